"""Terminal styling that degrades to plain text: ANSI colours only on a TTY without NO_COLOR."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TextIO

from minillm import config

_CODES = {"bold": "1", "dim": "2", "green": "32", "red": "31", "yellow": "33", "cyan": "36"}


def wants_color(out: TextIO, no_color_flag: bool = False) -> bool:
    """https://no-color.org: any non-empty NO_COLOR disables colour; so does a pipe or --no-color."""
    if no_color_flag or config.no_color():
        return False
    isatty = getattr(out, "isatty", None)
    return bool(isatty and isatty())


def can_encode(out: TextIO, text: str) -> bool:
    """Whether the stream's encoding can write `text` (an ASCII-only terminal cannot write '·' or '→')."""
    try:
        text.encode(getattr(out, "encoding", None) or "utf-8")
        return True
    except (UnicodeEncodeError, LookupError):
        return False


@dataclass
class Style:
    color: bool = False
    unicode: bool = True

    @classmethod
    def for_stream(cls, out: TextIO, no_color_flag: bool = False) -> "Style":
        return cls(color=wants_color(out, no_color_flag), unicode=can_encode(out, "·→×"))

    def __call__(self, text: str, *styles: str) -> str:
        if not self.color or not styles:
            return text
        return "".join(f"\033[{_CODES[s]}m" for s in styles) + text + "\033[0m"

    @property
    def dot(self) -> str:
        return " · " if self.unicode else " - "

    @property
    def arrow(self) -> str:
        return "→" if self.unicode else "->"
