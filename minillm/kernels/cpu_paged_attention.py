"""PagedAttention decode on the CPU: the Triton kernel's algorithm, compiled ahead of the first call.

Two builds of it: C with 8-float vectors (csrc/paged_decode.c, one pass with online softmax; see
cpu_native.py), used whenever a C compiler is present, and the numba kernel below (two passes), used
otherwise and for shapes the C kernel does not take (head_dim not a multiple of 8).

Torch on a CPU can only attend over paged KV by gathering each sequence's blocks into a contiguous copy
first (index_select), then reading that copy back in a matmul: three passes over the KV bytes plus a
dozen op dispatches per sequence and layer. Decode is bandwidth-bound, so this kernel does what the GPU
kernel does instead: one task per (sequence, kv head) walks the block table and reads every K and V row
exactly once, in place.

Per task: scores for the group's G query heads against the L keys (K pass), a softmax per head, then the
weighted sum of V rows (V pass). numba compiles it to native code with a parallel loop over tasks.
"""
from __future__ import annotations

import numpy as np
import torch

from minillm import config
from minillm.kernels import cpu_native

try:
    # numba's own OpenMP/TBB layers would start a second thread runtime beside torch's; its work queue
    # is enough for one caller at a time (the model runner).
    config.prefer_numba_workqueue()
    import numba
    from numba import prange
except ImportError:  # optional: without it the torch reference path runs
    numba = None


def cpu_kernel_available() -> bool:
    return numba is not None or cpu_native.load() is not None


if numba is not None:
    @numba.njit(parallel=True, cache=True, fastmath={"reassoc", "contract", "nsz", "arcp"})
    def _paged_decode(q, rows, k_cache, v_cache, block_tables, seq_lens, block_size, scale, out):  # pragma: no cover
        # q, out: [T, H, D], sequence s reads and writes row rows[s]; k/v_cache: [KVH, num_slots, D];
        # block_tables: [S, max_blocks]. Rows are addressed in place: gathering and scattering them in torch
        # costs more than the kernel's own bookkeeping.
        num_seqs = rows.shape[0]
        num_heads, head_dim = q.shape[1], q.shape[2]
        num_kv_heads = k_cache.shape[0]
        group = num_heads // num_kv_heads
        for task in prange(num_seqs * num_kv_heads):
            s = task // num_kv_heads
            h = task % num_kv_heads
            r = rows[s]
            length = seq_lens[s]
            num_blocks = (length + block_size - 1) // block_size
            qg = q[r, h * group:(h + 1) * group] * scale                 # [G, D], scaled once
            scores = np.empty((group, length), dtype=np.float32)
            kh = k_cache[h]
            for b in range(num_blocks):                                  # K pass: walk the block table
                base = block_tables[s, b] * block_size
                t0 = b * block_size
                for j in range(min(block_size, length - t0)):
                    krow = kh[base + j]
                    for g in range(group):
                        qrow = qg[g]
                        dot = np.float32(0.0)
                        for d in range(head_dim):
                            dot += qrow[d] * krow[d]
                        scores[g, t0 + j] = dot
            for g in range(group):                                       # softmax per query head
                row = scores[g]
                row -= row.max()
                np.exp(row, row)
                row *= np.float32(1.0) / row.sum()
            vh = v_cache[h]
            for g in range(group):                                       # V pass, one head at a time so the
                acc = np.zeros(head_dim, dtype=np.float32)              # accumulator stays in registers
                srow = scores[g]
                for b in range(num_blocks):
                    base = block_tables[s, b] * block_size
                    t0 = b * block_size
                    for j in range(min(block_size, length - t0)):
                        p = srow[t0 + j]
                        vrow = vh[base + j]
                        for d in range(head_dim):
                            acc[d] += p * vrow[d]
                out[r, h * group + g] = acc


