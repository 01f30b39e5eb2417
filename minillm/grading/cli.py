"""`minillm grade PATH`: run a lab notebook headlessly and print a per-task scorecard.

PATH is a lab folder (labs/lab01, solutions/lab01, or any copy of one) or a .ipynb file. The notebook runs
top to bottom in a fresh kernel (the current Python's `python3` kernel), cell by cell, carrying on after
errors; every graded cell (nbgrader metadata: grade=True, solution=False) scores its points when it ran
without an error — the same rule `nbgrader autograde` applies. No nbgrader course setup is needed.

The last line is exactly `score: X/Y`; the exit status is 0 only at full marks.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

DEFAULT_TIMEOUT = 600


@dataclass
class TaskResult:
    grade_id: str
    points: float
    passed: bool
    message: str = ""


def find_notebooks(path: Path) -> list[Path]:
    """The notebook(s) to grade: the file itself, `<folder>/<folder>.ipynb`, or every notebook in the folder."""
    path = Path(path)
    if path.is_file():
        if path.suffix != ".ipynb":
            raise ValueError(f"{path} is not a notebook (.ipynb) or a lab folder")
        return [path]
    if not path.is_dir():
        raise FileNotFoundError(f"{path} does not exist: give a lab folder (e.g. labs/lab01) or a .ipynb file")
    own = path / f"{path.resolve().name}.ipynb"
    if own.is_file():
        return [own]
    found = sorted(p for p in path.glob("*.ipynb") if not p.name.startswith("."))
    if not found:
        raise FileNotFoundError(f"{path} holds no .ipynb notebook to grade")
    return found


def graded_cells(nb) -> list:
    cells = []
    for cell in nb.cells:
        meta = cell.get("metadata", {}).get("nbgrader", {})
        if cell.cell_type == "code" and meta.get("grade") and not meta.get("solution"):
            cells.append(cell)
    return cells


def _first_error_line(cell) -> str | None:
    for out in cell.get("outputs", []):
        if out.get("output_type") == "error":
            evalue = (out.get("evalue") or "").strip().splitlines()
            first = evalue[0].strip() if evalue else ""
            return f"{out.get('ename', 'Error')}: {first}" if first else out.get("ename", "Error")
    return None


def _checksum_ok(cell) -> bool:
    """A release notebook carries nbgrader checksums of its locked cells: a graded cell whose source was
    edited (e.g. the checker call deleted) must not score. Solutions notebooks carry no checksum."""
    expected = cell.metadata.get("nbgrader", {}).get("checksum")
    if not expected:
        return True
    try:
        from nbgrader.utils import compute_checksum
    except ImportError:
        return True
    return compute_checksum(cell) == expected


def execute_notebook(nb_path: Path, timeout: int = DEFAULT_TIMEOUT, kernel_name: str = "python3"):
    """Execute a copy of the notebook in its own folder; returns the executed NotebookNode (file untouched)."""
    import nbformat
    from nbclient import NotebookClient
    try:
        nb = nbformat.read(nb_path, as_version=4)
    except Exception as e:          # not JSON, or JSON that is not a notebook (nbformat raises several kinds)
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"{nb_path} is not a Jupyter notebook that nbformat can read ({first[:160]}): pass a "
                         "lab's .ipynb file") from None
    client = NotebookClient(nb, timeout=timeout, kernel_name=kernel_name, allow_errors=True,
                            interrupt_on_timeout=True,
                            resources={"metadata": {"path": str(nb_path.parent.resolve())}})
    try:
        # The kernel process's own stderr holds only launcher noise (cell output, stderr included, travels in
        # the notebook's outputs), so keep the scorecard clean.
        client.execute(stderr=subprocess.DEVNULL)
    except Exception as e:  # the kernel died (e.g. out of memory): cells after it count as not run
        print(f"warning: execution stopped: {type(e).__name__}: {str(e).strip().splitlines()[:1]}",
              file=sys.stderr)
    return nb


def grade_notebook(nb_path: Path, timeout: int = DEFAULT_TIMEOUT) -> list[TaskResult]:
    nb = execute_notebook(nb_path, timeout)
    results = []
    for cell in graded_cells(nb):
        meta = cell.metadata["nbgrader"]
        points = float(meta.get("points", 0) or 0)
        gid = meta.get("grade_id", "?")
        if not _checksum_ok(cell):
            results.append(TaskResult(gid, points, False, "the graded cell was modified: restore it "
                                                          "(it must be the one-line checker call)"))
            continue
        err = _first_error_line(cell)
        if err is None and cell.get("execution_count") is None:
            err = "the cell did not run"
        results.append(TaskResult(gid, points, err is None, err or ""))
    return results


def _fmt(x: float) -> str:
    return f"{x:g}"


def cmd_grade(args) -> int:
    try:
        notebooks = find_notebooks(Path(args.path))
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    got = total = 0.0
    any_graded = False
    for nb_path in notebooks:
        print(f"grading {nb_path} (running it headless; this takes as long as the lab) ...", flush=True)
        t0 = time.perf_counter()
        results = grade_notebook(nb_path, args.timeout)
        print(f"{nb_path.name}: ran in {time.perf_counter() - t0:.0f} s")
        width = max([len(r.grade_id) for r in results] + [4])
        for r in results:
            any_graded = True
            mark = f"{_fmt(r.points if r.passed else 0)}/{_fmt(r.points)}"
            status = "pass" if r.passed else f"FAIL  {r.message}"
            print(f"  {r.grade_id:<{width}}  {mark:>7}  {status}")
            got += r.points if r.passed else 0
            total += r.points
    if not any_graded:
        print(f"error: no graded cells (nbgrader metadata grade=True) in {args.path}", file=sys.stderr)
        print("score: 0/0")
        return 2
    print(f"score: {_fmt(got)}/{_fmt(total)}")
    return 0 if got == total else 1


def add_grade_parser(subparsers) -> argparse.ArgumentParser:
    """Register `minillm grade PATH` on the main CLI's subparsers."""
    p = subparsers.add_parser(
        "grade", help="run a lab notebook headless and print its scorecard (score: X/Y)",
        description="Execute a lab notebook top to bottom in a fresh kernel and grade its graded cells. "
                    "Exit status 0 only at full marks.")
    p.add_argument("path", help="a lab folder (labs/lab01, solutions/lab01, a copy of one) or a .ipynb file")
    p.add_argument("--timeout", type=int, default=DEFAULT_TIMEOUT,
                   help=f"seconds per cell before it counts as failed (default {DEFAULT_TIMEOUT})")
    p.set_defaults(func=cmd_grade)
    return p


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="minillm-grade")
    sub = ap.add_subparsers(dest="command", required=True)
    add_grade_parser(sub)
    args = ap.parse_args(["grade", *(argv if argv is not None else sys.argv[1:])])
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
