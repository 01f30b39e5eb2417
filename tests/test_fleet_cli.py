"""`minillm fleet calibrate | simulate`: help without torch, clear one-line errors, calibration on a tiny random
model (its step records add up to what the engine computed), a small simulation with a table and a plot."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from minillm.cli import main
from minillm.fleet.calibrate import Scenario, calibrate, record, tiny_engine
from minillm.fleet.step_model import StepModel


def test_help_does_not_import_torch():
    code = ("import sys\nfrom minillm.cli import main\n"
            "for argv in (['fleet', '--help'], ['fleet', 'simulate', '--help'], ['fleet', 'calibrate', '--help'],\n"
            "             ['fleet', 'plan', '--help']):\n"
            "    try:\n        main(argv)\n    except SystemExit:\n        pass\n"
            "print('TORCH' if 'torch' in sys.modules else 'NO-TORCH')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "minillm fleet simulate --replicas 4 --router prefix-aware" in out     # examples in the help
    assert out.strip().endswith("NO-TORCH")


@pytest.mark.parametrize("argv, says", [
    (["--model", "llama-3.1-70b", "--gpu", "h999"], "unknown GPU 'h999'; known: a100-sxm-80gb, b200, gb200, h100-sxm"),
    (["--model", "llama-9", "--gpu", "h100"], "unknown model 'llama-9'; known: llama-2-13b"),
    (["--model", "llama-3.1-8b"], "needs both --model"),
    (["--router", "random"], "unknown router 'random'; known: round-robin, least-tokens, prefix-aware"),
    (["--rate", "0"], "--rate must be a positive number"),
])
def test_bad_input_is_one_clear_line(capsys, argv, says):
    assert main(["fleet", "simulate", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and says in err and "\n" not in err


def test_calibration_records_what_the_engine_computed(tmp_path):
    engine = tiny_engine(num_blocks=64, block_size=8, max_num_batched_tokens=32)
    scenarios = [Scenario(3, 20, 5), Scenario(2, 40, 4, second_wave=2, wave_after=2)]
    per = record(engine, scenarios, progress=False)
    for sc, steps in zip(scenarios, per):
        n = sc.batch + sc.second_wave
        assert sum(t.features.prefill_tokens for t in steps) == n * sc.prompt_len
        assert sum(t.features.decode_tokens for t in steps) == n * (sc.output_len - 1)
        assert all(t.features.tokens <= 32 and t.seconds > 0 for t in steps)
    assert any(t.features.prefill_tokens and t.features.decode_tokens for t in per[1])   # mixed steps happened
    sm = calibrate(engine=engine, quick=True, out=tmp_path / "m.json", progress=False)
    saved = StepModel.load(tmp_path / "m.json")
    assert saved == sm and sm.replica["num_blocks"] == 64 and sm.fit_error["steps"] > 0


def test_calibrate_then_simulate(tmp_path, capsys):
    path = tmp_path / "tiny.json"
    assert main(["fleet", "calibrate", "--model", "tiny-random", "--quick", "--out", str(path)]) == 0
    out = capsys.readouterr().out
    assert "held-out error" in out and json.loads(path.read_text())["form"] == "max"
    png = tmp_path / "cdf.png"
    assert main(["fleet", "simulate", "--step-model", str(path), "--replicas", "2", "--rate", "10", "--duration",
                 "3", "--router", "round-robin", "prefix-aware", "--plot", str(png), "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "TTFT p99" in out and "round-robin" in out and "prefix-aware" in out
    assert png.stat().st_size > 1000


def test_a_bad_trace_line_stops_the_simulation(tmp_path, capsys):
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"arrival_time": 0, "prompt_len": 5, "output_len": 2}\n{"arrival_time": 1}\n')
    assert main(["fleet", "simulate", "--model", "llama-3.1-8b", "--gpu", "h100", "--trace", str(trace),
                 "--no-progress"]) == 2
    assert "line 2: output_len must be an integer" in capsys.readouterr().err


def test_roofline_simulation_runs(capsys):
    assert main(["fleet", "simulate", "--model", "llama-3.1-8b", "--gpu", "h100", "--replicas", "2", "--rate", "5",
                 "--duration", "4", "--workload", "rag", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "roofline: llama-3.1-8b bf16 on 1 x h100-sxm" in out


@pytest.mark.parametrize("argv, says", [
    (["--disaggregate", "2"], "--disaggregate takes P:D"),
    (["--autoscale", "gpu:1:2"], "unknown autoscaling signal 'gpu'; known: queue"),
    (["--autoscale", "queue:1:2", "--replicas", "9", "--max-replicas", "4"], "must lie within --min-replicas"),
    (["--slo", "p99=3ms"], "--slo takes ttft=DURATION,tpot=DURATION"),
    (["--fail-at", "5:9"], "--fail-at 5:9: the fleet starts with replicas 0..3"),
    (["--disaggregate", "1:1", "--fail-at", "1:0"], "cannot be combined"),
    (["--kv-offload-gib", "-1"], "--kv-offload-gib must be a number >= 0"),
])
def test_bad_fleet_feature_flags_are_one_clear_line(capsys, argv, says):
    assert main(["fleet", "simulate", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and says in err and "\n" not in err


def test_the_fleet_features_from_the_command_line(tmp_path, capsys):
    """Each feature's flags reach the simulator and its metrics reach the table and the JSON."""
    base = ["fleet", "simulate", "--model", "llama-3.1-8b", "--gpu", "h100", "--rate", "8", "--duration", "6",
            "--no-progress"]
    js = tmp_path / "d.json"
    assert main(base + ["--disaggregate", "1:2", "--kv-link-gbps", "100", "--json", str(js)]) == 0
    out = capsys.readouterr().out
    assert "KV xfer p99" in out and "1P:2D" in out
    row = json.loads(js.read_text())[0]
    assert row["layout"] == "1P:2D" and row["kv_transfer_p99_ms"] > 0 and row["decode_pool_prefill_tokens"] == 0
    png = tmp_path / "f.png"
    assert main(base + ["--replicas", "2", "--autoscale", "queue:0.5:4", "--max-replicas", "3", "--cold-start", "2",
                        "--fail-at", "2:0", "--repair", "1", "--slo", "ttft=300ms,tpot=40ms", "--kv-offload-gib", "1",
                        "--json", str(js), "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    for head in ("repl fails", "lost tok", "SLO met", "replica-s", "SLO: TTFT <= 300 ms, TPOT <= 40 ms"):
        assert head in out
    row = json.loads(js.read_text())[0]
    assert row["replica_failures"] == 1 and 0 <= row["slo_attainment"] <= 1 and row["replica_seconds"] > 0
    assert (tmp_path / "f-replicas.png").stat().st_size > 1000


def test_simulate_help_lists_the_fleet_features(capsys):
    with pytest.raises(SystemExit):
        main(["fleet", "simulate", "--help"])
    out = capsys.readouterr().out
    for flag in ("--disaggregate", "--kv-link-gbps", "--autoscale", "--cold-start", "--fail-at", "--mtbf", "--retries",
                 "--slo", "--kv-offload-gib", "--pcie-gbps", "--json"):
        assert flag in out
