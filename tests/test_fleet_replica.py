"""The simulated replica against the real engine (same scheduler decisions, step by step), and the fleet
simulator's invariants under hypothesis."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, event, example, given, settings, strategies as st

from minillm.engine.llm_engine import LLMEngine
from minillm.fleet.metrics import LatencyStats
from minillm.fleet.replica import Replica, ReplicaConfig
from minillm.fleet.routers import make_router
from minillm.fleet.simulator import simulate
from minillm.fleet import workloads
from minillm.fleet.step_model import COEFFS, StepModel, from_roofline
from minillm.fleet.workloads import SimRequest
from minillm.sampling.params import SamplingParams
from minillm.testing import tiny_model

CONST = StepModel(dict.fromkeys(COEFFS, 0.0) | {"o_step": 0.01, "c_token": 0.001})
PREFIX = [5, 6, 7, 8, 9, 10, 11, 12, 13]   # shared by some prompts: prefix-cache hits need equal ids


def decisions(sched) -> tuple:
    return (tuple((s.request_id, n) for s, n in sched.scheduled), tuple(s.request_id for s in sched.preempted))


@st.composite
def traces(draw):
    """Requests arriving at engine steps: (step, id, prompt, output length), some sharing a prefix."""
    n = draw(st.integers(1, 7))
    out = []
    for i in range(n):
        tail = draw(st.lists(st.integers(3, 127), min_size=1, max_size=14))
        prompt = (PREFIX[:draw(st.integers(0, len(PREFIX)))] if draw(st.booleans()) else []) + tail
        out.append((draw(st.integers(0, 6)), i, prompt, draw(st.integers(1, 16))))
    return sorted(out)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@example(trace=[(0, 0, [3] * 6, 12), (0, 1, [4] * 6, 12), (0, 2, PREFIX + [5], 12), (2, 3, PREFIX + [6], 5)],
         num_blocks=8, max_num_seqs=3, budget=8, chunked=True)        # a pool too small: preemption by recompute
@given(trace=traces(), num_blocks=st.integers(6, 16), max_num_seqs=st.integers(1, 4),
       budget=st.integers(4, 16), chunked=st.booleans())
def test_the_simulated_replica_schedules_exactly_like_the_engine(trace, num_blocks, max_num_seqs, budget, chunked):
    """One replica, no model, the real engine's Scheduler and BlockManager: identical decisions at every step
    (which request computes how many tokens, who is preempted), with chunked prefill, a small pool (preemption
    by recompute), prefix-cache hits and requests arriving mid-run.

    The replica appends the tokens the engine generated (SimRequest.output_ids): output blocks enter the prefix
    cache too, and greedy decoding gives equal prompts equal outputs, so a preempted request's recompute can hit
    blocks another request wrote; with other tokens the cache (not the policy) would differ."""
    if not chunked:
        budget = max(budget, max(len(p) for _, _, p, _ in trace))
    engine = LLMEngine.from_model(tiny_model(), None, num_blocks=num_blocks, block_size=4, max_num_seqs=max_num_seqs,
                                  max_num_batched_tokens=budget, enable_chunked_prefill=chunked)
    trace = [r for r in trace if len(r[2]) < engine.max_model_len]    # longer ones the engine refuses at once
    real: list = []
    engine.add_step_observer(lambda info: real.append(decisions(info.scheduler_output)))
    outputs: dict[int, list[int]] = {}

    def run(add, step_once, busy) -> None:
        pending, step = list(trace), 0
        while pending or busy():
            while pending and pending[0][0] <= step:
                add(*pending.pop(0)[1:])
            step_once(step)
            step += 1
            assert step < 500

    def engine_add(rid, prompt, out):
        engine.add_request(prompt, SamplingParams(max_tokens=out, ignore_eos=True, temperature=0.0),
                           request_id=str(rid))

    def engine_step(step):
        for o in engine.step():
            if o.finished:
                outputs[int(o.request_id)] = o.outputs[0].token_ids
    run(engine_add, engine_step, engine.has_unfinished_requests)

    sim: list = []
    rep = Replica(CONST, ReplicaConfig(num_blocks, 4, max_num_seqs, budget, chunked,
                                       max_model_len=engine.max_model_len),
                  on_step=lambda now, sched: sim.append(decisions(sched)))

    def sim_step(step):
        if rep.begin_step() is not None:
            rep.end_step(float(step))
    run(lambda rid, prompt, out: rep.add(SimRequest(rid, 0.0, prompt, out, outputs[rid])), sim_step, rep.has_work)
    for i, (a, b) in enumerate(zip(real, sim)):
        assert a == b, f"step {i + 1}: the engine ran {a}, the simulated replica {b}"
    assert len(real) == len(sim)
    assert rep.num_requests == 0 and (real or not trace)
    event(f"preempted: {any(p for _, p in real)}")
    event(f"prefix hit: {rep.block_manager.stats.hits > 0}")
    event(f"chunked: {any(n > 1 and n < budget for d, _ in real for _, n in d) and chunked}")


def test_the_differential_check_can_fail():
    """A replica that forgets to finish requests at their output length diverges from the engine at once."""
    engine = LLMEngine.from_model(tiny_model(), None, num_blocks=16, block_size=4)
    real, sim = [], []
    engine.add_step_observer(lambda info: real.append(decisions(info.scheduler_output)))
    rep = Replica(CONST, ReplicaConfig(16, 4), on_step=lambda now, sched: sim.append(decisions(sched)))
    engine.add_request([3, 4, 5], SamplingParams(max_tokens=2, ignore_eos=True), request_id="0")
    rep.add(SimRequest(0, 0.0, [3, 4, 5], 3))     # one token longer: a wrong mirror of the finish rule
    for t in range(4):
        engine.step()
        if rep.begin_step() is not None:
            rep.end_step(float(t))
    assert real != sim


@st.composite
def fleets(draw, max_requests: int = 25, max_gap: float = 0.05, prefix: list[int] = PREFIX, first_id: int = 3,
           max_len: int = 60):
    """A trace: up to max_requests arrivals at most max_gap apart, half of them behind `prefix`, prompts of ids
    first_id..99 (tests/test_fleet_feature_invariants.py draws from it too)."""
    reqs, t = [], 0.0
    for i in range(draw(st.integers(1, max_requests))):
        t += draw(st.floats(0, max_gap))
        prompt = (prefix if draw(st.booleans()) else []) + draw(st.lists(st.integers(first_id, 99), min_size=1,
                                                                         max_size=max_len))
        reqs.append(SimRequest(i, t, prompt, draw(st.integers(1, 12))))
    return reqs


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(reqs=fleets(), replicas=st.integers(1, 3), num_blocks=st.integers(4, 20), max_num_seqs=st.integers(1, 5),
       budget=st.integers(2, 24), router=st.sampled_from(["round-robin", "least-tokens", "prefix-aware"]))
def test_fleet_invariants(reqs, replicas, num_blocks, max_num_seqs, budget, router):
    """Every request finishes (with its output) or is counted failed, once; the KV pool never holds more than its
    blocks and its bookkeeping stays consistent; the clock never goes back."""
    cfg = ReplicaConfig(num_blocks, 4, max_num_seqs, budget)
    clocks: list[float] = []

    def watch(rep_index):
        def on_step(now, sched):
            rep = reps[rep_index]
            bm = rep.block_manager
            held = {b for s in rep.scheduler.running for b in bm.block_table(s.seq_id)}
            assert len(held) <= bm.num_used_blocks <= bm.num_blocks
            bm.check_invariants()
            assert not clocks or now >= clocks[-1]
            clocks.append(now)
        return on_step
    reps = [Replica(CONST, cfg, on_step=watch(i)) for i in range(replicas)]
    seen = []
    res = simulate(reqs, reps, make_router(router, replicas, 4), on_finish=seen.append)
    assert sorted(f.request_id for f in seen) == [r.request_id for r in reqs]
    by_id = {r.request_id: r for r in reqs}
    for f in seen:
        r = by_id[f.request_id]
        if f.failed:
            assert r.prompt_len >= num_blocks * 4          # only a prompt the pool can never hold fails
        else:
            assert f.output_len == min(r.output_len, num_blocks * 4 - r.prompt_len)
            assert f.arrival <= f.first_scheduled <= f.first_token <= f.finished
    assert res.finished + res.failed == len(reqs)
    assert all(not r.has_work() and r.outstanding_tokens == 0 for r in reps)
    assert 0 <= res.kv_usage_mean <= res.kv_usage_peak * (1 + 1e-12) and res.kv_usage_peak <= 1   # a time-weighted mean


def test_the_clock_check_can_fail():
    with pytest.raises(AssertionError, match="clock went back"):
        simulate([SimRequest(0, 1.0, [3, 4], 2), SimRequest(1, 0.5, [3, 4], 2)], [Replica(CONST, ReplicaConfig(8))],
                 make_router("round-robin", 1))


def test_latency_stats_stay_bounded_and_accurate():
    """Past its exact store a LatencyStats answers from 2 %-wide log buckets: percentiles within 1 %."""
    xs = np.random.default_rng(0).lognormal(-3, 1.2, 50_000)
    s = LatencyStats(exact_limit=1000)
    for x in xs:
        s.add(float(x))
    assert not s.exact and len(s._exact) == 1000
    for q in (0.5, 0.9, 0.99):
        assert s.quantile(q) == pytest.approx(np.quantile(xs, q), rel=0.012)
    assert s.mean == pytest.approx(xs.mean())


def test_simulator_speed_is_measured(record_duration):
    """How fast the real-Scheduler path runs (recorded, not judged): wall seconds per 1,000 simulated requests of
    the chat mix on 4 roofline replicas of llama-3.1-8b on H100s at 100 requests/s."""
    sm = from_roofline("llama-3.1-8b", "h100-sxm")
    res = simulate(workloads.chat(100, 4, seed=0), [Replica(sm, ReplicaConfig.of(sm)) for _ in range(4)],
                   make_router("least-tokens", 4))
    assert res.finished > 300 and res.failed == 0
    record_duration("fleet simulate: wall s per 1000 simulated chat requests", 1000 * res.wall_s / res.finished)
