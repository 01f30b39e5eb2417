"""Trusted grading: the verdict `minillm grade` prints and the nbgrader hook records.

In-notebook checks are feedback: they run in the learner's kernel, where an answer cell can change anything. The
trusted verdict is computed elsewhere:

1. The notebook runs in a fresh kernel with every graded cell replaced by `handin.emit(...)`, which pickles that
   cell's answer by value (cloudpickle: a notebook's functions and classes travel with their code) and prints the bytes.
   Nothing else of the kernel is used: whatever its cells did (patched modules, IPython hooks, cleared outputs,
   a rewritten checker) stays in that process, and the bytes are only ever unpickled in a sandbox.
2. Each task is checked here, in the grader's process: its checker draws the inputs and holds the oracle, and calls
   a stand-in for the answer whose every use is a request to a sandbox process (sandbox.Sandbox) that holds the
   learner's code, with minillm's own implementation of the piece stubbed out. An exit or a crash there is a
   verdict ("your function ended the process").

`run_trusted(notebook, execute)` does both (`minillm grade` executes with nbclient, cli.grade_notebook); the
nbgrader hook `TrustedExecute` is the same as a preprocessor, enabled in the course's nbgrader_config.py in place
of Execute (docs/instructors.md).
"""
from __future__ import annotations

import copy
import inspect
import threading
from dataclasses import dataclass
from typing import Any, Callable

import torch
from nbgrader.preprocessors import Execute

from minillm.grading import (lab00, lab01, lab02, lab03, lab04, lab05, lab06, lab07, lab08, lab09, lab10, lab11, lab12,
                             wire)
from minillm.grading import core
from minillm.grading.core import GradingError, Task, note_call, show
from minillm.grading.handin import extraction_cell, graded_call, payloads
from minillm.grading.sandbox import Sandbox

TASKS: dict[str, Task] = {tid: task for lab in (lab00, lab01, lab02, lab03, lab04, lab05, lab06, lab07, lab08, lab09,
                                                lab10, lab11, lab12) for tid, task in lab.TASKS.items()}


# --------------------------------------------------------------------------- 2. stand-ins for the answer

class _Answer:
    """The learner's answer, loaded in one sandbox per thread that uses it (lab09's ranks are threads)."""

    def __init__(self, task: Task, payload: bytes) -> None:
        self.task, self.payload = task, payload
        self.engine = [_path(o) for o in task.engine_objects()]
        self.sandboxes: dict[int, Sandbox] = {}
        self.proxies: dict[int, wire.Proxy] = {}
        self.lock = threading.Lock()
        self.description: dict = {}
        self.closed, self.first = False, threading.get_ident()
        self.proxy()                                    # load it now, in this thread's sandbox

    def proxy(self) -> wire.Proxy:
        me = threading.get_ident()
        with self.lock:
            if self.closed:
                raise wire.ChannelClosed("the check is over")
            if me not in self.proxies:
                box = Sandbox()
                self.sandboxes[me] = box
                self.proxies[me], description = box.load(self.engine, self.payload)
                self.description = self.description or description
            return self.proxies[me]

    def ended(self) -> str:
        with self.lock:
            boxes = list(self.sandboxes.values())
        return next((e for e in (b.ended() for b in boxes) if e), "")

    def where(self) -> str:
        with self.lock:
            box = self.sandboxes.get(self.first)
        return box.where() if box is not None else ""

    def close(self) -> None:
        with self.lock:
            self.closed = True               # a rank thread still running gets no new sandbox
            boxes = list(self.sandboxes.values())
        for box in boxes:
            box.close()


def _path(obj: Any) -> str:
    obj = getattr(obj, "fn", obj) if not isinstance(obj, type) else obj
    return f"{obj.__module__}:{obj.__qualname__}"


def stand_in(answer: _Answer) -> Any:
    """A local object the checker can use as the answer: calls and member uses go to the sandbox."""
    d = answer.description
    if d["kind"] == "class":
        return _class(answer, d)
    if d["kind"] == "kernel":
        return RemoteKernel(answer, d)
    fn = _function(lambda: answer.proxy(), d["name"], d.get("params", []))
    fn.payload = answer.payload          # what a checker ships to fresh processes of its own (lab05's hash)
    return fn


def _function(target: Callable[[], Any], name: str, params: list, skip_self: bool = False) -> Callable[..., Any]:
    def call(*args: Any, **kwargs: Any) -> Any:
        shown = args[1:] if skip_self else args
        names = [p for p, kind in params if kind in ("POSITIONAL_ONLY", "POSITIONAL_OR_KEYWORD")]
        names = names[1:] if skip_self and names and names[0] in ("self", "cls") else names
        parts = [f"{n}={show(v)}" for n, v in zip(names, shown)] + [show(v) for v in shown[len(names):]]
        note_call(f"{name}({', '.join(parts + [f'{k}={show(v)}' for k, v in kwargs.items()])})")
        fn = target()
        result, state = wire.host(fn).call_seeded(fn, torch.get_rng_state(), args, kwargs)
        if isinstance(state, torch.Tensor) and state.dtype == torch.uint8:
            torch.set_rng_state(state)
        return result
    call.__name__ = call.__qualname__ = name
    call.__module__ = "sandbox"
    try:
        call.__signature__ = inspect.Signature([inspect.Parameter(p, getattr(inspect.Parameter, kind))
                                                for p, kind in params])
    except (ValueError, AttributeError):
        pass
    return call


