"""Checkpoint tensors that can be read in part: a tensor-parallel rank reads only its rows or columns.

A source has `shape` (the full tensor's, in nn.Linear's (out, in) order) and `read(rows=, cols=)`, which returns
a new float32 tensor of that slice. safetensors reads a slice from disk without the rest; GGUF dequantizes only
the slice's rows, and only the slice's blocks when a column range falls on block boundaries.
"""
from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from minillm.layers.linear import TensorSource, slice_index as _index  # noqa: F401 (TensorSource: the in-memory kind)
from minillm.loading.dequant import dequantize
from minillm.quant.gguf import NATIVE, from_blocks


class SafetensorsSource:
    """One tensor of an open safetensors file; `get_slice` reads just the requested part."""

    def __init__(self, handle, name: str) -> None:
        self.handle, self.name = handle, name
        self._slice = handle.get_slice(name)
        self.shape = tuple(self._slice.get_shape())

    def read(self, rows: slice | None = None, cols: slice | None = None) -> torch.Tensor:
        if rows is None and cols is None:
            return self.handle.get_tensor(self.name).float()
        return self._slice[_index(rows, cols, len(self.shape))].float()


class GGUFSource:
    """One tensor of a GGUF file. `transform(tensor, rows)` post-processes what was read (llama.cpp's Q/K row
    permutation is undone per head, so it applies to any whole-head row range)."""

    def __init__(self, gf, name: str, transform: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        self.gf, self.name, self.transform = gf, name, transform
        qtype, shape = gf.tensor_info(name)
        self.qtype, self.shape = qtype, tuple(shape)

    def read(self, rows: slice | None = None, cols: slice | None = None) -> torch.Tensor:
        from gguf import GGML_QUANT_SIZES
        if len(self.shape) != 2 or (rows is None and cols is None):
            t = self.gf.load(self.name)
            t = t if rows is None and cols is None else t[_index(rows, cols, t.dim())].clone()
            return self.transform(t) if self.transform else t
        out_f, in_f = self.shape
        r0, r1, _ = (rows or slice(None)).indices(out_f)
        c0, c1, _ = (cols or slice(None)).indices(in_f)
        block, size = GGML_QUANT_SIZES[self.qtype]
        raw = self.gf._raw(self.name).reshape(out_f, in_f // block * size)[r0:r1]
        if c0 % block == 0 and c1 % block == 0:       # whole blocks: decode only those
            raw = raw.reshape(r1 - r0, in_f // block, size)[:, c0 // block:c1 // block]
            t = torch.from_numpy(dequantize(np.ascontiguousarray(raw), self.qtype, (r1 - r0, c1 - c0)))
        else:
            t = torch.from_numpy(dequantize(np.ascontiguousarray(raw), self.qtype, (r1 - r0, in_f)))[:, c0:c1].clone()
        return self.transform(t) if self.transform else t

    def read_quantized(self, rows: slice | None = None, cols: slice | None = None):
        """The slice as a QuantizedWeight when the tensor's GGML type maps onto a minillm format (Q8_0, Q4_0,
        Q4_1) and the columns fall on its blocks; None otherwise (then `read` dequantizes)."""
        from gguf import GGML_QUANT_SIZES
        if self.qtype not in NATIVE or len(self.shape) != 2:
            return None
        out_f, in_f = self.shape
        r0, r1, _ = (rows or slice(None)).indices(out_f)
        c0, c1, _ = (cols or slice(None)).indices(in_f)
        block, size = GGML_QUANT_SIZES[self.qtype]
        if c0 % block or c1 % block:
            return None
        raw = self.gf._raw(self.name).reshape(out_f, in_f // block, size)[r0:r1, c0 // block:c1 // block]
        qw = from_blocks(raw, self.qtype)
        if self.transform is not None:   # a row permutation: find it by transforming the row numbers
            order = self.transform(torch.arange(r1 - r0, dtype=torch.float32).unsqueeze(1)).squeeze(1).long()
            qw = qw.take_rows(order)
        return qw
