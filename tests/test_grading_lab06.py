"""lab06 checkers, graded both ways: minillm's own process_logits and draw pass the property suites; handed in as
answers (as they are, wrapped) they are refused; plausible wrong implementations fail with the diagnosis a learner
needs; correct implementations written differently from minillm's pass. Plus: the oracle agrees with the engine's
vectorized processors, and the learner-style pieces run inside a real engine through Sampler(process_fn=,
draw_fn=)."""
import math

import pytest
import torch

from minillm.grading.lab06 import TASKS, check_lab06_1, check_lab06_2, reference_process_logits, reference_row
from minillm.sampling.processors import apply_top_p, process_logits
from minillm.sampling.sampler import Sampler, draw
from grading_helpers import rejected
from tests.test_engine import finish_all

NEG_INF = float("-inf")


# ---------------------------------------------------------------- lab06_1 process_logits

def test_lab06_1_minillm_process_logits_passes():
    TASKS["lab06_1"].verify(process_logits)


def test_lab06_1_rejects_minillm_itself():
    rejected(check_lab06_1, process_logits, "minillm's own answer")
    rejected(check_lab06_1, lambda *a: process_logits(*a), "runs minillm's own")
    rejected(check_lab06_1, reference_process_logits, "minillm's own answer")

    def uses_engine_top_p(logits, temperature, top_k, top_p, min_p):     # a mix: own code, engine's top-p
        return apply_top_p(logits / temperature[:, None], top_p)
    rejected(check_lab06_1, uses_engine_top_p, "runs minillm's own", "apply_top_p")


def _col(v):
    return v[:, None]


def _min_p(x, min_p):
    p = x.softmax(-1)
    return x.masked_fill(p < _col(min_p) * p.amax(-1, keepdim=True), NEG_INF)


def _top_k(x, top_k, strict=False, zero_keeps_none=False):
    V = x.shape[-1]
    k = top_k.clone()
    if not zero_keeps_none:
        k = torch.where(k > 0, k, torch.full_like(k, V))
    k = k.clamp(max=V)
    kth = x.sort(-1, descending=True).values.gather(-1, _col((k - 1).clamp(min=0)))
    drop = x <= kth if strict else x < kth
    if zero_keeps_none:
        drop |= _col(k <= 0)
    return x.masked_fill(drop, NEG_INF)


def _top_p(x, top_p, crossing=True, keep_first=True, mass_from=None):
    vals, idx = x.sort(-1, descending=True)
    src = vals if mass_from is None else mass_from.gather(-1, idx)
    p = src.softmax(-1)
    cum = p.cumsum(-1)
    drop = (cum - p >= _col(top_p)) if crossing else (cum > _col(top_p))
    if keep_first:
        drop[:, 0] = False
    drop &= _col(top_p < 1)
    return x.masked_fill(torch.zeros_like(drop).scatter(-1, idx, drop), NEG_INF)


def pl_drops_crossing(logits, temperature, top_k, top_p, min_p):
    x = _min_p(logits / _col(temperature), min_p)
    return _top_p(_top_k(x, top_k), top_p, crossing=False)


def pl_truncates_before_temperature(logits, temperature, top_k, top_p, min_p):
    x = _top_p(_top_k(_min_p(logits, min_p), top_k), top_p)
    return x / _col(temperature)


def pl_row0_settings(logits, temperature, top_k, top_p, min_p):
    B = logits.shape[0]
    t, k, p, m = (v[:1].expand(B) for v in (temperature, top_k, top_p, min_p))
    x = _min_p(logits / _col(t), m)
    return _top_p(_top_k(x, k), p)


def pl_min_p_on_logits(logits, temperature, top_k, top_p, min_p):
    x = logits / _col(temperature)
    x = x.masked_fill((x < _col(min_p) * x.amax(-1, keepdim=True)) & _col(min_p > 0), NEG_INF)
    return _top_p(_top_k(x, top_k), top_p)


def pl_top_k_strict(logits, temperature, top_k, top_p, min_p):        # `<=` instead of `<`: keeps k - 1
    x = _min_p(logits / _col(temperature), min_p)
    return _top_p(_top_k(x, top_k, strict=True), top_p)


def pl_top_k_zero_keeps_none(logits, temperature, top_k, top_p, min_p):
    x = _min_p(logits / _col(temperature), min_p)
    return _top_p(_top_k(x, top_k, zero_keeps_none=True), top_p)


