"""The GPU path for quantized layers: the Triton dequant-matmul kernel (kernels/triton_qgemm.py) against
dequantize-then-matmul, run on CPU through the Triton interpreter, and compiled for sm80/sm90 without a GPU.

Tolerance: the kernel accumulates in fp32 in another order than torch's matmul, so fp32 agrees to ~1e-6 relative
(TOL 1e-5); reading int4 nibbles in the wrong order (interleaved instead of GGUF's halves) is shown to be far outside.
"""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import example, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

pytest.importorskip("triton")

from minillm.kernels.triton_launch import kernel_device  # noqa: E402
from minillm.kernels.triton_qgemm import (KERNEL_NAME, TileConfig, aot_compile, qgemm_kernel,  # noqa: E402
                                          qlinear_triton, tile_config, triton_available)
from minillm.quant.formats import QuantizedWeight, QuantSpec, pack_int4, quantize, unpack_int4  # noqa: E402

pytestmark = pytest.mark.skipif(not triton_available(), reason="needs CUDA or TRITON_INTERPRET=1")
DEVICE = kernel_device(qgemm_kernel) or "cpu"
TOL = 1e-5


def _rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.float() - ref).norm() / ref.norm().clamp_min(1e-12))


CONFIGS = st.one_of(st.none(), st.builds(TileConfig, st.sampled_from([16, 32]), st.sampled_from([16, 32, 64]),
                                         st.sampled_from([32, 64, 128]), st.integers(1, 3)))


@settings(max_examples=10, deadline=None, derandomize=True)
@given(n=st.integers(1, 70), k_blocks=st.integers(1, 5), m=st.integers(1, 40), group_blocks=st.sampled_from([1, 2]),
       kind=st.sampled_from(["int4", "int8", "int8-channel"]), seed=st.integers(0, 2**16), config=CONFIGS)
@example(n=33, k_blocks=2, m=17, group_blocks=1, kind="int4", seed=0, config=None)   # ragged tiles on both axes
@example(n=5, k_blocks=2, m=1, group_blocks=2, kind="int8", seed=1, config=None)     # decode: one row
# K = 96 is not a whole number of 64-wide tiles (masked tail), three K-slices add into one output
@example(n=20, k_blocks=3, m=3, group_blocks=1, kind="int4", seed=2, config=TileConfig(16, 16, 64, 3))
@example(n=40, k_blocks=3, m=2, group_blocks=1, kind="int8-channel", seed=3, config=TileConfig(16, 32, 128, 2))
def test_kernel_equals_dequantize_then_matmul(n, k_blocks, m, group_blocks, kind, seed, config):
    k = 32 * k_blocks * group_blocks
    g = torch.Generator().manual_seed(seed)
    spec = QuantSpec("int8") if kind == "int8-channel" else QuantSpec(kind, 32 * group_blocks)
    qw = quantize(torch.randn(n, k, generator=g), spec)
    x = torch.randn(m, k, generator=g)
    y = qlinear_triton(x.to(DEVICE), _on(qw), config)
    assert y.shape == (m, n) and y.dtype == x.dtype
    assert _rel_err(y.cpu(), x @ qw.dequantize().T) < TOL


def _on(qw: QuantizedWeight) -> QuantizedWeight:
    return QuantizedWeight(qw.kind, *(t.to(DEVICE) if t is not None else None for t in (qw.qweight, qw.scales,
                                                                                        qw.mins)), qw.group_size)


def test_leading_dims_and_a_wrong_width_are_handled():
    qw = quantize(torch.randn(8, 64), QuantSpec("int4", 32))
    x = torch.randn(2, 3, 64)
    assert _rel_err(qlinear_triton(x.to(DEVICE), _on(qw)).cpu(), x @ qw.dequantize().T) < TOL
    with pytest.raises(ValueError, match="expects 64"):
        qlinear_triton(torch.randn(2, 32, device=DEVICE), _on(qw))
    with pytest.raises(ValueError, match="multiple of 32"):
        qlinear_triton(x.to(DEVICE), _on(qw), TileConfig(16, 16, 48))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_activations_keep_their_dtype(dtype):
    """fp16/bf16 activations take the tensor cores' half-precision products (fp32 accumulation): the result is
    x's dtype and within that dtype's rounding of the float64 product, decode (split-K) and prefill tiles alike."""
    if dtype == torch.bfloat16 and DEVICE == "cpu":
        pytest.skip("Triton 3.9's interpreter gets tl.dot on bf16 wrong (a 16x16 bf16 dot is off by ~1e10 there); "
                    "this case runs on a GPU")
    qw = quantize(torch.randn(48, 128), QuantSpec("int4", 64))
    for m in (1, 24):
        x = torch.randn(m, 128).to(dtype)
        y = qlinear_triton(x.to(DEVICE), _on(qw))
        ref = x.double() @ qw.dequantize().double().T
        assert y.dtype == dtype and y.shape == (m, 48)
        assert _rel_err(y.cpu().double(), ref) < (4e-3 if dtype == torch.float16 else 2e-2)


def test_tile_config_spreads_decode_over_the_gpu():
    """Decode (few rows) splits K so that n-tiles x K-slices cover about two programs per SM, never more slices than
    K has tiles; prefill does not split."""
    for n, k in ((4096, 4096), (11008, 4096), (4096, 11008), (576, 1536), (64, 128)):
        c = tile_config(1, n, k, 132)
        tiles_n, tiles_k = -(-n // c.block_n), -(-k // c.block_k)
        assert 1 <= c.split_k <= tiles_k
        assert tiles_n * c.split_k >= min(132, tiles_n * tiles_k) or c.split_k == tiles_k
        assert tile_config(512, n, k, 132).split_k == 1


def test_the_wrong_nibble_order_is_far_outside_the_tolerance():
    """The test above would catch a kernel that reads each byte's two nibbles as neighbours (element 2j, 2j+1)
    instead of GGUF's j, j + 16: that weight gives a very different product."""
    qw = quantize(torch.randn(16, 64), QuantSpec("int4", 32))
    q = unpack_int4(qw.qweight).view(16, 2, 2, 16)                # [rows, blocks, lo/hi half, 16]
    interleaved = q.transpose(2, 3).reshape(16, 64)              # what the other order would mean
    wrong = QuantizedWeight("int4", pack_int4(interleaved), qw.scales, qw.mins, 32)
    x = torch.randn(4, 64)
    ref = x @ qw.dequantize().T
    assert _rel_err(qlinear_triton(x.to(DEVICE), _on(qw)).cpu(), ref) < TOL
    assert _rel_err(x @ wrong.dequantize().T, ref) > 1000 * TOL


@pytest.mark.slow
def test_aot_compile_for_sm80_and_sm90_without_a_gpu():
    jobs = [(80, "fp16", "int4", 1), (90, "bf16", "int4", 256), (80, "bf16", "int8", 32), (90, "fp16", "int8", 1),
            (90, "fp32", "int4", 1), (80, "fp32", "int8", 256)]
    out = aot_compile(jobs)
    assert len(out) == len(jobs)
    for (arch, _, _, _), asm in out.items():
        assert f".entry {KERNEL_NAME}(" in asm["ptx"]
        assert f".target sm_{arch}" in asm["ptx"]
        assert asm["cubin_bytes"] > 0          # triton's bundled ptxas assembled it
