"""Where quiz progress lives: one JSON file per user, written atomically.

`$MINILLM_DATA_DIR/quiz.json`, else `$XDG_DATA_HOME/minillm/quiz.json`, else `~/.local/share/minillm/quiz.json`.
If that directory cannot be created or written, progress goes to a per-user file in the system temp
directory instead, with a warning: a read-only home must not cost the learner their session.
"""
from __future__ import annotations

import getpass
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import TextIO

from minillm import config
from minillm.quiz.schedule import Clock, Schedule, utc_now

FILE_NAME = "quiz.json"


def data_path() -> Path:
    return config.quiz_data_dir().expanduser() / FILE_NAME


def fallback_path() -> Path:
    try:
        user = getpass.getuser()
    except Exception:  # no user name (e.g. an arbitrary uid in a container): the uid still separates users
        user = str(os.getuid()) if hasattr(os, "getuid") else "user"
    return Path(tempfile.gettempdir()) / f"minillm-quiz-{user}.json"


def _writable_dir(d: Path) -> str | None:
    """None if we can create files in `d` (creating it if needed), else why not."""
    try:
        d.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=d, prefix=".probe-")
        os.close(fd)
        os.unlink(probe)
        return None
    except OSError as e:
        return e.strerror or str(e)


class ScheduleStore:
    """Load and save one Schedule; falls back to the temp file when the data directory is unwritable."""

    def __init__(self, path: Path | None = None, warn: TextIO | None = None):
        self.warn = warn if warn is not None else sys.stderr
        self.path = path or data_path()
        self._fell_back = False
        why = _writable_dir(self.path.parent)
        if why is not None:
            self._fall_back(why)

    def _fall_back(self, why: str) -> None:
        tmp = fallback_path()
        print(f"warning: cannot write quiz progress to {self.path.parent} ({why}); saving to {tmp} instead. "
              "Set MINILLM_DATA_DIR to a writable directory to keep it.", file=self.warn)
        self.path = tmp
        self._fell_back = True

    def load(self, clock: Clock = utc_now) -> Schedule:
        if not self.path.is_file():
            return Schedule.empty(clock)
        try:
            return Schedule.from_dict(json.loads(self.path.read_text(encoding="utf-8")), clock)
        except (ValueError, TypeError, OSError) as e:
            # Keep the damaged file for inspection and start afresh rather than refusing to quiz.
            backup = self.path.with_name(self.path.name + ".corrupt")
            try:
                os.replace(self.path, backup)
                kept = f"; the old file is kept as {backup}"
            except OSError:
                kept = ""
            print(f"warning: cannot read quiz progress {self.path} ({e}); starting a fresh schedule{kept}",
                  file=self.warn)
            return Schedule.empty(clock)

    def save(self, schedule: Schedule) -> Path:
        """Write via a temp file + rename, so an interrupted save leaves the previous file intact."""
        data = json.dumps(schedule.to_dict(), indent=1, sort_keys=True)
        try:
            self._write(data)
        except OSError as e:
            if self._fell_back:
                raise
            self._fall_back(e.strerror or str(e))
            self._write(data)
        return self.path

    def _write(self, data: str) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=f".{self.path.name}.")
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(data)
            os.replace(tmp, self.path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise


def reset() -> list[Path]:
    """Delete the progress file (and the temp fallback); returns the files removed."""
    removed = []
    for p in (data_path(), fallback_path()):
        try:
            p.unlink()
            removed.append(p)
        except FileNotFoundError:
            pass
        except OSError as e:
            raise OSError(f"cannot delete quiz progress {p}: {e.strerror or e}; delete it by hand") from None
    return removed
