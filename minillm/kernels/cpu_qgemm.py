"""Call the C quantized linear kernel (csrc/qgemm.c), built on first use like the attention kernel.

`qlinear(x, qw)` is the one entry point the layers use.
- W8A8 weights (`qw.act == "int8"`): always cpu_w8a8.w8a8_linear (per-token int8 activations at every batch size).
- Weight-only int8/int4 on CPU with the kernel built: up to TILES_MAX_ROWS rows (decode at any batch,
  verification, short prefill chunks) the kernel's tiles (the weights' own codes reordered into a copy made on the
  first call, each block widened once for all rows of a pass); built without AVX2, the row kernel on the packed
  weights below BATCHED_MIN_ROWS rows (its plain C loop). Past those (prefill) the BATCHED_PATH (see the table at
  the constant): by default the int16 GEMM (cpu_int16.py: 13-bit codes per 64 inputs) on a copy of the weight
  packed on the first such call; an FBGEMM float16 copy where that kernel cannot be built.
- Otherwise (no compiler, CUDA tensors, MINILLM_QGEMM=torch) the reference: dequantize, then a float matmul.
The kernel differs from the reference by its dynamic int16 activations (per block of 32), the batched paths by
their 16-bit copies: tests/test_quant.py, tests/test_w8a8.py and tests/test_int16_gemm.py state the tolerances.
MINILLM_QGEMM=scalar builds the kernel without SIMD (the portable loop, for tests and A/B runs);
MINILLM_QGEMM_BATCHED=int16|fp16|bf16|w8a8|float overrides BATCHED_PATH (A/B runs, tools/measure_qgemm.py;
w8a8 uses the layers' SmoothQuant factors, which load_model then calibrates).
"""
from __future__ import annotations

import contextlib
import ctypes
import functools
import threading
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from minillm import config
from minillm.kernels import cpu_int16, cpu_native, cpu_threads, cpu_w8a8
from minillm.kernels.cpu_w8a8 import cached, w8a8_linear
from minillm.quant.formats import QuantizedWeight, QuantSpec, quantize, quantize_activations, unpack_int4

CSRC = Path(__file__).with_name("csrc")
SOURCES = (CSRC / "qgemm.c",)
KIND = {"int8": 0, "int4": 1}
_P, _I = ctypes.c_void_p, ctypes.c_int64
_ARGTYPES = [ctypes.c_int, _P, _I, _I, _I, _P, _P, _P, _I, _I, _P, _I, ctypes.c_int]


def mode() -> str:
    """The qgemm setting (config.KernelConfig): c | scalar (the kernel built without SIMD) | torch (the reference)."""
    return config.kernels().qgemm


VARIANT_FLAGS = {"c": (), "scalar": ("-DMINILLM_QGEMM_SCALAR",), **cpu_native.WITHOUT_AVX512}


@functools.cache
def load(variant: str = "c") -> ctypes.CDLL | None:
    """The compiled kernel (`variant` c or scalar), or None when it cannot be built (the reference runs). "avx2",
    "avx2-vnni": built without AVX-512 (the tiles then hold 3 or 4 rows a pass, not 7), without or with AVX-VNNI, for
    tests on a machine that has them."""
    extra = VARIANT_FLAGS[variant]
    lib = cpu_native.open_library(SOURCES, "C quantized-matmul kernel", "dequantizing to float instead", extra)
    if lib is None:
        return None
    lib.minillm_qgemm.argtypes = _ARGTYPES
    lib.minillm_qgemm.restype = ctypes.c_int
    lib.minillm_qgemm_simd.restype = ctypes.c_int
    lib.minillm_dequant.argtypes = [ctypes.c_int, _P, _P, _P, _I, _I, _I, _P, ctypes.c_int]
    lib.minillm_dequant.restype = None
    lib.minillm_qgemm_tiles.argtypes = [ctypes.c_int, _P, _I, _I, _I, _P, _P, _P, _I, _I, _P, ctypes.c_int]
    lib.minillm_qgemm_tiles.restype = ctypes.c_int
    lib.minillm_qgemm_tiles_available.restype = ctypes.c_int
    return lib


