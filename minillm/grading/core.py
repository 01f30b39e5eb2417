"""The checker framework every lab's grader is built from.

A lab task is a `Task`: `task.check(answer)` grades a learner's answer, `task.verify(obj)` runs the same property
suite without the integrity checks (tests/ run it on minillm's own implementation: one suite, graded both ways).
`check` does, in order:

1. `task.form(answer)`: the answer has the right shape (a function, a class with these methods, ...).
2. `reject_delegation`: the answer is not minillm's own implementation of the piece, nor the grader's oracle, under
   any alias. Code of the learner's own that looks like theirs is never a reason to fail (honest answers coincide
   with them); a long verbatim copy of minillm's implementation is only noted for the instructor (copy_note).
3. `task.verify(answer)` under a `Watch`: a tracer that fails the check when minillm's implementation of the piece
   runs at all, or the grader's oracle runs under the learner's code (a wrapper, super(), a forwarding composition).
A failure raises one GradingError (an AssertionError: nbgrader and pytest count it as a failed test) that reads like
feedback: what went wrong, the smallest failing example hypothesis found, a hint.

Feedback: the conventions a lab's grader follows
  - The verdict is `message` / `Smallest failing example` / `Hint`, raised with `fail(message, hint)` (or `check`)
    inside a property that `run_property` runs, or anywhere in `verify`. Never `assert` or a bare exception.
  - The message says what was wrong on which case, in the statement's words; a known mistake is named after " — "
    (`diagnose` against the lab's list of wrong variants).
  - The example is what the learner's code was called with, never the generator's knobs (see `run_property`).
    Extra calls of the answer made to explain a failure go inside `diagnose` or `with not_recorded():`.
  - Hints are staged (`Hint(nudge, more, show)`, see `Task.check`). A plain string hint is shown as is on every
    failure: keep those to facts about the failure, never the solution. An untouched answer (NotImplementedError)
    reads NOT_IMPLEMENTED, with no hint at all.
  - A check runs under `time_limit(Task.time_limit)`: an endless loop reads "timed out after N s", naming the
    learner's function and line that were running. A lab may nest a shorter `time_limit` per case (lab04).
  - An exception from the learner's code reads "your code raised X: ... (in f, line N: `...`)"; one from the
    grader itself says it is the grader's bug. In a notebook the verdict shows without a traceback.

Feedback, not verdicts: `task.check` runs in the learner's kernel, where an answer cell can change anything, so its
integrity checks (exact-type reads of results, references computed from copies of the inputs, refusing minillm's
own implementation handed in or run by the answer) serve honest learners' feedback. The verdict is
minillm.grading.trusted's: the same `task.check`, run in the grader's own process on a stand-in whose every use
is a request to a sandbox process holding the learner's code (minillm.grading.sandbox).
"""
from __future__ import annotations

import contextlib
import dataclasses
import dis
import functools
import importlib
import inspect
import os
import re
import signal
import sys
import sysconfig
import tempfile
import threading
import time
import traceback
import types
from typing import Any, Callable, Iterable

from minillm import config  # noqa: E402

config.keep_hypothesis_out_of_the_notebook(os.path.join(tempfile.gettempdir(), "minillm-hypothesis"))

import torch  # noqa: E402
from hypothesis import HealthCheck, Phase, settings  # noqa: E402

from minillm.grading.wire import ChannelClosed  # noqa: E402
from minillm.verdict import (NOT_IMPLEMENTED, GradingError, Hint, as_float, as_int, as_ints,  # noqa: E402,F401
                             as_tensor, check, fail, is_minillm as _is_minillm, type_name as _type_name)

__all__ = ["GradingError", "Hint", "fail", "check", "as_int", "as_float", "as_ints", "as_tensor", "Task",
           "run_property", "diagnose", "not_recorded", "note_call", "reject_delegation", "copy_note", "fingerprints",
           "Watch", "NOT_IMPLEMENTED", "minillm_objects", "function_answer", "class_answer", "Delegated",
           "is_library_file",
           "show", "learner_location", "time_limit", "TimedOut", "reset_attempts", "DEFAULT_TIME_LIMIT"]


# --------------------------------------------------------------------------- delegation: aliases, copies, tracing

def _unwrap(obj: Any) -> Any:
    """See through functools.partial / partialmethod (with or without bound arguments), bound methods,
    staticmethod / classmethod and functools.wraps-style `__wrapped__` chains: the same code under another name."""
    seen = set()
    while id(obj) not in seen:
        seen.add(id(obj))
        if isinstance(obj, (functools.partial, functools.partialmethod)):
            obj = obj.func
        elif getattr(obj, "_partialmethod", None) is not None:          # what a partialmethod looks like on a class
            obj = obj._partialmethod.func
        elif isinstance(obj, (staticmethod, classmethod)) or inspect.ismethod(obj):
            obj = obj.__func__
        elif getattr(obj, "__wrapped__", None) is not None and not isinstance(obj, type):
            obj = obj.__wrapped__
        else:
            break
    return obj


