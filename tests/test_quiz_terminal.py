"""`minillm quiz` at a terminal and in a pipe: a reader that closes the pipe, wrapping to the width, one-key
ratings on a real pseudo-terminal (restored on every way out), and filters that ignore case and are validated."""
from __future__ import annotations

import io
import os
import re
import select
import signal
import subprocess
import sys
import termios
import time
from pathlib import Path

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from minillm.quiz.bank import load_bank
from minillm.quiz.layout import bullet, terminal_width, wrap
from minillm.quiz.schedule import Schedule
from minillm.quiz.session import QuizSession
from minillm.quiz.style import Style
from test_quiz import entry, write_topic

REPO = Path(__file__).resolve().parents[1]
DOTTED = "minillm.kv.sizing.kv_cache_bytes"
COMMAND = "`minillm bench throughput --max-num-seqs 8`"


def _env(tmp: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("NO_COLOR", "MINILLM_QUESTIONS", "COLUMNS")}
    env.update(MINILLM_DATA_DIR=str(tmp / "data"), TMPDIR=str(tmp), OMP_NUM_THREADS="1")
    return env


@pytest.fixture
def bank_dir(tmp_path: Path) -> Path:
    d = tmp_path / "bank"
    long_answer = (f"Read {DOTTED} for the formula and run {COMMAND} to see the limit; " * 4).strip()
    write_topic(d, "kv-cache", [entry("kv-one", answer=long_answer,
                                      common_mistake=f"Forgetting {DOTTED} counts KV heads; check with {COMMAND}.",
                                      evidence=[DOTTED, "minillm bench kv"]),
                                entry("kv-two", level="hard", labs=["lab01", "lab04_2"]),
                                entry("kv-three", level="easy")], "The KV cache")
    write_topic(d, "serving", [entry("serve-p99", topic="serving", level="scenario", labs=["lab11"])], "Serving")
    return d


# ---- a reader that closes the pipe -------------------------------------------------------------------------
def test_a_closed_pipe_ends_the_command_quietly(bank_dir, tmp_path):
    """`minillm quiz --list | head -1` with head already gone: the read end is closed before minillm writes,
    so every write fails with EPIPE. Before the fix this printed 'internal error: BrokenPipeError'."""
    r, w = os.pipe()
    os.close(r)
    try:
        proc = subprocess.run([sys.executable, "-m", "minillm", "quiz", "--list", "--bank", str(bank_dir)],
                              stdout=w, stderr=subprocess.PIPE, text=True, env=_env(tmp_path), cwd=REPO, timeout=300)
    finally:
        os.close(w)
    assert proc.stderr == "" and proc.returncode == 141, proc.stderr


def test_main_returns_quietly_when_stdout_is_a_closed_pipe(bank_dir, monkeypatch, capsys):
    """The same through main() in this process: the BrokenPipeError raised inside the command does not reach
    the 'internal error' safety net."""
    from minillm.cli import main
    r, w = os.pipe()
    os.close(r)
    broken = open(w, "w", buffering=1)
    monkeypatch.setattr(sys, "stdout", broken)
    try:
        assert main(["quiz", "--list", "--bank", str(bank_dir)]) == 141
        assert os.readlink(f"/proc/self/fd/{w}") == os.devnull      # stdout now points at /dev/null
    finally:
        broken.close()                                               # flushes into /dev/null: no error
    assert capsys.readouterr().err == ""


# ---- wrapping -------------------------------------------------------------------------------------------------
TOKENS = st.sampled_from(["the", "cache", "grows", "with", "tokens", "x", "2", "per-token", "--max-num-seqs",
                          DOTTED, "minillm.quiz.match.explain", COMMAND, "`minillm bench kv`", "copy-on-write"])


def _units(text: str) -> list[str]:
    """The unbreakable pieces: backticked spans and space-free words."""
    return re.findall(r"`[^`]*`|[^\s`]+", text)


@settings(max_examples=200, deadline=None, derandomize=True)
@given(st.lists(TOKENS, min_size=1, max_size=40), st.integers(20, 100), st.sampled_from(["", "  ", "    "]))
@example([DOTTED] * 3, 20, "  ")                                  # each longer than the line: alone, unsplit
@example(["a", COMMAND, "b"], 24, "")
def test_wrap_fills_to_the_width_without_splitting_names_or_commands(words, width, indent):
    text = " ".join(words)
    lines = wrap(text, width, indent)
    for line in lines:
        assert line.startswith(indent)
        body = line[len(indent):]
        assert len(line) <= width or len(_units(body)) == 1, (line, width)   # only a lone long unit overflows
    assert [u for l in lines for u in _units(l)] == _units(text)        # same pieces, same order, none split


