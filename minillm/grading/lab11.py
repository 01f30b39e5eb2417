"""Checkers for lab11 — serving and benchmarking: latency metrics from request traces, goodput, admission control.

Tasks (minillm's own versions: minillm/bench/serving_metrics.py and serve/app.py's TokenBudgetAdmission):
  lab11_1  percentile(values, q) -> float: linear interpolation between the closest ranks of the sorted values
  lab11_2  request_metrics(trace) -> TraceMetrics(ttft, tpot, itl, e2el) of one request's trace
  lab11_3  goodput(traces, slos, duration) -> requests per second that met every objective
  lab11_4  class Admission(max_waiting_requests, max_waiting_tokens) with admit(waiting_requests, waiting_tokens,
           prompt_tokens) -> bool

Oracles: numpy.percentile (lab11_1); the definitions written out per field (lab11_2, lab11_3); the rule as one
boolean expression (lab11_4). Cases are drawn by hypothesis around the edges that separate right from plausible:
q = 0 and 100, duplicates, unsorted input (never modified), chunks carrying several tokens, one-token answers,
failed requests, values exactly on an objective, a request larger than the whole token budget.
"""
from __future__ import annotations

import math
from typing import Any, Callable

import numpy as np
from hypothesis import example, given, strategies as st

from minillm.bench.serving_metrics import Trace, TraceMetrics
from minillm.grading.core import Hint, Task, as_float, check, diagnose, fail, minillm_objects, run_property
from minillm.verdict import type_name

__all__ = ["check_lab11_1", "check_lab11_2", "check_lab11_3", "check_lab11_4", "TASKS"]


def _close(a: float, b: float) -> bool:
    return (math.isnan(a) and math.isnan(b)) or math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12)


# --------------------------------------------------------------------------- lab11_1: percentile

def reference_percentile(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values, dtype=np.float64), q)) if values else math.nan


_PCT_PROBES = [([3.0, 1.0, 2.0, 10.0], 50.0), ([5.0, 1.0, 4.0, 2.0, 3.0], 90.0), ([1.0, 2.0], 25.0),
               ([7.0, 9.0, 8.0], 100.0), ([4.0, 1.0, 3.0], 0.0)]


def _nearest_rank(xs: list[float], q: float, sort: bool = True) -> float:
    ys = sorted(xs) if sort else list(xs)
    return ys[max(0, math.ceil(q / 100 * len(ys)) - 1)]


_PCT_MISTAKES = [
    ("that is the nearest-rank percentile on unsorted data: sort the values first, then interpolate",
     lambda xs, q: _nearest_rank(xs, q, sort=False)),
    ("that is the nearest-rank percentile (one of the values): interpolate linearly between the two closest ranks",
     _nearest_rank),
    ("you did not sort the values first", lambda xs, q: xs[0] + (xs[-1] - xs[0]) * q / 100),
    ("the position of the q-th percentile among n sorted values is (n - 1)·q/100 (index 0 is the minimum, "
     "n - 1 the maximum), not n·q/100",
     lambda xs, q: (lambda ys, p: ys[min(int(p), len(ys) - 1)] + (ys[min(int(p) + 1, len(ys) - 1)]
                                                                   - ys[min(int(p), len(ys) - 1)]) * (p - int(p)))(
         sorted(xs), len(xs) * q / 100)),
    ("you rounded the position down instead of interpolating between the two closest ranks",
     lambda xs, q: sorted(xs)[math.floor((len(xs) - 1) * q / 100)]),
    ("q is a percentage (0-100), not a fraction: divide by 100",
     lambda xs, q: reference_percentile(xs, min(q * 100, 100))),
]


