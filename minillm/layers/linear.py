"""Tensor-parallel layers (Megatron-style): each rank holds a slice of every matrix, and one all-reduce per
sub-block puts the pieces back together.

    y = x W^T with W = [W_0; W_1; ...] split by output rows  -> ColumnParallelLinear: rank r computes y[:, part r]
                                                                 from the full x. No communication.
    y = x W^T with W = [W_0, W_1, ...] split by input columns -> RowParallelLinear: rank r computes x[:, part r] W_r^T,
                                                                 a partial sum; all_reduce adds them (then the bias,
                                                                 once).
Attention: QKV is column-parallel by whole heads (each rank's query heads with the KV heads they read), attention
itself is local to the rank, o_proj is row-parallel -> one all-reduce. MLP: gate/up column-parallel (each rank takes
its slice of gate *and* of up), down row-parallel -> one all-reduce. Two all-reduces of [tokens, hidden] per layer.

Every layer loads its own slice from a weight source (`shape` + `read(rows=, cols=)`), so a rank never holds
(or, for safetensors and GGUF, even reads) another rank's slice. With one rank every layer is its plain version.
"""
from __future__ import annotations

import math
from typing import Protocol, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from minillm.distributed.comm import Communicator
from minillm.kernels.cpu_qgemm import qlinear
from minillm.quant.formats import QuantizedWeight, QuantSpec, quantize

SINGLE = Communicator()


class WeightSource(Protocol):
    """A checkpoint tensor that can be read in part (see loading/sources.py)."""
    shape: tuple[int, ...]

    def read(self, rows: slice | None = None, cols: slice | None = None) -> torch.Tensor: ...


def slice_index(rows: slice | None, cols: slice | None, ndim: int) -> tuple:
    full = slice(None)
    return (rows or full,) if ndim == 1 else (rows or full, cols or full)


class TensorSource:
    """A tensor already in memory (the checkpoint readers in loading/sources.py are the other kinds)."""

    def __init__(self, t: torch.Tensor) -> None:
        self.t, self.shape = t, tuple(t.shape)

    def read(self, rows: slice | None = None, cols: slice | None = None) -> torch.Tensor:
        return self.t[slice_index(rows, cols, self.t.dim())].float().clone()


def as_source(x: "torch.Tensor | WeightSource") -> WeightSource:
    return TensorSource(x) if isinstance(x, torch.Tensor) else x


def _check_shape(src: WeightSource, want: tuple[int, ...], what: str) -> None:
    if tuple(src.shape) != tuple(want):
        raise ValueError(f"{what}: checkpoint shape {tuple(src.shape)} != expected {tuple(want)}")


class MegatronRules:
    """Which slice of a matrix each rank holds, and how a row-parallel layer finishes (minillm's implementation of
    interfaces.TensorParallelRules; a learner's rules plug in through LlamaModel(rules=) / LLM(tp_rules=))."""

    @staticmethod
    def column_rows(num_units: int, unit_size: int, rank: int, world_size: int) -> range:
        """Rows of one column-parallel part (`num_units` units of `unit_size` rows: heads, or single columns) that
        `rank` holds. Units split evenly; with fewer units than ranks each unit is replicated on world/units
        consecutive ranks (a KV head with its query group)."""
        if num_units % world_size == 0:
            per = num_units // world_size
            return range(rank * per * unit_size, (rank + 1) * per * unit_size)
        if world_size % num_units == 0:
            unit = rank // (world_size // num_units)
            return range(unit * unit_size, (unit + 1) * unit_size)
        raise ValueError(f"{num_units} units neither split over nor replicate evenly on {world_size} ranks")

    @staticmethod
    def row_cols(input_size: int, rank: int, world_size: int) -> range:
        """Input columns of a row-parallel matrix that `rank` holds."""
        if input_size % world_size:
            raise ValueError(f"{input_size} input features do not split over {world_size} ranks")
        per = input_size // world_size
        return range(rank * per, (rank + 1) * per)

    @staticmethod
    def column_forward(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, comm) -> torch.Tensor:
        """This rank's output columns: no communication (the next layer consumes them split)."""
        return F.linear(x, weight, bias)

    @staticmethod
    def row_forward(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, comm) -> torch.Tensor:
        """This rank's partial product, summed over the ranks; the bias once, after the sum."""
        y = comm.all_reduce(F.linear(x, weight))
        return y if bias is None else y + bias


MEGATRON = MegatronRules()


