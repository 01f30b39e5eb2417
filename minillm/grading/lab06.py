"""Checkers for lab06 — sampling.

Tasks (the notebook documents the same signatures; minillm's own versions, the engine's seams, in brackets):
  lab06_1  process_logits(logits, temperature, top_k, top_p, min_p) -> Tensor [B, V]: logits [B, V] float32 and
           one setting per row ([B] tensors) -> the logits each row samples from: its own temperature, then min-p,
           top-k and top-p (vLLM's order); a dropped token is -inf.
                                                  [sampling.processors.process_logits; the ProcessFn seam]
  lab06_2  draw(probs, generators) -> int64 Tensor [B]: one token per row of probs [B, V], row i drawn with
           generators[i] (None: torch's global generator).            [sampling.sampler.draw; the DrawFn seam]
Both plug into minillm's Sampler: Sampler(process_fn=..., draw_fn=...), then engine.plug(sampler=...).

Oracles. lab06_1: each row on its own, in float64 Python, one rule after the other as its definition reads
(reference_row). The kept set must equal the oracle's exactly, except for tokens less likely than 1e-20 x the top
token (float32 cannot tell them apart; either fate is accepted); cases where a decision sits within a float32
rounding margin of its threshold are not drawn. The distribution (softmax of the result, in float64) must match
within rtol 1e-5 + 2e-6 x max|logit / T| (float32's own resolution at that magnitude).
lab06_2: no reference draw (two correct samplers give different tokens for the same seed). Exact checks (one-hot
rows, tokens of probability 0 never drawn), Pearson chi-square tests of the token counts against probs (fixed seeds;
3,072 draws per distribution and kind of generator; each p-value must exceed 1e-6), and the seeded rows' tokens
compared across repeated runs, batch compositions, positions and states of torch's global generator; an all-seeded
batch leaves torch's global generator untouched. Chosen random numbers (_chosen_uniforms): when the draw follows a
usual consumption of generators[i] token for token on ordinary rows (torch.multinomial, an inverse CDF on one float32
or float64 uniform), seeds are searched whose numbers land in a 4e-4 sliver of 1e-6 tokens next to a 0.9996 peak,
and, for a float32 inverse CDF, exactly on a cumulative edge; the draw must land there too.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Iterable, NamedTuple

import torch
from hypothesis import assume, example, given, strategies as st

from minillm.grading.core import GradingError, Hint, Task, as_tensor, check, diagnose, fail, minillm_objects, \
    run_property
from minillm.sampling.params import SamplingParams
from minillm.sampling.sampler import Sampler, SamplingBatch
from minillm.testing import chi_square

__all__ = ["check_lab06_1", "check_lab06_2", "TASKS", "reference_row", "reference_process_logits"]

NEG_INF = float("-inf")
NEGLIGIBLE = 46.0          # a token whose logit / T is more than 46 below the top one has p < 1e-20 x p_top


# --------------------------------------------------------------------------- lab06_1 the oracle

class Expected(NamedTuple):
    """What one row must come out as.

    keep:  the kept token ids;              x: every token's logit / T (float64)
    free:  ids whose fate is not compared: tokens below 1e-20 x the top one's probability, and tokens tied (equal
           logits) across top-p's cut, where any choice among the tied ones is a smallest set
    reach: (the tokens top-p chose from, top_p) when top-p ran: what is kept of them must still reach top_p
    fragile: a decision within float32 rounding of its threshold (such cases are not drawn)
    rtol:  the tolerance on the kept tokens' probabilities"""
    keep: frozenset
    x: dict
    free: frozenset = frozenset()
    reach: tuple | None = None
    fragile: bool = False
    rtol: float = 1e-4


def _softmax(x: dict) -> dict:
    top = max(x.values())
    w = {i: math.exp(v - top) for i, v in x.items()}
    z = sum(w.values())
    return {i: v / z for i, v in w.items()}


def reference_row(logits: list[float], temperature: float, top_k: int, top_p: float, min_p: float) -> Expected:
    """One row by the definitions, in float64 Python (logits: a list of floats)."""
    V = len(logits)
    x = {i: float(v) / temperature for i, v in enumerate(logits)}             # 1. temperature
    tempered = dict(x)
    big = max(abs(v) for v in x.values())
    delta = 1e-6 + 2e-7 * big              # how far float32 arithmetic may move a logit / T (in the exponent)
    top = max(x.values())
    free = {i for i, v in x.items() if top - v > NEGLIGIBLE}
    fragile, reach = False, None

    if min_p > 0:                          # 2. min-p: p_i >= min_p * p_top, on the tempered distribution
        ratio = {i: math.exp(v - top) for i, v in x.items()}                  # = p_i / p_top
        fragile |= any(v != top and i not in free and abs(ratio[i] / min_p - 1) < 4 * delta for i, v in x.items())
        x = {i: v for i, v in x.items() if ratio[i] >= min_p}

    if 0 < top_k < V:                      # 3. top-k: every token at least as likely as the k-th (ties stay)
        ranked = sorted(x.values(), reverse=True)
        kth = ranked[min(top_k, len(ranked)) - 1]
        fragile |= any(v != kth and i not in free and abs(v - kth) < 4 * delta for i, v in x.items())
        x = {i: v for i, v in x.items() if v >= kth}

    if top_p < 1:                          # 4. top-p: walk from the most likely, stop once the mass reaches top_p
        p = _softmax(x)
        reach = (frozenset(x), top_p)
        margin = 4 * (delta + V * 1e-7)
        kept, mass = [], 0.0
        for i in sorted(x, key=lambda i: -x[i]):
            if i not in free and abs(mass - top_p) < margin:
                fragile = True
            if mass >= top_p:
                break
            kept.append(i)
            mass += p[i]
        last = x[kept[-1]]
        ties = {i for i, v in x.items() if v == last}
        if ties - set(kept):               # tied tokens on both sides of the cut: which of them stay is arbitrary
            free |= ties
        x = {i: x[i] for i in kept}

    return Expected(frozenset(x), tempered, frozenset(free), reach, fragile, 1e-5 + 10 * delta)


def reference_process_logits(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                             min_p: torch.Tensor) -> list:
    """The oracle for a batch: one Expected per row, each with its own settings."""
    return [reference_row(logits[i].tolist(), float(temperature[i]), int(top_k[i]), float(top_p[i]),
                          float(min_p[i])) for i in range(logits.shape[0])]


# --------------------------------------------------------------------------- lab06_1 known mistakes

