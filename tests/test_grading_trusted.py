"""Trusted grading (minillm.grading.trusted): what an answer cell or an answer's code does to its kernel or to its
own process never changes a verdict.

- the wire between the grader and the sandbox: values cross as copies (tensors with their views, generators with
  their state), in-place changes of arguments come back, objects cross as references the other side can only use
  through their public names; what the sandbox sends is read without running any of its code;
- the sandbox: minillm's own implementation of the graded piece is stubbed (under any alias, with or without a
  tracer, from a thread), the graders' files cannot be read nor imported, minillm's compiled kernels cannot be
  loaded with ctypes, and an exit is a verdict;
- every tampering class, handed in from a notebook, fails through `minillm grade` AND through nbgrader autograde
  with the course's TrustedExecute hook, while a correct answer in the same notebook passes.
"""
from __future__ import annotations

import pickle
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import cloudpickle
import nbformat
import pytest
import torch

from minillm.grading import trusted, wire
from minillm.grading.sandbox import Sandbox

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import build_notebooks as bn  # noqa: E402


def _load(fn, engine=()):
    box = Sandbox()
    proxy, description = box.load(list(engine), cloudpickle.dumps(fn))
    return box, proxy, description


@pytest.fixture
def sandbox():
    boxes = []

    def load(fn, engine=()):
        box, proxy, description = _load(fn, engine)
        boxes.append(box)
        return proxy
    yield load
    for box in boxes:
        box.close()


# ---------------------------------------------------------------- the wire

def test_values_cross_as_copies_with_their_layout(sandbox):
    echo = sandbox(lambda *a: a)
    pool = torch.arange(24.0).reshape(2, 3, 4)
    k, v = pool[0], pool[1].t()                       # two views of one storage, one of them transposed
    g = torch.Generator().manual_seed(3)
    out = echo(k, v, {"n": [1, 2.5, "x", None, (3,)]}, torch.float16, torch.Size([2, 3]))
    assert torch.equal(out[0], k) and torch.equal(out[1], v) and out[1].stride() == v.stride()
    assert out[0].untyped_storage().data_ptr() == out[1].untyped_storage().data_ptr()     # still one storage
    assert out[2] == {"n": [1, 2.5, "x", None, (3,)]} and out[3] is torch.float16 and type(out[4]) is torch.Size
    assert torch.equal(echo(g)[0].get_state(), g.get_state())


def test_in_place_changes_of_arguments_come_back(sandbox):
    def fill(out, gen, items):
        out.copy_(torch.rand(out.shape, generator=gen))
        items.append(len(items))
    f = sandbox(fill)
    out, gen, items = torch.zeros(3), torch.Generator().manual_seed(7), [5]
    f(out, gen, items)
    here = torch.Generator().manual_seed(7)
    assert torch.equal(out, torch.rand(3, generator=here)) and items == [5, 1]
    assert torch.equal(gen.get_state(), here.get_state())        # the generator advanced as if drawn here


def test_a_call_that_advances_a_batch_of_generators_brings_every_state_back(sandbox, record_duration):
    """One draw per row from a batch of seeded generators (lab06's and lab07's checkers pass thousands in one
    call): each generator the call advanced comes back advanced, the ones it skipped as they were."""
    import time

    def draw(gens, skip):
        return [None if i in skip else float(torch.rand(1, generator=g)) for i, g in enumerate(gens)]
    f = sandbox(draw)
    gens = [torch.Generator().manual_seed(i) for i in range(3000)]
    skip = set(range(0, 3000, 7))
    t0 = time.perf_counter()
    got = f(gens, skip)
    record_duration("wire: one call advancing 3000 generators", time.perf_counter() - t0)
    for i, (g, x) in enumerate(zip(gens, got)):
        here = torch.Generator().manual_seed(i)
        if i not in skip:
            assert x == float(torch.rand(1, generator=here))
        assert torch.equal(g.get_state(), here.get_state()), i