def _kernel() -> ctypes.CDLL | None:
    m = mode()
    return None if m == "torch" else load(m)


def reference(x: torch.Tensor, qw: QuantizedWeight) -> torch.Tensor:
    """Exact weight-only semantics: dequantize W, then x W^T in x's dtype."""
    return F.linear(x, qw.dequantize(x.dtype))


# Weight-only layers with more than TILES_MAX_ROWS activation rows (without the tiles: at least BATCHED_MIN_ROWS) run
# BATCHED_PATH instead of the C kernel:
#   int16    the default (2026-11-28): the weight packed once into 13-bit codes per (output, 64 inputs), stored as
#            int16 (2 bytes per weight), the activations quantized per call to 13 bits per (row, 64 inputs), and a
#            vpmaddwd GEMM (csrc/int16_gemm.c). 1.2-1.3x float32 at 2048 rows, 1.5-2.3x at 16-64 rows, 2.4-5x
#            for the LM head (tools/measure_qgemm.py); the error is ~1e-4 of a layer's largest output
#            (SmolLM2's logits within 0.064 of the exact product, perplexity in README). Falls back to fp16
#            when the kernel cannot be built (no compiler, no AVX2) or K is odd; NaN/inf inputs take the float
#            product so they propagate.
#   fp16     an FBGEMM float16 copy made once (2 bytes per weight), float32 activations and accumulation: the weight
#            rounded to 11 bits (<= 2^-12 relative; tests/test_w8a8.py states the tolerance). No faster than float32
#            here (FBGEMM widens the weights to float32 before the FMAs) but half its memory.
#   bf16     a bfloat16 copy made once (2 bytes per weight), activations rounded to bfloat16, oneDNN's GEMM: the
#            weight and the activations rounded to 8 bits, the output to bfloat16 (<= ~1 % of a row's largest
#            output; torch has no bf16 x bf16 -> float32 GEMM on CPU). Opt-in: on the AVX-512 (avx512_bf16) machine
#            of ../shared/NOTES.md a 576x1536 layer ran 2x faster than float32 at 16 rows and 4x at 256 (here, AVX2,
#            torch emulates bfloat16: 6-9x slower), but the rounding flips SmolLM2's near-ties: its greedy answer to
#            "What is the capital of France?" starts with "The" at logits 25.33 vs 25.24 for "L" in float32 and
#            fp16; the bfloat16 LM head rounds both to 25.0 and the answer wanders off -- though perplexity moves
#            only +0.1 % (15.618 -> 15.633, 8 held-out windows of 256 tokens, auto).
#   float    a float32 copy made once (exact weight-only math; 4 bytes per weight)
#   w8a8     the weight requantized once to int8 per output channel (times the layer's SmoothQuant factors when
#            load_model calibrated it: calibration/smoothquant.py) and run as W8A8 (FBGEMM, cpu_w8a8.py). Not the default: on
#            this AVX2 machine FBGEMM's int8 GEMM is only ~1.3x the float32 one at 2048 rows and quantizing the
#            activations per token eats that (a 2048-token prefill: 5.16 s vs 4.98 s float32), while 7-bit
#            activations cost SmolLM2 +2.6 % perplexity even smoothed (+13 % without). Machines with VNNI/AMX int8
#            are where it would pay: MINILLM_QGEMM_BATCHED=w8a8 (load_model then calibrates).
#   dequant  W expanded to float32 on every call, then the float GEMM (exact, no memory; what ran until 2026-11-26)
# tools/measure_qgemm.py --repeat 2 (µs per call, int4 g32 weights, int8 g32 LM head, 1 thread, AVX2, 2026-11-26,
# shared machine: read ratios; weights stay in cache between calls, which flatters float at few rows -- in the
# engine the C kernel streams 1/7 of the bytes, see the decode bench):
#
#   shape              path        1      4      8     16     32     64    128    256 rows
#   576x576 q/o        C          97    149    294    516   1003   1133   2200   4793
#                      w8a8      324    332    374    400    501    501    817   1460
#                      fp16      102    130    169    235    350    502    958   1896
#                      float      64    123    159    227    297    516    951   1870
#                      dequant   383    434    463    494    493    710   1156   2083
#   1536x576 gate/up   C          99    182    352   1078   1387   2803   5698  14293
#                      w8a8      229    251    307    600    585    981   1815   3583
#                      fp16       82    123    200    466    675   1221   2408   4906
#                      float      89    229    307    560    781   1390   2705   5296
#                      dequant   592    737    841   1171   1282   1909   3228   5772
#   576x1536 down      C          86    173    327    664   1306   4944  11936  23879
#                      w8a8      218    249    294    402    611   1621   3409   6721
#                      fp16       80    121    193    359    677   1676   4565  10466
#                      float      75    224    300    473    792   1522   5109   9608
#   49152x576 head     C        3096   5327  10375  31528  70393 128594 185635 496445
#                      w8a8     4410   2839   4266   7406  26245  28093  64193 139733
#                      fp16     6148   4028   7839  23099  50310  46232  87132 180133
#                      float    7924  19259  21672  28608  73276  65156 101986 194381
#
# From 16 rows the C kernel (which re-expands the weights for every 4 rows) loses to every copy; below, in the
# engine, it reads 1/7 of the bytes (decode bench: 1.76x fp32 at batch 1). Through the engine (a scratch A/B, 12
# requests, outputs 16-128, 1 thread, best of 2 interleaved rounds, tok/s vs none): fp16 from 16 rows 1.41x,
# float 1.31x, w8a8 1.17x; fp16 from 4 rows 1.62x but 0.56x in its other round -- this machine's noise is larger
# than the difference, so 16 stays until a quiet re-measure. fp16 is kept over float for half the memory.
# Re-measure (this script and `bench throughput --quantization auto none --repeat 3`) when csrc/qgemm.c changes.
# The table predates the int16 path; tools/measure_qgemm.py now times it too (row "int16").
# 3 since the fused decode step runs the int16 GEMM too (2026-11-28, AVX2 Zen 3): median decode step of n
# sequences, SmolLM2 auto, 2 threads, 200-token prompts, best of 3 engines, fused step with the C kernel vs with
# the int16 GEMM: 1 row 9.4 vs 17.2 ms, 2 rows 13.4 vs 16.4, 3 rows 19.3 vs 16.8, 4 rows 25.8 vs 17.7, 8 rows 47.9
# vs 25.9, 16 rows 111.9 vs 50.3; the layers (MINILLM_DECODE_STEP=layers) cross at the same place (3 rows 34.4 vs
# 32.4, 8 rows 66.7 vs 44.0). Batch-1 decode stays on the C kernel: it streams int4's 0.56 bytes per weight, not 2.
# Still 3 with qgemm.c's row_many (2 rows sharing each widened weight block) and the tiles from 3 rows (2026-11-29,
# Zen 4, same measure): 2 rows 5.4 ms on row_many (6.8 on the row kernel before it); 3 rows 6.3 on the tiles, where
# row_many took 7.6-8.4 and the int16 GEMM 7.7-8.5.
# Since 2026-11-29 only where the tiles are not built (no AVX2): once a pass of the tiles kept its sums in registers
# (qgemm.c tiles_pass), they beat the row kernel at every count. Every matmul of SmolLM2, 2 threads, Zen 4, medians
# of 9 interleaved: 1 row 4.07 vs 4.51 ms, 2 rows 4.43 vs 5.10 (built for AVX2 without VNNI: 4.05 vs 4.34, 4.48 vs
# 5.04); a whole greedy decode step at batch 1, 4.3-4.9 -> 3.2-3.5 ms.
BATCHED_MIN_ROWS = 3
# Up to this many rows the C kernel's tiles run (qgemm.c: the weights' own int4 / int8 codes in tiles, widened in
# registers for every row of a pass; the row kernel's arithmetic, so batched rows differ from rows alone only by the
# order of float additions); past it, the BATCHED_PATH. The fused decode step runs the tiles at every batch
# (cpu_decode.applies), so plain and speculative decoding use one arithmetic at any batch size. Measured
# 2026-11-29 (SmolLM2's 576x1536 / 1536x576 int4 layers, 2 threads, Zen 4; -march=native and an AVX2-only build
# alike), ms tiles vs the int16 copy: 3 rows 2.2 vs 3.1, 5 rows 3.0 vs 4.9, 8 rows 4.1 vs 4.8, 16 rows 6.7 vs 7.0,
# 24 rows 9.6 vs 9.6, 32 rows 12.6 vs 11.9, 64 rows 25 vs 23, 256 rows 102 vs 85: a step of few rows streams the
# weights (0.56 bytes per int4 weight against the copy's 2), many rows are compute-bound and the copy's scale per 64
# inputs (half the float work of a scale per group of 32) wins. 64 covers a batch of max_num_seqs decodes.
TILES_MAX_ROWS = 64
BATCHED_PATHS = (*config.QGEMM_BATCHED_PATHS, "dequant")   # dequant: only inside exact_batched()
BATCHED_PATH = config.KERNEL_SETTINGS["qgemm_batched"][1]
_exact = threading.local()


