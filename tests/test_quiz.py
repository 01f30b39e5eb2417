"""`minillm quiz`: bank loading and its error messages, SM-2, key-point matching, progress storage, export,
the CLI, and scripted sessions (piped stdin, Ctrl-C). Tiny fixture banks in tmp_path; no model, no torch."""
from __future__ import annotations

import csv
import io
import json
import os
import subprocess
import sys
import tempfile
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
import yaml
from hypothesis import example, given, settings
from hypothesis import strategies as st

from minillm.quiz.bank import BankError, Question, SelectionError, load_bank
from minillm.quiz.export import to_anki_csv, to_markdown
from minillm.quiz.match import match_key_points, tokens
from minillm.quiz.schedule import MAX_INTERVAL_DAYS, MIN_EASE, RATINGS, Card, Schedule, sm2
from minillm.quiz.session import QuizSession
from minillm.quiz.store import ScheduleStore, data_path, fallback_path, reset
from minillm.quiz.style import Style, wants_color

REPO = Path(__file__).resolve().parents[1]

ANSWER = ("The KV cache keeps the key and value vectors of every token already processed, per layer and per "
          "KV head, so each decode step computes projections only for the one new token and attends over the "
          "stored ones. Without it, generating n tokens redoes all earlier tokens at every step, quadratic work "
          "instead of linear. The price is memory that grows with context length times the number of live "
          "sequences, which is why servers budget, page, share and quantize it.")


def entry(qid: str, topic: str = "kv-cache", level: str = "medium", **over) -> dict:
    e = {"id": qid, "topic": topic, "level": level, "question": f"Question {qid}: what is the KV cache?",
         "answer": ANSWER,
         "key_points": ["Stores K and V of past tokens per layer", "Decode computes only the new token",
                        "Memory grows with context x live sequences"],
         "common_mistake": "Counting query heads instead of KV heads.",
         "follow_ups": ["How does GQA change the size?"], "labs": ["lab01"],
         "evidence": [], "sources": ["CURRICULUM.md"]}
    if level == "system-design":
        e["design"] = {"requirements": "10K RPS, p99 < 2 s", "estimate": "40 GPUs at 250 RPS each",
                       "architecture": "router, replicas, KV-aware scheduler", "trade_offs": "TP vs replicas"}
    e.update(over)
    return e


def write_topic(bank: Path, topic: str, entries: list[dict], title: str | None = None) -> Path:
    bank.mkdir(parents=True, exist_ok=True)
    path = bank / f"{topic}.yaml"
    path.write_text(yaml.safe_dump({"topic": topic, "title": title or f"Title of {topic}", "questions": entries},
                                   sort_keys=False), encoding="utf-8")
    return path


@pytest.fixture
def bank_dir(tmp_path: Path) -> Path:
    d = tmp_path / "bank"
    write_topic(d, "kv-cache", [entry("kv-what"), entry("kv-size", level="hard", labs=["lab01", "lab04_2"])],
                "The KV cache")
    write_topic(d, "serving", [entry("serve-design", topic="serving", level="system-design", labs=["lab12"]),
                               entry("serve-p99", topic="serving", level="scenario", labs=["lab11"],
                                     evidence=["minillm bench kv"])], "Serving")
    (d / "sources.yaml").write_text("questions:\n  - {seed: 000_x.txt, line: 3, quote: \"What is\", id: kv-what}\n")
    return d


@pytest.fixture
def data_dir(tmp_path: Path, monkeypatch) -> Path:
    d = tmp_path / "data"
    monkeypatch.setenv("MINILLM_DATA_DIR", str(d))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))   # keep fallbacks out of the real /tmp
    (tmp_path / "tmp").mkdir()
    return d


