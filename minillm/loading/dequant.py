"""Dequantize GGUF tensor data to float32 with numpy.

GGML block formats (ggml-common.h): a row is cut into blocks of 32 values; each block stores one or
two float16 numbers (scale d, minimum m) followed by the packed integer quants:

    Q8_0  [d f16][32 x int8]                  x = d * q
    Q4_0  [d f16][16 bytes of nibbles]        x = d * (q - 8)
    Q4_1  [d f16][m f16][16 bytes]            x = d * q + m
    Q5_0  [d f16][qh u32][16 bytes]           x = d * (q - 16), q = nibble | (bit of qh << 4)
    Q5_1  [d f16][m f16][qh u32][16 bytes]    x = d * q + m

In a nibble byte j, the low 4 bits are value j and the high 4 bits value j + 16. Arithmetic is done in
float32 in the same order as gguf-py's reference, so results are bit-identical to it.
"""
from __future__ import annotations

from typing import Callable

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf import quants as gguf_quants

T = GGMLQuantizationType

# Types stored as plain numpy arrays: a cast is all it takes.
_PLAIN: dict[GGMLQuantizationType, np.dtype] = {
    T.F32: np.dtype("<f4"), T.F16: np.dtype("<f2"), T.F64: np.dtype("<f8"),
    T.I8: np.dtype("i1"), T.I16: np.dtype("<i2"), T.I32: np.dtype("<i4"), T.I64: np.dtype("<i8"),
}


def _f16(blocks: np.ndarray, start: int) -> np.ndarray:
    """The float16 at byte `start` of every block, as a (n_blocks, 1) float32 column."""
    return np.ascontiguousarray(blocks[:, start:start + 2]).view("<f2").astype(np.float32)


def _nibbles(packed: np.ndarray) -> np.ndarray:
    """(n, 16) bytes -> (n, 32) float32: low nibbles are elements 0..15, high nibbles 16..31."""
    out = np.empty((packed.shape[0], 32), dtype=np.float32)  # written in place: no big temporaries
    np.bitwise_and(packed, 0x0F, out=out[:, :16], casting="unsafe")
    np.right_shift(packed, 4, out=out[:, 16:], casting="unsafe")
    return out


def _high_bits(blocks: np.ndarray, start: int) -> np.ndarray:
    """Q5's 32 fifth bits (a little-endian u32 at `start`) -> (n, 32) float32 of 0 or 16."""
    qh = np.ascontiguousarray(blocks[:, start:start + 4]).view("<u4")
    return (((qh >> np.arange(32, dtype=np.uint32)) & 1) << 4).astype(np.float32)


# Integers up to 31 are exact in float32, so subtracting offsets after the cast changes nothing.
def _q8_0(b: np.ndarray) -> np.ndarray:
    q = b[:, 2:].view(np.int8).astype(np.float32)
    q *= _f16(b, 0)
    return q


def _q4_0(b: np.ndarray) -> np.ndarray:
    q = _nibbles(b[:, 2:])
    q -= 8
    q *= _f16(b, 0)
    return q


def _q4_1(b: np.ndarray) -> np.ndarray:
    q = _nibbles(b[:, 4:])
    q *= _f16(b, 0)
    q += _f16(b, 2)
    return q


def _q5_0(b: np.ndarray) -> np.ndarray:
    q = _nibbles(b[:, 6:])
    q += _high_bits(b, 2)
    q -= 16
    q *= _f16(b, 0)
    return q


def _q5_1(b: np.ndarray) -> np.ndarray:
    q = _nibbles(b[:, 8:])
    q += _high_bits(b, 4)
    q *= _f16(b, 0)
    q += _f16(b, 2)
    return q


def _bf16(b: np.ndarray) -> np.ndarray:
    # bfloat16 is the top half of a float32: shift the bits into place.
    return (np.ascontiguousarray(b).view("<u2").astype(np.uint32) << 16).view(np.float32)


_BLOCKS: dict[GGMLQuantizationType, Callable[[np.ndarray], np.ndarray]] = {
    T.BF16: _bf16, T.Q8_0: _q8_0, T.Q4_0: _q4_0, T.Q4_1: _q4_1, T.Q5_0: _q5_0, T.Q5_1: _q5_1,
}

SUPPORTED_NATIVE: frozenset[GGMLQuantizationType] = frozenset(_PLAIN) | frozenset(_BLOCKS)
# what gguf-py's reference numpy code decodes (K-quants, IQ-quants, ...), on top of ours
SUPPORTED: frozenset[GGMLQuantizationType] = SUPPORTED_NATIVE | frozenset(getattr(gguf_quants, "_type_traits", {}))


def unsupported_type_message(qtype: GGMLQuantizationType, name: str) -> str:
    names = ", ".join(sorted(t.name for t in SUPPORTED))
    return (f"tensor {name!r} has GGML type {qtype.name}, which minillm cannot load (a valid type, but one it has "
            f"no decoder for). Supported types: {names}. Convert the model to one of them (e.g. llama.cpp's "
            f"llama-quantize to Q8_0 or Q4_K_M)")


def expected_nbytes(ggml_type: GGMLQuantizationType | int, shape: tuple[int, ...]) -> int:
    """Bytes a tensor of this type and (numpy-order) shape occupies in a GGUF file."""
    qtype = _as_type(ggml_type)
    block, size = GGML_QUANT_SIZES[qtype]
    if shape and shape[-1] % block:
        raise ValueError(f"{qtype.name} tensor of shape {shape}: last dimension is not a multiple "
                         f"of the block size {block}")
    return int(np.prod(shape, dtype=np.int64)) // block * size


def dequantize(raw: np.ndarray, ggml_type: GGMLQuantizationType | int, shape: tuple[int, ...]) -> np.ndarray:
    """Decode `raw` (the tensor's bytes, any dtype) into a new float32 C-contiguous array of `shape`."""
    qtype, shape = _as_type(ggml_type), tuple(int(d) for d in shape)
    data = np.ascontiguousarray(raw).reshape(-1).view(np.uint8)
    want = expected_nbytes(qtype, shape)
    if data.size != want:
        raise ValueError(f"{qtype.name} tensor of shape {shape} needs {want} bytes, got {data.size}")
    if qtype in _PLAIN:
        out = data.view(_PLAIN[qtype]).astype(np.float32)  # astype copies: never a view of a memmap
    elif qtype in _BLOCKS:
        out = _BLOCKS[qtype](data.reshape(-1, GGML_QUANT_SIZES[qtype][1]))
    else:
        out = _fallback(data, qtype, shape)
    return np.ascontiguousarray(out, dtype=np.float32).reshape(shape)


def _fallback(data: np.ndarray, qtype: GGMLQuantizationType, shape: tuple[int, ...]) -> np.ndarray:
    """K-quants, IQ-quants, ...: gguf-py's reference numpy code."""
    block, size = GGML_QUANT_SIZES[qtype]
    rows = data.reshape(-1, shape[-1] // block * size) if shape else data
    try:
        return gguf_quants.dequantize(rows, qtype)
    except NotImplementedError as e:
        raise ValueError(f"cannot dequantize GGML type {qtype.name}: not supported") from e


def _as_type(ggml_type: GGMLQuantizationType | int) -> GGMLQuantizationType:
    try:
        return GGMLQuantizationType(int(ggml_type))
    except ValueError as e:
        raise ValueError(f"unknown GGML tensor type {ggml_type!r}") from e