def _functions(obj: Any) -> list[types.FunctionType]:
    """The Python functions an object runs: itself, every method of a class (its own and its bases' short of
    object), the Python function of a Triton kernel."""
    obj = _unwrap(obj)
    fn = getattr(obj, "fn", None)                      # triton JITFunction / InterpretedFunction
    if fn is not None and inspect.isfunction(fn):
        obj = fn
    if inspect.isfunction(obj):
        return [obj]
    if isinstance(obj, type):
        return [f for k in obj.__mro__ if k is not object for v in vars(k).values() for f in _member_functions(v)]
    return []


def _member_functions(v: Any) -> list[types.FunctionType]:
    v = _unwrap(v)
    if inspect.isfunction(v):
        return [v]
    if isinstance(v, property):
        return [f for f in (v.fget, v.fset, v.fdel) if inspect.isfunction(f)]
    return []


def _codes(obj: Any) -> list[types.CodeType]:
    return [f.__code__ for f in _functions(obj)]


def _fingerprint(code: types.CodeType, names: bool = False) -> tuple:
    """The code's instructions, local names erased (names=False: a copy whose variables were renamed has the same
    one) or kept (names=True: a verbatim copy)."""
    out = []
    for ins in dis.get_instructions(code):
        if ins.opname in ("RESUME", "NOP", "CACHE", "EXTENDED_ARG"):
            continue
        arg = ins.argval
        if inspect.iscode(arg):
            arg = _fingerprint(arg, names)
        elif ins.opname in ("LOAD_FAST", "STORE_FAST", "DELETE_FAST", "LOAD_CLOSURE", "LOAD_DEREF", "STORE_DEREF",
                            "MAKE_CELL", "COPY_FREE_VARS"):
            arg = ins.argval if names else ins.arg
        elif isinstance(arg, (int, float, str, bytes, bool, type(None), tuple, frozenset)):
            arg = repr(arg)
        else:
            arg = type(arg).__name__
        if "JUMP" in ins.opname or ins.opname.startswith("FOR_ITER") or ins.opname.startswith("SEND"):
            arg = None                                  # offsets move when a docstring or comment changes lines
        # 3.11's specializing interpreter rewrites a LOAD_METHOD on a module into a LOAD_ATTR in code that has run
        out.append(("LOAD_ATTR" if ins.opname == "LOAD_METHOD" else ins.opname, arg))
    return tuple(out)


def _size(fp: tuple) -> int:
    return sum(1 + (_size(a) if isinstance(a, tuple) and a and isinstance(a[0], tuple) else 0) for _, a in fp)


# A copy is never a reason to fail: honest answers coincide with minillm's code or the grader's oracle (a one-line
# formula, the statement's own step order, natural names). A long *verbatim* copy of minillm's own implementation
# (the same instructions and the same local names, at least this many instructions) is only noted, for the
# instructor; the grade is the behaviour's.
VERBATIM_NOTE_INSTRUCTIONS = 40


def fingerprints(engine: Iterable[Any]) -> set[tuple]:
    """The verbatim fingerprints of minillm's implementation of a piece (copy_note compares with them)."""
    return {_fingerprint(c, names=True) for e in engine for c in _codes(e)}


def copy_note(answer: Any, refs: set[tuple]) -> str | None:
    """A note when the answer's own code repeats minillm's implementation (`refs`: its fingerprints) verbatim."""
    target = _unwrap(answer)
    owner = target if inspect.isfunction(target) or isinstance(target, type) else type(target)
    own = [f.__code__ for f in _functions(owner) if not is_library_file(f.__code__.co_filename)]
    matched = [fp for fp in (_fingerprint(c, names=True) for c in own) if fp in refs]
    if sum(_size(fp) for fp in matched) < VERBATIM_NOTE_INSTRUCTIONS:
        return None
    return ("note for your instructor: this answer repeats minillm's own implementation verbatim (the same code and "
            "names); the grade above is your code's behaviour, the note only says where it came from.")


def _qualname(obj: Any) -> str:
    mod = getattr(obj, "__module__", None) or "?"
    name = getattr(obj, "__qualname__", None) or getattr(obj, "__name__", None) or type(obj).__name__
    return f"{mod}.{name}"


_DELEGATES = ("define it in the answer cell with your own code, instead of calling, subclassing or copying "
              "minillm's implementation.")


def reject_delegation(answer: Any, engine: Iterable[Any], oracles: Iterable[Any] = ()) -> None:
    """Fail when `answer` IS minillm's implementation of the piece (`engine`) or the grader's reference (`oracles`):
    the object itself under another name, or an object defined inside the minillm package. Code that merely looks
    like theirs is the learner's own (copy_note at most notes a long verbatim copy)."""
    __tracebackhide__ = True
    engine, oracles = list(engine), list(oracles)
    target = _unwrap(answer)
    if inspect.isfunction(getattr(target, "fn", None)):      # a Triton kernel: its Python function
        target = target.fn
    for ref in engine + oracles:
        r = _unwrap(ref)
        r = r.fn if inspect.isfunction(getattr(r, "fn", None)) else r
        if target is r or (inspect.isfunction(target) and inspect.isfunction(r) and target.__code__ is r.__code__):
            fail(f"you submitted {_qualname(r)} itself, minillm's own answer.", _DELEGATES)
    owner = target if inspect.isfunction(target) or isinstance(target, type) else type(target)
    if _is_minillm(getattr(owner, "__module__", None)):
        fail(f"you submitted {_qualname(owner)}, which is minillm's own code.", _DELEGATES)


