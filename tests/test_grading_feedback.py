"""Grader feedback a learner can act on (minillm/grading/core.py's "Feedback" conventions, the `minillm grade`
scorecard):
  - a verdict is message + smallest failing example + hint, rendered in a notebook without a traceback;
  - the example is what the learner's function was called with, by its own argument names, not the generator's
    knobs (seeds, sizes, fractions) and not the calls `diagnose` made afterwards;
  - hints are staged per task: the first failure nudges, the formula ("Show me") comes only from the third on, a
    pass starts over, and an untouched answer gets "not implemented yet" with no hint at all;
  - an endless loop reads "timed out after N s" naming the task and the learner's function; time limits nest;
  - an exception in the learner's code names its line; one in the grader says it is the grader's;
  - the scorecard prints each failure's whole verdict, and a syntax error in an answer cell as that.
Real kernels and nbgrader runs of the same are in tests/test_course.py (slow)."""
from __future__ import annotations

import functools
import operator
import re
import signal

import nbformat
import pytest

from minillm.grading import core
from minillm.grading.cli import TaskResult, grade_cells, scorecard_lines
from minillm.grading.core import GradingError, Hint, Task
from minillm.grading.lab00 import check_lab00_3
from minillm.grading.lab01 import check_lab01_1, check_lab01_2
from minillm.grading.lab02 import check_lab02_1
from minillm.grading.lab03 import check_lab03_2
from minillm.layers.attention import causal_attend


def verdict(checker, answer) -> str:
    with pytest.raises(GradingError) as e:
        checker(answer)
    return str(e.value)


@pytest.fixture(autouse=True)
def fresh_attempts():
    core.reset_attempts()
    yield
    core.reset_attempts()


def roofline_min(flops, nbytes, peak_flops, bandwidth):           # the classic mistake: min instead of max
    return min(flops / peak_flops, nbytes / bandwidth)


# ---------------------------------------------------------------- the verdict and how a notebook shows it

def test_verdict_has_message_example_hint_and_renders_without_a_traceback():
    with pytest.raises(GradingError) as e:
        check_lab00_3(roofline_min)
    lines = str(e.value).splitlines()
    assert lines[0].startswith("roofline_time = ") and "you took the smaller" in lines[0], lines
    assert lines[1] == ("Smallest failing example: roofline_min(flops=270000000.0, nbytes=540000000.0, "
                        "peak_flops=200000000000.0, bandwidth=20000000000.0)"), lines
    assert lines[2].startswith("Hint (1/3): the roofline"), lines
    shown = e.value._render_traceback_()             # what IPython prints instead of a traceback
    assert re.sub(r"\x1b\[[0-9;]*m", "", shown[0]) == "GradingError: " + lines[0]
    assert shown[1:] == lines[1:]
    text = "\n".join(shown)
    for internal in ("Traceback", "minillm/grading", "site-packages", "core.py", 'File "'):
        assert internal not in text, text


def test_ipython_shows_only_the_verdict(capsys):
    """IPython (what a notebook's kernel runs) honours _render_traceback_: no grader frame above the message."""
    from IPython.core.interactiveshell import InteractiveShell
    shell = InteractiveShell.instance()
    shell.user_ns["roofline_min"] = roofline_min
    result = shell.run_cell("from minillm.grading.lab00 import check_lab00_3; check_lab00_3(roofline_min)")
    assert isinstance(result.error_in_exec, GradingError)
    out = re.sub(r"\x1b\[[0-9;]*m", "", capsys.readouterr().out)
    assert out.startswith("GradingError: roofline_time = ") and "Smallest failing example" in out, out
    for internal in ("Traceback", "minillm/grading", "site-packages", "core.py"):
        assert internal not in out, out


# ---------------------------------------------------------------- the example: the learner's call

