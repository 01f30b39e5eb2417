#!/usr/bin/env python
"""Build the course notebooks: solutions/labNN/labNN.py (jupytext percent format) -> labNN.ipynb -> labs/.

The .py files are the single source of truth (readable diffs). A cell header carries its nbgrader role:

    # %% [markdown]                       plain text (no nbgrader metadata)
    # %%                                  plain code (setup, plug-in, measurement): the learner may edit it
    # %% nbgrader="readonly"              locked code or markdown (e.g. the imports of the checkers)
    # %% nbgrader="answer"                the learner's answer: code between ### BEGIN SOLUTION / ### END SOLUTION
    # %% nbgrader="graded" points=2       a locked graded cell: exactly one line,
                                          `from minillm.grading.labNN import check_labNN_K; check_labNN_K(name)`;
                                          its grade_id is labNN_K (taken from the call)

Answer cells get grade_id labNN_K_answer (K from the next graded cell), read-only cells labNN_readonly_I. A graded
cell sits under a markdown heading `## Task K — title (N points)`; "labNN_K · title" goes into its metadata
({"minillm": {"title": ...}}), and nbgrader's feedback names the task by it. The notebook's metadata is written as
JupyterLab would write it (kernelspec, ipykernel's language_info), so a notebook opens without unsaved changes.
This script checks the conventions (unique ids, one-line graded calls, a solution in every answer cell,
every task answered) and fails loudly when a source breaks them.

    python tools/build_notebooks.py                 # all labs: .py -> solutions/labNN/labNN.ipynb
    python tools/build_notebooks.py --release       # ... then `nbgrader generate_assignment` -> labs/
    python tools/build_notebooks.py lab01 --release # one lab
    python tools/build_notebooks.py --check         # exit 1 if an .ipynb is out of date with its .py
    python tools/build_notebooks.py --workspace     # copy labs/ into work/ (the learner's copy), never overwriting

Learners work in work/ (outside git's tracked files; `make lab` opens it): --release regenerates labs/ and refuses
to overwrite a labs/ notebook that differs from the committed one (someone's edits) unless --overwrite-edited,
which first saves it under work/backups/.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAB_RE = re.compile(r"^lab\d\d$")
# A graded cell imports its checker afresh (an answer cell may have rebound the name) and calls it on the answer.
GRADED_RE = re.compile(r"^from minillm\.grading\.(?P<lab>lab\d\d) import check_(?P<id>lab\d\d_\d+); "
                       r"check_(?P=id)\([A-Za-z_][A-Za-z_0-9.]*\)$")
# A notebook's metadata as JupyterLab writes it once a kernel connects: the python3 kernelspec, and the language_info
# of ipykernel's kernel_info reply. Anything less and JupyterLab fills it in on open, so every notebook opens with
# unsaved changes (a learner asked "save?" before touching anything). Only the version depends on the machine.
KERNELSPEC = {"display_name": "Python 3 (ipykernel)", "language": "python", "name": "python3"}
SCHEMA = 3
# "## Task 2 — `draw`: one token per row, each row with its own generator (3 points)": the task's title
TASK_RE = re.compile(r"^## Task (?P<k>\d+) — (?P<title>.+?)(?: \(\d+(?:\.\d+)? points?\))?\s*$", re.M)


def python_version() -> str:
    """This interpreter's version as ipykernel reports it (`sys.version.split()[0]`, e.g. 3.11.7)."""
    return sys.version.split()[0]


def language_info(version: str | None = None) -> dict:
    """ipykernel's language_info (its kernel_info reply) for Python `version` (default: this interpreter's)."""
    return {"codemirror_mode": {"name": "ipython", "version": 3}, "file_extension": ".py",
            "mimetype": "text/x-python", "name": "python", "nbconvert_exporter": "python",
            "pygments_lexer": "ipython3", "version": version or python_version()}


class SourceError(ValueError):
    pass


