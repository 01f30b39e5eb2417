"""W8A8 matmuls: int8 per-output-channel weights times int8 per-token dynamic activations (formats.py has the math).

`w8a8_linear(x, qw)` quantizes each activation row with its own step, multiplies the integer codes exactly and
rescales by step[m] * scale[n]. Implementations, all computing the same integer sums (tests/test_w8a8.py holds
each to `reference`):

    fbgemm  torch.ops.quantized.linear_dynamic on a prepacked copy of the weight (FBGEMM, AVX2 here): 1.5-4x faster
            than the fp32 GEMM at 16-256 rows on SmolLM2's shapes (tools/measure_qgemm.py). It quantizes its input
            per TENSOR, so it is given the per-token codes themselves (integers in [-63, 63]) plus one sentinel row
            [-64, 63, 0, ...]: the tensor's range is then exactly [-64, 63], its scale 1.0 and zero point 64, so
            FBGEMM's uint8 codes are our codes + 64, unchanged, and 7-bit (no int16 saturation, see formats.py).
            The per-row steps are applied to its float output.
    float   the codes as float32 times the weight codes as float32, split over K so that every partial sum is an
            exact integer below 2^24; for machines without FBGEMM (and any device).
    int_mm  torch._int_mm (int8 x int8 -> int32): exact, but 20-300x slower than fp32 on this CPU (torch 2.13).

MINILLM_W8A8=fbgemm|float|int_mm picks one (tests, A/B runs); the default is the first that works here.
"""
from __future__ import annotations

import functools
import warnings

import torch

from minillm import config
from minillm.quant.formats import W8A8_LEVELS, QuantizedWeight, quantize_per_token

IMPLS = ("fbgemm", "float", "int_mm")
# the largest K-chunk whose integer dot products stay exact in float32: 2^24 / (63 * 127)
_EXACT_K = (1 << 24) // (W8A8_LEVELS * 127)


def check(qw: QuantizedWeight) -> None:
    if qw.kind != "int8" or qw.group_size != qw.shape[1]:
        raise ValueError(f"W8A8 needs int8 weights with one scale per output channel, got {qw.kind} with groups "
                         f"of {qw.group_size} over {qw.shape[1]} inputs: quantize with QuantSpec('int8', act='int8')")


def reference(x: torch.Tensor, qw: QuantizedWeight) -> torch.Tensor:
    """The definition in plain torch: per-token codes, an exact integer matmul (float64 holds every sum exactly),
    rescaled by step[m] * scale[n]; [..., N] in x's dtype."""
    check(qw)
    k = qw.shape[1]
    codes, step = quantize_per_token(smoothed(x.reshape(-1, k), qw))
    acc = codes.double() @ qw.qweight.double().T
    y = acc * (step.double()[:, None] * qw.scales.double().view(1, -1))
    return y.to(x.dtype).reshape(*x.shape[:-1], qw.shape[0])


@functools.cache
def fbgemm_available() -> bool:
    """Whether torch's quantized CPU ops run here (an x86 build with FBGEMM)."""
    try:
        w = torch.ones(8, 32, dtype=torch.int8)
        _fbgemm_run(torch.zeros(2, 32), _fbgemm_pack(w, torch.ones(8)))
        return True
    except (RuntimeError, AttributeError, NotImplementedError):
        return False


def impl() -> str:
    """The implementation that runs: the w8a8_kernel setting (config.KernelConfig), auto: fbgemm where it works,
    else float."""
    m = config.kernels().w8a8_kernel
    return ("fbgemm" if fbgemm_available() else "float") if m == "auto" else m