def verify_lab11_1(percentile: Callable[..., Any]) -> None:
    def one(values: list[float], q: float) -> None:
        given_values = list(values)
        got = percentile(given_values, q)
        check(given_values == values, f"percentile changed the list it was given ({values!r:.80} became "
              f"{given_values!r:.80}): the benchmark reuses its values for every percentile — sort a copy "
              "(sorted(values)), not the list itself", "sorted(values) returns a new list; values.sort() "
              "reorders the caller's.")
        ref = reference_percentile(values, q)
        if not values:
            check(type(got) is float and math.isnan(got), f"percentile([], {q}) must be nan (no values, no "
                  f"percentile), got {type_name(got)} {got!r:.40}", "return math.nan for an empty list.")
            return
        got = as_float(got, "percentile's result")
        if _close(got, ref):
            return
        why = diagnose(percentile, _PCT_MISTAKES, [(list(values), q)] + [(list(v), p) for v, p in _PCT_PROBES],
                       lambda a, b: type(a) in (int, float, np.float64) and _close(float(a), float(b)))
        fail(f"percentile({values!r:.120}, {q!r}) = {got!r}, expected {ref!r}" + (f" — {why}" if why else ""))

    one([], 50.0)
    one([4.0], 99.0)

    @given(values=st.lists(st.floats(-1e6, 1e6, allow_nan=False), min_size=1, max_size=40),
           q=st.one_of(st.sampled_from([0.0, 50.0, 90.0, 99.0, 99.9, 100.0]), st.floats(0, 100)))
    @example(values=[3.0, 1.0, 2.0, 10.0], q=50.0)
    @example(values=[5.0, 1.0, 4.0, 2.0, 3.0], q=90.0)
    @example(values=[2.0, 2.0, 9.0, 1.0], q=99.0)
    def prop(values: list[float], q: float) -> None:
        one(values, q)

    run_property(prop, max_examples=80, hint=Hint(
        "a percentile of latencies reads the sorted values at a position between two of them; p0 is the minimum "
        "and p100 the maximum.",
        "sort a copy, find the (fractional) position of the q-th percentile among n values, and interpolate "
        "linearly between the two values around it.",
        "xs = sorted(values); pos = (len(xs) - 1) * q / 100; lo = floor(pos); hi = min(lo + 1, len(xs) - 1); "
        "return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)."))


# --------------------------------------------------------------------------- lab11_2: one request's metrics

def reference_request_metrics(t: Trace) -> TraceMetrics:
    ttft = t.chunk_times[0] - t.sent
    e2el = t.chunk_times[-1] - t.sent
    tpot = None if t.output_tokens < 2 else (e2el - ttft) / (t.output_tokens - 1)
    itl = [t.chunk_times[i + 1] - t.chunk_times[i] for i in range(len(t.chunk_times) - 1)]
    return TraceMetrics(ttft, tpot, itl, e2el)


@st.composite
def _traces(draw: st.DrawFn, ok: bool = True) -> Trace:
    sent = draw(st.floats(0, 1e4))
    gaps = draw(st.lists(st.floats(1e-4, 5.0), min_size=1, max_size=12))
    times = list(np.cumsum([draw(st.floats(1e-3, 20.0))] + gaps[1:]) + sent)
    # a chunk may carry several tokens (a server that coalesces a slow stream): tokens >= chunks
    tokens = len(times) + draw(st.sampled_from([0, 0, 0, 1, 5]))
    if not ok:
        return Trace(sent, [], 0, 10, draw(st.sampled_from(["HTTP 429: busy", "ReadTimeout: timed out"])))
    return Trace(sent, [float(x) for x in times], tokens, draw(st.integers(1, 500)))


def _as_metrics(m: Any) -> tuple[float, float | None, list[float], float]:
    __tracebackhide__ = True
    if type(m) not in (TraceMetrics, tuple) or len(m) != 4:
        fail(f"request_metrics must return TraceMetrics(ttft, tpot, itl, e2el) (or that 4-tuple), got "
             f"{type_name(m)} {m!r:.80}", "from minillm.bench.serving_metrics import TraceMetrics; return "
             "TraceMetrics(ttft, tpot, itl, e2el).")
    ttft, tpot, itl, e2el = m
    if type(itl) is not list:
        fail(f"itl must be a list of the gaps between consecutive chunks, got {type_name(itl)} {itl!r:.60}",
             "a list with one float per gap: [t1 - t0, t2 - t1, ...].")
    return (as_float(ttft, "ttft"), None if tpot is None else as_float(tpot, "tpot"),
            [as_float(x, "every gap of itl") for x in itl], as_float(e2el, "e2el"))


def _same_metrics(a: Any, b: TraceMetrics) -> bool:
    try:
        ttft, tpot, itl, e2el = a
        return (_close(float(ttft), b.ttft) and _close(float(e2el), b.e2el) and
                ((tpot is None) == (b.tpot is None)) and (tpot is None or _close(float(tpot), b.tpot)) and
                len(itl) == len(b.itl) and all(_close(float(x), y) for x, y in zip(itl, b.itl)))
    except (TypeError, ValueError):
        return False


def _wrong_metrics(**change: Callable[[Trace, TraceMetrics], Any]) -> Callable[[Trace], TraceMetrics]:
    def wrong(t: Trace) -> TraceMetrics:
        m = reference_request_metrics(t)
        return m._replace(**{k: f(t, m) for k, f in change.items()})
    return wrong