def _mistaken_row(logits: list[float], T: float, k: int, p: float, m: float, mistake: str) -> Expected:
    """One row done wrong in a known way (for diagnosis only)."""
    V = len(logits)
    raw = {i: float(v) for i, v in enumerate(logits)}
    x = {i: v / T for i, v in raw.items()}
    if mistake == "no_temperature":
        x = dict(raw)
    elif mistake == "multiply":
        x = {i: v * T for i, v in raw.items()}
    judge = raw if mistake == "raw" else x              # what the truncations look at
    alive = set(x)

    def softmax_of(ids: Iterable[int]) -> dict:
        return _softmax({i: judge[i] for i in ids})

    def min_p_step(ids: set[int]) -> set[int]:
        if m <= 0:
            return ids
        if mistake == "min_p_on_logits":
            best = max(judge[i] for i in ids)
            return {i for i in ids if judge[i] >= m * best}
        best = max(judge[i] for i in ids)
        return {i for i in ids if math.exp(judge[i] - best) >= m}

    free = set()

    def top_k_step(ids: set[int]) -> set[int]:
        kk = k
        if kk <= 0 and mistake == "k_zero_keeps_none":
            return set()
        if not 0 < kk < V:
            if mistake != "k_minus_one_everywhere":
                return ids
            kk = V
        kk = {"k_minus_one": kk - 1, "k_minus_one_everywhere": kk - 1, "k_plus_one": kk + 1}.get(mistake, kk)
        ranked = sorted(ids, key=lambda i: (-judge[i], i))
        if kk <= 0:
            return set()
        kth = judge[ranked[min(kk, len(ranked)) - 1]]
        if mistake == "k_no_ties":         # exactly k: which of the tokens tied at the k-th value is arbitrary
            free.update(i for i in ids if judge[i] == kth)
            return set(ranked[:kk])
        return {i for i in ids if judge[i] >= kth}

    def top_p_step(ids: set[int], mass_over: set[int]) -> set[int]:
        if p >= 1 or not ids:
            return ids
        probs = softmax_of(mass_over)
        kept, mass = [], 0.0
        for i in sorted(ids, key=lambda i: -judge[i]):
            if mistake in ("drops_crossing", "drops_crossing_keeps_one"):
                if mass + probs[i] > p and not (mistake == "drops_crossing_keeps_one" and not kept):
                    break
            elif mass >= p:
                break
            kept.append(i)
            mass += probs[i]
        return set(kept)

    if mistake == "min_p_last":
        alive = top_k_step(alive)
        alive = top_p_step(alive, alive)
        alive = min_p_step(alive)
    else:
        alive = min_p_step(alive)
        alive = top_k_step(alive)
        alive = top_p_step(alive, set(x) if mistake == "top_p_full_mass" else alive)
    return Expected(frozenset(alive), x, frozenset(free))


_PROCESS_MISTAKES = [
    ("top-p must keep the token that crosses top_p: keep a token while the mass of the tokens strictly more likely "
     "than it is still below top_p (the smallest set whose mass REACHES p includes the token that gets it there)",
     "drops_crossing"),
    ("top-p must keep the token that crosses top_p: keep a token while the mass of the tokens strictly more likely "
     "than it is still below top_p (the smallest set whose mass REACHES p includes the token that gets it there)",
     "drops_crossing_keeps_one"),
    ("every row has its own settings: row i uses temperature[i], top_k[i], top_p[i] and min_p[i] (you applied one "
     "row's settings to the whole batch)", "row0"),
    ("apply the temperature first: min-p and top-p must look at the distribution of logits / T, not of the raw "
     "logits (vLLM's order: temperature -> min-p -> top-k -> top-p)", "raw"),
    ("divide the logits by the temperature (logits / T: T < 1 sharpens, T > 1 flattens)", "multiply"),
    ("divide each row's logits by its temperature", "no_temperature"),
    ("min-p compares probabilities, not logits: drop token i when p_i < min_p * p_top (equivalently "
     "logit_i / T < max_j logit_j / T + log(min_p))", "min_p_on_logits"),
    ("top-k keeps k tokens: you keep k - 1 (an off-by-one on the k-th largest value)", "k_minus_one"),
    ("top-k keeps k tokens: you keep k - 1 (an off-by-one on the k-th largest value)", "k_minus_one_everywhere"),
    ("top-k keeps k tokens: you keep k + 1 (an off-by-one on the k-th largest value)", "k_plus_one"),
    ("tokens tied with the k-th largest logit all stay (keep every token whose logit >= the k-th largest value), "
     "so top-k may keep more than k tokens", "k_no_ties"),
    ("top_k <= 0 (0 or -1) means top-k is off: keep every token, not none", "k_zero_keeps_none"),
    ("top-p measures mass over what min-p and top-k left, renormalized (softmax of the surviving logits), not over "
     "the full distribution", "top_p_full_mass"),
    ("apply min-p before top-k and top-p (vLLM's order: temperature -> min-p -> top-k -> top-p): top-p measures "
     "the mass of what min-p left", "min_p_last"),
]


def _mistaken(case: tuple, mistake: str) -> Callable[[torch.Tensor], bool]:
    """A predicate: does a result (float64 [B, V]) match this mistake on `case`?"""
    logits, T, K, P, M = _lists(case)
    if mistake == "row0":
        expected = [reference_row(row, T[0], K[0], P[0], M[0]) for row in logits]
    else:
        expected = [_mistaken_row(row, T[i], K[i], P[i], M[i], mistake) for i, row in enumerate(logits)]
    return lambda out: _mismatch(out, expected) is None


# --------------------------------------------------------------------------- lab06_1 cases

def _lists(case: tuple) -> tuple:
    """A case -> (logits rows, temperatures, top_ks, top_ps, min_ps) as plain Python values (float32-exact)."""
    if case[0] == "rows":
        _, logits, T, K, P, M = case
        x = torch.tensor(logits, dtype=torch.float32)
    else:
        _, seed, V, scale, ties, offsets, T, K, P, M = case
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(len(T), V, generator=g) * scale
        if ties:
            x = torch.round(x)                         # a coarse grid: many exactly equal logits
        x = x + torch.tensor(offsets, dtype=torch.float32)[:, None]
    f32 = lambda vs: torch.tensor(vs, dtype=torch.float32).tolist()  # noqa: E731
    return x.tolist(), f32(T), [int(k) for k in K], f32(P), f32(M)


def _tensors(case: tuple) -> tuple[torch.Tensor, ...]:
    logits, T, K, P, M = _lists(case)
    return (torch.tensor(logits, dtype=torch.float32), torch.tensor(T, dtype=torch.float32),
            torch.tensor(K, dtype=torch.int64), torch.tensor(P, dtype=torch.float32),
            torch.tensor(M, dtype=torch.float32))