def pl_top_k_no_ties(logits, temperature, top_k, top_p, min_p):
    x = _min_p(logits / _col(temperature), min_p)
    V = x.shape[-1]
    out = torch.full_like(x, NEG_INF)
    for i in range(x.shape[0]):
        k = int(top_k[i]) if 0 < int(top_k[i]) < V else V
        idx = x[i].topk(k).indices
        out[i, idx] = x[i, idx]
    return _top_p(out, top_p)


def pl_top_p_full_mass(logits, temperature, top_k, top_p, min_p):
    x = logits / _col(temperature)
    return _top_p(_top_k(_min_p(x, min_p), top_k), top_p, mass_from=x)


def pl_min_p_last(logits, temperature, top_k, top_p, min_p):
    x = logits / _col(temperature)
    return _min_p(_top_p(_top_k(x, top_k), top_p), min_p)


def pl_multiplies_temperature(logits, temperature, top_k, top_p, min_p):
    return _top_p(_top_k(_min_p(logits * _col(temperature), min_p), top_k), top_p)


def pl_returns_probs(logits, temperature, top_k, top_p, min_p):
    return process_like_learner(logits, temperature, top_k, top_p, min_p).softmax(-1)


def pl_probs_keeping_inf(logits, temperature, top_k, top_p, min_p):   # probabilities, dropped tokens still -inf
    x = process_like_learner(logits, temperature, top_k, top_p, min_p)
    return x.softmax(-1).masked_fill(torch.isinf(x), NEG_INF)


def pl_big_negative(logits, temperature, top_k, top_p, min_p):
    x = process_like_learner(logits, temperature, top_k, top_p, min_p)
    return x.masked_fill(torch.isinf(x), -1e9)


def pl_naive_softmax(logits, temperature, top_k, top_p, min_p):   # exp without subtracting the max
    x = logits / _col(temperature)
    p = x.exp() / x.exp().sum(-1, keepdim=True)
    x = x.masked_fill(p < _col(min_p) * p.amax(-1, keepdim=True), NEG_INF)
    return _top_p(_top_k(x, top_k), top_p)


PROCESS_WRONG = {
    "drops_crossing_token": (pl_drops_crossing, "crosses top_p"),
    "truncates_before_temperature": (pl_truncates_before_temperature, "apply the temperature first"),
    "row0_settings": (pl_row0_settings, "every row has its own settings"),
    "min_p_on_logits": (pl_min_p_on_logits, "min-p compares probabilities, not logits"),
    "top_k_keeps_k_minus_1": (pl_top_k_strict, "you keep k - 1"),
    "top_k_zero_keeps_none": (pl_top_k_zero_keeps_none, "top_k <= 0 (0 or -1) means top-k is off"),
    "top_k_drops_ties": (pl_top_k_no_ties, "tokens tied with the k-th largest"),
    "top_p_full_mass": (pl_top_p_full_mass, "renormalized"),
    "min_p_last": (pl_min_p_last, "apply min-p before top-k and top-p"),
    "multiplies_temperature": (pl_multiplies_temperature, "divide the logits by the temperature"),
    "returns_probabilities": (pl_returns_probs, "you returned probabilities"),
    "returns_probabilities_with_inf": (pl_probs_keeping_inf, "you returned probabilities"),
    "big_negative_not_inf": (pl_big_negative, "must be exactly -inf"),
    "naive_softmax": (pl_naive_softmax, "subtract each row's maximum"),
}


@pytest.mark.parametrize("name", PROCESS_WRONG)
def test_lab06_1_wrong_implementations_fail(name):
    fn, diagnosis = PROCESS_WRONG[name]
    rejected(check_lab06_1, fn, diagnosis, "Hint")


def process_like_learner(logits, temperature, top_k, top_p, min_p):
    """A correct answer written another way: min-p in log space, one sort for top-k and top-p together."""
    B, V = logits.shape
    x = logits / temperature[:, None]
    logp = x.log_softmax(-1)
    x = x.masked_fill(logp < logp.amax(-1, keepdim=True) + torch.log(min_p)[:, None], NEG_INF)
    vals, order = x.sort(-1, descending=True)
    k = torch.where((top_k > 0) & (top_k < V), top_k, torch.full_like(top_k, V))
    keep = vals >= vals.gather(-1, (k - 1)[:, None])
    p = vals.masked_fill(~keep, NEG_INF).softmax(-1)
    keep &= (p.cumsum(-1) - p < top_p[:, None]) | (top_p[:, None] >= 1)
    return x.masked_fill(~torch.zeros_like(keep).scatter(-1, order, keep), NEG_INF)