def test_objects_cross_as_references_and_keep_their_identity(sandbox):
    class Pool:
        def __init__(self):
            self.running, self.log = [], []

        def note(self, x):
            self.log.append(x)

    def policy(pool, seq):
        pool.running.append(seq)
        pool.note(seq is pool.running[0])
        return seq
    pool, seq = Pool(), object()
    assert sandbox(policy)(pool, seq) is seq                  # the grader's own object comes back as itself
    assert pool.running == [seq] and pool.log == [True]


def test_dunder_names_and_modules_are_not_served(sandbox):
    def walk(obj):
        found = []
        for name in ("__dict__", "__globals__", "__code__", "__closure__", "__wrapped__"):
            try:
                getattr(obj, name)
                found.append(name)
            except AttributeError:
                pass
        try:
            obj._do("getattr", "__globals__")                  # the raw request, past the proxy's own refusal
            found.append("raw")
        except AttributeError:
            pass
        return found

    def grader_function():
        return 1
    assert sandbox(walk)(grader_function) == []


def test_the_grader_builds_nothing_but_values_from_what_the_sandbox_sends():
    class Evil:
        def __reduce__(self):
            return (subprocess.call, (["true"],))
    for payload in (pickle.dumps(Evil()), pickle.dumps(torch.nn.Linear(1, 1)), pickle.dumps(print)):
        with pytest.raises(pickle.UnpicklingError, match="does not accept"):
            wire.SafeUnpickler(__import__("io").BytesIO(payload), None).load()


def test_a_learners_object_comes_back_as_a_reference_and_lies_to_no_exact_type_check(sandbox):
    def liar():
        class Yes(int):
            def __eq__(self, other):
                return True
        return Yes(3), [Yes(4)]
    one, many = sandbox(liar)()
    assert isinstance(one, wire.Proxy) and isinstance(many[0], wire.Proxy) and type(one) is not int


def test_exceptions_keep_their_type_and_where(sandbox):
    def bad(x):
        raise ValueError(f"no {x}")
    with pytest.raises(ValueError, match="no 3") as e:
        sandbox(bad)(3)
    assert "in bad" in e.value.remote_where


# ---------------------------------------------------------------- the sandbox

def test_the_engines_piece_is_stubbed_under_every_alias_thread_and_tracer(sandbox):
    def delegate(how):
        import sys
        import threading
        from minillm.bench import roofline
        from minillm.bench.roofline import roofline_time as alias
        if how == "settrace":
            sys.settrace(None)
            return alias(1.0, 1.0, 1.0, 1.0)
        if how == "thread":
            out = []
            t = threading.Thread(target=lambda: out.append(roofline.roofline_time(1.0, 1.0, 1.0, 1.0)))
            t.start()
            t.join()
            return out[0] if out else "the thread failed"
        return alias(1.0, 1.0, 1.0, 1.0)
    f = sandbox(delegate, ["minillm.bench.roofline:roofline_time"])
    for how in ("alias", "settrace"):
        with pytest.raises(RuntimeError, match="minillm's own roofline_time is not available"):
            f(how)
    assert f("thread") == "the thread failed"


def test_graders_and_the_pieces_source_cannot_be_read_or_imported_nor_kernels_loaded(sandbox):
    def attempts():
        import ctypes
        import importlib
        import minillm.bench.roofline as r
        from minillm.kernels import cpu_native
        refused = []
        for name, attempt in (("grader import", lambda: importlib.import_module("minillm.grading.lab00")),
                              ("grader source", lambda: open(r.__file__.replace("bench/roofline.py",
                                                                               "grading/lab00.py")).read()),
                              ("piece source", lambda: open(r.__file__).read()),
                              ("C kernel", lambda: ctypes.CDLL(str(cpu_native.build())))):
            try:
                attempt()
            except (ImportError, PermissionError, OSError):
                refused.append(name)
        return refused
    assert sandbox(attempts, ["minillm.bench.roofline:roofline_time"])() == \
        ["grader import", "grader source", "piece source", "C kernel"]


@pytest.mark.parametrize("how", ["sys.exit(0)", "os._exit(0)", "os.kill(os.getpid(), 9)"])
def test_an_answer_that_ends_its_process_gets_a_verdict(how):
    src = f"def roofline_time(flops, nbytes, peak_flops, bandwidth):\n    import os, sys\n    {how}\n"
    space: dict = {"__name__": "__main__"}
    exec(compile(src, "/tmp/ipykernel_0/answer.py", "exec"), space)
    verdict = trusted.grade_answer("lab00_3", cloudpickle.dumps(space["roofline_time"]))
    assert not verdict.passed and "ended the process it was graded in" in verdict.message, verdict.message