def batched_path() -> str:
    """The qgemm_batched setting (config.KernelConfig, default BATCHED_PATH); dequant inside exact_batched()."""
    if getattr(_exact, "on", False):
        return "dequant"
    p = config.kernels().qgemm_batched
    if p == "int16" and not cpu_int16.available():
        return "fp16"
    return p


@contextlib.contextmanager
def exact_batched():
    """Batched steps through the exact float product inside the block (W expanded per call: no copy is kept):
    calibration measures the activations the exact products give."""
    before = getattr(_exact, "on", False)
    _exact.on = True
    try:
        yield
    finally:
        _exact.on = before


def dequantize(qw: QuantizedWeight) -> torch.Tensor:
    """The float32 matrix, by the C loop when it is built (the torch version unpacks through several temporaries)."""
    lib = _kernel()
    if lib is None or qw.qweight.device.type != "cpu":
        return qw.dequantize()
    n, k = qw.shape
    out = torch.empty(n, k, dtype=torch.float32)
    mins = qw.mins.data_ptr() if qw.mins is not None else None
    lib.minillm_dequant(KIND[qw.kind], qw.qweight.data_ptr(), qw.scales.data_ptr(), mins, n, k, qw.group_size,
                        out.data_ptr(), cpu_threads.team_size())
    return out