def process_per_row_loop(logits, temperature, top_k, top_p, min_p):
    """Another: a plain loop over rows, top-p with an ascending sort (Hugging Face style)."""
    out = []
    for i in range(logits.shape[0]):
        x = logits[i] / temperature[i]
        if min_p[i] > 0:
            p = torch.softmax(x, -1)
            x = torch.where(p >= min_p[i] * p.max(), x, torch.tensor(NEG_INF))
        k = int(top_k[i])
        if 0 < k < x.numel():
            x = torch.where(x >= torch.topk(x, k).values[-1], x, torch.tensor(NEG_INF))
        if top_p[i] < 1:
            vals, idx = torch.sort(x)                              # ascending
            tail = torch.softmax(vals, -1).cumsum(-1)              # mass of this token and all less likely ones
            drop = tail <= 1 - top_p[i]
            drop[-1] = False
            x = x.clone()
            x[idx[drop]] = NEG_INF
        out.append(x)
    return torch.stack(out)


@pytest.mark.slow      # seconds: the checker's full run on correct code; the wrong answers stay fast
def test_lab06_1_correct_learner_versions_pass():
    check_lab06_1(process_like_learner)
    check_lab06_1(process_per_row_loop)


def test_lab06_1_oracle_agrees_with_the_engine_on_random_batches():
    g = torch.Generator().manual_seed(0)
    for _ in range(30):
        B, V = 4, 40
        logits = torch.randn(B, V, generator=g) * 3
        T = torch.rand(B, generator=g) * 2 + 0.1
        K = torch.randint(-1, 12, (B,), generator=g)
        P = torch.rand(B, generator=g) * 0.9 + 0.1
        M = torch.rand(B, generator=g) * 0.2
        mine = process_logits(logits, T, K, P, M)
        for i, e in enumerate(reference_process_logits(logits, T, K, P, M)):
            if e.fragile:
                continue
            assert set(torch.isfinite(mine[i]).nonzero().flatten().tolist()) == set(e.keep)


def test_lab06_1_reference_row_reads_like_the_definitions():
    e = reference_row([math.log(0.5), math.log(0.3), math.log(0.2)], 1.0, 0, 0.6, 0.0)
    assert e.keep == {0, 1}                                 # 0.5 < 0.6: the crossing token stays
    e = reference_row([3.0, 2.0, 2.0, 1.0], 1.0, 2, 1.0, 0.0)
    assert e.keep == {0, 1, 2}                              # ties at the k-th value stay
    e = reference_row([math.log(0.5), math.log(0.25), math.log(0.25)], 1.0, 0, 0.6, 0.0)
    assert e.keep == {0, 1} and e.free >= {1, 2}            # either tied token may stay


# ---------------------------------------------------------------- lab06_2 draw

def test_lab06_2_minillm_draw_passes():
    TASKS["lab06_2"].verify(draw)


def test_lab06_2_rejects_minillm_itself():
    rejected(check_lab06_2, draw, "minillm's own answer")
    rejected(check_lab06_2, lambda probs, gens: draw(probs, gens), "runs minillm's own")


def draw_multinomial_loop(probs, generators):
    """The plain answer: one torch.multinomial per row, with that row's generator."""
    tokens = torch.empty(probs.shape[0], dtype=torch.long)
    for i, g in enumerate(generators):
        tokens[i] = torch.multinomial(probs[i], 1, generator=g)[0]
    return tokens


def draw_inverse_cdf(probs, generators):
    """An inverse CDF per row: the first token whose cumulative mass exceeds u x total."""
    cdf = probs.double().cumsum(-1)
    out = []
    for i, g in enumerate(generators):
        u = torch.rand(1, generator=g, dtype=torch.float64) * cdf[i, -1]
        out.append(int(torch.searchsorted(cdf[i], u, right=True).clamp(max=probs.shape[1] - 1)))
    return torch.tensor(out, dtype=torch.long)


def draw_gumbel(probs, generators):
    """The Gumbel-max trick, noise per row from that row's generator."""
    B, V = probs.shape
    noise = torch.stack([torch.rand(V, generator=g) for g in generators]).clamp_min(1e-20)
    return (probs.log() - (-noise.log()).log()).argmax(-1)


@pytest.mark.slow      # seconds: the checker's full run on correct code; the wrong answers stay fast
def test_lab06_2_correct_learner_versions_pass():
    check_lab06_2(draw_multinomial_loop)
    check_lab06_2(draw_inverse_cdf)
    check_lab06_2(draw_gumbel)


def dr_argmax(probs, generators):
    return probs.argmax(-1)


