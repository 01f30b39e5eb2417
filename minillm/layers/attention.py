"""Attention over a paged KV cache, behind one interface.

The model hands each layer's q, k, v (flat over the T tokens of the batch) to a backend together with an
AttentionMetadata that says which sequence every token belongs to and where its K/V goes (slot_mapping).
Backends write K/V into the pool, then attend: prefill chunks one sequence at a time (causal, with
whatever context is already cached), decode tokens all at once.
"""
from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn.functional as F

from minillm.kernels import cpu_native
from minillm.kernels.cpu_paged_attention import check_tables, cpu_kernel_available, paged_attention_decode_cpu
from minillm.kv.cache import KVCache
from minillm.kv.int8 import dequantize_rows
from minillm.kv.metadata import DECODE_GROUP_SIZE, AttentionMetadata, DecodeGroup, decode_groups  # noqa: F401


class Workspace:
    """A reusable scratch buffer: large fresh allocations on CPU page-fault on first touch (~4x a gather's cost)."""

    def __init__(self) -> None:
        self.buf: torch.Tensor | None = None

    def get(self, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
        n = math.prod(shape)
        if self.buf is None or self.buf.numel() < n or self.buf.dtype != like.dtype or self.buf.device != like.device:
            self.buf = torch.empty(n, dtype=like.dtype, device=like.device)
        return self.buf[:n].view(shape)


def paged_decode_attend(q: torch.Tensor, k_slots: torch.Tensor, v_slots: torch.Tensor, group: DecodeGroup,
                        scale: float, k_ws: Workspace | None = None, v_ws: Workspace | None = None,
                        scales: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """q: [S, H, D] (one token per sequence); k/v_slots: [KVH, num_slots, D]. Returns [S, H, D].
    scales: an int8 pool's (k_scale, v_scale) [KVH, num_slots]; the gathered rows are dequantized to q's dtype."""
    s, h, d = q.shape
    kvh, n = k_slots.shape[0], group.slots.numel()
    if scales is not None:
        k = dequantize_rows(torch.index_select(k_slots, 1, group.slots), torch.index_select(scales[0], 1, group.slots),
                            q.dtype).view(kvh, s, group.max_len, d)
        v = dequantize_rows(torch.index_select(v_slots, 1, group.slots), torch.index_select(scales[1], 1, group.slots),
                            q.dtype).view(kvh, s, group.max_len, d)
    else:
        k_out = k_ws.get((kvh, n, d), k_slots) if k_ws else None
        v_out = v_ws.get((kvh, n, d), v_slots) if v_ws else None
        k = torch.index_select(k_slots, 1, group.slots, out=k_out).view(kvh, s, group.max_len, d)
        v = torch.index_select(v_slots, 1, group.slots, out=v_out).view(kvh, s, group.max_len, d)
    qh = q.view(s, kvh, h // kvh, d).transpose(0, 1)                   # [KVH, S, G, D]
    scores = torch.matmul(qh, k.transpose(-1, -2))                       # [KVH, S, G, Lmax]
    scores = (scores.float() * scale).add_(group.bias.view(1, s, 1, -1))
    probs = scores.softmax(-1).to(v.dtype)
    return torch.matmul(probs, v).transpose(0, 1).reshape(s, h, d)


AttendFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]


def causal_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Attention of the last n positions of a sequence over all L of its keys.

    q: [n, H, D]; k, v: [L, KVH, D] with L >= n (the first L-n are cached context). Returns [n, H, D].
    GQA/MQA: head h reads kv head h // (H // KVH)."""
    n, L = q.shape[0], k.shape[0]
    qh, kh, vh = q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None]
    if n == L:
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale, enable_gqa=True)
    else:
        # Query i sits at absolute position L-n+i and may see keys 0..L-n+i.
        mask = torch.arange(L, device=q.device)[None, :] <= (L - n + torch.arange(n, device=q.device))[:, None]
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1)


def gqa_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """Like causal_attend, with K/V head-major: q [n, H, D]; k, v [KVH, L, D]. Returns [n, H, D] (into out if given)."""
    n, h, d = q.shape
    kvh, L = k.shape[0], k.shape[1]
    if n > 1:  # prefill chunk: torch's fused (flash) attention, which takes this layout as is
        qh = q.transpose(0, 1)[None]
        if n == L:
            o = F.scaled_dot_product_attention(qh, k[None], v[None], is_causal=True, scale=scale, enable_gqa=True)
        else:
            mask = torch.arange(L, device=q.device)[None, :] <= (L - n + torch.arange(n, device=q.device))[:, None]
            o = F.scaled_dot_product_attention(qh, k[None], v[None], attn_mask=mask, scale=scale, enable_gqa=True)
        o = o[0].transpose(0, 1)
        if out is None:
            return o
        out.copy_(o)
        return out
    # decode: the group's queries share one kv head, so GQA needs no repeated K/V: [KVH, G, D] @ [KVH, D, L]
    g = h // kvh
    scores = torch.matmul(q.view(kvh, g, d), k.transpose(1, 2))
    if scale != 1.0:
        scores.mul_(scale)
    probs = scores.softmax(-1) if scores.dtype == torch.float32 else scores.softmax(-1, dtype=torch.float32).to(v.dtype)
    if out is None:
        return torch.matmul(probs, v).view(1, h, d)
    torch.matmul(probs, v, out=out.view(kvh, g, d))
    return out


