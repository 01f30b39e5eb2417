"""The sampler: each transform's defining property, the vectorized batch against a per-row reference written
here, seeded rows independent of the batch, logprobs, and validation. Statistical checks state their test
(Pearson chi-square), their seed and their sample size."""
import math

import numpy as np
import pytest
import torch
from hypothesis import example, given, settings, strategies as st

from minillm.sampling.params import MAX_LOGPROBS, SamplingParams
from minillm.sampling.processors import (apply_min_p, apply_penalties, apply_top_k, apply_top_p, process_logits)
from minillm.sampling.sampler import Sampler, SamplingBatch, draw, make_generator, row_argmax
from minillm.testing import chi_square

sampler = Sampler()
SETTINGS = dict(deadline=None, derandomize=True)


def batch_of(params, gens=None, prompts=None, outputs=None):
    n = len(params)
    return SamplingBatch(list(params), list(gens or [None] * n), list(prompts or [[]] * n), list(outputs or [[]] * n))


def sample(logits, params, gen=None):
    return sampler(logits[None], batch_of([params], [gen])).token_ids[0]


def rows(seed, b, v, scale=3.0):
    return torch.randn(b, v, generator=torch.Generator().manual_seed(seed)) * scale


def col(values, dtype=torch.float32):
    return torch.tensor(values, dtype=dtype)


# ---------------------------------------------------------------- a per-row reference, from the definitions

def reference_probs(logits, p: SamplingParams) -> torch.Tensor:
    """One row's distribution, in numpy float64 from the definitions (not the engine's vectorized torch code):
    softmax(logits / T); min-p keeps the tokens whose probability is at least min_p x the largest; top-k keeps the
    k largest logits (ties with the k-th kept); top-p keeps the smallest most-likely-first set whose probability
    reaches top_p. Each rule sees the distribution the rules before it left (renormalized); a greedy row
    (temperature 0) is one-hot on the argmax."""
    x = np.asarray(logits, dtype=np.float64)
    if p.temperature == 0:
        return torch.from_numpy(np.eye(len(x))[np.argmax(x)])
    x = x / p.temperature
    keep = np.ones(len(x), dtype=bool)

    def dist() -> np.ndarray:
        w = np.where(keep, np.exp(x - x[keep].max()), 0.0)
        return w / w.sum()

    if p.min_p > 0:
        q = dist()
        keep &= q >= p.min_p * q.max()
    if 0 < p.top_k < len(x):
        kth = np.sort(x[keep])[::-1][min(p.top_k, keep.sum()) - 1]
        keep &= x >= kth
    if p.top_p < 1:
        q = dist()
        order = np.argsort(-q, kind="stable")
        reach = np.cumsum(q[order]) >= p.top_p
        size = int(np.argmax(reach)) + 1 if reach.any() else keep.sum()     # the first prefix reaching top_p
        keep[:] = False
        keep[order[:size]] = True
    return torch.from_numpy(dist())


settings_strategy = st.builds(
    SamplingParams, temperature=st.sampled_from([0.5, 1.0, 1.7]), top_k=st.sampled_from([0, 1, 3, 10]),
    top_p=st.sampled_from([1.0, 0.9, 0.5, 0.2]), min_p=st.sampled_from([0.0, 0.05, 0.3]))


@settings(max_examples=40, **SETTINGS)
# the smallest vocabulary with every rule at its tightest; a greedy row beside random ones; min-p leaving fewer
# tokens than top-k asks for; top-k = 1 with top-p = 1 (exactly the argmax)
@example(seed=0, params=[SamplingParams(temperature=0.5, top_k=1, top_p=0.2, min_p=0.3)], vocab=2)
@example(seed=1, params=[SamplingParams(temperature=0), SamplingParams(temperature=1.7, top_p=0.5),
                         SamplingParams(temperature=1.0)], vocab=40)
