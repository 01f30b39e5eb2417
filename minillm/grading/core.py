"""The checker framework every lab's grader is built from.

A lab task is a `Task`: `task.check(answer)` grades a learner's answer, `task.verify(obj)` runs the same property
suite without the integrity checks (tests/ run it on minillm's own implementation: one suite, graded both ways).
`check` does, in order:

1. `verify_untampered()`: the grading code is as it was imported (no patched function, class or namespace).
2. `task.form(answer)`: the answer has the right shape (a function, a class with these methods, ...).
3. `reject_delegation`: the answer is not minillm's own implementation of the piece, nor the grader's oracle,
   under any alias (partial, partialmethod, bound method, staticmethod, `__wrapped__`, a subclass that does not
   override), nor a copy of its code (same bytecode, locals renamed).
4. `task.verify(answer)` under a `Watch`: the properties, while a tracer notes if minillm's implementation of the
   piece runs at all, or the grader's oracle runs under the learner's code (a wrapper, a subclass calling super(),
   a composition that forwards). Either one fails the check, whatever the properties said.
A failure raises one GradingError (an AssertionError: nbgrader and pytest count it as a failed test) that reads like
feedback: what went wrong, the smallest failing example hypothesis found, a hint.

Integrity: what an answer cell may do and still not change a verdict
  - rebind a checker's name: graded cells import their checker afresh;
  - patch a grading module (`g.run_property = ...`, `vars(g)[...] = ...`, `torch.allclose = ...`): grading modules
    are sealed (`seal`, the last line of each): setting or deleting their attributes raises, and every name
    imported from them comes from a private copy of the module executed at import time, whose functions see
    one-level snapshots of torch / math / numpy / hypothesis.strategies taken then; patching that private copy
    (function code, class attributes, its namespace) is detected by verify_untampered;
  - return objects that lie (an __eq__ that is always true, a tensor subclass with __torch_function__, a number
    whose __float__ peeks at the checker's frame): results are read with exact types (`as_int`, `as_tensor`, ...)
    before anything compares them, and references are computed from copies of the inputs after the learner's
    code has returned;
  - delegate to minillm's implementation: see 3 and 4 above.
  What an in-process checker cannot stop: replacing entries of sys.modules, patching builtins, or patching the
  classes of torch / hypothesis themselves. Only grading in a separate process closes those.
"""
from __future__ import annotations

import builtins
import dis
import functools
import inspect
import os
import re
import sys
import sysconfig
import tempfile
import types
from typing import Any, Callable, Iterable

# Hypothesis writes a `.hypothesis/` folder into the current directory (even with database=None): inside a
# notebook that is the lab folder. Point it at a temp dir unless the user chose one. Hypothesis reads this
# variable lazily, the first time it needs the directory.
os.environ.setdefault("HYPOTHESIS_STORAGE_DIRECTORY", os.path.join(tempfile.gettempdir(), "minillm-hypothesis"))

import torch  # noqa: E402
from hypothesis import HealthCheck, Phase, settings  # noqa: E402

__all__ = ["GradingError", "fail", "check", "as_int", "as_float", "as_ints", "as_tensor", "Task", "run_property",
           "diagnose", "reject_delegation", "Watch", "seal", "verify_untampered", "NOT_IMPLEMENTED",
           "minillm_objects", "function_answer", "class_answer", "Delegated", "is_library_file"]


class GradingError(AssertionError):
    """The verdict of a checker. An AssertionError so nbgrader (and pytest) count it as a failed test."""


def fail(message: str, hint: str | None = None) -> None:
    """Raise the checker's verdict (a readable message, then the hint). The one way a checker fails."""
    __tracebackhide__ = True
    raise GradingError(_compose(message, None, hint)) from None


def check(condition: bool, message: str, hint: str | None = None) -> None:
    """`assert` for checkers: a plain-language message instead of `assert x == y`."""
    __tracebackhide__ = True
    if not condition:
        fail(message, hint)


NOT_IMPLEMENTED = ("not implemented yet: the answer raised NotImplementedError. Replace `raise NotImplementedError()` "
                   "in the answer cell with your code, run that cell, then this one.")


# --------------------------------------------------------------------------- reading results with exact types

_INT_TYPES = (int,)
_FLOAT_TYPES = (float, int)
try:
    import numpy as _np
    _INT_TYPES += tuple(_np.sctypes["int"] + _np.sctypes["uint"]) if hasattr(_np, "sctypes") else \
        (_np.int8, _np.int16, _np.int32, _np.int64, _np.uint8, _np.uint16, _np.uint32, _np.uint64)
    _FLOAT_TYPES += _INT_TYPES[1:] + (_np.float16, _np.float32, _np.float64)
except ImportError:  # pragma: no cover
    pass


