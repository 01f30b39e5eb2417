"""Measurement records (minillm.quiz.records, tools/record_measurements.py): the figures the bank quotes about
minillm come from a recorded run, the record knows the code it measured, and a changed code path makes it stale.
Everything here runs on scratch directories: no benchmark is run."""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from minillm.quiz import records
from minillm.quiz.records import (Record, RecordError, code_hash, load_record, parse_measured_claim, stale,
                                  verify_measured)

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def tree(tmp_path):
    """A scratch repository: one engine module, one lab script, a results/ folder."""
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "sched.py").write_text("def schedule():\n    return 57\n")
    (tmp_path / "pkg" / "__pycache__").mkdir()
    (tmp_path / "pkg" / "__pycache__" / "sched.cpython-311.pyc").write_bytes(b"\0junk")
    (tmp_path / "lab.py").write_text("# %% [markdown]\n# The run below needs 57 steps.\n\n# %%\nsteps = 57\n")
    (tmp_path / "results").mkdir()
    return tmp_path


def _write(tree: Path, key: str, values: dict, paths=("pkg", "lab.py")) -> Path:
    doc = {"key": key, "command": f"python tools/record_measurements.py {key}", "date": "2026-11-29",
           "machine": {"cpu": "test", "cores": 2}, "code": {"paths": list(paths), "sha256": code_hash(paths, tree)},
           "values": values}
    path = tree / "results" / f"{key}.json"
    path.write_text(json.dumps(doc))
    return path


def test_a_fresh_record_is_not_stale_and_an_edit_makes_it_stale(tree):
    _write(tree, "demo", {"steps": 57})
    rec = load_record("demo", tree / "results")
    assert stale(rec, tree) is None
    (tree / "pkg" / "sched.py").write_text("def schedule():\n    return 58\n")
    why = stale(rec, tree)
    assert why and "has changed since" in why and "python tools/record_measurements.py demo" in why


@pytest.mark.parametrize("change", ["add", "remove", "rename"])
def test_adding_removing_or_renaming_a_measured_file_makes_the_record_stale(tree, change):
    _write(tree, "demo", {"steps": 57})
    rec = load_record("demo", tree / "results")
    if change == "add":
        (tree / "pkg" / "new.py").write_text("x = 1\n")
    elif change == "remove":
        (tree / "pkg" / "sched.py").unlink()
    else:
        (tree / "pkg" / "sched.py").rename(tree / "pkg" / "scheduler.py")
    assert stale(rec, tree) is not None


def test_bytecode_prose_and_line_endings_do_not_change_the_hash(tree):
    before = code_hash(["pkg", "lab.py"], tree)
    (tree / "pkg" / "__pycache__" / "sched.cpython-311.pyc").write_bytes(b"other junk")
    (tree / "lab.py").write_text("# %% [markdown]\n# Reworded prose, no numbers.\n\n# %%\nsteps = 57\n")
    (tree / "pkg" / "sched.py").write_bytes(b"def schedule():\r\n    return 57\r\n")
    assert code_hash(["pkg", "lab.py"], tree) == before
    (tree / "lab.py").write_text("# %% [markdown]\n# Reworded prose, no numbers.\n\n# %%\nsteps = 58\n")
    assert code_hash(["pkg", "lab.py"], tree) != before


def test_a_missing_measured_path_is_an_error_not_an_empty_hash(tree):
    with pytest.raises(RecordError, match="does not exist"):
        code_hash(["pkg", "nowhere.py"], tree)
    _write(tree, "demo", {"steps": 57})
    (tree / "lab.py").unlink()
    assert "does not exist" in stale(load_record("demo", tree / "results"), tree)


@pytest.mark.parametrize("claim, number", [("57 steps", 57), ("~1.29x", 1.29), ("2.1%", 2.1), ("96.6 MB", 96.6),
                                            ("3,900", 3900), ("8 requests", 8), ("56", 56)])
def test_parse_measured_claim(claim, number):
    assert parse_measured_claim(claim) == number


def test_parse_measured_claim_rejects_an_unknown_unit():
    with pytest.raises(RecordError, match="cannot read"):
        parse_measured_claim("57 bananas")


def test_verify_measured_accepts_the_rounding_of_the_claim_and_rejects_a_stale_figure(tree):
    _write(tree, "demo", {"steps": 57, "ratio": 1.2937, "waste_pct": 2.05, "label": "auto"})
    res = tree / "results"
    assert verify_measured({"claim": "57 steps", "record": "demo", "key": "steps"}, res) == (57, 57)
    verify_measured({"claim": "1.29x", "record": "demo", "key": "ratio"}, res)
    verify_measured({"claim": "2.1%", "record": "demo", "key": "waste_pct"}, res)     # 2.05 rounds to 2.1
    with pytest.raises(AssertionError, match="recorded steps = 57"):
        verify_measured({"claim": "80 steps", "record": "demo", "key": "steps"}, res)
    with pytest.raises(AssertionError):
        verify_measured({"claim": "1.4x", "record": "demo", "key": "ratio"}, res)
    verify_measured({"claim": "~1.4x", "record": "demo", "key": "ratio", "rel_tol": 0.1}, res)
    with pytest.raises(RecordError, match="no value 'nope'"):
        verify_measured({"claim": "1", "record": "demo", "key": "nope"}, res)
    with pytest.raises(RecordError, match="not a number"):
        verify_measured({"claim": "1", "record": "demo", "key": "label"}, res)
    with pytest.raises(RecordError, match="record_measurements.py other"):
        verify_measured({"claim": "1", "record": "other", "key": "steps"}, res)


def test_a_malformed_record_names_the_command_that_rewrites_it(tree):
    (tree / "results" / "bad.json").write_text('{"key": "bad"}')
    with pytest.raises(RecordError, match="record_measurements.py bad"):
        load_record("bad", tree / "results")


def _tool():
    spec = importlib.util.spec_from_file_location("record_measurements", REPO / "tools" / "record_measurements.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod          # dataclasses look their module up while the class is built
    spec.loader.exec_module(mod)
    return mod


def test_the_tool_writes_a_record_with_date_machine_command_and_code_hash(tmp_path, monkeypatch):
    tool = _tool()
    fake = tool.Recipe("fake", "a recipe that measures nothing", ("minillm", "bench", "kv", "--json"),
                       ("minillm/quiz/records.py",), lambda recipe: {"answer": 42})
    monkeypatch.setitem(tool.RECIPES, "fake", fake)
    path = tool.record("fake", tmp_path)
    doc = json.loads(path.read_text())
    assert doc["values"] == {"answer": 42} and doc["command"] == "python tools/record_measurements.py fake"
    assert doc["date"] and doc["machine"]["cores"] and doc["runs"] == "minillm bench kv --json"
    rec = load_record("fake", tmp_path)
    assert isinstance(rec, Record) and stale(rec) is None


def test_every_recipe_measures_paths_that_exist_and_every_record_has_a_recipe():
    tool = _tool()
    for recipe in tool.RECIPES.values():
        records.source_files(recipe.paths)          # raises if a path is gone
    for path in records.RESULTS_DIR.glob("*.json"):
        rec = load_record(path.stem)
        assert rec.key in tool.RECIPES and list(rec.paths) == list(tool.RECIPES[rec.key].paths), \
            f"{path.name} was not written by the current recipe {rec.key!r}: rerun {rec.command}"
