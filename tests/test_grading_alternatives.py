"""No checker rejects a correct answer for its form: correct alternatives written the natural way pass.

The ways an honest answer can look like someone else's code, each graded by its behaviour only:
  - the grader's own reference, written into the answer cell (an "oracle-shaped" design: the statement's formula,
    its step order, the natural names) — for every function task whose reference takes the task's arguments;
  - the same answer under a decorator (functools.wraps-style, so `__wrapped__` is set), or a functools.lru_cache
    where the arguments are hashable;
  - minillm's own implementation's shape (tests/test_grading_integrity.py runs a pasted copy of it for every task:
    never failed for being a copy, only for what it does);
  - a whole number returned as a float where a count is asked (lab01_2 and lab01_3 alike).
A long verbatim copy of minillm's code is noted for the instructor (core.copy_note); it never changes the grade.
"""
from __future__ import annotations

import functools
import inspect
import sys
import textwrap
import types

import pytest

from minillm.grading import core
from minillm.grading.core import GradingError
from test_grading_integrity import TASKS, learner_module, run_cell


def _signature(fn) -> list[str]:
    return [p.name for p in inspect.signature(fn).parameters.values() if p.kind is not p.KEYWORD_ONLY]


def _answer_signature(tid: str) -> list[str] | None:
    """The parameters the task's graded answer takes (the solution's function), or None for a class task."""
    task = TASKS[tid]
    if task.kind != "function":
        return None
    lab = tid.split("_")[0]
    src = open(f"solutions/{lab}/{lab}.py").read()
    m = __import__("re").search(rf"^def {task.what}\((.*?)\):", src, __import__("re").M | __import__("re").S)
    if m is None:
        return None
    return [a.split(":")[0].split("=")[0].strip() for a in m.group(1).replace("\n", " ").split(",")
            if a.strip() and not a.strip().startswith("*")]


# References that are not an answer to their task, so they cannot stand in for one: they compute in float64 or return
# the raw codes (the task returns q's dtype / a QuantizedWeight), have another contract (one request vs a batch, a
# different function), or lean on another grader helper (which the tracer rightly calls running the reference).
NOT_AN_ANSWER = {"lab01_1": "float64 reference", "lab06_1": "calls reference_row", "lab07_1": "one step's contract",
                 "lab08_1": "returns the codes", "lab08_2": "returns the codes", "lab08_3": "float64 reference",
                 "lab10_3": "a walk, not the index builder"}


def _oracle_shaped():
    """(task id, the grader's reference) where the reference takes exactly the task's parameters."""
    for tid in sorted(set(TASKS) - set(NOT_AN_ANSWER)):
        want = _answer_signature(tid)
        for oracle in TASKS[tid].oracle_objects():
            params = inspect.signature(oracle).parameters.values() if inspect.isfunction(oracle) else ()
            required_kw = [q for q in params if q.kind is q.KEYWORD_ONLY and q.default is q.empty]
            if inspect.isfunction(oracle) and want is not None and len(_signature(oracle)) == len(want) \
                    and not required_kw:
                yield tid, oracle
                break


ORACLE_SHAPED = list(_oracle_shaped())


def _as_learner_code(fn: types.FunctionType) -> types.FunctionType:
    """fn's source run in the learner's namespace (with the names its module gives it), as an answer cell would."""
    mod = learner_module()
    home = sys.modules[fn.__module__]
    for k, v in vars(home).items():
        if not k.startswith("__"):
            vars(mod).setdefault(k, v)
    run_cell(mod, textwrap.dedent(inspect.getsource(fn)))
    return vars(mod)[fn.__name__]


def _passthrough(fn):
    @functools.wraps(fn)
    def decorated(*args, **kwargs):
        return fn(*args, **kwargs)
    return decorated


def test_the_oracle_shaped_set_covers_the_function_tasks_it_can():
    functions = [tid for tid in TASKS if TASKS[tid].kind == "function" and tid not in NOT_AN_ANSWER]
    assert len(ORACLE_SHAPED) >= 10 and {t for t, _ in ORACLE_SHAPED} <= set(functions), ORACLE_SHAPED


@pytest.mark.parametrize("tid, oracle", ORACLE_SHAPED, ids=[t for t, _ in ORACLE_SHAPED])
def test_an_answer_written_like_the_graders_reference_passes(tid, oracle):
    core.reset_attempts()
    TASKS[tid].check(_as_learner_code(oracle))


@pytest.mark.parametrize("tid, oracle", ORACLE_SHAPED, ids=[t for t, _ in ORACLE_SHAPED])
def test_a_decorated_correct_answer_passes(tid, oracle):
    core.reset_attempts()
    TASKS[tid].check(_passthrough(_as_learner_code(oracle)))


def test_a_cached_hash_passes():
    """lab05_1's hash under functools.lru_cache (its arguments are hashable): the cross-process check ships the
    function it wraps."""
    mod = learner_module()
    run_cell(mod, "import functools, hashlib\n"
                  "@functools.lru_cache(maxsize=None)\n"
                  "def hash_block(parent_hash, token_ids):\n"
                  "    h = hashlib.blake2b(digest_size=16)\n"
                  "    h.update(b'\\x00' if parent_hash is None else b'\\x01' + parent_hash.to_bytes(16, 'little'))\n"
                  "    h.update(b''.join(int(t).to_bytes(4, 'little') for t in token_ids))\n"
                  "    return int.from_bytes(h.digest(), 'little')\n")
    TASKS["lab05_1"].check(vars(mod)["hash_block"])


@pytest.mark.parametrize("tid, body", [
    ("lab01_2", "return float(2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * batch_size * seq_len\n"
                "                 * dtype_bytes)"),
    ("lab01_3", "per = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * seq_len * dtype_bytes\n"
                "    return float(max(0, (memory_bytes - weight_bytes) // per))"),
])
def test_a_whole_number_as_a_float_passes_in_both_counting_tasks(tid, body):
    params = ", ".join(_answer_signature(tid))
    mod = learner_module()
    run_cell(mod, f"def {TASKS[tid].what}({params}):\n    {body}\n")
    TASKS[tid].check(vars(mod)[TASKS[tid].what])


def test_a_copy_is_noted_not_failed(capsys):
    """A verbatim paste of minillm's LRUEvictor is lab05_3's correct answer: it passes, with the instructor's note."""
    from minillm.kv.prefix_cache import LRUEvictor
    answer = _as_learner_code(LRUEvictor)
    TASKS["lab05_3"].check(answer)
    assert "note for your instructor" in capsys.readouterr().out
    with pytest.raises(GradingError):         # the note is no pass for wrong code: the properties still decide
        broken = _as_learner_code(LRUEvictor)
        broken.pop_lru = lambda self: next(iter(self._order)) if hasattr(self, "_order") else 0
        TASKS["lab05_3"].check(broken)