_LIBRARY_DIRS = tuple(os.path.realpath(p) + os.sep for p in
                      {sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")}
                      | {os.path.dirname(os.path.dirname(os.path.abspath(__file__)))})   # the minillm package


def is_library_file(path: str) -> bool:
    """Code of minillm, the standard library or an installed package (a pseudo-file like <string> counts too)."""
    return path.startswith("<") or os.path.realpath(path).startswith(_LIBRARY_DIRS)


def _is_learner_code(code: types.CodeType, globals_: dict) -> bool:
    """Is this code the learner's (a notebook cell, a test's stand-in answer, code exec'd in either)? Judged by the
    module its globals belong to, else by its file: what `exec` or a notebook compiles has no real file."""
    name = globals_.get("__name__")
    module = sys.modules.get(name) if isinstance(name, str) else None
    path = getattr(module, "__file__", None)
    if path is None:
        if name == "__main__":                       # a notebook's namespace, or code exec'd into it
            return True
        path = code.co_filename
    return not is_library_file(path)


class Delegated(BaseException):
    """Raised by the tracer at the first forbidden call, to end the check early (the verdict is Watch.seen). A
    BaseException: the answer's own `except Exception` does not swallow it, and hypothesis lets it through."""


class Watch:
    """A tracer for the duration of a check: notes when minillm's implementation of the piece runs (`engine`
    code, at all) or the grader's oracle runs with the learner's code on the stack (`oracles`), and stops the
    check there (an answer that catches the stop still fails: `seen` is recorded first).

    It also records what the learner's answer was called with (`answer`: the code of the answer's functions or
    methods; only calls from outside them, so not a recursion's inner calls): the arguments by the names the
    learner gave them, rendered when the call starts (before the answer could modify them). `run_property` starts
    a new record for every example, so after a failure `calls` holds the failing example's calls; `diagnose` pauses
    the record while it probes the answer with other arguments."""

    def __init__(self, engine_codes: Iterable[types.CodeType], oracle_codes: Iterable[types.CodeType] = (),
                 answer_codes: Iterable[types.CodeType] = (), answer_name: str | None = None,
                 method_calls: bool = False) -> None:
        self.engine, self.oracles = frozenset(engine_codes), frozenset(oracle_codes)
        self.answer, self.answer_name, self.method_calls = frozenset(answer_codes), answer_name, method_calls
        self.seen: types.CodeType | None = None
        self.seen_engine = False
        self.calls: list[str] = []
        self.paused = 0
        self.noted = False           # calls recorded by a stand-in (note_call)

    def __enter__(self) -> "Watch":
        self.entry = sys._getframe(1)
        self.previous = sys.gettrace()
        _WATCHES.append(self)
        sys.settrace(self._trace)
        return self

    def __exit__(self, *exc: object) -> bool:
        sys.settrace(self.previous)
        if _WATCHES and _WATCHES[-1] is self:
            _WATCHES.pop()
        return False

    def _trace(self, frame: types.FrameType, event: str, arg: Any) -> Callable[..., Any] | None:
        code = frame.f_code
        if self.seen is None and (code in self.engine or (code in self.oracles and self._under_learner(frame))):
            self.seen, self.seen_engine = code, code in self.engine
            raise Delegated()
        if code in self.answer and not self.paused and (frame.f_back is None or frame.f_back.f_code not in self.answer):
            self.calls.append(self._call(frame))
            del self.calls[:-_KEPT_CALLS]
        return self.previous(frame, event, arg) if self.previous is not None else None

    def _call(self, frame: types.FrameType) -> str:
        code = frame.f_code
        names = list(code.co_varnames[:code.co_argcount + code.co_kwonlyargcount])
        star = code.co_argcount + code.co_kwonlyargcount
        if code.co_flags & inspect.CO_VARARGS:
            names.append("*" + code.co_varnames[star])
            star += 1
        if code.co_flags & inspect.CO_VARKEYWORDS:
            names.append("**" + code.co_varnames[star])
        values = frame.f_locals
        if self.method_calls and names and names[0] in ("self", "cls"):
            names = names[1:]
        shown = []
        for name in names:
            value = values.get(name.lstrip("*"))
            if name.startswith("**"):
                shown += [f"{k}={show(v)}" for k, v in (value or {}).items()]
            elif name.startswith("*"):
                shown += [show(v) for v in (value or ())]
            else:
                shown.append(f"{name}={show(value)}")
        fn = code.co_name if code.co_name != "<lambda>" or not self.answer_name else self.answer_name
        return _clip(f"{fn}({', '.join(shown)})", 600)

    def _under_learner(self, frame: types.FrameType) -> bool:
        f = frame.f_back
        while f is not None and f is not self.entry:
            if _is_learner_code(f.f_code, f.f_globals):
                return True
            f = f.f_back
        return False


_WATCHES: list[Watch] = []       # the Watch of the check running now (innermost last)
_KEPT_CALLS = 8


# --------------------------------------------------------------------------- showing values compactly

def _clip(text: str, room: int) -> str:
    return text if len(text) <= room else text[:room - 1] + "…"


def show(value: Any, room: int = 160) -> str:
    """A short, faithful rendering of a value for feedback: small containers in full, tensors as dtype and shape
    (their values too when there are at most 8), dataclasses by the fields that differ from their defaults. Never
    calls code of the learner's (an object of a class defined in a notebook shows as <ClassName object>)."""
    try:
        return _clip(_show(value, 3), room)
    except Exception:  # noqa: BLE001 — a rendering must never fail a check
        return f"<{type(value).__name__}>"


def _show(x: Any, depth: int) -> str:
    t = type(x)
    if x is None or t in (bool, int, float, complex):
        return repr(x)
    if t in (str, bytes, bytearray):
        return _clip(repr(x), 80)
    if isinstance(x, torch.Tensor):
        return _show_tensor(x)
    if isinstance(x, torch.dtype):
        return str(x)
    if type(x).__module__ == "numpy" and hasattr(x, "shape") and hasattr(x, "dtype"):
        if x.ndim == 0:
            return repr(x.item())
        if x.size <= 8:
            return f"array({x.tolist()!r}, dtype={x.dtype})"
        return f"<numpy {x.dtype} array {list(x.shape)}>"
    if isinstance(x, type):
        return x.__qualname__
    if isinstance(x, (types.FunctionType, types.BuiltinFunctionType, types.MethodType, functools.partial)):
        return f"<function {getattr(_unwrap(x), '__qualname__', type(x).__name__)}>"
    if depth <= 0:
        return f"<{t.__name__}>" if not isinstance(x, (list, tuple, dict)) else f"<{t.__name__} of {len(x)}>"
    if t in (list, tuple, set, frozenset) or (isinstance(x, tuple) and not hasattr(x, "_fields")):
        items = list(x) if t not in (set, frozenset) else sorted(x, key=repr)
        shown = [_show(v, depth - 1) for v in items[:12]] + ([f"… ({len(items)} items)"] if len(items) > 12 else [])
        inner = ", ".join(shown)
        return {list: f"[{inner}]", set: f"{{{inner}}}", frozenset: f"frozenset({{{inner}}})"}.get(
            t, f"({inner}{',' if len(items) == 1 else ''})")
    if isinstance(x, tuple) and hasattr(x, "_fields"):                    # a namedtuple
        return f"{t.__name__}(" + ", ".join(f"{k}={_show(v, depth - 1)}" for k, v in zip(x._fields, x)) + ")"
    if isinstance(x, (dict, types.MappingProxyType)):
        items = list(x.items())
        shown = [f"{_show(k, 0)}: {_show(v, depth - 1)}" for k, v in items[:8]]
        return "{" + ", ".join(shown + ([f"… ({len(items)} items)"] if len(items) > 8 else [])) + "}"
    if dataclasses.is_dataclass(x) and not _is_learner_class(t):
        return f"{t.__name__}(" + ", ".join(f"{f.name}={_show(getattr(x, f.name), depth - 1)}"
                                            for f in dataclasses.fields(x) if f.repr and _not_default(x, f)) + ")"
    if _is_learner_class(t) or t.__repr__ is object.__repr__:
        return f"<{t.__name__} object>"
    return _clip(repr(x), 80)


def _show_tensor(x: torch.Tensor) -> str:
    dtype = str(x.dtype).removeprefix("torch.")
    if x.numel() <= 8 and x.device.type != "meta":
        default = x.dtype in (torch.float32, torch.int64, torch.bool)
        return f"tensor({_numbers(x.detach().cpu().tolist())}{'' if default else f', dtype={dtype}'})"
    view = "" if x.is_contiguous() else ", a strided view"
    return f"<{dtype} tensor of shape {list(x.shape)}{view}>"


def _numbers(v: Any) -> str:
    """Nested lists of numbers with 4 significant digits (a tensor's values)."""
    if isinstance(v, list):
        return "[" + ", ".join(_numbers(x) for x in v) + "]"
    return f"{v:.4g}" if type(v) is float else repr(v)


def _not_default(obj: Any, f: "dataclasses.Field") -> bool:
    value = getattr(obj, f.name)
    if f.default is not dataclasses.MISSING:
        return not (type(value) is type(f.default) and value == f.default)
    return True


def _is_learner_class(t: type) -> bool:
    module = sys.modules.get(t.__module__)
    path = getattr(module, "__file__", None)
    return t.__module__ == "__main__" or (path is not None and not is_library_file(path))


# --------------------------------------------------------------------------- running a property

_NOTE_RE = re.compile(r"^(Falsifying|Failing)( explicit)? (example|test case): \w+\(\s*(?P<args>.*)\)\s*$", re.S)


def _format_example(notes: list[str]) -> str | None:
    """Hypothesis' own note of the failing example (used only when the example's arguments were not captured)."""
    for note in notes:
        m = _NOTE_RE.match(note.strip())
        if m:
            args = [a.strip().rstrip(",") for a in m.group("args").splitlines()]
            return ", ".join(a for a in args if a)
    return None


def learner_location(exc: BaseException) -> str:
    """Where in the learner's own code an exception was raised, e.g. ' (in attend, line 7: `k = k[idx]`)': the
    innermost frame of its traceback that is neither minillm's, nor a library's (no file path: in a notebook the
    line number counts from the top of the cell)."""
    if getattr(exc, "remote_where", None) is not None:         # raised in the sandbox (trusted grading)
        return exc.remote_where
    mine = [f for f in traceback.extract_tb(exc.__traceback__) if not is_library_file(f.filename)
            or f.filename.startswith("<ipython")]
    if not mine:
        return ""
    f = mine[-1]
    line = (f.line or "").strip()
    return f" (in {f.name}, line {f.lineno}" + (f": `{_clip(line, 80)}`)" if line else ")")


def _describe(exc: BaseException) -> str:
    if isinstance(exc, NotImplementedError) or _caused_by_not_implemented(exc):
        return NOT_IMPLEMENTED
    if isinstance(exc, GradingError):
        return exc.message or "a property did not hold"
    if isinstance(exc, AssertionError):
        text = str(exc).strip()
        return text or "a property did not hold"
    text = str(exc).strip().splitlines()
    first = _clip(text[0], 200) if text else ""
    return (f"your code raised {type(exc).__name__}" + (f": {first}" if first else "") + learner_location(exc))


def _caused_by_not_implemented(exc: BaseException) -> bool:
    seen = exc.__cause__ or exc.__context__
    while seen is not None:
        if isinstance(seen, NotImplementedError):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def run_property(test_fn: Callable[[], None], *, max_examples: int = 50, hint: "Hint | str | None" = None,
                 example: "bool | Callable[..., str]" = True) -> None:
    """Run a hypothesis `@given` test with grading settings; on failure raise one readable GradingError.

    Settings: no deadline, derandomized (same examples on every run), no example database, bounded examples,
    slow-data health checks off. Explicit `@example`s run first, so hand-picked edge cases always run.

    The verdict's "Smallest failing example" (example=True): for a function answer, its last call in the failing
    example (what the learner's function was called with, by its own argument names); for a class answer, the
    property's arguments (the operations that drove it). example=False: none (the message shows the case itself);
    a callable: its text for the property's arguments, `example(**kwargs)`."""
    __tracebackhide__ = True
    configured = settings(
        deadline=None, derandomize=True, database=None, max_examples=max_examples, print_blob=False,
        report_multiple_bugs=False,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much,
                               HealthCheck.large_base_example],
        phases=[Phase.explicit, Phase.generate, Phase.shrink],
    )(test_fn)
    watch = _WATCHES[-1] if _WATCHES else None
    last: dict = {}
    inner = configured.hypothesis.inner_test

    def one_example(*args: Any, **kwargs: Any) -> Any:
        __tracebackhide__ = True
        last.clear()
        last.update(args=args, kwargs=kwargs)
        if watch is not None:
            watch.calls.clear()
        return inner(*args, **kwargs)
    configured.hypothesis.inner_test = one_example
    try:
        configured()
    except (KeyboardInterrupt, SystemExit, Delegated, TimedOut, ChannelClosed):
        raise
    except BaseException as exc:  # noqa: BLE001 — the learner's code may raise anything
        described = _describe(exc)
        if described == NOT_IMPLEMENTED:
            raise GradingError(NOT_IMPLEMENTED) from None
        shown = _example_text(example, watch, inner, last, exc)
        own_hint = exc.hint if isinstance(exc, GradingError) else None
        raise GradingError(described, exc.example if isinstance(exc, GradingError) and exc.example else shown,
                           own_hint if own_hint is not None else hint) from None


