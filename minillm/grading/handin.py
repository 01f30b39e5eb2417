"""Handing answers in: what runs in the learner's kernel under trusted grading (minillm.grading.trusted).

Each graded cell `from minillm.grading.labNN import check_labNN_K; check_labNN_K(<answer>)` is replaced, for the
trusted run, by `extraction_cell(...)`: `emit` pickles the answer by value (cloudpickle: a notebook's functions and
classes travel with their code, a helper module of the learner's too) with a Triton kernel's source, and prints the
bytes; `payloads` reads them back from the executed cell. Nothing else of the kernel is used, and the bytes are
only ever unpickled in a sandbox.
"""
from __future__ import annotations

import ast
import base64
import inspect
import re
import sys
from typing import Any, Callable

from minillm.grading.core import is_library_file

MARK = "minillm-answer:"
_CALL = re.compile(r"^\s*from\s+(minillm\.grading\.lab\d\d)\s+import\s+(check_lab\d\d_\d+)\s*;\s*\2\((.*)\)\s*$", re.S)

def graded_call(source: str) -> tuple[str, str, str] | None:
    """(module, task id, answer expression) of a graded cell's one-line checker call, or None."""
    m = _CALL.match(source.strip())
    if m is None:
        return None
    try:
        ast.parse(m.group(3), mode="eval")
    except SyntaxError:
        return None
    return m.group(1), m.group(2).removeprefix("check_"), m.group(3).strip()


def emit(task_id: str, get: Callable[[], Any]) -> None:
    """Run in the learner's kernel in place of a graded cell: print the answer, pickled by value."""
    import cloudpickle
    value = get()
    modules = {getattr(f, "__module__", None) for f in _defined(value)}
    mine = [sys.modules[m] for m in modules if m and m in sys.modules and m != "__main__" and _own_module(m)]
    for module in mine:
        cloudpickle.register_pickle_by_value(module)
    try:
        data = cloudpickle.dumps((ENVELOPE, value, _kernel_text(value)))
    finally:
        for module in mine:
            cloudpickle.unregister_pickle_by_value(module)
    if len(data) > MAX_ANSWER_BYTES:
        raise ValueError(f"your answer takes {len(data) / 2**20:.0f} MiB to hand in: it carries notebook state with "
                         "it (a global it reads, such as a model or a big tensor, travels by value). Keep the answer "
                         "to code and small constants: pass large things in as arguments.")
    print(f"{MARK}{task_id}:{base64.b64encode(data).decode()}")


ENVELOPE = "minillm-answer/1"
MAX_ANSWER_BYTES = 64 * 2**20      # code and constants are kilobytes; past this, a model came along


def _kernel_text(value: Any) -> str | None:
    """A Triton kernel's source, taken where it was defined (the kernel's linecache has the cell's lines; a
    process that unpickles the kernel does not)."""
    fn = getattr(value, "fn", None)
    if not inspect.isfunction(fn):
        return None
    try:
        from minillm.kernels.triton_paged_attention import kernel_source
        return kernel_source(fn)
    except Exception:  # noqa: BLE001 — the checker says the source could not be read
        return None


def _defined(value: Any) -> list:
    value = inspect.unwrap(value) if callable(value) and not isinstance(value, type) else value
    value = getattr(value, "fn", value)
    if isinstance(value, type):
        return [k for k in value.__mro__ if k is not object]
    return [value]


def _own_module(name: str) -> bool:
    """A module of the learner's (a helper .py beside the notebook), not minillm's nor an installed library's."""
    path = getattr(sys.modules[name], "__file__", None)
    return bool(path) and not is_library_file(path)


def extraction_cell(source: str) -> str | None:
    call = graded_call(source)
    if call is None:
        return None
    _, task_id, expr = call
    return f"__import__('minillm.grading.handin', fromlist=['emit']).emit({task_id!r}, lambda: ({expr}))"


def payloads(cells: list) -> dict[str, bytes]:
    """task id -> the pickled answer printed by an executed extraction cell."""
    found = {}
    for cell in cells:
        for out in cell.get("outputs", []):
            text = out.get("text", "") if out.get("output_type") == "stream" else ""
            for line in text.splitlines():
                if line.startswith(MARK):
                    task_id, _, data = line[len(MARK):].partition(":")
                    try:
                        found[task_id] = base64.b64decode(data)
                    except ValueError:
                        pass
    return found
