"""The C kernels' team size on a busy machine (kernels/cpu_threads.py): torch's thread count, one thread while
other processes oversubscribe the cores; what it reads from /proc, and bench decode's --background-load."""
from __future__ import annotations

import statistics
import time

import pytest
import torch

from minillm import config
from minillm.bench import decode
from minillm.kernels import cpu_threads


@pytest.fixture
def team(monkeypatch):
    """A fresh sampler whose 'other runnable threads' the test sets, on a 2-core machine, 2 torch threads."""
    fresh = cpu_threads._Team()
    fresh.cores = 2
    busy = [0]
    monkeypatch.setattr(cpu_threads, "_team", fresh)
    monkeypatch.setattr(cpu_threads, "runnable_elsewhere", lambda: busy[0])
    monkeypatch.setattr(cpu_threads, "SAMPLE_EVERY_S", 0.0)          # every call samples
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield busy
    torch.set_num_threads(before)


def _settle(n: int = cpu_threads.SAMPLES) -> int:
    return [cpu_threads.team_size() for _ in range(n)][-1]


def test_the_team_is_torchs_until_the_cores_are_oversubscribed(team):
    for others, size in [(0, 2), (1, 2), (3, 2), (4, 1), (9, 1), (0, 2)]:
        team[0] = others
        assert _settle() == size, (others, size)


def test_a_short_burst_elsewhere_does_not_shrink_the_team(team):
    _settle()
    team[0] = 8
    assert cpu_threads.team_size() == 2                 # one sample of five: the median is still quiet
    assert _settle() == 1


def test_fixed_keeps_torchs_thread_count(team):
    team[0] = 50
    with config.kernels_set(kernel_threads="fixed"):
        assert _settle() == 2
    assert _settle() == 1


def test_proc_counts_other_processes_busy_threads():
    """Real /proc: busy processes beside this one are counted (a lower bound on a machine doing other work too)."""
    quiet = cpu_threads.runnable_elsewhere()
    if quiet is None:
        pytest.skip("no /proc/loadavg here: the team stays at torch's thread count")
    with decode.background_load(3):
        seen = []
        for _ in range(15):
            seen.append(cpu_threads.runnable_elsewhere())
            time.sleep(0.02)
    assert statistics.median(seen) >= 3, seen


def test_background_load_processes_end_with_the_block():
    with decode.background_load(2):
        pass
    with decode.background_load(0):
        pass


def test_the_background_report_states_both_slowdowns():
    b = decode.DecodeBench("m", "m.gguf", "auto: int4", "float32", 2, {}, 5.0, 30.0, 1, 1.0, 5.0,
                           decode_ms_rounds=[5.0, 6.0], loaded_ms_rounds=[10.0, 18.0], background_load=2)
    peer = {"tg_tok_s_rounds": [200.0, 200.0], "tg_tok_s_loaded_rounds": [50.0, 40.0], "slowdowns": [4.0, 5.0]}
    text = "\n".join(decode.format_background([b], peer))
    assert "--background-load 2" in text and "2.50x its quiet time" in text     # median of 2.0 and 3.0
    assert "4.50x its quiet time" in text                                       # llama.cpp: median of 4 and 5
    assert "slowdown / llama.cpp's: 0.55x" in text                              # median of 0.5 and 0.6
    assert decode.format_background([decode.DecodeBench("m", "m", "auto", "f", 2, {}, 5, 30, 1, 1, 5)], None) == []