def dr_first_generator(probs, generators):
    return torch.multinomial(probs, 1, generator=generators[0])[:, 0]


def dr_global_rng(probs, generators):
    return torch.multinomial(probs, 1)[:, 0]


def dr_index_plus_one(probs, generators):                 # a CDF with a leading 0: lands one bin to the right
    cdf = torch.cat([torch.zeros(probs.shape[0], 1), probs.cumsum(-1)], -1)
    u = torch.stack([torch.rand(1, generator=g) for g in generators])
    return torch.searchsorted(cdf, u)[:, 0].clamp(max=probs.shape[1] - 1)


def dr_index_minus_one(probs, generators):
    u = torch.stack([torch.rand(1, generator=g) for g in generators])
    return (torch.searchsorted(probs.cumsum(-1), u)[:, 0] - 1).clamp(min=0)


def dr_index_plus_one_unclamped(probs, generators):
    cdf = torch.cat([torch.zeros(probs.shape[0], 1), probs.cumsum(-1)], -1)
    u = torch.stack([torch.rand(1, generator=g) for g in generators])
    return torch.searchsorted(cdf, u)[:, 0]


def dr_index_minus_one_unclamped(probs, generators):
    u = torch.stack([torch.rand(1, generator=g) for g in generators])
    return torch.searchsorted(probs.cumsum(-1), u)[:, 0] - 1


def dr_noise_for_the_whole_batch(probs, generators):     # B numbers from every generator, row i takes the i-th
    B, V = probs.shape
    cdf = probs.cumsum(-1)
    out = []
    for i, g in enumerate(generators):
        u = torch.rand(B, generator=g)[i] * cdf[i, -1]
        out.append(int(torch.searchsorted(cdf[i], u, right=True).clamp(max=V - 1)))
    return torch.tensor(out)


def dr_squared(probs, generators):
    return draw_multinomial_loop(probs ** 2, generators)


def dr_softmax_again(probs, generators):
    return draw_multinomial_loop(probs.softmax(-1), generators)


def dr_fresh_generator_each_call(probs, generators):
    fresh = [None if g is None else torch.Generator().manual_seed(g.initial_seed()) for g in generators]
    return draw_multinomial_loop(probs, fresh)


def dr_column(probs, generators):
    return torch.multinomial(probs, 1)


def dr_int32(probs, generators):
    return draw_multinomial_loop(probs, generators).int()


def dr_greedy_when_peaked(probs, generators):
    """Right on every spread-out row; the argmax once one token holds more than 90%."""
    out = torch.empty(probs.shape[0], dtype=torch.long)
    for i, g in enumerate(generators):
        p = probs[i]
        out[i] = p.argmax() if p.max() > 0.9 else torch.multinomial(p, 1, generator=g)[0]
    return out


def dr_drop_tail(probs, generators):
    """Renormalizes after dropping every token below 1e-3: a few draws in thousands, invisible to a chi-square."""
    out = torch.empty(probs.shape[0], dtype=torch.long)
    for i, g in enumerate(generators):
        p = probs[i].clone()
        p[p < 1e-3] = 0
        out[i] = torch.multinomial(p if p.sum() > 0 else probs[i], 1, generator=g)[0]
    return out


def _inverse_cdf_draw(probs, generators, *, dtype=torch.float64, u_dtype=torch.float64, right=True, branch=None):
    """An inverse CDF per row on one uniform from that row's generator, with switches for subtle biases."""
    out = []
    for i, g in enumerate(generators):
        p = probs[i]
        if branch is not None:
            p = branch(p)
            if isinstance(p, int):
                out.append(p)
                continue
        cdf = p.to(dtype).cumsum(-1)
        u = torch.rand(1, generator=g, dtype=u_dtype).to(dtype) * cdf[-1]
        out.append(int(torch.searchsorted(cdf, u, right=right).clamp(max=p.numel() - 1)))
    return torch.tensor(out, dtype=torch.long)


def dr_greedy_when_very_peaked(probs, generators):
    """The argmax once one token holds more than 99%: 1 draw in 100 differs on such rows, none elsewhere."""
    return _inverse_cdf_draw(probs, generators, branch=lambda p: int(p.argmax()) if p.max() > 0.99 else p)


def dr_multinomial_greedy_when_very_peaked(probs, generators):
    out = torch.empty(probs.shape[0], dtype=torch.long)
    for i, g in enumerate(generators):
        p = probs[i]
        out[i] = p.argmax() if p.max() > 0.995 else torch.multinomial(p, 1, generator=g)[0]
    return out


