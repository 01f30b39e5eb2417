"""The int16 batched-step GEMM (csrc/int16_gemm.c, minillm/kernels/cpu_int16.py): the kernel equals its integer
arithmetic written out in torch, stays within the rounding bound of both operands, never overflows its int32 chunk
sums, and hands NaN/inf inputs and odd widths to the float paths."""
import pytest
import torch
from hypothesis import given, settings, strategies as st

from minillm.kernels import cpu_int16, cpu_qgemm
from minillm.quant.formats import QuantSpec, quantize

pytestmark = pytest.mark.skipif(not cpu_int16.available(), reason="no C compiler or no AVX2: the fp16 path runs")


def _data(m, n, k, seed, outlier=0.0):
    g = torch.Generator().manual_seed(seed)
    x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g)
    if outlier:
        x[:, k // 3] *= outlier            # one hidden-state channel far above the rest, as SmolLM2's
    return x, w


@settings(max_examples=40, deadline=None)
@given(m=st.integers(1, 70), n=st.integers(1, 60), k2=st.integers(1, 170), seed=st.integers(0, 10**6),
       outlier=st.sampled_from([0.0, 300.0]), threads=st.sampled_from([1, 2]))
def test_kernel_equals_its_integer_arithmetic_and_stays_within_the_rounding_bound(m, n, k2, seed, outlier, threads):
    x, w = _data(m, n, 2 * k2, seed, outlier)       # K up to 340: partial chunks, N not a multiple of 24, M % 4
    packed = cpu_int16.pack(w)
    y = cpu_int16.linear(x, packed, nthreads=threads)
    assert y.dtype == torch.float32 and y.shape == (m, n)
    scale = x.abs().amax(1, keepdim=True).double() * w.abs().sum(1).double() + 1e-30
    assert float(((y.double() - cpu_int16.simulate(x, packed)).abs() / scale).max()) < 1e-6
    assert bool(((y.double() - x.double() @ w.double().T).abs() <= cpu_int16.error_bound(x, w)).all())


@settings(max_examples=25, deadline=None, derandomize=True)
@given(m=st.integers(1, 70), n=st.integers(1, 60), k2=st.integers(1, 170), seed=st.integers(0, 10**6),
       variant=st.sampled_from(["avx2", "avx2-vnni"]))
def test_the_builds_without_avx512_give_the_same_bits(m, n, k2, seed, variant):
    """With AVX-512 a tile keeps its int32 sums and float outputs in registers over all of K; without it the sums go
    through memory once per chunk. The integer sums are exact and the float steps the same, in the same order, so
    the builds agree bit for bit (on a machine without AVX-512 or VNNI some are the same build)."""
    other = cpu_int16.load(variant)
    if other is None:
        pytest.skip(f"the {variant} build is not available here")
    x, w = _data(m, n, 2 * k2, seed, 300.0)
    packed = cpu_int16.pack(w)
    assert torch.equal(cpu_int16.linear(x, packed), cpu_int16.linear(x, packed, lib=other))


def test_the_bound_is_tight_enough_to_catch_coarser_codes():
    """Weights re-rounded to 8 bits per output channel (the first version of this path) break the bound."""
    x, w = _data(32, 48, 576, 3, outlier=300.0)
    w[:, 7] *= 40                                   # a few large weights set a per-row step
    s = w.abs().amax(1, keepdim=True) / 127
    coarse = x @ (torch.round(w / s) * s).T
    assert not bool(((coarse.double() - x.double() @ w.double().T).abs() <= cpu_int16.error_bound(x, w)).all())


def test_chunk_sums_at_the_largest_codes_do_not_overflow():
    k = 4 * cpu_int16.CHUNK
    x, w = torch.full((4, k), 3.0), torch.full((24, k), -2.0)      # every code at +-4095: 64 * 4095^2 per chunk
    y = cpu_int16.linear(x, cpu_int16.pack(w))
    assert torch.allclose(y, torch.full((4, 24), -6.0 * k), rtol=1e-6)


def test_nan_and_inf_inputs_take_the_float_path():
    qw = quantize(_data(1, 24, 128, 1)[1], QuantSpec("int4", 32))
    x = _data(max(cpu_qgemm.BATCHED_MIN_ROWS, 10), 24, 128, 2)[0]
    x[3, 5], x[7, 0] = float("nan"), float("inf")
    assert cpu_int16.linear(x, cpu_int16.pack(qw.dequantize())) is None
    y = cpu_qgemm.batched(x, qw, "int16")
    ref = cpu_qgemm.reference(x, qw)
    assert torch.equal(y.isnan(), ref.isnan()) and y[3].isnan().all()
    ok = ~ref.isnan().any(1)
    assert torch.allclose(y[ok], ref[ok], rtol=1e-5, atol=1e-5)


def test_odd_width_and_bad_input_are_handled():
    with pytest.raises(ValueError, match="even number of inputs"):
        cpu_int16.pack(torch.randn(4, 7))
    qw = quantize(torch.randn(24, 96), QuantSpec("int8", 32))
    with pytest.raises(ValueError, match="features"):
        cpu_int16.linear(torch.randn(3, 95), cpu_int16.pack(qw.dequantize()))
    x = torch.randn(20, 96, dtype=torch.bfloat16)
    y = cpu_qgemm.batched(x, qw, "int16")
    assert y.dtype == torch.bfloat16 and y.shape == (20, 24)


def test_the_packed_copy_is_cached_and_counted_once():
    qw = quantize(torch.randn(48, 128), QuantSpec("int4", 32))
    x = torch.randn(cpu_qgemm.BATCHED_MIN_ROWS, 128)
    a = cpu_qgemm.batched(x, qw, "int16")
    first = qw.cache_nbytes
    b = cpu_qgemm.batched(x, qw, "int16")
    assert torch.equal(a, b) and qw.cache_nbytes == first == 48 * 128 * 2 + 2 * 48 * 4