def lab_ids(root: Path = ROOT) -> list[str]:
    """Every lab that has a source: solutions/labNN/labNN.py (or, without one, a hand-made labNN.ipynb)."""
    sol = root / "solutions"
    return sorted(d.name for d in sol.iterdir() if d.is_dir() and LAB_RE.match(d.name)
                  and ((d / f"{d.name}.py").is_file() or (d / f"{d.name}.ipynb").is_file()))


def _nbgrader_meta(role: str, grade_id: str, points: float | None = None) -> dict:
    base = {"grade": False, "grade_id": grade_id, "locked": False, "schema_version": SCHEMA, "solution": False}
    if role == "answer":
        base.update(solution=True)
    elif role == "graded":
        base.update(grade=True, locked=True, points=points)
    elif role == "readonly":
        base.update(locked=True)
    else:
        raise SourceError(f"unknown nbgrader role {role!r}: use answer, graded or readonly")
    return base


def build_notebook(py_path: Path, python: str | None = None):
    """Read a percent-format source and return the nbgrader-ready notebook (a NotebookNode); `python` is the Python
    version its language_info names (default: this interpreter's)."""
    import jupytext
    import nbformat
    lab = py_path.stem
    src = jupytext.read(py_path, fmt="py:percent")
    nb = nbformat.v4.new_notebook()
    nb.metadata = {"kernelspec": dict(KERNELSPEC), "language_info": language_info(python)}
    cells = list(src.cells)
    # grade ids of graded cells first, so answer cells can take the id of the task they precede
    graded_ids: dict[int, str] = {}
    for idx, cell in enumerate(cells):
        if cell.metadata.get("nbgrader") == "graded":
            line = cell.source.strip()
            m = GRADED_RE.match(line)
            if not m or "\n" in line:
                raise SourceError(f"{py_path}: graded cell #{idx} must be one line `from minillm.grading.{lab} import "
                                  f"check_{lab}_K; check_{lab}_K(name)`, got {cell.source!r}")
            if m.group("lab") != lab or not m.group("id").startswith(lab + "_"):
                raise SourceError(f"{py_path}: graded cell calls {m.group(0)!r} but this is {lab}")
            graded_ids[idx] = m.group("id")
    if len(set(graded_ids.values())) != len(graded_ids):
        raise SourceError(f"{py_path}: duplicate graded task ids {sorted(graded_ids.values())}")
    if not graded_ids:
        raise SourceError(f"{py_path}: no graded cells")
    seen_answer: dict[str, int] = {}
    readonly = 0
    heading: tuple[str, str] | None = None            # the last "## Task K — title" seen: (K, title)
    for idx, cell in enumerate(cells):
        if cell.cell_type == "markdown":
            found = TASK_RE.findall(cell.source)
            heading = found[-1] if found else heading
        role = cell.metadata.pop("nbgrader", None)
        points = cell.metadata.pop("points", None)
        for junk in ("lines_to_next_cell", "title", "cell_marker", "lines_to_end_of_cell_marker"):
            cell.metadata.pop(junk, None)
        if cell.cell_type == "code":
            new = nbformat.v4.new_code_cell(cell.source, metadata=dict(cell.metadata))
        elif cell.cell_type == "markdown":
            new = nbformat.v4.new_markdown_cell(cell.source, metadata=dict(cell.metadata))
        else:
            new = nbformat.v4.new_raw_cell(cell.source, metadata=dict(cell.metadata))
        new.id = f"{lab}-c{idx:02d}"
        if isinstance(role, dict):        # full nbgrader metadata written by hand: keep it
            new.metadata["nbgrader"] = role
            new.id = role.get("grade_id", new.id)
        elif role == "graded":
            if not points or float(points) <= 0:
                raise SourceError(f"{py_path}: graded cell {graded_ids[idx]} needs points=N (N > 0)")
            new.metadata["nbgrader"] = _nbgrader_meta("graded", graded_ids[idx], points)
            new.id = graded_ids[idx]
            k = graded_ids[idx].rsplit("_", 1)[1]
            if heading is None or heading[0] != k:
                raise SourceError(f"{py_path}: graded cell {graded_ids[idx]} is not under a markdown heading "
                                  f"`## Task {k} — title (N points)`")
            # nbgrader's feedback names a graded cell by this title (minillm/grading/templates/feedback_titled)
            new.metadata["minillm"] = {"title": f"{graded_ids[idx]} · {heading[1].replace('`', '')}"}
        elif role == "answer":
            task = next((graded_ids[j] for j in sorted(graded_ids) if j > idx), None)
            if task is None:
                raise SourceError(f"{py_path}: answer cell #{idx} is not followed by a graded cell")
            if "### BEGIN SOLUTION" not in cell.source or "### END SOLUTION" not in cell.source:
                raise SourceError(f"{py_path}: answer cell for {task} lacks ### BEGIN SOLUTION / ### END SOLUTION")
            seen_answer[task] = seen_answer.get(task, 0) + 1
            gid = f"{task}_answer" + ("" if seen_answer[task] == 1 else str(seen_answer[task]))
            new.metadata["nbgrader"] = _nbgrader_meta("answer", gid)
            new.id = gid
        elif role == "readonly":
            readonly += 1
            gid = f"{lab}_readonly_{readonly}"
            new.metadata["nbgrader"] = _nbgrader_meta("readonly", gid)
            new.id = gid
        elif role is not None:
            raise SourceError(f"{py_path}: cell #{idx} has unknown nbgrader role {role!r}")
        if "### BEGIN SOLUTION" in cell.source and role != "answer":
            raise SourceError(f"{py_path}: cell #{idx} has a solution region but is not an answer cell")
        nb.cells.append(new)
    missing = sorted(set(graded_ids.values()) - set(seen_answer))
    if missing:
        raise SourceError(f"{py_path}: tasks without an answer cell: {missing}")
    nbformat.validate(nb)
    return nb


