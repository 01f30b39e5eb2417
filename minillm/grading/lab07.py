"""Checkers for lab07 — speculative decoding.

Tasks (the notebook documents the same signatures; minillm's own versions and the engine's seams in brackets):
  lab07_1  rule(target_probs, draft_token_ids, draft_probs, generator) -> list[int]: speculative sampling's
           verification for ONE request. target_probs [k+1, V] (p_1..p_{k+1}), draft_token_ids: the k drafts,
           draft_probs [k, V] (q_1..q_k, one-hot rows for a deterministic proposer), generator: a torch.Generator
           or None (torch's global one). Accept draft x_j with probability min(1, p_j(x_j) / q_j(x_j)); at the first
           rejection emit a token drawn from normalize(max(p_j - q_j, 0)) and stop; when all k are accepted emit a
           bonus token drawn from p_{k+1}. Returns the accepted drafts followed by one token (1 to k + 1 ints).
                      [spec_decode.rejection_sampler.RejectionSampler; the RejectionRule seam: RejectionSampler(rule=)]
  lab07_2  find_ngram_draft(token_ids, k, min_n, max_n) -> list[int]: prompt lookup. For n = max_n down to min_n,
           the LATEST earlier occurrence of the sequence's last n tokens (it must end before the last token); the
           up to k tokens that followed it. [] when no suffix of min_n..max_n tokens reappears.
                             [spec_decode.ngram.find_ngram_draft; the NgramLookup seam: NgramProposer(lookup=...)]
Both plug into the engine: engine.plug(proposer=NgramProposer(lookup=...), rejection_sampler=RejectionSampler(rule=))
on an engine built with speculative_config={"method": "ngram", "num_speculative_tokens": k}.

Oracles. lab07_1 has no reference rule to compare with (the output is random): the checker calls the rule on
thousands of requests of fixed cases (fixed seeds, so a verdict never changes between runs) and tests, with
Pearson's chi-square (minillm.testing.chi_square), that (a) the draft at position j is accepted at the rate
sum_x min(p_j(x), q_j(x)) (the best any lossless rule can do) and (b) the token emitted at every position j
follows p_j. A test fails below p = 1e-6; with the sample sizes below every known mistake scores p < 1e-12
(tests/test_grading_lab07.py), and a correct rule fails one of the 15 tests with probability < 2e-5. When a
test fails, the counts are compared with each known mistake's exact outcome (`single_step`, closed form) to name
it. Around the statistics: exact properties hypothesis draws (result types; greedy rows; a perfect draft; k = 0;
inputs left unmodified; the support of what is emitted) and reproducibility (the same seeded generator gives the
same tokens whatever torch's global RNG does). Chosen random numbers (_chosen_numbers): when the rule follows a
usual consumption of the generator token for token on ordinary requests, seeds (and, for u = 0, a crafted Mersenne
Twister state) are chosen so the bonus / residual draw lands in a sliver of 1e-6 tokens next to a 0.9996 peak, the
acceptance uniform is exactly 0 for a draft of target probability 0, or just below a ratio float16 rounds. lab07_2: the definition as plain loops (reference_find_ngram_draft).
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
from hypothesis import example, given, strategies as st

from minillm.grading.core import (GradingError, Hint, Task, as_ints, check, diagnose, fail, minillm_objects,
                                  run_property)
from minillm.grading.lab06 import inverse_cdf
from minillm.testing import chi_square

__all__ = ["check_lab07_1", "check_lab07_2", "TASKS", "single_step", "reference_find_ngram_draft", "STAT_CASES",
           "THRESHOLD"]

THRESHOLD = 1e-6          # a statistical test fails below this p-value
FITS = 1e-3               # a known mistake is named when the counts fit its outcome above this p-value


# --------------------------------------------------------------------------- lab07_1 the rejection rule

# The statistical cases: V = 6 tokens, k = 3 drafts, hand-picked so that the known mistakes differ from the right
# rule (and from each other) by a lot. Rows with zeros: a token the target never emits (p = 0) that the draft
# proposes, a token the draft never proposes (q = 0) that the target wants.
DENSE_P = [[0.30, 0.25, 0.20, 0.10, 0.10, 0.05],
           [0.05, 0.10, 0.40, 0.00, 0.35, 0.10],
           [0.20, 0.05, 0.05, 0.50, 0.10, 0.10],
           [0.10, 0.30, 0.05, 0.05, 0.20, 0.30]]           # p_4: the bonus row
DENSE_Q = [[0.10, 0.45, 0.05, 0.20, 0.05, 0.15],           # acceptance sum(min(p, q)): 0.60
           [0.20, 0.15, 0.30, 0.10, 0.10, 0.15],           # 0.65
           [0.00, 0.10, 0.15, 0.35, 0.30, 0.10]]           # 0.65
# A deterministic proposer (n-gram): q one-hot on its guess. Across requests its guesses vary (different
# contexts): per position they are drawn from GUESS_R, and the rule sees only the one-hot q of each.
ONE_HOT_P = [[0.70, 0.10, 0.08, 0.06, 0.04, 0.02],
             [0.05, 0.75, 0.10, 0.00, 0.05, 0.05],
             [0.10, 0.05, 0.05, 0.05, 0.65, 0.10],
             [0.25, 0.25, 0.20, 0.10, 0.10, 0.10]]
GUESS_R = [[0.80, 0.05, 0.05, 0.00, 0.00, 0.10],
           [0.05, 0.75, 0.05, 0.15, 0.00, 0.00],             # token 3: a guess the target never accepts
           [0.10, 0.00, 0.00, 0.10, 0.80, 0.00]]
BONUS_P = [[0.05, 0.15, 0.30, 0.20, 0.25, 0.05]]           # k = 0: only the bonus token

# name: (what it is, p, q rows or None, proposer guesses or None, requests, dtype, generator seed or None: global)
STAT_CASES = {
    "sampled drafts": ("drafts sampled from a dense q (a draft model)", DENSE_P, DENSE_Q, None, 4000,
                       torch.float64, 2024),
    "one-hot drafts": ("one-hot q (a deterministic proposer such as n-gram lookup), float32, generator=None",
                       ONE_HOT_P, None, GUESS_R, 3000, torch.float32, None),
    "no drafts": ("k = 0 (nothing drafted: only the bonus token)", BONUS_P, [], None, 1000, torch.float64, 7),
}
DRAFT_SEED = 99           # the checker's own generator for the drafts it feeds the rule
GLOBAL_SEED = 2025        # torch.manual_seed before a case run with generator=None


def _ratio(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """min(1, p/q) per token (1 where q = 0: such a token is never drafted)."""
    return torch.where(q > 0, p / q.clamp_min(1e-300), torch.ones_like(p)).clamp(max=1.0)


def _residual_rows(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    return (p - q).clamp_min(0).expand(p.numel(), -1)


# Each known mistake as (why, accept(p, q) -> [V] P(accept | draft x), final(p, q) -> [V, V] row x: the
# distribution (unnormalized) the token after rejecting x is drawn from).
RIGHT = (_ratio, _residual_rows)
MISTAKES = [
    ("on a rejection you resample from p itself: draw from the residual normalize(max(p - q, 0)) instead — p "
     "gives the tokens the draft proposes too often a second chance, so they come out too often",
     _ratio, lambda p, q: p.expand(p.numel(), -1)),
    ("your residual lacks the max(., 0) (e.g. |p - q|): tokens the draft over-proposes (q > p) get mass they "
     "must not have; the residual is (p - q).clamp(min=0), then normalized",
     _ratio, lambda p, q: (p - q).abs().expand(p.numel(), -1)),
    ("you accept a draft with probability p(x): the test is min(1, p(x) / q(x)) — x was proposed with "
     "probability q(x), and dividing by it is what makes accepted tokens follow min(p, q)",
     lambda p, q: p.clone(), _residual_rows),
    ("you accept a draft deterministically whenever p(x) >= q(x) (and never otherwise): accept with probability "
     "min(1, p(x) / q(x)), i.e. when u < p(x) / q(x) for a uniform u drawn from the generator",
     lambda p, q: (p >= q).to(p.dtype), _residual_rows),
    ("you accept with probability min(1, q(x) / p(x)): the ratio is upside down, it is p(x) / q(x)",
     lambda p, q: torch.where(p > 0, q / p.clamp_min(1e-300), torch.ones_like(p)).clamp(max=1.0), _residual_rows),
    ("after a rejection you draw from p with only the rejected draft removed: that is the residual for a one-hot "
     "q only; with a dense q the residual is normalize(max(p - q, 0))",
     _ratio, lambda p, q: p.expand(p.numel(), -1) * (1 - torch.eye(p.numel(), dtype=p.dtype))),
]


def single_step(p: torch.Tensor, q: torch.Tensor, accept: Callable[..., torch.Tensor] | None = None,
                final: Callable[..., torch.Tensor] | None = None) -> tuple[float, torch.Tensor]:
    """The exact outcome at one draft position when the draft x ~ q is accepted with probability accept(p, q)[x]
    and a rejection draws from the normalized row x of final(p, q): (P(accept), distribution of the emitted
    token). With the right rule (the defaults) that distribution is p itself."""
    accept, final = accept or RIGHT[0], final or RIGHT[1]
    p, q = p.double(), q.double()
    a = accept(p, q).clamp(0, 1)
    f = final(p, q).clone()
    mass = f.sum(-1, keepdim=True)
    f = torch.where(mass > 0, f / mass.clamp_min(1e-300), torch.zeros_like(f))
    emitted = q * a + ((q * (1 - a))[:, None] * f).sum(0)
    return float((q * a).sum()), emitted


def _fmt(row: torch.Tensor) -> str:
    return "[" + ", ".join(f"{float(v):.3f}" for v in row) + "]"


def _call_rule(rule: Callable[..., Any], p: torch.Tensor, drafts: Sequence[int], q: torch.Tensor,
               generator: torch.Generator | None, where: Callable[[], str], careful: bool = False) -> list[int]:
    """Call the rule on one request; read its result with exact types and check its shape. where() describes the
    request (only built for a message). careful: call it on copies, and fail if it changed its inputs."""
    __tracebackhide__ = True
    k, V = len(drafts), p.shape[1]
    args = (p.clone(), list(drafts), q.clone()) if careful else (p, list(drafts), q)
    try:
        out = rule(args[0], args[1], args[2], generator)
    except (NotImplementedError, GradingError):
        raise
    except Exception as e:  # noqa: BLE001 — the learner's code may raise anything
        first = (str(e).strip().splitlines() or [""])[0]
        fail(f"your rule raised {type(e).__name__}{': ' + first[:200] if first else ''} on {where()}",
             "target_probs is [k+1, V], draft_probs [k, V] (k may be 0), draft_token_ids a list of k ints; "
             "index a row with p[j], a probability with p[j, x].")
    if type(out) is list and all(type(t) is int for t in out):
        toks = list(out)                                  # the common case, without building a message
    else:
        toks = as_ints(out, f"the rule's result on {where()}")
    if careful:
        if not torch.equal(args[0], p):
            fail(f"your rule modified target_probs in place ({where()}): compute the residual in a new tensor, "
                 "e.g. (p[j] - q[j]).clamp(min=0) — in the engine these rows are shared")
        if not torch.equal(args[2], q):
            fail(f"your rule modified draft_probs in place ({where()}): leave the inputs as they are")
        if args[1] != list(drafts):
            fail(f"your rule modified draft_token_ids ({where()}): leave the inputs as they are")
    if not toks:
        fail(f"your rule returned no token on {where()}: it always returns at least one token of the target's (the "
             "token drawn at the first rejection, or the bonus token)")
    if len(toks) > k + 1:
        fail(f"your rule returned {len(toks)} tokens {toks} for k = {k} drafts on {where()}: at most k + 1 (the "
             "accepted drafts, then one more)")
    if toks[:-1] != list(drafts[:len(toks) - 1]):
        fail(f"your rule returned {toks} for the drafts {list(drafts)} on {where()}: the result must be the accepted "
             "drafts in order (a prefix of draft_token_ids, stopping at the first rejection), then one token")
    bad = [t for t in toks if not 0 <= t < V]
    if bad:
        fail(f"your rule returned token ids {bad} outside the vocabulary [0, {V}) on {where()}")
    return toks


def _describe(p: torch.Tensor, q: torch.Tensor, drafts: Sequence[int]) -> str:
    k = len(drafts)
    return f"a request with k = {k}, V = {p.shape[1]}, drafts {list(drafts)}" + \
        (f", p rows {[_fmt(r) for r in p]}, q rows {[_fmt(r) for r in q]}" if p.shape[1] <= 6 and k <= 3 else "")


def _run_case(rule: Callable[..., Any], name: str) -> tuple:
    """Run the rule on every request of a statistical case. Returns (p, q rows or None for one-hot, counts [k+1, V]:
    tokens emitted at each position, accepted [k] and reached [k]: per draft position, how many requests accepted
    the draft there / got that far, the right rule's acceptance rate per position, the longest result)."""
    __tracebackhide__ = True
    _, p_rows, q_rows, guesses, n, dtype, seed = STAT_CASES[name]
    p = torch.tensor(p_rows, dtype=dtype)
    k, V = p.shape[0] - 1, p.shape[1]
    g_draft = _seeded(DRAFT_SEED)
    if guesses is not None:                             # one-hot q per request
        r = torch.tensor(guesses, dtype=torch.float64)
        drafts = torch.stack([torch.multinomial(r[j], n, replacement=True, generator=g_draft) for j in range(k)], 1)
        qs = torch.nn.functional.one_hot(drafts, V).to(dtype)       # [n, k, V]
        q_shared = None
    else:
        q_shared = torch.tensor(q_rows, dtype=dtype).reshape(k, V)
        drafts = torch.stack([torch.multinomial(q_shared[j].double(), n, replacement=True, generator=g_draft)
                              for j in range(k)], 1) if k else torch.zeros(n, 0, dtype=torch.long)
        qs = None
    p_before, q_before = p.clone(), (qs if qs is not None else q_shared).clone()
    gen = None if seed is None else _seeded(seed)
    if seed is None:
        torch.manual_seed(GLOBAL_SEED)
    p_list = p.double().tolist()
    counts = [[0] * V for _ in range(k + 1)]
    accepted, reached, kept_chance, longest = [0] * k, [0] * k, [0.0] * k, 0
    for i, d in enumerate(drafts.tolist()):
        q = qs[i] if qs is not None else q_shared
        toks = _call_rule(rule, p, d, q, gen,
                          lambda: f"request {i} of the '{name}' case ({_describe(p, q, d)})", careful=i < 3)
        a = len(toks) - 1
        longest = max(longest, len(toks))
        for j, t in enumerate(toks):
            counts[j][t] += 1
        for j in range(min(a + 1, k)):
            reached[j] += 1
            kept_chance[j] += p_list[j][d[j]]
        for j in range(a):
            accepted[j] += 1
    if not torch.equal(p, p_before) or not torch.equal(qs if qs is not None else q_shared, q_before):
        fail(f"your rule modified target_probs or draft_probs in place during the '{name}' case: compute new "
             "tensors (e.g. (p[j] - q[j]).clamp(min=0)) — in the engine these rows are shared")
    if qs is None:
        alphas = [single_step(p[j], q_shared[j])[0] for j in range(k)]
    else:                                               # one-hot q: a guess x is kept with probability p(x)
        alphas = [kept_chance[j] / reached[j] if reached[j] else 0.0 for j in range(k)]
    return p, q_shared, torch.tensor(counts), accepted, reached, alphas, longest


def _acceptance_test(accepted: int, reached: int, alpha: float) -> float:
    if alpha <= 0.0:
        return 1.0 if accepted == 0 else 0.0
    if alpha >= 1.0:
        return 1.0 if accepted == reached else 0.0
    return chi_square([accepted, reached - accepted], [alpha, 1 - alpha]).p_value


def _name_mistake(p0: torch.Tensor, q0: torch.Tensor, accepted0: int, reached0: int,
                  counts0: torch.Tensor) -> str | None:
    """The known mistake whose exact outcome at the first position fits the counts best (acceptance and tokens),
    if it fits at all (p-value above FITS for both)."""
    best, best_fit = None, FITS
    for why, accept, final in MISTAKES:
        alpha, emitted = single_step(p0, q0, accept, final)
        fit = min(_acceptance_test(accepted0, reached0, alpha), chi_square(counts0, emitted).p_value)
        if fit > best_fit:
            best, best_fit = why, fit
    return best


_STAT_HINT_SHOW = ("for j, x in enumerate(draft_token_ids): draw u = torch.rand((), generator=generator, "
              "dtype=torch.float64); keep x if u < p[j, x] / q[j, x]; otherwise return the kept drafts plus "
              "int(torch.multinomial((p[j] - q[j]).clamp(min=0), 1, generator=generator)). If every draft was kept, "
              "append int(torch.multinomial(p[k], 1, generator=generator)), the bonus token.")
_STAT_HINT = Hint(
    "verification must make every emitted token follow the target's p_j exactly: accept, or reject and resample, "
    "or add the bonus token, as the statement's rule says.",
    "at position j draw one uniform number from the request's generator and accept x_j when it is below "
    "p_j(x_j) / q_j(x_j); at the first rejection draw from normalize(max(p_j − q_j, 0)) and stop; when all k are "
    "accepted, draw the bonus token from target_probs[k].",
    _STAT_HINT_SHOW)


def _statistics(rule: Callable[..., Any]) -> None:
    __tracebackhide__ = True
    for name, (what, _p, _q, _guesses, n, _dtype, _seed) in STAT_CASES.items():
        p, q, counts, accepted, reached, alphas, longest = _run_case(rule, name)
        k = p.shape[0] - 1
        case = f"in the '{name}' case ({what}; {n} requests, fixed seeds)"
        all_accepted = float(torch.tensor(alphas, dtype=torch.float64).prod()) if k else 0.0
        if k and longest < k + 1 and reached[k - 1] > 0:
            fail(f"{case} your rule never returned k + 1 = {k + 1} tokens, although the right rule accepts all "
                 f"{k} drafts in ~{all_accepted:.0%} of the requests: when "
                 "all k drafts are accepted, the target's last row gives one more token for free — draw the bonus "
                 "token from target_probs[k] and append it", _STAT_HINT)

        def why_first_position():
            return _name_mistake(p[0], q[0], accepted[0], reached[0], counts[0]) if q is not None and k else None

        for j in range(k):
            pv = _acceptance_test(accepted[j], reached[j], alphas[j])
            if pv < THRESHOLD:
                why = why_first_position()
                fail(f"{case} your rule accepted the draft at position {j} in {accepted[j]} of the {reached[j]} "
                     f"requests that reached it ({accepted[j] / max(reached[j], 1):.1%}); the right rule accepts "
                     f"{'sum_x min(p(x), q(x))' if q is not None else 'a guess x with probability p(x)'} = "
                     f"{alphas[j]:.1%} of them (chi-square p-value {pv:.1e} < {THRESHOLD:.0e})" +
                     (f" — {why}" if why else ""), _STAT_HINT)
        for j in range(k + 1):
            seen = int(counts[j].sum())
            if seen == 0:
                continue
            pv = chi_square(counts[j], p[j].double()).p_value
            if pv < THRESHOLD:
                why = why_first_position()
                if j == k and k and why is None and chi_square(counts[j], p[k - 1].double()).p_value > FITS:
                    why = ("your bonus token follows target_probs[k - 1]: the bonus is drawn from the LAST row, "
                           "target_probs[k], the target's distribution after all k drafts")
                role = "bonus token (all drafts accepted)" if j == k else f"token at position {j}"
                fail(f"{case} the {role} your rule emitted does not follow the target's p_{j}: frequencies "
                     f"{_fmt(counts[j].double() / seen)} over {seen} requests vs p_{j} = {_fmt(p[j])}" +
                     (f", q_{j} = {_fmt(q[j])}" if q is not None and j < k else "") +
                     f" (chi-square p-value {pv:.1e} < {THRESHOLD:.0e})" + (f" — {why}" if why else ""),
                     _STAT_HINT)


def _seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _reproducibility(rule: Callable[..., Any]) -> None:
    """The same seeded generator gives the same tokens whatever torch's global RNG does; with generator=None,
    torch.manual_seed reproduces the tokens."""
    __tracebackhide__ = True
    p, q = torch.tensor(DENSE_P, dtype=torch.float64), torch.tensor(DENSE_Q, dtype=torch.float64)
    g = _seeded(5)
    drafts = torch.stack([torch.multinomial(q[j], 40, replacement=True, generator=g) for j in range(3)], 1).tolist()
    # the rule's fast paths too: nothing drafted (k = 0: only the bonus token), and one-hot drafts (a greedy draft
    # model): each must still draw from the request's generator
    cases = [(p, d, q) for d in drafts] + [(p[:1], [], q[:0])] * 20 + \
        [(p, d, torch.nn.functional.one_hot(torch.tensor(d), q.shape[1]).to(q.dtype)) for d in drafts[:20]]

    def run(global_seed: int, gen_seed: int | None) -> list[list[int]]:
        torch.manual_seed(global_seed)
        gen = _seeded(gen_seed) if gen_seed is not None else None
        return [_call_rule(rule, pc, d, qc, gen, lambda: f"{_describe(pc, qc, d)} (the reproducibility check)")
                for pc, d, qc in cases]

    a, b = run(11, 1234), run(22, 1234)
    if a != b:
        i = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
        if run(11, 1234) == a:
            why = ("your rule draws (some of) its random numbers from torch's global RNG although a generator was "
                   "given: pass generator=generator to every torch.rand / torch.multinomial call (torch.distributions "
                   "samplers take no generator: use torch.multinomial)")
        else:
            why = ("your rule's randomness comes from somewhere else than torch (Python's random, numpy, the "
                   "clock): draw every random number with torch, from the generator argument")
        fail(f"two runs with generators seeded alike (torch.Generator().manual_seed(1234)) gave different tokens, "
             f"e.g. {a[i]} vs {b[i]} for the drafts {cases[i][1]}"
             + (" (one-hot draft_probs)" if i >= len(drafts) + 20 else "")
             + ", when only torch's global RNG was reseeded in "
             f"between — {why}. A seeded request must reproduce whatever else runs in the engine.")
    c, d = run(33, None), run(33, None)
    if c != d:
        i = next(i for i, (x, y) in enumerate(zip(c, d)) if x != y)
        fail(f"with generator=None, two runs after torch.manual_seed(33) gave different tokens ({c[i]} vs {d[i]}): "
             "when generator is None draw from torch's global RNG (torch.rand(..., generator=None), "
             "torch.multinomial(..., generator=None)), nothing else")


# Chosen random numbers. A bias in a sliver of the mass (greedy once a row is peaked, a threshold that drops tiny
# tokens, a float16 CDF), or an acceptance test `u <= ratio` (a draft of target probability 0 accepted when u = 0),
# shows in a few requests in a million: the counts above cannot see it. torch's random functions are deterministic
# given a generator's state, so the checker picks the states. It first finds which usual way of consuming the
# generator the rule follows token for token on ordinary requests (none: these checks are skipped, the statistics
# still apply): for a rejected draft, an acceptance uniform (float32, float64, or none) then the residual draw (an
# inverse CDF on one float32 / float64 uniform, or torch.multinomial). Then it searches seeds whose numbers land,
# that way, in the sliver, and the rule must land there too.
_PRE = {"no acceptance uniform": None,
        "a float32 acceptance uniform": lambda g: torch.rand((), generator=g),
        "a float64 acceptance uniform": lambda g: torch.rand((), generator=g, dtype=torch.float64)}
_DRAW = {"an inverse CDF on one float32 uniform": lambda r, g: inverse_cdf(r, float(torch.rand((), generator=g)))[0],
         "an inverse CDF on one float64 uniform":
             lambda r, g: inverse_cdf(r, float(torch.rand((), generator=g, dtype=torch.float64)))[0],
         "torch.multinomial": lambda r, g: int(torch.multinomial(r, 1, generator=g)[0])}


def _predict(pre: str, how: str, r: torch.Tensor, seed: int, k: int) -> int:
    g = _seeded(seed)
    if k and _PRE[pre] is not None:
        _PRE[pre](g)
    return _DRAW[how](r, g)


def _rejected_case(r: torch.Tensor) -> tuple[torch.Tensor, list[int], torch.Tensor]:
    """k = 1, draft 0 with target probability 0 (always rejected), one-hot q: the residual is r itself (r[0] = 0)."""
    V = r.numel()
    p = torch.stack([r, torch.full((V,), 1.0 / V, dtype=r.dtype)])
    q = torch.zeros(1, V, dtype=r.dtype)
    q[0, 0] = 1.0
    return p, [0], q


def _request(r: torch.Tensor, k: int) -> tuple[torch.Tensor, list[int], torch.Tensor]:
    return (r[None], [], r[None][:0]) if k == 0 else _rejected_case(r)


def _consumption(rule: Callable[..., Any], k: int) -> tuple[str, str] | None:
    g = _seeded(41 + k)
    rows = (torch.randn(8, 16, generator=g, dtype=torch.float64) * 1.5).softmax(-1)
    rows[:, 0] = 0.0
    rows = rows / rows.sum(-1, keepdim=True)
    seeds = list(range(900, 908))
    got = []
    for r, s in zip(rows, seeds):
        p, d, q = _request(r, k)
        got.append(_call_rule(rule, p, d, q, _seeded(s), lambda: f"{_describe(p, q, d)} (the chosen-numbers check)"))
    for pre in (_PRE if k else ["no acceptance uniform"]):
        for how in _DRAW:
            if all(t == [_predict(pre, how, r, s, k)] for t, r, s in zip(got, rows, seeds)):
                return pre, how
    return None


_SLIVER_HINT = Hint(
    "every token the rule emits must come out with exactly its probability (the residual's, the bonus row's), "
    "however small it is and however peaked the row: no shortcut to the argmax, no threshold, no low precision.",
    "sum probabilities in float32 or float64 (float16 has 11 bits: 0.9996 + 1e-6 = 0.9996); accept a draft when "
    "u < min(1, p/q), strictly: a draft of target probability 0 must never be accepted, even with u = 0.")


def _crafted(words: list[int], seed: int) -> torch.Generator:
    """A generator (seeded `seed`) whose next 32-bit outputs are `words` (Mersenne Twister: its state words are the
    outputs before tempering, so untempering them and rewinding the read position sets what comes next)."""
    def untemper(y: int) -> int:
        y ^= y >> 18
        y ^= (y << 15) & 0xEFC60000
        t = y
        for _ in range(5):
            t = y ^ ((t << 7) & 0x9D2C5680)
        y = t & 0xFFFFFFFF
        t = y
        for _ in range(3):
            t = y ^ (t >> 11)
        return t & 0xFFFFFFFF
    state = _seeded(seed).get_state().clone()
    raw = state.numpy()                          # the_initial_seed u64, left i32, seeded i32, next u64, state[624] u64
    mt = raw[24:24 + 624 * 8].view("<u8")
    for i, w in enumerate(words):
        mt[i] = untemper(w)
    raw[8:12].view("<i4")[0] = 624               # no twist before the next read ...
    raw[16:24].view("<u8")[0] = 0                # ... which starts at state[0]
    g = torch.Generator()
    g.set_state(state)
    return g


def _chosen_numbers(rule: Callable[..., Any]) -> None:
    __tracebackhide__ = True
    sliver = torch.full((402,), 1e-6, dtype=torch.float64)
    sliver[0], sliver[1] = 0.0, 1 - 400e-6        # token 1 holds 0.9996, tokens 2..401 hold 1e-6 each (r[0] = 0)
    for k, what in ((0, "the bonus token of a request with nothing drafted (k = 0)"),
                    (1, "the token drawn after rejecting draft 0 (target probability 0, one-hot draft_probs): the "
                        "residual max(p_0 - q_0, 0) is p_0 itself")):
        way = _consumption(rule, k)
        if way is None:
            continue
        pre, how = way
        seeds, s = [], 70_000
        while len(seeds) < 3:
            if 52 <= _predict(pre, how, sliver, s, k) <= 350:
                seeds.append(s)
            s += 1
        for s in seeds:
            p, d, q = _request(sliver.float(), k)
            toks = _call_rule(rule, p, d, q, _seeded(s), lambda: _describe(p, q, d))
            if not 2 <= toks[-1] <= 401:
                fail(f"for {what}, your rule follows {how}" + (f" after {pre}" if k else "") + " on ordinary "
                     f"requests, token for token. On a peaked row (token 1 holds 0.9996, tokens 2..401 hold 1e-06 "
                     f"each) with a generator seeded {s}, that random number lands among tokens 2..401 (token "
                     f"{_predict(pre, how, sliver, s, k)}), but your rule emitted {toks[-1]} — a rule that is greedy "
                     "on peaked rows, drops tiny tokens below a threshold, or sums the CDF in float16 never emits "
                     "these tokens", _SLIVER_HINT)
        if k and pre != "no acceptance uniform":      # u = 0 exactly: a draft of target probability 0 stays rejected
            words = 1 if pre.startswith("a float32") else 2
            crafted_ok = float(_PRE[pre](_crafted([0] * words, 8))) == 0.0    # False: another state layout, skip
            for q0 in ([0.0, 1.0, 0.0], [0.25, 0.5, 0.25]) if crafted_ok else ():
                p = torch.tensor([[0.5, 0.0, 0.5], [0.2, 0.3, 0.5]], dtype=torch.float64)
                q = torch.tensor([q0], dtype=torch.float64)
                toks = _call_rule(rule, p, [1], q, _crafted([0] * words, 8), lambda: _describe(p, q, [1]))
                if len(toks) > 1:
                    fail(f"your rule accepted draft 1 although the target gives it probability 0 "
                         f"({_describe(p, q, [1])}, a generator whose next uniform is exactly 0.0): accept when "
                         "u < min(1, p/q), strictly — with `u <= p / q` a draft of probability 0 is accepted once "
                         "in 2^24 float32 uniforms",
                         _SLIVER_HINT)
            # u just below p/q = 0.3001 / 0.6 = 0.50017 (float16 rounds it to 0.5): the draft must be accepted
            p = torch.tensor([[0.2, 0.3001, 0.4999], [0.2, 0.3, 0.5]])
            q = torch.tensor([[0.1, 0.6, 0.3]])
            s, hits = 90_000, 0
            while hits < 2:
                u = float(_PRE[pre](_seeded(s)))
                if 0.50003 < u < 0.50014:
                    hits += 1
                    toks = _call_rule(rule, p, [1], q, _seeded(s), lambda: _describe(p, q, [1]))
                    if len(toks) < 2:
                        fail(f"your rule draws {pre} first; with a generator seeded {s} that uniform is u = {u:.6f}, "
                             f"below min(1, p_0(1) / q_0(1)) = 0.3001 / 0.6 = {0.3001 / 0.6:.6f}, so draft 1 must be "
                             f"accepted, but your rule rejected it ({_describe(p, q, [1])}) — the ratio is computed "
                             "in too low a precision (float16 rounds it to 0.5)", _SLIVER_HINT)
                s += 1


# The exact properties: cases built from a seed (the same case for the same draw).

def _random_rows(g: torch.Generator, rows: int, V: int) -> torch.Tensor:
    """Random distributions with ~30% zeros (never the row's largest entry)."""
    logits = torch.randn(rows, V, generator=g, dtype=torch.float64) * 2
    drop = torch.rand(rows, V, generator=g) < 0.3
    drop[torch.arange(rows), logits.argmax(-1)] = False
    x = logits.softmax(-1).masked_fill(drop, 0.0)
    return x / x.sum(-1, keepdim=True)


def _make_rule_case(kind: str, k: int, V: int, dtype: torch.dtype, seed: int) -> tuple:
    g = _seeded(seed)
    p = _random_rows(g, k + 1, V)
    if kind == "dense":
        q = _random_rows(g, k, V)
        drafts = [int(torch.multinomial(q[j], 1, generator=g)) for j in range(k)]
    elif kind == "one_hot":
        drafts = torch.randint(0, V, (k,), generator=g).tolist()
        q = torch.nn.functional.one_hot(torch.tensor(drafts, dtype=torch.long), V).double().reshape(k, V)
    elif kind == "same":
        q = p[:k].clone()
        drafts = [int(torch.multinomial(q[j], 1, generator=g)) for j in range(k)]
    else:                                               # greedy: p one-hot on the target's argmax
        argmax = torch.randint(0, V, (k + 1,), generator=g)
        p = torch.nn.functional.one_hot(argmax, V).double()
        drafts = [int(a) if (V == 1 or float(torch.rand((), generator=g)) < 0.6) else
                  int((a + 1 + torch.randint(0, V - 1, (), generator=g)) % V) for a in argmax[:k]]
        if kind == "greedy_dense":                      # a sampling draft verified by a greedy target
            q = _random_rows(g, k, V)
            for j, x in enumerate(drafts):
                q[j, x] += 0.2
            q = q / q.sum(-1, keepdim=True)
        else:
            q = torch.nn.functional.one_hot(torch.tensor(drafts, dtype=torch.long), V).double().reshape(k, V)
    return p.to(dtype), drafts, q.reshape(k, V).to(dtype)


_KINDS = ["dense", "one_hot", "same", "greedy", "greedy_dense"]


def verify_lab07_1(rule: Callable[..., Any]) -> None:
    state = torch.random.get_rng_state()
    try:
        _statistics(rule)

        @given(kind=st.sampled_from(_KINDS), k=st.integers(0, 5), V=st.sampled_from([1, 2, 3, 7, 50, 300]),
               dtype=st.sampled_from(["float32", "float64"]), seed=st.integers(0, 2**31 - 1), gen=st.booleans())
        @example(kind="same", k=3, V=7, dtype="float32", seed=1, gen=True)          # all accepted + the bonus
        @example(kind="greedy", k=4, V=7, dtype="float32", seed=2, gen=False)       # temperature 0
        @example(kind="greedy", k=3, V=7, dtype="float32", seed=15, gen=True)       # ... every draft is the argmax
        @example(kind="greedy_dense", k=3, V=50, dtype="float64", seed=3, gen=True)
        @example(kind="dense", k=0, V=7, dtype="float32", seed=4, gen=True)         # nothing drafted
        @example(kind="one_hot", k=5, V=300, dtype="float32", seed=5, gen=True)     # token ids above 256
        @example(kind="dense", k=2, V=49152, dtype="float32", seed=6, gen=True)     # SmolLM2's vocabulary
        def prop(kind: str, k: int, V: int, dtype: str, seed: int, gen: bool) -> None:
            p, drafts, q = _make_rule_case(kind, k, V, getattr(torch, dtype), seed)
            generator = _seeded(seed + 1) if gen else None       # not the stream the case was drawn from
            what = f"{_describe(p, q, drafts)} ({dtype}, {kind} case)"
            toks = _call_rule(rule, p, drafts, q, generator, lambda: what, careful=True)
            a = len(toks) - 1
            if kind.startswith("greedy"):
                argmax = p.argmax(-1).tolist()
                keep = next((j for j, (x, y) in enumerate(zip(drafts, argmax)) if x != y), k)
                want = list(drafts[:keep]) + [argmax[keep]]
                check(toks == want, f"with greedy target rows (p one-hot on the target's argmax {argmax}: a "
                                    f"temperature-0 request) and drafts {list(drafts)}, the rule must keep the drafts "
                                    f"while they equal the argmax, then emit the argmax: expected {want}, got {toks}")
            if kind == "same":
                why = (" — you forgot the bonus token: when all k drafts are accepted, append a token drawn from "
                       "target_probs[k]" if toks == list(drafts) and k else "")
                check(a == k, f"with draft_probs equal to target_probs[:k] (a perfect draft: min(1, p/q) = 1 for every "
                              f"draft) every draft is accepted and the bonus token follows: expected {k + 1} tokens "
                              f"starting with {list(drafts)}, got {toks}{why}")
            pd, qd = p.double(), q.double()
            for j in range(a):
                check(float(pd[j, toks[j]]) > 0, f"your rule accepted draft {toks[j]} at position {j} although the "
                      f"target gives it probability 0 ({what})")
            if a < k:                                   # rejected at position a, then drew toks[-1]
                x, y = drafts[a], toks[-1]
                check(float(pd[a, x]) < float(qd[a, x]),
                      f"your rule rejected draft {x} at position {a} although p_{a}({x}) = {float(pd[a, x]):.4g} >= "
                      f"q_{a}({x}) = {float(qd[a, x]):.4g}: its acceptance probability min(1, p/q) is 1 ({what})")
                check(float(pd[a, y]) > float(qd[a, y]),
                      f"after rejecting draft {x} at position {a} your rule emitted {y}, where p_{a}({y}) = "
                      f"{float(pd[a, y]):.4g} <= q_{a}({y}) = {float(qd[a, y]):.4g}: the residual max(p - q, 0) "
                      f"is 0 there ({what})")
            else:
                check(float(pd[k, toks[-1]]) > 0, f"your bonus token {toks[-1]} has probability 0 under the last "
                      f"row target_probs[k] ({what})")

        run_property(prop, max_examples=60, hint=_STAT_HINT)
        _reproducibility(rule)
        _chosen_numbers(rule)
    finally:
        torch.random.set_rng_state(state)


# --------------------------------------------------------------------------- lab07_2 the n-gram lookup

def reference_find_ngram_draft(token_ids: Sequence[int], k: int, min_n: int, max_n: int) -> list[int]:
    """The definition as loops: for n = max_n down to min_n, scan the starts s from the latest (len - n - 1, so
    that the occurrence ends before the last token) to 0; at the first s whose n tokens equal the last n tokens,
    return the up to k tokens after it."""
    tokens = list(token_ids)
    length = len(tokens)
    for n in range(max_n, min_n - 1, -1):
        if n < 1 or n >= length:
            continue
        suffix = tokens[length - n:]
        for s in range(length - n - 1, -1, -1):
            if tokens[s:s + n] == suffix:
                return tokens[s + n:s + n + k]
    return []


def _lookup_variant(tokens: Sequence[int], k: int, min_n: int, max_n: int, *, latest: bool = True,
                    longest_first: bool = True, own: bool = False, last_start: int = 1, overlap: bool = True,
                    take: str = "follow") -> list[int]:
    """reference_find_ngram_draft with one known mistake switched on."""
    tokens = list(tokens)
    L = len(tokens)
    ns = range(max_n, min_n - 1, -1) if longest_first else range(min_n, max_n + 1)
    for n in ns:
        if n < 1 or n >= L + (1 if own else 0):
            continue
        suffix = tokens[L - n:]
        top = L - n - last_start + (1 if own else 0)
        if not overlap:
            top = min(top, L - 2 * n)
        starts = range(top, -1, -1) if latest else range(0, top + 1)
        for s in starts:
            if tokens[s:s + n] == suffix:
                if take == "match":
                    return tokens[s:s + n]
                if take == "all":
                    return tokens[s + n:]
                if take == "skip1":
                    return tokens[s + n + 1:s + n + 1 + k]
                if take == "short":
                    return tokens[s + n:s + n + k - 1]
                return tokens[s + n:s + n + k]
    return []


_LOOKUP_MISTAKES = [
    ("you take the EARLIEST occurrence: take the LATEST one (scan the starts from the end) — recent context "
     "predicts the continuation best, and it is what the engine's proposer does", dict(latest=False)),
    ("you try the SHORTEST n first: try n = max_n down to min_n and stop at the first n that matches — a longer "
     "match is more specific, so its continuation is a better guess", dict(longest_first=False)),
    ("you count the suffix itself as an occurrence (it ends AT the last token, and nothing follows it): an "
     "occurrence must end before the last token, start + n <= len(token_ids) - 1", dict(own=True)),
    ("you return the matched n-gram itself: return what FOLLOWED it, token_ids[start + n : start + n + k]",
     dict(take="match")),
    ("you return more than k tokens: at most k, token_ids[start + n : start + n + k]", dict(take="all")),
    ("you never look at the latest possible occurrence, the one that ends just before the last token "
     "(start = len(token_ids) - n - 1): an off-by-one at the end of the range of starts", dict(last_start=2)),
    ("you skip the first token after the occurrence: the draft starts right after it, at start + n",
     dict(take="skip1")),
    ("you return k - 1 tokens: take up to k, token_ids[start + n : start + n + k]", dict(take="short")),
    ("you require the occurrence not to overlap the suffix: overlapping occurrences count (in 7 7 7 7 the last "
     "two 7s also occur at positions 1-2, and a 7 follows them)", dict(overlap=False)),
]
_LOOKUP_PROBES = [
    ([1, 2, 5, 1, 2, 6, 1, 2], 2, 1, 2),                # latest occurrence: [6, 1]; earliest: [5, 1]
    ([3, 1, 2, 7, 4, 2, 8, 1, 2], 2, 1, 2),             # n = 2 first: [7, 4]; n = 1 first: [8, 1]
    ([4, 7, 7], 3, 1, 1),                                # the occurrence just before the last token: [7]
    ([7, 7, 7, 7], 2, 1, 3),                             # overlapping: n = 3 at 0 -> [7]
    ([1, 2, 5, 1, 2, 6, 1, 2], 1, 1, 2),                # at most k: [6]
    ([9, 8, 1, 2, 3, 4, 5, 6, 9, 8], 3, 2, 2),          # [1, 2, 3]
]


def _as_draft(x: Any) -> list[int] | None:
    try:
        return as_ints(x, "the lookup's result")
    except GradingError:
        return None


_NGRAM_ALPHABETS = [(0, 1), (0, 1, 2), (5, 6, 7, 8), (1, 2, 12, 21, 121), (3, 259, 65539, 2**24 + 3, 199_999)]


@st.composite
def _ngram_cases(draw: st.DrawFn) -> tuple[list[int], int, int, int]:
    alphabet = draw(st.sampled_from(_NGRAM_ALPHABETS))
    if draw(st.booleans()):
        tokens = draw(st.lists(st.sampled_from(alphabet), max_size=40))
    else:                                             # a repeated pattern with a tail: overlapping matches
        base = draw(st.lists(st.sampled_from(alphabet), min_size=1, max_size=6))
        tokens = (base * draw(st.integers(1, 6)) + draw(st.lists(st.sampled_from(alphabet), max_size=6)))[:40]
    min_n = draw(st.integers(1, 3))
    return tokens, draw(st.integers(1, 8)), min_n, min_n + draw(st.integers(0, 3))


def verify_lab07_2(find_ngram_draft: Callable[..., Any]) -> None:
    @given(case=_ngram_cases())
    @example(case=([1, 2, 5, 1, 2, 6, 1, 2], 2, 1, 2))            # the latest occurrence, not the earliest
    @example(case=([3, 1, 2, 7, 4, 2, 8, 1, 2], 2, 1, 2))         # the longest n first
    @example(case=([4, 7, 7], 3, 1, 1))                           # an occurrence ending just before the last token
    @example(case=([7, 7, 7, 7], 2, 1, 3))                        # overlapping occurrences
    @example(case=([1, 2, 5, 1, 2, 6, 1, 2], 1, 1, 2))            # at most k tokens
    @example(case=([1, 2, 3, 1, 2], 8, 1, 2))                     # k larger than what follows
    @example(case=([3, 9, 65539], 2, 1, 1))                       # 65539 = 2**16 + 3: ids are not 16-bit
    @example(case=([1, 21, 5, 12, 1, 2], 2, 2, 2))                # "1","21" is not "12": ids are not digits
    @example(case=([], 3, 1, 3))
    @example(case=([5], 2, 1, 1))
    def prop(case: tuple[list[int], int, int, int]) -> None:
        tokens, k, min_n, max_n = case
        given_tokens = list(tokens)
        try:
            out = find_ngram_draft(given_tokens, k, min_n, max_n)
        except (NotImplementedError, GradingError):
            raise
        except Exception as e:  # noqa: BLE001
            first = (str(e).strip().splitlines() or [""])[0]
            fail(f"find_ngram_draft({tokens}, k={k}, min_n={min_n}, max_n={max_n}) raised {type(e).__name__}"
                 f"{': ' + first[:200] if first else ''}")
        got = as_ints(out, f"find_ngram_draft({tokens}, k={k}, min_n={min_n}, max_n={max_n})")
        check(given_tokens == list(tokens), f"find_ngram_draft modified token_ids ({tokens} became {given_tokens}): "
                                            "in the engine that list is the sequence itself")
        want = reference_find_ngram_draft(tokens, k, min_n, max_n)
        if got != want:
            variants = [(why, (lambda kw: lambda t, kk, a, b: _lookup_variant(t, kk, a, b, **kw))(kw))
                        for why, kw in _LOOKUP_MISTAKES]
            why = diagnose(find_ngram_draft, variants, [(list(tokens), k, min_n, max_n)] +
                           [(list(t), *rest) for t, *rest in _LOOKUP_PROBES], lambda a, b: _as_draft(a) == list(b))
            fail(f"find_ngram_draft({tokens}, k={k}, min_n={min_n}, max_n={max_n}) returned {got}, expected {want}"
                 + (f" — {why}" if why else ""))

    run_property(prop, max_examples=200, hint=Hint(
        "prompt lookup: find the latest earlier place where the sequence's last n tokens occurred, the longest n "
        "first, and propose what followed it.",
        "n goes from max_n down to min_n (never more than len(token_ids) − 1); the earlier occurrence must end "
        "before the last token; scan from the latest start backwards; return up to k tokens after it, or [] when "
        "no n matched.",
        "for n from min(max_n, len(token_ids) - 1) down to min_n: suffix = token_ids[-n:]; for start from "
        "len(token_ids) - n - 1 down to 0: if token_ids[start:start + n] == suffix, return "
        "token_ids[start + n:start + n + k]. Return [] when nothing matched."))


# --------------------------------------------------------------------------- the tasks

TASKS = {t.id: t for t in (
    Task("lab07_1", what="rule", verify=verify_lab07_1,
         engine=minillm_objects("minillm.spec_decode.rejection_sampler:RejectionSampler"),
         oracles=lambda: [single_step]),
    Task("lab07_2", what="find_ngram_draft", verify=verify_lab07_2,
         engine=minillm_objects("minillm.spec_decode.ngram:find_ngram_draft"),
         oracles=lambda: [reference_find_ngram_draft]),
)}

check_lab07_1 = TASKS["lab07_1"].checker(
    'rule(target_probs [k+1, V], draft_token_ids (k ints), draft_probs [k, V], generator) -> the accepted drafts '
    'then one token: accept x_j with probability min(1, p_j(x_j) / q_j(x_j)), resample from normalize(max(p_j - '
    'q_j, 0)) at the first rejection, a bonus token from p_{k+1} when all are accepted.')
check_lab07_2 = TASKS["lab07_2"].checker(
    'find_ngram_draft(token_ids, k, min_n, max_n) -> up to k tokens that followed the latest earlier occurrence of '
    'the last n tokens, longest n first.')
