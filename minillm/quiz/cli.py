"""`minillm quiz`: rehearse the interview questions with spaced repetition, list the bank, export it."""
from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path
from typing import TextIO

from minillm.quiz.bank import LABS, LEVELS, PLANNED_TOPICS, Bank, BankError, SelectionError, load_bank
from minillm.quiz.coverage import coverage
from minillm.quiz.export import FORMATS, to_anki_csv, to_markdown
from minillm.quiz.session import QuizSession
from minillm.quiz.store import ScheduleStore, data_path, reset
from minillm.quiz.style import Style

DESCRIPTION = """\
Rehearse the interview questions in questions/ (one YAML file per topic, each question tied to the
lab that demonstrates it).

A round: the question is shown; answer aloud, or type your answer (a blank line ends it). The
project's answer appears with its key points as a checklist, the common mistake, the labs and the
code that backs it, wrapped to the terminal's width. Rate yourself: again / hard / good / easy
(a/h/g/e or 1-4; q quits): one key press on a terminal, a line (key + Enter) from a pipe.

Scheduling (SM-2 spaced repetition, per question): "again" restarts a question at 1 day; hard, good
and easy grow its interval (1 day, 6 days, then interval x ease). Ease starts at 2.5, falls on hard
and again, rises on easy, never below 1.3. A round asks overdue questions first, then new ones
(levels interleaved), then the rest by due date, so there is always something to practise.

Typed answers: a key point is ticked [x] when at least 60% of its content words appear in your
text (after lower-casing, dropping punctuation and stopwords, crude stemming so batched = batching;
KV-cache = kv cache = kvcache; TP = tensor parallelism; hyphenated terms such as copy-on-write must
appear whole; filler such as "use", "shrink", "roughly" is never required), or 60% of one of the
synonyms the bank lists for it; under each tick it shows the words that matched. A point is not
ticked when your text asserts the mistake it corrects (the bank lists those phrases; "do not ..."
before one does not count as asserting it). It is still a keyword match, not a judge.

Filters (--topic, --level, --lab) ignore case, apply to --list and --export too, and an unknown
value is an error that lists the valid ones.

Progress is saved after every rating, per user, to $MINILLM_DATA_DIR/quiz.json, else
$XDG_DATA_HOME/minillm/quiz.json, else ~/.local/share/minillm/quiz.json. If that directory is not
writable it goes to a file in the temp directory, with a warning. Ctrl-C or Ctrl-D saves and
exits; --reset deletes the progress.
  progress file here: {path}
"""

EPILOG = """\
examples:
  minillm quiz                               # due questions first, mixed levels
  minillm quiz --topic kv-cache --level hard --n 5
  minillm quiz --lab lab04                   # the questions a lab answers
  minillm quiz --list                        # topics, counts per level, coverage
  minillm quiz --export anki out.csv         # or: --export markdown out.md (- for stdout)
"""


def add_quiz_parser(subparsers) -> argparse.ArgumentParser:
    """Register `minillm quiz` on the main CLI's subparsers."""
    p = subparsers.add_parser(
        "quiz", help="rehearse interview questions (spaced repetition); --list, --export anki|markdown",
        description=DESCRIPTION.format(path=data_path()), epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--topic", action="append", default=[], metavar="TOPIC",
                   help="only this topic (repeatable); --list shows the topics")
    p.add_argument("--level", default=None, metavar="LEVEL", help=f"only this level: {', '.join(LEVELS)}")
    p.add_argument("--lab", default=None, metavar="LAB",
                   help="only the questions a lab answers (lab00 ... lab10; planned labs with --planned)")
    p.add_argument("--n", type=int, default=10, metavar="N", help="questions in this round (default 10)")
    p.add_argument("--seed", type=int, default=None, help="seed for shuffling new questions (default: random)")
    p.add_argument("--list", action="store_true", help="list topics with counts per level and questions per lab")
    p.add_argument("--planned", action="store_true",
                   help="authors: include the labs and topics not built yet, and the seed-coverage report")
    p.add_argument("--export", nargs=2, metavar=("FORMAT", "PATH"), default=None,
                   help="write the (filtered) bank as FORMAT anki (CSV for Anki's import) or markdown to PATH "
                        "('-' = stdout)")
    p.add_argument("--reset", action="store_true", help="delete your saved progress, then exit")
    p.add_argument("--bank", default=None, metavar="DIR",
                   help="question bank directory (default: $MINILLM_QUESTIONS or the repository's questions/)")
    p.add_argument("--no-color", action="store_true", help="plain text output (also: NO_COLOR=1, or any pipe)")
    p.set_defaults(func=cmd_quiz)
    return p