def qlinear(x: torch.Tensor, qw: QuantizedWeight, smooth: torch.Tensor | None = None,
            sampled: bool = False) -> torch.Tensor:
    """x [..., K] (float32/bf16/fp16) times the quantized [N, K] matrix -> [..., N] in x's dtype. `smooth`: the
    layer's SmoothQuant factors, used by a W8A8 copy for batched steps. `sampled`: x holds sampled rows only (the LM
    head's), never a prefill's bulk: they run the tiles at any count, so a verification of k + 1 tokens for many
    sequences scores its rows with the arithmetic a plain step of them would."""
    if qw.act is not None:
        return w8a8_linear(x, qw)
    lib = _kernel() if x.device.type == "cpu" else None
    if lib is None:
        return reference(x, qw)
    n, k = qw.shape
    if x.shape[-1] != k:
        raise ValueError(f"input has {x.shape[-1]} features, the quantized weight expects {k}")
    rows = x.numel() // k
    if lib.minillm_qgemm_tiles_available():
        if rows <= TILES_MAX_ROWS or sampled:
            y = linear_tiles(x, tiles_copy(qw), lib)
            if y is not None:
                return y
    elif rows < BATCHED_MIN_ROWS:
        return kernel(x, qw, lib)
    return batched(x, qw, smooth=smooth)