def test_example_is_the_learners_call_by_its_own_argument_names():
    def sizes(config, batch, length, width):                     # forgets that K and V are both cached
        return config.num_layers * config.num_kv_heads * config.head_dim * batch * length * width
    msg = verdict(check_lab01_2, sizes)
    example = next(line for line in msg.splitlines() if line.startswith("Smallest failing example: "))
    # the first hand-picked case (SmolLM2, batch 1, 8192 tokens, 2 bytes), not one of the probes diagnose tried next
    assert example == ("Smallest failing example: sizes(config=ModelConfig(vocab_size=1000, hidden_size=576, "
                       "intermediate_size=64, num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64), batch=1, "
                       "length=8192, width=2)"), msg
    assert "multiply by 2" in msg


def test_example_hides_the_generators_knobs():
    """lab01_1's property draws L, n_frac, kv_heads, group, seed, magnitude... and builds q, k, v from them: the
    example shows the tensors attend received (dtype and shape), never those knobs."""
    def no_mask(query, keys, values, scale):
        group = query.shape[1] // keys.shape[1]
        k, v = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
        p = (__import__("torch").einsum("nhd,lhd->hnl", query, k) * scale).softmax(-1)
        return __import__("torch").einsum("hnl,lhd->nhd", p, v)
    msg = verdict(check_lab01_1, no_mask)
    example = next(line for line in msg.splitlines() if line.startswith("Smallest failing example: "))
    assert re.fullmatch(r"Smallest failing example: no_mask\(query=<float32 tensor of shape \[\d+, \d+, \d+\]>, "
                        r"keys=<float32 tensor of shape \[\d+, \d+, \d+\]>, values=<float32 tensor of shape "
                        r"\[\d+, \d+, \d+\]>, scale=[0-9.]+\)", example), example
    for knob in ("n_frac", "seed", "magnitude", "group=", "negative"):
        assert knob not in example, example


def test_show_is_compact_and_never_calls_learner_code():
    import torch
    assert core.show(torch.tensor([1, 2, 3])) == "tensor([1, 2, 3])"
    assert core.show(torch.tensor([0.5, 1 / 3], dtype=torch.float16)) == "tensor([0.5, 0.3333], dtype=float16)"
    assert core.show(torch.zeros(4, 3).t()) == "<float32 tensor of shape [3, 4], a strided view>"
    assert core.show(list(range(20))) == "[0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, … (20 items)]"

    class Mine:
        def __repr__(self):
            raise AssertionError("the renderer ran the learner's __repr__")
    assert core.show(Mine()) == "<Mine object>"


# ---------------------------------------------------------------- staged hints

HINTED = {   # checker, a wrong answer, a piece of the formula its "Show me" line gives
    "lab00_3": (check_lab00_3, roofline_min, "max(flops / peak_flops, nbytes / bandwidth)"),
    "lab01_2": (check_lab01_2, lambda c, b, s, d: c.num_layers * c.num_kv_heads * c.head_dim * b * s * d,
                "2 (K and V) · num_layers · num_kv_heads"),
    "lab02_1": (check_lab02_1, lambda t, s, e, b: list(range(s, e)), "block_table[p // block_size] * block_size"),
    "lab03_2": (check_lab03_2, lambda m, l, acc, scores, values: (m, l, acc), "acc * alpha[:, None] + p @ values"),
}


@pytest.mark.parametrize("task", HINTED)
def test_hints_nudge_before_they_solve(task):
    checker, wrong, formula = HINTED[task]
    first, second, third = (verdict(checker, wrong) for _ in range(3))
    assert "Hint (1/3): " in first and "Show me" not in first and formula not in first, first
    assert "Hint (2/3): " in second and "Show me" not in second and formula not in second, second
    nudge = re.search(r"Hint \(1/3\): (.*)", first).group(1)
    assert re.search(r"Hint \(2/3\): (.*)", second).group(1).startswith(nudge)      # more, not something else
    assert re.search(r"^Show me: .+$", third, re.M) and formula in third, third
    assert third.splitlines()[0] == first.splitlines()[0]                          # the same verdict, more help


def test_a_pass_starts_the_hints_over_and_not_implemented_is_no_attempt():
    def todo(flops, nbytes, peak_flops, bandwidth):
        raise NotImplementedError()
    for _ in range(3):                                  # untouched: no hint, however often it is run
        msg = verdict(check_lab00_3, todo)
        assert msg.startswith("not implemented yet") and "Hint" not in msg and len(msg.splitlines()) == 1, msg
    assert "Hint (1/3)" in verdict(check_lab00_3, roofline_min)      # the first real attempt gets the nudge
    assert "Hint (2/3)" in verdict(check_lab00_3, roofline_min)
    check_lab00_3(lambda f, b, p, w: max(f / p, b / w))
    assert "Hint (1/3)" in verdict(check_lab00_3, roofline_min)