class TorchAttentionBackend:
    """Reference backend in plain torch: gathers each sequence's K/V through its block table.

    One sequence at a time, so there is no padding to the longest sequence (on CPU the gather is the cost).
    `attend_fn` lets a lab swap in the learner's attention with causal_attend's signature."""

    name = "torch"

    def __init__(self, attend_fn: AttendFn | None = None, decode_group_size: int = DECODE_GROUP_SIZE) -> None:
        self.attend_fn = attend_fn
        self.decode_group_size = decode_group_size
        self._k_ws, self._v_ws = Workspace(), Workspace()

    @staticmethod
    def write_kv(k: torch.Tensor, v: torch.Tensor, k_slots: torch.Tensor, v_slots: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
        k_slots.index_copy_(1, slot_mapping, k.transpose(0, 1))
        v_slots.index_copy_(1, slot_mapping, v.transpose(0, 1))

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: AttentionMetadata, cache: KVCache, scale: float) -> torch.Tensor:
        k_slots, v_slots = cache.layer_slots(layer)
        if cache.quantized:
            cache.write(layer, k, v, meta.slot_mapping)
        else:
            self.write_kv(k, v, k_slots, v_slots, meta.slot_mapping)
        out = torch.empty_like(q)
        decode_rows = self._decode(q, out, meta, cache, layer, scale)
        for i in range(meta.num_seqs):
            a, b = meta.query_start[i], meta.query_start[i + 1]
            if a in decode_rows:
                continue
            if cache.quantized:
                # An int8 pool is read back dequantized even by a fresh prefill (as vLLM's paged backends read a
                # quantized cache): every position then sees the same K/V whether its keys came from this chunk,
                # an earlier one or a prefix-cache hit, and `bench quality` measures what decode will see.
                ki, vi = cache.gather(layer, meta.context_slots(i), q.dtype)
            elif meta.seq_lens[i] == b - a:  # nothing cached before this chunk: use the fresh K/V directly
                ki, vi = k[a:b].transpose(0, 1), v[a:b].transpose(0, 1)
            else:
                slots = meta.context_slots(i)
                # index_select: ~3x faster than advanced indexing for this gather on CPU
                ki, vi = torch.index_select(k_slots, 1, slots), torch.index_select(v_slots, 1, slots)
            if self.attend_fn is not None:
                out[a:b] = self.attend_fn(q[a:b], ki.transpose(0, 1), vi.transpose(0, 1), scale)
            else:
                gqa_attend(q[a:b] * scale, ki, vi, 1.0, out=out[a:b])
        return out

    def _decode(self, q, out, meta, cache, layer, scale) -> set[int]:
        """Fill out[] for the step's decode rows, a few sequences at a time, and return those rows (the
        per-sequence loop skips them). A learner's attend_fn sees every sequence itself: nothing is grouped."""
        groups = [] if self.attend_fn is not None else meta.decode_groups(self.decode_group_size)
        if not groups:
            return set()
        k_slots, v_slots = cache.layer_slots(layer)
        scales = cache.layer_scales(layer) if cache.quantized else None
        for g in groups:
            out[g.rows] = paged_decode_attend(q[g.rows], k_slots, v_slots, g, scale, self._k_ws, self._v_ws, scales)
        return {meta.query_start[i] for g in groups for i in g.seq_idx}


class TritonAttentionBackend(TorchAttentionBackend):
    """Decode through the Triton PagedAttention kernel; prefill chunks through the torch path."""

    name = "triton"

    def __init__(self, decode_fn: Callable | None = None) -> None:
        """decode_fn: anything with paged_attention_decode_triton's signature (e.g. a learner's kernel wrapper)."""
        super().__init__()
        self.decode_fn = decode_fn

    def _decode(self, q, out, meta, cache, layer, scale) -> set[int]:
        from minillm.kernels.triton_paged_attention import paged_attention_decode_triton
        decode = self.decode_fn or paged_attention_decode_triton
        rows, tables, lens = meta.decode_rows()
        if not rows:
            return set()
        # every row a decode row (a decode step, a CUDA graph's): the built-in kernel takes q (strided) and fills out
        # as they are, with no index built on the host
        every = self.decode_fn is None and len(rows) == q.shape[0]
        k_cache, v_cache = cache.layer(layer)
        args = (q if every else q[rows], k_cache, v_cache, tables.to(torch.int32), lens.to(torch.int32), scale)
        if cache.quantized:
            if self.decode_fn is not None:
                raise ValueError("this decode_fn reads a float KV pool; the engine's pool is int8: use "
                                 "kv_cache_dtype='auto', or the built-in kernel (decode_fn=None)")
            k_scale, v_scale = cache.layer_scale_views(layer)
            result = decode(*args, k_scale=k_scale, v_scale=v_scale)
        else:
            result = decode(*args)
        if every:
            out.copy_(result)
        else:
            out[rows] = result
        return set(rows)