def _slice(r: range) -> slice:
    return slice(r.start, r.stop)


class Quantizable:
    """A layer whose weight may be held quantized (minillm/quant/formats.py) instead of as a float Parameter.

    Quantized, `weight` is None and `quant` holds the packed matrix (its tensors registered as buffers, so
    module.buffers() and the byte counts see them); `linear(x)` runs the quantized matmul. The tensor-parallel
    rules' `*_forward` take a float weight, so a quantized layer keeps Megatron's communication itself (a learner's
    rules are refused with quantization: see LlamaModel.quantize_)."""
    quant: QuantizedWeight | None = None
    QUANT_BUFFERS = ("qweight", "scales", "mins", "smooth")      # QuantizedWeight's tensors, registered as buffers

    @property
    def w8a8_smooth(self) -> torch.Tensor | None:
        """SmoothQuant factors for the W8A8 copy of batched steps (calibration/smoothquant.py), or None. A buffer (it moves
        with the module)."""
        return self._buffers.get("smooth_factors")

    def set_w8a8_smooth(self, s: torch.Tensor | None) -> None:
        """Give this weight-only layer the SmoothQuant factors its batched steps' W8A8 copy is made with (None: no
        W8A8 copy by default; batched steps use the float16 copy)."""
        if s is not None:
            k = self.quant.shape[1] if self.quant is not None else self.weight.shape[1]
            s = s.detach().float().contiguous()
            if tuple(s.shape) != (k,) or not bool(torch.isfinite(s).all() and (s > 0).all()):
                raise ValueError(f"SmoothQuant factors must be {k} positive finite numbers, got shape "
                                 f"{tuple(s.shape)}")
            self.register_buffer("smooth_factors", s)
        else:
            self._buffers.pop("smooth_factors", None)
        if self.quant is not None:
            self.quant.cache.pop("w8a8-smooth", None)

    def set_quantized(self, qw: QuantizedWeight) -> None:
        want = tuple(self.weight.shape) if self.weight is not None else tuple(self.quant.shape)
        qw.check()
        if tuple(qw.shape) != want:
            raise ValueError(f"quantized weight shape {tuple(qw.shape)} != this layer's {want}")
        if not all(t.is_contiguous() for t in qw.tensors()):   # the kernels read rows in place
            qw = QuantizedWeight(qw.kind, *(None if t is None else t.contiguous()
                                            for t in (qw.qweight, qw.scales, qw.mins)), qw.group_size, qw.act,
                                 None if qw.smooth is None else qw.smooth.contiguous())
        self.register_parameter("weight", None)
        self.quant = qw
        for name, t in zip(self.QUANT_BUFFERS, (qw.qweight, qw.scales, qw.mins, qw.smooth)):
            if t is not None:
                self.register_buffer(name, t)
            else:
                self._buffers.pop(name, None)

    def _apply(self, fn, recurse: bool = True):
        """module.to(device) / .cuda() / .half() move the registered buffers; `quant` must then hold the moved
        tensors, not the old ones. Scales and minimums are float16 by the format's definition (the kernels read
        their bits as such), so a dtype cast of the module leaves them float16; the kernel copies are
        dropped (they belong to the old device)."""
        out = super()._apply(fn, recurse)
        qw = self.quant
        if qw is not None:
            def buf(name):
                t = self._buffers.get(name)
                if t is None or name == "qweight":
                    return t
                want = torch.float32 if name == "smooth" else torch.float16
                return t if t.dtype == want else t.to(want)
            moved = QuantizedWeight(qw.kind, buf("qweight"), buf("scales"), buf("mins"), qw.group_size, qw.act,
                                    buf("smooth"))
            if not all(a is b for a, b in zip(moved.tensors(), qw.tensors())):
                self.set_quantized(moved)
        return out

    def quantize_(self, spec: QuantSpec, quantizer=None) -> None:
        """Quantize this layer's float weight in place (`quantizer(weight, spec)`, default round to nearest). The
        result is checked: a quantizer must return a QuantizedWeight of this layer's shape."""
        qw = (quantizer or quantize)(self.weight, spec)
        if not isinstance(qw, QuantizedWeight):
            raise TypeError(f"a quantizer must return a minillm.quant.formats.QuantizedWeight, got "
                            f"{type(qw).__name__}")
        self.set_quantized(qw)

    def dequantize_(self) -> None:
        """Hold this layer's weight as the float Parameter its quantized form stands for (the oracle a quantized
        layer is compared with); a float layer is left as it is."""
        qw = self.quant
        if qw is None:
            return
        w = qw.dequantize()
        for name in self.QUANT_BUFFERS:
            self._buffers.pop(name, None)
        self.quant = None
        self.weight = nn.Parameter(w, requires_grad=False)

    def linear(self, x: torch.Tensor, sampled: bool = False) -> torch.Tensor:
        """x times this rank's matrix (transposed); no communication, no bias. `sampled`: x holds sampled rows only
        (the LM head's; cpu_qgemm.qlinear says what changes)."""
        if self.quant is None:
            return F.linear(x, self.weight)
        if x.is_cuda:
            from minillm.kernels.triton_qgemm import qlinear_cuda
            return qlinear_cuda(x, self.quant)
        return qlinear(x, self.quant, self._buffers.get("smooth_factors"), sampled)