# ---------------------------------------------------------------- tampering, from a notebook, both paths

WRONG = "def roofline_time(flops, nbytes, peak_flops, bandwidth):\n    return flops / peak_flops + nbytes / bandwidth\n"
RIGHT = "def roofline_time(flops, nbytes, peak_flops, bandwidth):\n    return max(flops / peak_flops, nbytes / bandwidth)\n"
GRADED = "from minillm.grading.lab00 import check_lab00_3; check_lab00_3(roofline_time)"

# name -> answer cell (each a wrong answer, or a right one through minillm's own code, plus the tampering)
TAMPERING = {
    "task_verify": "from minillm.grading.lab00 import TASKS\nTASKS['lab00_3']._verify = lambda obj: None\n" + WRONG,
    "task_check": "from minillm.grading import core\ncore.Task.check = lambda self, answer: None\n" + WRONG,
    "checker_shadowed": "import minillm.grading.lab00 as g\ng.check_lab00_3 = lambda answer: None\n" + WRONG,
    "sys_modules": "import sys, types\nsys.modules['minillm.grading.lab00'] = types.SimpleNamespace("
                   "check_lab00_3=lambda answer: None)\n" + WRONG,
    # what the in-notebook checkers read their child processes' verdicts with (json.loads: the kernel's own)
    "stdlib_patched": "import json, subprocess\njson.load = lambda *a, **k: {'verdict': None}\n"
                      "subprocess.run = lambda *a, **k: None\n" + WRONG,
    "hypothesis_engine": "import hypothesis.core as hc\nhc.StateForActualGivenExecution.run_engine = "
                         "lambda self: None\n" + WRONG,
    "builtins": "import builtins\nbuiltins.abs = lambda x: 0.0\n" + WRONG,
    "comparisons_patched": "import math, torch\ntorch.allclose = torch.equal = lambda *a, **k: True\n"
                           "math.isclose = lambda *a, **k: True\n" + WRONG,
    "private_copy_patched": "from minillm.grading.lab00 import check_lab00_3 as c\n"
                            "c.__globals__['run_property'] = lambda *a, **k: None\n" + WRONG,
    "lying_result": textwrap.dedent("""\
        class Yes(float):
            def __eq__(self, other):
                return True
            def __sub__(self, other):
                return 0.0
            __rsub__ = __sub__
            def __abs__(self):
                return 0.0
            __hash__ = float.__hash__
        def roofline_time(flops, nbytes, peak_flops, bandwidth):
            return Yes(-1.0)
        """),
    "grader_frame": textwrap.dedent("""\
        def roofline_time(flops, nbytes, peak_flops, bandwidth):
            import sys
            f = sys._getframe(1)
            while f is not None:
                for k, v in f.f_locals.items():
                    if type(v) is float and k in ("want", "expected", "ref", "reference"):
                        return v
                f = f.f_back
            return flops / peak_flops + nbytes / bandwidth
        """),
    "settrace_delegation": "from minillm.bench.roofline import roofline_time as theirs\n"
                           "def roofline_time(*args):\n    import sys\n    sys.settrace(None)\n"
                           "    return theirs(*args)\n",
    "thread_delegation": textwrap.dedent("""\
        import threading
        from minillm.bench import roofline
        def roofline_time(*args):
            out = []
            t = threading.Thread(target=lambda: out.append(roofline.roofline_time(*args)))
            t.start(); t.join()
            return out[0]
        """),
    "copy_of_the_source": textwrap.dedent("""\
        import minillm.bench.roofline as r
        def roofline_time(*args):
            space = {}
            exec(open(r.__file__).read(), space)
            return space['roofline_time'](*args)
        """),
    "ctypes_kernel": "def roofline_time(flops, nbytes, peak_flops, bandwidth):\n    import ctypes\n"
                     "    from minillm.kernels import cpu_native\n    ctypes.CDLL(str(cpu_native.build()))\n"
                     "    return max(flops / peak_flops, nbytes / bandwidth)\n",
    "sys_exit": "def roofline_time(*args):\n    import sys\n    sys.exit(0)\n",
    "os_exit": "def roofline_time(*args):\n    import os\n    os._exit(0)\n",
    "custom_exc": "get_ipython().set_custom_exc((BaseException,), lambda *a, **k: None)\n" + WRONG,
    "showtraceback": "get_ipython().showtraceback = lambda *a, **k: None\n" + WRONG,
    # these two reach every later cell of the kernel: last
    "clear_output": "from IPython.display import clear_output\n"
                    "get_ipython().events.register('post_run_cell', lambda result: clear_output())\n" + WRONG,
    "input_transformer": "get_ipython().input_transformers_post.append(lambda lines: [])\n" + WRONG,
}