# ---- loading ---------------------------------------------------------------------------------------------
def test_load_bank_indexes_by_topic_level_and_lab(bank_dir):
    bank = load_bank(bank_dir)
    assert list(bank.questions) == ["kv-what", "kv-size", "serve-design", "serve-p99"]
    assert bank.topics == {"kv-cache": "The KV cache", "serving": "Serving"}
    assert [q.id for q in bank.by_level("hard")] == ["kv-size"]
    assert [q.id for q in bank.by_lab("lab04")] == ["kv-size"]      # lab04 includes its part lab04_2
    assert [q.id for q in bank.by_lab("lab04_2")] == ["kv-size"]
    assert bank.by_lab("lab04_1") == []
    assert bank.questions["serve-design"].design.estimate.startswith("40 GPUs")
    assert [q.id for q in bank.select(["serving"], level="scenario")] == ["serve-p99"]


def test_missing_bank_dir_says_what_to_do(tmp_path):
    with pytest.raises(BankError, match="MINILLM_QUESTIONS"):
        load_bank(tmp_path / "nope")


def test_malformed_yaml_names_file_line_and_column(bank_dir):
    (bank_dir / "broken.yaml").write_text("topic: broken\ntitle: Broken\nquestions:\n  - id: a\n   level: [easy\n")
    with pytest.raises(BankError) as err:
        load_bank(bank_dir)
    msg = str(err.value)
    assert "broken.yaml:" in msg and "malformed YAML" in msg
    line = msg.split("broken.yaml:")[1].split(":")[0]
    assert line.isdigit() and 4 <= int(line) <= 6


def test_duplicate_yaml_key_is_an_error(bank_dir):
    text = (bank_dir / "kv-cache.yaml").read_text().replace("  level: medium\n", "  level: medium\n  level: hard\n", 1)
    (bank_dir / "kv-cache.yaml").write_text(text)
    with pytest.raises(BankError, match=r"kv-cache\.yaml:\d+:\d+: malformed YAML: found duplicate key 'level'"):
        load_bank(bank_dir)


@pytest.mark.parametrize("over, field, words", [
    ({"key_points": []}, "key_points", "non-empty|too short"),
    ({"level": "expert"}, "level", "is not one of"),
    ({"labs": ["lab13"]}, "labs[0]", "does not match"),
    ({"sources": ["notes.txt"]}, "sources[0]", "does not match"),
    ({"anwser": "typo"}, "anwser", "unknown field"),
])
def test_schema_violation_names_file_entry_and_field(bank_dir, over, field, words):
    write_topic(bank_dir, "kv-cache", [entry("kv-what"), entry("kv-bad", **over)])
    with pytest.raises(BankError) as err:
        load_bank(bank_dir)
    msg = str(err.value)
    assert "kv-cache.yaml: entry 'kv-bad' field " + field + ":" in msg
    assert any(w in msg for w in words.split("|"))


def test_missing_field_and_missing_design_are_named(bank_dir):
    bad = entry("kv-bad")
    del bad["labs"]
    design = entry("kv-design", level="system-design")
    del design["design"]
    write_topic(bank_dir, "kv-cache", [bad, design])
    msg = str(pytest.raises(BankError, load_bank, bank_dir).value)
    assert "entry 'kv-bad' field labs: missing required field" in msg
    assert "entry 'kv-design' field design: missing required field" in msg


def test_entry_without_id_is_named_by_position(bank_dir):
    bad = entry("x")
    del bad["id"]
    write_topic(bank_dir, "kv-cache", [entry("kv-what"), bad])
    assert "entry #2 field id: missing required field" in str(pytest.raises(BankError, load_bank, bank_dir).value)


def test_rules_beyond_the_schema(bank_dir):
    write_topic(bank_dir, "kv-cache", [entry("kv-what", topic="serving"),
                                       entry("kv-long", answer=" ".join(["token"] * 201)),
                                       entry("kv-short", answer=" ".join(["supercalifragilistic"] * 20))])
    write_topic(bank_dir, "extra", [entry("serve-p99", topic="extra")])
    (bank_dir / "misnamed.yaml").write_text(yaml.safe_dump({"topic": "other", "title": "Other",
                                                            "questions": [entry("m1", topic="other")]}))
    msg = str(pytest.raises(BankError, load_bank, bank_dir).value)
    assert "kv-cache.yaml: entry 'kv-what' field topic: 'serving' but the file's topic is 'kv-cache'" in msg
    assert "entry 'kv-long' field answer: 201 words; answers must be 60-200 words" in msg
    assert "entry 'kv-short' field answer: 20 words" in msg
    assert "misnamed.yaml: field topic: 'other' differs from the file name" in msg
    assert "serving.yaml: entry 'serve-p99' field id: duplicate id, already used in" in msg


