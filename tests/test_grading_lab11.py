"""lab11 checkers, graded both ways: minillm's own serving metrics and admission rule pass the property suites;
handed in as answers they are refused, as are the grader's references and plausible wrong answers (TPOT with the
first token, ITL averaged per request, nearest-rank percentiles on unsorted data, goodput counting one objective
met, admission by request count when the limit is tokens, ...). Correct answers written other natural ways pass."""
import math
import statistics

import numpy as np
import pytest

from minillm.bench import serving_metrics
from minillm.bench.serving_metrics import TraceMetrics
from minillm.grading.lab11 import (TASKS, ReferenceAdmission, check_lab11_1, check_lab11_2, check_lab11_3,
                                   check_lab11_4, reference_percentile, reference_request_metrics)
from minillm.serve.app import TokenBudgetAdmission
from grading_helpers import rejected


# ---------------------------------------------------------------- lab11_1 percentile

def test_lab11_1_minillm_passes_and_is_refused_as_an_answer():
    TASKS["lab11_1"].verify(serving_metrics.percentile)
    rejected(check_lab11_1, serving_metrics.percentile, "minillm's own answer")
    rejected(check_lab11_1, reference_percentile, "minillm's own answer")


def test_lab11_1_correct_alternatives_pass():
    def by_numpy(values, q):
        return float(np.percentile(values, q)) if values else math.nan

    def by_hand(values, q):
        if not values:
            return math.nan
        xs = sorted(values)
        k = (len(xs) - 1) * (q / 100)
        f = int(k)
        c = min(f + 1, len(xs) - 1)
        return xs[f] * (1 - (k - f)) + xs[c] * (k - f)
    check_lab11_1(by_numpy)
    check_lab11_1(by_hand)


def _nearest_rank_unsorted(values, q):
    return values[max(0, math.ceil(q / 100 * len(values)) - 1)] if values else math.nan


def _nearest_rank(values, q):
    return _nearest_rank_unsorted(sorted(values), q)


def _sorts_in_place(values, q):
    if not values:
        return math.nan
    values.sort()
    return float(np.percentile(values, q))


def _n_not_n_minus_1(values, q):
    if not values:
        return math.nan
    xs = sorted(values)
    k = min(len(xs) * q / 100, len(xs) - 1)
    f = int(k)
    return xs[f] + (xs[min(f + 1, len(xs) - 1)] - xs[f]) * (k - f)


def _empty_is_zero(values, q):
    return float(np.percentile(values, q)) if values else 0.0


PCT_WRONG = {
    "nearest_rank_unsorted": (_nearest_rank_unsorted, "unsorted data"),
    "nearest_rank": (_nearest_rank, "nearest-rank"),
    "sorts_the_callers_list": (_sorts_in_place, "changed the list"),
    "position_n_not_n_minus_1": (_n_not_n_minus_1, "(n - 1)"),
    "empty_is_zero": (_empty_is_zero, "must be nan"),
    "statistics_median_always": (lambda v, q: statistics.median(v) if v else math.nan, "expected"),
}


@pytest.mark.parametrize("name", PCT_WRONG)
def test_lab11_1_wrong_implementations_fail(name):
    fn, needle = PCT_WRONG[name]
    rejected(check_lab11_1, fn, needle)


# ---------------------------------------------------------------- lab11_2 request metrics

def test_lab11_2_minillm_passes_and_is_refused_as_an_answer():
    TASKS["lab11_2"].verify(serving_metrics.request_metrics)
    rejected(check_lab11_2, serving_metrics.request_metrics, "minillm's own answer")
    rejected(check_lab11_2, lambda t: reference_request_metrics(t), "grader's reference answer")


def test_lab11_2_correct_alternatives_pass():
    def as_tuple(trace):
        c = trace.chunk_times
        ttft, e2el = c[0] - trace.sent, c[-1] - trace.sent
        return (ttft, (e2el - ttft) / (trace.output_tokens - 1) if trace.output_tokens > 1 else None,
                [c[i] - c[i - 1] for i in range(1, len(c))], e2el)
    check_lab11_2(as_tuple)
    check_lab11_2(lambda t: TraceMetrics(*as_tuple(t)))


def _right(t):
    c = t.chunk_times
    ttft, e2el = c[0] - t.sent, c[-1] - t.sent
    return TraceMetrics(ttft, (e2el - ttft) / (t.output_tokens - 1) if t.output_tokens > 1 else None,
                        [b - a for a, b in zip(c, c[1:])], e2el)


def _metrics(**change):
    def fn(t):
        m = _right(t)
        return m._replace(**{k: f(t, m) for k, f in change.items()})
    return fn


