"""The batched-step GEMM for quantized layers in 16-bit integers (csrc/int16_gemm.c): 13-bit weight codes per (output
column, chunk of CHUNK inputs) x 13-bit activation codes per (row, chunk).

`pack(w)` turns a float matrix into the kernel's tiles (once per layer, kept in the layer's QuantizedWeight cache by
cpu_qgemm.batched); `linear(x, packed)` runs it. `simulate(x, packed)` is the same arithmetic in torch (exact
integer sums per chunk, then the float scales): the kernel must equal it to float rounding, and the tests bound how
far both are from the float product.

Error: each weight moves by <= 1/(2*QMAX) of its chunk's largest |w|, each activation by <= 1/(2*PMAX) of its
chunk's largest |x|; error_bound() turns that into a bound per output (tests/test_int16_gemm.py holds the kernel to
it). SmolLM2's layers measured 1e-4-5e-4 of a row's largest output.
"""
from __future__ import annotations

import ctypes
import functools
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

from minillm.kernels import cpu_native, cpu_threads

SOURCE = Path(__file__).with_name("csrc") / "int16_gemm.c"
CHUNK = 64           # inputs per scale (csrc/int16_gemm.c): 64 * PMAX * QMAX < 2^31
PMAX = 4095          # activation codes: 13 bits
QMAX = 4095          # weight codes: 13 bits
TILE_N = 24          # output columns per packed block
TILE_M = 4           # activation rows per register tile (y gets rows up to a multiple of it)
_P, _I = ctypes.c_void_p, ctypes.c_int64


# the AVX2 builds' tile takes its sums through memory once per chunk; tests hold them to the native build's bits
VARIANT_FLAGS = {"native": (), **cpu_native.WITHOUT_AVX512}


@functools.cache
def load(variant: str = "native") -> ctypes.CDLL | None:
    """The compiled kernel, or None when it cannot be built or the CPU has no AVX2 (callers use another path)."""
    lib = cpu_native.open_library(SOURCE, "int16 GEMM kernel", "batched steps use another path",
                                  VARIANT_FLAGS[variant])
    if lib is None:
        return None
    lib.minillm_int16_gemm.argtypes = [_P, _I, _I, _I, _P, _P, _I, _P, _P, _P, ctypes.c_int]
    lib.minillm_int16_gemm.restype = ctypes.c_int
    lib.minillm_int16_simd.restype = ctypes.c_int
    return lib if lib.minillm_int16_simd() else None


def available() -> bool:
    return load() is not None


@dataclass
class PackedInt16:
    """13-bit codes stored as int16 tiles [N_pad/24, K/2, 24, 2] and a float scale per (chunk, output column)."""
    tiles: torch.Tensor          # int16
    scales: torch.Tensor         # float32 [ceil(K/CHUNK), N_pad] (0 for padding columns)
    n: int                       # output columns (before padding to a multiple of 24)
    k: int

    @property
    def nbytes(self) -> int:
        return self.tiles.nbytes + self.scales.nbytes

    def codes(self) -> torch.Tensor:
        """The codes back as [N, K] (int32), for simulate() and tests."""
        nb, kp = self.tiles.shape[:2]
        return self.tiles.permute(0, 2, 1, 3).reshape(nb * TILE_N, kp * 2)[: self.n].to(torch.int32)


def supports(k: int) -> bool:
    """The kernel takes an even number of inputs (pairs feed vpmaddwd)."""
    return k % 2 == 0


