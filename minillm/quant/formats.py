"""Quantized weight formats: int8 (symmetric, per output channel or per group) and int4 (asymmetric, group-wise).

    int8:  w[n, k] = scale[n, k // G] * q[n, k]                  q in [-127, 127]   (G = K: per output channel)
    int4:  w[n, k] = scale[n, k // G] * q[n, k] + min[n, k // G] q in [0, 15]

Scales and mins are float16 (what GGUF stores; half the bytes of float32). Before quantizing, each scale is rounded
to float16 first, so the integers are chosen against the scale that dequantization will actually use.

int4 values are packed two per byte in blocks of 32 — byte j of a block holds element j in its low nibble and
element j + 16 in its high nibble — which is GGUF's Q4_0/Q4_1 layout, so those checkpoints load by copying bytes.
Group sizes are multiples of 32 (the packing block, and the kernel's activation block).

W8A8 (`act="int8"`) is int8 per output channel whose activations are quantized too, per token at run time:

    x[m, k] ~ step[m] * c[m, k]     step[m] = max_k |x[m, k]| / W8A8_LEVELS,  c = round(x / step) in [-L, L]
    y[m, n] = step[m] * scale[n] * sum_k c[m, k] q[n, k]      (the sum is an exact integer)

W8A8_LEVELS is 63, not 127: the fast CPU path (FBGEMM on AVX2, minillm/kernels/cpu_w8a8.py) multiplies uint8 by int8
with vpmaddubsw, whose int16 pair sums saturate for codes above 127 (measured: 8160 instead of 1032256 with the full
range); PyTorch's own dynamic quantization on x86 makes the same choice (`reduce_range`). Every implementation
uses the same 63 so results do not depend on the machine.

A W8A8 matrix may carry SmoothQuant factors `smooth` = s (float32 [K], one per input channel): it then holds
W diag(s), and activations are divided by s before their per-token quantization, so y = (x / s)(W diag(s))^T = x W^T
in exact arithmetic. Dividing the outlier channels of x by large s (and scaling W's columns up by the same s) moves
the quantization difficulty from the activations, whose per-token step one outlier channel sets, to the weights,
which have a step per output channel (minillm/calibration/smoothquant.py chooses s from calibration text).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

BLOCK = 32
KINDS = ("int8", "int4")
ACTS = (None, "int8")     # None: weight-only (float activations); "int8": W8A8, per-token dynamic activations
W8A8_LEVELS = 63          # W8A8 activation codes lie in [-63, 63] (module docstring: why not 127)


@dataclass(frozen=True)
class QuantSpec:
    """What to quantize a weight to. `group_size=None` for int8 means one scale per output channel; `act="int8"`
    (int8 per channel only) also quantizes the activations per token at run time (W8A8)."""
    kind: str
    group_size: int | None = None
    act: str | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown quantization kind {self.kind!r}: choose one of {', '.join(KINDS)}")
        if self.kind == "int4" and self.group_size is None:
            raise ValueError("int4 needs a group size (a multiple of 32, e.g. 32 or 128)")
        if self.group_size is not None and (self.group_size < BLOCK or self.group_size % BLOCK):
            raise ValueError(f"group size {self.group_size} is not a positive multiple of {BLOCK}: "
                             f"use 32, 64, 128, ...")
        if self.act not in ACTS:
            raise ValueError(f"unknown activation quantization {self.act!r}: use None (weight-only) or 'int8'")
        if self.act is not None and (self.kind != "int8" or self.group_size is not None):
            raise ValueError(f"act='int8' (W8A8) needs int8 weights with one scale per output channel: use "
                             f"QuantSpec('int8', act='int8'), not {self.kind} with group size {self.group_size}")

    def group_for(self, in_features: int) -> int:
        """The group size used for a matrix with `in_features` columns; raises if it does not divide them."""
        g = in_features if self.group_size is None else self.group_size
        if in_features % BLOCK or in_features % g:
            raise ValueError(f"{self.kind} group size {g} does not divide the input dimension {in_features} "
                             f"(it must be a multiple of {BLOCK} that divides it); pick another group size or "
                             f"leave this layer unquantized")
        return g


@dataclass
class QuantizedWeight:
    """A [N, K] matrix in one of the formats above. `qweight` is int8 [N, K] (int8) or uint8 [N, K/2] (int4)."""
    kind: str
    qweight: torch.Tensor
    scales: torch.Tensor             # float16 [N, K / group_size]
    mins: torch.Tensor | None        # float16 [N, K / group_size] for int4, None for int8
    group_size: int
    act: str | None = None           # "int8": W8A8, activations quantized per token at run time (see above)
    smooth: torch.Tensor | None = None   # W8A8 only: SmoothQuant factors s [K] float32 (see above), or None
    # Copies that run batched steps faster (built on first use by minillm/kernels/cpu_qgemm.py, never by a model
    # that only decodes small batches): name -> (object, bytes held)
    cache: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def shape(self) -> tuple[int, int]:
        n, k = self.qweight.shape
        return (n, k * 2) if self.kind == "int4" else (n, k)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    @property
    def cache_nbytes(self) -> int:
        """Extra bytes held by the kernels' copies built so far (0 until the first product: then the tiles, the
        weight's own bytes reordered; the batched path's copy once a step has more than TILES_MAX_ROWS rows)."""
        return sum(nbytes + (obj.cache_nbytes if isinstance(obj, QuantizedWeight) else 0)
                   for obj, nbytes in self.cache.values())

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.qweight, self.scales, self.mins, self.smooth) if t is not None]

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        n, k = self.shape
        q = unpack_int4(self.qweight) if self.kind == "int4" else self.qweight
        g = self.group_size
        w = q.float().view(n, k // g, g) * self.scales.float().unsqueeze(-1)
        if self.mins is not None:
            w = w + self.mins.float().unsqueeze(-1)
        w = w.reshape(n, k)
        return (w if self.smooth is None else w / self.smooth).to(dtype)

    def take_rows(self, index: torch.Tensor) -> "QuantizedWeight":
        """The rows at `index` (an embedding lookup, or a row permutation)."""
        return QuantizedWeight(self.kind, self.qweight[index], self.scales[index],
                               None if self.mins is None else self.mins[index], self.group_size, self.act, self.smooth)

    def check(self) -> "QuantizedWeight":
        """Refuse what the kernels would misread (they take raw pointers, so a float32 scale read as float16 would be
        silently wrong math): the kind, dtypes, shapes, group size and device of the tensors. Returns self."""
        want = {"int8": torch.int8, "int4": torch.uint8}
        if self.kind not in want:
            raise ValueError(f"unknown quantized kind {self.kind!r}: use one of {', '.join(want)}")
        q = self.qweight
        if not isinstance(q, torch.Tensor) or q.dim() != 2 or q.dtype != want[self.kind]:
            raise ValueError(f"{self.kind} qweight must be a 2-D {want[self.kind]} tensor "
                             f"({'[N, K/2], two values per byte' if self.kind == 'int4' else '[N, K]'}), got "
                             f"{getattr(q, 'dtype', type(q).__name__)} {tuple(getattr(q, 'shape', ()))}")
        n, k = self.shape
        g = self.group_size
        if not isinstance(g, int) or isinstance(g, bool) or g < BLOCK or g % BLOCK or k % g:
            raise ValueError(f"group_size {g!r} must be a multiple of {BLOCK} that divides K = {k}")
        for name, t in (("scales", self.scales), ("mins", self.mins)):
            if name == "mins" and self.kind == "int8":
                if t is not None:
                    raise ValueError("int8 is symmetric: mins must be None")
                continue
            if not isinstance(t, torch.Tensor) or t.dtype != torch.float16 or tuple(t.shape) != (n, k // g):
                raise ValueError(f"{name} must be float16 of shape {(n, k // g)} (one per row and group), got "
                                 f"{getattr(t, 'dtype', type(t).__name__)} {tuple(getattr(t, 'shape', ()))}: "
                                 f"use .half() and one column per group")
        if any(t.device != q.device for t in self.tensors()):
            raise ValueError("qweight, scales and mins must be on one device")
        if self.act not in ACTS or (self.act is not None and (self.kind != "int8" or g != k)):
            raise ValueError(f"act={self.act!r}: use None (weight-only), or 'int8' (W8A8) with int8 weights and one "
                             f"scale per output channel")
        s = self.smooth
        if s is not None and (self.act is None or not isinstance(s, torch.Tensor) or s.dtype != torch.float32
                              or tuple(s.shape) != (k,) or not bool(torch.isfinite(s).all() and (s > 0).all())):
            raise ValueError(f"smooth must be None, or for a W8A8 matrix positive finite float32 factors of shape "
                             f"({k},), one per input channel; got {getattr(s, 'dtype', type(s).__name__)} "
                             f"{tuple(getattr(s, 'shape', ()))} with act={self.act!r}")
        return self

    @staticmethod
    def cat(parts: list["QuantizedWeight"]) -> "QuantizedWeight":
        """Stack matrices by output rows (fused q/k/v, gate/up); they must share kind and group size."""
        first = parts[0]
        same_smooth = all((p.smooth is None) == (first.smooth is None)
                          and (p.smooth is None or torch.equal(p.smooth, first.smooth)) for p in parts)
        if not same_smooth or any(p.kind != first.kind or p.group_size != first.group_size
                                  or p.shape[1] != first.shape[1] or p.act != first.act for p in parts):
            raise ValueError("cannot fuse matrices quantized differently: "
                             + ", ".join(f"{p.kind}/g{p.group_size}/act {p.act}" for p in parts))
        mins = None if first.mins is None else torch.cat([p.mins for p in parts])
        return QuantizedWeight(first.kind, torch.cat([p.qweight for p in parts]),
                               torch.cat([p.scales for p in parts]), mins, first.group_size, first.act, first.smooth)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """[N, K] integers in 0..15 -> [N, K/2] uint8, GGUF's nibble order within each block of 32."""
    n, k = q.shape
    b = q.to(torch.uint8).view(n, k // BLOCK, 2, BLOCK // 2)
    return (b[:, :, 0] | (b[:, :, 1] << 4)).reshape(n, k // 2)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of pack_int4: [N, K/2] uint8 -> [N, K] uint8 in 0..15."""
    n, half = packed.shape
    b = packed.view(n, half // (BLOCK // 2), 1, BLOCK // 2)
    return torch.cat([b & 0x0F, b >> 4], dim=2).reshape(n, half * 2)


def quantize(w: torch.Tensor, spec: QuantSpec, smooth: torch.Tensor | None = None) -> QuantizedWeight:
    """Round-to-nearest quantization of a float [N, K] matrix (W8A8 with `smooth`: of W diag(smooth), see above)."""
    if w.dim() != 2:
        raise ValueError(f"expected a 2-D weight matrix, got shape {tuple(w.shape)}")
    if smooth is not None:
        if spec.act != "int8":
            raise ValueError("smoothing factors go with W8A8 (QuantSpec('int8', act='int8')): weight-only layers "
                             "see float activations and need none")
        qw = quantize(w.detach().float() * smooth.float().view(1, -1), spec)
        qw.smooth = smooth.detach().float().contiguous()
        return qw.check()
    n, k = w.shape
    g = spec.group_for(k)
    x = w.detach().float().reshape(n, k // g, g)
    if spec.kind == "int8":
        scale = (x.abs().amax(-1) / 127).half()
        safe = torch.where(scale.float() > 0, scale.float(), torch.ones(()))
        q = torch.clamp(torch.round(x / safe.unsqueeze(-1)), -127, 127).to(torch.int8)
        return QuantizedWeight("int8", q.reshape(n, k), scale, None, g, spec.act)
    lo, hi = x.amin(-1), x.amax(-1)
    scale, mins = ((hi - lo) / 15).half(), lo.half()
    safe = torch.where(scale.float() > 0, scale.float(), torch.ones(()))
    q = torch.clamp(torch.round((x - mins.float().unsqueeze(-1)) / safe.unsqueeze(-1)), 0, 15)
    return QuantizedWeight("int4", pack_int4(q.reshape(n, k)), scale, mins, g)


ACT_LEVELS = 32767   # the CPU kernel quantizes activations to int16 (csrc/qgemm.c says why not int8)
MIN_ACT_STEP = 3.0e-39   # a block with a smaller step (values under ~1e-34) gets codes 0, as csrc/qgemm.c's FLT_MIN_STEP


def quantize_activations(x: torch.Tensor, levels: int = ACT_LEVELS) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Dynamic quantization of activations per row and per block of 32 to integers in [-levels, levels] (what the
    CPU kernel does first): returns q [M, K] (int16), scale float32 [M, K/32], and scale * sum(q) per block
    [M, K/32] (for int4's minimums)."""
    m, k = x.shape
    xb = x.float().reshape(m, k // BLOCK, BLOCK)
    d = xb.abs().amax(-1) / levels
    inv = torch.where(d > MIN_ACT_STEP, 1.0 / d, torch.zeros(()))     # a smaller step's inverse overflows
    q = torch.round(xb * inv.unsqueeze(-1)).clamp(-levels, levels)
    return q.to(torch.int16).reshape(m, k), d, d * q.sum(-1)


def quantize_per_token(x: torch.Tensor, levels: int = W8A8_LEVELS) -> tuple[torch.Tensor, torch.Tensor]:
    """W8A8's activation quantization: each row of x [M, K] gets its own symmetric step max|row| / levels (at least
    float32's smallest normal number, so an all-zero row divides safely and gets zero codes). Returns the codes
    (float32 holding integers in [-levels, levels]) and the steps [M] (float32). Division, not multiplication by
    1/step, so that an independent implementation of the definition rounds exactly the same values."""
    xf = x.float()
    step = (xf.abs().amax(-1) / levels).clamp_min_(torch.finfo(torch.float32).tiny)
    return torch.div(xf, step.unsqueeze(-1)).round_().clamp_(-levels, levels), step