def _example_text(example: bool | Callable[..., str], watch: "Watch | None", inner: Callable[..., Any], last: dict,
                  exc: BaseException) -> str | None:
    if example is False:
        return None
    if watch is not None and (watch.answer or watch.noted) and not watch.method_calls:   # a function answer: its call
        return watch.calls[-1] if watch.calls else None
    try:
        bound = inspect.signature(inner).bind(*last.get("args", ()), **last.get("kwargs", {}))
    except (TypeError, ValueError):
        return _format_example(list(getattr(exc, "__notes__", []) or []))
    if callable(example):
        try:
            return example(**bound.arguments)
        except Exception:  # noqa: BLE001 — a rendering must never hide the verdict
            pass
    return ", ".join(f"{k}={show(v, 400)}" for k, v in bound.arguments.items()) or None


def diagnose(fn: Callable[..., Any], variants: list[tuple[str, Callable[..., Any]]], probes: list[tuple],
             same: Callable[[Any, Any], bool]) -> str | None:
    """Name the known mistake the learner made: the first `(why, wrong_fn)` of `variants` that agrees with
    `fn` on every argument tuple in `probes`. None when no variant explains `fn`'s answers. (The calls it makes
    are not recorded as the failing example's.)"""
    with not_recorded():
        outs = []
        for args in probes:
            try:
                outs.append(fn(*args))
            except Exception:  # noqa: BLE001
                return None
        for why, wrong in variants:
            try:
                if all(same(out, wrong(*args)) for out, args in zip(outs, probes)):
                    return why
            except Exception:  # noqa: BLE001
                continue
    return None


