"""`minillm bench serve`: the serving metrics against independent definitions, arrivals with the stated rate, and the
benchmark driving a real server (a tiny model on loopback) end to end."""
from __future__ import annotations

import json
import math
import random

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from minillm import LLM
from minillm.bench import serving
from minillm.bench.serving_metrics import Trace, goodput, metric_values, percentile, request_metrics, summarize
from minillm.serve.server import BackgroundServer
from tests.tiny_models import tiny_model_dir


@given(st.lists(st.floats(-1e6, 1e6), min_size=1, max_size=40), st.floats(0, 100))
def test_percentile_is_numpys_linear_interpolation(xs, q):
    assert percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)), rel=1e-9, abs=1e-6)


def _trace(sent, times, tokens):
    return Trace(sent, list(times), tokens)


def test_tpot_excludes_the_first_token_and_itl_pools_every_gap():
    a = _trace(0.0, [0.5, 0.6, 0.7, 1.5], 4)           # TTFT 0.5, TPOT (1.5 - 0.5) / 3, gaps 0.1 0.1 0.8
    b = _trace(1.0, [1.2], 1)                          # one token: no TPOT, no gap
    v = metric_values([a, b, Trace(2.0, [], 0, error="HTTP 429")])
    assert v["ttft"] == pytest.approx([0.5, 0.2]) and v["e2el"] == pytest.approx([1.5, 0.2])
    assert v["tpot"] == pytest.approx([1.0 / 3])
    assert v["itl"] == pytest.approx([0.1, 0.1, 0.8])   # per gap, not one average per request
    m = request_metrics(a)
    assert type(m.ttft) is float and m.tpot == pytest.approx(1.0 / 3) and request_metrics(b).tpot is None


def test_goodput_counts_requests_that_met_every_objective():
    fast = _trace(0.0, [0.1, 0.15, 0.2], 3)            # TTFT 100 ms, TPOT 50 ms
    slow_start = _trace(0.0, [0.9, 0.95, 1.0], 3)      # TTFT 900 ms
    slow_tokens = _trace(0.0, [0.1, 0.5, 0.9], 3)      # TPOT 400 ms
    slos = {"ttft": 0.5, "tpot": 0.1}
    assert goodput([fast, slow_start, slow_tokens], slos, 2.0) == pytest.approx(0.5)   # only `fast`, over 2 s
    assert goodput([fast, slow_start, slow_tokens], {"ttft": 0.5}, 1.0) == pytest.approx(2.0)
    s = summarize([fast, slow_start], 1.0, slos)
    assert s["completed"] == 2 and s["goodput"] == 1.0 and s["p50_ttft_ms"] == pytest.approx(500)


def test_arrivals_have_the_asked_rate_and_burstiness():
    rng = random.Random(0)
    for burstiness in (1.0, 0.25, 4.0):
        t = serving.arrival_offsets(20_000, 8.0, burstiness, rng)
        gaps = np.diff(t)
        assert gaps.mean() == pytest.approx(1 / 8.0, rel=0.05)                       # the rate
        cv = gaps.std() / gaps.mean()                                                # gamma: CV = 1/sqrt(shape)
        assert cv == pytest.approx(1 / math.sqrt(burstiness), rel=0.08)
    assert serving.arrival_offsets(5, math.inf, 1.0, rng) == [0.0] * 5


def test_bad_flags_say_what_to_write():
    with pytest.raises(ValueError, match="ttft:500"):
        serving.parse_goodput(["latency:5"])
    with pytest.raises(ValueError, match="positive"):
        serving.parse_goodput(["ttft:-1"])
    assert serving.parse_goodput(["ttft:500", "tpot:100"]) == {"ttft": 0.5, "tpot": 0.1}
    with pytest.raises(ValueError, match="inf"):
        serving.parse_rates(["0"])
    with pytest.raises(ValueError, match="no OpenAI-compatible server"):
        serving.check_server("http://127.0.0.1:9/v1", None)


def test_the_knee_is_the_last_rate_within_twice_the_lightest_load():
    rows = [{"p99_ttft_ms": x} for x in (100, 150, 190, 450, 3000)]
    assert serving.knee(rows) == 2
    assert serving.knee([{"p99_ttft_ms": 100}, {"p99_ttft_ms": 120}]) == 1


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = tiny_model_dir(tmp_path_factory.mktemp("tiny") / "model", context=256)
    with LLM(str(path), num_blocks=128, block_size=4, max_num_seqs=8) as llm, \
            BackgroundServer(llm.engine, name="tiny") as s:
        yield s, llm