def batched(x: torch.Tensor, qw: QuantizedWeight, path: str | None = None,
            smooth: torch.Tensor | None = None) -> torch.Tensor:
    """A weight-only layer's product by one of BATCHED_PATHS (default: batched_path()); the copies they use are
    built on the first call and kept in qw.cache (qw.cache_nbytes counts them). `smooth`: the layer's SmoothQuant
    factors, for a W8A8 copy."""
    path = path or batched_path()
    if path == "int16" and x.device.type == "cpu" and cpu_int16.supports(qw.shape[1]) and cpu_int16.available():
        y = cpu_int16.linear(x, int16_copy(qw))
        if y is not None:
            return y
        return F.linear(x, dequantize(qw).to(x.dtype))      # NaN or inf in x: the float product propagates them
    if path == "int16":
        path = "fp16"                                       # odd K, or no AVX2 kernel
    if path == "w8a8":
        return w8a8_linear(x, requantized(qw, smooth))
    if path == "fp16" and x.device.type == "cpu" and cpu_w8a8.fbgemm_available():
        packed = cached(qw, "fp16", lambda: torch.ops.quantized.linear_prepack_fp16(dequantize(qw), None))
        lead = x.shape[:-1]
        y = torch.ops.quantized.linear_dynamic_fp16(x.reshape(-1, qw.shape[1]).float().contiguous(), packed)
        return y.view(*lead, qw.shape[0]).to(x.dtype)
    if path == "bf16":
        w = cached(qw, "bf16", lambda: dequantize(qw).to(torch.bfloat16))
        return F.linear(x.to(torch.bfloat16), w).to(x.dtype)
    if path in ("float", "fp16"):
        return F.linear(x, cached(qw, "float", lambda: dequantize(qw)).to(x.dtype))
    return F.linear(x, dequantize(qw).to(x.dtype))


@dataclass
class PackedTiles:
    """A quantized matrix's own codes in the C kernel's tiles (csrc/qgemm.c describes the layout): int4 as uint8
    [N_pad/24, K/32, 8, 3, 16], int8 as int8 [N_pad/24, K/32, 16, 3, 16]; the fp16 scales (and int4's minimums) per
    (24-column block, group, column) [N_pad/24, K/G, 24]. The same bytes as the matrix, reordered."""
    kind: str
    tiles: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None
    n: int
    k: int
    group: int

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in (self.tiles, self.scales, self.mins) if t is not None)

    @property
    def n_pad(self) -> int:
        """The output columns the kernel writes: n rounded up to whole 24-column blocks."""
        return self.tiles.shape[0] * TILE_N


TILE_N = 24                    # columns per tile: qgemm.c's TN, three vectors of 8 sums


