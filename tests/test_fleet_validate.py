"""`minillm fleet validate`: the simulator against the real engine on held-out workloads, rebuilt small on the tiny
random model (2 layers, steps of ~0.5-2 ms on a 2-core CPU).

The bound: on the 2-core development machine the tiny model's table (Poisson at loads 0.5 and 2, both length mixes,
16 requests each; 5 seeds) measured a median error of 6-15 %, a worst of 32-49 % (TTFT at low load or a p99 at load
2: the whole TTFT is one or two ~1 ms steps, and the real side also pays add_request and the wake-up from sleep,
which are not step costs; a p99 of 16 requests is one request) and a throughput error <= 7 %. So the agreement
bound is loose, ~2.5x the worst seen: median < 40 %, throughput < 15 %. The wrong model (every coefficient x 3)
measured a median of 200-260 % and TPOT p50 >= 187 % off on every workload, so median > 100 % flags it. The SmolLM2
table itself (the issue's 5 % / 10 % targets) is in docs/benchmarks.md.
"""
from __future__ import annotations

import json
import math

import pytest

from minillm.cli import main
from minillm.fleet import validate as val
from minillm.fleet.calibrate import calibrate, tiny_engine
from minillm.fleet.step_model import from_roofline


@pytest.fixture(scope="module")
def tiny():
    engine = tiny_engine()
    sm = calibrate(engine=engine, quick=True, out="", progress=False)
    return engine, sm


def test_real_and_simulated_agree_and_a_wrong_model_is_flagged(tiny):
    engine, sm = tiny
    workloads = val.held_out_workloads(sm, engine.model.cfg.vocab_size, 16, loads=(0.5, 2.0))
    good, real = val.validate(engine, sm, workloads, progress=False, repeat=2)
    assert [r["workload"] for r in good.rows] == ["short load 0.5", "short load 2", "long load 0.5", "long load 2"]
    for row, w, runs in zip(good.rows, workloads, real):
        assert len(runs) == len(row["runs"]) == 2
        for k in val.METRICS:      # the error is against the runs' mean; the spread is theirs
            values = [r[k] for r in row["runs"]]
            assert row["real"][k] == pytest.approx(sum(values) / 2)
            assert row["spread"][k] == pytest.approx((max(values) - min(values)) / row["real"][k])
        timelines = runs[0]
        assert row["requests"] == len(w.requests) == len(timelines) == 16
        assert sorted(t.output_len for t in timelines) == sorted(r.output_len for r in w.requests)   # ignore_eos
        assert set(row["real"]) == set(row["sim"]) == set(val.METRICS) and set(row["error"]) == set(val.METRICS)
        assert all(math.isfinite(row[side][k]) and row[side][k] > 0 for side in ("real", "sim") for k in val.METRICS)
        assert row["error"]["out_tok_s"] < 0.15
    assert good.median_error < 0.40, val.table(good)
    wrong, _ = val.validate(engine, val.scaled(sm, 3.0), workloads, progress=False, real=real)
    assert wrong.median_error > 1.0, val.table(wrong)
    assert all(r["error"]["tpot_p50_ms"] > 1.0 for r in wrong.rows)
    assert "median error" in val.table(good) and "TPOT p99 ms" in val.table(good)
    assert "real (mean of 2)" in val.table(good) and "own spread over 2 runs" in val.table(good)
    assert math.isfinite(good.median_spread) and good.repeats == 2


def test_the_command_prints_the_table_and_writes_json(tmp_path, capsys):
    path, js = tmp_path / "tiny.json", tmp_path / "v.json"
    assert main(["fleet", "calibrate", "--model", "tiny-random", "--quick", "--out", str(path)]) == 0
    assert main(["fleet", "validate", "--model", "tiny-random", "--step-model", str(path), "--quick", "--requests",
                 "4", "--json", str(js), "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "TTFT p99 ms" in out and "out tok/s" in out and "median error" in out
    d = json.loads(js.read_text())
    assert len(d["rows"]) == 4 and 0 <= d["median_error"] <= d["worst_error"] and d["worst"]


def test_bad_input_is_one_clear_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("MINILLM_CACHE_DIR", str(tmp_path / "empty-cache"))
    assert main(["fleet", "validate", "--model", "tiny-random"]) == 2
    err = capsys.readouterr().err.strip()
    assert "no step model for --model tiny-random: run `minillm fleet calibrate" in err and "\n" not in err
    roof = from_roofline("llama-3.1-8b", "h100-sxm").save(tmp_path / "roof.json")
    assert main(["fleet", "validate", "--model", "tiny-random", "--step-model", str(roof)]) == 2
    err = capsys.readouterr().err.strip()
    assert "was not calibrated on 'tiny-random'" in err and "\n" not in err
    assert main(["fleet", "validate", "--step-model", str(tmp_path / "nope.json")]) == 2
    assert "no such file" in capsys.readouterr().err
    assert main(["fleet", "validate", "--model", "tiny-random", "--repeat", "0"]) == 2
    assert "--repeat must be a positive integer" in capsys.readouterr().err
