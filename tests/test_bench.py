"""Benchmarks: their accounting on tiny models (fast) and the CLI on the real model (slow)."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from minillm.bench.kv import kv_bench, replay
from minillm.bench.throughput import percentile, run_minillm, run_transformers_static, throughput_plot
from minillm.bench.workload import WorkloadSpec, random_workload
from tests.tiny_models import load_minillm_from_dir, make_hf_model, save_hf_dir, tiny_model_dir

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
def test_bench_decode_cli():
    out = bench("decode", "--prefill-lens", "16", "--steps", "4")
    (d,) = out["runs"]           # one run per --quantization; the default is auto (test_quant compares formats)
    assert out["llama_cpp"] is None and d["quantization"].startswith("auto: int4 g32")
    assert d["decode_step"] == "fused C"        # SmolLM2's quantized decode steps run as one C call
    assert d["bound_ms_per_token"] > 0 and d["ratio"] == pytest.approx(d["decode_ms_per_token"] / d["bound_ms_per_token"])
    assert d["loaded_ms_rounds"] == [] and d["background_load"] == 0


@pytest.mark.slow
def test_bench_decode_times_each_round_again_beside_busy_processes():
    out = bench("decode", "--prefill-lens", "16", "--steps", "4", "--background-load", "1", "--repeat", "2")
    (d,) = out["runs"]
    assert d["background_load"] == 1 and len(d["loaded_ms_rounds"]) == len(d["decode_ms_rounds"]) == 2
    assert all(ms > 0 for ms in d["loaded_ms_rounds"])


@pytest.mark.slow
def test_bench_prefix_cli_hits_the_shared_prefixes(tmp_path):
    """The CLI end to end on a tiny random model with a chat template (the real model's TTFT ratios are in the
    README; here only the cache accounting matters): every pattern's later requests hit the shared blocks."""
    path = tiny_model_dir(tmp_path / "m", 2048)         # the long system prompt is ~900 tiny-tokenizer tokens
    p = bench("prefix", "--repeat", "1", "--model", str(path))
    for name in ("system_prompt", "long_system_prompt", "multi_turn"):
        assert p[f"{name}_hit_rate"] > 0, p


def test_spec_bench_accounting_on_a_tiny_model():
    """The spec bench's bookkeeping (not its timings): baseline first, every proposer and k, speedups against the
    baseline of the same task and batch, identical greedy text, and a reason for every slowdown."""
    from types import SimpleNamespace

    from minillm.bench.spec import SpecBenchConfig, format_spec_bench, run_spec_bench
    from minillm.config import EngineConfig
    from minillm.testing import random_model

    from tokenizers import Tokenizer as HFTokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    from minillm.loading.tokenizer import Tokenizer
    byte_chars = sorted(ByteLevel.alphabet())               # one token per byte: any text encodes, ids < 256
    hf = HFTokenizer(models.BPE({c: i for i, c in enumerate(byte_chars)}, []))
    hf.pre_tokenizer, hf.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    tok = Tokenizer(hf, bos_token_id=None, eos_token_id=2, add_bos_token=False,
                    chat_template="{{ messages[-1]['content'][:60] }}")
    model = random_model(seed=3, layers=2, vocab=256)
    loaded = SimpleNamespace(model=model, tokenizer=tok, config=model.cfg, path=Path("tiny"))
    bc = SpecBenchConfig(tasks=("rewrite", "chat"), proposers=("ngram", "layer_skip"), ks=(2, 3), batch_sizes=(1, 3),
                         batch1_requests=2, max_tokens=12, draft_layers=1, repeat=2)
    r = run_spec_bench(loaded, EngineConfig.from_kwargs(num_blocks=256, block_size=4), bc, progress=False)
    runs = r["runs"]
    assert len(runs) == 2 * 2 * (1 + 2 * 2)          # two rounds, one row (the faster round) per configuration
    assert len(r["repeats"]) == len(runs) and all(len(v) == 2 for v in r["repeats"].values())   # for the spread check
    assert [(x["task"], x["batch"], x["proposer"], x["k"]) for x in runs][:3] == [
        ("rewrite", 1, "none", 0), ("rewrite", 1, "ngram", 2), ("rewrite", 1, "ngram", 3)]
    for run in runs:
        base = next(b for b in runs if b["proposer"] == "none" and (b["task"], b["batch"]) == (run["task"], run["batch"]))
        assert run["speedup"] == pytest.approx(run["tok_s"] / base["tok_s"], rel=1e-2)
        assert run["decode_speedup"] == pytest.approx(run["decode_tok_s"] / base["decode_tok_s"], rel=1e-2)
        # the decode phase: every token after a request's first, in less time than the whole run took
        assert run["decode_tokens"] == run["output_tokens"] - (2 if run["batch"] == 1 else 3)
        assert 0 < run["decode_seconds"] < run["seconds"] + 5e-4
        assert run["same_text"] is True and run["output_tokens"] == base["output_tokens"]
        if run["proposer"] != "none":
            assert run["expected_speedup"] > 0 and (run["speedup"] >= 1 or run["why"])
    table = format_spec_bench(r)
    assert "layer_skip" in table and "speedup" in table and "decode" in table
    with pytest.raises(ValueError, match="unknown proposer"):
        run_spec_bench(loaded, EngineConfig(), SpecBenchConfig(proposers=("medusa",)), progress=False)
    with pytest.raises(ValueError, match="--repeat"):
        run_spec_bench(loaded, EngineConfig(), SpecBenchConfig(repeat=0), progress=False)


@pytest.mark.slow
def test_bench_spec_cli_small(tmp_path):
    r = bench("spec", "--proposers", "ngram", "--k", "4", "--batch-sizes", "1", "--tasks", "rewrite",
              "--batch1-requests", "1", "--max-tokens", "48", "--plot", str(tmp_path / "s.png"))
    ngram = next(x for x in r["runs"] if x["proposer"] == "ngram")
    # not a timing threshold: copying a passage is predictable, so most drafts are accepted and the text is unchanged
    assert ngram["same_text"] and ngram["acceptance"] > 0.5 and ngram["tokens_per_step"] > 2
    assert (tmp_path / "s.png").exists()


@pytest.mark.slow
def test_bench_structured_cli_small():
    r = bench("structured", "--batch-sizes", "1", "2", "--max-tokens", "6")
    b = r["build"]
    assert b["vocab_size"] == 49152 and b["trie_s"] > 0
    for name, p in b["patterns"].items():
        assert p["dfa_states"] > 0 and p["index_s"] > 0 and 0 < p["mask_share_of_decode_step"] < 1, name
    for bs in ("batch1", "batch2"):
        e = r["end_to_end"][bs]
        assert e["constrained_tok_s"] > 0 and e["unconstrained_tok_s"] > 0 and "/" in e["complete_and_valid"]
