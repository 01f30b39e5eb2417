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

import base64
import os
from typing import TYPE_CHECKING

from minillm.kernels.triton_launch import (HAS_TRITON, KernelCompileError, compile_for_target, compile_in_child,
                                           in_process_compile_ok, kernel_device, launch, next_pow2, pointer_type)

if TYPE_CHECKING:
    import torch

# torch is imported inside the functions that need it: the AOT-compile child process
# (see below) loads this file and should not pay ~3 s for `import torch`.

if HAS_TRITON:
    import triton
    import triton.language as tl

__all__ = [
    "paged_attention_decode_triton",
    "triton_available",
    "compile_for_gpu_target",
    "aot_compile",
    "kernel_source",
    "KernelCompileError",
    "KERNEL_NAME",
    "INT8_KERNEL_NAME",
    "next_pow2",
]

KERNEL_NAME = "paged_attention_decode_kernel"
INT8_KERNEL_NAME = "paged_attention_decode_int8_kernel"


def triton_available() -> bool:
    """True if triton imports and the kernel can actually run (CUDA, or TRITON_INTERPRET=1)."""
    return kernel_device(paged_attention_decode_kernel) is not None


if HAS_TRITON:
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
else:  # pragma: no cover
    _KERNEL_PY_FN = _INT8_KERNEL_PY_FN = None
    paged_attention_decode_kernel = paged_attention_decode_int8_kernel = None


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
    launch_decode(paged_attention_decode_int8_kernel if quantized else paged_attention_decode_kernel,
                  out, q, k_cache, v_cache, block_tables, seq_lens, scale, k_scale, v_scale)
    return out


def launch_decode(kernel, out, q, k_cache, v_cache, block_tables, seq_lens, scale, k_scale=None, v_scale=None):
    """One launch of a paged decode kernel with this module's signature (the int8 one's with k_scale/v_scale):
    grid (S, KVH), strides in elements, the head dim's stride 1, block_tables/seq_lens contiguous int32."""
    scales = () if k_scale is None else (k_scale, v_scale)
    scale_strides = () if k_scale is None else (*k_scale.stride(), *v_scale.stride())
    S, H, D = q.shape
    KVH = k_cache.shape[2]
    launch(kernel, (S, KVH),
           out, q, k_cache, v_cache, *scales, block_tables, seq_lens, float(scale),
           q.stride(0), q.stride(1),
           k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
           v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
           *scale_strides,
           block_tables.stride(0),
           out.stride(0), out.stride(1),
           GROUP=H // KVH, GROUP_PAD=next_pow2(H // KVH), HEAD_DIM=D, D_PAD=next_pow2(D),
           BLOCK_SIZE=k_cache.shape[1])


# ---------------------------------------------------------------------------------------
# Ahead-of-time compilation (no GPU needed), of this kernel or any kernel with its signature
# ---------------------------------------------------------------------------------------
#
# triton_launch.py says how (and why a child process when this process interprets its kernels); a kernel defined
# elsewhere (a notebook) travels to that child as source (kernel_source).

_ASM_TEXT_KEYS = ("ttir", "ttgir", "llir", "ptx")


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
    import inspect

    ptr = pointer_type(dtype)
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
    constexprs = {
        "GROUP": group, "GROUP_PAD": next_pow2(group),
        "HEAD_DIM": head_dim, "D_PAD": next_pow2(head_dim),
        "BLOCK_SIZE": block_size,
    }
    params = list(inspect.signature(fn).parameters)
    if [*signature, *constexprs] != params:
        raise KernelCompileError(f"the kernel's parameters {params} differ from the PagedAttention signature "
                                 f"{[*signature, *constexprs]}")
    return compile_for_target(fn, signature, constexprs, arch, num_warps)


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
    if not HAS_TRITON:
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
        in_process = in_process_compile_ok(paged_attention_decode_kernel)
    if in_process:
        try:
            return {key: _compile_fn(fn, **job) for key, job in zip(keys, jobs)}
        except KernelCompileError:
            raise
        except Exception as e:  # noqa: BLE001 - triton's compile errors come in many types
            raise KernelCompileError.from_log(str(e)) from None
    source = None if fn is _KERNEL_PY_FN else kernel_source(fn)
    key = (source, fn.__name__, repr(jobs))
    if key not in _AOT_CACHE:          # the same kernel compiled twice (a checker, then a notebook cell): once
        results = compile_in_child(__file__, "_aot_main", {"jobs": jobs, "source": source, "fn_name": fn.__name__})
        for asm in results:
            if "cubin" in asm:
                asm["cubin"] = base64.b64decode(asm["cubin"])
        _AOT_CACHE[key] = results
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


def _aot_main(payload: dict) -> list:
    """The child process's side of aot_compile: its cwd is a temporary directory, where a kernel's source becomes a
    file (triton reads a kernel's source through `inspect`)."""
    import importlib.util

    fn = _KERNEL_PY_FN
    if payload["source"] is not None:
        with open("user_kernel.py", "w") as f:
            f.write(payload["source"])
        spec = importlib.util.spec_from_file_location("_minillm_user_kernel", os.path.abspath("user_kernel.py"))
        user = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(user)
        fn = getattr(user, payload["fn_name"])
    results = []
    for job in payload["jobs"]:
        asm = _compile_fn(fn, **job)
        out = {k: asm[k] for k in _ASM_TEXT_KEYS if k in asm}
        if "cubin" in asm:
            out["cubin"] = base64.b64encode(asm["cubin"]).decode("ascii")
        results.append(out)
    return results


def compile_for_gpu_target(arch: int, dtype: str = "fp16", head_dim: int = 64,
                           block_size: int = 16, group: int = 1, kernel=None) -> str:
    """AOT-compile a kernel (minillm's by default) for sm``arch`` (80, 90, ...) without a GPU; return the PTX.

    ``dtype``: ``"fp16"``, ``"bf16"`` or ``"fp32"``. The cubin is built as well (use :func:`aot_compile` to get
    it); the PTX is returned because it is readable: it holds ``.entry <kernel name>`` and ``.target sm_80``."""
    asm = aot_compile(int(arch), dtypes=(dtype,), head_dim=head_dim, block_size=block_size,
                      group=group, kernel=kernel)
    return asm[(int(arch), dtype)]["ptx"]
