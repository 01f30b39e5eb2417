"""One quiz round in a terminal: ask, reveal, self-rate, save; over injectable streams so tests can pipe input.

Progress is saved after every rating, and again on the way out, so quitting with q, end of input (Ctrl-D)
or Ctrl-C loses nothing that was rated.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence, TextIO

from minillm.quiz.bank import LABS, Question
from minillm.quiz.keys import EOF_KEY, INTERRUPT_KEY, KeyReader
from minillm.quiz.layout import bullet, labelled, terminal_width, wrap
from minillm.quiz.match import explain
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
    """`read_key` (a terminal: one key press, no Enter) is found automatically when `inp` is the terminal's
    stdin; without it ratings are read as lines (pipes, tests). `width` fixes the wrap width; by default it
    follows the terminal, re-read for every block so a resized window is honoured."""

    def __init__(self, questions: Sequence[Question], schedule: Schedule, save: Callable[[Schedule], Path],
                 inp: TextIO | None = None, out: TextIO | None = None, style: Style | None = None,
                 width: int | None = None, read_key: Callable[[], str] | None = None):
        self.questions = list(questions)
        self.schedule = schedule
        self.save = save
        self.inp = inp if inp is not None else sys.stdin
        self.out = out if out is not None else sys.stdout
        self.style = style or Style.for_stream(self.out)
        self._width = width
        # A piped stdin does not echo what it feeds us: echo it ourselves so the transcript reads.
        self.interactive = self.inp is sys.stdin and bool(getattr(sys.stdin, "isatty", lambda: False)())
        if read_key is None and self.interactive:
            reader = KeyReader.for_stream(self.inp)
            read_key = reader.read if reader is not None else None
        self.read_key = read_key

    @property
    def width(self) -> int:
        return self._width or terminal_width()

    # ---- input/output -------------------------------------------------------------------------------------
    def _print(self, text: str = "") -> None:
        self.out.write(text + "\n")
        self.out.flush()

    def _lines(self, lines: list[str], first: str = "", *styles: str) -> None:
        """Print wrapped lines; `first`, the start of line 1 (a label or a marker), in `styles`."""
        for i, line in enumerate(lines):
            if i == 0 and first and styles and line.lstrip().startswith(first):
                at = line.index(first)
                line = line[:at] + self.style(first, *styles) + line[at + len(first):]
            self._print(line)

    def _wrap(self, text: str, indent: str = "  ") -> str:
        return "\n".join(wrap(text, self.width, indent))

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
        self._print(self.style(self._wrap("Type your answer (a blank line reveals), or just press Enter if you "
                                          "answered aloud.", ""), "dim"))
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

    def _section(self, label: str, text: str, *styles: str) -> None:
        self._lines(labelled(label, text, self.width), label, "bold", *styles)

    def _list(self, label: str, items: Sequence[str]) -> None:
        self._print(self.style(label, "bold"))
        for item in items:
            self._print("\n".join(bullet("-", item, self.width)))

    def _reveal(self, q: Question, typed: str) -> None:
        s, w = self.style, self.width
        self._print(s("Answer", "bold"))
        self._print(self._wrap(q.answer))
        if q.design is not None:
            for name, text in (("Requirements", q.design.requirements), ("Estimate", q.design.estimate),
                               ("Architecture", q.design.architecture), ("Trade-offs", q.design.trade_offs)):
                self._print(s(f"  {name}", "bold"))
                self._print(self._wrap(text, "    "))
        if typed.strip():
            matches = [explain(typed, kp, q.key_point_synonyms(i), cues=q.key_point_cues(i))
                       for i, kp in enumerate(q.key_points)]
            self._lines(wrap(f"Key points: your answer mentions {sum(m.hit for m in matches)} of {len(matches)} "
                             "(a keyword match, not a judge)", w, "", "  "), "Key points:", "bold")
            for kp, m in zip(q.key_points, matches):
                mark = "[x]" if m.hit else "[ ]"
                self._lines(bullet(mark, kp, w), mark, "green" if m.hit else "red")
                why = m.reason()
                if why:
                    self._print(s("\n".join(wrap(f"({why})", w, "      ")), "dim"))
        else:
            self._list("Key points (tick off the ones you said)", q.key_points)
        self._section("Common mistake:", q.common_mistake, "yellow")
        if q.follow_ups:
            self._list("Follow-ups", q.follow_ups)
        self._section("Labs:", ", ".join(f"{l} ({LABS.get(l.split('_')[0], '?')})" for l in q.labs))
        if q.evidence:
            self._list("Evidence", q.evidence)

    def _read_rating(self) -> str | None:
        """again/hard/good/easy, or None to quit."""
        if self.read_key is not None:
            return self._read_rating_key()
        prompt = "Rate yourself: [a]gain [h]ard [g]ood [e]asy (or 1-4; q quits): "
        while True:
            key = self._readline(prompt).strip().lower()
            if key in QUIT_KEYS:
                return None
            if key in RATING_KEYS:
                return RATING_KEYS[key]
            self._print(f"  '{key}' is not a rating: type a, h, g or e (or 1-4), or q to quit.")

    def _read_rating_key(self) -> str | None:
        """One key press: a/h/g/e or 1-4 rates, q quits, Enter alone is ignored (a key then Enter also works)."""
        assert self.read_key is not None
        self.out.write("Rate yourself, one key: [a]gain [h]ard [g]ood [e]asy (or 1-4; q quits): ")
        self.out.flush()
        while True:
            raw = self.read_key()
            if raw == "" or raw.startswith(EOF_KEY):
                self._print()
                raise EOFError
            if raw.startswith(INTERRUPT_KEY):
                self._print()
                raise KeyboardInterrupt
            key = raw.strip("\r\n").strip().lower()
            if not key:
                continue                                  # a bare Enter: still waiting for the rating key
            if key in QUIT_KEYS:
                self._print(key)
                return None
            if key in RATING_KEYS:
                self._print(RATING_KEYS[key])
                return RATING_KEYS[key]
            shown = f"'{key}'" if key.isprintable() else "That key"
            self.out.write(f"\n  {shown} is not a rating: press a, h, g or e (or 1-4), or q to quit: ")
            self.out.flush()

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