def _cells(cases: dict[str, str]) -> list:
    cells = [nbformat.v4.new_code_cell("import os, sys", metadata={"nbgrader": {
        "grade": False, "solution": False, "locked": True, "grade_id": "setup", "schema_version": 3}})]
    for name, answer in cases.items():
        cells.append(nbformat.v4.new_code_cell(answer, metadata={"nbgrader": {
            "grade": False, "solution": True, "locked": False, "grade_id": f"{name}_answer", "schema_version": 3}}))
        cells.append(nbformat.v4.new_code_cell(GRADED, metadata={"nbgrader": {
            "grade": True, "solution": False, "locked": True, "points": 1, "grade_id": name, "schema_version": 3}}))
    return cells


def _notebook(path: Path, cases: dict[str, str]) -> Path:
    nb = nbformat.v4.new_notebook(cells=_cells(cases))
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    path.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, path)
    return path


CASES = {"correct": RIGHT, **TAMPERING}


def _scorecard(path: Path, names=tuple(CASES)) -> dict[str, str]:
    r = subprocess.run([sys.executable, "-m", "minillm", "grade", str(path)], capture_output=True, text=True,
                       cwd=ROOT, timeout=1800)
    lines = {}
    for line in r.stdout.splitlines():
        parts = line.split()
        if len(parts) >= 3 and parts[0] in names:
            lines[parts[0]] = parts[2]
    assert r.stdout.strip().splitlines()[-1].startswith("score: "), r.stdout + r.stderr
    return lines


@pytest.mark.slow            # a kernel run and a sandbox per task: about a minute
def test_tampering_fails_through_minillm_grade(tmp_path):
    card = _scorecard(_notebook(tmp_path / "tamper" / "tamper.ipynb", CASES))
    assert card.pop("correct") == "pass", card
    assert card == {name: "FAIL" for name in TAMPERING}, card


@pytest.mark.slow
def test_a_minillm_package_beside_the_notebook_shadows_nothing(tmp_path):
    """A copy of minillm beside the notebook whose lab00 checker passes everything: the kernel imports it (its
    folder comes first on sys.path), the grader and the sandbox do not."""
    shadow = tmp_path / "shadow"
    shutil.copytree(ROOT / "minillm", shadow / "minillm", ignore=shutil.ignore_patterns("__pycache__"))
    with open(shadow / "minillm" / "grading" / "lab00.py", "a") as f:
        f.write("\ncheck_lab00_3 = lambda answer: None\n")
    cases = {"correct": RIGHT, "shadowed": WRONG}
    card = _scorecard(_notebook(shadow / "shadow.ipynb", cases), names=cases)
    assert card == {"correct": "pass", "shadowed": "FAIL"}, card


