"""The rejection sampler keeps the target's distribution exactly. Statistical tests: Pearson chi-square of the
emitted tokens against p at every position (cells with fewer than 5 expected merged), fixed seeds, 40,000
requests per case for the engine's sampler and 10,000 for the plain per-request rules (each known-wrong one is
rejected with p < 1e-6 at that size, while the right rule passes at 1e-4)."""
import pytest
import torch
from hypothesis import example, given, settings, strategies as st

from minillm.spec_decode.rejection_sampler import RejectionSampler
from minillm.sampling.sampler import make_generator
from minillm.testing import chi_square

V, K, N = 8, 3, 40_000


def dirichlet(gen, shape, alpha=0.7):
    g = torch.distributions.Gamma(torch.full(shape, alpha), torch.ones(shape))
    torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=gen)))
    x = g.sample()
    return x / x.sum(-1, keepdim=True)


def case(seed, k=K, one_hot_draft=False, n=N):
    """One target/draft pair per position, the same for all N requests; each request draws its own drafts."""
    gen = torch.Generator().manual_seed(seed)
    p = dirichlet(gen, (k + 1, V)).double()
    q = dirichlet(gen, (k, V)).double()
    if one_hot_draft:                       # a deterministic proposer: always the same guess, q one-hot
        guess = torch.randint(0, V, (k,), generator=gen)
        q = torch.nn.functional.one_hot(guess, V).double()
    drafts = torch.stack([torch.multinomial(q[j], n, replacement=True, generator=gen) for j in range(k)], 1)
    return p, q, drafts


def run(rs, p, q, drafts, one_hot=False, seed=0):
    torch.manual_seed(seed)
    n, k = drafts.shape
    target = p.repeat(n, 1)                                       # request r's k + 1 rows, in order
    return rs(target, drafts.tolist(), [None if one_hot else q] * n, [None] * n)


def position_counts(out, k):
    """counts[j]: how often each token was emitted at position j (among requests that reached it)."""
    counts = torch.zeros(k + 1, V, dtype=torch.long)
    for toks in out:
        for j, t in enumerate(toks):
            counts[j, t] += 1
    return counts


def distribution_ok(rs, seed, one_hot=False, threshold=1e-4, n=N):
    p, q, drafts = case(seed, one_hot_draft=one_hot, n=n)
    out = run(rs, p, q, drafts, one_hot, seed)
    counts = position_counts(out, K)
    pvals = [chi_square(counts[j], p[j]).p_value for j in range(K + 1) if counts[j].sum() >= 200]
    return min(pvals) > threshold, pvals


# ---------------------------------------------------------------- known-wrong rejection samplers

def per_request(rule):
    """Wrap a per-request rule as a RejectionSampler (the lab07 seam)."""
    return RejectionSampler(rule=rule)


def _walk(p, drafts, q, g, accept_prob, final_dist, bonus=True):
    out = []
    for j, x in enumerate(drafts):
        if float(torch.rand(1, generator=g, dtype=torch.float64)) < accept_prob(p[j], q[j], x):
            out.append(x)
            continue
        dist = final_dist(p[j], q[j])
        return out + [int(torch.multinomial(dist, 1, generator=g))]
    if bonus:
        return out + [int(torch.multinomial(p[len(drafts)], 1, generator=g))]
    return out            # all k drafts and nothing more: looks like "k - 1 accepted, then one token"


def _gen(g):
    return g if g is not None else torch.default_generator


WRONG = {
    # on a rejection, resample from p itself instead of the residual max(p - q, 0)
    "resample_from_p": lambda p, d, q, g: _walk(p, d, q, _gen(g), lambda pj, qj, x: min(1.0, float(pj[x] / qj[x])),
                                                 lambda pj, qj: pj),
    # no max(., 0): the residual |p - q| puts mass on tokens the draft over-proposes
    "residual_without_max": lambda p, d, q, g: _walk(p, d, q, _gen(g),
                                                     lambda pj, qj, x: min(1.0, float(pj[x] / qj[x])),
                                                     lambda pj, qj: (pj - qj).abs()),
    # accept the draft whenever the target likes it at least as much (no randomness in the test)
    "accept_if_p_ge_q": lambda p, d, q, g: _walk(p, d, q, _gen(g), lambda pj, qj, x: float(pj[x] >= qj[x]),
                                                 lambda pj, qj: (pj - qj).clamp_min(0)),
    # accept with probability p(x), forgetting that x was drawn from q (the min(1, p/q) ratio skipped)
    "accept_with_p_not_p_over_q": lambda p, d, q, g: _walk(p, d, q, _gen(g), lambda pj, qj, x: float(pj[x]),
                                                           lambda pj, qj: (pj - qj).clamp_min(0)),
}


def right_rule(p, d, q, g):
    return _walk(p, d, q, _gen(g), lambda pj, qj, x: min(1.0, float(pj[x] / qj[x])),
                 lambda pj, qj: (pj - qj).clamp_min(0))


