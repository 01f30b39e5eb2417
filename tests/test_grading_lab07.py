"""lab07 checkers, graded both ways: minillm's own rejection sampler (wrapped as a per-request rule) and n-gram
lookup pass the property suites; known-wrong rules and lookups are rejected with the diagnosis a learner needs;
correct learner versions written differently pass. Plus: the statistical cases are strong enough (every known
mistake's exact outcome is far from p at the checker's sample sizes), and the checker's closed form agrees with
the engine."""
import random

import pytest
import torch

from minillm.grading.lab07 import (MISTAKES, STAT_CASES, TASKS, THRESHOLD, check_lab07_1, check_lab07_2,
                                   reference_find_ngram_draft, single_step)
from minillm.spec_decode.ngram import find_ngram_draft
from minillm.spec_decode.rejection_sampler import RejectionSampler
from minillm.testing import chi_square
from grading_helpers import rejected


# ---------------------------------------------------------------- lab07_1 the rejection rule

def engine_rule(target_probs, draft_token_ids, draft_probs, generator):
    """minillm's vectorized RejectionSampler on a batch of one request, seen as a per-request rule."""
    return RejectionSampler()(target_probs, [draft_token_ids], [draft_probs], [generator])[0]


@pytest.mark.slow    # ~4-7 s: the quick subset stays under 3 minutes
def test_lab07_1_minillm_rejection_sampler_passes():
    TASKS["lab07_1"].verify(engine_rule)


def test_lab07_1_rejects_minillm_rejection_sampler():
    rejected(check_lab07_1, RejectionSampler, "minillm's own answer")
    rejected(check_lab07_1, engine_rule, "runs minillm's own implementation")
    rejected(check_lab07_1, single_step, "minillm's own answer")


def _gen(g):
    return g if g is not None else torch.default_generator


def walk(p, drafts, q, g, accept, final, bonus=True, bonus_row=None):
    """A per-request rule built from accept(p_j, q_j, x) -> probability and final(p_j, q_j, x) -> weights."""
    out = []
    for j, x in enumerate(drafts):
        if float(torch.rand((), generator=g, dtype=torch.float64)) < accept(p[j], q[j], x):
            out.append(x)
            continue
        return out + [int(torch.multinomial(final(p[j], q[j], x), 1, generator=g))]
    if bonus:
        row = len(drafts) if bonus_row is None else bonus_row(len(drafts))
        return out + [int(torch.multinomial(p[row], 1, generator=g))]
    return out if out else [int(torch.multinomial(p[0], 1, generator=g))]


def ratio(pj, qj, x):
    return min(1.0, float(pj[x] / qj[x]))


def residual(pj, qj, x):
    return (pj - qj).clamp_min(0)


def right_rule(p, d, q, g):
    return walk(p, d, q, _gen(g), ratio, residual)


RULE_WRONG = {
    "resample_from_p": (lambda p, d, q, g: walk(p, d, q, _gen(g), ratio, lambda pj, qj, x: pj),
                        "resample from p itself"),
    "residual_abs": (lambda p, d, q, g: walk(p, d, q, _gen(g), ratio, lambda pj, qj, x: (pj - qj).abs()),
                     "residual lacks the max(., 0)"),
    "residual_no_clamp_then_relu_of_q_minus_p": (
        lambda p, d, q, g: walk(p, d, q, _gen(g), ratio, lambda pj, qj, x: (qj - pj).clamp_min(0)),
        "does not follow the target's p_0"),
    "no_bonus": (lambda p, d, q, g: walk(p, d, q, _gen(g), ratio, residual, bonus=False),
                 "never returned k + 1"),
    "accept_with_p": (lambda p, d, q, g: walk(p, d, q, _gen(g), lambda pj, qj, x: float(pj[x]), residual),
                      "accept a draft with probability p(x)"),
    "accept_if_p_ge_q": (lambda p, d, q, g: walk(p, d, q, _gen(g), lambda pj, qj, x: float(pj[x] >= qj[x]),
                                                 residual),
                         "accept a draft deterministically whenever p(x) >= q(x)"),
    "inverted_ratio": (lambda p, d, q, g: walk(p, d, q, _gen(g),
                                               lambda pj, qj, x: min(1.0, float(qj[x] / pj[x])) if pj[x] > 0 else 1.0,
                                               residual),
                       "upside down"),
    "one_hot_residual_with_dense_q": (
        lambda p, d, q, g: walk(p, d, q, _gen(g), ratio,
                                lambda pj, qj, x: pj * (torch.arange(len(pj)) != x)),
        "only the rejected draft removed"),
    "bonus_from_last_draft_row": (lambda p, d, q, g: walk(p, d, q, _gen(g), ratio, residual,
                                                          bonus_row=lambda k: max(k - 1, 0)),
                                  "follows target_probs[k - 1]"),
}


