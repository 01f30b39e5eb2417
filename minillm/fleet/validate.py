"""Validate the fleet simulator against the real engine: the same requests, at the same arrival times, through one
real replica on this machine's wall clock and through one simulated replica on the calibrated step model.

The workloads are held out from calibration (calibrate.py runs a few fixed prompt lengths from 16 to 1024 tokens, 12
to 24 output tokens, requests all queued at once plus one second wave): here arrivals are Poisson, and prompt and
output lengths are lognormal over two mixes no scenario used (SHORT: chat-like prompts with longer answers, LONG:
RAG-like prompts with short answers). Rates are stated as loads: a load of 1 offers one request per (step-model)
service time of a mean request served alone, so the same loads mean the same regime on a 2-core CPU and on a tiny
random model; batching makes loads above 1 sustainable.

Both sides measure the same thing: a request's token appears when the step that produced it returns (the engine's
step() / the simulator's step end), its TTFT counts from its scheduled arrival time (a request that comes while a
pass runs waits for the next schedule() in both), TPOT = (finish - first token) / (output tokens - 1), throughput =
output tokens / (last finish - first arrival). Greedy, EOS ignored, so the output lengths are the drawn ones.
"""
from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import numpy as np
from tqdm.auto import tqdm

from minillm.engine.llm_engine import LLMEngine
from minillm.engine.outputs import StepInfo
from minillm.fleet.calibrate import step_features
from minillm.fleet.probe import Clock, WallClock, probe
from minillm.fleet.replica import Finished, Replica, ReplicaConfig
from minillm.fleet.routers import RoundRobin
from minillm.fleet.simulator import simulate
from minillm.fleet.step_model import StepFeatures, StepModel
from minillm.fleet.workloads import SimRequest, arrival_gaps
from minillm.sampling.params import SamplingParams


@dataclass(frozen=True)
class Mix:
    """Lognormal prompt and output lengths: medians, sigma, clipped to [lo, hi]."""
    name: str
    prompt_median: int
    prompt_range: tuple[int, int]
    output_median: int
    output_range: tuple[int, int]
    sigma: float = 0.6


SHORT = Mix("short", 64, (8, 256), 32, (4, 96))
LONG = Mix("long", 320, (64, 900), 16, (4, 48))
MIXES = (SHORT, LONG)
LOADS = (0.5, 1.0, 2.0)
METRICS = ("ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms", "out_tok_s")


@dataclass(frozen=True)
class Workload:
    name: str
    rate: float                  # requests per second
    requests: list[SimRequest]


def _length(rng: np.random.Generator, median: int, sigma: float, lo: int, hi: int) -> int:
    return int(min(hi, max(lo, round(rng.lognormal(math.log(median), sigma)))))


def service_seconds(sm: StepModel, mix: Mix) -> float:
    """A median request of `mix` served alone: its prompt in one step, then one decode step per further token."""
    p, o = mix.prompt_median, mix.output_median
    prefill = sm.seconds(StepFeatures.of([(0, p, p)]))
    decode = sum(sm.seconds(StepFeatures.of([(p + k, 1, p)])) for k in range(o - 1))
    return prefill + decode


def held_out_workloads(sm: StepModel, vocab: int, num_requests: int, loads: Sequence[float] = LOADS,
                       mixes: Sequence[Mix] = MIXES, seed: int = 0, max_prompt: int | None = None) -> list[Workload]:
    """One seeded Poisson workload per (mix, load): `num_requests` requests of random token ids (distinct, so the
    prefix cache stays out of it) whose lengths are drawn from the mix (prompts capped at max_prompt)."""
    out = []
    for i, mix in enumerate(mixes):
        for j, load in enumerate(loads):
            rng = np.random.default_rng([seed, i, j])
            rate = load / service_seconds(sm, mix)
            gaps, t, reqs = arrival_gaps(rng, rate), 0.0, []
            for k in range(num_requests):
                p = _length(rng, mix.prompt_median, mix.sigma, *mix.prompt_range)
                p = min(p, max_prompt) if max_prompt else p
                o = _length(rng, mix.output_median, mix.sigma, *mix.output_range)
                reqs.append(SimRequest(k, t, rng.integers(3, vocab, p).tolist(), o))
                t += next(gaps)
            out.append(Workload(f"{mix.name} load {load:g}", rate, reqs))
    return out