@st.composite
def _process_cases(draw: st.DrawFn) -> tuple:
    B = draw(st.integers(1, 5))
    V = draw(st.sampled_from([3, 2, 8, 33, 64, 300]))
    seed = draw(st.integers(0, 2**31 - 1))
    scale = draw(st.sampled_from([1.0, 0.3, 3.0, 8.0]))
    ties = draw(st.booleans())
    offsets = [draw(st.sampled_from([0.0, 0.0, 0.0, -1000.0, 90.0])) for _ in range(B)]
    T = [draw(st.sampled_from([1.0, 0.7, 0.3, 1.5, 4.0, 0.05]) | st.floats(0.05, 5.0)) for _ in range(B)]
    K = [draw(st.sampled_from([0, 0, -1, 1, 2, 3, 5, V - 1, V, V + 7]) | st.integers(0, V + 2)) for _ in range(B)]
    P = [draw(st.sampled_from([1.0, 1.0, 0.9, 0.95, 0.6, 0.3, 0.05]) | st.floats(0.01, 1.0))
         for _ in range(B)]
    M = [draw(st.sampled_from([0.0, 0.0, 0.0, 0.05, 0.1, 0.5, 1.0]) | st.floats(0.0, 1.0))
         for _ in range(B)]
    return ("seeded", seed, V, scale, ties, offsets, T, K, P, M)


# Hand-picked cases for the known traps (they also serve as the diagnosis probes).
_LN = lambda *ps: [3 + math.log(p) for p in ps]  # noqa: E731   (logits of these probabilities, all positive)
_CASE_CROSSING = ("rows", [_LN(0.5, 0.3, 0.2)], [1.0], [0], [0.6], [0.0])
_CASE_TEMPERATURE_FIRST = ("rows", [[2.0, 1.0, 0.0, -1.0], [2.0, 1.0, 0.0, -1.0]], [0.5, 2.0], [0, 0], [0.8, 1.0],
                           [0.0, 0.5])
_CASE_PER_ROW = ("rows", [[1.5, 1.0, 0.2, -0.3, -1.0]] * 4, [1.0, 1.0, 1.0, 0.5], [0, 1, 0, 0], [1.0, 1.0, 0.5, 1.0],
                 [0.0, 0.0, 0.0, 0.3])
_CASE_MIN_P = ("rows", [[3.0, 2.5, 1.0, 0.5]], [1.0], [0], [1.0], [0.1])
_CASE_TOP_K = ("rows", [[3.0, 2.0, 2.0, 1.0, 0.0]] * 5, [1.0] * 5, [2, 0, -1, 5, 1], [1.0] * 5, [0.0] * 5)
_CASE_TOP_P_AFTER_TOP_K = ("rows", [_LN(0.45, 0.3, 0.25)], [1.0], [2], [0.5], [0.0])
_CASE_MIN_P_BEFORE_TOP_P = ("rows", [_LN(0.4, 0.22, 0.16, 0.13, 0.09)], [1.0], [0], [0.6], [0.5])
_CASE_MAGNITUDES = ("rows", [[-1000.0, -1001.0, -1002.5, -1000.7], [90.0, 89.0, 87.5, 89.3]], [0.3, 0.3], [0, 3],
                    [0.9, 0.95], [0.05, 0.0])
_CASE_MIXED = ("seeded", 1, 12, 2.0, False, [0.0] * 4, [0.7, 1.5, 0.5, 1.0], [0, 3, 0, 5], [0.8, 1.0, 1.0, 0.6],
               [0.0, 0.0, 0.2, 0.05])
_PROBES = [_CASE_CROSSING, _CASE_TEMPERATURE_FIRST, _CASE_PER_ROW, _CASE_MIN_P, _CASE_TOP_K, _CASE_TOP_P_AFTER_TOP_K,
           _CASE_MIN_P_BEFORE_TOP_P, _CASE_MIXED]


# --------------------------------------------------------------------------- lab06_1 comparing

def _ids(s: Iterable[int], limit: int = 10) -> str:
    s = sorted(s)
    return "[" + ", ".join(map(str, s[:limit])) + (f", ... ({len(s)} tokens)" if len(s) > limit else "") + "]"


def _read_result(out: Any, B: int, V: int) -> torch.Tensor:
    """The learner's result as a float64 tensor, after the checks of its form."""
    __tracebackhide__ = True
    t = as_tensor(out, "process_logits's result")
    check(tuple(t.shape) == (B, V), f"process_logits must return a tensor of shape [B, V] = [{B}, {V}] (the logits "
                                    f"of every row), got shape {list(t.shape)}")
    check(t.dtype in (torch.float32, torch.float64),
          f"process_logits must return float32 logits (like its input), got {t.dtype}")
    return t.double()


def _mismatch(t: torch.Tensor, expected: list, settings: tuple | None = None) -> str | None:
    """None when every row of t (float64 [B, V]) keeps what `expected` keeps with the same distribution."""
    for i, e in enumerate(expected):
        row = t[i]
        where = f"row {i}"
        if settings is not None:
            T, K, P, M = settings
            where += f" (temperature={T[i]:g}, top_k={K[i]}, top_p={P[i]:g}, min_p={M[i]:g})"
        if bool(torch.isnan(row).any()):
            return f"{where} contains NaN"
        if bool((row == float("inf")).any()):
            return f"{where} contains +inf"
        kept = frozenset(torch.isfinite(row).nonzero().flatten().tolist())
        if not kept:
            if not e.keep:                 # only a mistaken variant expects this
                continue
            return f"{where}: every token was dropped (all -inf); at least the most likely token always stays"
        if (kept ^ e.keep) - e.free:
            extra, missing = sorted((kept - e.keep) - e.free), sorted((e.keep - kept) - e.free)
            what = "; ".join(s for s in (f"keeps {_ids(extra)} that should be dropped" if extra else "",
                                         f"drops {_ids(missing)} that should stay" if missing else "") if s)
            return f"{where} keeps tokens {_ids(kept)}, expected {_ids(e.keep)}: it {what}"
        if e.reach is not None and e.keep - kept:
            pool, top_p = e.reach
            p = _softmax({j: e.x[j] for j in pool})
            mass = sum(p[j] for j in kept & pool)
            if mass < top_p - 1e-4:
                return (f"{where} keeps tokens {_ids(kept)} whose mass {mass:.6g} does not reach top_p: of tokens "
                        f"tied at the cut, keep as many as it takes to reach top_p")
        want = _softmax({j: e.x[j] for j in kept})
        probs = torch.softmax(row, -1)
        for j in sorted(kept):
            got = float(probs[j])
            if abs(got - want[j]) > 1e-7 + e.rtol * want[j]:
                return (f"{where} keeps the right tokens but softmax(result) gives token {j} probability {got:.6g}, "
                        f"expected {want[j]:.6g} (softmax of logits / T over the kept tokens)")
    return None


def _settings(case: tuple) -> tuple:
    _, T, K, P, M = _lists(case)
    return T, K, P, M


def _call_process(fn: Callable[..., Any], case: tuple) -> torch.Tensor:
    """Call the learner's function on fresh tensors of the case; its result as float64 (form checked)."""
    logits, *rest = _tensors(case)
    return _read_result(fn(logits.clone(), *[r.clone() for r in rest]), *logits.shape)


def _diagnose_process(fn: Callable[..., Any], case: tuple) -> str | None:
    def learner(c: tuple) -> torch.Tensor | None:
        try:
            return _call_process(fn, c)
        except GradingError:
            return None

    variants = [(why, (lambda m: lambda c: _mistaken(c, m))(m)) for why, m in _PROCESS_MISTAKES]
    return diagnose(learner, variants, [(case,)] + [(p,) for p in _PROBES],
                    lambda out, matches: out is not None and matches(out))


