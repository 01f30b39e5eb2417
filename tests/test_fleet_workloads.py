"""Workloads: seeded, in arrival order, at the asked rate and burstiness; sessions share prefixes; a trace with a
bad line is refused with the line number."""
from __future__ import annotations

import json

import numpy as np
import pytest

from minillm.fleet import workloads
from minillm.fleet.workloads import arrival_gaps, read_trace


@pytest.mark.parametrize("name", workloads.WORKLOADS)
def test_seeded_and_in_arrival_order(name):
    a = list(workloads.make(name, 20, 30, seed=1))
    b = list(workloads.make(name, 20, 30, seed=1))
    assert [(r.arrival, r.prompt, r.output_len) for r in a] == [(r.arrival, r.prompt, r.output_len) for r in b]
    times = [r.arrival for r in a]
    assert times == sorted(times) and times[-1] < 30 and len({r.request_id for r in a}) == len(a)
    assert all(r.prompt_len >= 1 and r.output_len >= 1 for r in a)


@pytest.mark.parametrize("cv", [1.0, 3.0])
def test_arrival_rate_and_cv(cv):
    gaps = np.array([g for g, _ in zip(arrival_gaps(np.random.default_rng(0), 50.0, cv), range(40000))])
    assert gaps.mean() == pytest.approx(1 / 50, rel=0.05)
    assert gaps.std() / gaps.mean() == pytest.approx(cv, rel=0.1)


def test_multi_turn_prompts_repeat_the_conversation():
    reqs = list(workloads.multi_turn(5, 120, seed=0, think_s=5))
    by_prefix = 0
    for later in reqs:
        for earlier in reqs:
            if earlier.arrival < later.arrival and earlier.output_ids and \
                    later.prompt[:earlier.prompt_len + earlier.output_len] == earlier.prompt + earlier.output_ids:
                by_prefix += 1
                break
    assert by_prefix > len(reqs) / 3


def test_rag_prompts_are_long():
    assert np.median([r.prompt_len for r in workloads.rag(10, 30)]) > 1000


def test_trace(tmp_path):
    p = tmp_path / "t.jsonl"
    p.write_text(json.dumps({"arrival_time": 0, "prompt_token_ids": [5, 6, 7], "output_len": 4}) + "\n\n" +
                 json.dumps({"arrival_time": 1.5, "prompt_len": 10, "output_len": 2}) + "\n")
    got = list(read_trace(p))
    assert [(r.arrival, r.prompt_len, r.output_len) for r in got] == [(0.0, 3, 4), (1.5, 10, 2)]
    assert got[0].prompt == [5, 6, 7]


@pytest.mark.parametrize("line, why", [
    ("{not json", "not JSON"),
    ("[1, 2]", "expected an object"),
    ('{"arrival_time": -1, "prompt_len": 3, "output_len": 1}', "arrival_time must be"),
    ('{"arrival_time": 0.1, "prompt_len": 3, "output_len": 0}', "output_len must be"),
    ('{"arrival_time": 0.1, "output_len": 2}', "prompt_token_ids .* or prompt_len"),
    ('{"arrival_time": 0.1, "prompt_token_ids": [1, "a"], "output_len": 2}', "list of integers"),
    ('{"arrival_time": 0.0, "prompt_len": 3, "output_len": 2}', "before the previous line"),
])
def test_a_bad_trace_line_is_named(tmp_path, line, why):
    p = tmp_path / "t.jsonl"
    p.write_text(json.dumps({"arrival_time": 0.05, "prompt_len": 3, "output_len": 1}) + "\n\n" + line + "\n")
    with pytest.raises(ValueError, match=f"line 3: .*{why}"):
        list(read_trace(p))