@settings(max_examples=100, deadline=None, derandomize=True)
@given(st.lists(TOKENS, min_size=1, max_size=30), st.integers(30, 100), st.sampled_from(["-", "[x]", "[ ]"]))
def test_bullets_hang_under_their_text(words, width, marker):
    lines = bullet(marker, " ".join(words), width)
    assert lines[0].startswith(f"  {marker} ")
    assert all(l.startswith(" " * (3 + len(marker))) and not l[3 + len(marker)].isspace() for l in lines[1:])


def test_terminal_width_follows_columns_within_bounds(monkeypatch):
    for columns, expected in (("61", 60), ("20", 40), ("300", 100)):
        monkeypatch.setenv("COLUMNS", columns)
        assert terminal_width() == expected


def test_every_block_of_a_round_is_wrapped_to_the_width(bank_dir):
    bank = load_bank(bank_dir)
    out = io.StringIO()
    typed = "it keeps K and V of past tokens per layer"
    QuizSession([bank.questions["kv-one"]], Schedule.empty(), lambda s: Path("x"), inp=io.StringIO(f"{typed}\n\ng\n"),
                out=out, style=Style(False), width=50).run()
    lines = out.getvalue().splitlines()
    typed_lines = {f"> {typed}", "> ", "Rate yourself: [a]gain [h]ard [g]ood [e]asy (or 1-4; q quits): g"}
    too_long = [l for l in lines if len(l) > 50 and l not in typed_lines and not l.startswith("Rated ")
                and len(_units(l.strip())) > 1]
    assert not too_long
    assert all(DOTTED in l for l in lines if "kv_cache_bytes" in l)          # never split
    assert all("--max-num-seqs 8`" in l for l in lines if "`minillm bench throughput" in l)
    assert any(l.startswith("Common mistake: ") for l in lines) and "  - minillm bench kv" in lines
    assert "      (matched: k, v, past, tokens, layer)" in lines              # why the point was ticked


# ---- one-key ratings -----------------------------------------------------------------------------------------
def _keyed_session(bank_dir: Path, keys: list[str]) -> tuple[str, object]:
    bank = load_bank(bank_dir)
    out = io.StringIO()
    feed = iter(keys)
    s = QuizSession([bank.questions["kv-one"], bank.questions["kv-two"]], Schedule.empty(), lambda s: Path("x"),
                    inp=io.StringIO("\n\n"), out=out, style=Style(False), width=80, read_key=lambda: next(feed))
    summary = s.run()
    return out.getvalue(), summary


def test_one_key_rates_and_bare_enter_and_stray_keys_do_not(bank_dir):
    out, summary = _keyed_session(bank_dir, ["\r", "x", "\x1b[A", "g", "E\n"])
    assert summary.rated == {"again": 0, "hard": 0, "good": 1, "easy": 1} and summary.stopped_by == "done"
    assert "'x' is not a rating: press a, h, g or e" in out and "That key is not a rating" in out
    assert "one key: [a]gain" in out and "or q to quit: good\n" in out and "(or 1-4; q quits): easy\n" in out


@pytest.mark.parametrize("key, stopped_by", [("q", "quit"), ("\x04", "eof"), ("\x03", "interrupt")])
def test_q_ctrl_d_and_ctrl_c_keys_end_the_round(bank_dir, key, stopped_by):
    out, summary = _keyed_session(bank_dir, ["3", key])
    assert summary.stopped_by == stopped_by and summary.rated["good"] == 1


_DRIVER = """\
import argparse, sys
from minillm.quiz.cli import add_quiz_parser
ap = argparse.ArgumentParser(prog="minillm")
add_quiz_parser(ap.add_subparsers())
args = ap.parse_args(sys.argv[1:])
sys.exit(args.func(args))
"""


def _expect(fd: int, pattern: str, seen: list[str], timeout: float = 300) -> None:
    """Read the pty until `pattern` (a regex) appears in what was printed since the last call (`timeout`: a hang
    guard, not a budget)."""
    deadline, start = time.monotonic() + timeout, len("".join(seen))
    while not re.search(pattern, "".join(seen)[start:]):
        left = deadline - time.monotonic()
        assert left > 0, f"no {pattern!r} in {''.join(seen)[start:]!r}"
        if select.select([fd], [], [], left)[0]:
            try:
                seen.append(os.read(fd, 4096).decode(errors="replace"))
            except OSError:             # the child closed the terminal
                break