@example(seed=2, params=[SamplingParams(temperature=1.0, top_k=10, min_p=0.3)], vocab=40)
@example(seed=3, params=[SamplingParams(temperature=1.7, top_k=1)], vocab=3)
@given(seed=st.integers(0, 10**6), params=st.lists(settings_strategy, min_size=1, max_size=6),
       vocab=st.integers(2, 40))
def test_vectorized_batch_equals_the_per_row_reference(seed, params, vocab):
    logits = rows(seed, len(params), vocab)
    probs = sampler.probs(logits, batch_of(params))
    for i, p in enumerate(params):
        torch.testing.assert_close(probs[i].double(), reference_probs(logits[i], p), atol=1e-5, rtol=1e-4)


def test_a_loop_per_row_is_not_needed_the_transforms_take_one_setting_per_row():
    logits = rows(1, 3, 30)
    out = process_logits(logits, col([1.0, 0.5, 2.0]), col([0, 2, 5], torch.int64), col([1.0, 1.0, 0.3]),
                         col([0.0, 0.0, 0.1]))
    alone = [process_logits(logits[i:i + 1], col([t]), col([k], torch.int64), col([p]), col([m]))
             for i, (t, k, p, m) in enumerate([(1.0, 0, 1.0, 0.0), (0.5, 2, 1.0, 0.0), (2.0, 5, 0.3, 0.1)])]
    torch.testing.assert_close(out, torch.cat(alone))


# ---------------------------------------------------------------- each transform's property

@settings(max_examples=60, **SETTINGS)
@example(seed=0, vocab=2, p=1.0)                     # keeps everything
@example(seed=1, vocab=200, p=0.01)                  # only the most likely token
@example(seed=2, vocab=2, p=0.5)
@given(seed=st.integers(0, 10**6), vocab=st.integers(2, 200), p=st.floats(0.01, 1.0))
def test_top_p_keeps_the_smallest_set_reaching_p_including_the_crossing_token(seed, vocab, p):
    logits = rows(seed, 1, vocab)
    kept = torch.isfinite(apply_top_p(logits, col([p])))[0]
    probs = logits[0].softmax(-1).double()
    order = probs.argsort(descending=True)
    k = int(kept.sum())
    assert set(order[:k].tolist()) == set(kept.nonzero().flatten().tolist())   # the k most likely
    assert probs[order[:k]].sum() >= p - 1e-6                                  # their mass reaches p ...
    assert k == 1 or probs[order[:k - 1]].sum() < p + 1e-6                     # ... one fewer would not


@settings(max_examples=40, **SETTINGS)
@example(seed=0, vocab=10, k=-1)                     # k <= 0: everything
@example(seed=0, vocab=10, k=0)
@example(seed=1, vocab=10, k=1)
@example(seed=2, vocab=10, k=9)                      # all but one
@example(seed=2, vocab=10, k=10)                     # k = V: everything
@given(seed=st.integers(0, 10**6), vocab=st.integers(2, 100), k=st.integers(-1, 120))
def test_top_k_keeps_the_k_most_likely(seed, vocab, k):
    logits = rows(seed, 1, vocab)
    kept = torch.isfinite(apply_top_k(logits, col([k], torch.int64)))[0]
    expect = vocab if k <= 0 or k >= vocab else k
    assert int(kept.sum()) == expect
    assert float(logits[0][kept].min()) >= float(logits[0][~kept].max()) if expect < vocab else True


@settings(max_examples=40, **SETTINGS)
@example(seed=0, vocab=10, m=0.0)                    # nothing dropped
@example(seed=1, vocab=10, m=1.0)                    # only the most likely token(s)
@example(seed=2, vocab=2, m=0.5)
@given(seed=st.integers(0, 10**6), vocab=st.integers(2, 100), m=st.floats(0.0, 1.0))
def test_min_p_drops_exactly_the_tokens_below_min_p_times_the_top(seed, vocab, m):
    logits = rows(seed, 1, vocab)
    kept = torch.isfinite(apply_min_p(logits, col([m])))[0]
    probs = logits[0].softmax(-1)
    assert torch.equal(kept, probs >= m * probs.max())
    assert bool(kept[probs.argmax()])


