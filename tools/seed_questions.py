"""List every question in the seed collections (../shared/seeds/) as (seed file, line, text, implied).

The five collections print their questions differently; one small reader per layout:
  000  "<question> easy|medium|hard" lines, each followed by its answer
  001  "QUESTION NN" then the question on the next line
  002  quoted "- “...”" questions and one system-design "Prompt:"
  003  answer blocks only (answer, why, mistake, "Source / Inspiration"): the question is implied
  004  "- Title: prompt" system-design prompts
Used by tests/test_questions.py to prove questions/sources.yaml covers them all.
Run it to print the list: python tools/seed_questions.py [SEED_DIR]
"""
from __future__ import annotations

import os
import re
import sys
from pathlib import Path
from typing import NamedTuple


class SeedQuestion(NamedTuple):
    seed: str
    line: int      # 1-based
    text: str
    implied: bool


def default_seed_dir() -> Path:
    env = os.environ.get("MINILLM_SEEDS")
    return Path(env) if env else Path(__file__).resolve().parents[2] / "shared" / "seeds"


def _questions(name: str, lines: list[str]) -> list[tuple[int, str, bool]]:
    kind = name[:3]
    out: list[tuple[int, str, bool]] = []
    if kind == "000":
        out = [(i, m.group(1), False) for i, l in enumerate(lines, 1)
               if (m := re.match(r"(.*[?.])\s+(easy|medium|hard)$", l))]
    elif kind == "001":
        out = [(i + 1, lines[i], False) for i, l in enumerate(lines, 1) if l.startswith("QUESTION")]
    elif kind == "002":
        out = [(i, re.sub(r"^(- |Prompt: )", "", l).strip("“”"), False) for i, l in enumerate(lines, 1)
               if l.startswith("- “") or l.startswith("Prompt:")]
    elif kind == "003":
        start = None
        for i, l in enumerate(lines, 1):
            if i < 14:  # the page's preamble
                continue
            if start is None:
                start = i
            if l.startswith("Source / Inspiration") or l.startswith("Before an interview"):
                if not l.startswith("Source") and start == i:
                    break
                out.append((start, lines[start - 1], True))
                start = None
    elif kind == "004":
        out = [(i, l[2:], False) for i, l in enumerate(lines, 1) if l.startswith("- ")]
    else:
        raise ValueError(f"no reader for seed file {name}")
    return out


def seed_questions(seed_dir: Path | None = None) -> list[SeedQuestion]:
    seed_dir = seed_dir or default_seed_dir()
    result = []
    for path in sorted(seed_dir.glob("*.txt")):
        lines = path.read_text(encoding="utf-8").splitlines()
        result += [SeedQuestion(path.name, i, t, imp) for i, t, imp in _questions(path.name, lines)]
    return result


if __name__ == "__main__":
    qs = seed_questions(Path(sys.argv[1]) if len(sys.argv) > 1 else None)
    for q in qs:
        print(f"{q.seed}:{q.line}{' (implied)' if q.implied else ''}  {q.text[:100]}")
    print(f"{len(qs)} questions")