def _shift_mistake(fn: Callable[..., Any], case: tuple) -> str | None:
    """Logits in the hundreds or thousands: does the answer become right once each row is shifted to max 0?"""
    logits, T, K, P, M = _lists(case)
    if max(abs(v) for row in logits for v in row) < 40:
        return None
    shifted = ("rows", [[v - max(row) for v in row] for row in logits], T, K, P, M)
    expected = reference_process_logits(*_tensors(shifted))
    try:
        ok = not any(e.fragile for e in expected) and _mismatch(_call_process(fn, shifted), expected) is None
    except Exception:  # noqa: BLE001
        return None
    if ok:
        return ("your answer is right once each row's logits are shifted to a maximum of 0, but adding a constant to a "
                "row must change nothing: with logits this large, exp() overflows (or underflows to 0/0) — subtract "
                "each row's maximum before exp, or use torch.softmax / log_softmax, which do")
    return None


def _form_mistake(t: torch.Tensor, expected: list) -> str | None:
    """Returned probabilities (dropped tokens as 0 or as -inf), or a big negative number instead of -inf."""
    finite = torch.isfinite(t)
    values = t[finite]
    sums = t.masked_fill(~finite, 0.0).sum(-1)
    if (bool((finite.sum(-1) >= 2).any()) and bool(((values >= 0) & (values <= 1)).all())
            and bool(((sums - 1).abs() < 1e-3).all())):
        return ("you returned probabilities: return LOGITS, with -inf for every dropped token (the Sampler applies "
                "the softmax itself, and -inf is how a dropped token is told apart)")
    if not bool(finite.all()):
        return None
    should_drop = [(i, j) for i, e in enumerate(expected) for j in range(t.shape[1])
                   if j not in e.keep and j not in e.free]
    if not should_drop:
        return None
    vals = [float(t[i, j]) for i, j in should_drop]
    if max(vals) < -1e4:
        return (f"dropped tokens must be exactly -inf, got {min(vals):g} (e.g. row {should_drop[0][0]}, token "
                f"{should_drop[0][1]}): use float('-inf') in masked_fill, not a large negative number")
    return None


def verify_lab06_1(process_logits: Callable[..., Any]) -> None:
    @given(case=_process_cases())
    @example(case=_CASE_CROSSING)                 # top-p keeps the crossing token
    @example(case=_CASE_TEMPERATURE_FIRST)        # temperature before min-p / top-p
    @example(case=_CASE_PER_ROW)                  # each row its own settings
    @example(case=_CASE_MIN_P)                    # min-p on probabilities, not logits
    @example(case=_CASE_TOP_K)                    # ties at the k-th value; 0 / -1 / V mean off; k = 1
    @example(case=_CASE_TOP_P_AFTER_TOP_K)        # top-p over what top-k left, renormalized
    @example(case=_CASE_MIN_P_BEFORE_TOP_P)       # min-p before top-p
    @example(case=_CASE_MAGNITUDES)               # logits around -1000 and +90, T = 0.3: exp() must not overflow
    @example(case=_CASE_MIXED)
    def prop(case: tuple) -> None:
        logits, T, K, P, M = _tensors(case)
        expected = reference_process_logits(logits, T, K, P, M)
        assume(not any(e.fragile for e in expected))
        out = process_logits(logits.clone(), T.clone(), K.clone(), P.clone(), M.clone())
        t = _read_result(out, *logits.shape)
        why = _mismatch(t, expected, _settings(case))
        if why is None:
            return
        form = _form_mistake(t, expected)
        if form:
            fail(f"{why} — {form}")
        if "NaN" in why or "+inf" in why:
            fail(f"{why}: exp() of large logits overflows (and -inf - (-inf) is NaN) — subtract each row's "
                 "maximum before exp, or use torch.softmax / log_softmax, which do")
        diagnosis = _shift_mistake(process_logits, case) or _diagnose_process(process_logits, case)
        fail(why + (f" — {diagnosis}" if diagnosis else ""))

    run_property(prop, max_examples=120, hint=Hint(
        "each row is processed with its own settings, one rule after the other: temperature, then min-p, top-k and "
        "top-p; a dropped token becomes -inf.",
        "min-p compares each probability with min_p × the top one; top-k keeps the k largest (k <= 0 or >= V: off); "
        "top-p keeps the likeliest tokens until their mass reaches top_p, the one that crosses it included (top_p "
        "= 1: off). Settings shaped [B, 1] broadcast per row.",
        "per row: x = logits / T; min-p drops p_i < min_p * max p; top-k drops logits below the k-th largest; top-p "
        "sorts what is left, takes its softmax and keeps a token while the mass strictly before it is < top_p; "
        "dropped tokens = -inf. Work on [B, 1] columns (temperature[:, None], ...)."))
    _inside_the_sampler(process_logits)


def _inside_the_sampler(process_logits: Callable[..., Any]) -> None:
    """The function as minillm's Sampler calls it (its ProcessFn seam): only the sampled rows, columns it builds
    from SamplingParams (top_k = -1 included); greedy rows never reach it."""
    __tracebackhide__ = True
    params = [SamplingParams(temperature=0.8, top_p=0.9), SamplingParams(temperature=0),
              SamplingParams(temperature=1.3, top_k=-1, min_p=0.05), SamplingParams(temperature=0.5, top_k=4)]
    logits = torch.randn(4, 40, generator=torch.Generator().manual_seed(6)) * 3
    batch = SamplingBatch(params, [None] * 4, [[]] * 4, [[]] * 4)
    try:
        probs = Sampler(process_fn=process_logits).probs(logits.clone(), batch)
    except (GradingError, NotImplementedError):
        raise
    except Exception as e:  # noqa: BLE001
        fail(f"inside minillm's Sampler (Sampler(process_fn=process_logits).probs), your process_logits raised "
             f"{type(e).__name__}: {e}", "it receives logits [n, V] float32 for the n sampled rows, temperature, "
                                         "top_p and min_p float32 [n], top_k int64 [n] (0 or -1 when off).")
    for i, p in enumerate(params):
        if p.greedy:
            continue
        e = reference_row(logits[i].tolist(), p.temperature, p.top_k, p.top_p, p.min_p)
        dist = _softmax({j: e.x[j] for j in e.keep})
        for j in range(logits.shape[1]):
            want = dist.get(j, 0.0)
            check(abs(float(probs[i, j]) - want) <= 1e-6 + 1e-4 * want,
                  f"inside minillm's Sampler, row {i} ({p.temperature=}, {p.top_k=}, {p.top_p=}, {p.min_p=}) gets "
                  f"probability {float(probs[i, j]):.6g} for token {j}, expected {want:.6g}")


# --------------------------------------------------------------------------- lab06_2 the draw

