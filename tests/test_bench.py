"""Benchmarks: their accounting on tiny models (fast) and the CLI on the real model (slow)."""
import json
import subprocess
import sys

import pytest

from minillm.bench.kv import kv_bench, replay
from minillm.bench.throughput import percentile, run_minillm, run_transformers_static, throughput_plot
from minillm.bench.workload import WorkloadSpec, random_workload
from tests.tiny_models import load_minillm_from_dir, make_hf_model, save_hf_dir

SPEC = WorkloadSpec(num_requests=12, min_prompt=8, max_prompt=60, min_output=4, max_output=30, seed=3)


def test_kv_replay_paged_wastes_less_and_fits_more():
    wl = random_workload(128, SPEC)
    r = kv_bench(wl, budget_tokens=512, block_size=8, max_model_len=128, bytes_per_token=4)
    assert 0 <= r["paged_waste_frac"] < r["contiguous_waste_frac"] < 1
    assert r["paged_max_concurrency"] > r["contiguous_max_concurrency"] == 4
    # every request's tokens were accounted: the replay finished all of them
    assert replay(wl, 64, 8).steps > 0


def test_kv_replay_block_size_one_wastes_nothing():
    wl = random_workload(128, SPEC)
    assert replay(wl, 512, 1).waste_frac == 0


def test_kv_replay_refuses_a_pool_too_small():
    with pytest.raises(ValueError):
        replay(random_workload(128, SPEC), 2, 4)


def test_percentile_matches_definition():
    xs = [5.0, 1.0, 3.0, 2.0, 4.0]
    assert percentile(xs, 0) == 1 and percentile(xs, 50) == 3 and percentile(xs, 100) == 5
    assert percentile(xs, 25) == 2


def test_throughput_runs_count_exactly_the_requested_tokens(tmp_path):
    hf = make_hf_model(seed=0, heads=4, kv_heads=2, vocab=128)
    ours = load_minillm_from_dir(save_hf_dir(hf, tmp_path / "m"))
    wl = random_workload(128, WorkloadSpec(num_requests=5, min_prompt=4, max_prompt=20, min_output=2, max_output=9))
    want = sum(r.max_tokens for r in wl)
    mini = run_minillm(ours, None, wl, max_num_seqs=4, kv_cache_memory=2**22, progress=False)
    assert mini.output_tokens == want and len(mini.ttft_s) == 5 and mini.tok_s > 0
    static = run_transformers_static(hf, wl, batch_size=2, pad_token_id=0, progress=False)
    assert static.output_tokens == want and static.tok_s > 0
    result = {"minillm_tok_s": mini.tok_s, "baseline_by_batch_size": {2: static.tok_s}, "ratio": 1.0,
              "dtype": "float32", "workload": SPEC.as_dict()}
    throughput_plot(result, str(tmp_path / "t.png"))
    assert (tmp_path / "t.png").read_bytes()[:4] == b"\x89PNG"


def bench(*args):
    r = subprocess.run([sys.executable, "-m", "minillm", "bench", *args, "--json"], capture_output=True, text=True,
                       timeout=900)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_bench_kv_on_default_model_meets_targets():
    r = bench("kv")
    # memory accounting, not timing: paged reservation wastes < 5 %, and fits >= 3x the sequences
    assert r["paged_waste_frac"] < 0.05 and r["contiguous_waste_frac"] > 0.5 and r["concurrency_ratio"] >= 3


@pytest.mark.slow
def test_bench_throughput_cli_small(tmp_path):
    r = bench("throughput", "--num-requests", "3", "--prompt-lens", "32", "48", "--output-lens", "4", "8",
              "--baseline-batch-sizes", "1", "3", "--plot", str(tmp_path / "p.png"))
    assert {"minillm_tok_s", "baseline_tok_s", "ratio", "workload", "settings"} <= set(r)
    assert r["baseline_tok_s"] == max(r["baseline_by_batch_size"].values())
    assert r["ratio"] == pytest.approx(r["minillm_tok_s"] / r["baseline_tok_s"], rel=1e-2)
    assert (tmp_path / "p.png").exists()


@pytest.mark.slow
def test_bench_decode_and_prefix_cli():
    d = bench("decode", "--prefill-lens", "32", "--steps", "8")
    assert d["bound_ms_per_token"] > 0 and d["ratio"] == pytest.approx(d["decode_ms_per_token"] / d["bound_ms_per_token"])
    p = bench("prefix")
    assert p["system_prompt_hit_rate"] > 0 and p["multi_turn_hit_rate"] > 0
