"""Serving metrics from request traces: what `minillm bench serve` reports (and lab11 has the learner write).

A trace is one request as the client saw it: when it was sent, when each chunk of output arrived, how many tokens
it produced. From those:
  TTFT  time to first token: send -> first output chunk (queueing + prefill, as the user waits for it)
  TPOT  time per output token after the first, per request: (e2e - TTFT) / (output tokens - 1); undefined for a
        one-token answer
  ITL   inter-token latency: every gap between consecutive chunks, pooled over all requests (a stall shows in the
        tail even when each request's average is fine)
  E2EL  end-to-end latency: send -> last chunk
  goodput  requests per second that met EVERY service-level objective given (e.g. TTFT <= 500 ms and
        TPOT <= 100 ms); a request meeting one of two does not count
Percentiles interpolate linearly between the sorted values (numpy's default), as vLLM's benchmark does.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, NamedTuple


@dataclass(frozen=True)
class Trace:
    sent: float                                         # seconds (any clock, the same for all)
    chunk_times: list[float] = field(default_factory=list)   # arrival of each chunk that carried output
    output_tokens: int = 0
    prompt_tokens: int = 0
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and bool(self.chunk_times)


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation between closest ranks; nan for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    below, frac = divmod((len(ordered) - 1) * q / 100, 1)
    below = int(below)
    if below + 1 >= len(ordered):
        return float(ordered[-1])
    return ordered[below] + (ordered[below + 1] - ordered[below]) * frac


class TraceMetrics(NamedTuple):
    ttft: float                 # seconds
    tpot: float | None          # None for fewer than two output tokens
    itl: list[float]            # every gap between consecutive chunks
    e2el: float


def request_metrics(t: Trace) -> TraceMetrics:
    """One request's TTFT, TPOT, inter-chunk gaps and E2EL (a trace with at least one chunk)."""
    first, last = t.chunk_times[0] - t.sent, t.chunk_times[-1] - t.sent
    tpot = (last - first) / (t.output_tokens - 1) if t.output_tokens >= 2 else None
    return TraceMetrics(first, tpot, [b - a for a, b in zip(t.chunk_times, t.chunk_times[1:])], last)


METRICS = ("ttft", "tpot", "itl", "e2el")


def metric_values(traces: list[Trace], request_metrics: Callable[[Trace], TraceMetrics] = request_metrics
                  ) -> dict[str, list[float]]:
    """Every completed request's values, pooled per metric (TPOT only where defined; ITL every gap)."""
    per = [request_metrics(t) for t in traces if t.ok]
    return {"ttft": [m.ttft for m in per], "tpot": [m.tpot for m in per if m.tpot is not None],
            "itl": [gap for m in per for gap in m.itl], "e2el": [m.e2el for m in per]}


def meets(t: Trace, slos: dict[str, float]) -> bool:
    """Every objective met (seconds): ttft, tpot and e2el per request; an undefined TPOT meets its objective."""
    if not t.ok:
        return False
    m = request_metrics(t)
    got = {"ttft": m.ttft, "tpot": m.tpot, "e2el": m.e2el}
    return all(got[name] is None or got[name] <= limit for name, limit in slos.items())


def goodput(traces: list[Trace], slos: dict[str, float], duration: float) -> float:
    """Requests per second that met every objective."""
    return sum(meets(t, slos) for t in traces) / duration if duration > 0 else math.nan


def summarize(traces: list[Trace], duration: float, slos: dict[str, float] | None = None,
              percentiles: tuple[float, ...] = (50, 90, 99), *, percentile: Callable = percentile,
              request_metrics: Callable = request_metrics, goodput: Callable = goodput) -> dict:
    """The benchmark's row for one load level; the three metric functions are seams (lab11 plugs its own)."""
    values = metric_values(traces, request_metrics)
    done = [t for t in traces if t.ok]
    out = {"completed": len(done), "failed": len(traces) - len(done), "duration_s": duration,
           "request_throughput": len(done) / duration if duration > 0 else math.nan,
           "output_throughput": sum(t.output_tokens for t in done) / duration if duration > 0 else math.nan,
           "total_input_tokens": sum(t.prompt_tokens for t in done),
           "total_output_tokens": sum(t.output_tokens for t in done)}
    for name in METRICS:
        xs = values[name]
        out[f"mean_{name}_ms"] = 1000 * sum(xs) / len(xs) if xs else math.nan
        for q in percentiles:
            out[f"p{q:g}_{name}_ms"] = 1000 * percentile(xs, q)
    if slos:
        out["goodput"] = goodput(traces, slos, duration)
    return out