@dataclass(frozen=True)
class Timeline:
    """One request's times, in seconds from the workload's start."""
    arrival: float
    first_token: float
    finished: float
    output_len: int


# ---------------------------------------------------------------------- the two sides

class StepModelClock:
    """A clock that the real engine's steps advance by what `sm` predicts for each (heard through the public step
    observer), so a real run on it must reproduce the simulation exactly wherever the simulated replica schedules
    as the engine does: this isolates the replay (the scheduler's copy, the feature bookkeeping, the timing
    conventions) from the step model's fit and from the machine's noise. Use as a context manager."""

    def __init__(self, engine: LLMEngine, sm: StepModel):
        self.engine, self.sm, self.t = engine, sm, 0.0

    def _observe(self, info: StepInfo) -> None:
        self.t += self.sm.seconds(step_features(info))

    def __enter__(self) -> "StepModelClock":
        self.engine.add_step_observer(self._observe)
        return self

    def __exit__(self, *exc) -> None:
        self.engine.remove_step_observer(self._observe)

    def now(self) -> float:
        return self.t

    def sleep(self, seconds: float) -> None:
        self.t += seconds


def run_real(engine: LLMEngine, requests: Sequence[SimRequest], tick: Callable[[], None] = lambda: None,
             clock: Clock | None = None) -> list[Timeline]:
    """Add each request when its arrival time comes on the clock (the wall clock unless given), step while anything
    is queued (sleep while idle), and time every token by when the step() that produced it returned."""
    clock = clock or WallClock()
    engine.block_manager.reset_prefix_cache()
    pending = deque(sorted(requests, key=lambda r: r.arrival))
    by_id = {str(r.request_id): r for r in requests}
    first: dict[str, float] = {}
    out: list[Timeline] = []

    def add_next() -> None:
        r = pending.popleft()
        engine.add_request(r.prompt, SamplingParams(max_tokens=r.output_len, temperature=0.0, ignore_eos=True),
                           request_id=str(r.request_id))
    t0 = clock.now()
    while pending or engine.has_unfinished_requests():
        now = clock.now() - t0
        while pending and pending[0].arrival <= now:
            add_next()
        if not engine.has_unfinished_requests():
            clock.sleep(max(0.0, pending[0].arrival - now))
            add_next()           # its time has come: (clock.now() - t0) may round to a hair before it
            continue
        outputs = engine.step()
        t = clock.now() - t0
        for o in outputs:
            first.setdefault(o.request_id, t)
            if o.finished:
                r = by_id[o.request_id]
                out.append(Timeline(r.arrival, first.pop(o.request_id), t, len(o.token_ids)))
                tick()
    return out


def run_sim(sm: StepModel, config: ReplicaConfig, requests: Sequence[SimRequest],
            tick: Callable[[], None] = lambda: None) -> list[Timeline]:
    """The same requests through one simulated replica (the engine's scheduler on the step model's clock)."""
    out: list[Timeline] = []

    def done(f: Finished) -> None:
        if f.failed:
            raise ValueError(f"request {f.request_id} ({f.prompt_len} prompt tokens) does not fit the replica")
        out.append(Timeline(f.arrival, f.first_token, f.finished, f.output_len))
        tick()
    simulate(sorted(requests, key=lambda r: r.arrival), [Replica(sm, config)], RoundRobin(), "validate",
             on_finish=done)
    return out


def replica_config_of(engine: LLMEngine) -> ReplicaConfig:
    """The simulated replica gets the real one's pool and scheduler settings, whatever the step model recorded."""
    cc, sc = engine.config.cache, engine.config.scheduler
    return ReplicaConfig(engine.block_manager.num_blocks, cc.block_size, sc.max_num_seqs, sc.max_num_batched_tokens,
                         sc.enable_chunked_prefill, cc.enable_prefix_caching, engine.max_model_len)


def summarize(timelines: Sequence[Timeline]) -> dict[str, float]:
    ttft = np.array([t.first_token - t.arrival for t in timelines])
    tpot = np.array([(t.finished - t.first_token) / (t.output_len - 1) for t in timelines if t.output_len > 1])
    span = max(t.finished for t in timelines) - min(t.arrival for t in timelines)
    q = lambda a, p: float(np.quantile(a, p)) * 1e3 if len(a) else math.nan     # noqa: E731
    return {"ttft_p50_ms": q(ttft, .5), "ttft_p99_ms": q(ttft, .99), "tpot_p50_ms": q(tpot, .5),
            "tpot_p99_ms": q(tpot, .99), "out_tok_s": sum(t.output_len for t in timelines) / span}


