"""Call the C quantized linear kernel (csrc/qgemm.c), built on first use like the attention kernel.

`qlinear(x, qw)` is the one entry point the layers use.
- W8A8 weights (`qw.act == "int8"`): always cpu_w8a8.w8a8_linear (per-token int8 activations at every batch size).
- Weight-only int8/int4 on CPU with the kernel built: up to BATCHED_MIN_ROWS - 1 activation rows (decode) the
  integer kernel on the packed weights; from there on (prefill, batched decode) the BATCHED_PATH (see the table at
  the constant): by default a W8A8 copy of the weight, requantized to int8 per channel on the first such call.
- Otherwise (no compiler, CUDA tensors, MINILLM_QGEMM=torch) the reference: dequantize, then a float matmul.
The kernel differs from the reference by its dynamic int16 activations (per block of 32), the W8A8 batched path by
its per-channel int8 weights and 7-bit per-token activations: tests/test_quant.py and tests/test_w8a8.py state the
tolerances. MINILLM_QGEMM=scalar builds the kernel without SIMD (the portable loop, for tests and A/B runs);
MINILLM_QGEMM_BATCHED=w8a8|float|dequant overrides BATCHED_PATH (A/B runs, tools/measure_qgemm.py).
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
from minillm.kernels import cpu_w8a8
from minillm.kernels.cpu_w8a8 import cached, w8a8_linear
from minillm.quant.formats import QuantizedWeight, QuantSpec, quantize

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


# Weight-only layers with at least BATCHED_MIN_ROWS activation rows run BATCHED_PATH instead of the C kernel:
#   w8a8     the weight requantized once to int8 per output channel and run as W8A8 (FBGEMM, cpu_w8a8.py): the
#            fastest here from 16 rows on; the math changes a little (7-bit per-token activations, int8 weights)
#   float    a float32 copy made once, then the float GEMM (exact weight-only math; 4 bytes per weight)
#   dequant  W expanded to float32 on every call, then the float GEMM (exact; no memory; what ran until 2026-11-26)
# tools/measure_qgemm.py prints the table below (µs per call, SmolLM2 shapes, int4 g32 weights, 1 thread, AVX2,
# 2026-11-26, shared machine: read ratios). C = the integer kernel (csrc/qgemm.c), fp32 = a float weight's GEMM.
#
#   shape        path      1     4     8    16    32    64   128   256 rows
#   TABLE_PLACEHOLDER
#
# The C kernel's cost grows ~linearly with rows (it re-expands the weights for every 4 rows) and W8A8 is nearly
# flat up to ~16 rows, so the crossover sits at BATCHED_MIN_ROWS. Re-measure when csrc/qgemm.c changes.
BATCHED_MIN_ROWS = 16
BATCHED_PATHS = ("w8a8", "fp16", "float", "dequant")
BATCHED_PATH = "w8a8"


def batched_path() -> str:
    """MINILLM_QGEMM_BATCHED when set, else BATCHED_PATH."""
    p = os.environ.get("MINILLM_QGEMM_BATCHED", BATCHED_PATH).lower()
    if p not in BATCHED_PATHS:
        raise ValueError(f"MINILLM_QGEMM_BATCHED={p!r}: use one of {', '.join(BATCHED_PATHS)}")
    return p


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
    if qw.act is not None:
        return w8a8_linear(x, qw)
    lib = _kernel() if x.device.type == "cpu" else None
    if lib is None:
        return reference(x, qw)
    n, k = qw.shape
    if x.shape[-1] != k:
        raise ValueError(f"input has {x.shape[-1]} features, the quantized weight expects {k}")
    if x.numel() // k >= BATCHED_MIN_ROWS:
        return batched(x, qw)
    return kernel(x, qw, lib)


def batched(x: torch.Tensor, qw: QuantizedWeight, path: str | None = None) -> torch.Tensor:
    """A weight-only layer's product by one of BATCHED_PATHS (default: batched_path()); the copies they use are
    built on the first call and kept in qw.cache (qw.cache_nbytes counts them)."""
    path = path or batched_path()
    if path == "w8a8":
        return w8a8_linear(x, requantized(qw))
    if path == "fp16" and x.device.type == "cpu" and cpu_w8a8.fbgemm_available():
        packed = cached(qw, "fp16", lambda: torch.ops.quantized.linear_prepack_fp16(dequantize(qw), None))
        lead = x.shape[:-1]
        y = torch.ops.quantized.linear_dynamic_fp16(x.reshape(-1, qw.shape[1]).float().contiguous(), packed)
        return y.view(*lead, qw.shape[0]).to(x.dtype)
    if path in ("float", "fp16"):
        return F.linear(x, cached(qw, "float", lambda: dequantize(qw)).to(x.dtype))
    return F.linear(x, dequantize(qw).to(x.dtype))


def requantized(qw: QuantizedWeight) -> QuantizedWeight:
    """qw as W8A8 (int8 per output channel, rounded from its dequantized values), made once and kept. When FBGEMM
    runs it, FBGEMM's packed copy is all that is kept: the codes move to the "meta" device (shape, no memory)."""
    def build() -> QuantizedWeight:
        q = quantize(dequantize(qw), QuantSpec("int8", act="int8"))
        if cpu_w8a8.impl() == "fbgemm":
            cpu_w8a8.prepacked(q)
            q.qweight = q.qweight.to("meta")
        return q
    return cached(qw, "w8a8", build)


def kernel(x: torch.Tensor, qw: QuantizedWeight, lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """The C integer kernel at any number of rows (qlinear sends it fewer than BATCHED_MIN_ROWS)."""
    lib = lib or _kernel()
    n, k = qw.shape
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
