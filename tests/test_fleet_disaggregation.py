"""Disaggregated prefill/decode: the first token comes from the prefill pool (TTFT), the prompt's KV crosses the
link, the decode pool admits it with its prompt computed and never runs a prefill chunk."""
from __future__ import annotations

import math

import pytest

from minillm.fleet import workloads
from minillm.fleet.policies import KVLink
from minillm.fleet.replica import Replica, ReplicaConfig
from minillm.fleet.routers import make_router
from minillm.fleet.simulator import simulate
from minillm.fleet.step_model import COEFFS, StepFeatures, StepModel
from minillm.fleet.workloads import SimRequest

# 10 ms a step + 1 ms a token: a prefill of P tokens takes 10 + P ms, a decode of one sequence 11 ms.
CONST = StepModel(dict.fromkeys(COEFFS, 0.0) | {"o_step": 0.01, "c_token": 0.001})
CFG = ReplicaConfig(num_blocks=256, block_size=4, max_num_seqs=8, max_num_batched_tokens=64)


def run(reqs, link: KVLink | None, prefill: int = 1, decode: int = 1, cfg: ReplicaConfig = CFG):
    seen = []
    pre = [Replica(CONST, cfg) for _ in range(prefill)]
    dec = [Replica(CONST, cfg) for _ in range(decode)] if link is not None else []
    res = simulate(reqs, pre, make_router("least-tokens", prefill), decode_replicas=dec, kv_link=link,
                   on_finish=seen.append)
    return res, {f.request_id: f for f in seen}, pre, dec


def test_one_request_on_an_instant_link_meets_the_step_model_bounds():
    """Alone in the fleet: TTFT = one prefill step of the prompt, TPOT = one decode step, e2e = their sum."""
    req = SimRequest(0, 0.0, list(range(3, 43)), 5)      # 40 prompt tokens, 5 output tokens
    res, done, pre, dec = run([req], KVLink(1e6, math.inf))
    f = done[0]
    prefill_s = CONST.seconds(StepFeatures.of([(0, 40, 40)]))
    decode_s = CONST.seconds(StepFeatures.of([(40, 1, 40)]))
    assert f.first_token == pytest.approx(prefill_s) and prefill_s == pytest.approx(0.05)
    assert f.finished == pytest.approx(prefill_s + 4 * decode_s)
    assert res.tpot.quantile(0.5) == pytest.approx(decode_s)
    assert f.output_len == 5 and res.finished == 1 and res.layout == "1P:1D"
    assert pre[0].decode_tokens == 0 and pre[0].prefill_tokens == 40
    assert dec[0].prefill_tokens == 0 and dec[0].decode_tokens == 4


def test_a_slower_link_delays_decoding_not_the_first_token():
    """KV transfer = prompt tokens x bytes per token / bandwidth: 40 x 1 MB at 8 Gbit/s = 40 ms, between the first
    token and the second. TTFT does not move; TPOT and e2e grow by exactly the transfer."""
    req = SimRequest(0, 0.0, list(range(3, 43)), 5)
    _, fast, _, _ = run([req], KVLink(1e6, math.inf))
    res, slow, _, _ = run([req], KVLink(1e6, 8.0))
    assert KVLink(1e6, 8.0).seconds(40) == pytest.approx(0.04)
    assert slow[0].first_token == pytest.approx(fast[0].first_token)
    assert slow[0].finished - fast[0].finished == pytest.approx(0.04)
    assert res.kv_transfer.quantile(0.5) == pytest.approx(0.04)
    assert res.tpot.quantile(0.5) == pytest.approx((0.04 + 4 * 0.011) / 4)


def test_without_contention_disaggregation_matches_one_replica():
    """Requests far apart (each done before the next arrives), an instant link: every request's TTFT, finish time
    and output length equal a single unified replica's. A one-token answer never leaves the prefill pool."""
    reqs = [SimRequest(i, 2.0 * i, list(range(3 + i, 3 + i + 7 + 9 * i)), 1 + 3 * (i % 4)) for i in range(8)]
    _, unified, _, _ = run(reqs, None)
    res, disagg, _, dec = run(reqs, KVLink(1e6, math.inf))
    for i in range(8):
        u, d = unified[i], disagg[i]
        assert (d.first_token, d.finished, d.output_len) == pytest.approx((u.first_token, u.finished, u.output_len))
    assert dec[0].decode_tokens == sum(r.output_len - 1 for r in reqs)


def test_the_decode_pool_never_prefills_under_load():
    """A loaded 2P:2D fleet on the chat mix: every request finishes with its length, the decode pool computes no
    prompt token (its sequences arrive computed) and the prefill pool no decode."""
    reqs = list(workloads.chat(40, 2, seed=1, scale=0.1))
    res, done, pre, dec = run(reqs, KVLink(2e5, 100.0), 2, 2,
                              ReplicaConfig(num_blocks=2048, block_size=4, max_num_seqs=16,
                                            max_num_batched_tokens=64))
    assert res.finished == len(reqs) and res.failed == 0 and res.preemptions == 0
    assert all(done[r.request_id].output_len == r.output_len for r in reqs)
    assert res.decode_pool_prefill_tokens == 0 and all(d.prefill_tokens == 0 for d in dec)
    assert all(p.decode_tokens == 0 for p in pre) and sum(d.decode_tokens for d in dec) > 0
    assert res.kv_transfer.count == sum(r.output_len > 1 for r in reqs)


def test_the_decode_pool_check_can_fail():
    """Admitting a transferred request the ordinary way (add, not add_prefilled) would recompute its prompt on the
    decode replica: the counter the test above reads sees it."""
    rep = Replica(CONST, CFG)
    rep.add(SimRequest(0, 0.0, list(range(3, 43)) + [7], 4))
    while rep.has_work():
        rep.begin_step()
        rep.end_step(0.0)
    assert rep.prefill_tokens == 41