def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _draw(draw: Callable[..., Any], probs: torch.Tensor, generators: list, what: str = "draw's result") -> torch.Tensor:
    """Call the learner's draw; its tokens after the checks of their form."""
    __tracebackhide__ = True
    B, V = probs.shape
    t = as_tensor(draw(probs.clone(), list(generators)), what)
    if tuple(t.shape) != (B,):
        hint = (" — torch.multinomial returns [B, 1] (one column per sample): take [:, 0]"
                if tuple(t.shape) == (B, 1) else "")
        fail(f"draw must return one token id per row, a tensor of shape [{B}], got shape {list(t.shape)}{hint}")
    check(t.dtype == torch.int64, f"draw must return token ids as an int64 (torch.long) tensor, got {t.dtype}")
    bad = ((t < 0) | (t >= V)).nonzero().flatten().tolist()
    if bad:
        tok = int(t[bad[0]])
        why = (" — one past the last id: an index + 1, or an inverse CDF whose random number reached the last "
               "cumulative sum (a float32 cumsum may end a little below 1: scale u by the total, or clamp)"
               if tok == V else
               " — one before the first id: an index - 1 (the first j with cumsum[j] > u is the token itself)"
               if tok == -1 else "")
        fail(f"draw returned token id {tok} for row {bad[0]}: ids must be in [0, V) = [0, {V}){why}")
    return t


def _one_hot_rows(draw: Callable[..., Any]) -> None:
    """A row whose probability is all on one token must give that token, first and last ids included."""
    V, hot = 9, [0, 8, 4, 4, 2, 7, 1]
    probs = torch.zeros(len(hot), V)
    probs[torch.arange(len(hot)), torch.tensor(hot)] = 1.0
    gens = [_gen(11), None, _gen(12), None, _gen(13), _gen(14), None]
    got = _draw(draw, probs, gens).tolist()
    if got == hot:
        return
    i = next(i for i, (a, b) in enumerate(zip(got, hot)) if a != b)
    why = ""
    if all(g == h + 1 for g, h in zip(got, hot) if h + 1 < V):
        why = (" — you return the token AFTER the one your draw lands on (an index + 1, or searchsorted over a "
               "CDF that starts with a 0)")
    elif all(g == h - 1 for g, h in zip(got, hot) if h > 0):
        why = " — you return the token BEFORE the one your draw lands on (an index - 1)"
    fail(f"row {i} has all its probability on token {hot[i]} (probs = one-hot, V = {V}), but draw returned "
         f"token {got[i]}; all rows: expected {hot}, got {got}{why}",
         "draw token j with probability probs[i, j]: torch.multinomial(probs[i], 1, generator=generators[i]), or an "
         "inverse CDF: the first j with cumsum[j] > u * total.")


def _distributions(V: int = 50) -> torch.Tensor:
    """The four distributions the counts are tested against (float32 rows, as softmax makes them)."""
    d = torch.zeros(4, V)
    d[0, :5] = torch.tensor([0.4, 0.3, 0.2, 0.07, 0.03])
    d[1, 1], d[1, 3], d[1, V - 1] = 0.5, 0.25, 0.25                # zeros in between, the last id likely
    g = _gen(2024)
    d[2] = (torch.randn(V, generator=g) * 1.5).softmax(-1)
    x = torch.randn(V, generator=g) * 3
    d[3] = x.masked_fill(x < x.topk(10).values[-1], NEG_INF).softmax(-1)    # what top-k leaves: 10 tokens
    return d


ROWS_PER_KIND = 256       # rows per distribution and kind of generator (seeded / None) in each call
CALLS = 12                # calls with the same (persistent) generators: 256 x 12 = 3,072 draws per cell
P_MIN = 1e-6              # every chi-square p-value must exceed this


def _counts_check(draw: Callable[..., Any]) -> None:
    """Pearson chi-square of the counts against probs, seeded rows (one generator per row, persistent across calls)
    and unseeded rows (torch's global generator, seeded here) tested apart."""
    dists = _distributions()
    n = len(dists)
    V = dists.shape[1]
    # rows: for each distribution ROWS_PER_KIND seeded then ROWS_PER_KIND unseeded, interleaved across distributions
    which = torch.arange(n).repeat_interleave(2 * ROWS_PER_KIND)
    seeded = torch.arange(2 * ROWS_PER_KIND).repeat(n) < ROWS_PER_KIND
    order = torch.randperm(len(which), generator=_gen(7))           # rows of one kind are not adjacent
    which, seeded = which[order], seeded[order]
    probs = dists[which]
    gens = [_gen(10_000 + i) if bool(s) else None for i, s in enumerate(seeded)]
    torch.manual_seed(1234)
    draws = torch.stack([_draw(draw, probs, gens) for _ in range(CALLS)])          # [CALLS, rows]
    for d in range(n):
        for kind, mask in (("seeded", seeded), ("unseeded (generator None)", ~seeded)):
            rows = (which == d) & mask
            toks = draws[:, rows].flatten()
            counts = torch.bincount(toks, minlength=V)
            p = dists[d].double()
            zero = ((p == 0) & (counts > 0)).nonzero().flatten().tolist()
            if zero:
                fail(f"draw returned token {zero[0]} {int(counts[zero[0]])} times out of {len(toks)} for "
                     f"{kind} rows of a distribution that gives it probability 0 "
                     f"(support {(p > 0).nonzero().flatten().tolist()[:12]})" + _count_why(counts, p, draws, rows,
                                                                                      seeded, probs),
                     "a token of probability 0 (dropped by top-k / top-p) must never come out.")
            test = chi_square(counts, p)
            if test.p_value <= P_MIN:
                top = p.argsort(descending=True)[:5].tolist()
                shown = ", ".join(f"{j}: {float(p[j]) * len(toks):.0f} vs {int(counts[j])}" for j in top)
                fail(f"the tokens draw returns do not follow probs: for {kind} rows of distribution {d} "
                     f"({len(toks)} draws, seeds fixed), Pearson chi-square = {test.statistic:.1f} with {test.dof} "
                     f"degrees of freedom, p = {test.p_value:.2g} (must be > {P_MIN:g}); expected vs observed "
                     f"counts of the likeliest tokens: {shown}" + _count_why(counts, p, draws, rows, seeded, probs),
                     "draw token j of row i with probability probs[i, j] exactly (probs are already normalized: no "
                     "softmax, no power), a fresh random number for every row and every call.")


