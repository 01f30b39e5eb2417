"""PagedAttention *decode* in Triton.

Problem
-------
During decode every sequence contributes exactly one new query token, but its keys and
values live in a paged KV cache: fixed-size physical blocks ``[num_blocks, block_size,
KVH, D]`` that a per-sequence *block table* maps logical block ``i`` -> physical block id.
The kernel computes, for every sequence ``s`` and query head ``h``::

    out[s, h] = softmax(scale * q[s, h] . K_s[:, h // group]^T) @ V_s[:, h // group]

where ``K_s``/``V_s`` are the first ``seq_lens[s]`` cached tokens of sequence ``s``
(gathered through ``block_tables[s]``) and ``group = H // KVH`` (GQA / MQA).

Algorithm
---------
* Grid = ``(S, KVH)``: one program per (sequence, KV head).  The program handles all
  ``group`` query heads that share this KV head, as a ``[GROUP_PAD, D_PAD]`` tile, so each
  K/V block is loaded once per KV head instead of once per query head.
* The program walks the sequence's logical blocks ``0 .. cdiv(seq_len, BLOCK_SIZE) - 1``,
  reads the physical block id from the block table and loads a ``[BLOCK_SIZE, D_PAD]``
  K tile and V tile.  Table entries beyond the sequence's length are never read.
* Online (flash) softmax in fp32: keep a running max ``m``, running denominator ``l`` and
  an un-normalised accumulator ``acc``; for each block with scores ``x``::

      m_new = max(m, max(x));  alpha = exp(m - m_new);  p = exp(x - m_new)
      l = l * alpha + sum(p);  acc = acc * alpha + p @ V;  m = m_new

  and finally ``out = acc / l``.
* Masks: tokens past ``seq_len`` in the ragged last block (scores set to ``-inf``, loads
  masked so garbage/NaN in the cache is never touched), padded head-dim lanes
  (``D_PAD = next_pow2(D)``, so D = 48 / 80 / 96 work) and padded group rows
  (``GROUP_PAD = next_pow2(group)``, e.g. group 3).
* The dot products are written as broadcast-multiply + ``tl.sum`` instead of ``tl.dot``:
  the tiles are tiny (``group`` rows; ``tl.dot`` wants >= 16 on every dim) and this form
  runs both in the CPU interpreter and compiled.

Running it
----------
* With a CUDA GPU: pass CUDA tensors; the kernel is JIT-compiled.
* Without a GPU: set ``TRITON_INTERPRET=1`` *before this module is imported* (the variable
  is read when ``@triton.jit`` decorates the kernel) and pass CPU tensors (fp32/fp16/bf16).
  The interpreter costs a few ms per (program x block) iteration.
* :func:`compile_for_gpu_target` ahead-of-time compiles the same kernel for an NVIDIA
  target (sm80, sm90, ...) without a GPU, which proves the code is valid compiled Triton
  and not something only the interpreter accepts.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from minillm import config

if TYPE_CHECKING:
    import torch

# torch is imported inside the functions that need it: the AOT-compile child process
# (see below) loads this file and should not pay ~3 s for `import torch`.

try:
    import triton
    import triton.language as tl

    _HAS_TRITON = True
except Exception:  # pragma: no cover - triton is an x86_64-only dependency
    triton = None
    tl = None
    _HAS_TRITON = False

__all__ = [
    "paged_attention_decode_triton",
    "triton_available",
    "compile_for_gpu_target",
    "aot_compile",
    "kernel_source",
    "KernelCompileError",
    "KERNEL_NAME",
    "INT8_KERNEL_NAME",
]

KERNEL_NAME = "paged_attention_decode_kernel"
INT8_KERNEL_NAME = "paged_attention_decode_int8_kernel"


def triton_available() -> bool:
    """True if triton imports and the kernel can actually run (CUDA, or TRITON_INTERPRET=1)."""
    if not _HAS_TRITON:
        return False
    if _INTERPRETED:
        return True
    import torch

    return torch.cuda.is_available()


if _HAS_TRITON:
    # tl.sum / tl.max are themselves @jit helpers around tl.reduce with these combine
    # functions.  Calling tl.reduce directly compiles to exactly the same code, but in
    # the interpreter it skips a nested jit-function call (which re-patches
    # triton.language every time) and hits the numpy fast path: ~2x faster there.
    _sum_combine = tl.standard._sum_combine
    _max_combine = tl.standard._elementwise_max

    # The plain Python function is kept so that an AOT compile can wrap it in a real
    # ``JITFunction`` even when TRITON_INTERPRET=1 made ``triton.jit`` return an
    # ``InterpretedFunction``.
    def paged_attention_decode_kernel(
        out_ptr,
        q_ptr,
        k_cache_ptr,
        v_cache_ptr,
        block_tables_ptr,
        seq_lens_ptr,
        scale,
        stride_qs,
        stride_qh,
        stride_kb,
        stride_kt,
        stride_kh,
        stride_vb,
        stride_vt,
        stride_vh,
        stride_bt,
        stride_os,
        stride_oh,
        GROUP: tl.constexpr,  # query heads per KV head
        GROUP_PAD: tl.constexpr,  # next_pow2(GROUP)
        HEAD_DIM: tl.constexpr,  # D
        D_PAD: tl.constexpr,  # next_pow2(D)
        BLOCK_SIZE: tl.constexpr,  # tokens per KV-cache block (power of two)
    ):
        seq = tl.program_id(0)
        kv_head = tl.program_id(1)

        seq_len = tl.load(seq_lens_ptr + seq)

        offs_g = tl.arange(0, GROUP_PAD)
        offs_d = tl.arange(0, D_PAD)
        offs_t = tl.arange(0, BLOCK_SIZE)
        g_mask = offs_g < GROUP
        d_mask = offs_d < HEAD_DIM
        gd_mask = g_mask[:, None] & d_mask[None, :]

        # Query rows of the `group` heads that share this KV head, pre-scaled, fp32.
        heads = kv_head * GROUP + offs_g
        q_ptrs = q_ptr + seq * stride_qs + heads[:, None] * stride_qh + offs_d[None, :]
        q = tl.load(q_ptrs, mask=gd_mask, other=0.0).to(tl.float32) * scale  # [G, D]

        m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)  # running max
        l_i = tl.zeros([GROUP_PAD], tl.float32)  # running softmax denominator
        acc = tl.zeros([GROUP_PAD, D_PAD], tl.float32)  # running sum of p * V

        num_blocks = tl.cdiv(seq_len, BLOCK_SIZE)
        bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
        # Loop-invariant parts of the K/V tile addresses ([T, D]); only the physical block
        # offset changes per iteration.
        tile_k = kv_head * stride_kh + offs_t[:, None] * stride_kt + offs_d[None, :]
        tile_v = kv_head * stride_vh + offs_t[:, None] * stride_vt + offs_d[None, :]
        q3 = q[:, None, :]  # [G, 1, D]
        for b in range(0, num_blocks):
            phys = tl.load(bt_row + b).to(tl.int64)  # physical block id
            t_mask = offs_t < seq_len - b * BLOCK_SIZE  # ragged last block
            td_mask = t_mask[:, None] & d_mask[None, :]

            k = tl.load(k_cache_ptr + phys * stride_kb + tile_k,
                        mask=td_mask, other=0.0).to(tl.float32)  # [T, D]
            s = tl.reduce(q3 * k[None, :, :], 2, _sum_combine)  # [G, T] = q . k
            s = tl.where(t_mask[None, :], s, float("-inf"))

            # The block holds >= 1 valid token, so m_new is finite; on the first block
            # m_i = -inf and alpha = exp(-inf) = 0.
            m_new = tl.maximum(m_i, tl.reduce(s, 1, _max_combine))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(s - m_new[:, None])  # [G, T], 0 on masked tokens
            l_i = l_i * alpha + tl.reduce(p, 1, _sum_combine)

            v = tl.load(v_cache_ptr + phys * stride_vb + tile_v,
                        mask=td_mask, other=0.0).to(tl.float32)  # [T, D]
            pv = tl.reduce(p[:, :, None] * v[None, :, :], 1, _sum_combine)  # [G, D] = p @ V
            acc = acc * alpha[:, None] + pv
            m_i = m_new

        l_safe = tl.where(l_i > 0.0, l_i, 1.0)  # seq_len == 0 -> output zeros, not NaN
        out = acc / l_safe[:, None]
        o_ptrs = out_ptr + seq * stride_os + heads[:, None] * stride_oh + offs_d[None, :]
        tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=gd_mask)

    # The same kernel over an int8 pool (kv/int8.py): K/V tiles load as int8 and each row is scaled by its float16
    # scale ([num_blocks, block_size, KVH], any strides) right after the load, so the softmax and the sums are the
    # float kernel's. A separate kernel, not a constexpr flag, so the float kernel keeps the signature a learner's
    # kernel (lab03) is compiled and checked against.
    def paged_attention_decode_int8_kernel(
        out_ptr,
        q_ptr,
        k_cache_ptr,
        v_cache_ptr,
        k_scale_ptr,
        v_scale_ptr,
        block_tables_ptr,
        seq_lens_ptr,
        scale,
        stride_qs,
        stride_qh,
        stride_kb,
        stride_kt,
        stride_kh,
        stride_vb,
        stride_vt,
        stride_vh,
        stride_ksb,
        stride_kst,
        stride_ksh,
        stride_vsb,
        stride_vst,
        stride_vsh,
        stride_bt,
        stride_os,
        stride_oh,
        GROUP: tl.constexpr,
        GROUP_PAD: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        D_PAD: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
    ):
        seq = tl.program_id(0)
        kv_head = tl.program_id(1)
        seq_len = tl.load(seq_lens_ptr + seq)

        offs_g = tl.arange(0, GROUP_PAD)
        offs_d = tl.arange(0, D_PAD)
        offs_t = tl.arange(0, BLOCK_SIZE)
        g_mask = offs_g < GROUP
        d_mask = offs_d < HEAD_DIM
        gd_mask = g_mask[:, None] & d_mask[None, :]

        heads = kv_head * GROUP + offs_g
        q_ptrs = q_ptr + seq * stride_qs + heads[:, None] * stride_qh + offs_d[None, :]
        q = tl.load(q_ptrs, mask=gd_mask, other=0.0).to(tl.float32) * scale  # [G, D]

        m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
        l_i = tl.zeros([GROUP_PAD], tl.float32)
        acc = tl.zeros([GROUP_PAD, D_PAD], tl.float32)

        num_blocks = tl.cdiv(seq_len, BLOCK_SIZE)
        bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
        tile_k = kv_head * stride_kh + offs_t[:, None] * stride_kt + offs_d[None, :]
        tile_v = kv_head * stride_vh + offs_t[:, None] * stride_vt + offs_d[None, :]
        row_ks = kv_head * stride_ksh + offs_t * stride_kst   # [T]: the block's row scales
        row_vs = kv_head * stride_vsh + offs_t * stride_vst
        q3 = q[:, None, :]
        for b in range(0, num_blocks):
            phys = tl.load(bt_row + b).to(tl.int64)
            t_mask = offs_t < seq_len - b * BLOCK_SIZE
            td_mask = t_mask[:, None] & d_mask[None, :]

            ks = tl.load(k_scale_ptr + phys * stride_ksb + row_ks, mask=t_mask, other=0.0).to(tl.float32)
            k = tl.load(k_cache_ptr + phys * stride_kb + tile_k,
                        mask=td_mask, other=0).to(tl.float32) * ks[:, None]  # [T, D] dequantized
            s = tl.reduce(q3 * k[None, :, :], 2, _sum_combine)
            s = tl.where(t_mask[None, :], s, float("-inf"))

            m_new = tl.maximum(m_i, tl.reduce(s, 1, _max_combine))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(s - m_new[:, None])
            l_i = l_i * alpha + tl.reduce(p, 1, _sum_combine)

            vs = tl.load(v_scale_ptr + phys * stride_vsb + row_vs, mask=t_mask, other=0.0).to(tl.float32)
            v = tl.load(v_cache_ptr + phys * stride_vb + tile_v,
                        mask=td_mask, other=0).to(tl.float32) * vs[:, None]
            pv = tl.reduce(p[:, :, None] * v[None, :, :], 1, _sum_combine)
            acc = acc * alpha[:, None] + pv
            m_i = m_new

        l_safe = tl.where(l_i > 0.0, l_i, 1.0)
        out = acc / l_safe[:, None]
        o_ptrs = out_ptr + seq * stride_os + heads[:, None] * stride_oh + offs_d[None, :]
        tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=gd_mask)

    _KERNEL_PY_FN = paged_attention_decode_kernel
    paged_attention_decode_kernel = triton.jit(_KERNEL_PY_FN)
    _INT8_KERNEL_PY_FN = paged_attention_decode_int8_kernel
    paged_attention_decode_int8_kernel = triton.jit(_INT8_KERNEL_PY_FN)
    # What `triton.jit` produced at import time decides how the kernel runs.
    _INTERPRETED = not isinstance(paged_attention_decode_kernel, triton.runtime.jit.JITFunction)
else:  # pragma: no cover
    _KERNEL_PY_FN = _INT8_KERNEL_PY_FN = None
    paged_attention_decode_kernel = paged_attention_decode_int8_kernel = None
    _INTERPRETED = False


def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def paged_attention_decode_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """PagedAttention decode.

    q: [S, H, D]; k_cache/v_cache: [num_blocks, block_size, KVH, D];
    block_tables: int [S, max_blocks_per_seq]; seq_lens: int [S] (>= 0, number of cached
    tokens including the current one). Returns [S, H, D] in q's dtype.
    An int8 pool (kv/int8.py): k_cache/v_cache int8 and k_scale/v_scale [num_blocks, block_size, KVH]
    (float16, any strides, e.g. KVCache.layer_scale_views).
    """
    import torch

    if not triton_available():
        raise RuntimeError(
            "Triton kernel cannot run: need triton plus a CUDA GPU, or TRITON_INTERPRET=1 "
            "set before importing minillm.kernels.triton_paged_attention"
        )
    S, H, D = q.shape
    num_blocks, block_size, KVH, Dk = k_cache.shape
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} != v_cache {tuple(v_cache.shape)}")
    if Dk != D:
        raise ValueError(f"head dim mismatch: q has {D}, cache has {Dk}")
    if H % KVH != 0:
        raise ValueError(f"num heads {H} not a multiple of num kv heads {KVH}")
    if block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two, got {block_size}")
    if block_tables.shape[0] != S or seq_lens.shape[0] != S:
        raise ValueError("block_tables / seq_lens must have one row per sequence")
    group = H // KVH
    quantized = k_cache.dtype == torch.int8
    if quantized != (k_scale is not None) or (k_scale is None) != (v_scale is None) or v_cache.dtype != k_cache.dtype:
        raise ValueError(f"an int8 K/V cache needs k_scale and v_scale, a float one neither (got k {k_cache.dtype}, "
                         f"v {v_cache.dtype}, k_scale {'set' if k_scale is not None else 'None'}, v_scale "
                         f"{'set' if v_scale is not None else 'None'})")
    if quantized and (k_scale.shape != k_cache.shape[:3] or v_scale.shape != k_cache.shape[:3]):
        raise ValueError(f"k_scale/v_scale must be [num_blocks, block_size, KVH] = {tuple(k_cache.shape[:3])}, got "
                         f"{tuple(k_scale.shape)} / {tuple(v_scale.shape)}")

    # The kernel assumes unit stride on the head dim and contiguous int32 metadata.
    q = q if q.stride(-1) == 1 else q.contiguous()
    k_cache = k_cache if k_cache.stride(-1) == 1 else k_cache.contiguous()
    v_cache = v_cache if v_cache.stride(-1) == 1 else v_cache.contiguous()
    block_tables = block_tables.to(torch.int32).contiguous()
    seq_lens = seq_lens.to(torch.int32).contiguous()
    out = torch.empty((S, H, D), dtype=q.dtype, device=q.device)
    if S == 0:
        return out

    grid = (S, KVH)
    if quantized:
        paged_attention_decode_int8_kernel[grid](
            out, q, k_cache, v_cache, k_scale, v_scale, block_tables, seq_lens,
            float(scale),
            q.stride(0), q.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
            k_scale.stride(0), k_scale.stride(1), k_scale.stride(2),
            v_scale.stride(0), v_scale.stride(1), v_scale.stride(2),
            block_tables.stride(0),
            out.stride(0), out.stride(1),
            GROUP=group, GROUP_PAD=next_pow2(group),
            HEAD_DIM=D, D_PAD=next_pow2(D),
            BLOCK_SIZE=block_size,
        )
        return out
    paged_attention_decode_kernel[grid](
        out, q, k_cache, v_cache, block_tables, seq_lens,
        float(scale),
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        GROUP=group, GROUP_PAD=next_pow2(group),
        HEAD_DIM=D, D_PAD=next_pow2(D),
        BLOCK_SIZE=block_size,
    )
    return out


# ---------------------------------------------------------------------------------------
# Ahead-of-time compilation (no GPU needed), of this kernel or any kernel with its signature
# ---------------------------------------------------------------------------------------
#
# triton.compile(ASTSource(fn=JITFunction, signature, constexprs, attrs), target=GPUTarget)
# is the path triton/tools/compile.py uses; it needs no driver and no GPU, and the nvidia
# backend runs the ptxas bundled in triton's wheel, so we get ttir/ttgir/llir/ptx/cubin.
#
# It cannot run in a process where TRITON_INTERPRET=1 was set when triton was imported:
# triton's own standard library (tl.cdiv, tl.max, ...) is then made of interpreter
# functions, and running an interpreted kernel leaves triton.language monkey-patched.
# Wrapping a raw function in a fresh JITFunction is not enough, so in that case the
# compile runs in a child process (this file loaded there with TRITON_INTERPRET unset),
# and a kernel defined elsewhere (a notebook) travels there as source (kernel_source).

_ELT = {"fp16": "fp16", "bf16": "bf16", "fp32": "fp32",
        "float16": "fp16", "bfloat16": "bf16", "float32": "fp32"}
_ASM_TEXT_KEYS = ("ttir", "ttgir", "llir", "ptx")


class KernelCompileError(RuntimeError):
    """The compile failed: `summary` is one line (with the offending source line when triton names it)."""

    def __init__(self, summary: str, detail: str = "") -> None:
        super().__init__(f"{summary}\n{detail}" if detail else summary)
        self.summary, self.detail = summary, detail


def _python_fn(kernel):
    """The plain Python function behind a kernel (JITFunction / InterpretedFunction have it as .fn)."""
    if kernel is None:
        return _KERNEL_PY_FN
    fn = getattr(kernel, "fn", kernel)
    if not callable(fn) or not hasattr(fn, "__code__"):
        raise TypeError(f"expected a @triton.jit kernel or its Python function, got {type(kernel).__name__}")
    return fn


def _compile_fn(fn, arch: int, dtype: str, head_dim: int, block_size: int, group: int, num_warps: int,
                kv_cache_dtype: str = "auto") -> dict:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction

    elt = _ELT[str(dtype).replace("torch.", "")]
    ptr = f"*{elt}"
    if kv_cache_dtype == "int8":          # minillm's int8 kernel: int8 K/V, fp16 row scales with their strides
        fn = _INT8_KERNEL_PY_FN if fn is _KERNEL_PY_FN else fn
        signature = {
            "out_ptr": ptr, "q_ptr": ptr, "k_cache_ptr": "*i8", "v_cache_ptr": "*i8",
            "k_scale_ptr": "*fp16", "v_scale_ptr": "*fp16", "block_tables_ptr": "*i32", "seq_lens_ptr": "*i32",
            "scale": "fp32",
            **{f"stride_{n}": "i32" for n in ("qs", "qh", "kb", "kt", "kh", "vb", "vt", "vh", "ksb", "kst", "ksh",
                                                "vsb", "vst", "vsh", "bt", "os", "oh")},
        }
    else:
        signature = {
            "out_ptr": ptr, "q_ptr": ptr, "k_cache_ptr": ptr, "v_cache_ptr": ptr,
            "block_tables_ptr": "*i32", "seq_lens_ptr": "*i32",
            "scale": "fp32",
            "stride_qs": "i32", "stride_qh": "i32",
            "stride_kb": "i32", "stride_kt": "i32", "stride_kh": "i32",
            "stride_vb": "i32", "stride_vt": "i32", "stride_vh": "i32",
            "stride_bt": "i32", "stride_os": "i32", "stride_oh": "i32",
        }
    jit = JITFunction(fn)
    constexprs = {
        "GROUP": group, "GROUP_PAD": next_pow2(group),
        "HEAD_DIM": head_dim, "D_PAD": next_pow2(head_dim),
        "BLOCK_SIZE": block_size,
    }
    for name in constexprs:
        signature[name] = "constexpr"
    if list(signature) != list(jit.arg_names):
        raise KernelCompileError(f"the kernel's parameters {jit.arg_names} differ from the PagedAttention signature "
                                 f"{list(signature)}")
    # The specialisation the runtime launcher makes for torch allocations: 16-byte aligned pointers.
    attrs = {(jit.arg_names.index(n),): [["tt.divisibility", 16]]
             for n in signature if n.endswith("_ptr")}
    src = ASTSource(fn=jit, signature=signature, constexprs=constexprs, attrs=attrs)
    compiled = triton.compile(src, target=GPUTarget("cuda", int(arch), 32),
                              options={"num_warps": num_warps})
    return dict(compiled.asm)


def _in_process_compile_ok() -> bool:
    return not _INTERPRETED and not triton.knobs.runtime.interpret


def aot_compile(
    arch,
    dtypes=("fp16", "bf16"),
    head_dim: int = 64,
    block_size: int = 16,
    group: int = 1,
    num_warps: int = 4,
    in_process: bool | None = None,
    kernel=None,
    kv_cache_dtypes: tuple[str, ...] | None = None,
) -> dict:
    """Compile a PagedAttention decode kernel for ``GPUTarget("cuda", arch, 32)`` (sm``arch``) without a GPU.

    ``kernel``: None for minillm's, or any kernel with its signature (a @triton.jit function, e.g. defined in a
    notebook, or the plain Python function). ``arch`` is an int (80, 90, ...) or a sequence of them; ``dtypes`` a
    str or sequence of ``"fp16"``/``"bf16"``/``"fp32"``. Returns ``{(arch, dtype): asm}`` where ``asm`` holds
    ``ttir``, ``ttgir``, ``llir``, ``ptx`` (str) and ``cubin`` (bytes, from the ``ptxas`` bundled in triton's
    wheel). ``in_process=None`` picks a child process when this process runs the interpreter (see above).
    ``kv_cache_dtypes``: e.g. ``("auto", "int8")`` also compiles minillm's int8-pool kernel (one child process for
    all); the keys are then ``(arch, dtype, kv_cache_dtype)``.
    Raises KernelCompileError when the kernel does not compile."""
    if not _HAS_TRITON:
        raise RuntimeError("triton is not installed")
    fn = _python_fn(kernel)
    archs = (arch,) if isinstance(arch, int) else tuple(arch)
    dtypes = (dtypes,) if isinstance(dtypes, str) else tuple(dtypes)
    kvs = ("auto",) if kv_cache_dtypes is None else tuple(kv_cache_dtypes)
    if set(kvs) - {"auto", "int8"} or (kernel is not None and "int8" in kvs):
        raise ValueError(f"kv_cache_dtypes takes 'auto' and 'int8' (int8: minillm's own kernel, kernel=None), "
                         f"got {kvs}")
    jobs = [dict(arch=int(a), dtype=str(d), head_dim=int(head_dim), block_size=int(block_size), group=int(group),
                 num_warps=int(num_warps), kv_cache_dtype=kv)
            for a in archs for d in dtypes for kv in kvs]
    keys = [(job["arch"], job["dtype"]) + (() if kv_cache_dtypes is None else (job["kv_cache_dtype"],))
            for job in jobs]
    if in_process is None:
        in_process = _in_process_compile_ok()
    if in_process:
        try:
            return {key: _compile_fn(fn, **job) for key, job in zip(keys, jobs)}
        except KernelCompileError:
            raise
        except Exception as e:  # noqa: BLE001 - triton's compile errors come in many types
            raise KernelCompileError(_summarize(str(e)), str(e)) from None
    source = None if fn is _KERNEL_PY_FN else kernel_source(fn)
    key = (source, fn.__name__, repr(jobs))
    if key not in _AOT_CACHE:          # the same kernel compiled twice (a checker, then a notebook cell): once
        _AOT_CACHE[key] = _aot_compile_subprocess(jobs, source, fn.__name__)
    return dict(zip(keys, _AOT_CACHE[key]))


_AOT_CACHE: dict = {}


def kernel_source(fn) -> str:
    """A module's worth of source for a kernel defined anywhere (a notebook cell): triton imports, the module
    constants and @jit helpers the kernel uses (recursively), then the kernel itself, decorators dropped."""
    import dis
    import inspect
    import textwrap
    import types

    import triton.language as tl

    parts, done = [], set()
    jit_types = tuple(t for t in (getattr(triton.runtime.jit, "JITFunction", None),
                                  getattr(getattr(triton.runtime, "interpreter", None), "InterpretedFunction", None))
                      if t is not None)

    def add(f, top: bool) -> None:
        if f.__name__ in done:
            return
        done.add(f.__name__)
        names = dict.fromkeys(i.argval for i in dis.get_instructions(f) if i.opname == "LOAD_GLOBAL")
        for name in names:
            if name in done or name not in f.__globals__:
                continue                            # a builtin, or already written
            obj = f.__globals__[name]
            if isinstance(obj, types.ModuleType):
                parts.append(f"import {obj.__name__} as {name}\n")
            elif isinstance(obj, jit_types) and obj.fn.__module__.split(".")[0] == "triton":
                parts.append(f"{name} = __import__('importlib').import_module({obj.fn.__module__!r})."
                             f"{obj.fn.__name__}\n")               # triton's own helpers, e.g. tl.standard
            elif isinstance(obj, jit_types):
                add(obj.fn, top=False)
                continue
            elif isinstance(obj, tl.constexpr):
                parts.append(f"{name} = tl.constexpr({obj.value!r})\n")
            elif isinstance(obj, bool | int | float):
                parts.append(f"{name} = {obj!r}\n")        # as on a GPU: Triton rejects non-constexpr globals
            else:
                raise ValueError(f"the kernel {fn.__name__} uses the global {name!r} (a {type(obj).__name__}): a "
                                 "kernel can use only triton modules, numbers, tl.constexpr constants and other "
                                 "@triton.jit functions")
            done.add(name)
        lines = textwrap.dedent(inspect.getsource(f)).splitlines()
        while lines and not lines[0].lstrip().startswith("def "):
            lines.pop(0)                 # drop decorators: the compiler wraps the kernel; helpers get a fresh @jit
        parts.append(("" if top else "@triton.jit\n") + "\n".join(lines) + "\n")

    add(fn, top=True)
    header = "import math\nimport triton\nimport triton.language as tl\nfrom triton.language import constexpr\n\n"
    return header + "\n\n".join(parts)


def _summarize(err: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.strip()]
    summary = lines[-1].strip() if lines else "unknown error"
    caret = next((i for i in range(len(lines) - 1, 0, -1) if lines[i].strip() == "^"), None)
    if caret is not None:                   # triton points at the offending line of the kernel
        summary += f" — in `{lines[caret - 1].strip()}`"
    return summary[:400]


def _aot_compile_subprocess(jobs: list, source: str | None, fn_name: str, timeout: float = 300) -> list:
    import base64
    import json
    import subprocess
    import sys
    import tempfile

    env = config.gpu_compile_env()
    with tempfile.TemporaryDirectory() as tmp:
        jobs_path = os.path.join(tmp, "jobs.json")
        out_path = os.path.join(tmp, "out.json")
        src_path = ""
        if source is not None:
            src_path = os.path.join(tmp, "user_kernel.py")
            with open(src_path, "w") as f:
                f.write(source)
        with open(jobs_path, "w") as f:
            json.dump(jobs, f)
        # Load this file under a private name (not via sys.path: the child's cwd is tmp).
        code = (
            "import importlib.util, sys\n"
            "spec = importlib.util.spec_from_file_location('_minillm_paged_attn_aot', sys.argv[1])\n"
            "mod = importlib.util.module_from_spec(spec)\n"
            "spec.loader.exec_module(mod)\n"
            "mod._aot_main(*sys.argv[2:])\n"
        )
        try:
            proc = subprocess.run(
                [sys.executable, "-c", code, os.path.abspath(__file__), jobs_path, out_path, src_path, fn_name],
                env=env, cwd=tmp, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            raise KernelCompileError(f"the compile took more than {timeout:.0f} s") from None
        if proc.returncode != 0:
            err = proc.stderr.strip()
            raise KernelCompileError(_summarize(err), err[-3000:])
        with open(out_path) as f:
            results = json.load(f)
    for asm in results:
        if "cubin" in asm:
            asm["cubin"] = base64.b64decode(asm["cubin"])
    return results


def _aot_main(jobs_path: str, out_path: str, src_path: str = "", fn_name: str = "") -> None:
    import base64
    import importlib.util
    import json

    fn = _KERNEL_PY_FN
    if src_path:
        spec = importlib.util.spec_from_file_location("_minillm_user_kernel", src_path)
        user = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(user)
        fn = getattr(user, fn_name)
    with open(jobs_path) as f:
        jobs = json.load(f)
    results = []
    for job in jobs:
        asm = _compile_fn(fn, **job)
        out = {k: asm[k] for k in _ASM_TEXT_KEYS if k in asm}
        if "cubin" in asm:
            out["cubin"] = base64.b64encode(asm["cubin"]).decode("ascii")
        results.append(out)
    with open(out_path, "w") as f:
        json.dump(results, f)


def compile_for_gpu_target(arch: int, dtype: str = "fp16", head_dim: int = 64,
                           block_size: int = 16, group: int = 1, kernel=None) -> str:
    """AOT-compile a kernel (minillm's by default) for sm``arch`` (80, 90, ...) without a GPU; return the PTX.

    ``dtype``: ``"fp16"``, ``"bf16"`` or ``"fp32"``. The cubin is built as well (use :func:`aot_compile` to get
    it); the PTX is returned because it is readable: it holds ``.entry <kernel name>`` and ``.target sm_80``."""
    asm = aot_compile(int(arch), dtypes=(dtype,), head_dim=head_dim, block_size=block_size,
                      group=group, kernel=kernel)
    return asm[(int(arch), dtype)]["ptx"]