def _read_quantized(src, rows: slice | None = None, cols: slice | None = None) -> QuantizedWeight | None:
    """The slice in the checkpoint's own quantized format, when the source has one minillm takes directly."""
    reader = getattr(src, "read_quantized", None)
    return None if reader is None else reader(rows=rows, cols=cols)


class ColumnParallelLinear(Quantizable, nn.Module):
    """Output features split over ranks; the output stays split (the next layer is row-parallel or local).

    The matrix is one or more `parts` stacked by rows, each made of `num_units` units of `unit_size` rows (query
    heads of head_dim rows; or single columns of the MLP); every part is split on its own, so a fused gate/up holds
    slice r of gate *and* of up — not slice r of their concatenation, which would give rank 0 all of gate."""

    def __init__(self, input_size: int, parts: Sequence[tuple[str | None, int, int]], bias: bool = False,
                 comm: Communicator | None = None, rules=None) -> None:
        super().__init__()
        self.comm, self.rules = comm or SINGLE, rules or MEGATRON
        self.tp_rank, self.tp_size = self.comm.rank, self.comm.world_size
        self.parts = tuple(name for name, _, _ in parts)
        self.part_sizes = {name: units * size for name, units, size in parts}
        self.part_rows = {name: self.rules.column_rows(units, size, self.tp_rank, self.tp_size)
                          for name, units, size in parts}
        out_local = sum(len(r) for r in self.part_rows.values())
        self.in_features, self.out_features = input_size, out_local
        self.weight = nn.Parameter(torch.empty(out_local, input_size), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_local), requires_grad=False) if bias else None

    def shard(self, src: WeightSource, part: str | None = None, quantized: bool = False):
        """This rank's rows of `part`: a float tensor, or with `quantized` the checkpoint's own quantized format
        (None where the source has none minillm runs; a bias is never quantized)."""
        full = (self.part_sizes[part], self.in_features)[:len(src.shape)]
        _check_shape(src, full, f"{part or 'column-parallel'} weight")
        rows = _slice(self.part_rows[part])
        if quantized:
            return None if len(src.shape) == 1 else _read_quantized(src, rows=rows)
        return src.read(rows=rows)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quant is None:
            return self.rules.column_forward(x, self.weight, self.bias, self.comm)
        y = self.linear(x)
        return y if self.bias is None else y + self.bias


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel matrices fused into one matmul (gate and up)."""

    def __init__(self, input_size: int, output_sizes: Sequence[int], parts: Sequence[str], bias: bool = False,
                 comm: Communicator | None = None, rules=None) -> None:
        super().__init__(input_size, [(p, n, 1) for p, n in zip(parts, output_sizes)], bias, comm, rules)


class QKVParallelLinear(ColumnParallelLinear):
    """Q, K and V fused, split by whole heads: rank r holds query heads [r·H/tp, (r+1)·H/tp) and the KV heads those
    queries read. With fewer KV heads than ranks, each KV head is replicated on the tp / KV ranks whose query
    heads belong to its group."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False,
                 comm: Communicator | None = None, rules=None) -> None:
        super().__init__(hidden_size, [("q", num_heads, head_dim), ("k", num_kv_heads, head_dim),
                                       ("v", num_kv_heads, head_dim)], bias, comm, rules)
        self.head_dim = head_dim
        self.num_heads = len(self.part_rows["q"]) // head_dim
        self.num_kv_heads = len(self.part_rows["k"]) // head_dim