def note_call(text: str) -> None:
    """Record a call of the answer made through a stand-in (trusted grading: the answer's code runs in another
    process, where the Watch cannot see it)."""
    watch = _WATCHES[-1] if _WATCHES else None
    if watch is not None and not watch.paused:
        watch.noted = True
        watch.calls.append(_clip(text, 600))
        del watch.calls[:-_KEPT_CALLS]


@contextlib.contextmanager
def not_recorded():
    """Calls of the learner's answer made inside this block (probes, diagnoses) are not the failing example."""
    watch = _WATCHES[-1] if _WATCHES else None
    if watch is not None:
        watch.paused += 1
    try:
        yield
    finally:
        if watch is not None:
            watch.paused -= 1


# --------------------------------------------------------------------------- time limits

class TimedOut(BaseException):
    """A grader's time limit ran out. A BaseException: the learner's `except Exception` does not swallow it, and
    hypothesis lets it through (no shrinking of an endless loop). `limit` is the `time_limit` that ran out; `where`
    the innermost frame of the learner's code that was running, when there was one ("in f, line 3")."""

    def __init__(self, limit: "_Limit", where: str) -> None:
        super().__init__(f"timed out after {limit.seconds:g} s")
        self.limit, self.where = limit, where


class _Limit:
    def __init__(self, seconds: float) -> None:
        self.seconds, self.deadline = float(seconds), time.monotonic() + float(seconds)


