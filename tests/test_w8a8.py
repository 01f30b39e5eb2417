"""W8A8 (int8 weights per channel x int8 activations per token) and the batched paths of weight-only layers:
every implementation vs the torch reference, the reference vs a numpy oracle written from the definition, a
per-tensor implementation caught, the lazily built copies, and models that run w8a8."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from minillm.kernels import cpu_qgemm, cpu_w8a8
from minillm.quant.formats import W8A8_LEVELS, QuantizedWeight, QuantSpec, quantize, quantize_per_token

W8A8 = QuantSpec("int8", act="int8")
# Every implementation computes the same integer sums; what remains is float32 rounding of the rescale (and of
# int32 -> float32 for sums above 2^24): ~1e-7 relative. 1e-5 still fails any wrong step, scale or code (order 1e-2+).
IMPL_RTOL = 1e-5


def _rand(n: int, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, k, generator=g) * torch.rand(n, 1, generator=g).add(0.1)


def _rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    """Worst row's error relative to that row's largest output."""
    return float(((y.float() - ref.float()).abs().amax(1) / ref.float().abs().amax(1).clamp_min(1e-30)).max())


def _impls() -> list[str]:
    return [i for i in cpu_w8a8.IMPLS if i != "fbgemm" or cpu_w8a8.fbgemm_available()]


@pytest.mark.parametrize("impl", cpu_w8a8.IMPLS)
@given(n=st.integers(1, 70), k_blocks=st.integers(1, 6), m=st.integers(1, 64), outlier=st.booleans(),
       seed=st.integers(0, 2**31 - 1))
@settings(max_examples=15, deadline=None, derandomize=True)
@example(n=1, k_blocks=1, m=1, outlier=False, seed=0)
@example(n=9, k_blocks=3, m=64, outlier=True, seed=1)
@example(n=5, k_blocks=2, m=3, outlier=True, seed=2)
def test_each_implementation_equals_the_reference(impl, n, k_blocks, m, outlier, seed):
    if impl == "fbgemm" and not cpu_w8a8.fbgemm_available():
        pytest.skip("torch has no FBGEMM quantized ops here")
    k = 32 * k_blocks
    qw = quantize(_rand(n, k, seed), W8A8)
    x = _rand(m, k, seed + 1) * 5
    if outlier:
        x[0, 0] = 300.0
    x[-1] = 0.0                                            # an all-zero row (a padded token) gives zeros
    y = cpu_w8a8.w8a8_linear(x, qw, impl)
    ref = cpu_w8a8.reference(x, qw)
    assert y.shape == (m, n) and y.dtype == x.dtype
    assert torch.equal(y[-1], torch.zeros(n))
    if m > 1:
        assert _rel_err(y[:-1], ref[:-1]) < IMPL_RTOL


def _numpy_oracle(x: np.ndarray, codes_w: np.ndarray, scales_w: np.ndarray, levels: int) -> np.ndarray:
    """W8A8 from its definition, in numpy: per row step = max|x| / levels, codes = rint(x / step), an int64 dot
    product, times step[m] * scale[n]."""
    x = x.astype(np.float32)
    step = np.maximum(np.abs(x).max(axis=1) / np.float32(levels), np.finfo(np.float32).tiny).astype(np.float32)
    codes = np.clip(np.rint(x / step[:, None]), -levels, levels).astype(np.int64)
    acc = codes @ codes_w.astype(np.int64).T
    return acc * (step.astype(np.float64)[:, None] * scales_w.astype(np.float64)[None, :])


def test_reference_equals_a_numpy_oracle_of_the_definition():
    x = _rand(6, 96, 3) * 4
    x[2, 7] = -250.0
    qw = quantize(_rand(11, 96, 4), W8A8)
    codes, step = quantize_per_token(x)
    assert codes.abs().max() == W8A8_LEVELS and bool((codes == codes.round()).all())
    want = _numpy_oracle(x.numpy(), qw.qweight.numpy(), qw.scales.float().view(-1).numpy(), W8A8_LEVELS)
    got = cpu_w8a8.reference(x.double(), qw).numpy()
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=0)


def _per_tensor(x: torch.Tensor, qw: QuantizedWeight) -> torch.Tensor:
    """A plausible wrong W8A8: one step for the whole activation tensor (what FBGEMM's linear_dynamic does when
    it is handed x itself)."""
    step = x.abs().max() / W8A8_LEVELS
    codes = torch.round(x / step)
    return (codes.double() @ qw.qweight.double().T * step.double() * qw.scales.double().view(1, -1)).float()


def test_a_per_tensor_implementation_is_caught_on_a_row_next_to_an_outlier():
    qw = quantize(_rand(16, 128, 5), W8A8)
    x = _rand(3, 128, 6)
    x[0, 3] = 400.0                    # token 0 has an outlier: per tensor, it sets token 1's step too
    exact = x @ qw.dequantize().T
    ref = cpu_w8a8.reference(x, qw)
    wrong = _per_tensor(x, qw)
    err_token = _rel_err(ref[1:2], exact[1:2])
    err_tensor = _rel_err(wrong[1:2], exact[1:2])
    assert err_token < 0.05 < err_tensor and err_tensor > 10 * err_token
    assert _rel_err(wrong, ref) > 1000 * IMPL_RTOL      # it fails the test every implementation passes
    if cpu_w8a8.fbgemm_available():                     # and so does FBGEMM fed x instead of the pinned codes
        plain = torch.ops.quantized.linear_dynamic(x, cpu_w8a8.prepacked(qw), True)
        assert _rel_err(plain, ref) > 1000 * IMPL_RTOL


def test_bad_w8a8_settings_are_refused():
    with pytest.raises(ValueError, match="one scale per output channel"):
        QuantSpec("int8", 32, act="int8")
    with pytest.raises(ValueError, match="one scale per output channel"):
        QuantSpec("int4", 32, act="int8")
    with pytest.raises(ValueError, match="unknown activation quantization"):
        QuantSpec("int8", act="int4")
    with pytest.raises(ValueError, match="one scale per output channel"):
        cpu_w8a8.w8a8_linear(torch.randn(2, 64), quantize(torch.randn(4, 64), QuantSpec("int8", 32)))
    with pytest.raises(ValueError, match="MINILLM_W8A8"), pytest.MonkeyPatch.context() as mp:
        mp.setenv("MINILLM_W8A8", "vnni")
        cpu_w8a8.impl()


# ------------------------------------------------------------------------ batched steps of weight-only layers

# What each batched path may differ from exact weight-only math (dequantize, float32 matmul), as the worst row's
# error relative to its largest output, on Gaussian activations: float/dequant only summation order; fp16 rounds
# each weight to 11 bits (<= 2^-12 relative); w8a8 requantizes weights to int8 per channel and activations to 7
# bits per token (~1-2 % here; on SmolLM2's heavier-tailed activations ~5 % per layer: docs/engine.md's
# SmoothQuant paragraph says why).
# bf16 rounds weights and activations to 8 bits and the output to bfloat16 (~2^-9 of the largest output each);
# int16 rounds both to 13 bits per chunk of 64 inputs (~1e-4; tests/test_int16_gemm.py bounds it per output).
BATCHED_RTOL = {"float": 1e-5, "dequant": 1e-5, "fp16": 2e-3, "int16": 2e-3, "bf16": 1.2e-2, "w8a8": 0.05}


@pytest.mark.parametrize("path", cpu_qgemm.BATCHED_PATHS)
@pytest.mark.parametrize("spec", [QuantSpec("int4", 32), QuantSpec("int8", 32)])
def test_batched_paths_stay_within_their_stated_error(path, spec):
    qw = quantize(_rand(40, 192, 7), spec)
    x = _rand(cpu_qgemm.BATCHED_MIN_ROWS + 3, 192, 8)
    exact = cpu_qgemm.reference(x, qw)
    err = _rel_err(cpu_qgemm.batched(x, qw, path), exact)
    assert err < BATCHED_RTOL[path]
    if path == "w8a8":      # the tolerance is not loose enough to hide a per-tensor step
        x[0, 0] = 400.0
        assert _rel_err(_per_tensor(x, quantize(qw.dequantize(), W8A8)), cpu_qgemm.reference(x, qw)) > 0.1


def test_kernel_copies_are_built_lazily_and_reported():
    """Nothing before the first product; the tiles (the weights' own bytes, reordered) from the first one; the
    batched path's copy (2 bytes a weight) only once a step has more than TILES_MAX_ROWS rows."""
    from minillm.quant.policy import cache_bytes, describe
    from minillm.testing import random_model
    from tests.tiny_models import minillm_logits
    model = random_model(3, vocab=128).quantize_(QuantSpec("int4", 32), QuantSpec("int8"))
    assert cache_bytes(model) == 0 and "kernel copies" not in describe(model)
    lib = cpu_qgemm.load("c")
    if lib is None:
        pytest.skip("no C compiler: no kernel, no copies")
    own = sum(m.quant.nbytes for _, m in model.quantizable())
    minillm_logits(model, [3])
    tiles = cache_bytes(model)
    if lib.minillm_qgemm_tiles_available():
        assert 0 < tiles <= 1.5 * own and "kernel copies" in describe(model)     # padded to 24 columns
    minillm_logits(model, list(range(cpu_qgemm.TILES_MAX_ROWS + 2)))
    assert cache_bytes(model) > tiles and "kernel copies" in describe(model)
    assert cache_bytes(model) <= tiles + 4 * sum(m.in_features * m.out_features for n, m in model.quantizable()
                                                 if "layers." in n) + 4 * 128 * model.cfg.hidden_size


# ------------------------------------------------------------------------------------------- models

def test_w8a8_model_generates_like_its_float_twin_at_a_stated_rate():
    """Greedy decode through the engine (paged KV, batching) with w8a8 layers; each generated token is compared with
    what the same weights dequantized (float activations) predict after the same prefix. A random model's
    next-token distributions are nearly flat, so 7-bit activations flip near-tied argmaxes: measured 83-88 % per
    token on seeds 0-5 (teacher-forced, 200 tokens); we ask for 75 %. SmolLM2's numbers (perplexity, SmoothQuant)
    are in docs/engine.md."""
    from minillm.engine.llm_engine import LLMEngine
    from minillm.quant.policy import apply_quantization, describe
    from minillm.sampling.params import SamplingParams
    from minillm.testing import random_model, tiny_tokenizer
    from tests.test_engine import run_engine
    from tests.tiny_models import minillm_logits
    model = random_model(2, vocab=128)
    apply_quantization(model, "w8a8")
    assert describe(model).startswith("int8+a8")
    twin = random_model(2, vocab=128)
    for (_, m), (_, t) in zip(model.quantizable(), twin.quantizable()):
        t.weight.data.copy_(m.quant.dequantize())
    prompts = [[5, 9, 33], [100, 4, 4, 4, 7, 8, 9, 10], [77], list(range(20, 40))]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    outs = run_engine(LLMEngine(model, tiny_tokenizer()), [(p, params) for p in prompts])
    agree = total = 0
    for i, p in enumerate(prompts):
        out = outs[str(i)]
        twin_next = minillm_logits(twin, p + out[:-1]).argmax(-1)[len(p) - 1:]
        agree, total = agree + int((twin_next == torch.tensor(out)).sum()), total + len(out)
    assert agree >= 0.75 * total, f"{agree}/{total}"


def test_w8a8_is_a_quantization_setting():
    from minillm.config import EngineConfig
    from minillm.quant.policy import QUANTIZATIONS
    assert "w8a8" in QUANTIZATIONS and EngineConfig.from_kwargs(quantization="w8a8").quantization == "w8a8"