def pack_tiles(qw: QuantizedWeight) -> PackedTiles:
    """qw's codes, scales and minimums reordered into tiles (N padded to a multiple of 24 with zero columns)."""
    n, k = qw.shape
    g = qw.group_size
    n_pad = -(-n // TILE_N) * TILE_N
    pad = n_pad - n
    if qw.kind == "int4":                                  # (block, v, column, b, half, j, input)
        t = F.pad(unpack_int4(qw.qweight), (0, 0, 0, pad)).view(n_pad // TILE_N, 3, 8, k // 32, 2, 8, 2)
        tiles = (t[:, :, :, :, 0] | (t[:, :, :, :, 1] << 4)).permute(0, 3, 4, 1, 2, 5)   # (block, b, j, v, col, in)
        tiles = tiles.contiguous().view(n_pad // TILE_N, k // 32, 8, 3, 16)
    else:                                                  # (block, v, column, b, j, input)
        t = F.pad(qw.qweight, (0, 0, 0, pad)).view(n_pad // TILE_N, 3, 8, k // 32, 16, 2)
        tiles = t.permute(0, 3, 4, 1, 2, 5).contiguous().view(n_pad // TILE_N, k // 32, 16, 3, 16)

    def per_block(x: torch.Tensor) -> torch.Tensor:
        return F.pad(x, (0, 0, 0, pad)).view(n_pad // TILE_N, TILE_N, k // g).permute(0, 2, 1).contiguous()

    return PackedTiles(qw.kind, tiles, per_block(qw.scales), per_block(qw.mins) if qw.mins is not None else None,
                       n, k, g)


def tiles_copy(qw: QuantizedWeight) -> PackedTiles:
    """qw in tiles, made on the first product of up to TILES_MAX_ROWS rows and kept in qw.cache (the fused decode
    step shares it)."""
    return cached(qw, "tiles", lambda: pack_tiles(qw))


def linear_tiles(x: torch.Tensor, packed: PackedTiles, lib: ctypes.CDLL | None = None) -> torch.Tensor | None:
    """x [..., K] -> [..., N] in x's dtype through the tiles; None when x holds NaN or inf (the caller's float path
    then propagates them)."""
    lib = lib or _kernel()
    lead, k = x.shape[:-1], packed.k
    x2 = x.reshape(-1, k)
    if x2.dtype != torch.float32 or x2.stride(-1) != 1:
        x2 = x2.float().contiguous()
    m, n_pad = x2.shape[0], packed.n_pad
    y = torch.empty(m, n_pad, dtype=torch.float32)
    if m:
        mins = packed.mins.data_ptr() if packed.mins is not None else None
        rc = lib.minillm_qgemm_tiles(KIND[packed.kind], x2.data_ptr(), m, k, x2.stride(0), packed.tiles.data_ptr(),
                                     packed.scales.data_ptr(), mins, packed.group, n_pad, y.data_ptr(),
                                     cpu_threads.team_size())
        if rc == -2:
            return None
        if rc != 0:
            raise MemoryError("the quantized matmul could not allocate its activation buffer") if rc == -1 else \
                RuntimeError(f"the tiles kernel failed (code {rc})")
    y = y[:, :packed.n].contiguous() if packed.n != n_pad else y
    y = y.view(*lead, packed.n)
    return y if x.dtype == torch.float32 else y.to(x.dtype)


def simulate_tiles(x: torch.Tensor, qw: QuantizedWeight) -> torch.Tensor:
    """The tiles' arithmetic in torch (float64): per block of 32 inputs the exact integer sum of the activation codes
    (formats.quantize_activations, the row kernel's) times the weight codes, times the block's activation scale and
    the group's weight scale, plus (int4) the group's minimum times the block's scaled code sum."""
    x2 = x.reshape(-1, qw.shape[1]).float()
    q, d, s = quantize_activations(x2)
    codes = (unpack_int4(qw.qweight) if qw.kind == "int4" else qw.qweight).long()
    y = torch.zeros(x2.shape[0], qw.shape[0], dtype=torch.float64)
    for b in range(qw.shape[1] // 32):
        k0, g = 32 * b, 32 * b // qw.group_size
        dot = (q[:, k0:k0 + 32].long() @ codes[:, k0:k0 + 32].T).double()
        y += dot * d[:, b:b + 1].double() * qw.scales[:, g].double()
        if qw.mins is not None:
            y += s[:, b:b + 1].double() * qw.mins[:, g].double()
    return y.view(*x.shape[:-1], qw.shape[0])


def int16_copy(qw: QuantizedWeight) -> cpu_int16.PackedInt16:
    """qw packed for the int16 GEMM (the batched path's copy; the fused decode step's batched steps share it), made
    once and kept in qw.cache."""
    return cached(qw, "int16", lambda: cpu_int16.pack(dequantize(qw)))


def requantized(qw: QuantizedWeight, smooth: torch.Tensor | None = None) -> QuantizedWeight:
    """qw as W8A8 (int8 per output channel, rounded from its dequantized values, times `smooth` when given), made
    once per smoothing and kept. When FBGEMM runs it, FBGEMM's packed copy is all that is kept: the codes move to
    the "meta" device (shape, no memory)."""
    def build() -> QuantizedWeight:
        q = quantize(dequantize(qw), QuantSpec("int8", act="int8"), smooth)
        if cpu_w8a8.impl() == "fbgemm":
            cpu_w8a8.prepacked(q)
            q.qweight = q.qweight.to("meta")
        return q
    return cached(qw, "w8a8" if smooth is None else "w8a8-smooth", build)


def kernel(x: torch.Tensor, qw: QuantizedWeight, lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """The C row kernel at any number of rows (qlinear sends it fewer than BATCHED_MIN_ROWS where the tiles are not
    built; the tests' row-at-a-time reference)."""
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
                               cpu_threads.team_size())
        if rc != 0:
            raise MemoryError("the quantized matmul could not allocate its activation buffer")
    y = y.view(*lead, n)
    return y if x.dtype == torch.float32 else y.to(x.dtype)
