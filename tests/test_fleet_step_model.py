"""The replica step-time model: features, the fit (recovers known coefficients; a sum-not-max model is rejected by
its error on mixed steps), the roofline, JSON."""
from __future__ import annotations

import numpy as np
import pytest

from minillm.fleet.step_model import COEFFS, FITTED, StepFeatures, StepModel, StepTrace, fit, from_roofline, nnls

TRUE = dict.fromkeys(COEFFS, 0.0) | dict(o_step=2e-3, o_seq=5e-5, c_token=4e-5, c_pair=1e-8, m_step=8e-3, m_kv=2e-7)


def synthetic(n: int, seed: int, noise: float = 0.01, model: StepModel | None = None) -> list[StepTrace]:
    """Steps like a chunked-prefill engine makes: decodes at various contexts, some with a prompt chunk."""
    model = model or StepModel(TRUE)
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        ctx = rng.integers(10, 2000, int(rng.integers(1, 64)))
        chunks = [(int(c), 1, 1) for c in ctx]
        p = int(rng.choice([0, 0, 16, 64, 256, 512]))
        if p:
            chunks.append((int(rng.integers(0, 500)), p, 10 ** 6))
        f = StepFeatures.of(chunks)
        out.append(StepTrace(f, model.seconds(f) * (1 + noise * rng.standard_normal())))
    return out


def test_features_of_a_mixed_step():
    # a decode at context 9 (prompt 5), a 4-token chunk after 8 computed of a 20-token prompt, a fresh 3-token prompt
    f = StepFeatures.of([(9, 1, 5), (8, 4, 20), (0, 3, 3)])
    assert (f.prefill_tokens, f.decode_tokens, f.num_seqs) == (7, 1, 3)
    assert f.kv_tokens == 10 + 12 + 3
    assert f.attn_pairs == 10 + (9 + 10 + 11 + 12) + (1 + 2 + 3)


def test_max_not_sum():
    m = StepModel(dict.fromkeys(COEFFS, 0.0) | dict(c_token=1.0, m_step=3.0))
    assert m.seconds(StepFeatures(prefill_tokens=2)) == 3.0          # memory bound: the chunk rides along
    assert m.seconds(StepFeatures(prefill_tokens=5)) == 5.0
    assert StepModel(m.coeffs, form="sum").seconds(StepFeatures(prefill_tokens=2)) == 5.0


def test_nnls_matches_a_brute_force_over_active_sets():
    rng = np.random.default_rng(0)
    A, b = rng.standard_normal((30, 4)), rng.standard_normal(30)
    x = nnls(A, b)
    assert (x >= 0).all()
    best = min(np.sum((A @ np.clip(np.linalg.lstsq(A[:, m], b, rcond=None)[0] @ np.eye(4)[m], 0, None) - b) ** 2)
               if any(m) else np.sum(b ** 2)
               for m in (np.array([(k >> j) & 1 for j in range(4)], bool) for k in range(16))
               if not any(m) or (np.linalg.lstsq(A[:, m], b, rcond=None)[0] >= 0).all())
    assert np.sum((A @ x - b) ** 2) <= best + 1e-9


def test_fit_recovers_known_coefficients():
    m = fit(synthetic(240, 0, noise=0.002), held_out=synthetic(60, 1, noise=0.002))
    for k in FITTED:
        assert m.coeffs[k] == pytest.approx(TRUE[k], rel=0.05), k
    assert m.fit_error["median"] < 0.005


def test_a_sum_model_is_rejected_by_its_error_on_mixed_steps():
    train = synthetic(240, 0)
    mixed = [t for t in synthetic(300, 2) if t.features.prefill_tokens and t.features.decode_tokens]
    good, bad = fit(train, held_out=mixed), fit(train, form="sum", held_out=mixed)
    assert good.fit_error["median"] < 0.02
    assert bad.fit_error["p90"] > 5 * good.fit_error["p90"] and bad.fit_error["p90"] > 0.05


def test_fit_sees_context_length():
    """Steps that differ only in context: a fit must put the difference on m_kv / c_pair, not average it away."""
    short = [StepTrace(StepFeatures(0, 32, 32 * 50, 32 * 50, 32), 0.01 + 32 * 50 * 2e-7)] * 10
    long = [StepTrace(StepFeatures(0, 32, 32 * 4000, 32 * 4000, 32), 0.01 + 32 * 4000 * 2e-7)] * 10
    m = fit(short + long)
    assert m.seconds(long[0].features) / m.seconds(short[0].features) == pytest.approx(
        long[0].seconds / short[0].seconds, rel=0.02)