def _count_why(counts: torch.Tensor, p: torch.Tensor, draws: torch.Tensor, rows: torch.Tensor, seeded: torch.Tensor,
               probs: torch.Tensor) -> str:
    """Name the known mistake behind counts that do not follow p (empty when none fits)."""
    toks = draws[:, rows]
    if bool((toks == probs[rows].argmax(-1)[None]).all()):
        return " — every draw is the most likely token: that is argmax (greedy), not sampling"
    fits = lambda q: chi_square(counts, q / q.sum()).p_value > 1e-3   # noqa: E731
    if fits(p ** 2):
        return " — the counts follow probs squared (p_j^2 / sum): draw from probs itself"
    if fits(p.exp()):
        return " — the counts follow softmax(probs): probs are probabilities already, don't apply softmax again"
    # an index shifted by one and clamped back into [0, V): token j comes out as j + 1 (the last id keeps its own
    # mass and gets the one before it), or as j - 1 (token 0 gets its own mass and token 1's)
    shifted_up, shifted_down = torch.zeros_like(p), torch.zeros_like(p)
    shifted_up[1:], shifted_down[:-1] = p[:-1], p[1:]
    shifted_up[-1] += p[-1]
    shifted_down[0] += p[0]
    if not torch.equal(shifted_up, p) and fits(shifted_up):
        return (" — you return the token AFTER the one your draw lands on (an index + 1, or searchsorted over a "
                "CDF that starts with a 0)")
    if not torch.equal(shifted_down, p) and fits(shifted_down):
        return " — you return the token BEFORE the one your draw lands on (an index - 1)"
    seeded_rows = rows & seeded
    if bool(seeded_rows.any()):
        per_row = draws[:, seeded_rows]
        if float((per_row == per_row[0:1]).all(0).float().mean()) > 0.9:
            return (" — a seeded row gives the same token on every call: its generator must advance (draw FROM "
                    "generators[i]; don't make a new generator from its seed each time)")
    return ""


def _row_tokens(draw: Callable, probs: torch.Tensor, gens: list, calls: int, global_seed: int) -> torch.Tensor:
    """[calls, B] tokens over successive calls with the same generators, after seeding torch's global RNG."""
    torch.manual_seed(global_seed)
    return torch.stack([_draw(draw, probs, gens) for _ in range(calls)])


@st.composite
def _draw_rows(draw: st.DrawFn, max_rows: int = 5) -> tuple[torch.Tensor, list]:
    V = draw(st.sampled_from([2, 5, 50, 1000]))
    B = draw(st.integers(1, max_rows))
    seed = draw(st.integers(0, 2**31 - 1))
    g = _gen(seed)
    x = torch.randn(B, V, generator=g) * draw(st.sampled_from([1.0, 3.0, 0.3]))
    if draw(st.booleans()):                                          # some zeros, as top-k / top-p leave them
        keep = torch.rand(B, V, generator=g) < 0.5
        keep[torch.arange(B), x.argmax(-1)] = True
        x = x.masked_fill(~keep, NEG_INF)
    seeds = draw(st.lists(st.none() | st.integers(0, 2**40), min_size=B, max_size=B))
    return x.softmax(-1), seeds


# Masses a chi-square over the whole distribution cannot see: a few draws in thousands. Each case puts a known
# mass on a set of tokens; the count of draws that land there is Binomial(N, mass), and it must not fall more than
# MASS_SIGMAS standard deviations below N * mass (a one-sided z-test; seeds are fixed, so the verdict is too; a
# correct draw falls that low with probability < 1e-9, a draw that never picks the set is 10+ sigmas below).
MASS_SIGMAS = 6.0


def _mass_cases() -> list:
    """(what a sampler that misses the set does, probs [V], the token set, rows per call, calls)."""
    peaked = torch.full((8,), 0.04 / 7)
    peaked[0] = 0.96
    tail = torch.full((10_001,), 0.25 / 10_000)         # 10,000 tokens of 2.5e-5 each: a quarter of the mass
    tail[0] = 0.75
    return [("draws the argmax when one token holds 96% (the other 4% is drawn too: 1 time in 25)", peaked,
             torch.arange(1, 8), 500, 5),
            ("drops tokens below a probability threshold (10,000 tokens of 2.5e-5 each hold 25% of the mass)", tail,
             torch.arange(1, 10_001), 500, 5)]


def _mass_checks(draw: Callable[..., Any]) -> None:
    for why, p, members, rows, calls in _mass_cases():
        probs = p.expand(rows, -1).contiguous()
        gens = [_gen(20_000 + i) for i in range(rows)]
        toks = torch.cat([_draw(draw, probs, gens) for _ in range(calls)])
        n, mass = len(toks), float(p[members].double().sum())
        hit = int(torch.isin(toks, members).sum())
        expect, sigma = n * mass, (n * mass * (1 - mass)) ** 0.5
        if hit < expect - MASS_SIGMAS * sigma:
            fail(f"draw picked tokens {int(members[0])}..{int(members[-1])} {hit} times in {n} draws of probs "
                 f"[{rows}, {p.numel()}] whose mass there is {mass:g} (expected about {expect:.0f} ± {sigma:.0f}): a "
                 f"sampler that {why}",
                 "every token comes out with exactly its probability, however small it is and however peaked the "
                 "row: no shortcut to the argmax, no threshold.")


# Chosen random numbers. A bias that lives in a sliver of the mass (greedy once a row is peaked, a threshold that
# drops tiny tokens, a float16 CDF that cannot add 1e-6 to 0.9996, the wrong side of a cumulative edge) shows in a
# few draws in a million: no count test sees it. So the checker picks the generators' states. torch's random
# functions are deterministic given a generator's state, so for the usual ways of consuming it (below) it can tell,
# before calling draw, which token a draw that follows probs returns. On ordinary rows it first finds which of them
# the learner's draw follows token for token (none: these checks are skipped; the counts above still apply); then it
# searches seeds whose random numbers land that way in the sliver, and the learner's draw must land there too.
def inverse_cdf(p: torch.Tensor, u: float) -> tuple[int, float]:
    """(token, distance of u * total from its interval's edges) for an inverse CDF in float64."""
    cdf = p.double().cumsum(0)
    x = u * float(cdf[-1])
    j = min(int(torch.searchsorted(cdf, torch.tensor([x], dtype=torch.float64), right=True)), p.numel() - 1)
    lo = float(cdf[j - 1]) if j else 0.0
    return j, min(x - lo, float(cdf[j]) - x)


_CONSUMPTIONS = {
    "an inverse CDF on one float32 uniform (torch.rand(1, generator=generators[i]))":
        lambda p, g: inverse_cdf(p, float(torch.rand((), generator=g))),
    "an inverse CDF on one float64 uniform (torch.rand(1, generator=generators[i], dtype=torch.float64))":
        lambda p, g: inverse_cdf(p, float(torch.rand((), generator=g, dtype=torch.float64))),
    "torch.multinomial(probs[i], 1, generator=generators[i])":
        lambda p, g: (int(torch.multinomial(p, 1, generator=g)[0]), float("inf")),
}
_MARGIN = 1e-4            # calibration rows: the uniform is this far from its token's edges (any cumsum agrees)