def compare(real: dict[str, float], sim: dict[str, float]) -> dict[str, float]:
    """Relative error of the simulation per metric: |sim - real| / real."""
    return {k: abs(sim[k] - real[k]) / real[k] for k in METRICS if real[k] and math.isfinite(real[k])}


def over_runs(runs: Sequence[dict[str, float]]) -> tuple[dict[str, float], dict[str, float]]:
    """(the mean of each metric over repeated real runs, its spread (max - min) / mean): the real engine on a
    shared machine does not repeat itself, and an error smaller than the spread is below what one run can show."""
    mean = {k: float(np.mean([r[k] for r in runs])) for k in METRICS}
    spread = {k: (max(r[k] for r in runs) - min(r[k] for r in runs)) / mean[k] for k in METRICS if mean[k]}
    return mean, spread


@dataclass
class Validation:
    rows: list[dict]             # per workload: name, rate, requests, real {...} (mean of runs), runs [{...}],
    source: str                  # spread {...}, sim {...}, error {...}, speed, error_raw {...}
    drift_corrected: bool = False

    @property
    def median_error_raw(self) -> float:
        """The median error of the step model as calibrated, not scaled by the machine's drift."""
        return float(np.median([e for r in self.rows for e in r["error_raw"].values()]))

    @property
    def errors(self) -> list[float]:
        return [e for r in self.rows for e in r["error"].values()]

    @property
    def median_error(self) -> float:
        return float(np.median(self.errors))

    @property
    def worst(self) -> tuple[float, str]:
        return max((e, f"{r['workload']} {k}") for r in self.rows for k, e in r["error"].items())

    @property
    def repeats(self) -> int:
        return min(len(r["runs"]) for r in self.rows)

    @property
    def median_spread(self) -> float:
        """The real engine's own run-to-run spread, median over the metrics (nan with one run)."""
        spreads = [e for r in self.rows for e in r["spread"].values()]
        return float(np.median(spreads)) if self.repeats > 1 else math.nan

    def to_dict(self) -> dict:
        e, where = self.worst
        return {"step_model": self.source, "rows": self.rows, "median_error": self.median_error,
                "worst_error": e, "worst": where, "repeats": self.repeats, "median_spread": self.median_spread,
                "drift_corrected": self.drift_corrected, "median_error_raw": self.median_error_raw}


def validate(engine: LLMEngine, sm: StepModel, workloads: Sequence[Workload], progress: bool = True,
             real: Sequence[list[list[Timeline]]] | None = None, repeat: int = 1, clock: Clock | None = None,
             correct_drift: bool = True, speeds: Sequence[float] | None = None
             ) -> tuple[Validation, list[list[list[Timeline]]]]:
    """Each workload through the real engine `repeat` times on `clock` (the wall clock unless given; unless `real`
    runs are given: one set of runs checks several step models) and once through the simulator (it is
    deterministic); the table rows, the error against the mean of the real runs, and the real runs' timelines.

    The machine's drift since calibration: when the step model carries its calibration's probe time, the probe
    (fleet/probe.py) runs before every real run and after the last, a workload's speed is the median of its probes
    over the calibration's, and with `correct_drift` its simulation runs on the step model scaled by that speed
    (the row keeps the error on the unscaled model too). With `real` runs, `speeds` are theirs (else 1)."""
    if repeat < 1:
        raise ValueError(f"repeat={repeat} must be >= 1")
    config = replica_config_of(engine)
    base = sm.replica.get("probe_s")
    total = sum(len(w.requests) for w in workloads) * (1 + (0 if real is not None else repeat))
    bar = tqdm(total=total, desc="validating", unit="req", disable=not progress)
    if real is None:
        engine.warm_up()
    rows, reals = [], []
    for i, w in enumerate(workloads):
        bar.set_postfix_str(w.name)
        if real is not None:
            runs, speed = [list(r) for r in real[i]], (speeds[i] if speeds is not None else 1.0)
        else:
            runs, probes = [], []
            for _ in range(repeat):
                probes += [probe(engine, clock)] if base else []
                runs.append(run_real(engine, w.requests, lambda: bar.update(), clock))
            probes += [probe(engine, clock)] if base else []
            speed = float(np.median(probes)) / base if base else 1.0
        raw = summarize(run_sim(sm, config, w.requests, lambda: bar.update()))
        ss = summarize(run_sim(scaled(sm, speed), config, w.requests)) if correct_drift and speed != 1.0 else raw
        per_run = [summarize(r) for r in runs]
        rs, spread = over_runs(per_run)
        rows.append({"workload": w.name, "rate": w.rate, "requests": len(w.requests), "real": rs,
                     "runs": per_run, "spread": spread, "sim": ss, "error": compare(rs, ss), "speed": speed,
                     "error_raw": compare(rs, raw)})
        reals.append(runs)
    bar.close()
    return Validation(rows, sm.source, correct_drift and base is not None), reals