def _class(answer: _Answer, d: dict) -> type:
    """A local class standing for the learner's. Without a base: instances live in the sandbox (`_remote`), every
    member forwards there. As a subclass of minillm's base (a Scheduler subclass): instances live here, the
    base's methods run here, and the learner's functions run in the sandbox with `self` lent from here."""
    base = answer.task.base
    if base is not None and answer.task.instances == "sandbox":
        return _remote_subclass(answer, d, base)
    space: dict[str, Any] = {"__module__": "sandbox", "__qualname__": d["name"]}
    for name, kind in d["members"].items():
        if name.startswith("__") and name not in _PROTOCOL:
            continue
        if name in _PROTOCOL and base is None:
            space[name] = _protocol(name)
        elif kind in ("static", "classmethod"):
            space[name] = staticmethod(_function(_class_member(answer, name), name, []))
        elif kind in ("data", "class"):
            space[name] = getattr(answer.proxy(), name)
        elif base is not None:
            if kind == "method":
                space[name] = _function(_class_member(answer, name), name, [("self", "POSITIONAL_OR_KEYWORD")],
                                        skip_self=True)
        elif kind == "property":
            space[name] = property(lambda self, n=name: getattr(self.__dict__["_remote"], n))
        elif name != "__init__":
            space[name] = _Forward(name)
    if base is None:
        _remote_instances(space, answer)
    return type(d["name"], (base,) if base is not None else (), space)


def _remote_subclass(answer: _Answer, d: dict, base: type) -> type:
    """A subclass of minillm's base whose instances live in the sandbox, base methods and all (the checker drives
    them through the methods: one request a call, however much the methods do inside)."""
    space: dict[str, Any] = {"__module__": "sandbox", "__qualname__": d["name"]}
    names = {n for k in base.__mro__ if k is not object for n in vars(k)} | set(d["members"])
    for name in names:
        static = inspect.getattr_static(base, name, None) if name not in d["members"] else None
        kind = d["members"].get(name) or ("property" if isinstance(static, property) else
                                          "method" if callable(static) else "data")
        if name == "__init__" or (name.startswith("__") and name not in _PROTOCOL):
            continue
        if name in _PROTOCOL:
            space[name] = _protocol(name)
        elif kind == "property":
            space[name] = property(lambda self, n=name: getattr(self.__dict__["_remote"], n))
        elif kind in ("method", "static", "classmethod"):
            space[name] = _Forward(name)
        elif kind in ("data", "class") and name in d["members"]:
            space[name] = getattr(answer.proxy(), name)
    _remote_instances(space, answer)
    return type(d["name"], (base,), space)


_PROTOCOL = {"__len__": len, "__iter__": iter, "__bool__": bool, "__hash__": hash,
             "__contains__": lambda r, x: x in r, "__getitem__": lambda r, k: r[k], "__eq__": lambda r, o: r == o,
             "__setitem__": lambda r, k, v: r.__setitem__(k, v), "__delitem__": lambda r, k: r.__delitem__(k),
             "__call__": lambda r, *a, **k: r(*a, **k)}


def _protocol(name: str) -> Callable[..., Any]:
    """A dunder of a stand-in whose instances live in the sandbox: the same operation on the remote instance."""
    op = _PROTOCOL[name]

    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        return op(self.__dict__["_remote"], *args, **kwargs)
    method.__name__ = name
    return method


def _remote_getattr(self: Any, name: str) -> Any:
    if name.startswith("__") or "_remote" not in self.__dict__:
        raise AttributeError(name)
    return getattr(self.__dict__["_remote"], name)


def _remote_instances(space: dict[str, Any], answer: _Answer) -> None:
    """A stand-in class's instances live in the sandbox (`_remote`): construction, reads and writes go there."""
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        self.__dict__["_remote"] = answer.proxy()(*args, **kwargs)
    space["__init__"] = __init__
    space["__getattr__"] = _remote_getattr
    space["__setattr__"] = lambda self, name, value: setattr(self.__dict__["_remote"], name, value)


class _Forward:
    """A method of a stand-in class whose instances live in the sandbox: `obj.name` is the remote bound method
    (one request a call; `map_calls` for many)."""

    def __init__(self, name: str) -> None:
        self.name = self.__name__ = name

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        return self if obj is None else wire.Method(obj.__dict__["_remote"], self.name)

    def __call__(self, obj: Any, *args: Any, **kwargs: Any) -> Any:
        return wire.Method(obj.__dict__["_remote"], self.name)(*args, **kwargs)


def _class_member(answer: _Answer, name: str) -> Callable[[], Any]:
    """The learner's class member `name` as found on the class in this thread's sandbox (for a method: the plain
    function, called with `self` lent from here)."""
    cache: dict[int, Any] = {}

    def get() -> Any:
        me = threading.get_ident()
        if me not in cache:
            cache[me] = getattr(answer.proxy(), name)
        return cache[me]
    return get


