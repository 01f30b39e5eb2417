"""The course as a whole: every lab in solutions/ is built, released, graded and timed.

Driven by the list of lab folders (solutions/labNN), so a new lab is covered the moment its folder exists:
- the .ipynb sources are up to date with their jupytext .py, and follow the cell conventions;
- labs/ is what `nbgrader generate_assignment` makes of solutions/ today (checked on the autograde run's release);
- real `nbgrader autograde` into a throwaway gradebook: the solution gets full marks, the untouched release 0;
- the solution's autograde (a full top-to-bottom run) finishes without errors; its run time is measured and
  reported (.pytest_durations.json), not judged: a time budget is a measurement, not a correctness property;
- `minillm grade` gives full marks (exit 0) to a solution folder and 0 (exit 1) to a release folder;
- feedback in a real kernel: a failing graded cell shows the checker's verdict alone (no grader frame, no install
  path) under nbgrader autograde, and `minillm grade` prints whole verdicts, syntax errors in answer cells and
  endless loops as such.
"""
from __future__ import annotations

import importlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import build_book  # noqa: E402
import build_notebooks as bn  # noqa: E402

LABS = bn.lab_ids(ROOT)


def graded(nb):
    return [c for c in nb.cells if c.metadata.get("nbgrader", {}).get("grade")]


def run_seconds(nb) -> float:
    """First cell's start to last cell's reply, from the timings nbclient records in each executed cell
    (kernel start-up and nbgrader's own work are not the learner's wait)."""
    from datetime import datetime
    times = [c.metadata["execution"] for c in nb.cells if c.cell_type == "code"]
    start = datetime.fromisoformat(times[0]["iopub.execute_input"].replace("Z", "+00:00"))
    end = datetime.fromisoformat(times[-1]["shell.execute_reply"].replace("Z", "+00:00"))
    return (end - start).total_seconds()


def course_copy(dest: Path, lab: str) -> Path:
    """A throwaway course: nbgrader_config.py + solutions/<lab>/ (the config roots the course at its own folder)."""
    dest.mkdir(parents=True, exist_ok=True)
    shutil.copy(ROOT / "nbgrader_config.py", dest / "nbgrader_config.py")
    shutil.copytree(ROOT / "solutions" / lab, dest / "solutions" / lab,
                    ignore=shutil.ignore_patterns(".ipynb_checkpoints", "__pycache__", ".hypothesis"))
    return dest


def comparable(nb) -> dict:
    """What must match between two generated notebooks (ignoring ids, outputs and execution counts)."""
    return {"metadata": dict(nb.metadata),
            "cells": [(c.cell_type, c.source, dict(c.metadata)) for c in nb.cells]}


def files_in(d: Path) -> list[str]:
    skip = {".ipynb_checkpoints", "__pycache__", ".hypothesis"}
    return sorted(str(p.relative_to(d)) for p in d.rglob("*") if p.is_file() and not skip & set(p.parts))


def test_labs_00_and_01_exist():
    assert {"lab00", "lab01"} <= set(LABS), LABS


# ---------------------------------------------------------------- cheap: sources and conventions

@pytest.mark.parametrize("lab", LABS)
def test_source_notebook_is_up_to_date_with_its_py(lab):
    if not (ROOT / "solutions" / lab / f"{lab}.py").is_file():
        pytest.skip("hand-made notebook without a jupytext source")
    assert not bn.build_lab(lab, ROOT, check=True), \
        f"solutions/{lab}/{lab}.ipynb is stale: run `make labs` (tools/build_notebooks.py --release)"


@pytest.mark.parametrize("lab", LABS)
def test_graded_cells_are_one_line_calls_of_existing_checkers(lab):
    nb = nbformat.read(ROOT / "solutions" / lab / f"{lab}.ipynb", as_version=4)
    checkers = importlib.import_module(f"minillm.grading.{lab}")
    cells = graded(nb)
    assert 2 <= len(cells) <= 4, f"{lab} has {len(cells)} graded tasks (2–4 expected)"
    ids = [c.metadata["nbgrader"]["grade_id"] for c in cells]
    assert ids == [f"{lab}_{k}" for k in range(1, len(cells) + 1)], ids
    for c in cells:
        meta = c.metadata["nbgrader"]
        assert meta["locked"] and not meta["solution"] and meta["points"] > 0
        m = bn.GRADED_RE.fullmatch(c.source.strip())
        assert m and m.group("id") == meta["grade_id"] and m.group("lab") == lab, c.source
        assert callable(getattr(checkers, f"check_{meta['grade_id']}", None))
    all_ids = [c.metadata["nbgrader"]["grade_id"] for c in nb.cells if "nbgrader" in c.metadata]
    assert len(all_ids) == len(set(all_ids))
    answers = [c for c in nb.cells if c.metadata.get("nbgrader", {}).get("solution")]
    assert len(answers) >= len(cells) and all("### BEGIN SOLUTION" in c.source for c in answers)
    assert (ROOT / "tests" / f"test_grading_{lab}.py").is_file(), \
        f"tests/test_grading_{lab}.py must prove the reference passes and wrong implementations fail"


