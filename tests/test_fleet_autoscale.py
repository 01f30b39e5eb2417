"""Autoscaling: a step in load starts replicas that take requests only after the cold start, never more than the
ceiling; a quiet fleet drains replicas, which finish what they hold; cost is the billed replica time."""
from __future__ import annotations

import pytest

from minillm.fleet.policies import Autoscaler
from minillm.fleet.replica import Replica, ReplicaConfig
from minillm.fleet.routers import make_router
from minillm.fleet.simulator import simulate
from minillm.fleet.step_model import COEFFS, StepModel
from minillm.fleet.workloads import SimRequest

CONST = StepModel(dict.fromkeys(COEFFS, 0.0) | {"o_step": 0.01, "c_token": 0.001})
CFG = ReplicaConfig(num_blocks=512, block_size=4, max_num_seqs=4, max_num_batched_tokens=64)


def step_load(low_rate: float, high_rate: float, switch: float, end: float, out: int = 20) -> list[SimRequest]:
    """Evenly spaced requests: `low_rate` per second until `switch`, then `high_rate` until `end`."""
    reqs, t, i = [], 0.0, 0
    while t < end:
        reqs.append(SimRequest(i, t, [3 + i % 50] + list(range(100, 111)), out))
        t += 1 / (low_rate if t < switch else high_rate)
        i += 1
    return reqs


def run(reqs, scaler: Autoscaler, replicas: int = 1, router: str = "least-tokens"):
    seen = []
    res = simulate(reqs, [Replica(CONST, CFG) for _ in range(replicas)],
                   make_router(router, scaler.max_replicas), autoscaler=scaler,
                   new_replica=lambda: Replica(CONST, CFG), on_finish=seen.append)
    return res, seen


@pytest.mark.parametrize("router", ["least-tokens", "prefix-aware"])
def test_a_load_step_scales_up_after_the_cold_start_and_never_past_the_ceiling(router):
    """One replica holds 1 request/s; at t = 10 s the load jumps to 40/s. Replicas are billed from the decision
    and routable exactly cold_start later; none before the load step; at most max_replicas."""
    scaler = Autoscaler("queue", low=0.5, high=2.0, min_replicas=1, max_replicas=3, cold_start_s=4.0,
                        interval_s=1.0)
    res, seen = run(step_load(1, 40, 10, 25), scaler, router=router)
    tl = res.timeline
    assert tl[0] == (0.0, 1, 1)
    first_billed = next(t for t, _, billed in tl if billed > 1)
    first_up = next(t for t, up, _ in tl if up > 1)
    assert 10 <= first_billed and first_up == pytest.approx(first_billed + 4.0)
    assert max(b for _, _, b in tl) == 3 and all(up <= b <= 3 for _, up, b in tl)
    assert res.finished == len(seen) == len(step_load(1, 40, 10, 25)) and res.failed == 0
    # cost: the integral of the billed count; a fixed fleet of one would bill just the makespan
    billed = sum((t1 - t0) * b for (t0, _, b), (t1, _, _) in zip(tl, tl[1:]))
    assert res.replica_seconds == pytest.approx(billed)
    assert res.replica_seconds > tl[-1][0]


def test_the_cold_start_is_what_delays_the_new_replicas():
    """The same load with an instant start: the second replica is routable at the decision itself."""
    scaler = Autoscaler("queue", low=0.5, high=2.0, min_replicas=1, max_replicas=3, cold_start_s=0.0,
                        interval_s=1.0)
    res, _ = run(step_load(1, 40, 10, 25), scaler)
    first_billed = next(t for t, _, billed in res.timeline if billed > 1)
    assert next(t for t, up, _ in res.timeline if up > 1) == first_billed


def test_draining_loses_no_request():
    """Busy, then quiet: the autoscaler drains replicas while they still hold requests (long answers, an empty
    queue); every request finishes exactly once, with its full length, and none fails."""
    scaler = Autoscaler("queue", low=0.5, high=1.0, min_replicas=1, max_replicas=4, cold_start_s=1.0,
                        interval_s=0.5)
    reqs = step_load(40, 0.5, 6, 30, out=150)
    res, seen = run(reqs, scaler, replicas=4)
    assert sorted(f.request_id for f in seen) == [r.request_id for r in reqs]
    assert res.failed == 0 and all(f.output_len == 150 for f in seen)
    assert res.drained >= 1 and res.drained_in_flight >= 1
    assert res.timeline[-1][2] < 4


def test_kv_and_token_rate_signals_scale_too():
    reqs = step_load(1, 40, 10, 20)
    for scaler in (Autoscaler("kv", 0.001, 0.01, 1, 3, 2.0, 1.0), Autoscaler("tokens", 10, 200, 1, 3, 2.0, 1.0)):
        res, _ = run(reqs, scaler)
        assert max(b for _, _, b in res.timeline) > 1 and res.failed == 0


def test_the_rule_itself():
    a = Autoscaler("queue", low=1, high=4, min_replicas=2, max_replicas=10)
    assert a.decide(value=8, up=3, starting=0) == 3          # ceil(3 x 8 / 4) = 6 replicas
    assert a.decide(value=8, up=3, starting=3) == 0          # already on their way
    assert a.decide(value=100, up=3, starting=0) == 7        # capped at 10
    assert a.decide(value=0.5, up=3, starting=0) == -1
    assert a.decide(value=0.5, up=2, starting=0) == 0        # the floor
    assert a.decide(value=2, up=1, starting=0) == 1          # below the floor (a replica died): replace
    with pytest.raises(ValueError, match="unknown autoscaling signal 'gpu'"):
        Autoscaler.parse("gpu:1:2")
    with pytest.raises(ValueError, match="LOW < HIGH"):
        Autoscaler.parse("queue:4:1")
