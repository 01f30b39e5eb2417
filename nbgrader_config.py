"""nbgrader course configuration: this repository is the course.

    solutions/labNN/   source versions (with solutions): nbgrader's "source" step
    labs/labNN/        release versions (what learners open): nbgrader's "release" step

Run nbgrader from the repository root (it reads this file only from the current directory):
    make labs                                    # = python tools/build_notebooks.py --release
    nbgrader generate_assignment lab01 --force   # one lab: solutions/lab01 -> labs/lab01
    nbgrader autograde lab01 --force             # grades submitted/<student>/lab01/
    nbgrader generate_feedback lab01 --force     # feedback/<student>/lab01/*.html

The gradebook and the exchange live in a throwaway temp folder by default (this is a self-study course, not a
class roster); set MINILLM_NBGRADER_DIR to keep them somewhere permanent.
"""
import importlib.util
import os
import tempfile

import nbgrader

c = get_config()  # noqa: F821 — provided by nbgrader when it loads this file

_root = os.path.dirname(os.path.abspath(__file__))
_state = os.environ.get("MINILLM_NBGRADER_DIR") or os.path.join(tempfile.gettempdir(), "minillm-nbgrader")
os.makedirs(os.path.join(_state, "exchange"), exist_ok=True)

c.CourseDirectory.root = _root
c.CourseDirectory.course_id = "minillm"
c.CourseDirectory.source_directory = "solutions"
c.CourseDirectory.release_directory = "labs"
c.CourseDirectory.db_url = "sqlite:///" + os.path.join(_state, "gradebook.db")
# Never copy into a release: hypothesis' cache, bytecode, checkpoints, feedback, and the jupytext source of
# the notebook (solutions/labNN/labNN.py holds the solutions in plain text).
c.CourseDirectory.ignore = [".ipynb_checkpoints", "*.pyc", "__pycache__", "feedback", ".hypothesis",
                            "lab[0-9][0-9].py"]

c.Exchange.root = os.path.join(_state, "exchange")

# Feedback (`nbgrader generate_feedback`) names each graded cell by its task's title, "lab06_2 · draw: one token per
# row, ...", where nbgrader's own page says "Test cell": minillm/grading/templates/feedback_titled/ extends nbgrader's
# feedback template (found in nbgrader's folder, as nbgrader itself would), and the title is in each graded cell's
# metadata (tools/build_notebooks.py). Found through the installed minillm, so a copy of this file works anywhere.
c.HTMLExporter.template_name = "feedback_titled"
c.HTMLExporter.template_file = "feedback_titled.html.j2"
c.HTMLExporter.extra_template_basedirs = [
    os.path.join(os.path.dirname(nbgrader.__file__), "server_extensions", "formgrader", "templates"),
    os.path.join(os.path.dirname(importlib.util.find_spec("minillm").origin), "grading", "templates"),
]

# Labs load a real model and run hypothesis properties: the 30 s default per cell is too short.
c.Execute.timeout = 600
c.Execute.interrupt_on_timeout = True

# Graded cells are one-line checker calls: the hidden logic lives in minillm.grading, so feedback shows
# the checker's message (failing example + hint), not the tests.
c.ClearSolutions.code_stub = {"python": "# YOUR CODE HERE\nraise NotImplementedError()"}

# Trusted grading (minillm.grading.trusted): autograde takes every answer out of the kernel and checks it with the
# learner's code in a sandbox process, so nothing an answer cell does to its kernel changes a grade; each graded
# cell's output is then the trusted verdict, which SaveAutoGrades records. (nbgrader's own Execute in the first
# place grades from the kernel's outputs instead: instant feedback, not a verdict.)
c.Autograde.autograde_preprocessors = [
    "minillm.grading.trusted.TrustedExecute",
    "nbgrader.preprocessors.IgnorePattern",
    "nbconvert.preprocessors.ClearMetadataPreprocessor",
    "nbgrader.preprocessors.LimitOutput",
    "nbgrader.preprocessors.SaveAutoGrades",
    "nbgrader.preprocessors.AssignLatePenalties",
    "nbgrader.preprocessors.CheckCellMetadata",
]