def dr_drops_below_1e5(probs, generators):
    """Drops tokens below 1e-5 (and renormalizes): a few draws in a million."""
    return _inverse_cdf_draw(probs, generators, branch=lambda p: torch.where(p < 1e-5, 0.0, p))


def dr_float16_cdf(probs, generators):
    return _inverse_cdf_draw(probs, generators, dtype=torch.float16, u_dtype=torch.float32)


def dr_left_edge(probs, generators):
    """searchsorted(right=False): u == cdf[j] goes to token j instead of the next one."""
    return _inverse_cdf_draw(probs, generators, dtype=torch.float32, u_dtype=torch.float32, right=False)


def dr_touches_the_global_rng(probs, generators):
    """Right tokens, but one torch.multinomial over the whole batch first (its result used for unseeded rows only)."""
    everyone = torch.multinomial(probs, 1)[:, 0]
    seeded = draw_multinomial_loop(probs, [g if g is not None else torch.Generator() for g in generators])
    return torch.tensor([int(seeded[i]) if g is not None else int(everyone[i]) for i, g in enumerate(generators)])


DRAW_WRONG = {
    "greedy_when_very_peaked": (dr_greedy_when_very_peaked, "tokens 1..400 hold 1e-06 each", "greedy on peaked"),
    "multinomial_greedy_when_very_peaked": (dr_multinomial_greedy_when_very_peaked, "follows torch.multinomial",
                                            "greedy on peaked"),
    "drops_below_1e-5": (dr_drops_below_1e5, "drops tiny tokens below a threshold"),
    "float16_cdf": (dr_float16_cdf, "probability 0"),
    "left_edge_of_the_cdf": (dr_left_edge, "u equals cdf[0] exactly", "cdf[j] > u"),
    "touches_the_global_rng": (dr_touches_the_global_rng, "advanced torch's global generator"),
    "greedy_when_peaked": (dr_greedy_when_peaked, "draws the argmax when one token holds 96%"),
    "tail_dropped": (dr_drop_tail, "drops tokens below a probability threshold"),
    "argmax": (dr_argmax, "argmax"),
    "first_generator_for_all": (dr_first_generator, "OTHER rows' generators", "generators[0]"),
    "global_rng": (dr_global_rng, "the same seeds gave different tokens"),
    "index_plus_one": (dr_index_plus_one, "token AFTER"),
    "index_minus_one": (dr_index_minus_one, "token BEFORE"),
    "index_plus_one_unclamped": (dr_index_plus_one_unclamped, "one past the last id"),
    "index_minus_one_unclamped": (dr_index_minus_one_unclamped, "one before the first id"),
    "noise_for_the_whole_batch": (dr_noise_for_the_whole_batch, "the batch's size or the row's position"),
    "probs_squared": (dr_squared, "probs squared"),
    "softmax_again": (dr_softmax_again, "don't apply softmax again"),
    "fresh_generator_each_call": (dr_fresh_generator_each_call, "generator must advance"),
    "returns_a_column": (dr_column, "take [:, 0]"),
    "int32": (dr_int32, "int64"),
}


@pytest.mark.parametrize("name", DRAW_WRONG)
def test_lab06_2_wrong_implementations_fail(name):
    fn, *diagnosis = DRAW_WRONG[name]
    rejected(check_lab06_2, fn, *diagnosis)


# ---------------------------------------------------------------- the learner's pieces inside a real engine

def test_learner_pieces_drive_a_real_engine_and_a_seeded_request_ignores_its_batch():
    from minillm.engine.llm_engine import LLMEngine
    from minillm.sampling.params import SamplingParams
    from minillm.testing import tiny_model

    engine = LLMEngine.from_model(tiny_model(), None, block_size=4, num_blocks=64)
    engine.plug(sampler=Sampler(process_fn=process_like_learner, draw_fn=draw_multinomial_loop))
    seeded = SamplingParams(temperature=0.9, top_p=0.9, top_k=20, seed=7, max_tokens=8, ignore_eos=True)

    def run(requests):
        ids = [engine.add_request(p, sp) for p, sp in requests]
        done = finish_all(engine)
        return [done[i].outputs[0].token_ids for i in ids]

    prompt = [5, 6, 7, 8, 9]
    alone = run([(prompt, seeded)])[0]
    crowd = run([([1, 2, 3], SamplingParams(temperature=1.0, max_tokens=6, ignore_eos=True)), (prompt, seeded),
                 ([9, 9], SamplingParams(temperature=0.5, seed=1, max_tokens=8, ignore_eos=True))])
    assert crowd[1] == alone
