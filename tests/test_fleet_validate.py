"""`minillm fleet validate`: the simulator against the real engine on held-out workloads, rebuilt small on the tiny
random model (2 layers, steps of ~0.5-2 ms on a 2-core CPU).

Two claims, tested apart. The replay: on a clock that each real step advances by exactly what the step model
predicts for it (`StepModelClock`, fed by the public step observer), the real engine's timelines must equal the
simulation's to rounding, since the simulated replica runs the engine's scheduler with the same features and timing
conventions; a replica configured unlike the engine, and step models 3x or 1.05x off, must show. The fit: on the wall
clock the error is a measurement of a shared, busy machine (the tiny model's table measured a median of 6-15 % and a
worst of 32-49 % on a quiet 2-core machine; one CI run, beside an nbgrader autograde on the other core, measured a
throughput error of 17 %), so it is reported, and asserted only far outside what load can do: within 2x, and a 10x
wrong model flagged. The SmolLM2 table itself (the issue's 5 % / 10 % targets) is in docs/benchmarks.md.
"""
from __future__ import annotations

import json
import math
import time
from dataclasses import replace

import numpy as np
import pytest

from minillm.cli import main
from minillm.fleet import validate as val
from minillm.fleet.calibrate import calibrate, tiny_engine
from minillm.fleet.probe import probe
from minillm.fleet.step_model import from_roofline


@pytest.fixture(scope="module")
def tiny():
    engine = tiny_engine()
    sm = calibrate(engine=engine, quick=True, out="", progress=False)
    return engine, sm


def check_table(v: val.Validation, workloads: list[val.Workload], real: list, repeats: int) -> None:
    assert [r["workload"] for r in v.rows] == ["short load 0.5", "short load 2", "long load 0.5", "long load 2"]
    for row, w, runs in zip(v.rows, workloads, real):
        assert len(runs) == len(row["runs"]) == repeats
        for k in val.METRICS:      # the error is against the runs' mean; the spread is theirs
            values = [r[k] for r in row["runs"]]
            assert row["real"][k] == pytest.approx(sum(values) / repeats)
            assert row["spread"][k] == pytest.approx((max(values) - min(values)) / row["real"][k])
        timelines = runs[0]
        assert row["requests"] == len(w.requests) == len(timelines) == 16
        assert sorted(t.output_len for t in timelines) == sorted(r.output_len for r in w.requests)   # ignore_eos
        assert set(row["real"]) == set(row["sim"]) == set(val.METRICS) and set(row["error"]) == set(val.METRICS)
        assert all(math.isfinite(row[side][k]) and row[side][k] > 0 for side in ("real", "sim") for k in val.METRICS)
    assert "median error" in val.table(v) and "TPOT p99 ms" in val.table(v)
    assert f"real (mean of {repeats})" in val.table(v) and f"own spread over {repeats} runs" in val.table(v)
    assert math.isfinite(v.median_spread) and v.repeats == repeats


def test_on_the_step_models_clock_the_real_engine_replays_the_simulation_exactly(tiny):
    engine, sm = tiny
    workloads = val.held_out_workloads(sm, engine.model.cfg.vocab_size, 16, loads=(0.5, 2.0))
    with val.StepModelClock(engine, sm) as clock:      # a drift probe would read model time against wall time
        good, real = val.validate(engine, sm, workloads, progress=False, repeat=2, clock=clock, correct_drift=False)
    check_table(good, workloads, real, 2)
    assert all(r["error_raw"] == r["error"] for r in good.rows) and "not corrected for" in val.table(good)
    assert good.median_spread < 1e-12      # greedy, and a clock that is a function of the steps (to rounding)
    assert max(good.errors) < 1e-9, val.table(good)
    wrong, _ = val.validate(engine, val.scaled(sm, 3.0), workloads, progress=False, real=real)
    # (per workload: at load 2 a slower replica batches more, so its TPOT p50 alone can come out under 2x)
    assert all(np.median(list(r["error"].values())) > 1.0 for r in wrong.rows), val.table(wrong)
    # Every step 5 % slow: with short prompts at load 0.5 a token's latency is one decode step, 5 % high; elsewhere
    # a prompt landing mid-decode or a bigger batch moves single metrics of 16 requests either way (a long-mix TPOT
    # p50 was seen 18-36 % off); a low load's throughput is set by the arrivals. So a 5 % error in the fit shows as
    # a median of a few percent over the 20 metrics.
    near, _ = val.validate(engine, val.scaled(sm, 1.05), workloads, progress=False, real=real)
    assert 0.03 < near.median_error < 0.10, val.table(near)
    assert 0.04 < near.rows[0]["error"]["tpot_p50_ms"] < 0.15, val.table(near)
    # A replica that batches unlike the engine (at most 2 running) is a replay bug the check must show.
    narrow = replace(val.replica_config_of(engine), max_num_seqs=2)
    busy = workloads[1]
    err = val.compare(val.summarize(real[1][0]), val.summarize(val.run_sim(sm, narrow, busy.requests)))
    assert max(err.values()) > 0.2, err


def test_the_drift_probe_tells_a_slower_machine_from_a_wrong_model(tiny):
    """The machine 'calibrated' on the step model's clock, 'validated' on a clock 1.2x slower: the probe reads the
    1.2x, the corrected simulation replays exactly, and the uncorrected one is off by about the drift."""
    engine, sm = tiny
    with val.StepModelClock(engine, sm) as clock:
        at_calibration = replace(sm, replica=sm.replica | {"probe_s": probe(engine, clock)})
    workloads = val.held_out_workloads(sm, engine.model.cfg.vocab_size, 16, loads=(0.5, 2.0))
    with val.StepModelClock(engine, val.scaled(sm, 1.2)) as slower:
        v, real = val.validate(engine, at_calibration, workloads, progress=False, clock=slower)
    assert v.drift_corrected and all(r["speed"] == pytest.approx(1.2, rel=1e-9) for r in v.rows)
    assert max(v.errors) < 1e-9, val.table(v)
    assert 0.1 < v.median_error_raw < 0.3 and "on the model as calibrated: median error" in val.table(v)
    off, _ = val.validate(engine, at_calibration, workloads, progress=False, real=real,
                          speeds=[r["speed"] for r in v.rows], correct_drift=False)
    assert not off.drift_corrected and off.median_error == pytest.approx(v.median_error_raw)


def test_on_the_wall_clock_the_error_is_measured_and_reported(tiny, record_duration, capsys):
    engine, sm = tiny
    workloads = val.held_out_workloads(sm, engine.model.cfg.vocab_size, 16, loads=(0.5, 2.0))
    t = time.perf_counter()
    good, real = val.validate(engine, sm, workloads, progress=False, repeat=2)
    record_duration("fleet validate, tiny model: wall s for 4 workloads x 16 requests x 2 runs",
                    time.perf_counter() - t)
    check_table(good, workloads, real, 2)
    with capsys.disabled():
        print(f"\nfleet validate on the tiny model, wall clock (a measurement, not judged):\n{val.table(good)}")
    assert good.median_error < 1.0, val.table(good)
    wrong, _ = val.validate(engine, val.scaled(sm, 10.0), workloads, progress=False, real=real)
    assert wrong.median_error > 3.0, val.table(wrong)


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
