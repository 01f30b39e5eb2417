"""Call the C quantized linear kernel (csrc/qgemm.c), built on first use like the attention kernel.

`qlinear(x, qw)` is the one entry point the layers use. On CPU with the kernel built: up to DEQUANT_MIN_ROWS - 1
activation rows (decode) the integer kernel on the packed weights; from there on (prefill, big batches) W expanded
to float by a C loop, then the float GEMM. Otherwise (no compiler, CUDA tensors, MINILLM_QGEMM=torch) the
reference: dequantize, then a float matmul. The kernel differs from the reference by its dynamic int16 activations
(per block of 32): tests/test_quant.py states the tolerance.
MINILLM_QGEMM=scalar builds the kernel without SIMD (the portable loop, for tests and A/B runs).
"""
from __future__ import annotations

import ctypes
import functools
import os
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

from minillm.kernels import cpu_native
from minillm.quant.formats import QuantizedWeight

SOURCE = Path(__file__).with_name("csrc") / "qgemm.c"
KIND = {"int8": 0, "int4": 1}
_P, _I = ctypes.c_void_p, ctypes.c_int64
_ARGTYPES = [ctypes.c_int, _P, _I, _I, _I, _P, _P, _P, _I, _I, _P, _I, ctypes.c_int]


def mode() -> str:
    """MINILLM_QGEMM: c (default) | scalar (the kernel built without SIMD) | torch (the reference only)."""
    m = os.environ.get("MINILLM_QGEMM", "c").lower()
    if m not in ("c", "scalar", "torch"):
        raise ValueError(f"MINILLM_QGEMM={m!r}: use c, scalar or torch")
    return m


@functools.cache
def load(variant: str = "c") -> ctypes.CDLL | None:
    """The compiled kernel (`variant` c or scalar), or None when it cannot be built (the reference runs)."""
    extra = ("-DMINILLM_QGEMM_SCALAR",) if variant == "scalar" else ()
    try:
        lib = ctypes.CDLL(str(cpu_native.build(source=SOURCE, extra_flags=extra)))
    except (RuntimeError, OSError) as e:
        warnings.warn(f"C quantized-matmul kernel unavailable, dequantizing to float instead: {e}", RuntimeWarning)
        return None
    lib.minillm_qgemm.argtypes = _ARGTYPES
    lib.minillm_qgemm.restype = ctypes.c_int
    lib.minillm_qgemm_simd.restype = ctypes.c_int
    lib.minillm_dequant.argtypes = [ctypes.c_int, _P, _P, _P, _I, _I, _I, _P, ctypes.c_int]
    lib.minillm_dequant.restype = None
    return lib


def _kernel() -> ctypes.CDLL | None:
    m = mode()
    return None if m == "torch" else load(m)


def reference(x: torch.Tensor, qw: QuantizedWeight) -> torch.Tensor:
    """Exact weight-only semantics: dequantize W, then x W^T in x's dtype."""
    return F.linear(x, qw.dequantize(x.dtype))


# From this many activation rows on, expanding W to float once and calling the float GEMM (oneDNN/MKL) is faster
# than the integer dot products, which redo the widening of every weight for each group of four rows (timed on
# SmolLM2's layer shapes, 1 thread, AVX2, 2026-11-25: the kernel wins up to ~8-16 rows, the float GEMM from ~32).
DEQUANT_MIN_ROWS = 16


def dequantize(qw: QuantizedWeight) -> torch.Tensor:
    """The float32 matrix, by the C loop when it is built (the torch version unpacks through several temporaries)."""
    lib = _kernel()
    if lib is None or qw.qweight.device.type != "cpu":
        return qw.dequantize()
    n, k = qw.shape
    out = torch.empty(n, k, dtype=torch.float32)
    mins = qw.mins.data_ptr() if qw.mins is not None else None
    lib.minillm_dequant(KIND[qw.kind], qw.qweight.data_ptr(), qw.scales.data_ptr(), mins, n, k, qw.group_size,
                        out.data_ptr(), torch.get_num_threads())
    return out


def qlinear(x: torch.Tensor, qw: QuantizedWeight) -> torch.Tensor:
    """x [..., K] (float32/bf16/fp16) times the quantized [N, K] matrix -> [..., N] in x's dtype."""
    lib = _kernel() if x.device.type == "cpu" else None
    if lib is None:
        return reference(x, qw)
    n, k = qw.shape
    if x.shape[-1] != k:
        raise ValueError(f"input has {x.shape[-1]} features, the quantized weight expects {k}")
    if x.numel() // k >= DEQUANT_MIN_ROWS:
        return F.linear(x, dequantize(qw).to(x.dtype))
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    if x2.dtype != torch.float32 or x2.stride(-1) != 1:
        x2 = x2.float().contiguous()
    m = x2.shape[0]
    y = torch.empty(m, n, dtype=torch.float32)
    if m:
        mins = qw.mins.data_ptr() if qw.mins is not None else None
        rc = lib.minillm_qgemm(KIND[qw.kind], x2.data_ptr(), m, k, x2.stride(0), qw.qweight.data_ptr(),
                               qw.scales.data_ptr(), mins, n, qw.group_size, y.data_ptr(), n,
                               torch.get_num_threads())
        if rc != 0:
            raise MemoryError("the quantized matmul could not allocate its activation buffer")
    y = y.view(*lead, n)
    return y if x.dtype == torch.float32 else y.to(x.dtype)
