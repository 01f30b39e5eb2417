"""Parse a GGUF header (versions 2 and 3) from a buffer: metadata as plain Python values, tensor infos.

Layout (all integers little-endian; a file whose version reads as 0 in its low 16 bits is big-endian,
as gguf-py's reader assumes):

    b"GGUF", u32 version, u64 tensor_count, u64 kv_count
    kv_count x  [string key][u32 value type][value]
    tensor_count x  [string name][u32 n_dims][n_dims x u64 dims, innermost first][u32 ggml type][u64 offset]
    padding up to a multiple of general.alignment (default 32), then the tensor data

A string is a u64 byte length followed by UTF-8 bytes; an array is [u32 element type][u64 count][elements].

Values come out exactly as gguf-py's ``ReaderField.contents()`` gives them (strings as str, arrays as
flat lists, scalars as Python numbers), but in a fraction of the time: gguf-py slices its memmap a few
times per string, which for a 100k-entry vocabulary takes seconds. Here fixed-size arrays are one
``np.frombuffer`` and string arrays a tight loop of ``unpack_from`` + slice + decode.

Every problem raises GGUFFormatError (a ValueError) saying where; the caller adds the file name.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
# Keys gguf-py's reader uses for its own bookkeeping; a file defining one of them is rejected (as gguf-py
# does), and keys under "GGUF." are not metadata.
RESERVED_KEYS = ("GGUF.version", "GGUF.tensor_count", "GGUF.kv_count")

# GGUF value types
UINT8, INT8, UINT16, INT16, UINT32, INT32, FLOAT32, BOOL, STRING, ARRAY, UINT64, INT64, FLOAT64 = range(13)
_SCALAR_CODES = {UINT8: "B", INT8: "b", UINT16: "H", INT16: "h", UINT32: "I", INT32: "i", FLOAT32: "f",
                 BOOL: "?", UINT64: "Q", INT64: "q", FLOAT64: "d"}
_TYPE_NAMES = {UINT8: "uint8", INT8: "int8", UINT16: "uint16", INT16: "int16", UINT32: "uint32",
               INT32: "int32", FLOAT32: "float32", BOOL: "bool", STRING: "string", ARRAY: "array",
               UINT64: "uint64", INT64: "int64", FLOAT64: "float64"}
_MIN_TENSOR_INFO = 8 + 4 + 4 + 8  # empty name, no dims, type, offset


class GGUFFormatError(ValueError):
    """The bytes are not a valid GGUF file; the message says what is wrong and where."""


@dataclass(frozen=True)
class TensorInfo:
    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]      # numpy order (outermost first): GGUF's dims reversed
    offset: int                 # absolute byte offset of the data in the file
    n_bytes: int                # n_elements * type_size // block_size, as gguf-py computes it


@dataclass
class GGUFHeader:
    version: int
    byte_order: str             # "<" or ">"
    metadata: dict[str, Any]    # in file order, without "GGUF.*" keys
    value_types: dict[str, int]  # GGUF value type of each metadata key
    tensors: list[TensorInfo]
    alignment: int
    data_offset: int            # where the tensor data section starts
    header_size: int            # bytes of header before the alignment padding


class _Parser:
    def __init__(self, buf, byte_order: str) -> None:
        self.buf = buf
        self.size = len(buf)
        self.u32 = struct.Struct(byte_order + "I").unpack_from
        self.u64 = struct.Struct(byte_order + "Q").unpack_from
        self.scalars = {t: struct.Struct(byte_order + c) for t, c in _SCALAR_CODES.items()}
        self.dtypes = {t: np.dtype(byte_order + c) for t, c in _SCALAR_CODES.items()}
        self.dtypes[BOOL] = np.dtype(np.bool_)

    def need(self, off: int, n: int, what: str) -> None:
        if n < 0 or off + n > self.size:
            raise GGUFFormatError(f"{what} needs {n} bytes at byte {off}, past the end of the file "
                             f"({self.size} bytes)")

    def string(self, off: int, what: str) -> tuple[str, int]:
        self.need(off, 8, what)
        (n,) = self.u64(self.buf, off)
        off += 8
        self.need(off, n, what)
        try:
            return str(self.buf[off:off + n], "utf-8"), off + n
        except UnicodeDecodeError as e:
            raise GGUFFormatError(f"{what} at byte {off} is not valid UTF-8 ({e.reason})") from None

    def string_array(self, off: int, count: int, what: str) -> tuple[list[str], int]:
        buf, size, u64 = self.buf, self.size, self.u64
        out: list[str] = []
        append = out.append
        try:
            for _ in range(count):
                (n,) = u64(buf, off)
                off += 8
                end = off + n
                if end > size:
                    break
                append(str(buf[off:end], "utf-8"))
                off = end
            else:
                return out, off
        except struct.error:
            pass
        except UnicodeDecodeError as e:
            raise GGUFFormatError(f"{what}: string {len(out)} at byte {off} is not valid UTF-8 "
                                  f"({e.reason})") from None
        raise GGUFFormatError(f"{what}: the file ends ({size} bytes) in string {len(out)} of {count}")

    def value(self, off: int, vtype: int, what: str) -> tuple[Any, int]:
        """One value of type `vtype` at `off`: (contents as gguf-py gives them, offset after it)."""
        if vtype == STRING:
            return self.string(off, what)
        if vtype in _SCALAR_CODES:
            st = self.scalars[vtype]
            self.need(off, st.size, what)
            return st.unpack_from(self.buf, off)[0], off + st.size
        if vtype != ARRAY:
            raise GGUFFormatError(f"{what} at byte {off} has unknown value type {vtype}")
        self.need(off, 12, what)
        (etype,) = self.u32(self.buf, off)
        (count,) = self.u64(self.buf, off + 4)
        off += 12
        if count == 0:  # gguf-py never looks at the element type of an empty array
            return [], off
        if etype in _SCALAR_CODES:
            dt = self.dtypes[etype]
            self.need(off, count * dt.itemsize, f"{what} ({count} x {_TYPE_NAMES[etype]})")
            return np.frombuffer(self.buf, dt, count, off).tolist(), off + count * dt.itemsize
        if etype == STRING:
            self.need(off, count * 8, f"{what} ({count} strings)")
            return self.string_array(off, count, what)
        if etype == ARRAY:
            self.need(off, count * 12, f"{what} ({count} arrays)")
            return self.nested_array(off, count, what)
        raise GGUFFormatError(f"{what} at byte {off - 12} is an array of unknown value type {etype}")

    def nested_array(self, off: int, count: int, what: str) -> tuple[list[Any], int]:
        """An array of arrays, flattened the way gguf-py's contents() flattens it.

        gguf-py records the value types of the first element only (recursively) and decides from the last
        of them whether the leaves are strings; leaves of another kind come out as it would give them.
        """
        types = [ARRAY]
        leaves: list[tuple[int, bytes, Any]] = []  # (value type, raw bytes, value)
        for i in range(count):
            off, t = self._element(off, ARRAY, leaves, what, 1)
            if i == 0:
                types += t
        if types[-1] == STRING:
            try:
                return [str(raw, "utf-8") for _, raw, _ in leaves], off
            except UnicodeDecodeError as e:
                raise GGUFFormatError(f"{what}: a string is not valid UTF-8 ({e.reason})") from None
        out: list[Any] = []
        for vtype, raw, v in leaves:
            if vtype == STRING:
                out.extend(raw)  # gguf-py gives a string's bytes as a list of ints here
            else:
                out.append(v)
        return out, off

    def _element(self, off: int, etype: int, leaves: list[tuple[int, bytes, Any]], what: str,
                 depth: int) -> tuple[int, list[int]]:
        """One array element of type `etype` at `off`: (offset after it, its value types as gguf-py lists them)."""
        buf = self.buf
        if etype == STRING:
            self.need(off, 8, what)
            (n,) = self.u64(buf, off)
            self.need(off + 8, n, what)
            leaves.append((STRING, bytes(buf[off + 8:off + 8 + n]), None))
            return off + 8 + n, [STRING]
        if etype in _SCALAR_CODES:
            st = self.scalars[etype]
            self.need(off, st.size, what)
            raw = bytes(buf[off:off + st.size])
            leaves.append((etype, raw, np.frombuffer(raw, self.dtypes[etype], 1).tolist()[0]))
            return off + st.size, [etype]
        if etype != ARRAY:
            raise GGUFFormatError(f"{what} at byte {off} has unknown value type {etype}")
        if depth > 64:
            raise GGUFFormatError(f"{what}: arrays nested more than 64 deep")
        self.need(off, 12, what)
        (sub,) = self.u32(buf, off)
        (n,) = self.u64(buf, off + 4)
        off += 12
        self.need(off, n, what)  # every element takes at least a byte: no absurd loops
        types = [ARRAY]
        for i in range(n):
            off, t = self._element(off, sub, leaves, what, depth + 1)
            if i == 0:
                types += t
        return off, types


def parse_header(buf) -> GGUFHeader:
    """Parse the header in `buf` (bytes, mmap, or anything sliceable to bytes with the buffer protocol)."""
    size = len(buf)
    if size < 4 or bytes(buf[:4]) != GGUF_MAGIC:
        raise GGUFFormatError(f"it starts with {bytes(buf[:4])!r}, not {GGUF_MAGIC!r}")
    if size < 24:
        raise GGUFFormatError(f"the file is only {size} bytes, shorter than the 24-byte GGUF preamble")
    (version,) = struct.unpack_from("<I", buf, 4)
    byte_order = "<"
    if version & 0xFFFF == 0:  # written on a machine of the other byte order (gguf-py's rule)
        byte_order = ">"
        (version,) = struct.unpack_from(">I", buf, 4)
    if version not in SUPPORTED_VERSIONS:
        raise GGUFFormatError(f"GGUF version {version} is not supported (only versions 2 and 3 are)")
    n_tensors, n_kv = struct.unpack_from(byte_order + "QQ", buf, 8)
    p = _Parser(buf, byte_order)
    off = 24
    if n_kv * 12 > size - off:  # every pair takes at least 12 bytes: an absurd count is a corrupt file
        raise GGUFFormatError(f"the header claims {n_kv} metadata entries, more than the file can hold")

    metadata: dict[str, Any] = {}
    value_types: dict[str, int] = {}
    seen: set[str] = set(RESERVED_KEYS)
    for i in range(n_kv):
        key, off = p.string(off, f"the key of metadata entry {i}")
        if key in seen:
            raise GGUFFormatError(f"duplicate metadata key {key!r}")
        seen.add(key)
        p.need(off, 4, f"the value type of metadata key {key!r}")
        (vtype,) = p.u32(buf, off)
        value, off = p.value(off + 4, vtype, f"metadata key {key!r}")
        if not key.startswith("GGUF."):
            metadata[key] = value
            value_types[key] = vtype

    if n_tensors * _MIN_TENSOR_INFO > size - off:
        raise GGUFFormatError(f"the header claims {n_tensors} tensors, more than the file can hold")
    raw_tensors = []
    for i in range(n_tensors):
        name, off = p.string(off, f"the name of tensor {i}")
        p.need(off, 4, f"tensor {name!r}")
        (n_dims,) = p.u32(buf, off)
        off += 4
        p.need(off, 8 * n_dims + 12, f"tensor {name!r} ({n_dims} dimensions)")
        dims = struct.unpack_from(f"{byte_order}{n_dims}Q", buf, off)
        off += 8 * n_dims
        raw_type, rel = struct.unpack_from(byte_order + "IQ", buf, off)
        off += 12
        raw_tensors.append((name, dims, raw_type, rel))
    header_size = off

    alignment = DEFAULT_ALIGNMENT
    if "general.alignment" in metadata:
        if value_types["general.alignment"] != UINT32:
            raise GGUFFormatError("general.alignment is not a uint32")
        alignment = metadata["general.alignment"]
        if alignment == 0 or alignment & (alignment - 1):
            raise GGUFFormatError(f"general.alignment is {alignment}, not a power of two")
    data_offset = -(-off // alignment) * alignment

    tensors: list[TensorInfo] = []
    names: set[str] = set()
    for name, dims, raw_type, rel in raw_tensors:
        if name in names:
            raise GGUFFormatError(f"duplicate tensor name {name!r}")
        names.add(name)
        try:
            qtype = GGMLQuantizationType(raw_type)
            block_size, type_size = GGML_QUANT_SIZES[qtype]
        except (ValueError, KeyError):
            raise GGUFFormatError(f"tensor {name!r} has unknown GGML type {raw_type}") from None
        n_elements = 1
        for d in dims:
            n_elements *= d
        tensors.append(TensorInfo(name, qtype, tuple(reversed(dims)), data_offset + rel,
                                  n_elements * type_size // block_size))
    return GGUFHeader(version, byte_order, metadata, value_types, tensors, alignment, data_offset,
                      header_size)


__all__ = ["GGUFFormatError", "GGUFHeader", "TensorInfo", "parse_header"]
