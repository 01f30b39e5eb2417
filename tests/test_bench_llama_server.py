"""bench throughput --llama-server: llama.cpp's server started on the same GGUF and threads with minillm's slots,
driven with the same token ids (greedy, EOS ignored, all at once), and the ratio printed. A stand-in server
(tests/fakes/fake_llama_server.py) checks what it is sent; the real one is measured in docs/benchmarks.md."""
from __future__ import annotations

import json
import stat
import sys
from pathlib import Path

import pytest
import torch

from minillm.bench import llama_server
from minillm.cli import main

FAKE = Path(__file__).parent / "fakes" / "fake_llama_server.py"


@pytest.fixture
def fake_server(tmp_path, monkeypatch):
    exe = tmp_path / "llama-server"
    exe.write_text(f"#!{sys.executable}\n" + FAKE.read_text())
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
    log = tmp_path / "argv.json"
    monkeypatch.setenv("FAKE_LLAMA_LOG", str(log))
    return exe, log


def test_the_command_sizes_slots_like_minillm():
    cmd = llama_server.command("llama-server", "m.gguf", 2, 64, 784, 8080)
    assert cmd[cmd.index("-np") + 1] == "64" and cmd[cmd.index("-c") + 1] == str(64 * 784)    # 784 tokens a slot
    assert cmd[cmd.index("-t") + 1] == cmd[cmd.index("-tb") + 1] == "2" and "-cb" in cmd
    assert cmd[-2:] == ["--port", "8080"]


@pytest.mark.slow
def test_bench_throughput_against_llama_server(fake_server, capsys):
    exe, log = fake_server
    argv = ["bench", "throughput", "--no-baseline", "--llama-server", str(exe), "--num-requests", "4",
            "--prompt-lens", "8", "24", "--output-lens", "3", "6", "--max-num-seqs", "8", "--repeat", "2"]
    assert main(argv + ["--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    started = json.loads(log.read_text())
    assert started["m"].endswith(".gguf") and started["np"] == "8" and started["t"] == str(torch.get_num_threads())
    assert int(started["c"]) == 8 * (24 + 6 + 16) and started["no_cache_prompt"]     # each round starts cold
    peer = r["llama_server"]
    assert peer["output_tokens"] == r["minillm"]["output_tokens"]           # the same workload, to the token
    assert peer["minillm_over_llama_server"] == pytest.approx(r["minillm_tok_s"] / peer["tok_s"], rel=1e-2)
    assert len(peer["per_round_ratios"]) == 2 and len(r["repeats"]["llama-server output tok/s"]) == 2
    assert main(argv[:-2]) == 0
    assert "ratio auto vs llama-server" in capsys.readouterr().out


@pytest.mark.slow
def test_a_server_that_stops_short_is_refused(fake_server, monkeypatch, capsys):
    exe, _ = fake_server
    monkeypatch.setenv("FAKE_LLAMA_SHORT", "1")
    argv = ["bench", "throughput", "--no-baseline", "--llama-server", str(exe), "--num-requests", "2",
            "--prompt-lens", "8", "16", "--output-lens", "3", "4"]
    assert main(argv) != 0
    assert "stopped early" in capsys.readouterr().err


def test_the_flag_is_checked_before_anything_loads(tmp_path, capsys):
    assert main(["bench", "throughput", "--llama-server", str(tmp_path / "nope")]) != 0
    err = capsys.readouterr().err
    assert "--llama-server" in err and "not an executable" in err
    assert main(["bench", "throughput", "--model", str(tmp_path), "--llama-server", sys.executable]) != 0
    assert "--llama-server compares on a GGUF file" in capsys.readouterr().err