NOTEBOOKS = sorted(str(p.relative_to(ROOT)) for d in ("solutions", "labs") for p in (ROOT / d).glob("lab*/lab*.ipynb"))


def kernel_metadata() -> tuple[dict, dict]:
    """What JupyterLab writes into a notebook once its kernel connects: the installed python3 kernelspec's name,
    display name and language, and ipykernel's language_info (its kernel_info reply)."""
    from ipykernel.ipkernel import IPythonKernel
    from jupyter_client.kernelspec import KernelSpecManager
    spec = KernelSpecManager().get_kernel_spec("python3")
    return ({"display_name": spec.display_name, "language": spec.language, "name": "python3"},
            dict(IPythonKernel.language_info))


@pytest.mark.parametrize("path", NOTEBOOKS)
def test_notebooks_open_and_save_unchanged(path, tmp_path):
    """Opening a generated notebook and saving it without an edit changes nothing: Jupyter's contents manager reads
    and writes it back byte for byte, and the metadata JupyterLab fills in when a kernel connects (kernelspec,
    language_info) is already there, as the kernel reports it (only the Python version may differ: the learner's
    copy gets this machine's, test_workspace_copy_names_this_python)."""
    from jupyter_server.services.contents.filemanager import FileContentsManager
    from nbformat.sign import NotebookNotary
    shutil.copy(ROOT / path, tmp_path / "nb.ipynb")
    cm = FileContentsManager(root_dir=str(tmp_path))
    cm.notary = NotebookNotary(db_file=":memory:")
    cm.save(cm.get("nb.ipynb"), "nb.ipynb")
    assert (tmp_path / "nb.ipynb").read_bytes() == (ROOT / path).read_bytes(), f"{path} changes when saved unedited"
    nb = nbformat.read(ROOT / path, as_version=4)
    kernelspec, language_info = kernel_metadata()
    assert nb.metadata["kernelspec"] == kernelspec
    written = dict(nb.metadata["language_info"])
    assert re.fullmatch(r"3\.\d+\.\d+\S*", written.pop("version")), nb.metadata["language_info"]
    language_info.pop("version")
    assert written == language_info
    assert nb.nbformat == 4 and nb.nbformat_minor == nbformat.v4.nbformat_minor
    assert all(c.get("id") for c in nb.cells) and len({c.id for c in nb.cells}) == len(nb.cells)


def test_workspace_copy_names_this_python(tmp_path):
    """The learner's copy (`make lab` -> build_notebooks.py --workspace) records the Python that runs it, so the
    kernel's language_info equals the notebook's and JupyterLab opens it without unsaved changes; nothing else in
    the copy differs from labs/."""
    (tmp_path / "labs" / "lab00").mkdir(parents=True)
    shutil.copy(ROOT / "labs" / "lab00" / "lab00.ipynb", tmp_path / "labs" / "lab00" / "lab00.ipynb")
    nb = nbformat.read(tmp_path / "labs" / "lab00" / "lab00.ipynb", as_version=4)
    nb.metadata["language_info"]["version"] = "3.0.1"                   # as if labs/ were built on another Python
    nbformat.write(nb, tmp_path / "labs" / "lab00" / "lab00.ipynb")
    assert bn.workspace(tmp_path) == [tmp_path / "work" / "lab00" / "lab00.ipynb"]
    mine = nbformat.read(tmp_path / "work" / "lab00" / "lab00.ipynb", as_version=4)
    kernelspec, language_info = kernel_metadata()
    assert mine.metadata["kernelspec"] == kernelspec and mine.metadata["language_info"] == language_info
    assert mine.cells == nb.cells
    text = (tmp_path / "work" / "lab00" / "lab00.ipynb").read_text()
    assert text == nbformat.writes(nbformat.reads(text, as_version=4)) + "\n"


