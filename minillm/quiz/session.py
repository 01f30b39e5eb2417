"""One quiz round in a terminal: ask, reveal, self-rate, save; over injectable streams so tests can pipe input.

Progress is saved after every rating, and again on the way out, so quitting with q, end of input (Ctrl-D)
or Ctrl-C loses nothing that was rated.
"""
from __future__ import annotations

import shutil
import sys
import textwrap
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence, TextIO

from minillm.quiz.bank import LABS, Question
from minillm.quiz.match import match_key_points
from minillm.quiz.schedule import RATINGS, Schedule
from minillm.quiz.style import Style

RATING_KEYS = {"a": "again", "1": "again", "h": "hard", "2": "hard", "g": "good", "3": "good",
               "e": "easy", "4": "easy", **{r: r for r in RATINGS}}
QUIT_KEYS = {"q", "quit", "exit"}


@dataclass
class Summary:
    asked: int = 0
    rated: dict[str, int] = field(default_factory=lambda: {r: 0 for r in RATINGS})
    stopped_by: str = "done"          # done | quit | eof | interrupt
    saved_to: Path | None = None

    @property
    def n_rated(self) -> int:
        return sum(self.rated.values())


class QuizSession:
    def __init__(self, questions: Sequence[Question], schedule: Schedule, save: Callable[[Schedule], Path],
                 inp: TextIO | None = None, out: TextIO | None = None, style: Style | None = None,
                 width: int | None = None):
        self.questions = list(questions)
        self.schedule = schedule
        self.save = save
        self.inp = inp if inp is not None else sys.stdin
        self.out = out if out is not None else sys.stdout
        self.style = style or Style.for_stream(self.out)
        self.width = width or min(100, max(40, shutil.get_terminal_size((88, 24)).columns - 2))
        # A piped stdin does not echo what it feeds us: echo it ourselves so the transcript reads.
        self.interactive = self.inp is sys.stdin and bool(getattr(sys.stdin, "isatty", lambda: False)())

    # ---- input/output -------------------------------------------------------------------------------------
    def _print(self, text: str = "") -> None:
        self.out.write(text + "\n")
        self.out.flush()

    def _wrap(self, text: str, indent: str = "  ") -> str:
        return textwrap.fill(text, self.width, initial_indent=indent, subsequent_indent=indent)

    def _readline(self, prompt: str) -> str:
        """One line without its newline; EOFError at end of input (KeyboardInterrupt passes through)."""
        if self.interactive:
            return input(prompt)   # line editing on a real terminal
        self.out.write(prompt)
        self.out.flush()
        line = self.inp.readline()
        if line == "":
            self.out.write("\n")
            raise EOFError
        line = line.rstrip("\r\n")
        self.out.write(line + "\n")
        return line

    # ---- one question -------------------------------------------------------------------------------------
    def _ask(self, n: int, q: Question) -> None:
        s = self.style
        self._print()
        self._print(s(f"[{n}/{len(self.questions)}] {q.topic}{s.dot.rstrip()} {q.level}", "bold", "cyan"))
        self._print(self._wrap(q.question, ""))

    def _read_answer(self) -> str:
        """Typed lines up to a blank line; a blank first line means 'I answered aloud'."""
        self._print(self.style("Type your answer (a blank line reveals), or just press Enter if you answered aloud.",
                               "dim"))
        lines: list[str] = []
        while True:
            try:
                line = self._readline("> ")
            except EOFError:
                if lines:          # the input ended mid-answer: still reveal what was typed
                    break
                raise
            if not line.strip():
                break
            lines.append(line)
        return "\n".join(lines)

    def _reveal(self, q: Question, typed: str) -> None:
        s = self.style
        self._print(s("Answer", "bold"))
        self._print(self._wrap(q.answer))
        if q.design is not None:
            for name, text in (("Requirements", q.design.requirements), ("Estimate", q.design.estimate),
                               ("Architecture", q.design.architecture), ("Trade-offs", q.design.trade_offs)):
                self._print(s(f"  {name}", "bold"))
                self._print(self._wrap(" ".join(text.split()), "    "))
        if typed.strip():
            hits = match_key_points(typed, q.key_points)
            self._print(s(f"Key points: your answer mentions {sum(hits)} of {len(hits)} "
                          "(a keyword match, not a judge)", "bold"))
            for kp, hit in zip(q.key_points, hits):
                self._print(f"  {s('[x]', 'green') if hit else s('[ ]', 'red')} {kp}")
        else:
            self._print(s("Key points (tick off the ones you said)", "bold"))
            for kp in q.key_points:
                self._print(f"  - {kp}")
        self._print(s("Common mistake: ", "bold", "yellow") + " ".join(q.common_mistake.split()))
        if q.follow_ups:
            self._print(s("Follow-ups: ", "bold") + " | ".join(q.follow_ups))
        labs = ", ".join(f"{l} ({LABS.get(l.split('_')[0], '?')})" for l in q.labs)
        self._print(s("Labs: ", "bold") + labs)
        if q.evidence:
            self._print(s("Evidence: ", "bold") + s.dot.join(q.evidence).strip())

    def _read_rating(self) -> str | None:
        """again/hard/good/easy, or None to quit."""
        prompt = "Rate yourself: [a]gain [h]ard [g]ood [e]asy (or 1-4; q quits): "
        while True:
            key = self._readline(prompt).strip().lower()
            if key in QUIT_KEYS:
                return None
            if key in RATING_KEYS:
                return RATING_KEYS[key]
            self._print(f"  '{key}' is not a rating: type a, h, g or e (or 1-4), or q to quit.")

    # ---- the round ----------------------------------------------------------------------------------------
    def run(self) -> Summary:
        summary = Summary()
        try:
            for n, q in enumerate(self.questions, 1):
                self._ask(n, q)
                summary.asked += 1
                typed = self._read_answer()
                self._reveal(q, typed)
                rating = self._read_rating()
                if rating is None:
                    summary.stopped_by = "quit"
                    break
                card = self.schedule.review(q.id, rating)
                summary.rated[rating] += 1
                summary.saved_to = self.save(self.schedule)
                days = f"{card.interval} day" + ("s" if card.interval != 1 else "")
                self._print(self.style(f"  {self.style.arrow} next review in {days}", "dim"))
        except EOFError:
            summary.stopped_by = "eof"
        except KeyboardInterrupt:
            summary.stopped_by = "interrupt"
        if summary.n_rated:
            summary.saved_to = self.save(self.schedule)   # cheap, and covers a save interrupted mid-round
        self._print_summary(summary)
        return summary

    def _print_summary(self, summary: Summary) -> None:
        counts = ", ".join(f"{r} {c}" for r, c in summary.rated.items())
        why = {"done": "", "quit": " (quit)", "eof": " (end of input)", "interrupt": " (interrupted)"}
        self._print()
        line = f"Rated {summary.n_rated} of {len(self.questions)} questions{why[summary.stopped_by]}: {counts}."
        if summary.saved_to is not None:
            line += f" Progress saved to {summary.saved_to}."
        else:
            line += " Nothing to save."
        self._print(line)