def as_int(x: Any, what: str) -> int:
    """x as a plain int, if its type is exactly int or a numpy integer (no bool, no subclass that could lie)."""
    __tracebackhide__ = True
    if type(x) not in _INT_TYPES:
        fail(f"{what} must be an int, got {_type_name(x)}")
    return int(x)


def as_float(x: Any, what: str) -> float:
    """x as a plain float, if its type is exactly float / int or a numpy scalar of those kinds."""
    __tracebackhide__ = True
    if type(x) not in _FLOAT_TYPES:
        fail(f"{what} must be a number (int or float), got {_type_name(x)}")
    return float(x)


def as_ints(x: Any, what: str) -> list[int]:
    """A list or tuple of ints, as a plain list."""
    __tracebackhide__ = True
    if type(x) not in (list, tuple):
        fail(f"{what} must be a list of ints, got {_type_name(x)}")
    return [as_int(v, f"every element of {what}") for v in x]


def as_tensor(x: Any, what: str) -> torch.Tensor:
    """A detached copy of x if it is exactly a torch.Tensor (a subclass could override comparisons)."""
    __tracebackhide__ = True
    if type(x) is not torch.Tensor:
        fail(f"{what} must be a torch.Tensor, got {_type_name(x)}")
    return x.detach().clone()


def _type_name(x: Any) -> str:
    t = type(x)
    return f"a {t.__module__}.{t.__qualname__}" if t.__module__ not in ("builtins",) else f"a {t.__qualname__} ({x!r:.60})"


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


# Below these sizes two honest answers can coincide (a one-line formula): a copy with renamed variables must be
# longer than COPY_MIN_INSTRUCTIONS, a verbatim copy (the same variable names too) longer than VERBATIM_MIN.
COPY_MIN_INSTRUCTIONS = 30
VERBATIM_MIN_INSTRUCTIONS = 12


def _copied(answer_codes: list, reference_codes: list) -> bool:
    for names, least in ((False, COPY_MIN_INSTRUCTIONS), (True, VERBATIM_MIN_INSTRUCTIONS)):
        refs = {_fingerprint(c, names) for c in reference_codes}
        matched = [fp for fp in (_fingerprint(c, names) for c in answer_codes) if fp in refs]
        if sum(_size(fp) for fp in matched) >= least:
            return True
    return False


def _qualname(obj: Any) -> str:
    mod = getattr(obj, "__module__", None) or "?"
    name = getattr(obj, "__qualname__", None) or getattr(obj, "__name__", None) or type(obj).__name__
    return f"{mod}.{name}"


def _is_minillm(module: str | None) -> bool:
    return bool(module) and (module == "minillm" or module.startswith("minillm."))


_DELEGATES = ("define it in the answer cell with your own code, instead of calling, subclassing or copying "
              "minillm's implementation.")