_LIMITS: list[_Limit] = []          # the active limits, outermost first
_OLD_HANDLER: list = []


def _can_alarm() -> bool:
    return (hasattr(signal, "SIGALRM") and threading.current_thread() is threading.main_thread()
            and (bool(_LIMITS) or signal.getitimer(signal.ITIMER_REAL)[0] == 0))   # never take over a foreign timer


def _arm() -> None:
    if not _LIMITS:
        signal.setitimer(signal.ITIMER_REAL, 0)
        return
    left = min(x.deadline for x in _LIMITS) - time.monotonic()
    signal.setitimer(signal.ITIMER_REAL, max(left, 0.001), 1.0)     # and again every second, should it be swallowed


def _on_alarm(signum: int, frame: types.FrameType | None) -> None:
    now = time.monotonic()
    expired = [x for x in _LIMITS if x.deadline <= now + 0.01]
    if not expired:
        _arm()
        return
    where = ""
    f = frame
    while f is not None:
        if _is_learner_code(f.f_code, f.f_globals):
            where = f"in {f.f_code.co_name}, line {f.f_lineno}"
            break
        f = f.f_back
    raise TimedOut(expired[0], where)           # the outermost: its owner reports it


@contextlib.contextmanager
def time_limit(seconds: float | None):
    """Raise TimedOut in this block once it has run `seconds` (SIGALRM: the main thread on POSIX; elsewhere, or
    with seconds=None, no limit). Limits nest; an inner one never extends an outer one. Yields the limit, so its
    owner can tell its own TimedOut (`e.limit is limit`) from an outer one's."""
    if seconds is None or not _can_alarm():
        yield None
        return
    limit = _Limit(seconds)
    if not _LIMITS:
        _OLD_HANDLER[:] = [signal.signal(signal.SIGALRM, _on_alarm)]
    _LIMITS.append(limit)
    _arm()
    try:
        yield limit
    finally:
        _LIMITS.remove(limit)
        _arm()
        if not _LIMITS and _OLD_HANDLER:
            signal.signal(signal.SIGALRM, _OLD_HANDLER.pop())


# --------------------------------------------------------------------------- the task

# A check stops after this long (seconds) unless its Task says otherwise: the solutions' checks take 0.1-20 s on a
# loaded 2-core machine, so only an answer that loops forever gets near it.
DEFAULT_TIME_LIMIT = 120.0


