"""GGUF's quantized blocks <-> minillm's quantized weights, without going through float.

    Q8_0  [d f16][32 x int8]       -> int8, group 32:  w = d q
    Q4_1  [d f16][m f16][16 bytes] -> int4, group 32:  w = d q + m
    Q4_0  [d f16][16 bytes]        -> int4, group 32:  w = d (q - 8) = d q + (-8 d)   (exact: -8d is a float16)

The nibble order inside a block is already minillm's (formats.pack_int4), so the bytes are copied as they are.
Other GGML types (K-quants, Q5, ...) have no direct mapping: the loader dequantizes them and quantizes again.
"""
from __future__ import annotations

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from minillm.quant.formats import BLOCK, QuantizedWeight

T = GGMLQuantizationType
NATIVE = {T.Q8_0: "int8", T.Q4_0: "int4", T.Q4_1: "int4"}


def _f16(blocks: np.ndarray, start: int) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(blocks[..., start:start + 2]).view("<f2")[..., 0].copy())


def from_blocks(raw: np.ndarray, qtype: GGMLQuantizationType) -> QuantizedWeight:
    """raw: uint8 [rows, blocks per row, bytes per block] of one of the NATIVE types."""
    if qtype not in NATIVE:
        raise ValueError(f"GGML type {qtype.name} has no direct minillm format (direct: "
                         f"{', '.join(t.name for t in NATIVE)})")
    n, nb, size = raw.shape
    if size != GGML_QUANT_SIZES[qtype][1]:
        raise ValueError(f"{qtype.name} blocks are {GGML_QUANT_SIZES[qtype][1]} bytes, got {size}")
    d = _f16(raw, 0)
    if qtype == T.Q8_0:
        q = torch.from_numpy(np.ascontiguousarray(raw[..., 2:]).view(np.int8).reshape(n, nb * BLOCK).copy())
        return QuantizedWeight("int8", q, d, None, BLOCK)
    if qtype == T.Q4_1:
        mins, qs = _f16(raw, 2), raw[..., 4:]
    else:
        mins, qs = (d.float() * -8).half(), raw[..., 2:]
    packed = torch.from_numpy(np.ascontiguousarray(qs).reshape(n, nb * BLOCK // 2).copy())
    return QuantizedWeight("int4", packed, d, mins, BLOCK)


def to_blocks(qw: QuantizedWeight) -> tuple[np.ndarray, GGMLQuantizationType]:
    """The inverse for group-32 weights: int8 -> Q8_0, int4 -> Q4_1 bytes [rows, K * bytes per block / 32]."""
    if qw.group_size != BLOCK:
        raise ValueError(f"only group size {BLOCK} maps to a GGUF block type, this weight has {qw.group_size}")
    n, k = qw.shape
    nb = k // BLOCK
    d = qw.scales.numpy().view(np.uint8).reshape(n, nb, 2)
    if qw.kind == "int8":
        body = qw.qweight.numpy().view(np.uint8).reshape(n, nb, BLOCK)
        return np.concatenate([d, body], axis=-1).reshape(n, -1), T.Q8_0
    m = qw.mins.numpy().view(np.uint8).reshape(n, nb, 2)
    body = qw.qweight.numpy().reshape(n, nb, BLOCK // 2)
    return np.concatenate([d, m, body], axis=-1).reshape(n, -1), T.Q4_1