@settings(max_examples=40, **SETTINGS)
@example(seed=0, vocab=4, prompt=[], output=[], rep=1.5, pres=1.0, freq=1.0)        # nothing seen: untouched
@example(seed=1, vocab=4, prompt=[1], output=[2, 2, 2, 1], rep=1.0, pres=0.0, freq=0.0)   # neutral settings
@example(seed=2, vocab=8, prompt=[0, 3], output=[3, 3, 5], rep=0.5, pres=-2.0, freq=2.0)
@given(seed=st.integers(0, 10**6), vocab=st.integers(4, 60),
       prompt=st.lists(st.integers(0, 59), max_size=8), output=st.lists(st.integers(0, 59), max_size=8),
       rep=st.floats(0.5, 2.0), pres=st.floats(-2, 2), freq=st.floats(-2, 2))
def test_penalties_touch_only_seen_tokens_and_by_the_stated_amounts(seed, vocab, prompt, output, rep, pres, freq):
    prompt = [t % vocab for t in prompt]
    output = [t % vocab for t in output]
    logits = rows(seed, 1, vocab)
    out = apply_penalties(logits, [prompt], [output], col([rep]), col([pres]), col([freq]))[0]
    for t in range(vocab):
        x = float(logits[0, t])
        if t not in prompt and t not in output:
            assert float(out[t]) == x
            continue
        want = x / rep if x > 0 else x * rep
        want -= freq * output.count(t) + (pres if t in output else 0.0)
        assert math.isclose(float(out[t]), want, rel_tol=1e-5, abs_tol=1e-5)


def test_repetition_penalty_changes_greedy_choice_only_through_seen_tokens():
    logits = torch.tensor([[3.0, 2.9, 0.0, -1.0]])
    p = SamplingParams(temperature=0, repetition_penalty=1.5)
    b = batch_of([p], prompts=[[0]], outputs=[[]])
    assert sampler(logits, b).token_ids == [1]                   # 3.0 / 1.5 = 2.0 < 2.9
    assert sampler(logits, batch_of([p], prompts=[[3]])).token_ids == [0]


@settings(max_examples=30, **SETTINGS)
@example(seed=0, vocab=2, temp=0.1)
@example(seed=1, vocab=300, temp=5.0)
@given(seed=st.integers(0, 10**6), vocab=st.integers(2, 300), temp=st.floats(0.1, 5.0))
def test_top_k_1_is_greedy(seed, vocab, temp):
    logits = rows(seed, 1, vocab)[0]
    g = make_generator(seed)
    assert {sample(logits, SamplingParams(temperature=temp, top_k=1), g) for _ in range(5)} == {int(logits.argmax())}


def test_temperature_to_zero_approaches_greedy():
    logits = rows(7, 1, 50, 1.0)[0]
    top = int(logits.argmax())
    share = {}
    for t in (1.0, 0.3, 0.05):
        g = make_generator(3)
        share[t] = sum(sample(logits, SamplingParams(temperature=t), g) == top for _ in range(400)) / 400
    assert share[1.0] < share[0.3] <= share[0.05] and share[0.05] >= 0.99


# ---------------------------------------------------------------- the draw

def test_draws_follow_the_processed_distribution_chi_square():
    """Pearson chi-square, 20,000 draws per row (seed 11), each row with its own settings: p > 1e-3 for each.
    A draw that ignores the row's settings (plain softmax) is rejected on the same samples (p < 1e-12)."""
    logits = rows(5, 3, 12, 1.5)
    params = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=5),
              SamplingParams(temperature=1.3, top_p=0.8, min_p=0.05)]
    n = 20_000
    b = batch_of([p for p in params for _ in range(n)])
    big = logits.repeat_interleave(n, 0)
    torch.manual_seed(11)
    toks = torch.tensor(sampler(big, b).token_ids).view(3, n)
    for i, p in enumerate(params):
        counts = torch.bincount(toks[i], minlength=12)
        assert chi_square(counts, reference_probs(logits[i], p)).p_value > 1e-3, (i, counts)
    wrong = chi_square(torch.bincount(toks[2], minlength=12), logits[2].softmax(-1))
    assert wrong.p_value < 1e-12