def test_a_plain_string_hint_is_the_same_every_time():
    h = Hint("the concept.", "more.", "x = 1.")
    assert h.lines(1) == ["Hint (1/3): the concept."]
    assert h.lines(2) == ["Hint (2/3): the concept. more."]
    assert h.lines(5) == ["Hint: the concept. more.", "Show me: x = 1."]
    assert Hint("only a nudge.").lines(4) == ["Hint: only a nudge."]
    e = GradingError("wrong", "f(1)", "return an int.")
    assert str(e.staged(3)) == str(e) == "wrong\nSmallest failing example: f(1)\nHint: return an int."


# ---------------------------------------------------------------- time limits

def spin(flops, nbytes, peak_flops, bandwidth):
    x = 0
    while True:
        try:
            x += 1
        except Exception:              # a learner's blanket except must not swallow the time limit
            pass


def test_an_endless_loop_times_out_naming_the_task_and_the_line(monkeypatch):
    monkeypatch.setenv("MINILLM_TIME_LIMIT_SCALE", "0.01")          # 120 s -> 1.2 s
    msg = verdict(check_lab00_3, spin)       # the scaled limit fired (the message names it), not the 120 s one
    assert msg.startswith("timed out after 1.2 s: the check of lab00_3 (roofline_time) did not finish (it was "
                          "running your code, in spin, line "), msg
    assert "the call in progress: spin(flops=270000000.0" in msg and "endless loop" in msg, msg
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)       # the alarm is off again


def test_a_bad_time_limit_scale_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("MINILLM_TIME_LIMIT_SCALE", "fast")
    assert verdict(check_lab00_3, roofline_min).startswith("MINILLM_TIME_LIMIT_SCALE='fast' is not a positive number")


def test_time_limits_nest():
    def loop():
        while True:
            pass
    with core.time_limit(5) as outer:
        with pytest.raises(core.TimedOut) as e:
            with core.time_limit(0.2) as inner:
                loop()
        assert e.value.limit is inner
        assert 0 < signal.getitimer(signal.ITIMER_REAL)[0] <= 5        # the outer one still runs
    assert outer is not None and signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)
    with pytest.raises(core.TimedOut) as e:
        with core.time_limit(0.2) as outer:
            with core.time_limit(30):                   # never extends the outer one
                loop()
    assert e.value.limit is outer and str(e.value) == "timed out after 0.2 s"
    assert signal.getsignal(signal.SIGALRM) in (signal.SIG_DFL, signal.SIG_IGN, None) or \
        signal.getsignal(signal.SIGALRM) is not core._on_alarm


# ---------------------------------------------------------------- exceptions: the learner's or the grader's

def _direct_task(verify) -> Task:
    return Task("t_1", what="f", verify=verify, engine=list)


def test_an_exception_in_the_learners_code_names_its_line():
    def f(x):
        y = x + 1
        return y / 0
    msg = verdict(_direct_task(lambda fn: fn(1)).check, f)
    assert re.match(r"your code raised ZeroDivisionError: division by zero \(in f, line \d+: `return y / 0`\)",
                    msg), msg


def test_an_exception_inside_a_property_names_its_line_too():
    def roofline_zero(flops, nbytes, peak_flops, bandwidth):
        t = flops / peak_flops
        return t / 0
    msg = verdict(check_lab00_3, roofline_zero)
    assert re.match(r"your code raised ZeroDivisionError: float division by zero \(in roofline_zero, line \d+: "
                    r"`return t / 0`\)\nSmallest failing example: roofline_zero\(flops=", msg), msg


def test_an_exception_in_the_grader_says_so():
    msg = verdict(_direct_task(functools.partial(operator.truediv, 1)).check, lambda x: x)
    assert msg.startswith("the checker of t_1 itself failed (TypeError: ") and "bug in minillm's grader" in msg, msg


