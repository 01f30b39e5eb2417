"""The C kernels' team on a busy machine (kernels/cpu_threads.py): torch's thread count, or one thread while the
fused step measures one thread faster; and bench decode's --background-load."""
from __future__ import annotations

import pytest
import torch

from minillm import config
from minillm.bench import decode
from minillm.kernels import cpu_threads


@pytest.fixture
def choice(monkeypatch):
    """A fresh chooser on 2 torch threads (a probe is due after PROBE_EVERY_S of recorded fused steps)."""
    fresh = cpu_threads.TeamChoice()
    monkeypatch.setattr(cpu_threads, "_choice", fresh)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield fresh
    torch.set_num_threads(before)


def _steps(n: int, seconds: dict[int, float], rows: int = 1) -> list[int]:
    """n fused steps whose time depends on the team they got; the teams chosen."""
    teams = []
    for _ in range(n):
        team = cpu_threads.step_team(rows)
        cpu_threads.record(team, rows, seconds[team])
        teams.append(team)
    return teams


def _due(fresh) -> None:
    fresh.since_probe = cpu_threads.PROBE_EVERY_S


def test_the_team_stays_while_it_is_faster(choice):
    teams = _steps(12, {2: 0.004, 1: 0.0065})            # quiet: two threads beat one
    assert teams == [2] * 12                              # nothing known about one thread: the team, no probe yet
    _due(choice)
    assert _steps(1, {2: 0.004, 1: 0.0065}) == [1]        # a probe per second of decoding keeps the other current
    assert cpu_threads.team_size() == 2                   # the other kernels do not follow a probe
    assert _steps(2, {2: 0.004, 1: 0.0065}) == [2, 2]
    assert cpu_threads.team_size() == 2


def test_one_thread_must_be_clearly_faster_to_replace_the_team(choice):
    """Noise on a quiet machine (a team step after a prompt step, a lucky probe) must not hand every later kernel
    to one thread: one thread wins only by MARGIN."""
    _steps(8, {2: 0.0100})                                # no probe due yet: only the team runs
    for _ in range(cpu_threads.SAMPLES):
        _due(choice)
        _steps(2, {2: 0.0100, 1: 0.0100 / cpu_threads.MARGIN * 1.02})   # one thread a little faster: not enough
    assert cpu_threads.step_team(1) == 2 and cpu_threads.team_size() == 2
    for _ in range(cpu_threads.SAMPLES):
        _due(choice)
        _steps(2, {2: 0.0100, 1: 0.0100 / cpu_threads.MARGIN * 0.9})    # past the margin: one thread
    assert cpu_threads.step_team(1) == 1 and cpu_threads.team_size() == 1


def test_probes_follow_decoding_time_not_the_wall_clock(choice):
    """A long prompt step between two decode steps does not make the next decode step a probe: only the fused
    steps' own time counts (a probe ~1.6x slower after every prefill was the validation's slow first decodes)."""
    teams = _steps(240, {2: 0.004, 1: 0.0065})            # 0.96 s of decoding: no probe yet
    assert teams == [2] * 240
    assert _steps(20, {2: 0.004, 1: 0.0065}).count(1) == 1  # past 1 s of it: exactly one


def test_a_collapsing_team_gives_way_to_one_thread_and_comes_back(choice):
    _steps(8, {2: 0.004, 1: 0.0065})
    busy = _steps(20, {2: 0.08, 1: 0.01})                 # the machine gets busy: team steps take 20x longer
    assert busy[:13] == [2] * 13 and busy[13] == 1        # after a second of fused steps, one thread is probed
    assert busy[14:] == [1] * 6                           # and, faster, kept
    assert cpu_threads.team_size() == 1                   # the other C kernels follow the fused step's choice
    assert cpu_threads.step_team(48) == 1                 # rows not measured yet take the last choice
    cpu_threads.record(1, 48, 0.01)
    for _ in range(cpu_threads.SAMPLES):                  # quiet again: the probes bring the team back
        _due(choice)
        _steps(2, {2: 0.004, 1: 0.0065})
    assert _steps(3, {2: 0.004, 1: 0.0065}) == [2, 2, 2]


def test_each_number_of_rows_is_measured_on_its_own(choice):
    _steps(8, {2: 0.004, 1: 0.0065}, rows=1)
    _due(choice)
    _steps(2, {2: 0.004, 1: 0.0065}, rows=1)
    assert cpu_threads.step_team(48) == 2                 # 48 rows: nothing known yet, the last choice (the team)
    cpu_threads.record(2, 48, 0.05)
    for _ in range(cpu_threads.SAMPLES):                  # one thread faster at 48 rows only
        cpu_threads.record(1, 48, 0.03)
    assert cpu_threads.step_team(48) == 1 and cpu_threads.step_team(1) == 2


def test_fixed_keeps_torchs_thread_count(choice):
    with config.kernels_set(kernel_threads="fixed"):
        for _ in range(10):
            _due(choice)
            assert _steps(1, {2: 0.08, 1: 0.001}) == [2]
        assert cpu_threads.team_size() == 2


def test_one_torch_thread_is_one_thread(choice):
    torch.set_num_threads(1)
    assert _steps(3, {1: 0.01}) == [1, 1, 1]


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