def test_bench_serve_drives_a_server_and_its_numbers_add_up(server, tmp_path):
    s, llm = server
    prompts = serving.chat_workload(llm.tokenizer, 12, (8, 40), (4, 12), seed=1)
    model = serving.check_server(s.url, None)
    rows = serving.sweep(s.url, model, prompts, [math.inf, 40.0], slos={"ttft": 60.0}, seed=1)
    for row in rows:
        assert row["completed"] == 12 and row["failed"] == 0, row["errors"]
        assert row["total_output_tokens"] == sum(p.max_tokens for p in prompts)     # ignore_eos: exact lengths
        assert row["goodput"] == pytest.approx(row["request_throughput"])            # a generous objective
        assert all(math.isfinite(row[f"p99_{m}_ms"]) for m in ("ttft", "tpot", "itl", "e2el"))
    print("\n" + serving.table(rows, "tiny"))
    serving.plot_curves({"tiny": rows}, str(tmp_path / "curve.png"))
    assert (tmp_path / "curve.png").stat().st_size > 10_000
    json.dumps(rows)                                                                 # --json can write it


def test_a_jsonl_workload_and_its_mistakes(tmp_path, server):
    s, _ = server
    f = tmp_path / "prompts.jsonl"
    f.write_text('{"prompt": "ab ab", "max_tokens": 3}\n\n{"messages": [{"role": "user", "content": "b"}]}\n')
    prompts = serving.jsonl_workload(f, 10, 5)
    assert [(p.text, p.max_tokens) for p in prompts] == [("ab ab", 3), (None, 5)]
    rows = serving.sweep(s.url, "tiny", prompts, [math.inf])
    assert rows[0]["completed"] == 2 and rows[0]["total_output_tokens"] == 8
    f.write_text('{"prompt": "a", "messages": []}\n')
    with pytest.raises(ValueError, match="prompts.jsonl:1"):
        serving.jsonl_workload(f, 10, 5)


@pytest.mark.slow
def test_minillm_bench_serve_end_to_end(tmp_path, capsys, monkeypatch):
    """The command: starts minillm serve on the model, sweeps, reports JSON; --compare and --plot take it back.
    The offline baseline is warmed up exactly as the server was and then times the prompts the server got at rate
    inf (a warm-up on measured prompts would hand the baseline prefix-cache hits the server never had)."""
    from minillm.cli import main
    sent, offline = [], []
    run_rate, offline_throughput = serving.run_rate, serving.offline_throughput
    monkeypatch.setattr(serving, "run_rate", lambda url, model, prompts, rate, *a, **k:
                        sent.append((rate, prompts)) or run_rate(url, model, prompts, rate, *a, **k))
    monkeypatch.setattr(serving, "offline_throughput", lambda llm, prompts:
                        offline.append(prompts) or offline_throughput(llm, prompts))
    path = tiny_model_dir(tmp_path / "model", context=256)
    argv = ["bench", "serve", "--model", str(path), "--num-prompts", "6", "--request-rate", "20", "inf",
            "--goodput", "ttft:60000", "--prompt-lens", "8", "32", "--output-lens", "2", "6", "--max-num-seqs", "4"]
    assert main(argv + ["--json", "--offline-baseline"]) == 0
    result = json.loads(capsys.readouterr().out)
    (_, warmup), *measured = sent
    assert offline[0] is warmup and offline[1:] == [dict(measured)[math.inf]]
    assert result["label"] == "minillm" and [r["request_rate"] for r in result["rows"]] == [20.0, math.inf]
    assert all(r["completed"] == 6 and r["goodput"] > 0 for r in result["rows"])
    assert result["offline_tok_s"] > 0 and result["server_over_offline"] > 0
    (tmp_path / "first.json").write_text(json.dumps({**result, "label": "earlier"}, default=str))
    assert main(argv + ["--compare", str(tmp_path / "first.json"), "--plot", str(tmp_path / "both.png")]) == 0
    out = capsys.readouterr().out
    assert "minillm: latencies in ms" in out and "earlier: latencies in ms" in out and "goodput minillm" in out
    assert (tmp_path / "both.png").stat().st_size > 10_000


@pytest.mark.parametrize("argv, needle", [
    (["--goodput", "latency:5"], "ttft:500"), (["--request-rate", "0"], "inf (all at once)"),
    (["--base-url", "http://x/v1", "--max-num-seqs", "4"], "with --base-url the server is already running"),
    (["--offline-baseline", "--request-rate", "4"], "add inf"), (["--dataset", "no-such.jsonl"], "no such file"),
    (["--burstiness", "0"], "positive"), (["--num-prompts", "0"], "at least 1"),
])
def test_bench_serve_flags_are_checked_before_anything_runs(argv, needle, capsys):
    from unittest import mock

    from minillm.cli import main
    with mock.patch("minillm.bench.serving.run_cli", side_effect=AssertionError("ran")):
        assert main(["bench", "serve", *argv]) == 2
    assert needle in capsys.readouterr().err


def test_measuring_works_inside_a_running_event_loop(server):
    """A notebook's kernel runs an event loop: the benchmark's own loop then runs on a thread of its own."""
    import asyncio
    s, llm = server
    prompts = serving.chat_workload(llm.tokenizer, 2, (8, 16), (2, 3), seed=3)

    async def inside():
        return serving.measure(s.url, "tiny", prompts, [math.inf])
    [run] = asyncio.run(inside())
    assert len(run.traces) == 2 and all(t.ok for t in run.traces)
