"""One key press from a terminal, without waiting for Enter: the quiz's rating prompt.

The terminal goes into cbreak mode (no line buffering, no echo; Ctrl-C still raises KeyboardInterrupt) only
while a key is read, and its settings are restored in a `finally`, so every way out (a key, Ctrl-C, Ctrl-D,
an exception) leaves it as it was. Without termios (Windows) or on a non-terminal, `KeyReader.for_stream`
returns None and the caller reads lines instead.
"""
from __future__ import annotations

import importlib.util
import os
import select
import time
from typing import TextIO

GRACE_S = 0.3      # an Enter typed right after the key ("g⏎", the line-mode habit) is swallowed within this
EOF_KEY, INTERRUPT_KEY = "\x04", "\x03"


class KeyReader:
    def __init__(self, fd: int):
        self.fd = fd

    @classmethod
    def for_stream(cls, stream: TextIO) -> "KeyReader | None":
        """A reader for `stream` when it is a terminal and termios exists, else None."""
        if importlib.util.find_spec("termios") is None:     # POSIX only
            return None
        try:
            fd = stream.fileno()
        except (AttributeError, OSError, ValueError):
            return None
        return cls(fd) if os.isatty(fd) else None

    def read(self) -> str:
        """The next key as text ('g', '\\r', '\\x1b[A' for an arrow key); '' when the terminal is gone.
        The rest of a line typed together with the key ("good⏎") is consumed, so it cannot leak into the next
        prompt; Ctrl-C raises KeyboardInterrupt with the terminal already restored."""
        import termios
        import tty
        saved = termios.tcgetattr(self.fd)
        try:
            tty.setcbreak(self.fd, termios.TCSANOW)   # TCSANOW: keep keys typed ahead of the prompt
            data = os.read(self.fd, 32)
            if data and data not in (b"\r", b"\n") and not data.endswith((b"\r", b"\n")):
                self._swallow_rest_of_line()
        finally:
            termios.tcsetattr(self.fd, termios.TCSADRAIN, saved)
        return data.decode("utf-8", "replace")

    def _swallow_rest_of_line(self) -> None:
        """Drop what arrives within GRACE_S up to and including an Enter; keys after that wait their turn."""
        deadline = time.monotonic() + GRACE_S
        while (left := deadline - time.monotonic()) > 0 and select.select([self.fd], [], [], left)[0]:
            chunk = os.read(self.fd, 1)
            if not chunk or chunk in (b"\r", b"\n"):
                return