# ---- SM-2 ------------------------------------------------------------------------------------------------
T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)


@settings(max_examples=200, deadline=None, derandomize=True)
@given(st.lists(st.sampled_from(list(RATINGS)), min_size=1, max_size=40))
@example(["easy"] * 40)          # intervals hit the century cap: the clock walks to year ~5200
@example(["good"] * 40)
@example(["again", "easy"] * 20)
def test_sm2_invariants(ratings):
    card, now = Card(), T0
    for r in ratings:
        before = card
        card = sm2(card, r, now)
        assert card.interval >= 1 and card.ease >= MIN_EASE
        due = datetime.fromisoformat(card.due)
        assert due > now or due == datetime.max.replace(tzinfo=now.tzinfo)
        if r == "again":
            assert card.repetitions == 0 and card.interval == 1 and card.lapses == before.lapses + 1
        else:
            assert card.repetitions == before.repetitions + 1
        if r == "easy":
            assert card.ease >= before.ease
        if r != "again" and before.repetitions >= 2:
            assert card.interval >= before.interval      # a pass never shortens the interval past SM-2's start
        now = datetime.fromisoformat(card.due)


def test_sm2_intervals_stop_at_a_century():
    card = Card()
    for _ in range(40):                                   # 2.5^40 days would overflow any date
        card = sm2(card, "easy", T0)
    assert card.interval == MAX_INTERVAL_DAYS and datetime.fromisoformat(card.due) > T0


def test_sm2_first_intervals_are_1_then_6_then_grow_by_ease():
    c1 = sm2(Card(), "good", T0)
    c2 = sm2(c1, "good", T0)
    c3 = sm2(c2, "good", T0)
    assert (c1.interval, c2.interval, c3.interval) == (1, 6, 15)     # 6 x 2.5
    assert sm2(Card(), "hard", T0).ease == pytest.approx(2.36)
    assert sm2(Card(), "easy", T0).ease == pytest.approx(2.6)
    with pytest.raises(ValueError, match="again, hard, good, easy"):
        sm2(Card(), "great", T0)


class _Item:
    def __init__(self, id: str, level: str):
        self.id, self.level = id, level


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["easy", "hard", "scenario"]),
                          st.one_of(st.none(), st.integers(-30, 30))), min_size=1, max_size=30),
       st.integers(0, 2**16))
def test_due_first_orders_overdue_then_new_then_later(spec, seed):
    import random
    items = [_Item(f"q{i}", level) for i, (level, _) in enumerate(spec)]
    cards = {f"q{i}": Card(due=(T0 + timedelta(days=d)).isoformat(), reviews=1)
             for i, (_, d) in enumerate(spec) if d is not None}
    order = Schedule(cards, clock=lambda: T0).due_first(items, random.Random(seed))
    assert sorted(i.id for i in order) == sorted(i.id for i in items)
    kinds = ["new" if i.id not in cards else "due" if cards[i.id].due_at() <= T0 else "later" for i in order]
    rank = {"due": 0, "new": 1, "later": 2}
    assert [rank[k] for k in kinds] == sorted(rank[k] for k in kinds)
    dues = [cards[i.id].due_at() for i in order if i.id in cards]
    overdue = [d for d in dues if d <= T0]
    assert overdue == sorted(overdue) and dues[len(overdue):] == sorted(dues[len(overdue):])


