"""The checker framework every lab's grader is built from.

A checker (`check_labNN_K(obj)`) does three things:
1. `reject_reference(obj, ...)`: the learner must submit their own code, not minillm's (or the grader's) answer.
2. `run_property(test, ...)`: run a hypothesis `@given` property against `obj` — bounded, derandomized, no
   deadline — so a graded cell gives the same verdict every time and finishes in seconds.
3. On failure, raise one AssertionError that reads like feedback: what went wrong, the smallest failing
   example (hypothesis shrinks it), and a hint. No 200-line tracebacks: the frames of this module are hidden
   in IPython (`__tracebackhide__`) and the hypothesis machinery is cut off (`from None`).

The same properties run in tests/ against minillm's own implementation ("one suite, graded both ways").
"""
from __future__ import annotations

import functools
import inspect
import os
import re
import tempfile
from dataclasses import dataclass, field
from typing import Any, Callable

# Hypothesis writes a `.hypothesis/` folder into the current directory (even with database=None): inside a
# notebook that is the lab folder. Point it at a temp dir unless the user chose one. Hypothesis reads this
# variable lazily, the first time it needs the directory.
os.environ.setdefault("HYPOTHESIS_STORAGE_DIRECTORY", os.path.join(tempfile.gettempdir(), "minillm-hypothesis"))

from hypothesis import HealthCheck, Phase, settings  # noqa: E402

__all__ = ["run_property", "reject_reference", "diagnose", "check", "fail", "Scorecard", "GradingError"]


class GradingError(AssertionError):
    """The verdict of a checker. An AssertionError so nbgrader (and pytest) count it as a failed test."""


def fail(message: str, hint: str | None = None) -> None:
    """Raise the checker's verdict (a readable message, then the hint)."""
    __tracebackhide__ = True
    raise GradingError(_compose(message, None, hint)) from None


def check(condition: bool, message: str, hint: str | None = None) -> None:
    """`assert` for checkers: a plain-language message instead of `assert x == y`."""
    __tracebackhide__ = True
    if not condition:
        fail(message, hint)


# --------------------------------------------------------------------------- rejecting minillm's own code

def _unwrap(obj: Any) -> Any:
    """See through functools.partial (with no bound arguments), bound methods, staticmethod/classmethod and
    functools.wraps-style `__wrapped__` chains: those are the very object under another name."""
    seen = set()
    while id(obj) not in seen:
        seen.add(id(obj))
        if isinstance(obj, functools.partial) and not obj.args and not obj.keywords:
            obj = obj.func
        elif isinstance(obj, (staticmethod, classmethod)):
            obj = obj.__func__
        elif inspect.ismethod(obj):
            obj = obj.__func__
        elif getattr(obj, "__wrapped__", None) is not None and not isinstance(obj, type):
            obj = obj.__wrapped__
        else:
            break
    return obj


def _qualname(obj: Any) -> str:
    mod = getattr(obj, "__module__", None) or "?"
    name = getattr(obj, "__qualname__", None) or getattr(obj, "__name__", None) or type(obj).__name__
    return f"{mod}.{name}"


def _is_minillm_module(module: str | None) -> bool:
    return bool(module) and (module == "minillm" or module.startswith("minillm."))


