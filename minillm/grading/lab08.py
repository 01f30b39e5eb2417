"""Checkers for lab08 — weight quantization.

Tasks (the notebook documents the same signatures; minillm's own versions are minillm.quant.formats.quantize, the
engine's Quantizer seam LlamaModel.quantize_(..., quantizer=), QuantizedWeight.dequantize and
minillm.kernels.cpu_qgemm.dequantize / qlinear):
  lab08_1  quantize_int8(w) -> QuantizedWeight("int8", q int8 [N, K], scales float16 [N, 1], None, group_size=K):
           symmetric, one scale per output row: scale = max|w[n]| / 127 rounded to float16 first, then
           q = round(w / scale) clamped to [-127, 127].
  lab08_2  quantize_int4(w, group_size) -> QuantizedWeight("int4", packed uint8 [N, K/2], scales float16 [N, K/G],
           mins float16 [N, K/G], group_size): asymmetric, per group of G consecutive inputs of a row:
           min = the group's minimum, scale = (max - min) / 15 (both rounded to float16 first),
           q = round((w - min) / scale) clamped to [0, 15], packed two per byte in GGUF's order (in each block of 32,
           byte j holds element j in its low nibble and element j + 16 in its high nibble). ValueError when
           group_size does not divide K.
  lab08_3  dequantize(qw) -> float32 [N, K]: w = scale[n, k // G] * q[n, k] (+ min[n, k // G] for int4).
  lab08_4  qlinear(x, qw) -> x [..., K] times the dequantized matrix transposed, [..., N], in x's dtype.

Decisions. The codes are checked against the learner's own float16 scales and minimums (which must themselves be
the float16 roundings of the statistics above): a code may be either neighbour of a point halfway between two
integers (ties, and float32 division), and a code computed against the *unrounded* float32 scale is accepted too
(`q = round(w / s32)`, storing s16): it moves a code by one step only where w / scale lies within
|w| * |1/s16 - 1/s32| (< 0.07) of a half-way point, and costs at most that fraction of a step in error. Minimums
computed by the learner but not rounded before subtracting are accepted the same way.

Oracles, none of them minillm's quantization code: the statistics in float64, codes from the definition row by row
and group by group, a nibble unpacker written for the grader, dequantization and the matmul in float64. Hand-picked
cases run first, each naming the mistake it catches; hypothesis draws the rest.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
from hypothesis import example, given, strategies as st

from minillm.grading.core import GradingError, Hint, Task, as_tensor, diagnose, fail, minillm_objects, run_property
from minillm.quant.formats import QuantizedWeight

__all__ = ["check_lab08_1", "check_lab08_2", "check_lab08_3", "check_lab08_4", "TASKS", "int8_codes_ref",
           "int4_codes_ref", "unpack_ref", "dequantize_ref"]

PACK = 32        # the packing block of int4 (GGUF's Q4_0 / Q4_1 block)


# --------------------------------------------------------------------------- oracles

def _f16(x: torch.Tensor) -> torch.Tensor:
    """float64 -> the nearest float16 -> float64."""
    return x.to(torch.float16).to(torch.float64)


def int8_codes_ref(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale float64 [N] = f16(max|w| / 127), codes float64 [N, K] before rounding: w / scale, 0 where scale is 0)."""
    w = w.to(torch.float64)
    scale = _f16(w.abs().max(dim=1).values / 127)
    exact = torch.zeros_like(w)
    for n in range(w.shape[0]):
        if scale[n] > 0:
            exact[n] = w[n] / scale[n]
    return scale, exact