def test_new_questions_interleave_levels():
    import random
    items = [_Item(f"e{i}", "easy") for i in range(3)] + [_Item(f"h{i}", "hard") for i in range(3)]
    order = Schedule.empty(lambda: T0).due_first(items, random.Random(0))
    levels = [i.level for i in order]
    assert all(a != b for a, b in zip(levels, levels[1:]))


def test_schedule_review_uses_injected_clock_and_roundtrips():
    s = Schedule.empty(lambda: T0)
    s.review("a", "good")
    again = Schedule.from_dict(json.loads(json.dumps(s.to_dict())), clock=lambda: T0)
    assert again.cards["a"].due == (T0 + timedelta(days=1)).isoformat()


# ---- key-point matching ------------------------------------------------------------------------------------
KV_POINTS = ["2 x layers x kv_heads x head_dim x bytes per token",
             "Use KV heads, not query heads, so GQA/MQA shrink it",
             "Sum tokens over all live sequences (batch x length)",
             "Llama-3-8B is 128 KiB/token in bf16"]


def test_matcher_hits_and_misses_on_a_realistic_answer():
    typed = ("It's two times the number of layers, times the KV heads, times head dim, times the bytes per "
             "element -- per token. You sum that over every live sequence, so batch times length.")
    assert match_key_points(typed, KV_POINTS) == [True, False, True, False]


def test_matcher_is_robust_to_case_punctuation_and_spelling_variants():
    typed = "KV-HEADS (not query heads!!) matter: GQA & MQA shrink the cache. LLAMA 3 8B: 128KiB per token, BF16."
    hits = match_key_points(typed, KV_POINTS)
    assert hits[1] and hits[3]
    assert match_key_points(typed.lower().replace("-", " "), KV_POINTS) == hits
    assert match_key_points("the kvcache", ["the KV cache"]) == [True]
    assert match_key_points("the kv cache", ["the KVcache"]) == [True]
    assert match_key_points("copy on write", ["copy-on-write sharing of prefixes"]) == [False]   # 1 of 3 units
    assert match_key_points("copy-on-write sharing of the prefix", ["copy-on-write sharing of prefixes"]) == [True]


def test_matcher_needs_a_typed_answer_and_content_words():
    assert match_key_points("", KV_POINTS) == [False] * 4
    assert match_key_points("the a of to", ["the cache"]) == [False]
    assert tokens("Caching cached caches 4,096 ×2") == ["cach", "cach", "cach", "4096", "x", "2"]


# ---- progress storage --------------------------------------------------------------------------------------
def test_data_path_precedence(monkeypatch, tmp_path):
    monkeypatch.delenv("MINILLM_DATA_DIR", raising=False)
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg"))
    assert data_path() == tmp_path / "xdg" / "minillm" / "quiz.json"
    monkeypatch.delenv("XDG_DATA_HOME")
    assert data_path() == Path.home() / ".local" / "share" / "minillm" / "quiz.json"
    monkeypatch.setenv("MINILLM_DATA_DIR", str(tmp_path / "d"))
    assert data_path() == tmp_path / "d" / "quiz.json"


def test_store_roundtrip_and_reset(data_dir):
    store = ScheduleStore()
    s = store.load()
    s.review("q1", "easy")
    assert store.save(s) == data_dir / "quiz.json"
    assert ScheduleStore().load().cards["q1"].last_rating == "easy"
    assert reset() == [data_dir / "quiz.json"]
    assert ScheduleStore().load().cards == {}


