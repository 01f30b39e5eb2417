"""`minillm fleet plan`: the sizing is monotone (more load never needs fewer GPUs, a looser SLO never costs more),
the recommendation meets its own SLO when the whole fleet is simulated, and an impossible SLO says what fails."""
from __future__ import annotations

from dataclasses import replace

import pytest

from minillm.catalog import hardware_spec
from minillm.cli import main
from minillm.fleet.planner import Demand, check, fixed_lengths, plan, simulate_slice, size
from minillm.fleet.replica import ReplicaConfig
from minillm.fleet.step_model import from_roofline

SM = from_roofline("llama-3.1-8b", "h100-sxm")
CFG = ReplicaConfig.of(SM)


def gpus(lay) -> float:
    return float("inf") if lay.rejected else lay.gpus


def test_more_load_never_needs_fewer_gpus_and_a_looser_slo_never_costs_more():
    for tp in (1, 2):
        sm = from_roofline("llama-3.1-8b", "h100-sxm", tp=tp)
        cfg = ReplicaConfig.of(sm)
        load = [gpus(size(sm, cfg, Demand(rps, 800, 150, 0.3, 0.05), tp)) for rps in (1, 5, 20, 60, 200, 1000)]
        assert load == sorted(load) and load[0] == tp and load[-1] > load[0]
        for slos in ([Demand(200, 800, 150, 5.0, tpot) for tpot in (0.008, 0.01, 0.012, 0.05, 1.0)],
                     [Demand(200, 800, 150, ttft, 1.0) for ttft in (0.01, 0.02, 0.05, 1.0)]):
            cost = [gpus(size(sm, cfg, d, tp)) for d in slos]
            assert cost == sorted(cost, reverse=True)
            if tp == 1:      # where latency, not throughput, binds: the loosening shows
                assert cost[0] > cost[-1]
    best = [plan("llama-3.1-70b", "h100-sxm", Demand(rps, 1000, 200, 0.2, 0.05), verify=0).layouts[0].gpus
            for rps in (10, 100, 1000)]
    assert best == sorted(best) and best[0] < best[-1]


def test_the_capacity_is_the_edge_of_the_constraints():
    """Just below the sized capacity every constraint holds; 5 % above, one breaks (the bisection is not lazy)."""
    d = Demand(50, 1000, 200, 0.2, 0.03)
    lay = size(SM, CFG, d, 1)
    assert check(SM, CFG, 0.999 * lay.capacity_rps, d, 0.8)[0] == ""
    assert check(SM, CFG, 1.05 * lay.capacity_rps, d, 0.8)[0] != ""


def test_the_recommendation_meets_its_slo_on_the_whole_fleet():
    """Verified on a one-replica slice; the whole recommended fleet, simulated with another seed, meets it too."""
    d = Demand(40, 1000, 100, 0.25, 0.05)
    p = plan("llama-3.1-8b", "h100-sxm", d, verify=1, duration=8, slice_replicas=1)
    best = p.best
    assert best is not None and best.verified is not None and best.replicas >= 2
    sm = from_roofline("llama-3.1-8b", "h100-sxm", tp=best.tp)
    res = simulate_slice(sm, ReplicaConfig.of(sm), d, best.replicas, duration=8, slice_replicas=best.replicas,
                         seed=1)
    assert res.failed == 0 and res.finished > 200
    assert res.ttft.quantile(0.99) <= d.ttft_p99_s and res.tpot.quantile(0.99) <= d.tpot_p99_s


def test_plan_from_the_command_line(capsys):
    assert main(["fleet", "plan", "--model", "llama-3.1-8b", "--gpu", "h100", "--rps", "20", "--slo",
                 "ttft_p99=300ms,tpot_p99=50ms", "--prompt-len", "500", "--output-len", "50", "--duration", "5",
                 "--price-per-gpu-hour", "2"]) == 0
    out = capsys.readouterr().out
    assert "recommended: " in out and "per million output tokens" in out and "runner-ups:" in out
    assert "$2/GPU-hour" in out


def test_an_impossible_slo_says_which_constraint_fails(capsys):
    assert main(["fleet", "plan", "--model", "llama-3.1-8b", "--gpu", "h100", "--rps", "5", "--slo",
                 "ttft_p99=300ms,tpot_p99=1ms", "--prompt-len", "500", "--output-len", "50"]) == 1
    out = capsys.readouterr().out
    assert "no layout verified" in out and "TPOT" in out and "> 80% of 1 ms" in out