@pytest.mark.parametrize("name", sorted(RULE_WRONG))
def test_lab07_1_wrong_rules_fail_with_their_diagnosis(name):
    fn, diagnosis = RULE_WRONG[name]
    rejected(check_lab07_1, fn, diagnosis, "Hint")


def global_rng_rule(p, d, q, g):                 # ignores the generator it is given
    return walk(p, d, q, torch.default_generator, ratio, residual)


def python_random_rule(p, d, q, g):              # right distribution, randomness from Python's random module
    out = []
    for j, x in enumerate(d):
        if random.random() < ratio(p[j], q[j], x):
            out.append(x)
            continue
        return out + random.choices(range(p.shape[1]), weights=residual(p[j], q[j], x).tolist())
    return out + random.choices(range(p.shape[1]), weights=p[len(d)].tolist())


def half_global_rule(p, d, q, g):               # the test from the generator, the draws from the global RNG
    out = []
    for j, x in enumerate(d):
        if float(torch.rand((), generator=_gen(g), dtype=torch.float64)) < ratio(p[j], q[j], x):
            out.append(x)
            continue
        return out + [int(torch.multinomial(residual(p[j], q[j], x), 1))]
    return out + [int(torch.distributions.Categorical(probs=p[len(d)]).sample())]


@pytest.mark.slow    # ~4-7 s: the quick subset stays under 3 minutes
def test_lab07_1_randomness_must_come_from_the_generator():
    rejected(check_lab07_1, global_rng_rule, "global RNG although a generator was given")
    rejected(check_lab07_1, half_global_rule, "global RNG although a generator was given")
    rejected(check_lab07_1, python_random_rule, "somewhere else than torch")


def test_lab07_1_types_shapes_and_inputs():
    rejected(check_lab07_1, lambda p, d, q, g: torch.tensor(right_rule(p, d, q, g)), "must be a list of ints")
    rejected(check_lab07_1, lambda p, d, q, g: [torch.tensor(t) for t in right_rule(p, d, q, g)],
             "must be an int, got a torch.Tensor")
    rejected(check_lab07_1, lambda p, d, q, g: [float(t) for t in right_rule(p, d, q, g)], "must be an int")

    def keeps_going(p, d, q, g):                 # does not stop at the first rejection
        return [right_rule(p[j:j + 2], [x], q[j:j + 1], g)[-1] for j, x in enumerate(d)] + \
            [int(torch.multinomial(p[len(d)], 1, generator=_gen(g)))]
    rejected(check_lab07_1, keeps_going, "a prefix of draft_token_ids")

    def in_place(p, d, q, g):
        out = []
        for j, x in enumerate(d):
            if float(torch.rand((), generator=_gen(g), dtype=torch.float64)) < ratio(p[j], q[j], x):
                out.append(x)
                continue
            p[j] -= q[j]                          # the residual, computed in the caller's tensor
            return out + [int(torch.multinomial(p[j].clamp_min(0), 1, generator=_gen(g)))]
        return out + [int(torch.multinomial(p[len(d)], 1, generator=_gen(g)))]
    rejected(check_lab07_1, in_place, "modified target_probs in place")

    def k0_crash(p, d, q, g):
        if not d:
            return [int(torch.stack([]).sum())]
        return right_rule(p, d, q, g)
    rejected(check_lab07_1, k0_crash, "raised RuntimeError")