def _error(msg: str) -> int:
    print(f"error: {msg}", file=sys.stderr)
    return 2


def _filters(args: argparse.Namespace) -> str:
    """The filters given, as the user would retype them: '--topic kv-cache --level hard'."""
    given = [("topic", t) for t in args.topic] + [("level", args.level), ("lab", args.lab)]
    return " ".join(f"--{k} {v}" for k, v in given if v)


def cmd_quiz(args: argparse.Namespace) -> int:
    if args.reset:
        try:
            removed = reset()
        except OSError as e:
            return _error(str(e))
        print("deleted " + ", ".join(map(str, removed)) if removed else f"no saved progress ({data_path()})")
        return 0
    if args.n < 1:
        return _error(f"--n must be at least 1, got {args.n}")
    if args.export:
        args.export[0] = args.export[0].lower()
        if args.export[0] not in FORMATS:
            return _error(f"unknown export format {args.export[0]!r}; use anki or markdown (e.g. --export anki out.csv)")
    try:
        bank = load_bank(args.bank)
    except BankError as e:
        return _error(f"cannot load the question bank:\n{e}")
    if args.lab and not args.planned and args.lab.lower().split("_")[0] in LABS \
            and args.lab.lower().split("_")[0] not in built_labs():
        return _error(f"{args.lab} is planned, not built yet: its questions show with --planned")
    try:   # validated (case-insensitively) for every mode, --list and --export included
        questions = bank.select(args.topic, args.level, args.lab)
    except SelectionError as e:
        return _error(str(e))
    if not questions:
        print(f"no questions match {_filters(args) or 'the bank'} yet; see `minillm quiz --list`", file=sys.stderr)
        return 1
    if args.list:
        print_list(bank, sys.stdout, questions if _filters(args) else None, _filters(args), args.planned)
        return 0
    if args.export:
        return _export(bank, questions, *args.export)
    return _run(questions, args)


def _export(bank: Bank, questions: list, fmt: str, path: str) -> int:
    text = to_anki_csv(questions, bank.topics) if fmt == "anki" else to_markdown(questions, bank.topics)
    if path == "-":
        sys.stdout.write(text)
        return 0
    try:
        Path(path).write_text(text, encoding="utf-8")
    except OSError as e:
        return _error(f"cannot write {path}: {e.strerror or e}")
    print(f"wrote {len(questions)} questions to {path} ({fmt})")
    return 0


def _run(questions: list, args: argparse.Namespace) -> int:

    store = ScheduleStore()
    schedule = store.load()
    now = schedule.clock()
    due = sum(1 for q in questions if (d := schedule.card(q.id).due_at()) is not None and d <= now)
    new = sum(1 for q in questions if q.id not in schedule.cards)
    order = schedule.due_first(questions, random.Random(args.seed))[: args.n]
    print(f"{len(order)} of {len(questions)} questions ({due} due, {new} new). Progress: {store.path}")
    session = QuizSession(order, schedule, store.save, style=Style.for_stream(sys.stdout, args.no_color))
    session.run()
    return 0