# ---------------------------------------------------------------- the scorecard of `minillm grade`

def _answer(src: str, gid: str, error: dict | None = None):
    c = nbformat.v4.new_code_cell(src, metadata={"nbgrader": {"grade": False, "solution": True, "locked": False,
                                                              "grade_id": f"{gid}_answer", "schema_version": 3}})
    c.execution_count = 1
    c.outputs = [nbformat.v4.new_output("error", **error)] if error else []
    return c


def _graded(gid: str, error: dict | None = None):
    c = nbformat.v4.new_code_cell(f"check_{gid}(f)", metadata={"nbgrader": {
        "grade": True, "solution": False, "locked": True, "points": 2, "grade_id": gid, "schema_version": 3}})
    c.execution_count = 2
    c.outputs = [nbformat.v4.new_output("error", **error)] if error else []
    return c


def _err(ename: str, evalue: str) -> dict:        # the fields ipykernel sends (traceback as in a real run)
    return {"ename": ename, "evalue": evalue, "traceback": [f"{ename}: {evalue}"]}


def test_scorecard_prints_the_whole_verdict():
    whole = "wrong value for f(3)\nSmallest failing example: f(x=3)\nHint (1/3): think of the base case."
    cells = [_answer("def f(x):\n    return x\n", "t_1"), _graded("t_1", _err("GradingError", whole))]
    [r] = grade_cells(cells)
    assert not r.passed and r.message == whole
    lines = scorecard_lines(r, 4)
    assert lines[0] == "  t_1       0/2  FAIL  wrong value for f(3)"
    at = lines[0].index("wrong")                        # the verdict's later lines sit under its first
    assert lines[1:] == [" " * at + "Smallest failing example: f(x=3)", " " * at + "Hint (1/3): think of the base case."]


def test_scorecard_names_a_syntax_error_in_the_answer_cell_and_its_line():
    src = "def f(x):\n    return (x +\n\nprint(1)\n"
    cells = [nbformat.v4.new_markdown_cell("# t"),
             _answer(src, "t_1", _err("SyntaxError", "'(' was never closed (3170455139.py, line 2)")),
             _graded("t_1", _err("NameError", "name 'f' is not defined")),
             _answer("def g():\n  return 1\n   x = 2\n", "t_2", _err("IndentationError",
                                                                    "unexpected indent (2861103321.py, line 3)")),
             _graded("t_2", _err("NameError", "name 'g' is not defined"))]
    r1, r2 = grade_cells(cells)
    assert r1.message.splitlines()[:2] == ["syntax error in the answer cell of t_1 (cell 2 of the notebook), line 2: "
                                           "'(' was never closed", "    " + "    return (x +"], r1.message
    assert r2.message.startswith("indentation error in the answer cell of t_2 (cell 4 of the notebook), line 3: "
                                 "unexpected indent\n       x = 2"), r2.message


def test_scorecard_says_timed_out_and_names_an_answer_cell_that_raised():
    cells = [_answer("while True: pass", "t_1", _err("KeyboardInterrupt", "")),
             _graded("t_1", _err("NameError", "name 'f' is not defined")),
             _answer("import nope", "t_2", _err("ModuleNotFoundError", "No module named 'nope'")),
             _graded("t_2", _err("NameError", "name 'f' is not defined")),
             _answer("def f(x): return x", "t_3"), _graded("t_3", _err("KeyboardInterrupt", ""))]
    r1, r2, r3 = grade_cells(cells, timeout=30)
    assert r1.message.startswith("timed out after 30 s: the answer cell of t_1 (cell 1 of the notebook) was still "
                                 "running"), r1.message
    assert r2.message == ("the answer cell of t_2 (cell 3 of the notebook) raised ModuleNotFoundError: No module "
                          "named 'nope'\nso the graded cell failed with NameError: name 'f' is not defined")
    assert r3.message.startswith("timed out after 30 s: the graded cell was interrupted")
    assert [r.passed for r in (r1, r2, r3)] == [False, False, False]
    assert scorecard_lines(TaskResult("t_4", 1, True), 4) == ["  t_4       1/1  pass"]
