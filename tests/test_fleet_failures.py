"""Replica failures: requests in flight are retried elsewhere (resuming after the tokens already streamed) or
counted failed, exactly once each; the work a failure throws away is counted, and the fleet really redoes it."""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from minillm.fleet import workloads
from minillm.fleet.policies import Autoscaler, FailurePlan, Slo
from minillm.fleet.replica import Replica, ReplicaConfig
from minillm.fleet.routers import make_router
from minillm.fleet.simulator import simulate
from minillm.fleet.step_model import COEFFS, StepModel

CONST = StepModel(dict.fromkeys(COEFFS, 0.0) | {"o_step": 0.01, "c_token": 0.001})
# No prefix cache and a pool that never preempts: every computed KV position is either kept or lost to a failure.
CFG = ReplicaConfig(num_blocks=4096, block_size=4, max_num_seqs=8, max_num_batched_tokens=32,
                    enable_prefix_caching=False)


def run(reqs, failures: FailurePlan, retries: int = 2, replicas: int = 3, slo: Slo | None = None, **kw):
    seen = []
    reps = [Replica(CONST, CFG) for _ in range(replicas)]
    res = simulate(reqs, reps, make_router("round-robin", replicas), failures=failures, retries=retries, slo=slo,
                   new_replica=lambda: Replica(CONST, CFG), on_finish=seen.append, **kw)
    return res, seen


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(times=st.lists(st.tuples(st.floats(0.05, 3.0), st.integers(0, 2)), min_size=1, max_size=3),
       retries=st.integers(0, 2), repair=st.sampled_from([None, 0.5]))
def test_every_request_ends_once_and_lost_work_is_what_gets_recomputed(times, retries, repair):
    """Whatever fails when: each request finishes or fails exactly once; a finished one has its full length;
    and the fleet computed exactly (prompt + output - 1) KV positions per finished request plus the lost tokens
    (what failed replicas had computed for requests in flight), so lost work is neither hidden nor invented."""
    reqs = list(workloads.chat(6, 3, seed=3, scale=0.15))
    res, seen = run(reqs, FailurePlan(tuple(times), repair_s=repair), retries)
    assert sorted(f.request_id for f in seen) == [r.request_id for r in reqs]
    assert res.finished + res.failed == len(reqs)
    by_id = {r.request_id: r for r in reqs}
    for f in seen:
        if not f.failed:
            r = by_id[f.request_id]
            assert (f.output_len, f.prompt_len, f.arrival) == (r.output_len, r.prompt_len, r.arrival)
            assert f.arrival <= f.first_scheduled <= f.first_token <= f.finished
    kept = sum(f.prompt_len + f.output_len - 1 for f in seen if not f.failed)
    assert res.prefill_tokens + res.decode_tokens == kept + res.lost_tokens
    assert res.replica_failures <= len(times) and res.preemptions == 0


def test_the_lost_work_count_can_fail():
    """A count that forgot the retried requests' recompute (lost_tokens = 0) would break the balance above."""
    reqs = list(workloads.chat(6, 3, seed=3, scale=0.15))
    res, seen = run(reqs, FailurePlan(((1.0, 0),)))
    kept = sum(f.prompt_len + f.output_len - 1 for f in seen if not f.failed)
    assert res.lost_tokens > 0 and res.prefill_tokens + res.decode_tokens != kept


def test_no_retries_fails_exactly_the_requests_in_flight():
    """retries=0: the requests the dead replica held fail, once; the others finish; its pending step is void."""
    reqs = list(workloads.chat(6, 3, seed=3, scale=0.15))
    res_ok, _ = run(reqs, FailurePlan())
    res, seen = run(reqs, FailurePlan(((1.0, 0),)), retries=0, replicas=3)
    assert res.failed >= 1 and res.retried == 0 and res.replica_failures == 1
    assert res.failed + res.finished == len(reqs) == res_ok.finished
    assert len({f.request_id for f in seen}) == len(reqs)


def test_a_retried_request_keeps_its_first_token_and_arrival():
    """One replica dies mid-answer; the request resumes on the other after the tokens it had streamed: its TTFT
    is the first attempt's, it finishes with its full length, and its TPOT shows the stall."""
    reqs = [workloads.SimRequest(0, 0.0, list(range(3, 23)), 30)]
    res, seen = run(reqs, FailurePlan(((0.2, 0),)), replicas=2)
    ok, seen_ok = run(reqs, FailurePlan(), replicas=2)
    f, g = seen[0], seen_ok[0]
    assert not f.failed and f.output_len == 30 and f.first_token == pytest.approx(g.first_token)
    assert f.finished > g.finished and res.retried == 1
    # the dead replica had computed the prompt (20) and one KV position per decode step (11 ms) done by t = 0.2
    decodes = int((0.2 - g.first_token) / 0.011)
    assert g.first_token == pytest.approx(0.03) and decodes == 15
    assert res.lost_tokens == 20 + decodes


def test_slo_attainment_counts_failed_requests_as_misses():
    reqs = list(workloads.chat(6, 3, seed=3, scale=0.15))
    slo = Slo.parse("ttft=60ms,tpot=12ms")
    res, seen = run(reqs, FailurePlan(((1.0, 0),)), retries=0, slo=slo)
    met = sum(1 for f in seen if not f.failed and f.first_token - f.arrival <= 0.06 and
              (f.output_len < 2 or (f.finished - f.first_token) / (f.output_len - 1) <= 0.012))
    assert 0 < met < len(reqs) and res.slo_met == met
    assert res.slo_attainment == pytest.approx(met / len(reqs))
    assert res.failed > 0


def test_random_failures_are_seeded_and_replaced_by_the_autoscaler():
    """--mtbf draws the same failures for the same seed; an autoscaled fleet replaces dead replicas (min replicas)
    after the cold start; requests nobody can take in between fail, once."""
    reqs = list(workloads.chat(6, 6, seed=3, scale=0.15))
    plan = FailurePlan(mtbf_s=2.0, seed=7)
    scaler = Autoscaler("queue", 0.1, 100, min_replicas=2, max_replicas=3, cold_start_s=0.5, interval_s=0.25)
    a, seen = run(reqs, plan, replicas=2, autoscaler=scaler)
    b, _ = run(reqs, plan, replicas=2, autoscaler=scaler)
    assert str(a.row() | {"sim_req_per_wall_s": 0}) == str(b.row() | {"sim_req_per_wall_s": 0})   # nan-safe
    assert a.replica_failures >= 2 and a.finished + a.failed == len(reqs) == len({f.request_id for f in seen})
    assert max(billed for _, _, billed in a.timeline) <= 3 and a.timeline[-1][1] >= 1


def test_flags_parse():
    assert FailurePlan.parse_at("12.5:3") == (12.5, 3)
    assert Slo.parse("ttft=200ms,tpot=0.05s") == Slo(0.2, 0.05)
    for bad in ("3", "x:1", "-1:0"):
        with pytest.raises(ValueError, match="T:REPLICA"):
            FailurePlan.parse_at(bad)
    with pytest.raises(ValueError, match="ttft=DURATION"):
        Slo.parse("p99=3ms")