_T = lambda sent, times, tokens: Trace(sent, times, tokens, 8)  # noqa: E731
_METRIC_PROBES = [_T(0.0, [0.5, 0.6, 0.7, 1.5], 4), _T(1.0, [1.2, 1.3, 1.6], 7), _T(2.0, [2.4], 1),
                  _T(0.0, [1.0, 1.1], 2)]
_METRIC_MISTAKES = [
    ("TPOT counts the tokens after the first: (e2el - ttft) / (output_tokens - 1); you divided the whole e2el by "
     "every token (the first token's wait is prefill and queueing, which TTFT already reports)",
     _wrong_metrics(tpot=lambda t, m: m.e2el / t.output_tokens)),
    ("TPOT divides by output tokens - 1, not by the number of chunks - 1: a chunk may carry several tokens",
     _wrong_metrics(tpot=lambda t, m: None if len(t.chunk_times) < 2 else
                    (m.e2el - m.ttft) / (len(t.chunk_times) - 1))),
    ("itl holds every gap between consecutive chunks, not one average per request: averaging hides the stalls "
     "p99 ITL is there to show", _wrong_metrics(itl=lambda t, m: [sum(m.itl) / len(m.itl)] if m.itl else [])),
    ("TTFT runs from when the request was SENT to the first chunk (the user waits through the queue too)",
     _wrong_metrics(ttft=lambda t, m: 0.0)),
    ("e2el runs from when the request was sent, not from its first chunk",
     _wrong_metrics(e2el=lambda t, m: m.e2el - m.ttft)),
    ("a one-token answer has no TPOT (None): there is no second token to time",
     _wrong_metrics(tpot=lambda t, m: 0.0 if t.output_tokens < 2 else m.tpot)),
]


def verify_lab11_2(request_metrics: Callable[..., Any]) -> None:
    def one(t: Trace) -> None:
        got = _as_metrics(request_metrics(t))
        ref = reference_request_metrics(t)
        if _same_metrics(got, ref):
            return
        why = diagnose(request_metrics, _METRIC_MISTAKES, [(t,)] + [(p,) for p in _METRIC_PROBES], _same_metrics)
        fail(f"for a request sent at {t.sent:g} s whose chunks arrived at {t.chunk_times!r:.120} carrying "
             f"{t.output_tokens} tokens, got (ttft, tpot, itl, e2el) = {got!r:.160}, expected "
             f"{tuple(ref)!r:.160}" + (f" — {why}" if why else ""))

    for t in _METRIC_PROBES:
        one(t)

    @given(_traces())
    def prop(t: Trace) -> None:
        one(t)

    run_property(prop, max_examples=80, hint=Hint(
        "four numbers from one trace, each defined by what a user waits for: until the first chunk, between "
        "tokens after it, between chunks, until the end.",
        "ttft and e2el start at `sent`; TPOT spreads the time after the first chunk over the tokens after the "
        "first (None with fewer than two tokens); itl lists every gap between consecutive chunk times.",
        "ttft = chunks[0] - sent; e2el = chunks[-1] - sent; tpot = (e2el - ttft) / (output_tokens - 1) if "
        "output_tokens >= 2 else None; itl = [b - a for a, b in zip(chunks, chunks[1:])]."))


# --------------------------------------------------------------------------- lab11_3: goodput

def reference_goodput(traces: list[Trace], slos: dict[str, float], duration: float) -> float:
    good = 0
    for t in traces:
        if t.error is not None or not t.chunk_times:
            continue
        m = reference_request_metrics(t)
        values = {"ttft": m.ttft, "tpot": m.tpot, "e2el": m.e2el}
        if all(values[k] is None or values[k] <= limit for k, limit in slos.items()):
            good += 1
    return good / duration


def _met_any(traces: list[Trace], slos: dict[str, float], duration: float) -> float:
    def any_met(t: Trace) -> bool:
        m = reference_request_metrics(t)
        values = {"ttft": m.ttft, "tpot": m.tpot, "e2el": m.e2el}
        return any(values[k] is not None and values[k] <= v for k, v in slos.items())
    return sum(1 for t in traces if t.ok and any_met(t)) / duration


def _strict(traces: list[Trace], slos: dict[str, float], duration: float) -> float:
    def met(t: Trace) -> bool:
        m = reference_request_metrics(t)
        values = {"ttft": m.ttft, "tpot": m.tpot, "e2el": m.e2el}
        return all(values[k] is None or values[k] < v for k, v in slos.items())
    return sum(1 for t in traces if t.ok and met(t)) / duration


def _with_failed(traces: list[Trace], slos: dict[str, float], duration: float) -> float:
    ok = [t for t in traces if t.ok]
    return (reference_goodput(ok, slos, duration) * duration + len(traces) - len(ok)) / duration