# ---------------------------------------------------------------- the tests

@pytest.mark.parametrize("seed", [0, pytest.param(1, marks=pytest.mark.slow)])
@pytest.mark.parametrize("one_hot", [False, True], ids=["sampled_draft", "one_hot_draft"])
def test_every_emitted_position_is_distributed_as_p(seed, one_hot):
    ok, pvals = distribution_ok(RejectionSampler(), seed, one_hot)
    assert ok, pvals


def test_a_plain_per_request_rule_passes_the_same_test():
    ok, pvals = distribution_ok(per_request(right_rule), 0, n=10_000)
    assert ok, pvals


@pytest.mark.parametrize("name", sorted(WRONG))
def test_known_wrong_samplers_fail_the_distribution_test(name):
    ok, pvals = distribution_ok(per_request(WRONG[name]), 0, threshold=1e-6, n=10_000)
    assert not ok, (name, pvals)
    print(name, pvals)


def perfect_draft_ok(rs, seed=4, n=4000):
    """q == p: every draft is accepted, so each request must emit its k drafts and then a bonus token ~ p_{k+1}."""
    gen = torch.Generator().manual_seed(seed)
    p = dirichlet(gen, (K + 1, V)).double()
    drafts = torch.stack([torch.multinomial(p[j], n, replacement=True, generator=gen) for j in range(K)], 1)
    out = run(rs, p, p[:K], drafts)
    if not all(len(t) == K + 1 and t[:K] == d for t, d in zip(out, drafts.tolist())):
        return False
    return chi_square(position_counts(out, K)[K], p[K]).p_value > 1e-4


def test_forgetting_the_bonus_token_is_caught_when_the_draft_is_perfect():
    assert perfect_draft_ok(RejectionSampler())
    assert perfect_draft_ok(per_request(right_rule), n=1000)
    no_bonus = per_request(lambda p_, d, q, g: _walk(p_, d, q, _gen(g),
                                                     lambda pj, qj, x: min(1.0, float(pj[x] / qj[x])),
                                                     lambda pj, qj: (pj - qj).clamp_min(0), bonus=False))
    assert not perfect_draft_ok(no_bonus, n=1000)


def test_acceptance_rate_is_the_overlap_of_p_and_q():
    """With drafts drawn from q, a draft is accepted with probability sum_x min(p(x), q(x)) (40,000 requests,
    k = 1: within 5 standard errors)."""
    p, q, drafts = case(9, k=1)
    out = run(RejectionSampler(), p, q, drafts[:, :1], seed=9)
    accepted = sum(len(t) == 2 for t in out) / len(out)
    alpha = float(torch.minimum(p[0], q[0]).sum())
    assert abs(accepted - alpha) < 5 * (alpha * (1 - alpha) / len(out)) ** 0.5


@settings(max_examples=40, deadline=None, derandomize=True)
@example(seed=0, ks=[0])                             # nothing drafted: the bonus token alone
@example(seed=1, ks=[5, 0, 5])                       # the longest drafts around an empty one
@given(seed=st.integers(0, 10**6), ks=st.lists(st.integers(0, 5), min_size=1, max_size=6))
def test_greedy_rows_accept_while_the_draft_is_the_argmax_then_emit_the_argmax(seed, ks):
    gen = torch.Generator().manual_seed(seed)
    target_rows, drafts = [], []
    for k in ks:
        logits = torch.randn(k + 1, V, generator=gen)
        target_rows.append(torch.nn.functional.one_hot(logits.argmax(-1), V).double())
        argmax = logits.argmax(-1).tolist()
        d = [a if torch.rand(1, generator=gen) < 0.7 else (a + 1) % V for a in argmax[:k]]
        drafts.append(d)
    out = RejectionSampler()(torch.cat(target_rows), drafts, [None] * len(ks), [None] * len(ks))
    for rows_, d, toks in zip(target_rows, drafts, out):
        argmax = rows_.argmax(-1).tolist()
        a = next((j for j, (x, y) in enumerate(zip(d, argmax)) if x != y), len(d))
        assert toks == d[:a] + [argmax[a]]


@settings(max_examples=20, deadline=None, derandomize=True)
@example(seed=0, ks=[0, 0], at=0)                    # no drafts anywhere: only the final draw's noise
@example(seed=1, ks=[4, 0, 2], at=1)                 # the seeded request drafted nothing, its neighbours did
@example(seed=2, ks=[1, 4, 4, 4, 4], at=4)
@given(seed=st.integers(0, 10**6), ks=st.lists(st.integers(0, 4), min_size=2, max_size=5), at=st.integers(0, 4))
def test_a_seeded_request_gets_the_same_tokens_whatever_else_is_in_the_batch(seed, ks, at):
    at = at % len(ks)
    gen = torch.Generator().manual_seed(seed)
    ps = [dirichlet(gen, (k + 1, V)).double() for k in ks]
    qs = [dirichlet(gen, (k, V)).double() for k in ks]
    ds = [[int(torch.multinomial(q[j], 1, generator=gen)) for j in range(k)] for q, k in zip(qs, ks)]
    rs = RejectionSampler()
    alone = rs(ps[at], [ds[at]], [qs[at]], [make_generator(seed)])[0]
    gens = [None] * len(ks)
    gens[at] = make_generator(seed)
    torch.manual_seed(seed + 7)
    assert rs(torch.cat(ps), ds, qs, gens)[at] == alone