class RemoteKernel:
    """A Triton kernel handed in: its source (the lab03 checker runs it from the source text in a child process of
    its own), and `kernel[grid](*args)` launches it in the sandbox (tensors written in place come back)."""

    __module__ = "sandbox"

    def __init__(self, answer: _Answer, d: dict) -> None:
        self.answer, self.description = answer, d
        self.__name__ = d["name"]
        self.source = d.get("source")
        self.arg_names = [p for p, _ in d.get("params", [])]

    def kernel_source(self) -> str | None:
        return self.source

    def __getitem__(self, grid: Any) -> Callable[..., Any]:
        def launch(*args: Any, **kwargs: Any) -> Any:
            return self.answer.proxy()[grid](*args, **kwargs)
        return launch


# --------------------------------------------------------------------------- 3. a task's trusted verdict

@dataclass
class Verdict:
    passed: bool
    message: str = ""
    note: str | None = None


def grade_answer(task_id: str, payload: bytes) -> Verdict:
    """Check one answer (its pickled bytes) with the task's checker, the learner's code in a sandbox."""
    task = TASKS[task_id]
    answer = None
    try:
        try:
            answer = _Answer(task, payload)
        except Exception as e:  # noqa: BLE001 — unpickling ran in the sandbox: whatever it raised is the answer's
            return Verdict(False, f"your {task.what} could not be loaded where it is graded ({type(e).__name__}: "
                                  f"{e}): hand in code of your own, defined in the notebook (minillm's graders and "
                                  "its own implementation of the piece are not available there).")
        core.REMOTE_WHERE.append(answer.where)
        try:
            task.check(stand_in(answer))
        finally:
            core.REMOTE_WHERE.remove(answer.where)
        return Verdict(True, note=answer.description.get("note"))
    except GradingError as e:
        return Verdict(False, str(e).strip())
    except wire.ChannelClosed as e:
        how = answer.ended() if answer is not None else ""
        if isinstance(e, wire.Ended) or how:
            cause = str(e) if isinstance(e, wire.Ended) else how
            return Verdict(False, f"your {task.what} ended the process it was graded in ({cause}): "
                           "an answer returns its result; it never exits.")
        return Verdict(False, f"the grading sandbox stopped: {e}")
    except wire.RemoteError as e:
        return Verdict(False, f"your answer could not be loaded for grading: {e}")
    finally:
        if answer is not None:
            answer.close()


# --------------------------------------------------------------------------- 4. a notebook's trusted verdicts

def _graded(cell: Any) -> bool:
    meta = cell.get("metadata", {}).get("nbgrader", {})
    return cell.get("cell_type") == "code" and bool(meta.get("grade")) and not meta.get("solution")


def run_trusted(nb: Any, execute: Callable[[Any], Any]) -> Any:
    """Execute `nb` with its graded cells replaced by extraction cells (`execute(notebook) -> executed notebook`),
    then put back the graded cells, each with its trusted verdict as its output: nothing on a pass (a note for
    the instructor at most), a GradingError output on a failure. Returns the executed notebook."""
    import nbformat
    work = copy.deepcopy(nb)
    graded = [i for i, c in enumerate(work.cells) if _graded(c)]
    for i in graded:
        work.cells[i].source = extraction_cell(nb.cells[i].source) or "raise RuntimeError('not a checker call')"
    done = execute(work)
    for i in graded:
        found = payloads([done.cells[i]])           # the answer printed by this cell (tasks may repeat)
        cell, source = done.cells[i], nb.cells[i].source
        cell.source = source
        call = graded_call(source)
        error = next((o for o in cell.get("outputs", []) if o.get("output_type") == "error"), None)
        if call is None:
            cell.outputs = [_error("GradingError", "the graded cell was modified: restore it (it must be the "
                                                   "one-line checker call)")]
        elif call[1] not in found:
            cell.outputs = [error] if error is not None else [_error(
                "GradingError", "the answer was not handed in (the cell did not run to its end)")]
        else:
            verdict = grade_answer(call[1], found[call[1]])
            cell.outputs = [] if verdict.passed else [_error("GradingError", verdict.message)]
            if verdict.note:
                cell.outputs.append(nbformat.v4.new_output("stream", name="stdout", text=verdict.note + "\n"))
    return done


def _error(ename: str, evalue: str) -> Any:
    import nbformat
    return nbformat.v4.new_output("error", ename=ename, evalue=evalue, traceback=[f"{ename}: {evalue}"])


class TrustedExecute(Execute):
    """nbgrader's Execute, graded the trusted way: use it in place of Execute in the course's
    `c.Autograde.autograde_preprocessors` (nbgrader_config.py). SaveAutoGrades then records the verdicts."""

    def preprocess(self, nb: Any, resources: Any) -> tuple[Any, Any]:
        out: dict[str, Any] = {}

        def execute(work: Any) -> Any:
            out["nb"], out["resources"] = super(TrustedExecute, self).preprocess(work, resources)
            return out["nb"]
        done = run_trusted(nb, execute)
        return done, out.get("resources", resources)