def test_one_key_rating_on_a_real_terminal_restores_it_on_every_exit(bank_dir, tmp_path):
    """`minillm quiz` (its parser and command, without the rest of the CLI) on a pseudo-terminal: a single 'g'
    rates; 'h' then Enter rates and the Enter does not leak into the next answer; Ctrl-C at the third rating
    prompt saves and exits; the terminal's settings are then what they were before."""
    master, slave = os.openpty()
    before = termios.tcgetattr(slave)
    proc = subprocess.Popen([sys.executable, "-c", _DRIVER, "quiz", "--bank", str(bank_dir), "--topic", "kv-cache",
                             "--n", "3", "--seed", "0"], stdin=slave, stdout=slave, stderr=slave,
                            env={**_env(tmp_path), "COLUMNS": "80"}, cwd=REPO)
    seen: list[str] = []
    try:
        _expect(master, r"> $", seen)
        os.write(master, b"\n")                                    # answered aloud
        _expect(master, r"one key: .*: $", seen)
        os.write(master, b"g")                                     # no Enter
        _expect(master, r"good\r?\n(.|\n)*\[2/3\](.|\n)*> $", seen)
        os.write(master, b"\n")
        _expect(master, r"one key: .*: $", seen)
        os.write(master, b"h\n")                                   # the line-mode habit
        _expect(master, r"hard\r?\n(.|\n)*\[3/3\](.|\n)*> $", seen)
        time.sleep(0.5)
        _expect(master, r"$", seen, timeout=0.1)
        assert "Answer" not in "".join(seen).split("[3/3]")[1]     # the Enter did not answer question 3
        os.write(master, b"\n")
        _expect(master, r"one key: .*: $", seen)
        proc.send_signal(signal.SIGINT)                            # Ctrl-C while the terminal is in cbreak mode
        assert proc.wait(timeout=300) == 0
        _expect(master, r"\(interrupted\)", seen)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        after = termios.tcgetattr(slave)
        os.close(master)
        os.close(slave)
    text = "".join(seen)
    assert "Rated 2 of 3 questions (interrupted): again 0, hard 1, good 1, easy 0." in text
    assert after == before and after[3] & termios.ICANON and after[3] & termios.ECHO


# ---- filters -------------------------------------------------------------------------------------------------
def _main(*argv: str) -> int:
    from minillm.cli import main
    return main(list(argv))


def test_filters_ignore_case_and_list_respects_them(bank_dir, capsys):
    assert _main("quiz", "--bank", str(bank_dir), "--list", "--topic", "KV-Cache", "--level", "HARD") == 0
    out = capsys.readouterr().out
    assert out.startswith("1 of 4 questions match --topic KV-Cache --level HARD\n")
    assert "  kv-two  kv-cache, hard" in out and "kv-one" not in out and "serving" not in out
    assert next(l for l in out.splitlines() if l.startswith("total")).split()[-1] == "1"
    assert _main("quiz", "--bank", str(bank_dir), "--list", "--lab", "LAB4") == 0          # lab4 = lab04
    out = capsys.readouterr().out
    assert "1 of 4 questions match --lab LAB4" in out
    per_lab = next(line for line in out.splitlines() if line.startswith("questions per lab"))
    assert per_lab == "questions per lab: lab01 1, lab04 1"        # the labs the selection touches, no zeros
    assert _main("quiz", "--bank", str(bank_dir), "--list", "--level", "Scenario") == 0
    assert "  serve-p99  serving, scenario" in capsys.readouterr().out
    assert _main("quiz", "--bank", str(bank_dir), "--export", "Markdown", "-", "--topic", "SERVING") == 0
    md = capsys.readouterr().out
    assert "serve-p99" in md and "kv-one" not in md


@pytest.mark.parametrize("flag, value, valid", [
    ("--topic", "kv", "valid topics: kv-cache, serving"),
    ("--level", "expert", "valid levels: easy, medium, hard, system-design, scenario"),
    ("--lab", "lab13", "valid labs: lab00, lab01, lab02, lab03, lab04, lab05, lab06, lab07, lab08, lab09, lab10, "
                       "lab11, lab12 (or a part such as lab04_2)"),
])
def test_an_unknown_filter_value_is_one_error_line_with_list_and_export_too(bank_dir, capsys, flag, value, valid):
    for mode in ([], ["--list"], ["--export", "anki", "-"]):
        assert _main("quiz", "--bank", str(bank_dir), *mode, flag, value) == 2
        captured = capsys.readouterr()
        assert captured.out == ""
        assert captured.err.splitlines() == [f"error: unknown {flag[2:]} {value!r}; {valid}"]


def test_a_filter_that_matches_nothing_says_so(bank_dir, capsys):
    assert _main("quiz", "--bank", str(bank_dir), "--list", "--lab", "lab09") == 1
    assert "no questions match --lab lab09 yet" in capsys.readouterr().err