def test_a_build_keeps_the_recorded_python_version(tmp_path):
    """Building on another Python is no change to the course: the version already recorded stays."""
    (tmp_path / "solutions" / "lab00").mkdir(parents=True)
    shutil.copy(ROOT / "solutions" / "lab00" / "lab00.py", tmp_path / "solutions" / "lab00" / "lab00.py")
    assert bn.build_lab("lab00", tmp_path)                                  # first build: this interpreter's
    built = tmp_path / "solutions" / "lab00" / "lab00.ipynb"
    assert json.loads(built.read_text())["metadata"]["language_info"]["version"] == bn.python_version()
    built.write_text(built.read_text().replace(f'"version": "{bn.python_version()}"', '"version": "3.99.1"'))
    assert not bn.build_lab("lab00", tmp_path, check=True)
    assert json.loads(built.read_text())["metadata"]["language_info"]["version"] == "3.99.1"


@pytest.mark.parametrize("lab", LABS)
def test_graded_cells_carry_their_tasks_title(lab):
    """Each graded cell names its task as the lab's heading does ("## Task K — title (N points)"), for nbgrader's
    feedback page; nbgrader's release keeps it."""
    for path in (ROOT / "solutions" / lab / f"{lab}.ipynb", ROOT / "labs" / lab / f"{lab}.ipynb"):
        if not path.is_file():
            pytest.skip(f"{path.relative_to(ROOT)} is not built yet")
        nb = nbformat.read(path, as_version=4)
        headings = dict(bn.TASK_RE.findall("\n".join(c.source for c in nb.cells if c.cell_type == "markdown")))
        for c in graded(nb):
            gid = c.metadata["nbgrader"]["grade_id"]
            title = headings[gid.rsplit("_", 1)[1]].replace("`", "")
            assert c.metadata["minillm"]["title"] == f"{gid} · {title}", path


def test_a_graded_cell_without_a_task_heading_is_refused(tmp_path):
    src = tmp_path / "lab00.py"
    text = (ROOT / "solutions" / "lab00" / "lab00.py").read_text()
    src.write_text(text.replace("# ## Task 2 — ", "# ## Step 2 — "))
    with pytest.raises(bn.SourceError, match="lab00_2 is not under a markdown heading"):
        bn.build_notebook(src)


def feedback_html(nb) -> str:
    """nbgrader's feedback page for `nb`, rendered as `nbgrader generate_feedback` renders it: the HTML exporter
    configured by this course's nbgrader_config.py (and the stylesheet folder nbgrader adds)."""
    import nbgrader
    from nbconvert import HTMLExporter
    from traitlets.config.loader import PyFileConfigLoader
    config = PyFileConfigLoader("nbgrader_config.py", path=str(ROOT)).load_config()
    config.HTMLExporter.extra_template_paths = [str(Path(nbgrader.__file__).parent / "server_extensions" / "formgrader"
                                                    / "static" / "node_modules" / "bootstrap" / "dist" / "css")]
    for c in graded(nb):
        c.metadata["nbgrader"]["score"] = 0
    html, _ = HTMLExporter(config=config).from_notebook_node(
        nb, resources={"nbgrader": {"notebook": "lab06", "score": 0, "max_score": 7, "late_penalty": 0}})
    return html


def test_feedback_names_each_task_by_its_title():
    """nbgrader's own template says "Test cell" for every task; the course's names it."""
    nb = nbformat.read(ROOT / "labs" / "lab06" / "lab06.ipynb", as_version=4)
    html = feedback_html(nb)
    toc = re.findall(r'<li><a href="#(lab06_\d)">(.*?)</a>', html)
    assert toc == [("lab06_1", "lab06_1 · process_logits: one batch, one setting per row"),
                   ("lab06_2", "lab06_2 · draw: one token per row, each row with its own generator")], toc
    assert "Test cell" not in html and "Grade cell" not in html
    assert html.count('<span class="nbgrader-label">lab06_2 · draw: one token per row') == 1   # the cell's heading
    assert "Student&#39;s answer" in html or "Student's answer" in html                       # the rest as nbgrader's
    for c in graded(nb):                        # a notebook without titles (made elsewhere) keeps nbgrader's labels
        del c.metadata["minillm"]
    assert feedback_html(nb).count(">Test cell</a>") == 2


