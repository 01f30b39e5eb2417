"""`minillm grade PATH`: run a lab notebook headlessly and print a per-task scorecard.

PATH is a lab folder (labs/lab01, solutions/lab01, or any copy of one) or a .ipynb file. The notebook runs
top to bottom in a fresh kernel (the current Python's `python3` kernel), cell by cell, carrying on after
errors; every graded cell (nbgrader metadata: grade=True, solution=False) scores its points when it ran
without an error — the same rule `nbgrader autograde` applies. No nbgrader course setup is needed.

A failing task prints its whole verdict (message, smallest failing example, hint) under its line. When the cause
is elsewhere it says so: a syntax error in the task's answer cell (that cell and the line), an answer cell that
raised, a cell that ran past --timeout ("timed out after N s": nbclient interrupts it and grading goes on).

The last line is exactly `score: X/Y`; the exit status is 0 only at full marks.
"""
from __future__ import annotations

import argparse
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from nbformat import NotebookNode

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


def _error(cell: NotebookNode) -> dict | None:
    """The cell's first error output (nbformat's: ename, evalue, traceback), or None."""
    return next((o for o in cell.get("outputs", []) if o.get("output_type") == "error"), None)


_SYNTAX_ERRORS = ("SyntaxError", "IndentationError", "TabError")
# Python's text for a SyntaxError: "invalid syntax (1063758517.py, line 3)"; the file is the cell's own
_SYNTAX_RE = re.compile(r"^(?P<msg>.*?)\s*\((?P<file>[^()]*), line (?P<line>\d+)\)\s*$", re.S)


def _verdict(err: dict, timeout: int) -> str:
    """What a graded cell's error says: a checker's whole verdict as it is, any other error with its name."""
    ename, evalue = err.get("ename", "Error"), (err.get("evalue") or "").strip()
    if ename == "KeyboardInterrupt":
        return f"timed out after {timeout} s: the graded cell was interrupted (an endless loop?)"
    if ename == "GradingError":
        return evalue or "the check failed"
    return f"{ename}: {evalue}" if evalue else ename


def _answer_cells(cells: list, at: int, grade_id: str) -> list[int]:
    """Indices of the answer cells of the graded cell cells[at]: nbgrader's `<grade_id>_answer` cells, else the
    solution cells since the previous graded cell, else every code cell since then."""
    named = [i for i, c in enumerate(cells) if _meta(c).get("grade_id") == f"{grade_id}_answer"]
    if named:
        return named
    start = max([i for i in range(at) if _is_graded(cells[i])] + [-1]) + 1
    between = [i for i in range(start, at) if cells[i].cell_type == "code"]
    return [i for i in between if _meta(cells[i]).get("solution")] or between


def _meta(cell: NotebookNode) -> dict:
    return cell.get("metadata", {}).get("nbgrader", {})


def _is_graded(cell: NotebookNode) -> bool:
    return cell.cell_type == "code" and bool(_meta(cell).get("grade")) and not _meta(cell).get("solution")


def _answer_trouble(cells: list, answers: list[int], grade_id: str, timeout: int, graded_err: dict) -> str | None:
    """The cause of a failed task found in its answer cells: a syntax error (always the cause: nothing of that cell
    was defined), an interrupted cell, or an error when the graded cell did not fail with a verdict of its own."""
    for i in answers:
        err = _error(cells[i])
        if err is None:
            continue
        where = f"the answer cell of {grade_id} (cell {i + 1} of the notebook)"
        ename, evalue = err.get("ename", "Error"), (err.get("evalue") or "").strip()
        if ename in _SYNTAX_ERRORS:
            m = _SYNTAX_RE.match(evalue)
            msg, line = (m.group("msg"), int(m.group("line"))) if m else (evalue, None)
            src = cells[i].source.splitlines()
            shown = f"\n    {src[line - 1].rstrip()}" if line and 0 < line <= len(src) else ""
            kind = "indentation error" if ename != "SyntaxError" else "syntax error"
            return (f"{kind} in {where}" + (f", line {line}" if line else "") + f": {msg}{shown}\n"
                    "nothing in that cell ran: fix the line, run the cell, then the graded cell.")
        if ename == "KeyboardInterrupt":
            return (f"timed out after {timeout} s: {where} was still running when it was interrupted (an endless "
                    "loop at the cell's top level?)")
        if graded_err.get("ename") != "GradingError":
            first = (evalue.splitlines() or [""])[0]
            return f"{where} raised {ename}" + (f": {first}" if first else "") + \
                f"\nso the graded cell failed with {_verdict(graded_err, timeout)}"
    return None