def paged_attention_decode_cpu(q: torch.Tensor, k_slots: torch.Tensor, v_slots: torch.Tensor,
                               block_tables: torch.Tensor, seq_lens: torch.Tensor, block_size: int,
                               scale: float, rows: torch.Tensor | None = None,
                               out: torch.Tensor | None = None, impl: str = "auto",
                               check: bool = True, k_scale: torch.Tensor | None = None,
                               v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """One query token per sequence. q: [S, H, D] fp32 (any row/head strides); k/v_slots: a layer's physical
    pool [KVH, slots, D]; block_tables: [S, max_blocks] int64; seq_lens: [S] (tokens to attend, >= 1).
    Returns [S, H, D].

    With rows ([S] int64), q and out are a whole step's [T, H, D] and sequence s owns row rows[s]: the kernel
    reads its query and writes its output there (the step's prefill rows are left alone).
    impl: "auto" (C when built, else numba), "c" or "numba". check=False skips the block-table bounds check
    (for callers that ran check_tables once for all layers of a step).

    An int8 pool (k/v_slots int8, kv/int8.py) comes with k_scale / v_scale, float16 [KVH, slots]; only the C build
    reads it. The numba build stays float32-only on purpose: it is the fallback for machines without a C compiler,
    an int8 variant would add a multi-second JIT compile to every such process, and there the engine's torch path
    (gather + dequantize) reads an int8 pool anyway (CpuAttentionBackend falls back to it)."""
    quantized = k_slots.dtype == torch.int8
    if q.dtype != torch.float32 or not (k_slots.dtype == torch.float32 or quantized) or v_slots.dtype != k_slots.dtype:
        raise TypeError(f"the CPU kernel runs in float32 over a float32 or int8 pool (got q {q.dtype}, "
                        f"kv {k_slots.dtype}/{v_slots.dtype})")
    if quantized and (k_scale is None or v_scale is None):
        raise ValueError("an int8 pool needs its k_scale and v_scale ([kv_heads, num_slots] float16)")
    if rows is None:
        rows = torch.arange(q.shape[0])
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype)
    if not (out.is_contiguous() and out.shape == q.shape and out.dtype == q.dtype):
        raise ValueError(f"out must be a contiguous {q.dtype} tensor shaped like q {tuple(q.shape)}")
    if check:
        check_tables(block_tables, seq_lens, block_size, k_slots.shape[1])
        if not (rows.shape[0] == seq_lens.shape[0] == block_tables.shape[0]):
            raise ValueError(f"rows, seq_lens and block_tables must have one entry per sequence (got "
                             f"{rows.shape[0]}, {seq_lens.shape[0]}, {block_tables.shape[0]})")
        if rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= q.shape[0]):
            raise ValueError(f"rows must index q's {q.shape[0]} rows (got {rows.tolist()})")
    use_c = impl != "numba" and cpu_native.supports(q, out, k_slots, v_slots, k_scale, v_scale)
    if (impl == "c" or quantized) and not use_c:
        raise RuntimeError("the C kernel is not built or does not take this shape (head_dim % 8 != 0, or an int8 "
                           "pool's scales are not contiguous float16 [kv_heads, num_slots]); an int8 pool has no "
                           "numba build: read it through the torch path")
    if use_c:
        cpu_native.paged_decode(q, rows, k_slots, v_slots, block_tables, seq_lens, block_size, scale, out,
                                k_scale, v_scale)
        return out
    if numba is None:
        raise RuntimeError("the CPU paged-attention kernel needs numba or a C compiler: pip install numba")
    numba.set_num_threads(max(1, min(torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS)))
    _paged_decode(q.contiguous().numpy(), rows.contiguous().numpy(), k_slots.numpy(), v_slots.numpy(),
                  block_tables.contiguous().numpy(), seq_lens.contiguous().numpy(), block_size, np.float32(scale),
                  out.numpy())
    return out


def check_tables(block_tables: torch.Tensor, seq_lens: torch.Tensor, block_size: int, num_slots: int) -> None:
    """Compiled kernels do not bounds-check: a table pointing outside the pool would read foreign memory."""
    if seq_lens.numel() == 0:
        return
    if int(seq_lens.min()) < 1 or int(seq_lens.max()) > block_tables.shape[1] * block_size:
        raise ValueError(f"seq_lens must be in 1..{block_tables.shape[1] * block_size} (block table width x "
                         f"block_size), got {seq_lens.tolist()}")
    if int(block_tables.min()) < 0 or int(block_tables.max()) >= num_slots // block_size:
        raise ValueError(f"block table entries must index the pool's {num_slots // block_size} blocks "
                         f"(got {int(block_tables.min())}..{int(block_tables.max())})")