def test_lab07_1_greedy_mistakes():
    def exact_match(p, d, q, g):                 # "keep the longest prefix the target agrees with" for every request
        a = p.argmax(-1).tolist()
        keep = next((j for j, (x, y) in enumerate(zip(d, a)) if x != y), len(d))
        return list(d[:keep]) + [a[keep]]
    rejected(check_lab07_1, exact_match)       # statistically wrong for sampled requests

    def bonus_argmax_of_wrong_row(p, d, q, g):
        out = right_rule(p, d, q, g)
        if all(float(r.max()) == 1.0 for r in p) and len(out) == len(d) + 1 and d:
            out[-1] = int(p[0].argmax())
        return out
    rejected(check_lab07_1, bonus_argmax_of_wrong_row, "greedy target rows")


def vectorized_rule(target_probs, draft_token_ids, draft_probs, generator):
    """A correct learner rule written differently: all k uniforms at once, the first rejection by argmin of a
    cumulative product, the draw by inverse CDF (searchsorted) instead of torch.multinomial."""
    k = len(draft_token_ids)
    p = target_probs.double()
    q = draft_probs.double()
    x = torch.tensor(draft_token_ids, dtype=torch.long)
    u = torch.rand(k, generator=generator, dtype=torch.float64)
    rows = torch.arange(k)
    ok = u * q[rows, x] < p[rows, x]
    n = int(ok.long().cumprod(0).sum()) if k else 0
    dist = p[k] if n == k else (p[n] - q[n]).clamp(min=0)
    cdf = dist.cumsum(0)
    y = int(torch.searchsorted(cdf, torch.rand((), generator=generator, dtype=torch.float64) * cdf[-1],
                               right=True).clamp(max=len(dist) - 1))
    while dist[y] == 0:                          # float round-off at the top of the CDF
        y -= 1
    return [int(t) for t in draft_token_ids[:n]] + [y]


def test_lab07_1_correct_learner_rules_pass():
    check_lab07_1(right_rule)
    check_lab07_1(vectorized_rule)


def _noncentrality(n, a1, e1, a2, e2):
    """The expected excess of the chi-square statistics (acceptance + emitted tokens) when counts of n requests
    that follow (a1, e1) are tested against (a2, e2)."""
    if bool(((e1 > 0) & (e2 == 0)).any()):
        return float("inf")
    m = e2 > 0
    return n * float(((e1 - e2)[m] ** 2 / e2[m]).sum()) + n * (a1 - a2) ** 2 / (a2 * (1 - a2))


def test_lab07_1_the_statistical_cases_separate_every_known_mistake():
    """At the checker's sample sizes, each known mistake's exact outcome at the first position of the 'sampled
    drafts' case is far from the right one (noncentrality above 200: the checker's test, failing below p = 1e-6 on
    5 + 1 degrees of freedom, rejects it with p < 1e-20 typically), and any two mistakes are far enough apart (above 40)
    for the best fit to name the right one."""
    _, p_rows, q_rows, _, n, _, _ = STAT_CASES["sampled drafts"]
    p, q = torch.tensor(p_rows, dtype=torch.float64), torch.tensor(q_rows, dtype=torch.float64)
    alpha, emitted = single_step(p[0], q[0])
    assert torch.allclose(emitted, p[0]) and abs(alpha - float(torch.minimum(p[0], q[0]).sum())) < 1e-12
    outcomes = [single_step(p[0], q[0], accept, final) for _, accept, final in MISTAKES]
    for (why, _, _), (a, e) in zip(MISTAKES, outcomes):
        assert _noncentrality(n, a, e, alpha, p[0]) > 200, why
    for i, (a1, e1) in enumerate(outcomes):
        for j, (a2, e2) in enumerate(outcomes):
            if i != j:
                assert _noncentrality(n, a1, e1, a2, e2) > 40, (MISTAKES[i][0], MISTAKES[j][0])