@pytest.mark.parametrize("lab", LABS)
def test_figures_are_one_call_each(lab):
    """The labs draw no figure themselves: each is one call of minillm.plots (tests/test_plots.py checks those)."""
    path = ROOT / "solutions" / lab / f"{lab}.py"
    if not path.is_file():
        pytest.skip("hand-made notebook without a jupytext source")
    code = [line for line in path.read_text().splitlines() if not line.lstrip().startswith("#")]
    drawing = [line for line in code if re.search(r"\bplt\.|\bmatplotlib\b|\bax\d?\.|\baxes\b|\.subplots\(", line)]
    assert not drawing, f"{lab} draws a figure itself (move it to minillm/plots.py):\n" + "\n".join(drawing)


def check_release_in_sync(lab: str, course: Path) -> None:
    """The release nbgrader just made from solutions/ in a throwaway course must equal the committed labs/."""
    fresh, committed = course / "labs" / lab, ROOT / "labs" / lab
    assert committed.is_dir(), f"labs/{lab} is missing: run `make labs`"
    assert files_in(fresh) == files_in(committed), "labs/ has different files: run `make labs`"
    for name in files_in(fresh):
        if name.endswith(".ipynb"):
            a = nbformat.read(fresh / name, as_version=4)
            b = nbformat.read(committed / name, as_version=4)
            assert comparable(a) == comparable(b), f"labs/{lab}/{name} is out of date: run `make labs`"
        else:
            assert (fresh / name).read_bytes() == (committed / name).read_bytes(), name
    release = nbformat.read(committed / f"{lab}.ipynb", as_version=4)
    text = nbformat.writes(release)
    assert "### BEGIN SOLUTION" not in text and "raise NotImplementedError()" in text


# ---------------------------------------------------------------- slow: real executions

@pytest.mark.slow
@pytest.mark.parametrize("lab", LABS)
def test_nbgrader_autograde_solution_full_marks_blank_zero(lab, tmp_path, record_duration):
    from nbgrader.api import Gradebook
    course = course_copy(tmp_path / "course", lab)
    state = tmp_path / "state"
    bn.release([lab], course, state_dir=state)           # records the assignment and its cells in the gradebook
    # that release is generated from solutions/ now: labs/ must be in sync with it (the .ipynb is in sync with its
    # .py: test_source_notebook_is_up_to_date_with_its_py)
    check_release_in_sync(lab, course)
    for student, src in (("solution", ROOT / "solutions" / lab), ("blank", ROOT / "labs" / lab)):
        dest = course / "submitted" / student / lab
        dest.mkdir(parents=True)
        shutil.copy(src / f"{lab}.ipynb", dest / f"{lab}.ipynb")
    if lab == "lab00":                 # and one wrong answer, to see what a learner sees (the same nbgrader run)
        submit_wrong_lab00(course)
    # One autograde run grades both submissions (each executed top to bottom in its own kernel); the solution's
    # executed copy is also the learner's run: errors anywhere and unexecuted cells are checked on it, and its run
    # time is reported (not judged). (One nbgrader process, not two: each start costs ~5 s of imports.)
    t0 = time.perf_counter()
    bn.nbgrader(["autograde", lab, "--force"], course, state, timeout=1800)        # a hang guard, not a budget
    record_duration(f"{lab}: nbgrader autograde (solution + blank)", time.perf_counter() - t0)
    ran = nbformat.read(course / "autograded" / "solution" / lab / f"{lab}.ipynb", as_version=4)
    errors = [(i, o.ename, o.evalue) for i, c in enumerate(ran.cells) if c.cell_type == "code"
              for o in c.get("outputs", []) if o.output_type == "error"]
    assert not errors, errors
    assert all(c.execution_count for c in ran.cells if c.cell_type == "code")
    elapsed = run_seconds(ran)
    record_duration(f"{lab}: solution notebook top to bottom", elapsed)
    print(f"{lab}: {elapsed:.0f} s top to bottom")
    build_book.store_execution(lab, ran)     # the book's chapter takes its outputs from this run (tests/test_book.py)
    with Gradebook(f"sqlite:///{state / 'gradebook.db'}") as gb:
        max_score = gb.find_assignment(lab).max_score
        solution = gb.find_submission(lab, "solution").score
        blank = gb.find_submission(lab, "blank").score
    assert max_score > 0
    assert solution == max_score, f"the solution of {lab} got {solution}/{max_score}"
    assert blank == 0, f"the untouched release of {lab} got {blank}/{max_score}"
    # every graded cell of the untouched release says "not implemented yet" (not a NameError, not a traceback)
    blank_ran = nbformat.read(course / "autograded" / "blank" / lab / f"{lab}.ipynb", as_version=4)
    for cell in graded(blank_ran):
        errors = [o for o in cell.get("outputs", []) if o.output_type == "error"]
        assert errors and errors[0].ename == "GradingError" and errors[0].evalue.startswith("not implemented yet"), \
            (cell.metadata["nbgrader"]["grade_id"], [(o.ename, o.evalue[:200]) for o in errors])
        assert_only_the_verdict(errors[0])
    # feedback shows the checker's verdict, not hidden test logic, and a wrong answer's whole verdict (every lab's
    # graded cells are the same one-line checker calls, so one lab proves it: each nbgrader run costs ~10 s)
    if lab == "lab00":
        bn.nbgrader(["generate_feedback", lab, "--force"], course, state, timeout=600)
        html = (course / "feedback" / "blank" / lab / f"{lab}.html").read_text()
        assert "not implemented yet" in html
        check_wrong_lab00(course)