def _consumption(draw: Callable[..., Any]) -> str | None:
    """Which known way of consuming generators[i] the learner's draw follows on ordinary rows (None: none)."""
    g = _gen(31)
    probs = (torch.randn(8, 16, generator=g) * 1.5).softmax(-1)
    seeds, s = [], 500
    for row in probs:                      # seeds whose uniforms sit well inside a token (float32 or 64)
        while any(m < _MARGIN for f in list(_CONSUMPTIONS.values())[:2] for _, m in [f(row, _gen(s))]):
            s += 1
        seeds.append(s)
        s += 1
    got = _draw(draw, probs, [_gen(x) for x in seeds]).tolist()
    for name, f in _CONSUMPTIONS.items():
        if got == [f(row, _gen(x))[0] for row, x in zip(probs, seeds)]:
            return name
    return None


def _sliver_row() -> tuple[torch.Tensor, torch.Tensor]:
    """A peaked row: token 0 holds 0.9996, then 400 tokens of 1e-6 each (the sliver: 4e-4 of the mass)."""
    p = torch.full((401,), 1e-6)
    p[0] = 1 - 400e-6
    return p, torch.arange(1, 401)


def _chosen_uniforms(draw: Callable[..., Any]) -> None:
    __tracebackhide__ = True
    way = _consumption(draw)
    if way is None:
        return
    f = _CONSUMPTIONS[way]
    p, sliver = _sliver_row()
    seeds, s = [], 40_000
    while len(seeds) < 3:                  # seeds whose draw lands in the sliver, 50 tokens from its ends
        tok, _ = f(p, _gen(s))
        if 50 <= tok <= 350:
            seeds.append(s)
        s += 1
    got = _draw(draw, p.expand(3, -1).contiguous(), [_gen(x) for x in seeds]).tolist()
    for x, t in zip(seeds, got):
        if t not in sliver.tolist():
            fail(f"on ordinary rows your draw follows {way}, token for token; on a peaked row (token 0 holds "
                 f"{float(p[0]):.4f}, tokens 1..400 hold 1e-06 each) with generators[i] seeded {x}, that random "
                 f"number lands among tokens 1..400 (token {f(p, _gen(x))[0]}), but your draw returned token {t} — "
                 "a sampler that is greedy on peaked rows, drops tiny tokens below a threshold, or adds up the CDF "
                 "in float16 / bfloat16 (1e-6 vanishes next to 0.9996) never draws these tokens",
                 Hint("every token comes out with exactly its probability, however small it is and however peaked "
                      "the row: no shortcut to the argmax, no threshold, no low precision.",
                      "sum probabilities in float32 or float64 (float16 has 11 bits: 0.9996 + 1e-6 = 0.9996), "
                      "and take no branch on the row's shape."))
    if not way.startswith("an inverse CDF on one float32"):
        return
    # a cumulative edge exactly on the uniform: token j owns u in [cdf[j-1], cdf[j]), so u == cdf[0] is token 2
    rows, s = [], 60_000
    while len(rows) < 3:
        u = float(torch.rand((), generator=_gen(s)))
        if 0.05 < u < 0.95:
            rows.append((s, u))
        s += 1
    probs = torch.tensor([[u, 0.0, 1.0 - u] for _, u in rows], dtype=torch.float32)
    got = _draw(draw, probs, [_gen(x) for x, _ in rows]).tolist()
    for (x, u), t in zip(rows, got):
        if t != 2:
            fail(f"your draw follows {way}; with generators[i] seeded {x} that uniform is u = {u!r}, and the row "
                 f"probs = [{u!r}, 0.0, {1 - u!r}] has cdf = [{u!r}, {u!r}, 1.0]: u equals cdf[0] exactly, so it "
                 f"belongs to the next token of nonzero probability, token 2, but your draw returned {t} — token j "
                 "owns u in [cdf[j-1], cdf[j]): take the first j with cdf[j] > u (searchsorted(..., right=True), "
                 "`<` not `<=`); the other side gives tokens of probability 0 a chance (u = 0)",
                 "the edge of a cumulative interval belongs to the token after it: float32 uniforms are multiples "
                 "of 2^-24, and such a tie happens.")


def _global_rng_untouched(draw: Callable[..., Any]) -> None:
    """A batch whose rows are all seeded must leave torch's global generator where it was."""
    before = torch.get_rng_state()
    _draw(draw, torch.full((3, 5), 0.2), [_gen(1), _gen(2), _gen(3)])
    check(torch.equal(before, torch.get_rng_state()),
          "every row of the batch had its own generator, yet draw advanced torch's global generator: a seeded row "
          "must take its random numbers from generators[i] only (the unseeded requests' stream must not depend on "
          "the seeded ones)", _INDEPENDENCE_HINT)


def verify_lab06_2(draw: Callable[..., Any]) -> None:
    with torch.random.fork_rng(devices=[]):              # the notebook's global RNG is left as it was
        _counts_check(draw)
        _mass_checks(draw)
        _one_hot_rows(draw)
        _reproducible(draw)
        _independent(draw)
        _inside_the_sampler_draw(draw)
        _global_rng_untouched(draw)
        _chosen_uniforms(draw)


def _reproducible(draw: Callable[..., Any]) -> None:
    @given(rows=_draw_rows(), globals_=st.tuples(st.integers(0, 1000), st.integers(1001, 2000)))
    @example(rows=(torch.full((3, 4), 0.25), [1, 2, 3]), globals_=(0, 1))
    def prop(rows: tuple[torch.Tensor, list], globals_: tuple[int, int]) -> None:
        probs, seeds = rows
        seeds = [s if s is not None else 99 + i for i, s in enumerate(seeds)]     # every row seeded here
        first = _row_tokens(draw, probs, [_gen(s) for s in seeds], 3, globals_[0])
        again = _row_tokens(draw, probs, [_gen(s) for s in seeds], 3, globals_[1])
        if not torch.equal(first, again):
            i = int((first != again).any(0).nonzero()[0])
            fail(f"the same seeds gave different tokens: row {i} (seed {seeds[i]}) drew {first[:, i].tolist()} over "
                 f"3 calls, then {again[:, i].tolist()} with fresh generators of the same seeds (torch's global RNG "
                 "seeded differently in between) — a seeded row must draw from its own generator, generators[i], "
                 "never from torch's global one")

    run_property(prop, max_examples=30, hint=Hint(
        "a seeded row must draw from its own generator only, whatever the other rows or torch's global generator "
        "do.",
        "row i's random numbers must all come from generators[i] (None: torch's global generator), so a row cannot "
        "share one random call with the rest of the batch.",
        "pass generator=generators[i] to every random call for row i (torch.multinomial, torch.rand, "
        "Tensor.exponential_, ...)."))


_INDEPENDENCE_HINT = ("row i must use generators[i] and nothing else: not generators[0] for the whole batch, not one "
                      "torch.multinomial over all rows (that uses a single generator), no more random numbers from "
                      "generators[i] than row i needs, and the global RNG only for rows whose generator is None.")
_SEED = 3                 # the seeded row the fixed situations move around