def test_lab07_1_single_step_matches_the_engine():
    """The checker's closed form (acceptance and emitted distribution) against minillm's vectorized sampler on
    20,000 one-draft requests."""
    _, p_rows, q_rows, _, _, _, _ = STAT_CASES["sampled drafts"]
    p, q = torch.tensor(p_rows[1:3], dtype=torch.float64), torch.tensor(q_rows[1:2], dtype=torch.float64)
    n = 20_000
    g = torch.Generator().manual_seed(3)
    drafts = torch.multinomial(q[0], n, replacement=True, generator=g)
    torch.manual_seed(4)                  # another stream than the drafts' (the same seed would correlate them)
    out = RejectionSampler()(p.repeat(n, 1), [[int(x)] for x in drafts], [q] * n, [None] * n)
    alpha, emitted = single_step(p[0], q[0])
    accepted = sum(len(o) == 2 for o in out)
    assert chi_square([accepted, n - accepted], [alpha, 1 - alpha]).p_value > 1e-4
    first = torch.bincount(torch.tensor([o[0] for o in out]), minlength=6)
    assert chi_square(first, emitted).p_value > 1e-4
    assert THRESHOLD <= 1e-6


# ---------------------------------------------------------------- lab07_2 the n-gram lookup

def test_lab07_2_minillm_lookup_passes():
    TASKS["lab07_2"].verify(find_ngram_draft)
    TASKS["lab07_2"].verify(reference_find_ngram_draft)


def test_lab07_2_rejects_minillm_lookup():
    rejected(check_lab07_2, find_ngram_draft, "minillm's own answer")
    rejected(check_lab07_2, reference_find_ngram_draft, "minillm's own answer")
    rejected(check_lab07_2, lambda t, k, a, b: find_ngram_draft(t, k, a, b), "runs minillm's own implementation")


def lookup(tokens, k, min_n, max_n, *, earliest=False, shortest_first=False, own=False, end=-1, what="follow",
           overlap=True):
    """A learner's lookup with switches for the classic mistakes (end: the last start tried is len - n + end)."""
    tokens = list(tokens)
    ns = list(range(min_n, max_n + 1)) if shortest_first else list(range(max_n, min_n - 1, -1))
    for n in ns:
        if n > len(tokens) - (0 if own else 1) or n < 1:
            continue
        suffix = tokens[len(tokens) - n:]
        last = len(tokens) - n + (0 if own else end)
        if not overlap:
            last = min(last, len(tokens) - 2 * n)
        starts = list(range(0, last + 1)) if earliest else list(range(last, -1, -1))
        for s in starts:
            if tokens[s:s + n] == suffix:
                return {"follow": tokens[s + n:s + n + k], "match": tokens[s:s + n], "all": tokens[s + n:],
                        "after_match_k": tokens[s:s + k]}[what]
    return []


LOOKUP_WRONG = {
    "earliest": (dict(earliest=True), "EARLIEST occurrence"),
    "shortest_first": (dict(shortest_first=True), "SHORTEST n first"),
    "own_position": (dict(own=True), "suffix itself as an occurrence"),
    "returns_the_ngram": (dict(what="match"), "matched n-gram itself"),
    "more_than_k": (dict(what="all"), "more than k tokens"),
    "off_by_one_at_the_end": (dict(end=-2), "off-by-one at the end"),
    "no_overlap": (dict(overlap=False), "not to overlap"),
}


@pytest.mark.parametrize("name", sorted(LOOKUP_WRONG))
def test_lab07_2_wrong_lookups_fail_with_their_diagnosis(name):
    kw, diagnosis = LOOKUP_WRONG[name]
    rejected(check_lab07_2, lambda t, k, a, b: lookup(t, k, a, b, **kw), diagnosis, "Hint")


