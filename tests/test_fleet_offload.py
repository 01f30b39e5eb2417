"""KV offload to host memory: blocks the device pool evicts go to a host tier; a prompt that continues into them
loads them over PCIe (charged to the step) instead of recomputing them."""
from __future__ import annotations

import pytest

from minillm.fleet import workloads
from minillm.fleet.offload import HostTier
from minillm.fleet.replica import Replica, ReplicaConfig
from minillm.fleet.routers import make_router
from minillm.fleet.simulator import simulate
from minillm.fleet.step_model import COEFFS, StepFeatures, StepModel
from minillm.fleet.workloads import SimRequest

CONST = StepModel(dict.fromkeys(COEFFS, 0.0) | {"o_step": 0.01, "c_token": 0.001})
CFG = ReplicaConfig(num_blocks=6, block_size=4, max_num_seqs=4, max_num_batched_tokens=64)
A = list(range(3, 20))          # 17 tokens: 4 full blocks and one more token
B = list(range(100, 121))       # 21 tokens: six blocks, the whole pool: every cached block of A goes


def drain(rep: Replica) -> list[float]:
    durations = []
    while rep.has_work():
        durations.append(rep.begin_step())
        rep.end_step(0.0)
    return durations


def revisit(host: HostTier | None) -> tuple[Replica, list[float]]:
    rep = Replica(CONST, CFG, host=host)
    for i, prompt in enumerate((A, B)):
        rep.add(SimRequest(i, 0.0, prompt, 1))
        drain(rep)
    rep.add(SimRequest(2, 0.0, A, 1))
    rep.begin_step()
    seq = rep.scheduler.running[0]
    return rep, [seq.metrics.num_cached_tokens, seq.num_computed_tokens]


def test_an_evicted_prefix_comes_back_from_host_for_the_price_of_a_transfer():
    """A's four blocks are evicted by B. Without a host tier A's return recomputes 17 tokens; with one its four
    blocks load from host (16 cached tokens) and the step costs one token's compute plus 4 block transfers."""
    rep, (cached, computed) = revisit(None)
    assert cached == 0 and computed == 0 and rep.block_manager.stats.evictions >= 4
    host = HostTier(capacity_blocks=100, block_bytes=4 * 1000, bytes_per_s=1e6)     # 4 ms a block
    rep = Replica(CONST, CFG, host=host)
    for i, prompt in enumerate((A, B)):
        rep.add(SimRequest(i, 0.0, prompt, 1))
        drain(rep)
    assert host.stored >= 4
    rep.add(SimRequest(2, 0.0, A, 1))
    dt = rep.begin_step()
    seq = rep.scheduler.running[0]
    assert seq.metrics.num_cached_tokens == 16 and host.loaded == 4
    assert dt == pytest.approx(CONST.seconds(StepFeatures.of([(16, 1, 17)])) + 4 * 0.004)
    assert host.seconds == pytest.approx(0.016)
    rep.end_step(1.0)
    rep.block_manager.check_invariants()


def test_a_host_tier_too_small_holds_nothing():
    rep, (cached, _) = revisit(HostTier(capacity_blocks=0, block_bytes=4000, bytes_per_s=1e6))
    assert cached == 0 and rep.host.loaded == 0


def test_offload_raises_the_hit_rate_on_multi_turn_chat():
    """Sessions whose history the small device pool cannot keep: with a host tier the fleet's prefix hit rate is
    at least the device-only one (here well above), and the loads are charged (PCIe seconds = blocks x time)."""
    cfg = ReplicaConfig(num_blocks=96, block_size=4, max_num_seqs=8, max_num_batched_tokens=64)

    def run(host_blocks: int | None):
        reps = [Replica(CONST, cfg, host=None if host_blocks is None else HostTier(host_blocks, 4000, 1e8))
                for _ in range(2)]
        reqs = workloads.multi_turn(3, 40, seed=2, scale=0.1, think_s=3.0)
        return simulate(reqs, reps, make_router("prefix-aware", 2, 4))
    without, with_host = run(None), run(4096)
    assert with_host.finished == without.finished > 50 and with_host.failed == 0
    assert with_host.prefix_hit_rate > without.prefix_hit_rate + 0.05
    assert with_host.host_loaded_blocks > 0
    assert with_host.host_seconds == pytest.approx(with_host.host_loaded_blocks * 4000 / 1e8)
    assert with_host.host_loaded_blocks * 4 <= with_host.cached_tokens