def int4_codes_ref(w: torch.Tensor, g: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(scale [N, K/g], min [N, K/g], codes before rounding [N, K]) for groups of g consecutive inputs."""
    w = w.to(torch.float64)
    n_rows, k = w.shape
    scale = torch.zeros(n_rows, k // g, dtype=torch.float64)
    mins = torch.zeros_like(scale)
    exact = torch.zeros_like(w)
    for j in range(k // g):
        block = w[:, j * g:(j + 1) * g]
        lo, hi = block.min(dim=1).values, block.max(dim=1).values
        mins[:, j], scale[:, j] = _f16(lo), _f16((hi - lo) / 15)
        for n in range(n_rows):
            if scale[n, j] > 0:
                exact[n, j * g:(j + 1) * g] = (block[n] - mins[n, j]) / scale[n, j]
    return scale, mins, exact


def unpack_ref(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K/2] -> codes int64 [N, K]: in each block of 16 bytes, byte j holds element j (low nibble) and
    element j + 16 (high nibble) of the block's 32 elements."""
    n_rows, half = packed.shape
    out = torch.zeros(n_rows, half * 2, dtype=torch.int64)
    p = packed.to(torch.int64)
    for b in range(half // (PACK // 2)):
        bytes_ = p[:, b * 16:(b + 1) * 16]
        out[:, b * PACK:b * PACK + 16] = bytes_ % 16
        out[:, b * PACK + 16:(b + 1) * PACK] = bytes_ // 16
    return out


def dequantize_ref(qw: QuantizedWeight) -> torch.Tensor:
    """float64 [N, K]: scale[n, k // G] * q[n, k] (+ min[n, k // G])."""
    q = unpack_ref(qw.qweight) if qw.kind == "int4" else qw.qweight.to(torch.int64)
    g = qw.group_size
    out = torch.zeros(q.shape, dtype=torch.float64)
    for j in range(q.shape[1] // g):
        cols = slice(j * g, (j + 1) * g)
        out[:, cols] = q[:, cols].to(torch.float64) * qw.scales[:, j:j + 1].to(torch.float64)
        if qw.mins is not None:
            out[:, cols] += qw.mins[:, j:j + 1].to(torch.float64)
    return out


# --------------------------------------------------------------------------- reading a QuantizedWeight

def _read_qw(got: Any, what: str, kind: str, n: int, k: int, g: int) -> QuantizedWeight:
    """The learner's result as a QuantizedWeight of exact types and shapes (copies of its tensors)."""
    __tracebackhide__ = True
    if type(got) is not QuantizedWeight:
        fail(f"{what} must return a minillm.quant.formats.QuantizedWeight, got a {type(got).__qualname__}",
             "build it with QuantizedWeight(kind, qweight, scales, mins, group_size): the engine's kernels read it.")
    if type(got.kind) is not str or got.kind != kind:
        fail(f"{what} returned a QuantizedWeight of kind {got.kind!r}, expected {kind!r}")
    if type(got.group_size) is not int or got.group_size != g:
        fail(f"{what} returned group_size={got.group_size!r}, expected {g}"
             + (" (one group per output row: the whole row, K)" if kind == "int8" else ""))
    q_shape, q_dtype = ((n, k), torch.int8) if kind == "int8" else ((n, k // 2), torch.uint8)
    qweight = as_tensor(got.qweight, f"{what}'s qweight")
    scales = as_tensor(got.scales, f"{what}'s scales")
    mins = None if got.mins is None else as_tensor(got.mins, f"{what}'s mins")
    for name, t, shape, dtype in (("qweight", qweight, q_shape, q_dtype), ("scales", scales, (n, k // g),
                                                                            torch.float16)):
        if tuple(t.shape) != shape or t.dtype != dtype:
            fail(f"{what}'s {name} is a {str(t.dtype).removeprefix('torch.')} tensor of shape {list(t.shape)}, "
                 f"expected {str(dtype).removeprefix('torch.')} of shape {list(shape)}"
                 + (" (two 4-bit codes per byte)" if name == "qweight" and kind == "int4" else ""))
    if kind == "int8" and mins is not None:
        fail(f"{what} returned mins: int8 here is symmetric (w = scale * q), mins must be None")
    if kind == "int4":
        if mins is None or tuple(mins.shape) != (n, k // g) or mins.dtype != torch.float16:
            fail(f"{what}'s mins must be a float16 tensor of shape {[n, k // g]} (one minimum per group), got "
                 + ("None" if mins is None else f"{str(mins.dtype).removeprefix('torch.')} {list(mins.shape)}"))
    return QuantizedWeight(kind, qweight, scales, mins, g)


def _close_f16(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """Equal up to one float16 rounding (relative 2^-10, or one subnormal step)."""
    return (got - want).abs() <= want.abs() * 2.0 ** -10 + 2.0 ** -24


def _codes_ok(codes: torch.Tensor, exact: torch.Tensor, lo: int, hi: int, slack: torch.Tensor) -> torch.Tensor:
    """Each code is round(exact) clamped to [lo, hi], up to ties and `slack` (the scale's own rounding), and never
    outside [lo, hi] (symmetric int8 is [-127, 127]: -128 has no positive twin)."""
    clamped = exact.clamp(lo, hi)
    inside = (codes >= lo) & (codes <= hi)
    return inside & ((codes.to(torch.float64) - clamped).abs() <= 0.5 + slack + 1e-6 * (1 + exact.abs()))


def _where(mask: torch.Tensor) -> tuple[int, ...]:
    return tuple(int(i) for i in mask.nonzero()[0])


# --------------------------------------------------------------------------- lab08_1 quantize_int8

def _int8_per_tensor(w: torch.Tensor) -> QuantizedWeight:
    s = (w.float().abs().max() / 127).half()
    q = torch.clamp(torch.round(w.float() / s.float()), -127, 127).to(torch.int8)
    return QuantizedWeight("int8", q, s.expand(w.shape[0], 1).clone(), None, w.shape[1])


def _int8_variant(rounding: Callable = torch.round, clamp: bool = True) -> Callable[..., QuantizedWeight]:
    def quant(w: torch.Tensor) -> QuantizedWeight:
        s = (w.float().abs().amax(1, keepdim=True) / 127).half()
        safe = torch.where(s.float() > 0, s.float(), torch.ones(()))
        q = rounding(w.float() / safe)
        q = torch.clamp(q, -127, 127) if clamp else q
        return QuantizedWeight("int8", q.to(torch.int8), s, None, w.shape[1])
    return quant


_INT8_MISTAKES = [
    ("one scale for the whole matrix: each output row (channel) needs its own max|w| / 127, or rows with small "
     "weights lose all their precision", _int8_per_tensor),
    ("rounded toward zero: converting with .to(torch.int8) (or int()) truncates; round to the nearest integer first",
     _int8_variant(rounding=torch.trunc)),
    ("codes outside [-127, 127]: max|w| / scale can exceed 127 after the scale is rounded to float16 (here it "
     "is above 127.5, which rounds to 128 and wraps to -128 in int8): clamp before the cast",
     _int8_variant(clamp=False)),
]

_INT8_HINT = Hint(
    "symmetric int8 per output channel: every row n of w gets its own scale, chosen so that the row's largest "
    "|weight| maps to 127; the codes are the weights divided by the scale, rounded to the nearest integer.",
    "compute the scale per row (a max over the input dimension), round it to float16 (the format stores it so), "
    "divide by that rounded scale, round to nearest, keep the codes in [-127, 127], store int8.",
    "s = (w.abs().amax(dim=1, keepdim=True) / 127).half(); q = torch.round(w / s.float()).clamp(-127, 127)"
    ".to(torch.int8); QuantizedWeight('int8', q, s, None, w.shape[1]) — with s = 1 where it is 0.")

# A row whose largest weight is 7.6e-4: its scale 5.98e-6 is a float16 subnormal and rounds down to 5.96e-6, so
# max|w| / scale = 127.6: without a clamp the code is 128, which int8 cannot hold.
# rows whose float16 scale is subnormal (rounded by up to 1%): |w| / scale passes 127.5 at the row's extreme, so
# the clamp decides the code; the negative extreme must clamp to -127 (symmetric), not -128
_TINY_ROW = torch.tensor([[7.6e-4, -3e-4] + [1e-5] * 30, [-7.6e-4, 3e-4] + [1e-5] * 30, [0.5, -1.0] + [0.25] * 30])


def _int8_case(quantize_int8: Callable[..., Any], w: torch.Tensor) -> None:
    __tracebackhide__ = True
    n, k = w.shape
    given_ = w.clone()
    got = quantize_int8(given_)
    qw = _read_qw(got, "quantize_int8(w)", "int8", n, k, k)
    if not torch.equal(given_, w):
        fail("quantize_int8 changed its input w in place: leave the float weights as they are")
    scale, exact = int8_codes_ref(w)
    scales = qw.scales.to(torch.float64)[:, 0]
    bad = ~_close_f16(scales, scale)
    if bad.any():
        r = _where(bad)[0]
        why = diagnose(quantize_int8, _INT8_MISTAKES, [(w.clone(),)], _same_qw)
        fail(f"the scale of row {r} is {scales[r].item():.6g}, expected max|w[{r}]| / 127 = {scale[r].item():.6g}"
             + (f" — {why}" if why else ""), _INT8_HINT)
    s32 = w.to(torch.float64).abs().max(dim=1).values / 127
    slack = w.to(torch.float64).abs() * (1 / scale.clamp_min(1e-30) - 1 / s32.clamp_min(1e-30)).abs()[:, None]
    codes = qw.qweight.to(torch.int64)
    zero_rows = (w == 0).all(dim=1)
    if (codes[zero_rows] != 0).any():
        r = next(int(i) for i in zero_rows.nonzero().flatten() if (codes[i] != 0).any())
        c = int((codes[r] != 0).nonzero()[0])
        fail(f"row {r} of w is all zeros: its scale is 0 and its codes must be 0, but code [{r}, {c}] is "
             f"{codes[r, c].item()} (a division by a zero scale, or by a stand-in for it, must not leak into the "
             "codes)",
             "a row of zeros has scale 0: give it codes 0 (don't divide by zero).")
    ok = _codes_ok(codes, exact, -127, 127, slack) | (scale[:, None] == 0)
    if not ok.all():
        r, c = _where(~ok)
        why = diagnose(quantize_int8, _INT8_MISTAKES, [(w.clone(),)], _same_qw)
        fail(f"the code of w[{r}, {c}] = {w[r, c].item():.6g} is {codes[r, c].item()}, expected "
             f"round(w / scale) = round({exact[r, c].item():.4f}) clamped to [-127, 127] = "
             f"{int(torch.round(exact[r, c]).clamp(-127, 127).item())}" + (f" — {why}" if why else ""), _INT8_HINT)


def _same_qw(a: Any, b: QuantizedWeight) -> bool:
    return (type(a) is QuantizedWeight and a.kind == b.kind and a.group_size == b.group_size
            and all(type(x) is torch.Tensor for x in a.tensors())
            and [tuple(t.shape) for t in a.tensors()] == [tuple(t.shape) for t in b.tensors()]
            and all(torch.equal(x, y) for x, y in zip(a.tensors(), b.tensors())))


def _weights(seed: int, n: int, k: int, spread: float, offset: float = 0.0) -> torch.Tensor:
    """Rows of different magnitudes (as real layers have), with some outliers."""
    g = torch.Generator().manual_seed(seed)
    rows = torch.exp(torch.randn(n, 1, generator=g) * spread) * 0.05
    w = torch.randn(n, k, generator=g) * rows
    w[torch.rand(n, k, generator=g) < 0.01] *= 8
    return w + offset


def verify_lab08_1(quantize_int8: Callable[..., Any]) -> None:
    _int8_case(quantize_int8, torch.tensor([[0.5, -1.0] + [0.25] * 30, [0.01, 0.02] + [-0.005] * 30]))
    _int8_case(quantize_int8, _TINY_ROW.clone())
    _int8_case(quantize_int8, torch.cat([torch.zeros(1, 64), _weights(1, 3, 64, 2.0)]))   # an all-zero row

    @given(seed=st.integers(0, 2**31 - 1), n=st.integers(1, 12), k=st.sampled_from([32, 64, 96, 160]),
           spread=st.sampled_from([0.0, 1.0, 3.0]), zero_row=st.none() | st.integers(0, 11))
    @example(seed=3, n=8, k=64, spread=3.0, zero_row=None)
    @example(seed=4, n=3, k=32, spread=1.0, zero_row=2)
    def prop(seed: int, n: int, k: int, spread: float, zero_row: int | None) -> None:
        w = _weights(seed, n, k, spread)
        if zero_row is not None:
            w[zero_row % n] = 0.0                                                # an all-zero row
        _int8_case(quantize_int8, w)

    run_property(prop, max_examples=25, hint=_INT8_HINT)


# --------------------------------------------------------------------------- lab08_2 quantize_int4

def _int4_variant(symmetric: bool = False, shift: int = 0, clamp: bool = True, nibbles: str = "gguf") -> Callable:
    def quant(w: torch.Tensor, group_size: int) -> QuantizedWeight:
        n, k = w.shape
        x = w.float().reshape(n, k // group_size, group_size)
        if symmetric:
            scale = (x.abs().amax(-1) / 7.5).half()
            mins = (-8 * scale.float()).half()
        else:
            lo, hi = x.amin(-1), x.amax(-1)
            scale, mins = ((hi - lo) / 15).half(), lo.half()
        if shift:
            scale, mins = torch.roll(scale, -shift, 1), torch.roll(mins, -shift, 1)
        safe = torch.where(scale.float() > 0, scale.float(), torch.ones(()))
        q = torch.round((x - mins.float().unsqueeze(-1)) / safe.unsqueeze(-1)).reshape(n, k)
        q = (q.clamp(0, 15) if clamp else q).to(torch.int64) % 256      # without the clamp, -1 becomes 255
        if nibbles == "pairs":
            packed = (q[:, 0::2] | (q[:, 1::2] << 4)) % 256
        else:
            b = q.reshape(n, k // PACK, 2, PACK // 2)
            packed = ((b[:, :, 0] | (b[:, :, 1] << 4)) % 256).reshape(n, k // 2)   # OR-ing spills 255 over both
        packed = packed.to(torch.uint8)
        return QuantizedWeight("int4", packed, scale, mins, group_size)
    return quant


_INT4_MISTAKES = [
    ("a symmetric scale (max|w| / 7.5 around zero): this data is not centred on zero, so half of the 16 levels go "
     "unused; use the group's own min and max", _int4_variant(symmetric=True)),
    ("group j got the scale and minimum of group j + 1: the group of column k is k // group_size",
     _int4_variant(shift=1)),
    ("the element pairs are packed as neighbours (2j, 2j + 1); minillm (and GGUF) pack element j with element j + 16 "
     "of each block of 32", _int4_variant(nibbles="pairs")),
    ("codes outside [0, 15] before the cast: (w - min) / scale is slightly negative when the float16 minimum rounds "
     "above the true minimum, and -1 becomes 255 in uint8 (15 in a nibble): clamp to [0, 15] first",
     _int4_variant(clamp=False)),
]

_INT4_HINT = Hint(
    "asymmetric int4 per group: each run of group_size consecutive inputs of a row gets its own minimum and a "
    "scale that spreads the range [min, max] over the 16 codes 0..15; the codes are packed two per byte.",
    "per group: min and scale = (max - min) / 15, both rounded to float16; code = round((w - min) / scale) kept in "
    "0..15; packing follows GGUF: in each block of 32 codes, byte j holds code j (low 4 bits) and code j + 16 "
    "(high 4 bits). minillm.quant.formats.pack_int4 packs that way, if you want to use it.",
    "x = w.reshape(N, K // G, G); lo, hi = x.amin(-1), x.amax(-1); s, m = ((hi - lo) / 15).half(), lo.half(); "
    "q = ((x - m[..., None]) / s[..., None]).round().clamp(0, 15); pack q.reshape(N, K); "
    "QuantizedWeight('int4', packed, s, m, G) — with s = 1 where it is 0.")


def _int4_case(quantize_int4: Callable[..., Any], w: torch.Tensor, g: int) -> None:
    __tracebackhide__ = True
    n, k = w.shape
    given_ = w.clone()
    got = quantize_int4(given_, g)
    qw = _read_qw(got, f"quantize_int4(w, {g})", "int4", n, k, g)
    if not torch.equal(given_, w):
        fail("quantize_int4 changed its input w in place: leave the float weights as they are")
    scale, mins, exact = int4_codes_ref(w, g)

    def why() -> str:
        found = diagnose(quantize_int4, _INT4_MISTAKES, [(w.clone(), g)], _same_qw)
        return f" — {found}" if found else ""
    got_s, got_m = qw.scales.to(torch.float64), qw.mins.to(torch.float64)
    for name, got_t, want in (("minimum", got_m, mins), ("scale", got_s, scale)):
        bad = ~_close_f16(got_t, want)
        if bad.any():
            r, j = _where(bad)
            formula = "min" if name == "minimum" else "(max - min) / 15"
            fail(f"the {name} of row {r}, group {j} (columns {j * g}..{(j + 1) * g - 1}) is "
                 f"{got_t[r, j].item():.6g}, expected {formula} of that group = {want[r, j].item():.6g}{why()}",
                 _INT4_HINT)
    codes = unpack_ref(qw.qweight)
    w64 = w.to(torch.float64)
    lo = torch.stack([w64[:, j * g:(j + 1) * g].min(dim=1).values for j in range(k // g)], 1)
    span = (torch.stack([w64[:, j * g:(j + 1) * g].max(dim=1).values for j in range(k // g)], 1) - lo) / 15
    inv = lambda s: 1 / s.clamp_min(1e-30)                                       # noqa: E731
    slack = ((w64 - lo.repeat_interleave(g, 1)).abs() * (inv(scale) - inv(span)).abs().repeat_interleave(g, 1)
             + (mins - lo).abs().repeat_interleave(g, 1) * inv(scale).repeat_interleave(g, 1))
    flat = torch.stack([w64[:, j * g:(j + 1) * g].max(dim=1).values for j in range(k // g)], 1) == lo
    for r, j in flat.nonzero().tolist():                         # a constant group: scale 0, codes 0
        nz = (codes[r, j * g:(j + 1) * g] != 0).nonzero().flatten()
        if len(nz):
            c = j * g + int(nz[0])
            fail(f"row {r}, group {j} (columns {j * g}..{(j + 1) * g - 1}) has all its weights equal to "
                 f"{w[r, j * g].item():.6g}: its scale is 0 and its codes must be 0, but the code of w[{r}, {c}] is "
                 f"{codes[r, c].item()} after unpacking (a division by a zero scale, or a stand-in for it, must not "
                 "leak into the codes)", "a group whose values are all equal has scale 0: give it codes 0.")
    ok = _codes_ok(codes, exact, 0, 15, slack) | (scale.repeat_interleave(g, 1) == 0)
    if not ok.all():
        r, c = _where(~ok)
        fail(f"the code of w[{r}, {c}] = {w[r, c].item():.6g} (group {c // g}) is {codes[r, c].item()} after "
             f"unpacking, expected round((w - min) / scale) = round({exact[r, c].item():.4f}) clamped to [0, 15] = "
             f"{int(torch.round(exact[r, c]).clamp(0, 15).item())}{why()}", _INT4_HINT)


def _int4_raises(quantize_int4: Callable[..., Any], k: int, g: int) -> None:
    __tracebackhide__ = True
    w = _weights(k + g, 2, k, 1.0)
    try:
        got = quantize_int4(w, g)
    except ValueError as e:
        if not str(e).strip():
            fail(f"quantize_int4(w of {k} columns, {g}) raised a ValueError without a message",
                 "say what is wrong and what to do: the group size must divide the number of columns.")
        return
    except (NotImplementedError, GradingError):
        raise
    except Exception as e:  # noqa: BLE001
        fail(f"quantize_int4(w of {k} columns, {g}) raised {type(e).__name__}, expected a ValueError: group size "
             f"{g} does not divide {k}", "check the shapes first and raise ValueError(\"...\") with a message.")
    fail(f"quantize_int4(w of {k} columns, {g}) returned a {type(got).__qualname__}, but {g} does not divide {k}: "
         "the last group would be partial (or the reshape wrong); raise ValueError",
         "check k % group_size before quantizing and raise ValueError with a message that says what to change.")


def verify_lab08_2(quantize_int4: Callable[..., Any]) -> None:
    _int4_case(quantize_int4, _weights(0, 4, 64, 1.0, offset=0.3), 32)           # not centred on zero
    _int4_case(quantize_int4, _weights(1, 3, 128, 2.0), 32)                       # groups of different ranges
    far = 100.0 + torch.rand(2, 64, generator=torch.Generator().manual_seed(5)) * 0.5
    _int4_case(quantize_int4, far, 32)                                            # fp16(min) rounds above min
    const = _weights(2, 2, 64, 1.0)
    const[0, :32] = 0.125                                                         # a constant group: scale 0
    const[1, 32:] = 0.0                                                           # an all-zero group
    _int4_case(quantize_int4, const, 32)
    _int4_raises(quantize_int4, 96, 64)
    _int4_raises(quantize_int4, 64, 128)

    @given(seed=st.integers(0, 2**31 - 1), n=st.integers(1, 8), blocks=st.integers(1, 6),
           g=st.sampled_from([32, 64, 128]), offset=st.sampled_from([0.0, 0.2, -1.0]),
           flat=st.none() | st.tuples(st.integers(0, 7), st.integers(0, 5), st.sampled_from([0.0, 0.0, -0.3, 2.5])))
    @example(seed=7, n=4, blocks=4, g=64, offset=0.2, flat=None)
    @example(seed=8, n=2, blocks=2, g=32, offset=0.0, flat=(1, 1, 0.0))
    def prop(seed: int, n: int, blocks: int, g: int, offset: float, flat: tuple | None) -> None:
        w = _weights(seed, n, blocks * g, 1.0, offset)
        if flat is not None:                                                     # a constant (or all-zero) group
            r, j, v = flat
            w[r % n, (j % blocks) * g:(j % blocks + 1) * g] = v
        _int4_case(quantize_int4, w, g)

    run_property(prop, max_examples=25, hint=_INT4_HINT)


# --------------------------------------------------------------------------- lab08_3 dequantize

def _random_qw(seed: int, kind: str, n: int, k: int, g: int) -> QuantizedWeight:
    """Random codes, scales and minimums (any bytes: every nibble value, negative scales too)."""
    gen = torch.Generator().manual_seed(seed)
    scales = (torch.randn(n, k // g, generator=gen) * 0.05).half()
    if kind == "int8":
        q = torch.randint(-127, 128, (n, k), generator=gen).to(torch.int8)
        return QuantizedWeight("int8", q, scales, None, g)
    packed = torch.randint(0, 256, (n, k // 2), generator=gen).to(torch.uint8)
    return QuantizedWeight("int4", packed, scales, (torch.randn(n, k // g, generator=gen) * 0.3).half(), g)


def _copy_qw(qw: QuantizedWeight) -> QuantizedWeight:
    return QuantizedWeight(qw.kind, qw.qweight.clone(), qw.scales.clone(),
                           None if qw.mins is None else qw.mins.clone(), qw.group_size)


def _deq_variant(nibbles: str = "gguf", mins: bool = True, groups: str = "interleave") -> Callable[..., torch.Tensor]:
    def deq(qw: QuantizedWeight) -> torch.Tensor:
        n, k = qw.shape
        if qw.kind == "int4":
            p = qw.qweight.to(torch.int64)
            if nibbles == "pairs":
                q = torch.stack([p % 16, p // 16], -1).reshape(n, k)
            else:
                b = p.reshape(n, k // PACK, 1, PACK // 2)
                q = torch.cat([b % 16, b // 16], 2).reshape(n, k)
        else:
            q = qw.qweight.to(torch.int64)
        rep = (lambda t: t.float().repeat_interleave(qw.group_size, 1)) if groups == "interleave" else \
            (lambda t: t.float().repeat(1, qw.group_size))
        w = q.float() * rep(qw.scales)
        if qw.mins is not None and mins:
            w = w + rep(qw.mins)
        return w
    return deq


_DEQ_MISTAKES = [
    ("the minimums are missing: int4 here is asymmetric, w = scale * q + min", _deq_variant(mins=False)),
    ("the nibbles are read as neighbours (2j, 2j + 1); the format packs element j with element j + 16 of each "
     "block of 32", _deq_variant(nibbles="pairs")),
    ("the scales are tiled (repeat) instead of expanded group by group (repeat_interleave): column k belongs to "
     "group k // group_size, not k % (number of groups)", _deq_variant(groups="tile")),
]

_DEQ_HINT = Hint(
    "undo the format: unpack the codes (int4: two per byte), then multiply every code by the scale of its group "
    "(and add the group's minimum for int4).",
    "the group of column k is k // group_size; in each block of 32 int4 codes, byte j holds code j in its low 4 "
    "bits and code j + 16 in its high 4 bits. Return float32 [N, K].",
    "q = codes [N, K]; s = qw.scales.float().repeat_interleave(G, dim=1); w = q * s (+ qw.mins.float()"
    ".repeat_interleave(G, dim=1) for int4).")


def _deq_case(dequantize: Callable[..., Any], qw: QuantizedWeight) -> None:
    __tracebackhide__ = True
    given_ = _copy_qw(qw)
    got = as_tensor(dequantize(given_), "dequantize(qw)")
    n, k = qw.shape
    if tuple(got.shape) != (n, k) or got.dtype != torch.float32:
        fail(f"dequantize(qw) returned a {str(got.dtype).removeprefix('torch.')} tensor of shape {list(got.shape)}, "
             f"expected float32 of shape {[n, k]}")
    want = dequantize_ref(qw)
    err = (got.to(torch.float64) - want).abs()
    tol = 1e-6 * want.abs() + 1e-7
    if (err > tol).any():
        r, c = _where(err > tol)
        found = diagnose(dequantize, _DEQ_MISTAKES, [(_copy_qw(qw),)],
                         lambda a, b: type(a) is torch.Tensor and a.shape == b.shape and torch.allclose(
                             a.float(), b.float(), rtol=1e-5, atol=1e-6))
        fail(f"{qw.kind} g{qw.group_size}, [{n}, {k}]: w[{r}, {c}] came out {got[r, c].item():.6g}, expected "
             f"{want[r, c].item():.6g}" + (f" — {found}" if found else ""), _DEQ_HINT)


def verify_lab08_3(dequantize: Callable[..., Any]) -> None:
    for seed, (kind, n, k, g) in enumerate((("int8", 3, 64, 64), ("int4", 2, 64, 32), ("int4", 3, 128, 64),
                                            ("int8", 2, 96, 32))):
        _deq_case(dequantize, _random_qw(seed, kind, n, k, g))

    @given(seed=st.integers(0, 2**31 - 1), kind=st.sampled_from(["int8", "int4"]), n=st.integers(1, 8),
           blocks=st.integers(1, 6), g=st.sampled_from([32, 64]))
    def prop(seed: int, kind: str, n: int, blocks: int, g: int) -> None:
        _deq_case(dequantize, _random_qw(seed, kind, n, blocks * g, g))

    run_property(prop, max_examples=25, hint=_DEQ_HINT)


# --------------------------------------------------------------------------- lab08_4 qlinear

_QLINEAR_HINT = Hint(
    "a weight-only quantized linear layer computes the same x · Wᵀ as a float one, with W rebuilt from its codes; "
    "the result has x's shape but for the last dimension, and x's dtype.",
    "dequantize W to [N, K], then multiply: x [..., K] times Wᵀ [K, N] -> [..., N]; cast W to x's dtype (or "
    "compute in float32 and cast the result back).",
    "return x @ dequantize(qw).to(x.dtype).T")


def _qlinear_case(qlinear: Callable, qw: QuantizedWeight, lead: tuple[int, ...], dtype: torch.dtype, seed: int) -> None:
    __tracebackhide__ = True
    n, k = qw.shape
    x = torch.randn(*lead, k, generator=torch.Generator().manual_seed(seed)).to(dtype)
    x_given, qw_given = x.clone(), _copy_qw(qw)
    got = as_tensor(qlinear(x_given, qw_given), "qlinear(x, qw)")
    name = str(dtype).removeprefix("torch.")
    if tuple(got.shape) != (*lead, n) or got.dtype != dtype:
        fail(f"qlinear(x {name} {[*lead, k]}, a [{n}, {k}] matrix) returned {str(got.dtype).removeprefix('torch.')} "
             f"of shape {list(got.shape)}, expected {name} of shape {[*lead, n]}", _QLINEAR_HINT)
    want = x.to(torch.float64) @ dequantize_ref(qw).T
    scale = (x.to(torch.float64).abs() @ dequantize_ref(qw).abs().T)      # the size of the sum's terms
    rel = 2e-2 if dtype == torch.bfloat16 else 1e-5
    err = (got.to(torch.float64) - want).abs()
    if (err > rel * scale + 1e-6).any():
        idx = _where(err > rel * scale + 1e-6)
        hint = ""
        wt = dequantize_ref(qw)
        if qw.mins is not None and torch.allclose(got.to(torch.float64), x.to(torch.float64) @ (
                wt - dequantize_ref(QuantizedWeight(qw.kind, qw.qweight, torch.zeros_like(qw.scales), qw.mins,
                                                    qw.group_size))).T, rtol=rel, atol=1e-4):
            hint = " — the minimums are missing: int4 here is w = scale * q + min"
        fail(f"qlinear(x {name} {[*lead, k]}, {qw.kind} g{qw.group_size} [{n}, {k}]): output{list(idx)} is "
             f"{got[idx].item():.6g}, expected x · dequantize(W)ᵀ = {want[idx].item():.6g}{hint}", _QLINEAR_HINT)


def verify_lab08_4(qlinear: Callable[..., Any]) -> None:
    cases = ((("int4", 4, 64, 32), (3,), torch.float32), (("int8", 5, 64, 64), (1,), torch.float32),
             (("int4", 3, 128, 64), (2, 3), torch.float32), (("int4", 6, 64, 32), (2,), torch.bfloat16))
    for seed, (spec, lead, dtype) in enumerate(cases):
        _qlinear_case(qlinear, _random_qw(seed, *spec), lead, dtype, seed)

    @given(seed=st.integers(0, 2**31 - 1), kind=st.sampled_from(["int8", "int4"]), n=st.integers(1, 8),
           blocks=st.integers(1, 4), g=st.sampled_from([32, 64]), rows=st.integers(1, 20),
           dtype=st.sampled_from([torch.float32, torch.bfloat16]))
    def prop(seed: int, kind: str, n: int, blocks: int, g: int, rows: int, dtype: torch.dtype) -> None:
        _qlinear_case(qlinear, _random_qw(seed, kind, n, blocks * g, g), (rows,), dtype, seed)

    run_property(prop, max_examples=20, hint=_QLINEAR_HINT)


# --------------------------------------------------------------------------- the tasks

_FORMATS = "minillm.quant.formats"
_KERNEL = "minillm.kernels.cpu_qgemm"

TASKS = {t.id: t for t in (
    Task("lab08_1", what="quantize_int8", verify=verify_lab08_1,
         engine=minillm_objects(f"{_FORMATS}:quantize"), oracles=lambda: [int8_codes_ref]),
    Task("lab08_2", what="quantize_int4", verify=verify_lab08_2,
         engine=minillm_objects(f"{_FORMATS}:quantize"), oracles=lambda: [int4_codes_ref]),
    Task("lab08_3", what="dequantize", verify=verify_lab08_3,
         engine=minillm_objects(f"{_KERNEL}:dequantize", f"{_FORMATS}:QuantizedWeight.dequantize"),
         oracles=lambda: [dequantize_ref]),
    Task("lab08_4", what="qlinear", verify=verify_lab08_4,
         engine=minillm_objects(f"{_KERNEL}:qlinear", f"{_KERNEL}:reference", f"{_KERNEL}:dequantize",
                                f"{_FORMATS}:QuantizedWeight.dequantize"),
         oracles=lambda: [dequantize_ref]),
)}

check_lab08_1 = TASKS["lab08_1"].checker(
    "quantize_int8(w) -> QuantizedWeight: symmetric int8, one float16 scale per output row.")
check_lab08_2 = TASKS["lab08_2"].checker(
    "quantize_int4(w, group_size) -> QuantizedWeight: asymmetric int4 per group, packed in GGUF's nibble order.")
check_lab08_3 = TASKS["lab08_3"].checker("dequantize(qw) -> float32 [N, K]: the matrix a QuantizedWeight stands for.")
check_lab08_4 = TASKS["lab08_4"].checker("qlinear(x, qw) -> x · dequantize(qw)ᵀ in x's dtype.")