def plain(lines: list[str]) -> str:
    return re.sub(r"\x1b\[[0-9;]*m", "", "\n".join(lines))


def assert_only_the_verdict(error) -> None:
    """A graded cell's error output as the notebook shows it: the verdict (ename: evalue), nothing above it."""
    shown = plain(error.traceback)
    assert shown == f"{error.ename}: {error.evalue}", shown
    for internal in ("Traceback", "minillm/grading", "site-packages", "core.py", 'File "'):
        assert internal not in shown, shown


def lab00_notebook(answers: dict[str, str]):
    """lab00's three tasks as a tiny notebook: for each, an answer cell (nbgrader metadata as in the release) with
    the given source, then lab00's real graded cell. Runs in seconds (no model)."""
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    names = {"lab00_1": "linear_flops_bytes", "lab00_2": "model_flops_bytes", "lab00_3": "roofline_time"}
    for gid, name in names.items():
        meta = {"grade": False, "solution": True, "locked": False, "grade_id": f"{gid}_answer", "schema_version": 3}
        nb.cells.append(nbformat.v4.new_code_cell(answers[gid], metadata={"nbgrader": meta}))
        meta = {"grade": True, "solution": False, "locked": True, "points": 1, "grade_id": gid, "schema_version": 3}
        nb.cells.append(nbformat.v4.new_code_cell(f"from minillm.grading.lab00 import check_{gid}; check_{gid}({name})",
                                                  metadata={"nbgrader": meta}))
    return nb


WRONG_ROOFLINE = "def roofline_time(flops, nbytes, peak_flops, bandwidth):\n    return min(flops / peak_flops, " \
                 "nbytes / bandwidth)\n"


@pytest.mark.slow
def test_minillm_grade_reports_syntax_errors_endless_loops_and_whole_verdicts(tmp_path):
    nb = lab00_notebook({
        "lab00_1": "def linear_flops_bytes(num_tokens, d_in, d_out, dtype_bytes):\n    return (2 * num_tokens *\n",
        "lab00_2": "def model_flops_bytes(cfg, num_tokens, num_logits, dtype_bytes):\n    n = 0\n    while True:\n"
                   "        n += 1\n",
        "lab00_3": WRONG_ROOFLINE})
    nbformat.write(nb, tmp_path / "mine.ipynb")
    env = dict(os.environ, MINILLM_TIME_LIMIT_SCALE="0.05")          # the checks' 120 s become 6 s
    r = subprocess.run([sys.executable, "-m", "minillm", "grade", str(tmp_path / "mine.ipynb")], capture_output=True,
                       text=True, timeout=600, env=env)
    out = r.stdout
    assert r.returncode == 1 and out.strip().splitlines()[-1] == "score: 0/3", out
    lines = out.splitlines()
    at = next(i for i, line in enumerate(lines) if "lab00_1" in line)
    assert re.search(r"lab00_1\s+0/1\s+FAIL  syntax error in the answer cell of lab00_1 \(cell 1 of the notebook\), "
                     r"line 2: ", lines[at]), out
    assert lines[at + 1].strip() == "return (2 * num_tokens *", out
    assert re.search(r"lab00_2\s+0/1\s+FAIL  timed out after 6 s: the check of lab00_2 \(model_flops_bytes\) did "
                     r"not finish \(it was running your code, in model_flops_bytes, line [34]\)", out), out
    at = next(i for i, line in enumerate(lines) if "lab00_3" in line)
    assert "FAIL  roofline_time = " in lines[at] and "you took the smaller" in lines[at], out
    assert lines[at + 1].strip().startswith("Smallest failing example: roofline_time(flops="), out
    assert lines[at + 2].strip().startswith("Hint (1/3): "), out