def reject_delegation(answer: Any, engine: Iterable[Any], oracles: Iterable[Any] = ()) -> None:
    """Fail when `answer` IS minillm's implementation of the piece (`engine`) or the grader's reference (`oracles`):
    the object under another name, an object defined inside the minillm package, or a copy of their code."""
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
    own = [f.__code__ for f in _functions(owner) if _is_learner_code(f.__code__, f.__globals__)]
    if own and _copied(own, [c for r in engine + oracles for c in _codes(r)]):
        fail("your answer is a copy of minillm's own implementation (the same code, maybe with other names).",
             _DELEGATES)


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
    check there (an answer that catches the stop still fails: `seen` is recorded first)."""

    def __init__(self, engine_codes: Iterable[types.CodeType], oracle_codes: Iterable[types.CodeType] = ()) -> None:
        self.engine, self.oracles = frozenset(engine_codes), frozenset(oracle_codes)
        self.seen: types.CodeType | None = None
        self.seen_engine = False

    def __enter__(self) -> "Watch":
        self.entry = sys._getframe(1)
        self.previous = sys.gettrace()
        sys.settrace(self._trace)
        return self

    def __exit__(self, *exc) -> bool:
        sys.settrace(self.previous)
        return False

    def _trace(self, frame, event, arg):
        code = frame.f_code
        if self.seen is None and (code in self.engine or (code in self.oracles and self._under_learner(frame))):
            self.seen, self.seen_engine = code, code in self.engine
            raise Delegated()
        return self.previous(frame, event, arg) if self.previous is not None else None

    def _under_learner(self, frame) -> bool:
        f = frame.f_back
        while f is not None and f is not self.entry:
            if _is_learner_code(f.f_code, f.f_globals):
                return True
            f = f.f_back
        return False


# --------------------------------------------------------------------------- running a property

_NOTE_RE = re.compile(r"^(Falsifying|Failing)( explicit)? (example|test case): \w+\(\s*(?P<args>.*)\)\s*$", re.S)


def _format_example(notes: list[str]) -> str | None:
    for note in notes:
        m = _NOTE_RE.match(note.strip())
        if m:
            args = [a.strip().rstrip(",") for a in m.group("args").splitlines()]
            return ", ".join(a for a in args if a)
    return None


def _compose(message: str, example: str | None, hint: str | None) -> str:
    parts = [message.strip()]
    if example:
        parts.append(f"Smallest failing example: {example}")
    if hint:
        parts.append(f"Hint: {hint.strip()}")
    return "\n".join(parts)


def _describe(exc: BaseException) -> str:
    if isinstance(exc, NotImplementedError) or _caused_by_not_implemented(exc):
        return NOT_IMPLEMENTED
    if isinstance(exc, AssertionError):
        text = str(exc).strip()
        return text or "a property did not hold"
    text = str(exc).strip().splitlines()
    first = text[0] if text else ""
    return f"your code raised {type(exc).__name__}: {first}" if first else f"your code raised {type(exc).__name__}"


def _caused_by_not_implemented(exc: BaseException) -> bool:
    seen = exc.__cause__ or exc.__context__
    while seen is not None:
        if isinstance(seen, NotImplementedError):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def run_property(test_fn: Callable[[], None], *, max_examples: int = 50, hint: str | None = None) -> None:
    """Run a hypothesis `@given` test with grading settings; on failure raise one readable GradingError.

    Settings: no deadline, derandomized (same examples on every run), no example database, bounded examples,
    slow-data health checks off. Explicit `@example`s run first, so hand-picked edge cases always run."""
    __tracebackhide__ = True
    configured = settings(
        deadline=None, derandomize=True, database=None, max_examples=max_examples, print_blob=False,
        report_multiple_bugs=False,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much,
                               HealthCheck.large_base_example],
        phases=[Phase.explicit, Phase.generate, Phase.shrink],
    )(test_fn)
    try:
        configured()
    except (KeyboardInterrupt, SystemExit, Delegated):
        raise
    except BaseException as exc:  # noqa: BLE001 — the learner's code may raise anything
        example = _format_example(list(getattr(exc, "__notes__", []) or []))
        described = _describe(exc)
        raise GradingError(_compose(described, None if described == NOT_IMPLEMENTED else example,
                                    None if described == NOT_IMPLEMENTED else hint)) from None


def diagnose(fn: Callable[..., Any], variants: list[tuple[str, Callable[..., Any]]], probes: list[tuple],
             same: Callable[[Any, Any], bool]) -> str | None:
    """Name the known mistake the learner made: the first `(why, wrong_fn)` of `variants` that agrees with
    `fn` on every argument tuple in `probes`. None when no variant explains `fn`'s answers."""
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


# --------------------------------------------------------------------------- the task

class Task:
    """One graded task: `check` for learners, `verify` for tests (see the module docstring).

    what:    how feedback names the piece, e.g. "slot_mapping"
    verify:  object -> None, the property suite (raises GradingError)
    engine:  zero-argument callable -> minillm's implementations of the piece (functions / classes / methods)
    oracles: zero-argument callable -> the grader's references for it (allowed for the checker, not the answer)
    kind:    the answer's shape: "function"; "class" (with `methods`); "methods" (a subclass of `base` that
             defines `methods` itself, e.g. a Scheduler subclass with its own schedule_running)
    form:    answer -> the object to verify, checking its shape (default: from kind)
    """

    def __init__(self, task_id: str, *, what: str, verify: Callable[[Any], None],
                 engine: Callable[[], list], oracles: Callable[[], list] = list, kind: str = "function",
                 base: type | None = None, methods: tuple[str, ...] = (),
                 form: Callable[[Any], Any] | None = None) -> None:
        if kind not in ("function", "class", "methods"):
            raise ValueError(f"unknown answer kind {kind!r}")
        self.id, self.what, self.kind, self.base, self.methods = task_id, what, kind, base, methods
        self._verify, self._engine, self._oracles = verify, engine, oracles
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
        __tracebackhide__ = True
        verify_untampered()
        if answer is None:
            fail(f"you passed None: pass {self.what} itself (the name defined in the answer cell), not the result "
                 "of calling it.")
        engine, oracles = self.engine_objects(), self.oracle_objects()
        reject_delegation(answer, engine, oracles)
        try:
            obj = self._form(answer)
        except NotImplementedError:
            fail(NOT_IMPLEMENTED)
        watch = Watch([c for e in engine for c in _codes(e)], [c for o in oracles for c in _codes(o)])
        verdict = None
        with watch:
            try:
                self._verify(obj)
            except GradingError as e:
                verdict = e
            except NotImplementedError:
                verdict = GradingError(NOT_IMPLEMENTED)
            except Delegated:
                pass
        if watch.seen is not None:
            whose = "minillm's own implementation" if watch.seen_engine else "the grader's reference answer"
            fail(f"your {self.what} runs {whose} ({watch.seen.co_name} in {os.path.basename(watch.seen.co_filename)}) "
                 "instead of your code.", _DELEGATES)
        if verdict is not None:
            raise verdict