_G_PROBE_TRACES = [_T(0.0, [0.1, 0.15, 0.2], 3), _T(0.0, [0.9, 0.95, 1.0], 3), _T(0.0, [0.1, 0.5, 0.9], 3),
                   _T(0.0, [0.3], 1), Trace(0.0, [], 0, 5, "HTTP 429: busy")]
_G_PROBES = [(_G_PROBE_TRACES, {"ttft": 0.5, "tpot": 0.1}, 2.0), (_G_PROBE_TRACES, {"ttft": 0.3}, 1.0),
             (_G_PROBE_TRACES, {"e2el": 0.9}, 4.0)]
_G_MISTAKES = [
    ("a request counts toward goodput only when it met EVERY objective; you counted requests that met at least "
     "one", _met_any),
    ("a request that failed (an error, a 429, no chunk) delivered nothing: it never counts", _with_failed),
    ("an objective is met AT its limit too (<=): a TTFT of exactly 500 ms meets ttft:500", _strict),
    ("goodput is a rate: requests per second over `duration`, not a fraction of the requests",
     lambda traces, slos, d: reference_goodput(traces, slos, d) * d / len(traces)),
    ("goodput is a rate: divide the count by `duration`",
     lambda traces, slos, d: reference_goodput(traces, slos, d) * d),
]


def verify_lab11_3(goodput: Callable[..., Any]) -> None:
    def one(traces: list[Trace], slos: dict[str, float], duration: float) -> None:
        got = as_float(goodput(list(traces), dict(slos), duration), "goodput's result")
        ref = reference_goodput(traces, slos, duration)
        if _close(got, ref):
            return
        why = diagnose(goodput, _G_MISTAKES, [(traces, slos, duration)] + _G_PROBES,
                       lambda a, b: type(a) in (int, float, np.float64) and _close(float(a), float(b)))
        fail(f"goodput = {got!r} req/s for {len(traces)} requests ({sum(not t.ok for t in traces)} failed) over "
             f"{duration:g} s with objectives {slos} (seconds), expected {ref!r}" + (f" — {why}" if why else ""))

    for args in _G_PROBES:
        one(*args)

    slo = st.dictionaries(st.sampled_from(["ttft", "tpot", "e2el"]), st.floats(0.01, 10.0), min_size=1)

    @given(traces=st.lists(st.one_of(_traces(), _traces(), _traces(ok=False)), min_size=1, max_size=12),
           slos=slo, duration=st.floats(0.5, 100.0), on_edge=st.booleans())
    def prop(traces: list[Trace], slos: dict[str, float], duration: float, on_edge: bool) -> None:
        if on_edge and traces[0].ok and "ttft" in slos:        # a value exactly on its objective
            slos = {**slos, "ttft": reference_request_metrics(traces[0]).ttft}
        one(traces, slos, duration)

    run_property(prop, max_examples=60, hint=Hint(
        "goodput is throughput that counts only the requests a user would call good: every objective met.",
        "skip failed requests; for the others compute their ttft / tpot / e2el and require each one named in "
        "slos to be at or under its limit (an undefined TPOT meets it); divide the count by duration.",
        "sum(1 for t in traces if t.ok and all(value(t, k) is None or value(t, k) <= v for k, v in slos.items()))"
        " / duration."))


# --------------------------------------------------------------------------- lab11_4: admission

class ReferenceAdmission:
    def __init__(self, max_waiting_requests: int, max_waiting_tokens: int) -> None:
        self.max_requests, self.max_tokens = max_waiting_requests, max_waiting_tokens

    def admit(self, waiting_requests: int, waiting_tokens: int, prompt_tokens: int) -> bool:
        fits_count = waiting_requests < self.max_requests
        fits_tokens = waiting_requests == 0 or waiting_tokens + prompt_tokens <= self.max_tokens
        return fits_count and fits_tokens


_ADMIT_MISTAKES = [
    ("you bounded the number of waiting requests only: the token budget bounds how much prefill work waits "
     "(one 8,000-token prompt costs as much as a hundred short ones)",
     lambda r, t, p, mr, mt: r < mr),
    ("you bounded the tokens only: the request count is a limit too",
     lambda r, t, p, mr, mt: r == 0 or t + p <= mt),
    ("when nothing waits, admit the request even if it alone exceeds the token budget: refusing it would refuse "
     "it forever (whether it fits the KV cache is the engine's question, not admission's)",
     lambda r, t, p, mr, mt: r < mr and t + p <= mt),
    ("the limits are inclusive: with max_waiting_tokens = 100, 60 waiting + 40 new fit",
     lambda r, t, p, mr, mt: r < mr and (r == 0 or t + p < mt)),
    ("max_waiting_requests counts the requests waiting after this one joins: with 3 allowed and 3 waiting, "
     "the fourth must be refused", lambda r, t, p, mr, mt: r <= mr and (r == 0 or t + p <= mt)),
    ("the new request's own tokens count against the budget too",
     lambda r, t, p, mr, mt: r < mr and (r == 0 or t <= mt)),
]