@pytest.mark.parametrize("argv, says", [
    (["--model", "llama-9"], "unknown model 'llama-9'; known: "),
    (["--gpu", "h999"], "unknown GPU 'h999'; known: "),
    (["--slo", "ttft_p99=200ms"], "needs both ttft_p99 and tpot_p99"),
    (["--rps", "0"], "--rps must be a positive number"),
    (["--prefix-len", "100"], "--prefix-len must be in [0, --prompt-len)"),
])
def test_plan_bad_input(capsys, argv, says):
    base = {"--model": "llama-3.1-8b", "--gpu": "h100", "--rps": "10", "--slo": "ttft_p99=200ms,tpot_p99=50ms",
            "--prompt-len": "100", "--output-len": "10"}
    base.update(dict(zip(argv[::2], argv[1::2])))
    assert main(["fleet", "plan", *[x for kv in base.items() for x in kv]]) == 2
    err = capsys.readouterr().err
    assert says in err and "\n" not in err.strip()


def test_a_disaggregated_split_is_sized_per_pool_and_holds_when_simulated():
    """With --disaggregate each TP also gets a P:D split, each pool from its own capacity (a prefill replica
    answers to TTFT, a decode replica to TPOT); the whole split fleet, simulated with its KV link, meets the SLO."""
    d = Demand(60, 1000, 100, 0.25, 0.05)
    lay = size(SM, CFG, d, 1, disaggregate=True)
    assert lay.split is not None and lay.replicas == sum(lay.split) and not lay.rejected
    unified = size(SM, CFG, d, 1)
    assert lay.split[0] >= 1 and lay.split[1] >= 1 and unified.split is None
    res = simulate_slice(SM, CFG, d, lay.replicas, duration=8, slice_replicas=lay.replicas, seed=1,
                         split=lay.split, link_gbps=400)
    assert res.layout == f"{lay.split[0]}P:{lay.split[1]}D" and res.failed == 0 and res.finished > 300
    assert res.decode_pool_prefill_tokens == 0
    assert res.ttft.quantile(0.99) <= d.ttft_p99_s and res.tpot.quantile(0.99) <= d.tpot_p99_s
    labels = [x.label for x in plan("llama-3.1-8b", "h100-sxm", d, verify=0, disaggregate=True).layouts]
    assert f"TP=1 {lay.split[0]}P:{lay.split[1]}D" in labels and "TP=1" in labels


def test_a_shared_prefix_is_prefilled_once_per_replica_and_never_costs_more():
    """--prefix-len: the sizing counts only the tokens after the shared prefix, so a longer shared prefix never
    needs more GPUs; the simulated requests really share it, and the replicas' prefix caches hit on all of its
    full blocks after each replica's first request."""
    sized = [gpus(size(SM, CFG, Demand(200, 1000, 50, 0.2, 0.05, prefix_len=c), 1)) for c in (0, 300, 600, 900)]
    assert sized == sorted(sized, reverse=True) and sized[0] > sized[-1]
    reqs = list(fixed_lengths(20, 2, 100, 5, seed=3, prefix_len=40))
    assert len({tuple(r.prompt[:40]) for r in reqs}) == 1 and len({tuple(r.prompt[40:]) for r in reqs}) == len(reqs)
    d = Demand(20, 100, 5, 1.0, 1.0, prefix_len=40)
    res = simulate_slice(SM, CFG, d, replicas=2, duration=4, slice_replicas=2)
    full_blocks = 40 // CFG.block_size * CFG.block_size
    assert res.finished > 40 and res.cached_tokens == (res.finished - 2) * full_blocks
    with pytest.raises(ValueError, match="prefix_len=100 must be in"):
        Demand(1, 100, 5, 1.0, 1.0, prefix_len=100)


def test_more_bandwidth_never_needs_more_gpus():
    """The planner's sizing on an H100 whose HBM is 1.5x or 3x faster: never more GPUs for the same demand (long
    answers under a tight TPOT, where the weight and KV reads bind, so faster memory needs strictly fewer)."""
    h100 = hardware_spec("h100-sxm")
    d = Demand(300, 200, 1000, 1.0, 0.012)
    needed = []
    for f in (1.0, 1.5, 3.0):
        sm = from_roofline("llama-3.1-8b", replace(h100, hbm_gb_s=h100.hbm_gb_s * f))
        needed.append(gpus(size(sm, ReplicaConfig.of(sm), d, 1)))
    assert needed == sorted(needed, reverse=True) and needed[-1] < needed[0]