def test_unwritable_data_dir_falls_back_to_temp_with_a_warning(tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("MINILLM_DATA_DIR", str(blocker / "sub"))   # mkdir fails even for root
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    warn = io.StringIO()
    store = ScheduleStore(warn=warn)
    assert store.path == fallback_path() and store.path.parent == tmp_path
    assert "warning: cannot write quiz progress" in warn.getvalue() and str(store.path) in warn.getvalue()
    s = store.load()
    s.review("q1", "good")
    store.save(s)
    assert json.loads(store.path.read_text())["cards"]["q1"]["repetitions"] == 1


def test_corrupt_progress_file_is_kept_and_replaced(data_dir):
    data_dir.mkdir()
    (data_dir / "quiz.json").write_text("{not json")
    warn = io.StringIO()
    assert ScheduleStore(warn=warn).load().cards == {}
    assert "starting a fresh schedule" in warn.getvalue()
    assert (data_dir / "quiz.json.corrupt").read_text() == "{not json"


# ---- export and show -------------------------------------------------------------------------------------
def test_anki_csv_parses_back_one_row_per_question(bank_dir):
    bank = load_bank(bank_dir)
    text = to_anki_csv(bank.questions.values(), bank.topics)
    rows = [r for r in csv.reader(io.StringIO(text)) if not r[0].startswith("#")]
    assert len(rows) == len(bank) and all(len(r) == 4 for r in rows)
    guid, front, back, tags = rows[1]
    assert len({r[0] for r in rows}) == len(rows) and guid.isalnum()
    assert front.startswith("Question kv-size") and "The KV cache · hard" in front
    assert "<li>Stores K and V of past tokens per layer</li>" in back and ANSWER[:40] in back
    assert tags.split() == ["minillm", "kv-cache", "hard", "lab01", "lab04_2"]


def test_markdown_contains_every_question_with_folded_answers(bank_dir):
    bank = load_bank(bank_dir)
    md = to_markdown(list(bank.questions.values()), bank.topics)
    for q in bank.questions.values():
        assert q.question in md and f"`{q.id}`" in md
    assert md.count("<details>") == len(bank) == md.count("</details>")
    assert "## The KV cache (`kv-cache`)" in md and "## Serving (`serving`)" in md
    assert "*Estimate:* 40 GPUs at 250 RPS each" in md and "`minillm bench kv`" in md


def test_show_and_render_a_labs_questions(bank_dir, capsys):
    from minillm.quiz import render, show
    bank = load_bank(bank_dir)
    html = render(lab="lab12", fmt="html", bank=bank)
    assert "<details><summary>Answer</summary>" in html and "Question serve-design" in html
    assert "Question kv-what" not in html
    show(lab="lab04", bank=bank)
    out = capsys.readouterr().out
    assert "Question kv-size" in out and "<details>" in out and "Question kv-what" not in out
    with pytest.raises(SelectionError, match="valid labs: lab00"):
        render(lab="lab42", bank=bank)
    assert render(lab="LAB12", bank=bank).startswith("# Interview questions for lab12 (from one engine to a fleet)")


# ---- CLI -------------------------------------------------------------------------------------------------
def _main(*argv: str) -> int:
    from minillm.cli import main
    return main(list(argv))


def test_cli_unknown_topic_lab_level_list_the_valid_ones(bank_dir, data_dir, capsys):
    assert _main("quiz", "--bank", str(bank_dir), "--topic", "kv") == 2
    assert "unknown topic 'kv'; valid topics: kv-cache, serving" in capsys.readouterr().err
    assert _main("quiz", "--bank", str(bank_dir), "--lab", "lab99") == 2
    assert "valid labs: lab00, lab01" in capsys.readouterr().err
    assert _main("quiz", "--bank", str(bank_dir), "--level", "expert") == 2
    assert "valid levels: easy, medium, hard, system-design, scenario" in capsys.readouterr().err
    assert _main("quiz", "--bank", str(bank_dir), "--export", "pdf", "x.pdf") == 2
    assert "use anki or markdown" in capsys.readouterr().err


def test_cli_bank_error_is_reported_not_raised(bank_dir, data_dir, capsys):
    (bank_dir / "kv-cache.yaml").write_text("topic: kv-cache\ntitle: [\n")
    assert _main("quiz", "--bank", str(bank_dir), "--list") == 2
    err = capsys.readouterr().err
    assert "cannot load the question bank" in err and "kv-cache.yaml:" in err


def test_cli_list_for_a_learner_shows_the_built_labs_only(bank_dir, capsys, monkeypatch):
    """A learner sees the topics that exist and the labs they have; planned labs, planned topics and the authors'
    coverage report need --planned. (Which labs are built is pinned here: labs/ grows as labs land.)"""
    import minillm.quiz.cli as quiz_cli
    monkeypatch.setattr(quiz_cli, "built_labs", lambda: {f"lab{i:02d}" for i in range(11)})
    assert _main("quiz", "--bank", str(bank_dir), "--list") == 0
    out = capsys.readouterr().out
    assert "lab01 2" in out and "lab10" in out and "lab12" not in out and "lab11" not in out
    assert "(no file yet)" not in out and "coverage" not in out and "without evidence" not in out
    assert _main("quiz", "--bank", str(bank_dir), "--lab", "lab12") == 2
    assert "lab12 is planned, not built yet" in capsys.readouterr().err
    assert _main("quiz", "--bank", str(bank_dir), "--lab", "lab12", "--planned", "--list") == 0


def test_cli_list_shows_topics_counts_and_coverage(bank_dir, capsys):
    assert _main("quiz", "--bank", str(bank_dir), "--list", "--planned") == 0
    out = capsys.readouterr().out
    kv = next(l for l in out.splitlines() if l.startswith("kv-cache "))
    assert "The KV cache" in kv and kv.split()[-6:] == ["0", "1", "1", "0", "0", "2"]
    assert next(l for l in out.splitlines() if l.startswith("total")).split()[-1] == "4"
    assert "sampling" in out and "(no file yet)" in out
    assert "lab01 2" in out and "lab04 1" in out and "lab12 1" in out
    assert "1 seed questions mapped in sources.yaml to 1 distinct entries; 1 of them in the bank" in out
    assert "3 entries without evidence" in out


def test_cli_export_writes_files(bank_dir, tmp_path, capsys):
    out_csv, out_md = tmp_path / "out.csv", tmp_path / "out.md"
    assert _main("quiz", "--bank", str(bank_dir), "--export", "anki", str(out_csv)) == 0
    assert _main("quiz", "--bank", str(bank_dir), "--topic", "serving", "--export", "markdown", str(out_md)) == 0
    assert "wrote 2 questions" in capsys.readouterr().out
    assert len([r for r in csv.reader(out_csv.open()) if not r[0].startswith("#")]) == 4
    assert "serve-p99" in out_md.read_text() and "kv-what" not in out_md.read_text()


def test_cli_reset_deletes_progress(data_dir, capsys):
    data_dir.mkdir()
    (data_dir / "quiz.json").write_text("{}")
    assert _main("quiz", "--reset") == 0
    assert not (data_dir / "quiz.json").exists() and "deleted" in capsys.readouterr().out


def test_help_explains_scheduling_matching_and_storage(capsys):
    with pytest.raises(SystemExit):
        _main("quiz", "--help")
    out = " ".join(capsys.readouterr().out.split())
    assert "SM-2" in out and "keyword match, not a judge" in out and "MINILLM_DATA_DIR" in out


# ---- sessions --------------------------------------------------------------------------------------------
def _session(bank_dir: Path, script: str, store: ScheduleStore, inp=None) -> tuple[QuizSession, str]:
    bank = load_bank(bank_dir)
    out = io.StringIO()
    qs = [bank.questions["kv-what"], bank.questions["serve-design"]]
    session = QuizSession(qs, store.load(), store.save, inp=inp or io.StringIO(script), out=out, style=Style(False))
    session.summary = session.run()
    return session, out.getvalue()


def test_session_typed_answer_checklist_rating_and_quit(bank_dir, data_dir):
    store = ScheduleStore()
    script = "It stores K and V of past tokens for each layer\n\nmaybe\ng\n\nq\n"
    session, out = _session(bank_dir, script, store)
    assert "[1/2] kv-cache · medium" in out and "[2/2] serving · system-design" in out
    assert "[x] Stores K and V of past tokens per layer" in out and "[ ] Decode computes only the new token" in out
    assert "mentions 1 of 3 (a keyword match, not a judge)" in out
    assert "'maybe' is not a rating" in out
    assert "  - Stores K and V" in out                      # answered aloud: plain list for question 2
    assert "Requirements" in out and "40 GPUs at 250 RPS each" in out
    assert session.summary.stopped_by == "quit" and session.summary.rated["good"] == 1
    assert "Rated 1 of 2 questions (quit)" in out
    assert json.loads((data_dir / "quiz.json").read_text())["cards"].keys() == {"kv-what"}


def test_session_ctrl_c_saves_progress_and_exits_cleanly(bank_dir, data_dir):
    class CtrlCAfter(io.StringIO):
        """Feeds the first question's lines, then raises KeyboardInterrupt as a terminal's Ctrl-C does."""
        def readline(self, *a):
            line = super().readline(*a)
            if line == "":
                raise KeyboardInterrupt
            return line

    session, out = _session(bank_dir, "", ScheduleStore(), inp=CtrlCAfter("\ne\n"))
    assert session.summary.stopped_by == "interrupt" and "(interrupted)" in out
    assert "Progress saved to" in out
    cards = json.loads((data_dir / "quiz.json").read_text())["cards"]
    assert cards["kv-what"]["last_rating"] == "easy" and "serve-design" not in cards


def test_style_plain_when_piped_or_no_color(monkeypatch):
    class Tty(io.StringIO):
        def isatty(self):
            return True
    monkeypatch.delenv("NO_COLOR", raising=False)
    assert wants_color(Tty()) and not wants_color(io.StringIO()) and not wants_color(Tty(), no_color_flag=True)
    monkeypatch.setenv("NO_COLOR", "1")
    assert not wants_color(Tty())
    assert Style(color=False)("x", "bold") == "x" and Style(color=True)("x", "bold") == "\033[1mx\033[0m"


def _env(data: Path, tmp: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("NO_COLOR", "MINILLM_QUESTIONS")}
    env.update(MINILLM_DATA_DIR=str(data), TMPDIR=str(tmp), OMP_NUM_THREADS="1")
    return env


def test_scripted_session_end_to_end_via_subprocess(bank_dir, tmp_path):
    data = tmp_path / "data"
    script = "the cache stores K and V of past tokens for every layer\n\ng\n\nh\n"
    r = subprocess.run([sys.executable, "-m", "minillm", "quiz", "--n", "2", "--bank", str(bank_dir),
                        "--topic", "kv-cache", "--seed", "0"], input=script, capture_output=True, text=True,
                       env=_env(data, tmp_path), cwd=REPO, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "[1/2]" in r.stdout and "[2/2]" in r.stdout and "[x] Stores K and V" in r.stdout
    assert "\033[" not in r.stdout                       # piped: no colour codes
    assert "Rated 2 of 2 questions: again 0, hard 1, good 1, easy 0." in r.stdout
    cards = json.loads((data / "quiz.json").read_text())["cards"]
    assert set(cards) == {"kv-what", "kv-size"} and {c["last_rating"] for c in cards.values()} == {"good", "hard"}
    # The next round starts with the questions not seen yet (the serving ones); reviewed ones are not due.
    r2 = subprocess.run([sys.executable, "-m", "minillm", "quiz", "--n", "1", "--bank", str(bank_dir)],
                        input="", capture_output=True, text=True, env=_env(data, tmp_path), cwd=REPO, timeout=300)
    assert r2.returncode == 0 and "(0 due, 2 new)" in r2.stdout and "[1/1] serving" in r2.stdout
    assert "(end of input)" in r2.stdout and json.loads((data / "quiz.json").read_text())["cards"] == cards


def test_importing_minillm_quiz_does_not_import_torch():
    code = "import sys, minillm.quiz, minillm.quiz.cli; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO, timeout=300)


def test_question_from_dict_normalizes_whitespace():
    q = Question.from_dict(entry("x", answer="  two\n  lines  "))
    assert q.answer == "two lines" and q.design is None and q.labs == ("lab01",)