class Task:
    """One graded task: `check` for learners, `verify` for tests (see the module docstring).

    what:    how feedback names the piece, e.g. "slot_mapping"
    verify:  object -> None, the property suite (raises GradingError)
    engine:  zero-argument callable -> minillm's implementations of the piece (functions / classes / methods)
    oracles: zero-argument callable -> the grader's references for it (allowed for the checker, not the answer)
    kind:    the answer's shape: "function"; "class" (with `methods`); "methods" (a subclass of `base` that
             defines `methods` itself, e.g. a Scheduler subclass with its own schedule_running)
    form:    answer -> the object to verify, checking its shape (default: from kind)
    time_limit: seconds the whole check may take before it stops with "timed out after N s" (an endless loop in
             the answer); about 10x what a correct answer takes on a slow 2-core machine.
    instances: where a class answer's instances live under trusted grading (minillm.grading.trusted): "sandbox"
             (the checker drives them through calls) or "grader" (the engine holds them: the learner's methods run
             in the sandbox with `self` lent from the grader's process).
    """

    def __init__(self, task_id: str, *, what: str, verify: Callable[[Any], None],
                 engine: Callable[[], list], oracles: Callable[[], list] = list, kind: str = "function",
                 base: type | None = None, methods: tuple[str, ...] = (),
                 form: Callable[[Any], Any] | None = None, time_limit: float = DEFAULT_TIME_LIMIT,
                 instances: str = "sandbox") -> None:
        if kind not in ("function", "class", "methods") or instances not in ("sandbox", "grader"):
            raise ValueError(f"unknown answer kind {kind!r} or instances {instances!r}")
        self.instances = instances
        self.id, self.what, self.kind, self.base, self.methods = task_id, what, kind, base, methods
        self._verify, self._engine, self._oracles, self.time_limit = verify, engine, oracles, time_limit
        if form is None:
            form = (function_answer(what) if kind == "function" else
                    class_answer(what, methods) if kind == "class" else
                    class_answer(what, methods, base=base, own=methods))
        self._form = form

    def engine_objects(self) -> list:
        return list(self._engine())

    def oracle_objects(self) -> list:
        return list(self._oracles())

    def verify(self, obj: Any) -> None:
        __tracebackhide__ = True
        self._verify(obj)

    def checker(self, contract: str) -> Callable[[Any], None]:
        """The graded cells' entry point, `check_<task id>(answer)`; `contract` documents what it grades."""
        def check_answer(answer: Any) -> None:
            __tracebackhide__ = True
            self.check(answer)
        check_answer.__name__ = check_answer.__qualname__ = f"check_{self.id}"
        check_answer.__doc__ = contract
        return check_answer

    def check(self, answer: Any) -> None:
        """Grade an answer; a failure raises GradingError with the hint of this task's failures in a row so far
        in this kernel session (1: a nudge, 2: more, 3 and on: "Show me"). A pass starts the count again; "not
        implemented yet" does not count."""
        __tracebackhide__ = True
        try:
            self._check(answer)
        except GradingError as e:
            if e.message.startswith(NOT_IMPLEMENTED[:20]):
                raise GradingError(NOT_IMPLEMENTED) from None
            n = _ATTEMPTS[self.id] = _ATTEMPTS.get(self.id, 0) + 1
            raise e.staged(n) from None
        _ATTEMPTS.pop(self.id, None)

    def _check(self, answer: Any) -> None:
        __tracebackhide__ = True
        if answer is None:
            fail(f"you passed None: pass {self.what} itself (the name defined in the answer cell), not the result "
                 "of calling it.")
        engine, oracles = self.engine_objects(), self.oracle_objects()
        reject_delegation(answer, engine, oracles)
        try:
            obj = self._form(answer)
        except NotImplementedError:
            fail(NOT_IMPLEMENTED)
        watch = Watch([c for e in engine for c in _codes(e)], [c for o in oracles for c in _codes(o)],
                      _answer_codes(obj), self.what, method_calls=isinstance(obj, type))
        verdict = None
        with time_limit(self.time_limit * _time_scale()) as limit, watch:
            try:
                self._verify(obj)
            except GradingError as e:
                verdict = e
            except NotImplementedError:
                verdict = GradingError(NOT_IMPLEMENTED)
            except Delegated:
                if watch.seen is None:      # not the tracer's: the answer raised it itself, to end the check early
                    verdict = GradingError("your code raised Delegated, the grader's own signal to stop a check: "
                                           "an answer cannot end its check early.")
            except TimedOut as e:
                if e.limit is not limit:
                    raise
                verdict = self._timed_out(e, watch)
            except Exception as e:  # noqa: BLE001 — an error outside run_property: the learner's, or the grader's
                verdict = self._crashed(e, watch, obj)
        if watch.seen is not None:
            whose = "minillm's own implementation" if watch.seen_engine else "the grader's reference answer"
            fail(f"your {self.what} runs {whose} ({watch.seen.co_name} in {os.path.basename(watch.seen.co_filename)}) "
                 "instead of your code.", _DELEGATES)
        if verdict is not None:
            raise verdict
        note = copy_note(answer, fingerprints(engine))
        if note:
            print(note)

    def _timed_out(self, e: TimedOut, watch: Watch) -> GradingError:
        at = e.where or next((ask() for ask in reversed(REMOTE_WHERE)), "")
        where = f" (it was running your code, {at})" if at else ""
        call = f"; the call in progress: {watch.calls[-1]}" if watch.calls else ""
        return GradingError(
            f"timed out after {e.limit.seconds:g} s: the check of {self.id} ({self.what}) did not finish{where}{call}"
            " — an endless loop?", None,
            "look for a loop whose condition never changes (an index that is not advanced, a queue that never "
            "empties) or a recursion that never reaches its base case; a correct answer takes a few seconds here.")

    def _crashed(self, e: Exception, watch: Watch, obj: Any) -> GradingError:
        where = learner_location(e)
        if where or _raised_in_learner_code(e):
            return GradingError(_describe(e), watch.calls[-1] if watch.calls and not watch.method_calls else None)
        if isinstance(e, TypeError) and _names_the_answer(e, obj):     # the call itself failed: its parameters
            return GradingError(f"calling your {self.what} failed: {_clip(str(e), 200)} — its parameters are not the "
                                "ones the task states.", None, "compare the def line with the task's statement.")
        first = (str(e).strip().splitlines() or [""])[0]
        return GradingError(f"the checker of {self.id} itself failed ({type(e).__name__}: {_clip(first, 200)}), so "
                            "it cannot give a verdict: this is a bug in minillm's grader, please report it.")