def _checksum_ok(cell: NotebookNode) -> bool:
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


def read_notebook(nb_path: Path) -> NotebookNode:
    import nbformat
    try:
        return nbformat.read(nb_path, as_version=4)
    except Exception as e:          # not JSON, or JSON that is not a notebook (nbformat raises several kinds)
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"{nb_path} is not a Jupyter notebook that nbformat can read ({first[:160]}): pass a "
                         "lab's .ipynb file") from None


def execute_notebook(nb_path: Path, timeout: int = DEFAULT_TIMEOUT, kernel_name: str = "python3",
                     nb: NotebookNode | None = None) -> NotebookNode:
    """Execute a copy of the notebook (or `nb`) in the notebook's folder; returns the executed NotebookNode (the
    file is untouched)."""
    from nbclient import NotebookClient
    nb = read_notebook(nb_path) if nb is None else nb
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
    """The trusted scorecard: answers taken out of a fresh kernel, each checked with the learner's code in a
    sandbox process (minillm.grading.trusted)."""
    from minillm.grading.trusted import run_trusted
    nb = run_trusted(read_notebook(nb_path), lambda work: execute_notebook(nb_path, timeout, nb=work))
    return grade_cells(nb.cells, timeout)


def grade_cells(cells: list, timeout: int = DEFAULT_TIMEOUT) -> list[TaskResult]:
    """The scorecard of an executed notebook's cells (nbgrader's rule: a graded cell scores when it ran without an
    error), with each failure's whole verdict, or its cause when that lies in the task's answer cell."""
    results = []
    for at, cell in enumerate(cells):
        if not _is_graded(cell):
            continue
        meta = _meta(cell)
        points = float(meta.get("points", 0) or 0)
        gid = meta.get("grade_id", "?")
        if not _checksum_ok(cell):
            results.append(TaskResult(gid, points, False, "the graded cell was modified: restore it "
                                                          "(it must be the one-line checker call)"))
            continue
        err = _error(cell)
        if err is None:
            ran = cell.get("execution_count") is not None
            notes = [o.get("text", "").strip() for o in cell.get("outputs", []) if o.get("output_type") == "stream"
                     and o.get("text", "").startswith("note for your instructor")]
            results.append(TaskResult(gid, points, ran, "\n".join(notes) if ran else "the cell did not run"))
            continue
        cause = _answer_trouble(cells, _answer_cells(cells, at, gid), gid, timeout, err)
        results.append(TaskResult(gid, points, False, cause or _verdict(err, timeout)))
    return results


def scorecard_lines(r: TaskResult, width: int) -> list[str]:
    """One task's lines of the scorecard: id, points and pass, or FAIL and the whole verdict, its later lines
    indented under its first."""
    mark = f"{_fmt(r.points if r.passed else 0)}/{_fmt(r.points)}"
    head = f"  {r.grade_id:<{width}}  {mark:>7}  "
    if r.passed:          # a pass may carry a note for the instructor (a verbatim copy of minillm's code)
        return [head + "pass"] + [" " * (len(head) + 6) + line for line in r.message.splitlines()]
    first, *rest = r.message.splitlines() or [""]
    return [f"{head}FAIL  {first}".rstrip()] + [" " * (len(head) + 6) + line for line in rest]


def _fmt(x: float) -> str:
    return f"{x:g}"


def cmd_grade(args: argparse.Namespace) -> int:
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
            print("\n".join(scorecard_lines(r, width)))
            got += r.points if r.passed else 0
            total += r.points
    if not any_graded:
        print(f"error: no graded cells (nbgrader metadata grade=True) in {args.path}", file=sys.stderr)
        print("score: 0/0")
        return 2
    print(f"score: {_fmt(got)}/{_fmt(total)}")
    return 0 if got == total else 1


def add_grade_parser(subparsers: Any) -> argparse.ArgumentParser:
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
