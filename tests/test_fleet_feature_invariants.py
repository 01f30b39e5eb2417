"""The fleet features together under hypothesis: small pools (preemption, decode-pool recompute), a host KV tier,
failures with retries and repairs, autoscaling. Every request finishes with its length or is counted failed,
exactly once; each replica's KV bookkeeping stays consistent at every step; nothing is left behind."""
from __future__ import annotations

import math

from hypothesis import HealthCheck, event, given, settings, strategies as st

from minillm.fleet.offload import HostTier
from minillm.fleet.policies import Autoscaler, FailurePlan, KVLink
from minillm.fleet.replica import Replica, ReplicaConfig
from minillm.fleet.routers import make_router
from minillm.fleet.simulator import simulate
from tests.test_fleet_replica import CONST, fleets

PREFIX = list(range(5, 18))


def requests():
    return fleets(max_requests=20, max_gap=0.03, prefix=PREFIX, first_id=20, max_len=40)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(reqs=requests(), num_blocks=st.integers(6, 24), budget=st.integers(4, 24), offload=st.booleans(),
       mode=st.sampled_from(["disaggregated", "failing", "autoscaled"]), fail_t=st.floats(0.005, 0.3),
       router=st.sampled_from(["round-robin", "least-tokens", "prefix-aware"]))
def test_fleet_features_keep_every_request_and_the_pools_consistent(reqs, num_blocks, budget, offload, mode, fail_t,
                                                                   router):
    cfg = ReplicaConfig(num_blocks, 4, 3, budget)

    def on_step(now, sched):
        for r in made:
            r.block_manager.check_invariants()
            assert r.block_manager.num_used_blocks <= r.block_manager.num_blocks
    made: list[Replica] = []

    def new_replica() -> Replica:
        made.append(Replica(CONST, cfg, on_step, HostTier(64, 4000, 1e8) if offload else None))
        return made[-1]
    kw: dict = {}
    if mode == "disaggregated":
        kw = {"decode_replicas": [new_replica()], "kv_link": KVLink(1e4, 1.0)}
    elif mode == "failing":
        kw = {"failures": FailurePlan(((fail_t, 0),), repair_s=0.2), "retries": 1}
    else:
        kw = {"autoscaler": Autoscaler("queue", 0.5, 1.0, 1, 3, cold_start_s=0.05, interval_s=0.05),
              "failures": FailurePlan(((fail_t, 1),)), "retries": 2}
    seen = []
    res = simulate(reqs, [new_replica() for _ in range(2)], make_router(router, 3, 4), new_replica=new_replica,
                   on_finish=seen.append, **kw)
    assert sorted(f.request_id for f in seen) == [r.request_id for r in reqs]
    by_id = {r.request_id: r for r in reqs}
    pool = num_blocks * 4
    for f in seen:
        r = by_id[f.request_id]
        if f.failed:
            continue
        assert f.output_len == min(r.output_len, pool - r.prompt_len) and f.prompt_len == r.prompt_len
        assert f.arrival <= f.first_scheduled <= f.first_token <= f.finished
    refused = sum(r.prompt_len >= pool for r in reqs)
    assert res.failed >= refused and (mode != "disaggregated" or res.failed == refused)
    event(f"{mode}: preempted {res.preemptions > 0}, retried {res.retried > 0}, host loads "
          f"{res.host_loaded_blocks > 0}, decode-pool recompute {res.decode_pool_prefill_tokens > 0}")
    assert not any(r.has_work() for r in made) and all(r.outstanding_tokens == 0 for r in made)
    assert 0 <= res.kv_usage_mean <= res.kv_usage_peak <= 1 and math.isfinite(res.replica_seconds)
