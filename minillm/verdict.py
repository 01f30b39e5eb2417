"""The verdict of a check, and results read with exact types.

Shared by the fixtures in minillm.testing and the graders in minillm.grading (which sit above both): a failed check
is one GradingError (an AssertionError: nbgrader and pytest count it as a failed test) built by `fail` / `check`,
with a Hint staged so it nudges before it solves; results are read with `as_int` / `as_float` / `as_ints` /
`as_tensor` before anything compares them (a subclass that lies about equality never reaches a comparison).
These checks are honest learners' feedback in the notebook; the verdict is minillm.grading.trusted's, where the
learner's code runs in a sandbox process and nothing a notebook patches reaches the checker.
"""
from __future__ import annotations

from typing import Any

import torch


class Hint:
    """A hint given in stages, so that it nudges before it solves (see "Feedback" in the module docstring).

    nudge: the first failure: the concept and where to look, never the formula;
    more:  added from the second failure of the task on: a fuller explanation;
    show:  added from the third on, on a line of its own ("Show me: ..."): the formula or the code's shape."""

    __slots__ = ("nudge", "more", "show")

    def __init__(self, nudge: str, more: str | None = None, show: str | None = None) -> None:
        self.nudge, self.more, self.show = nudge.strip(), (more or "").strip() or None, (show or "").strip() or None

    def stages(self) -> int:
        return 3 if self.show else 2 if self.more else 1

    def lines(self, stage: int) -> list[str]:
        """The hint as shown on the `stage`-th failure in a row (1, 2, 3, ...)."""
        n = self.stages()
        label = f"Hint ({min(stage, n)}/{n})" if n > 1 and stage < n else "Hint"
        text = self.nudge + (f" {self.more}" if self.more and stage >= 2 else "")
        return [f"{label}: {text}"] + ([f"Show me: {self.show}"] if self.show and stage >= 3 else [])


def _hint_lines(hint: "Hint | str | None", stage: int) -> list[str]:
    if hint is None:
        return []
    if isinstance(hint, Hint):
        return hint.lines(stage)
    return [f"Hint: {str(hint).strip()}"]          # a plain string: the same on every failure


class GradingError(AssertionError):
    """The verdict of a checker. An AssertionError so nbgrader (and pytest) count it as a failed test.

    It keeps its parts (`message`, `example`, `hint`) so that `Task.check` can show the hint at the stage the
    learner has reached (`stage`: this task's failures in a row in the kernel session). In a notebook it renders
    as the verdict alone, without a traceback (`_render_traceback_`, which IPython calls instead of formatting
    one): no frame of the grader, no install path above the message."""

    def __init__(self, message: str, example: str | None = None, hint: "Hint | str | None" = None,
                 stage: int = 1) -> None:
        self.message, self.example, self.hint, self.stage = str(message).strip(), example, hint, stage
        super().__init__(_compose(self.message, example, hint, stage))

    def staged(self, stage: int) -> "GradingError":
        """The same verdict with the hint of the `stage`-th failure."""
        return GradingError(self.message, self.example, self.hint, stage)

    def __reduce__(self):
        return GradingError, (self.message, self.example, self.hint, self.stage)

    def _render_traceback_(self) -> list[str]:
        lines = str(self).splitlines() or [""]
        return [f"\x1b[31m{type(self).__name__}\x1b[0m: {lines[0]}"] + lines[1:]


def fail(message: str, hint: "Hint | str | None" = None, *, example: str | None = None) -> None:
    """Raise the checker's verdict (a readable message, the failing case, a hint). The one way a checker fails."""
    __tracebackhide__ = True
    raise GradingError(message, example, hint) from None


def check(condition: bool, message: str, hint: "Hint | str | None" = None) -> None:
    """`assert` for checkers: a plain-language message instead of `assert x == y`."""
    __tracebackhide__ = True
    if not condition:
        fail(message, hint)


NOT_IMPLEMENTED = ("not implemented yet: the answer raised NotImplementedError. Replace `raise NotImplementedError()` "
                   "in the answer cell with your code, run that cell, then this one.")


def _compose(message: str, example: str | None, hint: "Hint | str | None", stage: int = 1) -> str:
    parts = [message.strip()]
    if example and not message.startswith(NOT_IMPLEMENTED[:20]):
        parts.append(f"Smallest failing example: {example}")
    if not message.startswith(NOT_IMPLEMENTED[:20]):
        parts += _hint_lines(hint, stage)
    return "\n".join(parts)




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
        fail(f"{what} must be an int, got {type_name(x)}")
    return int(x)


def as_float(x: Any, what: str) -> float:
    """x as a plain float, if its type is exactly float / int or a numpy scalar of those kinds."""
    __tracebackhide__ = True
    if type(x) not in _FLOAT_TYPES:
        fail(f"{what} must be a number (int or float), got {type_name(x)}")
    return float(x)


def as_ints(x: Any, what: str) -> list[int]:
    """A list or tuple of ints, as a plain list."""
    __tracebackhide__ = True
    if type(x) not in (list, tuple):
        fail(f"{what} must be a list of ints, got {type_name(x)}")
    return [as_int(v, f"every element of {what}") for v in x]


def as_tensor(x: Any, what: str) -> torch.Tensor:
    """A detached copy of x if it is exactly a torch.Tensor (a subclass could override comparisons)."""
    __tracebackhide__ = True
    if type(x) is not torch.Tensor:
        fail(f"{what} must be a torch.Tensor, got {type_name(x)}")
    return x.detach().clone()


def type_name(x: Any) -> str:
    t = type(x)
    return f"a {t.__module__}.{t.__qualname__}" if t.__module__ not in ("builtins",) else f"a {t.__qualname__} ({x!r:.60})"


def is_minillm(module: str | None) -> bool:
    return bool(module) and (module == "minillm" or module.startswith("minillm."))