def test_lab07_2_other_mistakes_fail():
    def uint16(tokens, k, min_n, max_n):         # ids squeezed into 16 bits
        return lookup([t & 0xFFFF for t in tokens], k, min_n, max_n)
    rejected(check_lab07_2, uint16, "65539")
    rejected(check_lab07_2, lambda t, k, a, b: tuple(str(x) for x in lookup(t, k, a, b)), "must be an int")

    def mutates(tokens, k, min_n, max_n):
        out = lookup(tokens, k, min_n, max_n)
        tokens.append(0)
        return out
    rejected(check_lab07_2, mutates, "modified token_ids")


def test_lab07_2_correct_learner_lookups_pass():
    check_lab07_2(lambda t, k, a, b: lookup(t, k, a, b))

    def with_tuples(token_ids, k, min_n, max_n):  # written differently: tuple keys, one pass per n from the end
        toks = tuple(token_ids)
        for n in range(min(max_n, len(toks) - 1), min_n - 1, -1):
            key = toks[-n:]
            hits = [s for s in range(len(toks) - n) if toks[s:s + n] == key]
            if hits:
                s = hits[-1]
                return list(toks[s + n:s + n + k])
        return []
    check_lab07_2(with_tuples)


def _fast_path_global(p, d, q, g, when):
    """right_rule, except that its fast path draws from torch's global RNG: with nothing drafted (k = 0), or with
    one-hot draft_probs (a greedy draft model): the common paths stay exact, so the statistics cannot tell."""
    onehot = len(d) > 0 and bool((q == 1).any(-1).all())
    fast = (when == "k0" and len(d) == 0) or (when == "one_hot" and onehot)
    return walk(p, d, q, torch.default_generator if fast else _gen(g), ratio, residual)


@pytest.mark.parametrize("when", ["k0", "one_hot"])
def test_lab07_1_a_fast_path_on_the_global_rng_fails(when):
    rejected(check_lab07_1, lambda p, d, q, g: _fast_path_global(p, d, q, g, when),
             "global RNG although a generator was given")


# ---------------------------------------------------------------- biases in a sliver: the checker chooses the numbers

def _sliver_rule(*, accept_le=False, greedy_above=None, drop_below=None, half_ratio=False):
    """right_rule's walk (float64 uniforms, torch.multinomial), with one bias a count test cannot see."""
    def rule(p, d, q, g):
        g = _gen(g)
        out = []

        def emit(w):
            if greedy_above is not None and float(w.max() / w.sum()) > greedy_above:
                return int(w.argmax())
            if drop_below is not None:
                w = torch.where(w < drop_below * w.sum(), torch.zeros_like(w), w)
            return int(torch.multinomial(w, 1, generator=g))
        for j, x in enumerate(d):
            u = float(torch.rand((), generator=g, dtype=torch.float32 if half_ratio else torch.float64))
            r = float(p[j, x].half() / q[j, x].half()) if half_ratio else float(p[j, x] / q[j, x])
            if (u <= r) if accept_le else (u < min(1.0, r)):
                out.append(x)
                continue
            return out + [emit((p[j] - q[j]).clamp_min(0))]
        return out + [emit(p[len(d)])]
    return rule


SLIVER_WRONG = {
    "greedy_when_peaked": (dict(greedy_above=0.99), "greedy on peaked rows"),
    "drops_tiny_tokens": (dict(drop_below=1e-3), "drops tiny tokens below a threshold"),
    "accepts_when_u_equals_the_ratio": (dict(accept_le=True), "next uniform is exactly 0.0", "strictly"),
    "float16_ratio": (dict(half_ratio=True), "too low a precision"),
}


@pytest.mark.parametrize("name", sorted(SLIVER_WRONG))
def test_lab07_1_biases_in_a_sliver_fail(name):
    """Statistics cannot see these (a few requests in a million differ); generators in chosen states do."""
    kw, *needles = SLIVER_WRONG[name]
    rejected(check_lab07_1, _sliver_rule(**kw), *needles)


def test_lab07_1_the_sliver_rule_without_its_bias_passes():
    check_lab07_1(_sliver_rule())