_ADMIT_PROBES = [(3, 100, 0, 0, 500), (3, 100, 1, 60, 40), (3, 100, 1, 60, 41), (3, 100, 2, 0, 1),
                 (3, 100, 3, 0, 1), (1, 10, 0, 0, 10**6), (5, 1000, 4, 10, 10), (4, 50, 1, 50, 1), (4, 50, 1, 20, 40),
                 (4, 50, 1, 60, 1), (3, 100, 5, 0, 1)]


def verify_lab11_4(cls: type) -> None:
    def answer(mr: int, mt: int, r: int, t: int, p: int) -> Any:
        return cls(mr, mt).admit(r, t, p)

    def one(mr: int, mt: int, r: int, t: int, p: int) -> None:
        got = answer(mr, mt, r, t, p)
        check(type(got) is bool, f"admit's answer must be True or False (a bool), got {type_name(got)} "
              f"{got!r:.40}", "return a bool: the comparison itself.")
        ref = ReferenceAdmission(mr, mt).admit(r, t, p)
        if got == ref:
            return
        why = diagnose(answer, [(w, lambda mr_, mt_, r_, t_, p_, f=f: f(r_, t_, p_, mr_, mt_))
                                for w, f in _ADMIT_MISTAKES], [(mr, mt, r, t, p)] + _ADMIT_PROBES,
                       lambda a, b: a == b)
        fail(f"{cls.__name__}(max_waiting_requests={mr}, max_waiting_tokens={mt}).admit(waiting_requests={r}, "
             f"waiting_tokens={t}, prompt_tokens={p}) returned {got}, expected {ref}" + (f" — {why}" if why else ""))

    for case in _ADMIT_PROBES:
        one(*case)

    @given(mr=st.integers(1, 64), mt=st.integers(1, 10_000), r=st.integers(0, 70), t=st.integers(0, 12_000),
           p=st.integers(1, 12_000))
    def prop(mr: int, mt: int, r: int, t: int, p: int) -> None:
        one(mr, mt, r, t if r else 0, p)

    run_property(prop, max_examples=120, hint=Hint(
        "two limits bound what waits to start: the number of requests and their prompt tokens; a refused request "
        "gets a 429 and retries later.",
        "refuse when the request would make one too many waiting, or push the waiting tokens over the budget — "
        "unless nothing waits at all (then it must be let in, however long).",
        "return waiting_requests < max_waiting_requests and (waiting_requests == 0 or waiting_tokens + "
        "prompt_tokens <= max_waiting_tokens)."))


# --------------------------------------------------------------------------- the tasks

TASKS = {t.id: t for t in (
    Task("lab11_1", what="percentile", verify=verify_lab11_1,
         engine=minillm_objects("minillm.bench.serving_metrics:percentile"), oracles=lambda: [reference_percentile]),
    Task("lab11_2", what="request_metrics", verify=verify_lab11_2,
         engine=minillm_objects("minillm.bench.serving_metrics:request_metrics"),
         oracles=lambda: [reference_request_metrics]),
    Task("lab11_3", what="goodput", verify=verify_lab11_3,
         engine=minillm_objects("minillm.bench.serving_metrics:goodput", "minillm.bench.serving_metrics:meets"),
         oracles=lambda: [reference_goodput]),
    Task("lab11_4", what="admission policy", verify=verify_lab11_4, kind="class", methods=("admit",),
         engine=minillm_objects("minillm.serve.app:TokenBudgetAdmission"), oracles=lambda: [ReferenceAdmission]),
)}

check_lab11_1 = TASKS["lab11_1"].checker("percentile(values, q) -> the q-th percentile, interpolated linearly.")
check_lab11_2 = TASKS["lab11_2"].checker("request_metrics(trace) -> TraceMetrics(ttft, tpot, itl, e2el).")
check_lab11_3 = TASKS["lab11_3"].checker("goodput(traces, slos, duration) -> requests/s meeting every objective.")
check_lab11_4 = TASKS["lab11_4"].checker("class Admission(max_waiting_requests, max_waiting_tokens) with "
                                         "admit(waiting_requests, waiting_tokens, prompt_tokens) -> bool.")