def w8a8_linear(x: torch.Tensor, qw: QuantizedWeight, which: str | None = None) -> torch.Tensor:
    """x [..., K] (any float dtype) times the W8A8 matrix [N, K] -> [..., N] in x's dtype."""
    check(qw)
    n, k = qw.shape
    if x.shape[-1] != k:
        raise ValueError(f"input has {x.shape[-1]} features, the quantized weight expects {k}")
    which = which or impl()
    if which == "fbgemm" and x.device.type != "cpu":
        which = "float"
    x2 = smoothed(x.reshape(-1, k), qw)
    codes, step = quantize_per_token(x2)
    if which == "fbgemm":
        y = _fbgemm_run(codes, prepacked(qw))
        y.mul_(step[:, None])
    else:
        acc = _int_mm(codes, qw) if which == "int_mm" else _float_codes(codes, qw)
        y = acc * (step[:, None] * qw.scales.float().view(1, -1))
    return y.to(x.dtype).reshape(*x.shape[:-1], n)


def smoothed(x: torch.Tensor, qw: QuantizedWeight) -> torch.Tensor:
    """The activations the integer product sees: x, or x / s for a matrix with SmoothQuant factors s."""
    return x if qw.smooth is None else torch.div(x.float(), qw.smooth.to(x.device))


def prepacked(qw: QuantizedWeight):
    """FBGEMM's packed copy of qw, made on first use and kept in qw.cache."""
    return cached(qw, "fbgemm", lambda: _fbgemm_pack(qw.qweight, qw.scales.float().view(-1)))


def cached(qw: QuantizedWeight, name: str, build):
    """qw.cache[name], built on first use; its bytes (a nested QuantizedWeight's own and its cache's) are reported
    by qw.cache_nbytes."""
    if name not in qw.cache:
        obj = build()
        qw.cache[name] = (obj, _bytes_of(obj, qw, name))
    return qw.cache[name][0]


def _bytes_of(obj, qw: QuantizedWeight, name: str) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if hasattr(obj, "nbytes"):              # cpu_int16.PackedInt16, cpu_qgemm.PackedTiles
        return obj.nbytes
    if isinstance(obj, QuantizedWeight):    # a requantized copy; tensors left on "meta" hold no memory
        return sum(t.numel() * t.element_size() for t in obj.tensors() if t.device.type != "meta")
    n, k = qw.shape             # FBGEMM's packed matrices: int8 (+ column offsets and scales) or float16
    return n * k * 2 if name == "fp16" else n * k + 8 * n


def _fbgemm_pack(codes: torch.Tensor, scales: torch.Tensor):
    """FBGEMM's prepacked form of int8 codes [N, K] with float scales [N] (one per output channel)."""
    n = codes.shape[0]
    with warnings.catch_warnings():     # quantized-tensor constructors warn that they are deprecated (torch 2.13)
        warnings.simplefilter("ignore")
        q = torch._make_per_channel_quantized_tensor(codes.contiguous(), scales.double(),
                                                     torch.zeros(n, dtype=torch.long), 0)
        return torch.ops.quantized.linear_prepack(q, None)


def _fbgemm_run(codes: torch.Tensor, packed) -> torch.Tensor:
    """sum_k codes[m, k] * w[n, k] * scale[n] for codes already integer in [-63, 63] (see the module docstring)."""
    m, k = codes.shape
    y = torch.ops.quantized.linear_dynamic(torch.cat([codes, _sentinel(k)]), packed, True)
    return y[:m]


@functools.cache
def _sentinel(k: int) -> torch.Tensor:
    """The row [-64, 63, 0, ...] that pins FBGEMM's per-tensor range to [-64, 63] (k >= 32 in formats.py)."""
    row = torch.zeros(1, k)
    row[0, 0], row[0, 1] = -(W8A8_LEVELS + 1), W8A8_LEVELS
    return row


def _float_codes(codes: torch.Tensor, qw: QuantizedWeight) -> torch.Tensor:
    """The integer sums with float32 GEMMs, in K-chunks short enough that every partial sum is exact."""
    k = codes.shape[1]
    w = qw.qweight.to(codes.device, torch.float32)
    acc = None
    for k0 in range(0, k, _EXACT_K):
        part = codes[:, k0:k0 + _EXACT_K] @ w[:, k0:k0 + _EXACT_K].T
        acc = part if acc is None else acc.double() + part
    return acc.float()


def _int_mm(codes: torch.Tensor, qw: QuantizedWeight) -> torch.Tensor:
    return torch._int_mm(codes.to(torch.int8), qw.qweight.T).float()
