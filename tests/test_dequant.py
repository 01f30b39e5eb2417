"""Our numpy dequantization must be bit-identical to gguf-py's reference (`gguf.quants.dequantize`)."""
from __future__ import annotations

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T
from gguf import quants
from hypothesis import given, settings, strategies as st

from minillm.loading.dequant import SUPPORTED_NATIVE, dequantize, expected_nbytes

BLOCK_TYPES = [T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1]
QUANTIZABLE = [T.F32, T.F16, T.BF16, *BLOCK_TYPES]  # types gguf-py can also quantize
FAST = settings(deadline=None, derandomize=True, max_examples=40)

# (rows, blocks per row) and a seed: numpy makes the data, hypothesis explores sizes and scales
shapes = st.tuples(st.integers(1, 5), st.integers(1, 4))
seeds = st.integers(0, 2**32 - 1)
magnitudes = st.sampled_from([0.0, 1e-4, 1.0, 37.0, 5e3])  # f16 overflows past 65504


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    """Exact equality, NaN payloads included."""
    return a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))


def reference(raw: np.ndarray, qtype: T, shape: tuple[int, ...]) -> np.ndarray:
    return np.asarray(quants.dequantize(raw, qtype), dtype=np.float32).reshape(shape)


def test_supported_native_covers_the_common_types():
    assert {T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1} <= SUPPORTED_NATIVE


@pytest.mark.parametrize("qtype", QUANTIZABLE, ids=lambda t: t.name)
@FAST
@given(shape=shapes, seed=seeds, magnitude=magnitudes, offset=st.sampled_from([0.0, 3.0, -50.0]))
def test_matches_reference_on_quantized_data(qtype, shape, seed, magnitude, offset):
    rows, blocks = shape
    x = np.random.default_rng(seed).standard_normal((rows, 32 * blocks)).astype(np.float32) * magnitude + offset
    raw = quants.quantize(x, qtype)
    ours = dequantize(raw, qtype, x.shape)
    assert ours.dtype == np.float32 and ours.flags.c_contiguous and ours.flags.writeable
    assert same_bits(ours, reference(raw, qtype, x.shape))


def random_blocks(qtype: T, n_blocks: int, rng: np.random.Generator) -> np.ndarray:
    """Arbitrary quant bits, but finite float16 scale/min fields (random f16 bits can be NaN/inf)."""
    _, size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (n_blocks, size), dtype=np.uint8)
    n_halves = 2 if qtype in (T.Q4_1, T.Q5_1) else 1  # d, or d and m, lead every block
    halves = (rng.standard_normal((n_blocks, n_halves)) * 10.0 ** rng.integers(-4, 4, (n_blocks, 1)))
    raw[:, :2 * n_halves] = halves.astype(np.float16).view(np.uint8)
    return raw


@pytest.mark.parametrize("qtype", BLOCK_TYPES, ids=lambda t: t.name)
@FAST
@given(shape=shapes, seed=seeds)
def test_matches_reference_on_arbitrary_bits(qtype, shape, seed):
    rows, blocks = shape
    raw = random_blocks(qtype, rows * blocks, np.random.default_rng(seed)).reshape(rows, -1)
    assert same_bits(dequantize(raw, qtype, (rows, 32 * blocks)), reference(raw, qtype, (rows, 32 * blocks)))


@pytest.mark.parametrize("qtype", [T.F16, T.BF16], ids=lambda t: t.name)
@FAST
@given(n=st.integers(1, 300), seed=seeds)
def test_half_types_on_every_bit_pattern(qtype, n, seed):
    """All 16-bit patterns are valid input here (NaN and inf included): the cast must match bit for bit."""
    bits = np.random.default_rng(seed).integers(0, 2**16, n, dtype=np.uint16)
    bits[:4] = [0x0000, 0x8000, 0x7C00, 0xFFFF][: min(4, n)]  # zeros, inf (f16), a NaN
    raw = bits.view(np.uint8) if qtype == T.BF16 else bits.view(np.float16)
    assert same_bits(dequantize(raw, qtype, (n,)), reference(raw, qtype, (n,)))


def test_three_dimensional_shape():
    x = np.random.default_rng(0).standard_normal((2, 3, 64)).astype(np.float32)
    raw = quants.quantize(x, T.Q8_0)
    assert same_bits(dequantize(raw, T.Q8_0, x.shape), reference(raw, T.Q8_0, x.shape))


def test_accepts_flat_bytes_and_int_type_codes():
    x = np.random.default_rng(1).standard_normal((4, 64)).astype(np.float32)
    raw = quants.quantize(x, T.Q4_1)
    out = dequantize(raw.reshape(-1), int(T.Q4_1), (4, 64))
    assert same_bits(out, reference(raw, T.Q4_1, (4, 64)))


def test_f32_result_is_a_copy():
    raw = np.arange(8, dtype=np.float32)
    out = dequantize(raw, T.F32, (2, 4))
    out[0, 0] = 99.0
    assert raw[0] == 0.0 and out.shape == (2, 4)


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q6_K], ids=lambda t: t.name)
def test_other_types_fall_back_to_gguf(qtype):
    assert qtype not in SUPPORTED_NATIVE
    block, size = GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(2)
    raw = rng.integers(0, 256, (3, size), dtype=np.uint8)
    # the f16 super-block scales (first bytes for Q4_K, last two for Q6_K) must be finite
    scale_at = slice(0, 4) if qtype == T.Q4_K else slice(size - 2, size)
    n_scales = (scale_at.stop - scale_at.start) // 2
    raw[:, scale_at] = rng.standard_normal((3, n_scales)).astype(np.float16).view(np.uint8)
    out = dequantize(raw, qtype, (3, block))
    assert out.shape == (3, block) and np.isfinite(out).all()
    assert same_bits(out, reference(raw, qtype, (3, block)))


@pytest.mark.parametrize("qtype", QUANTIZABLE, ids=lambda t: t.name)
def test_wrong_byte_length_raises(qtype):
    raw = quants.quantize(np.ones((2, 64), dtype=np.float32), qtype)
    with pytest.raises(ValueError, match=r"needs \d+ bytes, got \d+"):
        dequantize(raw.reshape(-1).view(np.uint8)[:-1], qtype, (2, 64))
    with pytest.raises(ValueError, match="needs"):
        dequantize(raw, qtype, (3, 64))


def test_row_not_a_multiple_of_the_block_raises():
    with pytest.raises(ValueError, match="block size 32"):
        dequantize(np.zeros(34, dtype=np.uint8), T.Q8_0, (1, 33))


def test_unknown_type_raises():
    with pytest.raises(ValueError, match="unknown GGML tensor type"):
        dequantize(np.zeros(4, dtype=np.uint8), 999, (1,))


def test_expected_nbytes():
    assert expected_nbytes(T.Q4_1, (576, 1536)) == 576 * 1536 // 32 * 20
    assert expected_nbytes(T.F32, (7,)) == 28