def test_draw_picks_token_j_with_probability_p_j():
    """The exponential race on its own: 40,000 draws (seed 3) from a fixed distribution, chi-square p > 1e-3."""
    probs = torch.tensor([0.4, 0.3, 0.2, 0.07, 0.03, 0.0])
    g = make_generator(3)
    toks = torch.cat([draw(probs.expand(4000, -1).clone(), [g] * 4000) for _ in range(10)])
    counts = torch.bincount(toks, minlength=6)
    assert counts[5] == 0
    assert chi_square(counts, probs).p_value > 1e-3


@settings(max_examples=20, **SETTINGS)
@example(seed=0, vocab=2, temp=0.3)
@example(seed=2**31 - 1, vocab=300, temp=2.0)
@given(seed=st.integers(0, 2**31 - 1), vocab=st.integers(2, 300), temp=st.floats(0.3, 2.0))
def test_same_seed_reproduces(seed, vocab, temp):
    logits = rows(seed, 1, vocab)[0]
    p = SamplingParams(temperature=temp, top_p=0.9, seed=seed)
    a, b = make_generator(seed), make_generator(seed)
    assert [sample(logits, p, a) for _ in range(10)] == [sample(logits, p, b) for _ in range(10)]


@settings(max_examples=25, **SETTINGS)
@example(seed=0, others=[], at=0, target=SamplingParams(temperature=1.0))               # alone in its batch
@example(seed=1, others=[SamplingParams(temperature=0.5, top_k=3)] * 2, at=5,           # last, after greedy-ish rows
         target=SamplingParams(temperature=1.7, top_p=0.2))
@given(seed=st.integers(0, 10**6), others=st.lists(settings_strategy, max_size=5), at=st.integers(0, 5),
       target=settings_strategy)
def test_a_seeded_row_draws_the_same_token_whatever_else_is_in_the_batch(seed, others, at, target):
    at = min(at, len(others))
    target.seed = seed
    vocab = 40
    logits = rows(seed, len(others) + 1, vocab)
    alone = sampler(logits[at:at + 1], batch_of([target], [make_generator(seed)])).token_ids[0]
    params = others[:at] + [target] + others[at:]
    gens = [None] * at + [make_generator(seed)] + [None] * (len(others) - at)
    torch.manual_seed(seed + 1)           # the unseeded rows' draws must not move the seeded one
    assert sampler(logits, batch_of(params, gens)).token_ids[at] == alone


# ---------------------------------------------------------------- logprobs

@settings(max_examples=25, **SETTINGS)
@example(seed=0, n=0, temp=0.0)                      # the sampled token's logprob only
@example(seed=1, n=8, temp=0.8)
@given(seed=st.integers(0, 10**6), n=st.integers(0, 8), temp=st.sampled_from([0.0, 0.8]))
def test_logprobs_are_the_raw_log_softmax_with_rank_and_top_n(seed, n, temp):
    logits = rows(seed, 2, 30)
    p = SamplingParams(temperature=temp, top_k=3, logprobs=n)
    out = sampler(logits, batch_of([p, SamplingParams(temperature=temp)], [make_generator(seed), None]))
    assert out.logprobs[1] is None
    lp, tok = out.logprobs[0], out.token_ids[0]
    raw = logits[0].log_softmax(-1)
    assert lp.token_id == tok and math.isclose(lp.logprob, float(raw[tok]), abs_tol=1e-5)
    assert lp.rank == int((raw > raw[tok]).sum()) + 1
    assert [t for t, _ in lp.top] == raw.topk(n).indices.tolist()
    assert all(math.isclose(v, float(raw[t]), abs_tol=1e-5) for t, v in lp.top)