def reject_reference(obj: Any, *reference_objects: Any) -> None:
    """Fail when `obj` IS minillm's own implementation.

    Rejected: one of `reference_objects` itself (or an alias: partial without arguments, bound method,
    `functools.wraps` chain), a function sharing a reference's code object (a copy made with
    `types.FunctionType(ref.__code__, ...)`), or any function/class defined inside the `minillm` package
    (its `__module__` starts with "minillm."), e.g. `from minillm.layers.attention import causal_attend`.

    Accepted: anything defined in the notebook (`__main__`) or another module of the learner's — including a
    thin wrapper that calls minillm inside. The rule targets handing in the answer key as is; a wrapper has to
    be written on purpose and is plainly visible in the answer cell.
    """
    __tracebackhide__ = True
    if obj is None:
        fail("you passed None: pass the function (or class) you wrote in the answer cell, e.g. check(my_fn), "
             "not check(my_fn()).")
    target = _unwrap(obj)
    refs = [_unwrap(r) for r in reference_objects]
    code = getattr(target, "__code__", None)
    hit = None
    for r in refs:
        if target is r or (code is not None and code is getattr(r, "__code__", None)):
            hit = r
            break
    if hit is None and not isinstance(target, type):
        # An instance of a minillm class counts as that class (e.g. an allocator object).
        cls = type(target)
        if not (inspect.isfunction(target) or inspect.isbuiltin(target)) and _is_minillm_module(cls.__module__):
            hit = cls
    if hit is None and _is_minillm_module(getattr(target, "__module__", None)):
        hit = target
    if hit is not None:
        fail(f"you submitted minillm's own implementation ({_qualname(hit)}). Write your own version in the "
             "answer cell: the point of the lab is to build the piece yourself.",
             "define the function (or class) in the answer cell instead of importing it from minillm.")


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
    if isinstance(exc, NotImplementedError):
        return ("not implemented yet: the function raised NotImplementedError. Replace `raise "
                "NotImplementedError()` in the answer cell with your code, run that cell, then this one.")
    if isinstance(exc, AssertionError):
        text = str(exc).strip()
        return text or "a property did not hold"
    text = str(exc).strip().splitlines()
    first = text[0] if text else ""
    return f"your code raised {type(exc).__name__}: {first}" if first else f"your code raised {type(exc).__name__}"


def run_property(test_fn: Callable[[], None], *, max_examples: int = 50, hint: str | None = None) -> None:
    """Run a hypothesis `@given` test with grading settings; on failure raise one readable AssertionError.

    Settings: no deadline, derandomized (same examples on every run), no example database, bounded examples,
    `too_slow` / `data_too_large` health checks off (tensor-building properties are slow by design).
    Explicit `@example`s on the test run first, so hand-picked edge cases (huge logits, a single token, ...)
    are always tried."""
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
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:  # noqa: BLE001 — the learner's code may raise anything
        example = _format_example(list(getattr(exc, "__notes__", []) or []))
        raise GradingError(_compose(_describe(exc), example, hint)) from None


# --------------------------------------------------------------------------- naming the mistake

def diagnose(fn: Callable[..., Any], variants: list[tuple[str, Callable[..., Any]]], probes: list[tuple],
             same: Callable[[Any, Any], bool]) -> str | None:
    """Name the known mistake the learner made: the first `(why, wrong_fn)` of `variants` that agrees with
    `fn` on every argument tuple in `probes` (use the failing example plus a few fixed probes chosen so the
    mistakes differ from each other). None when no variant explains `fn`'s answers."""
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


# --------------------------------------------------------------------------- optional: a scorecard

@dataclass
class Scorecard:
    """Collect (task, points, passed, message) rows and print them like `minillm grade` does."""
    rows: list[tuple[str, float, float, str]] = field(default_factory=list)

    def run(self, task_id: str, points: float, checker: Callable[..., None], *args: Any) -> bool:
        try:
            checker(*args)
        except AssertionError as e:
            self.rows.append((task_id, 0.0, points, str(e).splitlines()[0] if str(e) else "failed"))
            return False
        self.rows.append((task_id, points, points, ""))
        return True

    @property
    def score(self) -> tuple[float, float]:
        return sum(r[1] for r in self.rows), sum(r[2] for r in self.rows)

    def __str__(self) -> str:
        lines = [f"{t:<10} {got:g}/{pts:g}  {'pass' if got == pts else 'FAIL  ' + msg}"
                 for t, got, pts, msg in self.rows]
        got, total = self.score
        lines.append(f"score: {got:g}/{total:g}")
        return "\n".join(lines)