METRIC_WRONG = {
    "tpot_includes_the_first_token": (_metrics(tpot=lambda t, m: m.e2el / t.output_tokens), "output_tokens - 1"),
    "tpot_per_chunk": (_metrics(tpot=lambda t, m: None if len(t.chunk_times) < 2 else
                                (m.e2el - m.ttft) / (len(t.chunk_times) - 1)), "number of chunks"),
    "itl_averaged_per_request": (_metrics(itl=lambda t, m: [sum(m.itl) / len(m.itl)] if m.itl else []),
                                 "one average per request"),
    "ttft_from_the_first_chunk": (_metrics(ttft=lambda t, m: 0.0), "SENT"),
    "e2el_from_the_first_chunk": (_metrics(e2el=lambda t, m: m.e2el - m.ttft), "not from its first chunk"),
    "tpot_zero_for_one_token": (_metrics(tpot=lambda t, m: 0.0 if t.output_tokens < 2 else m.tpot), "None"),
    "itl_as_a_tuple": (_metrics(itl=lambda t, m: tuple(m.itl)), "itl must be a list"),
    "a_dict": (lambda t: _right(t)._asdict(), "must return TraceMetrics"),
}


@pytest.mark.parametrize("name", METRIC_WRONG)
def test_lab11_2_wrong_implementations_fail(name):
    fn, needle = METRIC_WRONG[name]
    rejected(check_lab11_2, fn, needle)


# ---------------------------------------------------------------- lab11_3 goodput

def test_lab11_3_minillm_passes_and_is_refused_as_an_answer():
    TASKS["lab11_3"].verify(serving_metrics.goodput)
    rejected(check_lab11_3, serving_metrics.goodput, "minillm's own answer")


def _good(t, slos, strict=False, any_=False):
    if t.error is not None or not t.chunk_times:
        return False
    ttft = t.chunk_times[0] - t.sent
    e2el = t.chunk_times[-1] - t.sent
    tpot = (e2el - ttft) / (t.output_tokens - 1) if t.output_tokens > 1 else None
    values = {"ttft": ttft, "tpot": tpot, "e2el": e2el}
    tests = [values[k] is None or (values[k] < v if strict else values[k] <= v) for k, v in slos.items()]
    return any(tests) if any_ else all(tests)


def test_lab11_3_correct_alternative_passes():
    check_lab11_3(lambda traces, slos, duration: sum(_good(t, slos) for t in traces) / duration)


GOODPUT_WRONG = {
    "one_objective_is_enough": (lambda tr, s, d: sum(_good(t, s, any_=True) for t in tr) / d, "EVERY objective"),
    "failed_requests_count": (lambda tr, s, d: sum(_good(t, s) or t.error is not None for t in tr) / d,
                              "never counts"),
    "strictly_under": (lambda tr, s, d: sum(_good(t, s, strict=True) for t in tr) / d, "AT its limit"),
    "a_fraction": (lambda tr, s, d: sum(_good(t, s) for t in tr) / len(tr), "not a fraction"),
    "a_count": (lambda tr, s, d: float(sum(_good(t, s) for t in tr)), "divide the count"),
}


@pytest.mark.parametrize("name", GOODPUT_WRONG)
def test_lab11_3_wrong_implementations_fail(name):
    fn, needle = GOODPUT_WRONG[name]
    rejected(check_lab11_3, fn, needle)


# ---------------------------------------------------------------- lab11_4 admission

def test_lab11_4_minillm_passes_and_is_refused_as_an_answer():
    TASKS["lab11_4"].verify(TokenBudgetAdmission)
    rejected(check_lab11_4, TokenBudgetAdmission, "minillm's own answer")
    rejected(check_lab11_4, ReferenceAdmission, "minillm's own answer")


def test_lab11_4_correct_alternative_passes():
    class Admission:
        def __init__(self, max_waiting_requests, max_waiting_tokens):
            self.requests, self.tokens = max_waiting_requests, max_waiting_tokens

        def admit(self, waiting_requests, waiting_tokens, prompt_tokens):
            if waiting_requests >= self.requests:
                return False
            if waiting_requests == 0:
                return True
            return waiting_tokens + prompt_tokens <= self.tokens
    check_lab11_4(Admission)


def _admission(rule):
    class Admission:
        def __init__(self, max_waiting_requests, max_waiting_tokens):
            self.mr, self.mt = max_waiting_requests, max_waiting_tokens

        def admit(self, waiting_requests, waiting_tokens, prompt_tokens):
            return rule(waiting_requests, waiting_tokens, prompt_tokens, self.mr, self.mt)
    return Admission


ADMIT_WRONG = {
    "request_count_only": (lambda r, t, p, mr, mt: r < mr, "number of waiting requests only"),
    "tokens_only": (lambda r, t, p, mr, mt: r == 0 or t + p <= mt, "tokens only"),
    "refuses_a_big_request_forever": (lambda r, t, p, mr, mt: r < mr and t + p <= mt, "refuse it forever"),
    "tokens_strictly_under": (lambda r, t, p, mr, mt: r < mr and (r == 0 or t + p < mt), "inclusive"),
    "one_request_too_many": (lambda r, t, p, mr, mt: r <= mr and (r == 0 or t + p <= mt), "the fourth"),
    "new_tokens_not_counted": (lambda r, t, p, mr, mt: r < mr and (r == 0 or t <= mt), "own tokens"),
    "returns_an_int": (lambda r, t, p, mr, mt: int(r < mr and (r == 0 or t + p <= mt)), "must be True or False"),
}


@pytest.mark.parametrize("name", ADMIT_WRONG)
def test_lab11_4_wrong_implementations_fail(name):
    rule, needle = ADMIT_WRONG[name]
    rejected(check_lab11_4, _admission(rule), needle)