_ATTEMPTS: dict[str, int] = {}       # task id -> its failed checks in a row, in this kernel session
# Under trusted grading the learner's code runs in a sandbox process: these say where it is (the innermost)
REMOTE_WHERE: list[Callable[[], str]] = []


def _names_the_answer(e: TypeError, obj: Any) -> bool:
    """A TypeError like "f() missing 1 required positional argument" whose f is the answer or one of its methods:
    the answer was called the way the task states and its signature did not take it."""
    names = {getattr(obj, "__name__", None)} | ({n for n in vars(obj) if callable(vars(obj)[n])}
                                                if isinstance(obj, type) else set())
    m = re.match(r"(?:\w+\.)?(\w+)\(\) (?:missing|got an unexpected|takes)", str(e))
    return bool(m) and m.group(1) in names - {None}


def _time_scale() -> float:
    """MINILLM_TIME_LIMIT_SCALE (default 1) multiplies every check's time limit: more on a slow machine, less in
    the tests of the limit itself."""
    __tracebackhide__ = True
    text = config.time_limit_scale()
    if not text:
        return 1.0
    try:
        scale = float(text)
    except ValueError:
        scale = float("nan")
    if not (0 < scale < float("inf")):
        fail(f"MINILLM_TIME_LIMIT_SCALE={text!r} is not a positive number: unset it, or set e.g. 2 to give every "
             "check twice as long.")
    return scale


def reset_attempts() -> None:
    """Forget every task's failures (the next failure gets the first hint again)."""
    _ATTEMPTS.clear()


def _answer_codes(obj: Any) -> list[types.CodeType]:
    """The code objects of the learner's own functions in an answer (whose calls the Watch records)."""
    return [f.__code__ for f in _functions(obj) if _is_learner_code(f.__code__, f.__globals__)]


def _raised_in_learner_code(exc: BaseException) -> bool:
    if getattr(exc, "remote_where", None) is not None:
        return True
    tb = exc.__traceback__
    while tb is not None:
        if _is_learner_code(tb.tb_frame.f_code, tb.tb_frame.f_globals):
            return True
        tb = tb.tb_next
    return False


def resolve(paths: Iterable[str]) -> list:
    """The minillm objects at "module:attr" paths (attr may be dotted), imported now."""
    found = []
    for path in paths:
        module, _, attr = path.partition(":")
        obj = importlib.import_module(module)
        for part in attr.split("."):
            obj = vars(obj)[part] if isinstance(obj, type) else getattr(obj, part)   # raw: no binding
        found.append(obj)
    return found


def minillm_objects(*paths: str) -> Callable[[], list]:
    """A Task's `engine`: the minillm objects at "module:attr" paths, imported when asked (`resolve`)."""
    return lambda: resolve(paths)


def function_answer(what: str) -> Callable[[Any], Any]:
    """A Task's `form` for tasks whose answer is a function."""
    def form(answer: Any) -> Any:
        __tracebackhide__ = True
        if not callable(answer) or isinstance(answer, type):
            fail(f"pass the function {what} itself (e.g. check({what})), got {_type_name(answer)}")
        return answer
    return form


def class_answer(what: str, methods: tuple[str, ...], base: type | None = None,
                 own: tuple[str, ...] = ()) -> Callable[[Any], type]:
    """A Task's `form` for tasks whose answer is a class: it has `methods`, subclasses `base` when given, and
    defines the methods in `own` itself (not inherited from minillm)."""
    def form(answer: Any) -> type:
        __tracebackhide__ = True
        cls = answer if isinstance(answer, type) else type(answer)
        if base is not None and not issubclass(cls, base):
            fail(f"pass your {what} class (a subclass of minillm's {base.__name__}), got {cls.__name__}",
                 f"class My{base.__name__}({base.__name__}): ... then check(My{base.__name__})")
        missing = [m for m in methods if not callable(getattr(cls, m, None))]
        check(not missing, f"your {what} class lacks {', '.join(missing)}",
              f"it needs {', '.join(methods)}.")
        for name in own:
            owner = next(k for k in cls.__mro__ if name in vars(k))
            if _is_minillm(owner.__module__):
                fail(f"{cls.__name__} does not define {name}: write it in the answer cell (as is, it inherits "
                     f"minillm's).")
        return cls
    return form