@pytest.mark.slow            # nbgrader's own start-up, a kernel run and a sandbox per task: about a minute
def test_tampering_fails_through_nbgrader_autograde_with_the_trusted_hook(tmp_path):
    from nbgrader.api import Gradebook
    course, state = tmp_path / "course", tmp_path / "state"
    course.mkdir()
    shutil.copy(ROOT / "nbgrader_config.py", course / "nbgrader_config.py")
    source = _notebook(course / "solutions" / "tamper" / "tamper.ipynb", CASES)
    bn.release(["tamper"], course, state_dir=state)
    submitted = course / "submitted" / "learner" / "tamper"
    submitted.mkdir(parents=True)
    shutil.copy(source, submitted / "tamper.ipynb")
    bn.nbgrader(["autograde", "tamper", "--force"], course, state, timeout=1800)
    with Gradebook(f"sqlite:///{state / 'gradebook.db'}") as gb:
        scores = {g.name: g.score for g in gb.find_submission_notebook("tamper", "tamper", "learner").grades}
    assert scores.pop("correct") == 1, scores
    assert scores == {name: 0 for name in TAMPERING}, scores


# ---------------------------------------------------------------- delegation, the trusted way

# one task of each kind per lab; each delegation form of tests/test_grading_integrity.py but the copy (graded by its
# behaviour) — minillm's object itself, a wrapper / subclass / super() call / alias of it
TRUSTED_DELEGATION = ("lab00_1", "lab01_1", "lab02_2", "lab02_3", "lab03_1", "lab04_1", "lab05_1", "lab06_2",
                      "lab07_2", "lab08_2", "lab09_4", "lab10_2", "lab11_2", "lab11_4", "lab12_1", "lab12_2")


def _delegation_cases():
    from tests.test_grading_integrity import TASKS, delegations
    for tid in TRUSTED_DELEGATION:
        for how, answer in delegations(TASKS[tid]):
            if how in ("itself", "wrapper", "super", "alias", "composition"):
                yield pytest.param(tid, how, id=f"{tid}-{how}")


@pytest.mark.slow            # a sandbox per case: about two seconds each
@pytest.mark.parametrize("tid, how", list(_delegation_cases()))
def test_delegation_to_minillm_fails_under_trusted_grading(tid, how):
    from tests.test_grading_integrity import TASKS, delegations
    answer = dict(delegations(TASKS[tid]))[how]
    owner = answer if isinstance(answer, type) else getattr(answer, "__wrapped__", answer)
    module = sys.modules.get(getattr(owner, "__module__", "") or "")
    mine = module is not None and module.__name__.startswith("learner_answers_")
    if mine:
        cloudpickle.register_pickle_by_value(module)       # what emit() does for a notebook's own helper modules
    try:
        payload = cloudpickle.dumps(answer)
    finally:
        if mine:
            cloudpickle.unregister_pickle_by_value(module)
    verdict = trusted.grade_answer(tid, payload)
    assert not verdict.passed, (tid, how)
    reasons = ("is not available while your answer is graded", "raised TypeError", "lacks", "does not define",
               "could not be loaded where it is graded",
               "super(type, obj)")     # super() in a method run with `self` lent from the grader (lab04)
    assert any(r in verdict.message for r in reasons), verdict.message


@pytest.mark.slow            # two notebook runs: about forty seconds
@pytest.mark.parametrize("folder, full", [("solutions", True), ("labs", False)])
def test_minillm_grade_gives_the_solution_full_marks_and_the_release_zero(folder, full):
    """The CLI's trusted path on a whole lab (every lab's solution and release go through the nbgrader hook in
    tests/test_course.py; the two paths share run_trusted)."""
    r = subprocess.run([sys.executable, "-m", "minillm", "grade", str(ROOT / folder / "lab01")], capture_output=True,
                       text=True, cwd=ROOT, timeout=1800)
    got, total = r.stdout.strip().splitlines()[-1].removeprefix("score: ").split("/")
    assert (float(got) == float(total) > 0) if full else (float(got) == 0 < float(total)), r.stdout + r.stderr
    assert r.returncode == (0 if full else 1)


def test_an_answer_that_drags_notebook_state_along_is_refused_when_handed_in(capsys):
    from minillm.grading import handin
    big = torch.zeros(handin.MAX_ANSWER_BYTES // 4 + 1)           # a global the answer reads: it travels by value

    def answer(x):
        return x + big[0]
    with pytest.raises(ValueError, match="carries notebook state"):
        handin.emit("lab00_3", lambda: answer)
    handin.emit("lab00_3", lambda: (lambda x: x))                    # a small one prints its bytes
    assert capsys.readouterr().out.startswith(handin.MARK + "lab00_3:")