def submit_wrong_lab00(course: Path) -> None:
    """lab00's solution with one answer deliberately wrong (roofline_time takes the min), as student "wrong"."""
    nb = nbformat.read(ROOT / "solutions" / "lab00" / "lab00.ipynb", as_version=4)
    [answer] = [c for c in nb.cells if c.metadata.get("nbgrader", {}).get("grade_id") == "lab00_3_answer"]
    answer.source = WRONG_ROOFLINE
    nb.cells = [c for c in nb.cells if c.cell_type != "code" or "nbgrader" in c.metadata]   # the solution ran demos
    dest = course / "submitted" / "wrong" / "lab00"
    dest.mkdir(parents=True)
    nbformat.write(nb, dest / "lab00.ipynb")


def check_wrong_lab00(course: Path) -> None:
    """After a real `nbgrader autograde` (and generate_feedback): the wrong answer's graded cell shows the verdict,
    message + example + hint, with no grader frame above it; the other tasks pass; the feedback page shows it."""
    ran = nbformat.read(course / "autograded" / "wrong" / "lab00" / "lab00.ipynb", as_version=4)
    cells = {c.metadata["nbgrader"]["grade_id"]: c for c in graded(ran)}
    assert not [o for gid in ("lab00_1", "lab00_2") for o in cells[gid].outputs if o.output_type == "error"]
    [error] = [o for o in cells["lab00_3"].outputs if o.output_type == "error"]
    assert error.ename == "GradingError", error
    assert_only_the_verdict(error)
    verdict = error.evalue.splitlines()
    assert verdict[0].startswith("roofline_time = ") and "you took the smaller" in verdict[0], verdict
    assert verdict[1].startswith("Smallest failing example: roofline_time(flops=") and \
        verdict[2].startswith("Hint (1/3): "), verdict
    html = (course / "feedback" / "wrong" / "lab00" / "lab00.html").read_text()
    assert "Smallest failing example: roofline_time(flops=" in html
    # each task by its title, with its score (nbgrader's own page says "Test cell" for all three)
    assert re.search(r'<a href="#lab00_3">lab00_3 · the roofline bound</a> \(Score: 0\.0 / 2\.0\)', html), html[:3000]
    assert "lab00_1 · FLOPs and bytes of one linear layer" in html and "Test cell" not in html
    assert "minillm/grading" not in html and "site-packages" not in html


def test_minillm_grade_scorecard_on_a_tiny_notebook(tmp_path):
    """Cheap check of the scorecard rules (pass, error, an edited locked graded cell: checksum mismatch) on an
    executed notebook's cells: the trusted run leaves its verdicts in the graded cells and the same rules read them.
    A graded cell that is not a minillm checker call has no trusted verdict: the trusted run calls it modified."""
    from nbgrader.utils import compute_checksum
    from minillm.grading.cli import execute_notebook, grade_cells, scorecard_lines
    from minillm.grading.trusted import run_trusted

    def cell(src, gid, points):
        c = nbformat.v4.new_code_cell(src, metadata={"nbgrader": {
            "grade": True, "solution": False, "locked": True, "points": points, "grade_id": gid,
            "schema_version": 3}})
        c.metadata["nbgrader"]["checksum"] = compute_checksum(c)
        return c
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    edited = cell("assert False, 'the original check'", "t_3", 4)
    edited.source = "pass  # learner deleted the check"
    nb.cells = [nbformat.v4.new_code_cell("x = 1"), cell("assert x == 1", "t_1", 2),
                cell("assert x == 2, 'x should be 2\\nsecond line'", "t_2", 1), edited]
    nbformat.write(nb, tmp_path / "tiny.ipynb")
    results = grade_cells(execute_notebook(tmp_path / "tiny.ipynb").cells)
    out = "\n".join(line for r in results for line in scorecard_lines(r, 4))
    assert [r.passed for r in results] == [True, False, False], out
    assert re.search(r"t_1\s+2/2\s+pass", out), out
    assert re.search(r"t_2\s+0/1\s+FAIL\s+AssertionError: x should be 2\n\s+second line$", out, re.M), out
    assert re.search(r"t_3\s+0/4\s+FAIL\s+the graded cell was modified", out), out
    trusted = run_trusted(nb, lambda work: execute_notebook(tmp_path / "tiny.ipynb", nb=work))
    assert [r.message.split(":")[0] for r in grade_cells(trusted.cells)] == ["the graded cell was modified"] * 3