def _situations() -> list:
    """Where the seeded row (seed _SEED) is put: (description, its batch's generators, its position, global seed).
    The first is the reference: alone. The probs are uniform over 16 tokens (every draw tells something)."""
    S = _SEED
    return [
        ("alone", lambda: [_gen(S)], 0, 0),
        ("alone, torch's global RNG seeded differently", lambda: [_gen(S)], 0, 1),
        ("last of a batch of 3, after rows seeded 11 and 12", lambda: [_gen(11), _gen(12), _gen(S)], 2, 0),
        ("last of a batch of 3, after rows seeded 21 and 22", lambda: [_gen(21), _gen(22), _gen(S)], 2, 0),
        ("between two unseeded rows (generator None)", lambda: [None, _gen(S), None], 1, 0),
        ("first of a batch of 4", lambda: [_gen(S), _gen(11), None, _gen(12)], 0, 0),
    ]


def _seeded_row_tokens(draw: Callable[..., Any], gens: list, at: int, global_seed: int, calls: int = 4) -> list:
    probs = torch.full((len(gens), 16), 1.0 / 16)
    return _row_tokens(draw, probs, gens, calls, global_seed)[:, at].tolist()


def _independent(draw: Callable[..., Any]) -> None:
    """A seeded row's tokens are a function of its generator alone: first in fixed situations, each named (the
    feedback says which change moved the tokens, and so which mistake it is), then in random batches."""
    __tracebackhide__ = True
    seen = [(what, _seeded_row_tokens(draw, make(), at, glob)) for what, make, at, glob in _situations()]
    (_, alone), rest = seen[0], seen[1:]
    for what, tokens in rest:
        if tokens != alone:
            fail(f"a seeded row's tokens depend on the rest of the batch: alone, the row with seed {_SEED} drew "
                 f"{alone} over {len(alone)} calls; {what}, it drew {tokens}" + _independence_why(dict(seen)),
                 _INDEPENDENCE_HINT)

    @given(rows=_draw_rows(max_rows=6), at=st.integers(0, 5), seed=st.integers(0, 2**40),
           globals_=st.tuples(st.integers(0, 1000), st.integers(1001, 2000)))
    @example(rows=(torch.full((2, 6), 1 / 6), [None, None]), at=1, seed=8, globals_=(2, 3))
    def prop(rows: tuple[torch.Tensor, list], at: int, seed: int, globals_: tuple[int, int]) -> None:
        probs, seeds = rows
        at = at % probs.shape[0]
        alone = _row_tokens(draw, probs[at:at + 1], [_gen(seed)], 3, globals_[0])[:, 0]
        gens = [_gen(s) if s is not None else None for s in seeds]
        gens[at] = _gen(seed)
        inside = _row_tokens(draw, probs, gens, 3, globals_[1])[:, at]
        if not torch.equal(alone, inside):
            others = ", ".join("None" if s is None else f"seed {s}" for j, s in enumerate(seeds) if j != at)
            fail(f"a seeded row's tokens depend on the rest of the batch: alone, a row with seed {seed} drew "
                 f"{alone.tolist()} over 3 calls; at position {at} of a batch of {probs.shape[0]} (the other rows' "
                 f"generators: {others or 'none'}; torch's global RNG seeded differently) it drew {inside.tolist()}",
                 _INDEPENDENCE_HINT)

    run_property(prop, max_examples=40)


def _independence_why(seen: dict) -> str:
    """Which change moved a seeded row's tokens, as a known mistake ('' when the pattern fits none)."""
    situations = [what for what, *_ in _situations()]
    alone, global_changed, after_a, after_b = (seen[w] for w in situations[:4])
    if global_changed != alone:
        return (" — seeding torch's global RNG differently changed a seeded row's tokens: it must draw from "
                "generators[i] only")
    if after_a != after_b:
        return (" — the row's tokens changed when only the OTHER rows' generators changed: it is drawn with "
                "another row's generator (generators[0] for the whole batch, or one torch.multinomial over all rows)")
    return (" — the other rows' generators do not matter, but the batch's size or the row's position does: you take "
            "more random numbers from generators[i] than row i needs (e.g. torch.rand(B, V, generator="
            "generators[i])[i]), so how far its generator advances depends on the batch — draw only row i's numbers "
            "from it")


def _inside_the_sampler_draw(draw: Callable[..., Any]) -> None:
    """draw as minillm's Sampler calls it (its DrawFn seam): only the sampled rows, each with its request's
    generator; greedy rows never reach it."""
    __tracebackhide__ = True
    params = [SamplingParams(temperature=1.0, seed=4), SamplingParams(temperature=0),
              SamplingParams(temperature=1.0, top_k=2), SamplingParams(temperature=1.0, seed=9)]
    logits = torch.tensor([[0.0, 1.0, 2.0, NEG_INF], [0.0, 3.0, 1.0, 2.0], [5.0, 4.0, 0.0, 0.0],
                           [NEG_INF, NEG_INF, 0.0, 0.0]])
    sampler = Sampler(process_fn=lambda x, t, k, p, m: x, draw_fn=draw)
    for _ in range(20):
        batch = SamplingBatch(params, [_gen(4), None, None, _gen(9)], [[]] * 4, [[]] * 4)
        try:
            tokens = sampler(logits.clone(), batch).token_ids
        except (GradingError, NotImplementedError):
            raise
        except Exception as e:  # noqa: BLE001
            fail(f"inside minillm's Sampler (Sampler(draw_fn=draw)), your draw raised {type(e).__name__}: {e}",
                 "it receives probs [n, V] float32 for the n sampled rows and a list of n generators (None: torch's "
                 "global one).")
        check(tokens[1] == 1 and tokens[0] in (0, 1, 2) and tokens[3] in (2, 3),
              f"inside minillm's Sampler the batch drew {tokens}; row 0 must be one of 0, 1, 2 (token 3 has "
              f"probability 0), row 1 is greedy (token 1), row 3 one of 2, 3")


# --------------------------------------------------------------------------- the tasks

TASKS = {t.id: t for t in (
    Task("lab06_1", what="process_logits", verify=verify_lab06_1,
         engine=minillm_objects("minillm.sampling.processors:process_logits",
                                "minillm.sampling.processors:apply_temperature",
                                "minillm.sampling.processors:apply_min_p",
                                "minillm.sampling.processors:apply_top_k",
                                "minillm.sampling.processors:apply_top_p"),
         oracles=lambda: [reference_process_logits, reference_row]),
    Task("lab06_2", what="draw", verify=verify_lab06_2,
         engine=minillm_objects("minillm.sampling.sampler:draw")),
)}

check_lab06_1 = TASKS["lab06_1"].checker(
    'process_logits(logits [B, V], temperature [B], top_k [B], top_p [B], min_p [B]) -> logits [B, V], dropped = '
    '-inf; per row: temperature -> min-p -> top-k -> top-p.')
check_lab06_2 = TASKS["lab06_2"].checker(
    'draw(probs [B, V], generators: list of B torch.Generator | None) -> int64 [B], row i drawn with generators[i].')