class RowParallelLinear(Quantizable, nn.Module):
    """Input features split over ranks (the input arrives split, from a column-parallel layer or local attention
    heads); each rank's product is a partial sum, all-reduced. The bias is added once, after the sum."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False, comm: Communicator | None = None,
                 rules=None) -> None:
        super().__init__()
        self.comm, self.rules = comm or SINGLE, rules or MEGATRON
        self.tp_rank, self.tp_size = self.comm.rank, self.comm.world_size
        self.cols = self.rules.row_cols(input_size, self.tp_rank, self.tp_size)
        self.input_size, self.in_features, self.out_features = input_size, len(self.cols), output_size
        self.weight = nn.Parameter(torch.empty(output_size, len(self.cols)), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(output_size), requires_grad=False) if bias else None

    def shard(self, src: WeightSource, part: str | None = None, quantized: bool = False):
        """This rank's columns (the bias whole): float, or with `quantized` the checkpoint's quantized format or
        None (see ColumnParallelLinear.shard)."""
        if len(src.shape) == 1:  # the bias is not split
            if quantized:
                return None
            _check_shape(src, (self.out_features,), "row-parallel bias")
            return src.read()
        _check_shape(src, (self.out_features, self.input_size), "row-parallel weight")
        cols = _slice(self.cols)
        return _read_quantized(src, cols=cols) if quantized else src.read(cols=cols)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quant is None:
            return self.rules.row_forward(x, self.weight, self.bias, self.comm)
        y = self.comm.all_reduce(self.linear(x))
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(Quantizable, nn.Module):
    """The embedding table split by vocabulary rows: rank r holds ids [r·Vp, (r+1)·Vp) with Vp = ceil(V / tp) (the
    last rank's tail is zero padding). A rank looks up the ids it owns, writes zeros for the others, and an
    all-reduce assembles each token's row (exactly one rank contributed it)."""

    def __init__(self, vocab_size: int, hidden_size: int, comm: Communicator | None = None) -> None:
        super().__init__()
        self.comm = comm or SINGLE
        self.tp_rank, self.tp_size = self.comm.rank, self.comm.world_size
        self.vocab_size, self.hidden_size = vocab_size, hidden_size
        self.shard_size = math.ceil(vocab_size / self.tp_size)
        self.vocab_start = self.tp_rank * self.shard_size
        self.weight = nn.Parameter(torch.empty(self.shard_size, hidden_size), requires_grad=False)

    def shard(self, src: WeightSource, part: str | None = None, quantized: bool = False):
        """This rank's vocabulary rows, zero-padded on the last rank: float, or with `quantized` the checkpoint's
        quantized format or None (also for the padded last shard: padding a packed matrix is not worth it)."""
        _check_shape(src, (self.vocab_size, self.hidden_size), "embedding")
        stop = min(self.vocab_start + self.shard_size, self.vocab_size)
        if quantized:
            padded = stop - self.vocab_start < self.shard_size
            return None if padded else _read_quantized(src, rows=slice(self.vocab_start, stop))
        rows = src.read(rows=slice(self.vocab_start, stop))
        if rows.shape[0] < self.shard_size:
            rows = torch.cat([rows, rows.new_zeros(self.shard_size - rows.shape[0], self.hidden_size)])
        return rows

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        if self.quant is None:
            return F.embedding(ids, self.weight)
        flat = ids.reshape(-1)
        return self.quant.take_rows(flat).dequantize().view(*ids.shape, self.hidden_size)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return self._lookup(ids)
        local = ids - self.vocab_start
        mine = (local >= 0) & (local < self.shard_size)
        x = self._lookup(torch.where(mine, local, 0))
        x = x * mine.unsqueeze(-1).to(x.dtype)
        return self.comm.all_reduce(x)


class ParallelLMHead(VocabParallelEmbedding):
    """The output projection split by vocabulary rows like the embedding (and, when tied, the same slice): each
    rank scores its Vp ids (LlamaModel.compute_logits, which also serves a tied head); the logits are gathered on
    rank 0, where the sampler runs (gather_logits)."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # pragma: no cover -- a head is not looked up
        raise TypeError("ParallelLMHead holds the head's slice: LlamaModel.compute_logits scores with it")


def gather_logits(local: torch.Tensor, comm: Communicator, vocab_size: int) -> torch.Tensor | None:
    """[rows, Vp] local logits -> [rows, V] on rank 0 (padding cut off), None on the other ranks."""
    full = comm.gather(local, dim=-1)
    return None if full is None else full[:, :vocab_size]