def run_grade(path: Path) -> tuple[int, str]:
    r = subprocess.run([sys.executable, "-m", "minillm", "grade", str(path)], capture_output=True, text=True,
                       timeout=1200)
    return r.returncode, r.stdout


@pytest.mark.slow
def test_minillm_grade_cli_full_marks_and_zero(tmp_path):
    sol, blank = tmp_path / "sol" / "lab00", tmp_path / "mine" / "lab00"   # copies: any lab folder works
    shutil.copytree(ROOT / "solutions" / "lab00", sol)
    shutil.copytree(ROOT / "labs" / "lab00", blank)
    for folder in (sol, blank):      # the demo cells are the autograde test's business: this one is about the CLI
        nb = nbformat.read(folder / "lab00.ipynb", as_version=4)
        nb.cells = [c for c in nb.cells if c.cell_type != "code" or "nbgrader" in c.metadata]
        nbformat.write(nb, folder / "lab00.ipynb")
    rc, out = run_grade(sol)
    last = out.strip().splitlines()[-1]
    m = re.fullmatch(r"score: (\d+(?:\.\d+)?)/(\d+(?:\.\d+)?)", last)
    assert m and m.group(1) == m.group(2) and float(m.group(2)) > 0, out
    assert rc == 0, out
    assert all(f"lab00_{k}" in out for k in (1, 2, 3))
    rc, out = run_grade(blank / "lab00.ipynb")
    last = out.strip().splitlines()[-1]
    assert re.fullmatch(rf"score: 0/{m.group(2)}", last), out
    assert rc == 1, out
    assert out.count("not implemented yet") == 3, out


def test_learner_jupyterlab_hides_instructor_tools_and_renders_markdown():
    """`make lab`'s config names plugins and settings that exist in the installed JupyterLab and nbgrader (a rename
    upstream would silently show the instructor tools or open labs/README.md as source again)."""
    import json
    prefix = Path(sys.prefix) / "share" / "jupyter"
    disabled = json.loads((ROOT / "mk/jupyter/learner/labconfig/page_config.json").read_text())["disabledExtensions"]
    bundle = "".join(p.read_text(errors="ignore") for p in (prefix / "labextensions/@jupyter/nbgrader").rglob("*.js"))
    for plugin in disabled:
        assert f'id:"{plugin}"' in bundle, f"nbgrader has no plugin {plugin}"
    assert '"@jupyter/nbgrader:validate-assignment"' not in json.dumps(disabled)    # learners keep validate
    overrides = json.loads((ROOT / "mk/jupyter/settings/overrides.json").read_text())
    schema = json.loads((prefix / "lab/schemas/@jupyterlab/docmanager-extension/plugin.json").read_text())
    assert "defaultViewers" in schema["properties"]
    assert overrides["@jupyterlab/docmanager-extension:plugin"]["defaultViewers"] == {"markdown": "Markdown Preview"}
    mk = (ROOT / "mk/course.mk").read_text()
    assert "JUPYTER_CONFIG_PATH=$(abspath mk/jupyter/learner)" in mk and "formgrader': False" in mk