# ---------------------------------------------------------------- validation

@pytest.mark.parametrize("kw, words", [
    (dict(max_tokens=0), "max_tokens"), (dict(max_tokens=-3), "max_tokens"), (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"), (dict(temperature=-0.1), "temperature"), (dict(top_k=-2), "top_k"),
    (dict(n=0), "n must"), (dict(stop=[""]), "stop"), (dict(temperature=float("nan")), "temperature.*finite"),
    (dict(temperature=float("inf")), "temperature"), (dict(top_p=float("nan")), "top_p"),
    (dict(min_p=1.5), "min_p"), (dict(min_p=float("nan")), "min_p"), (dict(repetition_penalty=0.0), "repetition"),
    (dict(repetition_penalty=float("inf")), "repetition"), (dict(presence_penalty=3.0), "presence"),
    (dict(frequency_penalty=float("-inf")), "frequency"), (dict(logprobs=MAX_LOGPROBS + 1), "logprobs"),
    (dict(logprobs=-1), "logprobs"), (dict(seed=-1), "seed"), (dict(temperature="hot"), "temperature"),
    (dict(top_k=True), "top_k"), (dict(stop_token_ids=[-4]), "stop_token_ids"),
])
def test_invalid_params_say_what_is_wrong(kw, words):
    with pytest.raises(ValueError, match=words):
        SamplingParams(**kw)


def test_params_changed_after_construction_are_checked_again_before_they_run():
    from minillm.engine.llm_engine import LLMEngine
    from minillm.testing import tiny_model
    engine = LLMEngine.from_model(tiny_model(), None, num_blocks=16, block_size=4)
    p = SamplingParams()
    p.temperature = float("nan")
    with pytest.raises(ValueError, match="temperature"):
        engine.add_request([5, 6, 7], p)
    assert not engine.has_unfinished_requests() and engine.block_manager.num_free_blocks == 16


# ---------------------------------------------------------------- row_argmax: torch's argmax, faster on the CPU

@settings(max_examples=60, **SETTINGS)
@given(st.integers(0, 2**31 - 1), st.integers(0, 6), st.sampled_from([128 * 8, 128 * 11, 49152, 1000, 64]),
       st.lists(st.tuples(st.sampled_from(["nan", "inf", "-inf", "tie", "max_at_slice_end", "all_-inf"]),
                          st.integers(0, 5), st.floats(0, 1)), max_size=6))
@example(1, 2, 128 * 8, [("tie", 0, 0.99), ("tie", 1, 0.0)])
@example(1, 1, 128 * 8, [("nan", 0, 0.7), ("nan", 0, 0.2)])
def test_row_argmax_is_torchs_argmax_ties_nans_and_infs_included(seed, b, v, edits):
    """The first index of each row's maximum, and its first NaN where it has one, exactly as x.argmax(-1): with
    values placed at slice boundaries, ties across slices, NaNs, infinities and all -inf rows; widths that do not
    split into slices take torch's own path."""
    x = rows(seed, b, v).round(decimals=1)          # rounding makes ties within a row common
    for kind, r, at in edits:
        if r >= b:
            continue
        j = min(int(at * v), v - 1)
        if kind == "nan":
            x[r, j] = float("nan")
        elif kind == "inf":
            x[r, j] = float("inf")
        elif kind == "-inf":
            x[r, j] = float("-inf")
        elif kind == "all_-inf":
            x[r] = float("-inf")
        elif kind == "max_at_slice_end":
            x[r, min(j // 128 * 128 + 127, v - 1)] = x[r].nan_to_num().max() + 1
        else:                                        # the row's maximum again, later in the row
            x[r, j] = x[r].nan_to_num(nan=-1e9).max()
    assert torch.equal(row_argmax(x), x.argmax(-1))
