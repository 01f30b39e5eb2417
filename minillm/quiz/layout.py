"""Wrap the quiz's text to the terminal: break only at spaces, never inside a dotted name
(minillm.kv.sizing.kv_cache_bytes), a --flag-with-hyphens or a `command in backticks`; bullets hang.

textwrap does the filling; two settings and one substitution make it safe for code: break_on_hyphens=False
and break_long_words=False keep every space-free token whole (a token longer than the line overflows rather
than splits), and the spaces inside backticks become a placeholder textwrap does not break at.
"""
from __future__ import annotations

import re
import shutil
import textwrap

from minillm.quiz.markup import split_fences

MIN_WIDTH, MAX_WIDTH = 40, 100     # below 40 nothing reads well; beyond 100 lines are too long to read
_KEEP = "\x00"                     # stands for a space inside backticks while textwrap runs
_BACKTICKS = re.compile(r"`[^`\n]*`")


def terminal_width() -> int:
    """Columns to fill: the terminal's (or $COLUMNS) less one, clamped to MIN_WIDTH..MAX_WIDTH; 88 when neither
    is known (a pipe)."""
    return min(MAX_WIDTH, max(MIN_WIDTH, shutil.get_terminal_size((89, 24)).columns - 1))


def wrap(text: str, width: int, indent: str = "", hanging: str | None = None) -> list[str]:
    """`text` (whitespace collapsed) filled to `width` columns: the first line starts with `indent`, the others
    with `hanging` (default: `indent`). A fenced code block keeps its lines as written, 4 columns further in."""
    hang = indent if hanging is None else hanging
    lines: list[str] = []
    for code, chunk in split_fences(text):
        first = indent if not lines else hang
        if code:
            lines += [(first if i == 0 else hang) + "    " + l for i, l in enumerate(chunk.split("\n"))]
            continue
        flat = _BACKTICKS.sub(lambda m: m.group(0).replace(" ", _KEEP), " ".join(chunk.split()))
        lines += [l.replace(_KEEP, " ") for l in textwrap.wrap(flat, width, initial_indent=first,
                                                                 subsequent_indent=hang, break_long_words=False,
                                                                 break_on_hyphens=False)]
    return lines or [indent.rstrip()]


def bullet(marker: str, text: str, width: int, indent: str = "  ") -> list[str]:
    """'  - text ...' with the continuation lines under the text, not under the marker."""
    return wrap(text, width, indent + marker + " ", " " * (len(indent) + len(marker) + 1))


def labelled(label: str, text: str, width: int, indent: str = "") -> list[str]:
    """'Common mistake: text ...' with continuation lines at `indent` + two spaces; the label stays on line 1."""
    return wrap(label + " " + text, width, indent, indent + "  ")