@settings(max_examples=40, deadline=None, derandomize=True)
@example(seed=0, ks=[4], seeded=[True])               # a greedy batch-1 verification, seeded
@given(seed=st.integers(0, 10**6), ks=st.lists(st.integers(0, 5), min_size=1, max_size=5),
       seeded=st.lists(st.booleans(), min_size=5, max_size=5))
def test_one_token_rows_against_drafts_with_probabilities_keep_the_rule_and_the_generators(seed, ks, seeded):
    """Every row of p one token (greedy requests) and drafts sampled from a q of their own: a draft is kept exactly
    when it is its row's token, the first miss emits that row's token and a full acceptance the bonus row's; each
    seeded request's generator advances by its k acceptance uniforms and nothing else, as in a mixed batch."""
    gen = torch.Generator().manual_seed(seed)
    ps, qs, ds = [], [], []
    for k in ks:
        ps.append(torch.nn.functional.one_hot(torch.randint(0, V, (k + 1,), generator=gen), V).double())
        qs.append(dirichlet(gen, (k, V)).double())
        ds.append([int(torch.multinomial(qs[-1][j], 1, generator=gen)) if torch.rand(1, generator=gen) < 0.5
                   else int(ps[-1][j].argmax()) for j in range(k)])
    gens = [make_generator(seed + i) if seeded[i] else None for i in range(len(ks))]
    out = RejectionSampler()(torch.cat(ps), ds, qs, gens)
    for p, d, toks in zip(ps, ds, out):
        want = p.argmax(-1).tolist()
        a = next((j for j, (x, y) in enumerate(zip(d, want)) if x != y), len(d))
        assert toks == d[:a] + [want[a]]
    for i, (k, g) in enumerate(zip(ks, gens)):
        if g is not None:
            expected = make_generator(seed + i)
            torch.rand(k, generator=expected, dtype=torch.float64)
            assert torch.equal(g.get_state(), expected.get_state())


def test_a_one_hot_final_row_draws_no_noise_and_the_others_still_do():
    """A greedy request's final distribution has one nonzero entry, so its token needs no draw (V exponentials a
    row were half the extra cost of a greedy step verifying one guess): its generator advances by its k uniforms
    only. A row with two nonzero entries, however uneven, is still drawn: both its tokens come out."""
    one_hot = torch.nn.functional.one_hot(torch.tensor([3, 7, 7]), V).double()     # k = 2: rows 1..3
    drafts = [[3, 5]]                                   # the second guess is rejected: final = p_2, one-hot on 7
    g, expected = make_generator(5), make_generator(5)
    assert RejectionSampler()(one_hot, drafts, [None], [g]) == [[3, 7]]
    torch.rand(2, generator=expected, dtype=torch.float64)                         # the two acceptance tests
    assert torch.equal(g.get_state(), expected.get_state())
    uneven = torch.zeros(1, V, dtype=torch.float64)
    uneven[0, 1], uneven[0, 2] = 1 - 1e-3, 1e-3
    got = {RejectionSampler()(uneven, [[]], [None], [make_generator(s)])[0][0] for s in range(20_000)}
    assert got == {1, 2}


@pytest.mark.slow
def test_the_vectorized_sampler_and_the_per_request_rule_agree_in_distribution_on_a_mixed_batch():
    """Requests with different k in one call: each request's first token ~ its own p_1 (chi-square)."""
    gen = torch.Generator().manual_seed(21)
    ks = [0, 1, 2, 4]
    ps = [dirichlet(gen, (k + 1, V)).double() for k in ks]
    qs = [dirichlet(gen, (k, V)).double() for k in ks]
    n = 10_000
    target = torch.cat([ps[i % 4] for i in range(4 * n)])
    drafts = [[int(torch.multinomial(qs[i % 4][j], 1, generator=gen)) for j in range(ks[i % 4])] for i in range(4 * n)]
    torch.manual_seed(21)
    out = RejectionSampler()(target, drafts, [qs[i % 4] for i in range(4 * n)], [None] * (4 * n))
    for r in range(4):
        first = torch.bincount(torch.tensor([out[i][0] for i in range(r, 4 * n, 4)]), minlength=V)
        assert chi_square(first, ps[r][0]).p_value > 1e-4, (ks[r], first)


def test_bad_shapes_are_refused_with_the_rule():
    with pytest.raises(ValueError, match="rows"):
        RejectionSampler()(torch.ones(3, V) / V, [[1, 2, 3]], [None], [None])