def minillm_objects(*paths: str) -> Callable[[], list]:
    """A Task's `engine`: the minillm objects at "module:attr" paths (attr may be dotted), imported when asked."""
    def objects() -> list:
        import importlib
        found = []
        for path in paths:
            module, _, attr = path.partition(":")
            obj = importlib.import_module(module)
            for part in attr.split("."):
                obj = vars(obj)[part] if isinstance(obj, type) else getattr(obj, part)   # raw: no binding
            found.append(obj)
        return found
    return objects


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


# --------------------------------------------------------------------------- sealing grading modules

_FROZEN_MODULES = frozenset({"torch", "math", "numpy", "hypothesis.strategies", "functools", "os", "sys"})
_SEALED: dict[str, "_Record"] = {}


class _Record:
    def __init__(self, module: types.ModuleType, private: dict) -> None:
        self.module, self.private = module, private
        self.names = dict(private)
        self.functions = {}
        self.classes = {}
        for name, v in private.items():
            if inspect.isfunction(v) and (v.__globals__ is private or _is_minillm(v.__module__)):
                self.functions[name] = (v, v.__code__, v.__defaults__, v.__kwdefaults__)
            elif isinstance(v, type) and v.__module__ == private["__name__"]:
                self.classes[name] = (v, dict(vars(v)))

    def tampered(self) -> str | None:
        if type(self.module) is not _SealedModule:
            return "the module was unsealed"
        if self.private.keys() != self.names.keys() or any(self.private[k] is not v for k, v in self.names.items()):
            return "a name of its private namespace was rebound"
        for name, (f, code, defaults, kwdefaults) in self.functions.items():
            if f.__code__ is not code or f.__defaults__ is not defaults or f.__kwdefaults__ is not kwdefaults:
                return f"function {name} was modified"
        for name, (cls, members) in self.classes.items():
            now = vars(cls)
            if now.keys() != members.keys() or any(now[k] is not v for k, v in members.items()):
                return f"class {name} was modified"
        return None


class _SealedModule(types.ModuleType):
    """A grading module after seal(): attributes come from its private copy and cannot be set or deleted."""

    def __getattribute__(self, name: str) -> Any:
        if not name.startswith("__"):
            record = _SEALED.get(types.ModuleType.__getattribute__(self, "__name__"))
            if record is not None and name in record.private:
                verify_untampered()     # a graded cell's import checks the grading code before it gets a checker
                return record.private[name]
        return types.ModuleType.__getattribute__(self, name)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"{self.__name__} is sealed: grading code cannot be patched from a notebook "
                             "(restart the kernel to undo other changes)")

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"{self.__name__} is sealed: grading code cannot be patched from a notebook")


class _ModuleSnapshot(types.SimpleNamespace):
    """A module's attributes as they were when a grading module was sealed."""


def seal(namespace: dict) -> None:
    """Seal the grading module whose globals these are (call it as the module's last line: `seal(globals())`).

    The module's source is executed once more into a private namespace whose module references (torch, math,
    ...) are snapshots taken now; the module then serves every attribute from that copy and refuses changes."""
    if namespace.get("__minillm_private__"):
        return
    name = namespace["__name__"]
    module = sys.modules[name]
    private: dict = {"__name__": name, "__file__": namespace["__file__"], "__package__": namespace.get("__package__"),
                     "__spec__": namespace.get("__spec__"), "__loader__": namespace.get("__loader__"),
                     "__builtins__": builtins, "__minillm_private__": True}
    with open(namespace["__file__"], encoding="utf-8") as f:
        exec(compile(f.read(), namespace["__file__"], "exec"), private)
    for key, value in list(private.items()):
        if isinstance(value, types.ModuleType) and value.__name__ in _FROZEN_MODULES:
            private[key] = _ModuleSnapshot(**{k: v for k, v in vars(value).items() if not k.startswith("__")})
    # the first module sealed is this one: its private copy's registry and module class serve everyone after
    home = private if name == __name__ else globals()
    home["_SEALED"][name] = home["_Record"](module, private)
    module.__class__ = home["_SealedModule"]


def verify_untampered() -> None:
    """Fail when sealed grading code was patched after it was imported."""
    __tracebackhide__ = True
    for name, record in _SEALED.items():
        what = record.tampered()
        if what is not None:
            fail(f"the grading code was modified after it was imported ({name}: {what}), so this check cannot "
                 "give a verdict.", "restart the kernel and run the notebook from the top without patching minillm.")


seal(globals())