def scaled(sm: StepModel, factor: float) -> StepModel:
    """Every coefficient x factor: a deliberately wrong step model (the check must flag it)."""
    return replace(sm, coeffs={k: v * factor for k, v in sm.coeffs.items()},
                   prefill_coeffs={k: v * factor for k, v in sm.prefill_coeffs.items()},
                   short_prefill_coeffs={k: v * factor for k, v in sm.short_prefill_coeffs.items()},
                   source=f"{sm.source} x {factor:g}")


def check_model(sm: StepModel, engine: LLMEngine, where: str) -> None:
    """The step model must have been calibrated on this model: a roofline or another model's fit is refused."""
    name = engine.model.cfg.name
    recorded = sm.replica.get("model")
    if not sm.source.startswith("calibrated") or (recorded or name) != name or \
            (recorded is None and name not in sm.source):
        raise ValueError(f"{where} ({sm.source!r}) was not calibrated on {name!r}: run `minillm fleet calibrate` "
                         "for this model, or pass --calibrate")


def table(v: Validation) -> str:
    """One row per (workload, metric): real (the mean of the runs), simulated, error, and with repeated runs the
    real side's own spread; then the median and the worst."""
    repeated = v.repeats > 1
    heads = ["workload", "req/s", "speed", "metric", "real" + (f" (mean of {v.repeats})" if repeated else ""), "sim",
             "error"] + (["real spread"] if repeated else [])
    names = {"ttft_p50_ms": "TTFT p50 ms", "ttft_p99_ms": "TTFT p99 ms", "tpot_p50_ms": "TPOT p50 ms",
             "tpot_p99_ms": "TPOT p99 ms", "out_tok_s": "out tok/s"}
    rows = []
    for r in v.rows:
        for k in METRICS:
            err = r["error"].get(k, math.nan)
            first = k == METRICS[0]
            rows.append([r["workload"] if first else "", f"{r['rate']:.2f}" if first else "",
                         f"{r['speed']:.2f}x" if first else "", names[k], f"{r['real'][k]:.1f}", f"{r['sim'][k]:.1f}",
                         f"{100 * err:.1f} %"]
                        + ([f"{100 * r['spread'].get(k, math.nan):.1f} %"] if repeated else []))
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(heads)]
    left = (0, 1, 3)
    lines = ["  ".join(h.ljust(w) if i in left else h.rjust(w) for i, (h, w) in enumerate(zip(heads, widths))),
             "  ".join("-" * w for w in widths)]
    lines += ["  ".join(c.ljust(w) if i in left else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
              for row in rows]
    e, where = v.worst
    lines.append(f"median error {100 * v.median_error:.1f} %, worst {100 * e:.1f} % ({where}); "
                 "target: median <= 5 %, every metric <= 10 %")
    if repeated:
        lines.append(f"the real engine's own spread over {v.repeats} runs: median {100 * v.median_spread:.1f} % "
                     "(an error below a metric's spread is within what one real run can tell)")
    speeds = [r["speed"] for r in v.rows]
    if v.drift_corrected:
        lines.append(f"speed: the probe's time now over at calibration ({min(speeds):.2f}-{max(speeds):.2f}x); each "
                     f"workload simulated on the step model x its speed; on the model as calibrated: median error "
                     f"{100 * v.median_error_raw:.1f} %")
    elif any(s != 1.0 for s in speeds):
        lines.append(f"speed: the probe's time now over at calibration ({min(speeds):.2f}-{max(speeds):.2f}x), "
                     "not corrected for")
    else:
        lines.append("speed: not probed (the step model has no calibration probe time: recalibrate to get one)")
    return "\n".join(lines)