# Prefill chunks go through the paged kernel too, a query row per token, each reading its context from the pool;
# the kernel attends a chunk's rows in pieces of up to ten (SmolLM2's 3 query heads per kv head), each chunk of keys
# read once for the piece (csrc/paged_decode.c). Whole prefill steps against torch's flash attention over the
# gathered context (SmolLM2, 2 threads, interleaved): fresh prompts of 300 / 768 / 1,536 tokens 0.92x / 0.94x /
# 0.93x the time; 2,032 / 32 / 256 / 512 / 1,024 / 2,048 new tokens after 16 / 4,096 / 1,024 / 1,536 / 2,048 / 2,048
# cached 0.74x / 0.72x / 0.90x / 0.91x / 0.93x / 0.82x. An int8 pool's kernel still attends a task per row (every row
# rereads the keys before it), so there only the chunks within these limits take it: at most
# PAGED_PREFILL_MAX_ROWS tokens, or a sequence (context and chunk) of at most PAGED_PREFILL_MAX_LEN; with a task
# per row, 256 new tokens after 1,024 cached took 1.22x torch's time in the backend's attention.
PAGED_PREFILL_MAX_ROWS = 64
PAGED_PREFILL_MAX_LEN = 512


class CpuAttentionBackend(TorchAttentionBackend):
    """Decode and prefill through the compiled CPU PagedAttention kernel (C, or numba for decode only; over an int8
    pool, prefill chunks within PAGED_PREFILL_MAX_ROWS / PAGED_PREFILL_MAX_LEN), other chunks through the torch path.

    The kernel reads K/V in place through the block tables, like the Triton kernel on a GPU; torch can only
    gather a copy first. Falls back to the torch groups where the kernel does not apply (bf16 queries, a bf16 pool,
    an int8 pool without the C build: the numba build reads float32 pools only)."""

    name = "cpu"

    @property
    def kernel(self) -> str:
        """Which build decodes (for shapes it takes): 'c' (csrc/paged_decode.c) or 'numba'."""
        return "c" if cpu_native.load() is not None else "numba"

    def _decode(self, q, out, meta, cache, layer, scale) -> set[int]:
        if q.dtype != torch.float32 or q.device.type != "cpu":
            return super()._decode(q, out, meta, cache, layer, scale)
        k_slots, v_slots = cache.layer_slots(layer)
        scales = cache.layer_scales(layer) if cache.quantized else (None, None)
        if cache.quantized:
            if not cpu_native.supports(q, out, k_slots, v_slots, *scales):
                return super()._decode(q, out, meta, cache, layer, scale)
        elif cache.k.dtype != torch.float32:
            return super()._decode(q, out, meta, cache, layer, scale)
        # a learner's attend_fn (the lab01 seam) still sees every prefill chunk; so does the numba build, which is
        # slower than torch's flash attention on many rows
        if self.attend_fn is not None or cpu_native.load() is None:
            starts, rows, tables, lens = meta.token_rows(1)
        elif cache.quantized:
            starts, rows, tables, lens = meta.token_rows(PAGED_PREFILL_MAX_ROWS, PAGED_PREFILL_MAX_LEN)
        else:
            starts, rows, tables, lens = meta.token_rows(max(meta.query_lens))
        if not starts:
            return set()
        # every layer of the step reads the same tables: bounds-check them once
        meta.memo("tables_checked", lambda: check_tables(tables, lens, meta.block_size, k_slots.shape[1]) or True)
        paged_attention_decode_cpu(q, k_slots, v_slots, tables, lens, meta.block_size, scale,
                                   rows=rows, out=out, check=False, k_scale=scales[0], v_scale=scales[1])
        return set(starts)


def get_attention_backend(name: str = "auto", device: str | torch.device = "cpu", block_size: int | None = None):
    """'auto' = the Triton kernel on CUDA (the torch reference for a block_size that is not a power of two, which the
    kernel cannot split); on CPU the compiled CPU kernel (C built on first use, or numba), else the torch reference
    (Triton's interpreter is far too slow to serve)."""
    if name == "auto":
        if torch.device(device).type == "cuda":
            name = "triton" if block_size is None or block_size & (block_size - 1) == 0 else "torch"
        else:
            name = "cpu" if cpu_kernel_available() else "torch"
    if name == "torch":
        return TorchAttentionBackend()
    if name == "cpu":
        return CpuAttentionBackend()
    if name == "triton":
        from minillm.kernels.triton_paged_attention import triton_available
        if not triton_available():      # refused here, not at the first decode step with requests in flight
            raise ValueError("the triton attention backend needs triton and a CUDA GPU (or TRITON_INTERPRET=1 set "
                             "before minillm is imported, for tests): use attention_backend 'auto', 'cpu' or 'torch'")
        return TritonAttentionBackend()
    raise ValueError(f"unknown attention backend {name!r}: use 'torch', 'cpu', 'triton' or 'auto'")