def notebook_text(nb) -> str:
    import nbformat
    return nbformat.writes(nb) + "\n"


def recorded_python(ipynb: Path) -> str | None:
    """The Python version a built notebook's language_info names (None when there is no such notebook)."""
    try:
        version = json.loads(ipynb.read_text())["metadata"]["language_info"]["version"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return version if isinstance(version, str) and re.fullmatch(r"\d+\.\d+\.\d+\S*", version) else None


def build_lab(lab: str, root: Path = ROOT, check: bool = False) -> bool:
    """Write solutions/<lab>/<lab>.ipynb from its .py; returns True when the file changed (or would).
    The Python version in language_info stays the one the notebook already records (a build on another Python is
    not a change to the course); a learner's copy gets the version of the Python that runs it (`workspace`)."""
    d = root / "solutions" / lab
    py, ipynb = d / f"{lab}.py", d / f"{lab}.ipynb"
    if not py.is_file():
        return False  # a hand-made notebook without a .py source: nothing to build
    text = notebook_text(build_notebook(py, recorded_python(ipynb)))
    old = ipynb.read_text() if ipynb.is_file() else None
    if old == text:
        return False
    if not check:
        ipynb.write_text(text)
    return True


def nbgrader_env(state_dir: str | Path | None = None) -> dict[str, str]:
    """Environment for running nbgrader: this venv's bin on PATH (nbgrader shells out to `alembic` when it
    creates a gradebook) and, optionally, a private folder for the gradebook and exchange."""
    env = dict(os.environ)
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    if state_dir is not None:
        env["MINILLM_NBGRADER_DIR"] = str(state_dir)
    return env


def nbgrader(args: list[str], root: Path = ROOT, state_dir: str | Path | None = None,
             timeout: float | None = None) -> subprocess.CompletedProcess:
    """Run `nbgrader ARGS` from the course root `root` (it reads nbgrader_config.py only from the cwd)."""
    cmd = [sys.executable, "-m", "nbgrader", *args]
    r = subprocess.run(cmd, cwd=root, capture_output=True, text=True, env=nbgrader_env(state_dir), timeout=timeout)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({r.returncode}) in {root}:\n{r.stdout}\n{r.stderr}")
    return r


def release(labs: list[str], root: Path = ROOT, state_dir: str | Path | None = None) -> None:
    """`nbgrader generate_assignment LAB --force` for each lab: solutions/LAB -> labs/LAB."""
    for lab in labs:
        nbgrader(["generate_assignment", lab, "--force", "--log-level=WARN"], root, state_dir)


def edited_releases(labs: list[str], root: Path = ROOT) -> list[Path]:
    """The labs/ notebooks that differ from the committed ones (a learner's saved work), per git; none outside git."""
    paths = [root / "labs" / lab / f"{lab}.ipynb" for lab in labs]
    done = subprocess.run(["git", "diff", "--name-only", "HEAD", "--", *map(str, paths)], cwd=root,
                          capture_output=True, text=True)
    if done.returncode != 0:
        return []
    return [root / line for line in done.stdout.split()]


def back_up(paths: list[Path], root: Path = ROOT) -> Path:
    """Copy `paths` to work/backups/<time>/ (keeping their labs/... layout); returns that folder."""
    dest = root / "work" / "backups" / time.strftime("%Y%m%d-%H%M%S")
    for path in paths:
        target = dest / path.relative_to(root)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(path, target)
    return dest


def workspace(root: Path = ROOT) -> list[Path]:
    """Copy labs/ into work/ where work/ lacks a file; never overwrite one (it is the learner's). Returns the copies.
    A notebook's language_info names this interpreter's Python (the kernel `make lab` starts), so JupyterLab finds
    nothing to fill in and the notebook opens without unsaved changes."""
    import nbformat
    made = []
    for src in sorted((root / "labs").rglob("*")):
        rel = src.relative_to(root / "labs")
        dest = root / "work" / rel
        if src.is_file() and ".ipynb_checkpoints" not in rel.parts and not dest.exists():
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest)
            if src.suffix == ".ipynb":
                nb = nbformat.read(src, as_version=nbformat.NO_CONVERT)
                if nb.metadata.get("language_info", {}).get("name") == "python":
                    nb.metadata["language_info"] = language_info()
                    dest.write_text(notebook_text(nb))
            made.append(dest)
    return made


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("labs", nargs="*", help="lab ids (default: every solutions/labNN)")
    ap.add_argument("--release", action="store_true", help="also run nbgrader generate_assignment into labs/")
    ap.add_argument("--check", action="store_true", help="only report .ipynb files out of date with their .py")
    ap.add_argument("--overwrite-edited", action="store_true",
                    help="with --release: regenerate edited labs/ notebooks too (saved first to work/backups)")
    ap.add_argument("--workspace", action="store_true", help="copy labs/ into work/ where work/ lacks a file, and stop")
    args = ap.parse_args(argv)
    if args.workspace:
        made = workspace()
        print(f"work/: {len(made)} new file(s) copied from labs/; your own files there are never overwritten")
        return 0
    labs = args.labs or lab_ids()
    edited = edited_releases(labs) if args.release else []
    if edited and not args.overwrite_edited:
        names = ", ".join(str(p.relative_to(ROOT)) for p in edited)
        print(f"error: {names} changed since the last commit (a learner's saved work?): regenerating labs/ would "
              "erase it. Learners work in work/ (`make lab` copies labs/ there). To regenerate anyway, run "
              "`make labs FORCE=1`: the edited notebooks are saved to work/backups/ first.", file=sys.stderr)
        return 2
    if edited:
        print(f"saved the edited notebooks to {back_up(edited).relative_to(ROOT)}/ before regenerating labs/")
    stale = []
    for lab in labs:
        try:
            changed = build_lab(lab, check=args.check)
        except SourceError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        if changed:
            stale.append(lab)
            print(f"{'stale' if args.check else 'built'}: solutions/{lab}/{lab}.ipynb")
    if args.check:
        return 1 if stale else 0
    if args.release:
        release(labs)
        for lab in labs:
            print(f"released: labs/{lab}/")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONHASHSEED", "0")
    sys.exit(main())