def test_learner_jupyterlab_asks_no_news_and_checks_no_updates(tmp_path):
    """`make lab` installs mk/jupyter/settings/overrides.json where its JupyterLab reads settings overrides (the app
    dir's settings/ of the venv that runs it), and the file turns off the news pop-up and the update check, in terms
    the installed JupyterLab's schema accepts."""
    import jsonschema
    from jupyterlab.labapp import LabApp
    from jupyterlab_server.settings_utils import _get_overrides
    mk = (ROOT / "mk/course.mk").read_text()
    assert "LAB_SETTINGS := $(VENV)/share/jupyter/lab/settings/overrides.json" in mk
    assert re.search(r"^lab: .*\$\(LAB_SETTINGS\)", mk, re.M) and re.search(r"^instructor: .*\$\(LAB_SETTINGS\)", mk, re.M)
    assert re.search(r"^\$\(LAB_SETTINGS\): mk/jupyter/settings/overrides.json", mk, re.M)
    assert Path(LabApp().app_settings_dir) == Path(sys.prefix) / "share" / "jupyter" / "lab" / "settings"
    # JupyterLab's own reader, on a folder laid out as the make rule lays it out
    shutil.copy(ROOT / "mk/jupyter/settings/overrides.json", tmp_path / "overrides.json")
    overrides, error = _get_overrides(str(tmp_path))
    assert not error, error
    notification = overrides["@jupyterlab/apputils-extension:notification"]
    assert notification == {"fetchNews": "false", "checkForUpdates": False}
    schemas = Path(sys.prefix) / "share" / "jupyter" / "lab" / "schemas"
    for plugin, values in overrides.items():
        package, name = plugin.split(":")
        schema = json.loads((schemas / package / f"{name}.json").read_text())
        jsonschema.validate(values, schema)                     # names and values this JupyterLab knows
        assert set(values) <= set(schema["properties"]), plugin


@pytest.mark.slow
def test_learner_work_survives_every_make_target(tmp_path):
    """A learner's saved notebook is never erased: `make lab` works on work/ (copied from labs/, never overwritten),
    `make labs` refuses to regenerate an edited labs/ notebook and, with FORCE=1, saves it to work/backups/ first,
    and `make clean` leaves work/ alone. Run in a copy of this checkout (committed as one commit), with its venv."""
    clone = tmp_path / "repo"
    shutil.copytree(ROOT, clone, ignore=shutil.ignore_patterns(".git", ".venv", "work", "book", "__pycache__",
                                                               ".hypothesis", ".pytest_cache", "*.egg-info"))
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t"]
    for args in (["init", "-q"], ["add", "-A"], ["commit", "-qm", "the course as released"]):
        subprocess.run(git + args, cwd=clone, check=True, capture_output=True)
    make = ["make", "-s", f"VENV={ROOT / '.venv'}"]
    answer = "# my answer, saved at 23:59\n"
    # the learner's workspace: a first copy, then a saved answer that a second `make lab` copy step must keep
    subprocess.run([sys.executable, "tools/build_notebooks.py", "--workspace"], cwd=clone, check=True,
                   capture_output=True)
    mine = clone / "work" / "lab00" / "lab00.ipynb"
    nb = nbformat.read(mine, as_version=4)
    nb.cells[0].source = answer + nb.cells[0].source
    nbformat.write(nb, mine)
    saved = mine.read_bytes()
    subprocess.run([sys.executable, "tools/build_notebooks.py", "--workspace"], cwd=clone, check=True,
                   capture_output=True)
    assert mine.read_bytes() == saved
    # an old habit: the learner edited labs/ itself; `make labs` must not erase it
    edited = clone / "labs" / "lab01" / "lab01.ipynb"
    nb = nbformat.read(edited, as_version=4)
    nb.cells[0].source = answer + nb.cells[0].source
    nbformat.write(nb, edited)
    before = edited.read_bytes()
    r = subprocess.run(make + ["labs"], cwd=clone, capture_output=True, text=True, timeout=1800)   # a hang guard
    assert r.returncode != 0 and "labs/lab01/lab01.ipynb" in r.stderr and "FORCE=1" in r.stderr, r.stderr
    assert edited.read_bytes() == before
    r = subprocess.run(make + ["labs", "FORCE=1"], cwd=clone, capture_output=True, text=True, timeout=1800)
    assert r.returncode == 0, r.stderr
    backups = list((clone / "work" / "backups").rglob("lab01.ipynb"))
    assert len(backups) == 1 and backups[0].read_bytes() == before
    assert answer not in edited.read_text()                 # regenerated, as asked, after the backup
    # `make clean` removes the venv and caches it is told to, never work/ (a throwaway VENV: not this checkout's)
    subprocess.run(["make", "-s", f"VENV={tmp_path / 'venv'}", "clean"], cwd=clone, check=True, capture_output=True)
    assert mine.read_bytes() == saved and backups[0].is_file()