def _chunk_amax(t: torch.Tensor) -> torch.Tensor:
    """max |t| per (row, chunk of CHUNK inputs): [rows, ceil(K/CHUNK)] (a last, shorter chunk is padded with 0)."""
    rows, k = t.shape
    nchunks = -(-k // CHUNK)
    return torch.nn.functional.pad(t.abs(), (0, nchunks * CHUNK - k)).view(rows, nchunks, CHUNK).amax(dim=2)


def _per_input(per_chunk: torch.Tensor, k: int) -> torch.Tensor:
    """[rows, nchunks] -> [rows, k]: each chunk's value repeated over its inputs."""
    return per_chunk.repeat_interleave(CHUNK, dim=1)[:, :k]


def _round_per_chunk(t: torch.Tensor, qmax: int) -> tuple[torch.Tensor, torch.Tensor]:
    """t [rows, K] float32 -> codes round(t / scale) in [-qmax, qmax] (whole floats, half to even as the C kernel's
    nearbyintf / cvtps; callers pick the integer type) and scales [rows, nchunks] = max|t| / qmax per chunk (0 for
    an all-zero chunk)."""
    scales = _chunk_amax(t) / qmax
    inv = torch.where(scales > 0, 1.0 / scales, torch.zeros_like(scales))
    return torch.round(t * _per_input(inv, t.shape[1])).clamp_(-qmax, qmax), scales


def pack(w: torch.Tensor) -> PackedInt16:
    """A float matrix [N, K] (K even) as 13-bit codes with a scale per (row, chunk of CHUNK inputs)."""
    n, k = w.shape
    if not supports(k):
        raise ValueError(f"the int16 GEMM kernel needs an even number of inputs, got K={k}")
    codes, scales = _round_per_chunk(w.float(), QMAX)
    q = codes.to(torch.int16)
    n_pad = -(-n // TILE_N) * TILE_N
    if n_pad != n:
        q = torch.cat([q, q.new_zeros(n_pad - n, k)])
        scales = torch.cat([scales, scales.new_zeros(n_pad - n, scales.shape[1])])
    tiles = q.view(n_pad // TILE_N, TILE_N, k // 2, 2).permute(0, 2, 1, 3).contiguous()
    return PackedInt16(tiles, scales.T.contiguous(), n, k)


def linear(x: torch.Tensor, packed: PackedInt16, nthreads: int | None = None,
           lib: ctypes.CDLL | None = None) -> torch.Tensor | None:
    """x [..., K] -> [..., N] in x's dtype, by the kernel (`lib`: another build, load(variant); default load());
    None when x holds NaN or inf (the caller's float path then propagates them, as float math would)."""
    lib = lib or load()
    if lib is None:
        raise RuntimeError("the int16 kernel is not available here (no C compiler or no AVX2): check available()")
    k = packed.k
    if x.shape[-1] != k:
        raise ValueError(f"input has {x.shape[-1]} features, the packed weight expects {k}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    if x2.dtype != torch.float32 or x2.stride(-1) != 1:
        x2 = x2.float().contiguous()
    m, n_pad = x2.shape[0], packed.scales.shape[1]
    m_pad = -(-m // TILE_M) * TILE_M
    y = torch.empty(m_pad, n_pad, dtype=torch.float32)
    if m:
        p = _scratch("codes", m_pad * k, torch.int16)
        sx = _scratch("scales", m_pad * -(-k // CHUNK), torch.float32)
        rc = lib.minillm_int16_gemm(x2.data_ptr(), m, k, x2.stride(0), packed.tiles.data_ptr(),
                                    packed.scales.data_ptr(), n_pad, y.data_ptr(), p.data_ptr(), sx.data_ptr(),
                                    nthreads or cpu_threads.team_size())
        if rc == -2:
            return None
        if rc != 0:
            raise RuntimeError(f"the int16 kernel failed (code {rc})")
    y = y[:m, : packed.n]
    if packed.n != n_pad:
        y = y.contiguous()
    y = y.view(*lead, packed.n)
    return y if x.dtype == torch.float32 else y.to(x.dtype)


_local = threading.local()


def _scratch(name: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A per-thread buffer of at least numel elements, grown (never shrunk) and reused across calls."""
    buf = getattr(_local, name, None)
    if buf is None or buf.numel() < numel:
        buf = torch.empty(max(numel, 1 << 16), dtype=dtype)
        setattr(_local, name, buf)
    return buf


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> 13-bit codes [M, K] (int64) and scales [M, ceil(K/CHUNK)]: amax/PMAX per chunk."""
    codes, scales = _round_per_chunk(x.float(), PMAX)
    return codes.long(), scales


def simulate(x: torch.Tensor, packed: PackedInt16) -> torch.Tensor:
    """The kernel's arithmetic in torch: exact integer sums per chunk, then the float scales (float64 here)."""
    x2 = x.reshape(-1, packed.k)
    codes, sx = quantize_activations(x2)
    q = packed.codes().long()
    y = torch.zeros(x2.shape[0], packed.n, dtype=torch.float64)
    for c, c0 in enumerate(range(0, packed.k, CHUNK)):
        part = codes[:, c0:c0 + CHUNK] @ q[:, c0:c0 + CHUNK].T
        y += part.double() * sx[:, c:c + 1].double() * packed.scales[c, : packed.n].double()
    return y.view(*x.shape[:-1], packed.n)


def error_bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """A bound on |linear(x, pack(w)) - x w^T| per output [M, N] from the rounding of both operands:
    sum_k |e_k||w_k| + |x_k||d_k| + |e_k||d_k| with |e_k| <= amax_x(chunk)/(2 PMAX), |d_k| <= amax_w(chunk)/(2 QMAX),
    plus float32 rounding of the scaled chunk sums."""
    x2, w = x.reshape(-1, w.shape[1]).double(), w.double()
    k = w.shape[1]
    ex = _per_input(_chunk_amax(x2) / (2 * PMAX), k)           # per-element rounding bounds, [rows, K]
    dw = _per_input(_chunk_amax(w) / (2 * QMAX), k)
    bound = ex @ w.abs().T + x2.abs() @ dw.T + ex @ dw.T
    return bound + 1e-6 * (x2.abs() @ w.abs().T) + 1e-30
