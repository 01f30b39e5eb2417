"""Routers: prefix-aware keeps requests that share leading blocks together (unless overloaded), its load bound
holds, and a router hashing the whole prompt would fail the shared-prefix property."""
from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
from hypothesis import given, settings, strategies as st

from minillm.fleet import cli as fleet_cli, routers, workloads
from minillm.fleet.replica import Replica, ReplicaConfig
from minillm.fleet.routers import LeastTokens, PrefixAware, RoundRobin, Router, leading_block_hash
from minillm.fleet.simulator import simulate
from minillm.fleet.step_model import COEFFS, StepModel
from minillm.fleet.workloads import SimRequest


@dataclass
class Load:
    outstanding_tokens: int = 0
    num_requests: int = 0


def req(i: int, prompt: list[int]) -> SimRequest:
    return SimRequest(i, 0.0, prompt, 1)


class WholePrompt(PrefixAware):
    """The mistake lab12 rejects: the ring key hashes the whole prompt, not its leading blocks."""

    def key(self, request):
        return leading_block_hash(request.prompt, self.block_size, 10 ** 9) & ((1 << 64) - 1)


def shared_prefix_groups(router: Router, n_groups: int = 6, per_group: int = 8) -> list[set[int]]:
    """Route groups of prompts that share 4 leading blocks (then differ) on an unloaded fleet of 4."""
    loads = [Load() for _ in range(4)]
    out = []
    for g in range(n_groups):
        prefix = [1000 * g + k for k in range(64)]
        out.append({router.route(req(g * 100 + j, prefix + [7, j, j + 1] * (j + 1)), loads)
                    for j in range(per_group)})
    return out


def test_prefix_aware_sends_a_shared_prefix_to_one_replica():
    groups = shared_prefix_groups(PrefixAware(4, block_size=16, prefix_blocks=4))
    assert all(len(g) == 1 for g in groups)
    assert len(set.union(*groups)) > 1          # different prefixes spread over the ring


def test_whole_prompt_hashing_fails_the_shared_prefix_property():
    groups = shared_prefix_groups(WholePrompt(4, block_size=16, prefix_blocks=4))
    assert any(len(g) > 1 for g in groups)


def test_the_key_is_the_prefix_caches_block_hash():
    p = list(range(100))
    assert leading_block_hash(p, 16, 2) == leading_block_hash(p[:32] + [9] * 50, 16, 2)
    assert leading_block_hash(p, 16, 2) != leading_block_hash(p[:31] + [9] * 50, 16, 2)
    assert leading_block_hash(p[:15], 16, 2) is None


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 6), eps=st.sampled_from([0.0, 0.1, 0.25, 1.0]),
       keys=st.lists(st.integers(0, 3), min_size=1, max_size=80))
def test_bounded_load_holds(n, eps, keys):
    """Even when every request carries one of a few hot prefixes, no replica takes a request that puts it above
    ceil((1 + eps) x mean)."""
    r = PrefixAware(n, block_size=4, prefix_blocks=2, epsilon=eps)
    loads = [Load() for _ in range(n)]
    for i, k in enumerate(keys):
        cap = math.ceil((1 + eps) * (sum(x.num_requests for x in loads) + 1) / n)
        j = r.route(req(i, [k] * 8), loads)
        loads[j].num_requests += 1
        assert loads[j].num_requests <= cap


def test_without_the_bound_a_hot_prefix_buries_one_replica():
    """The bound is what spreads a hot prefix: with an unbounded ring (huge epsilon) one replica takes all."""
    loads = [Load() for _ in range(4)]
    r = PrefixAware(4, block_size=4, prefix_blocks=2, epsilon=1e9)
    for i in range(40):
        loads[r.route(req(i, [1] * 8), loads)].num_requests += 1
    assert max(x.num_requests for x in loads) == 40
    loads = [Load() for _ in range(4)]
    r = PrefixAware(4, block_size=4, prefix_blocks=2, epsilon=0.25)
    for i in range(40):
        loads[r.route(req(i, [1] * 8), loads)].num_requests += 1
    assert max(x.num_requests for x in loads) <= math.ceil(1.25 * 10)


def test_round_robin_and_least_tokens():
    loads = [Load(5), Load(1), Load(3)]
    assert [RoundRobin().route(req(0, [1]), loads) for _ in range(1)] == [0]
    rr = RoundRobin()
    assert [rr.route(req(i, [1]), loads) for i in range(4)] == [0, 1, 2, 0]
    assert LeastTokens().route(req(0, [1]), loads) == 1
    assert all(isinstance(x, Router) for x in (RoundRobin(), LeastTokens(), PrefixAware(2)))


def test_cli_names_match():
    assert fleet_cli.ROUTER_NAMES == routers.ROUTERS and fleet_cli.WORKLOAD_NAMES == workloads.WORKLOADS


def test_simulate_refuses_an_object_that_is_not_a_router():
    class Wrong:
        def pick(self, request, replicas):
            return 0
    with pytest.raises(TypeError, match="lacks route of minillm.interfaces.Router"):
        simulate([], [Replica(StepModel(dict.fromkeys(COEFFS, 0.0)), ReplicaConfig(4))], Wrong())