def built_labs() -> set[str]:
    """The labs a learner has: the folders of the repository's labs/ (all of LABS where there is no checkout)."""
    labs = Path(__file__).resolve().parents[2] / "labs"
    found = {d.name for d in labs.iterdir() if d.is_dir() and d.name in LABS} if labs.is_dir() else set()
    return found or set(LABS)


def print_list(bank: Bank, out: TextIO, questions: list | None = None, filters: str = "",
               planned: bool = False) -> None:
    """Every topic with counts per level and totals, and questions per lab; with `planned` (for authors) also the
    topics and labs not built yet and the coverage of the seed questions. With `questions` (the ones some filters
    select) the counts are theirs and the matching ids are listed."""

    selected = list(bank.questions.values()) if questions is None else questions
    short = {"system-design": "design"}
    cols = [short.get(l, l) for l in LEVELS]
    if questions is None:
        names = [*bank.topics, *[p for p in PLANNED_TOPICS if p not in bank.topics and planned]]
    else:
        names = [t for t in bank.topics if any(q.topic == t for q in selected)]
    titles = {t: bank.topics.get(t, "(no file yet)") for t in names}
    tw = max([len(t) for t in titles] + [5])
    hw = max([len(t) for t in titles.values()] + [5])
    if filters:
        out.write(f"{len(selected)} of {len(bank)} questions match {filters}\n\n")
    out.write(f"{'topic':<{tw}}  {'title':<{hw}}  " + "  ".join(f"{c:>6}" for c in cols) + f"  {'total':>5}\n")
    totals = [0] * len(LEVELS)
    for topic, title in titles.items():
        qs = [q for q in selected if q.topic == topic]
        counts = [sum(q.level == l for q in qs) for l in LEVELS]
        totals = [a + b for a, b in zip(totals, counts)]
        out.write(f"{topic:<{tw}}  {title:<{hw}}  " + "  ".join(f"{c:>6}" for c in counts) + f"  {len(qs):>5}\n")
    out.write(f"{'total':<{tw}}  {'':<{hw}}  " + "  ".join(f"{c:>6}" for c in totals) + f"  {len(selected):>5}\n\n")

    by_lab: dict[str, int] = {}
    for q in selected:
        for lab in {l.split("_")[0] for l in q.labs}:
            by_lab[lab] = by_lab.get(lab, 0) + 1
    shown = [lab for lab in LABS if planned or lab in built_labs()]
    if questions is not None:      # filtered: the labs the selection touches, not a row of zeros
        shown = [lab for lab in shown if by_lab.get(lab)]
    out.write("questions per lab: " + ", ".join(f"{lab} {by_lab.get(lab, 0)}" for lab in shown) + "\n")
    if questions is not None:
        iw = max(len(q.id) for q in selected)
        out.write("\n" + "".join(f"  {q.id:<{iw}}  {q.topic}, {q.level}\n" for q in selected))
        return
    if not planned:
        return
    cov = coverage(bank)
    present = len(cov.referenced) - len(cov.missing)
    out.write(f"coverage: {cov.seed_questions} seed questions mapped in sources.yaml to {len(cov.referenced)} "
              f"distinct entries; {present} of them in the bank, {len(cov.missing)} not written yet\n")
    if cov.missing:
        shown = ", ".join(cov.missing[:8]) + (", ..." if len(cov.missing) > 8 else "")
        out.write(f"  not written yet: {shown}\n")
    out.write(f"  {len(bank)} entries in the bank, {len(cov.unreferenced)} not mapped from a seed "
              "(and not marked CURRICULUM.md)")
    out.write(": " + ", ".join(cov.unreferenced) + "\n" if cov.unreferenced else "\n")
    out.write(f"  {len(cov.without_evidence)} entries without evidence")
    out.write(": " + ", ".join(cov.without_evidence[:8]) + ("..." if len(cov.without_evidence) > 8 else "") + "\n"
              if cov.without_evidence else "\n")
