"""`minillm fleet simulate --engine exact|fast|auto`: auto picks the fast engine for large runs only when no flag
needs the exact one; --engine fast with such a flag stops with one line naming it and the fix; a fast run says
which engine ran and how fast."""
from __future__ import annotations

import argparse
import json

import pytest

from minillm.cli import main
from minillm.fleet.cli import AUTO_FAST_REQUESTS, add_fleet_parser, check_args
from minillm.fleet.replica import ReplicaConfig
from minillm.fleet.run import engine_of


def parse(*argv: str):
    p = argparse.ArgumentParser()
    add_fleet_parser(p.add_subparsers(dest="command"))
    args = p.parse_args(["fleet", "simulate", "--model", "llama-3.1-8b", "--gpu", "h100", *argv])
    check_args(args)
    return args


CFG = ReplicaConfig(1000)


@pytest.mark.parametrize("argv, engine, says", [
    (["--rate", "10", "--duration", "60"], "exact", "under 20,000"),
    (["--rate", "1000", "--duration", "60"], "fast", "60,000 requests"),
    (["--rate", "1000", "--duration", "60", "--fail-at", "5:0"], "exact", "--fail-at needs it"),
    (["--rate", "1000", "--duration", "60", "--disaggregate", "1:1"], "exact", "--disaggregate needs it"),
    (["--rate", "1000", "--duration", "60", "--engine", "exact"], "exact", "--engine exact"),
    (["--rate", "1", "--duration", "1", "--engine", "fast"], "fast", "--engine fast"),
])
def test_auto_picks_the_engine(argv, engine, says):
    got, why = engine_of(parse(*argv), CFG)
    assert got == engine and says in why


def test_auto_counts_a_traces_lines(tmp_path):
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(json.dumps({"arrival_time": i / 1e3, "prompt_len": 20, "output_len": 4}) + "\n"
                             for i in range(AUTO_FAST_REQUESTS)))
    assert engine_of(parse("--trace", str(trace)), CFG)[0] == "fast"


@pytest.mark.parametrize("argv, says", [
    (["--disaggregate", "1:1"], "--engine fast does not simulate --disaggregate"),
    (["--autoscale", "queue:1:4"], "--engine fast does not simulate --autoscale"),
    (["--mtbf", "100"], "--engine fast does not simulate --mtbf"),
    (["--kv-offload-gib", "8"], "--engine fast does not simulate --kv-offload-gib"),
    (["--max-num-seqs", "512", "--max-num-batched-tokens", "256"], "max_num_seqs (512) <= the token budget"),
])
def test_what_fast_does_not_model_is_one_clear_line(capsys, argv, says):
    assert main(["fleet", "simulate", "--model", "llama-3.1-8b", "--gpu", "h100", "--engine", "fast",
                 "--no-progress", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and says in err and "use --engine exact" in err and "\n" not in err


def test_a_fast_run_says_which_engine_and_how_fast(tmp_path, capsys):
    out_json = tmp_path / "r.json"
    assert main(["fleet", "simulate", "--model", "llama-3.1-8b", "--gpu", "h100", "--replicas", "3", "--rate", "20",
                 "--duration", "10", "--engine", "fast", "--router", "round-robin", "prefix-aware", "--no-progress",
                 "--slo", "ttft=200ms,tpot=50ms", "--json", str(out_json)]) == 0
    out = capsys.readouterr().out
    assert "engine: fast (--engine fast)" in out
    assert "[prefix-aware, fast engine:" in out and "simulated requests per wall second]" in out
    rows = json.loads(out_json.read_text())
    assert [r["router"] for r in rows] == ["round-robin", "prefix-aware"]
    assert all(r["finished"] > 100 and r["failed"] == 0 and 0 < r["slo_attainment"] <= 1 for r in rows)


def test_help_explains_the_engines(capsys):
    with pytest.raises(SystemExit):
        main(["fleet", "simulate", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--engine {auto,exact,fast}" in text and "aggregate replicas" in text and "20,000" in text