def test_roofline_decode_is_memory_bound_and_prefill_compute_bound():
    m = from_roofline("llama-3.1-8b", "h100-sxm")
    k = m.coeffs
    decode = StepFeatures.of([(1000, 1, 1)] * 8)
    prefill = StepFeatures.of([(0, 4096, 4096)])
    comp = lambda f: k["c_token"] * f.tokens + k["c_pair"] * f.attn_pairs + k["c_seq"] * f.num_seqs  # noqa: E731
    mem = lambda f: k["m_step"] + k["m_kv"] * f.kv_tokens  # noqa: E731
    assert mem(decode) > comp(decode) and comp(prefill) > mem(prefill)
    # 8B bf16 = 16.06 GB, less the untied input embedding (a row gather, 1.05 GB), at 3350 GB/s x 0.7: ~6.4 ms
    assert k["m_step"] == pytest.approx((16.06e9 - 128256 * 4096 * 2) / (3350e9 * 0.7), rel=0.01)
    assert m.replica["num_blocks"] > 0
    assert from_roofline("llama-3.1-70b", "h100-sxm", tp=4).coeffs["o_token"] > 0   # TP all-reduces cost


def test_roofline_refuses_a_model_that_does_not_fit():
    with pytest.raises(ValueError, match="no room for a KV pool"):
        from_roofline("llama-3.1-70b", "h100-sxm", tp=1)


def test_json_round_trip(tmp_path):
    m = fit(synthetic(50, 3), replica={"num_blocks": 10, "block_size": 16}, held_out=synthetic(10, 4))
    back = StepModel.load(m.save(tmp_path / "m.json"))
    assert back == m
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ValueError, match="not a step model"):
        StepModel.load(tmp_path / "bad.json")


def test_split_fit_recovers_two_code_paths():
    """A decode-only step and a step with a prompt chunk run different code paths on a CPU (fused C call vs the
    layers): with split=True each gets its coefficients, and they survive JSON."""
    layered = dict(TRUE, o_step=2e-2, m_step=0.0)
    two = StepModel(TRUE, prefill_coeffs=layered)
    traces = synthetic(300, 3, model=two)
    m = fit(traces, split=True, held_out=synthetic(60, 4, model=two))
    assert m.prefill_coeffs["o_step"] == pytest.approx(2e-2, rel=0.1) and m.coeffs["o_step"] < 1.1e-2
    assert m.fit_error["median"] < 0.02 and fit(traces).relative_errors(traces).mean() > 0.05
    assert StepModel.from_json(m.to_json()) == m


def test_split_fit_recovers_short_prefill_steps_on_their_own_kernel():
    """Prefill steps of at most 64 tokens run another kernel (tiles) than longer ones (the int16 copy): with
    short_prefill_tokens=64 each side of the line gets its own coefficients; without, one line misfits the short
    steps. The three sets survive JSON, and a set without its threshold is refused."""
    short = dict(TRUE, o_step=5e-3, c_token=9e-5)
    three = StepModel(TRUE, prefill_coeffs=dict(TRUE, o_step=2e-2), short_prefill_coeffs=short,
                      short_prefill_tokens=64)
    traces = synthetic(400, 5, model=three)
    held = synthetic(80, 6, model=three)
    m = fit(traces, split=True, held_out=held, short_prefill_tokens=64)
    # (few short steps: their tokens and sequences are nearly collinear, so the prediction is checked, not each
    # coefficient)
    shorts = [t for t in held if t.features.prefill_tokens and t.features.tokens <= 64]
    assert m.short_prefill_tokens == 64 and len(shorts) >= 5 and m.fit_error["median"] < 0.02
    assert np.median(m.relative_errors(shorts)) < 0.02
    two = fit(traces, split=True)
    assert not two.short_prefill_coeffs and np.median(two.relative_errors(shorts)) > 0.1
    assert StepModel.from_json(m.to_json()) == m
    with pytest.raises(ValueError, match="short_prefill_tokens > 0"):
        StepModel(TRUE, prefill_coeffs=TRUE, short_prefill_coeffs=TRUE)
    with pytest.raises(ValueError, match="missing"):
        StepModel(TRUE, prefill_coeffs=TRUE, short_prefill_coeffs={"o_step": 1.0}, short_prefill_tokens=64)


def test_the_fast_engines_step_time_takes_the_same_coefficient_set():
    from minillm.fleet.aggregate.fleet import AggregateFleet
    from minillm.fleet.aggregate.routing import make_batch_router
    from minillm.fleet.replica import ReplicaConfig
    three = StepModel(TRUE, prefill_coeffs=dict(TRUE, o_step=2e-2), short_prefill_coeffs=dict(TRUE, o_step=5e-3),
                      short_prefill_tokens=64)
    feats = [f.features for f in synthetic(200, 7, model=three)]
    arr = lambda name: np.array([getattr(f, name) for f in feats], float)     # noqa: E731
    fleet = AggregateFleet(three, ReplicaConfig(4096, 16, 64, 512), 1, make_batch_router("round-robin", 1))
    got = fleet.step_seconds(arr("prefill_tokens"), arr("decode_tokens"), arr("kv_tokens"), arr("attn_pairs"),
                             arr("num_seqs"))
    assert np.allclose(got, [three.seconds(f) for f in feats], rtol=1e-12)
