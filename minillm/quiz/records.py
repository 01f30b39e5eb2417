"""Measurement records: the figures the question bank quotes about minillm itself, each from a recorded run.

A record is one JSON file, `results/<key>.json`, written by the command it names (`tools/record_measurements.py
KEY`). It keeps the date, the machine, the command line, the values measured, and `code`: the source paths the
measurement exercises with a sha256 over their contents at the time of the run. A bank entry cites a figure with
`measured: [{claim, record, key}]`; `verify_measured` reads the claim as written in the entry's text and compares
it with the record's value. `stale` says when the code the record measured has changed since: the hash covers the
files' contents (not mtimes, not git history), so it gives the same verdict in a fresh clone, in CI, or in a
working tree with uncommitted edits.
"""
from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
RESULTS_DIR = REPO / "results"
SOURCE_SUFFIXES = (".py", ".c", ".h", ".cpp", ".cu")
_SKIP_DIRS = {"__pycache__", ".ipynb_checkpoints"}


class RecordError(ValueError):
    """A record is missing, malformed or does not hold the key an entry cites."""


@dataclass(frozen=True)
class Record:
    key: str
    command: str
    date: str
    machine: dict[str, Any]
    paths: tuple[str, ...]          # what the measurement exercises, relative to the repository root
    code_sha256: str
    values: dict[str, Any]
    file: Path

    def value(self, name: str) -> float:
        if name not in self.values:
            raise RecordError(f"{self.file.name}: no value {name!r}; it holds {', '.join(sorted(self.values))}")
        v = self.values[name]
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise RecordError(f"{self.file.name}: value {name!r} is {v!r}, not a number")
        return float(v)


def source_files(paths: list[str] | tuple[str, ...], root: Path = REPO) -> list[Path]:
    """Every source file under `paths` (files or directories), sorted; a path that does not exist is an error,
    since a record must not silently measure nothing."""
    files: set[Path] = set()
    for rel in paths:
        p = root / rel
        if p.is_file():
            files.add(p)
        elif p.is_dir():
            files |= {f for f in p.rglob("*") if f.is_file() and f.suffix in SOURCE_SUFFIXES
                      and not _SKIP_DIRS & set(f.relative_to(root).parts)}
        else:
            raise RecordError(f"measured path {rel!r} does not exist")
    return sorted(files)


def _code_only(data: bytes) -> bytes:
    """A jupytext percent script (a lab) without its markdown cells: prose edits do not change what it measures."""
    text = data.decode("utf-8", "replace")
    if "# %% [markdown]" not in text:
        return data
    out, in_md = [], False
    for line in text.splitlines():
        if line.startswith("# %%"):
            in_md = "[markdown]" in line
        if not in_md:
            out.append(line)
    return "\n".join(out).encode()


def code_hash(paths: list[str] | tuple[str, ...], root: Path = REPO) -> str:
    """sha256 over the relative path and contents of every source file under `paths` (a lab script's code cells,
    not its prose): changes exactly when one of them is edited, added, removed or renamed."""
    h = hashlib.sha256()
    for f in source_files(paths, root):
        h.update(f.relative_to(root).as_posix().encode() + b"\0")
        h.update(_code_only(f.read_bytes().replace(b"\r\n", b"\n")) + b"\0")
    return h.hexdigest()


def load_record(key: str, results_dir: Path = RESULTS_DIR) -> Record:
    path = results_dir / f"{key}.json"
    if not path.is_file():
        raise RecordError(f"no record {path.name} in {results_dir}; write it with "
                          f"`python tools/record_measurements.py {key}`")
    try:
        d = json.loads(path.read_text(encoding="utf-8"))
        return Record(key=d["key"], command=d["command"], date=d["date"], machine=d["machine"],
                      paths=tuple(d["code"]["paths"]), code_sha256=d["code"]["sha256"], values=d["values"],
                      file=path)
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise RecordError(f"{path.name} is not a measurement record ({e!r}); rewrite it with "
                          f"`python tools/record_measurements.py {key}`") from None


def load_records(results_dir: Path = RESULTS_DIR) -> dict[str, Record]:
    return {p.stem: load_record(p.stem, results_dir) for p in sorted(results_dir.glob("*.json"))}


def stale(record: Record, root: Path = REPO) -> str | None:
    """Why the record no longer describes the code (None when it does)."""
    try:
        now = code_hash(record.paths, root)
    except RecordError as e:
        return f"{record.file.name}: {e}; rerun `{record.command}`"
    if now != record.code_sha256:
        return (f"{record.file.name} ({record.date}) measured {', '.join(record.paths)} as they were then; "
                f"that code has changed since. Rerun `{record.command}` and update the entries that cite it")
    return None


# "57 steps", "~1.3x", "50.5 ms/token", "2.1%", "56 sequences", "8 requests", "1.4x faster"
_CLAIM = re.compile(r"^~?\s*([0-9][0-9,]*(?:\.[0-9]+)?)\s*(x|×|%|ms/token|ms|s|tok/s|tokens/s|steps|sequences|"
                    r"requests|tokens|prompt tokens/s|MB)?$")


def parse_measured_claim(claim: str) -> float:
    """The number of a cited figure, in the record's units: '57 steps' -> 57, '~1.3x' -> 1.3, '2.1%' -> 2.1
    (percent figures are recorded in percent), '50.5 ms/token' -> 50.5 (milliseconds are recorded in ms)."""
    m = _CLAIM.match(claim.strip())
    if not m:
        raise RecordError(f"cannot read the measured figure {claim!r}: write a number and one of x, %, ms/token, "
                          "ms, s, tok/s, steps, sequences, requests, tokens")
    return float(m.group(1).replace(",", ""))


def verify_measured(item: dict[str, Any], results_dir: Path = RESULTS_DIR) -> tuple[float, float]:
    """(claimed, recorded); AssertionError when they differ by more than rel_tol (default 0: exact) and by more than
    the rounding of the claim as written (57 covers 56.5-57.5, 1.3 covers 1.25-1.35)."""
    record = load_record(item["record"], results_dir)
    recorded = record.value(item["key"])
    claimed = parse_measured_claim(item["claim"])
    digits = item["claim"].replace(",", "")
    decimals = len(m.group(1)) if (m := re.search(r"\.(\d+)", digits)) else 0
    rounding = 0.5 * 10 ** -decimals + 1e-9
    tol = float(item.get("rel_tol", 0.0))
    if not (math.isclose(claimed, recorded, rel_tol=tol) or abs(claimed - recorded) <= rounding):
        raise AssertionError(f"claim {item['claim']!r} = {claimed:g} but {record.file.name} ({record.date}, "
                             f"`{record.command}`) recorded {item['key']} = {recorded:g} (rel_tol {tol})")
    return claimed, recorded
