"""The Anki export as Anki's text importer reads it (file headers, a GUID column that is stable so a re-import
updates notes), Markdown code rendered as HTML with the text escaped first, and no stray whitespace anywhere."""
from __future__ import annotations

import csv
import hashlib
import io
import random
import re
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minillm.quiz.bank import Question, load_bank
from minillm.quiz.export import note_guid, to_anki_csv, to_markdown
from minillm.quiz.markup import inline_html, normalize, to_html
from test_quiz import entry, write_topic

MESSY = entry("kv-messy", answer=("  Use `minillm bench kv`  to see **paged** vs contiguous; a <b> tag & an ampersand stay "
                                  "text.\n\n\n   The block table maps logical blocks to physical ones, per sequence, "
                                  "and the   allocator hands out fixed-size blocks on demand as tokens arrive.\n"
                                  "```python\nfor b in table:\n    print(b)\n```\n  Trailing words after the fence, "
                                  "enough of them to pass the sixty-word minimum for an answer in the bank here.  "),
              key_points=["  `kv_cache_bytes` counts **KV** heads  ", "Blocks of 16 tokens", "Copy-on-write < copy"],
              common_mistake="Reading `n_heads`\ninstead of `n_kv_heads`.  ")


@pytest.fixture
def bank(tmp_path: Path):
    d = tmp_path / "bank"
    write_topic(d, "kv-cache", [entry("kv-what"), MESSY, entry("kv-size", level="hard", labs=["lab01", "lab04_2"])],
                "The KV cache")
    write_topic(d, "serving", [entry("serve-design", topic="serving", level="system-design", labs=["lab12"])],
                "Serving")
    return load_bank(d)


def _anki_read(text: str) -> tuple[dict[str, str], list[dict[str, str]]]:
    """Parse an export the way Anki's importer does: '#key:value' header lines, then CSV records; the
    header's columns name each record's fields."""
    lines = text.split("\n")
    headers = {}
    while lines and lines[0].startswith("#"):
        key, _, value = lines.pop(0)[1:].partition(":")
        headers[key] = value
    columns = headers["columns"].split(",")
    rows = list(csv.reader(io.StringIO("\n".join(lines))))
    assert all(len(r) == len(columns) for r in rows)
    return headers, [dict(zip(columns, r)) for r in rows]


def test_anki_headers_name_the_guid_and_tags_columns(bank):
    headers, rows = _anki_read(to_anki_csv(bank.questions.values(), bank.topics))
    columns = headers["columns"].split(",")
    assert headers["separator"] == "comma" and headers["html"] == "true"
    assert columns[int(headers["guid column"]) - 1] == "GUID" and columns[int(headers["tags column"]) - 1] == "Tags"
    assert [r["Tags"].split()[:3] for r in rows][0] == ["minillm", "kv-cache", "medium"]


def test_guid_depends_on_the_entry_id_alone(bank):
    """Stable across runs, re-ordering and edits to the text, different for every id: a re-import updates."""
    qs = list(bank.questions.values())
    first = {r["Front"]: r["GUID"] for r in _anki_read(to_anki_csv(qs, bank.topics))[1]}
    shuffled = qs[:]
    random.Random(1).shuffle(shuffled)
    again = {r["Front"]: r["GUID"] for r in _anki_read(to_anki_csv(shuffled, bank.topics))[1]}
    assert again == first and len(set(first.values())) == len(qs)
    edited = Question.from_dict({**entry("kv-what"), "question": "Reworded?", "answer": "changed " * 70})
    assert note_guid(edited.id) == _anki_read(to_anki_csv([edited]))[1][0]["GUID"] == first[
        next(f for f in first if f.startswith("Question kv-what"))]
    # Pinned: a change to the derivation would turn every card a learner imported into a duplicate on re-import.
    g = note_guid("kv-cache-size-formula")
    assert g == "I2PEbVZElaQ"
    digits = "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
    assert sum(digits.index(c) * 62 ** i for i, c in enumerate(reversed(g))) == int.from_bytes(
        hashlib.sha256(b"minillm:kv-cache-size-formula").digest()[:8], "big")


@settings(max_examples=200, deadline=None, derandomize=True)
@given(st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789-", min_size=1, max_size=60))
def test_guids_are_short_alphanumeric_and_safe_in_a_csv_cell(qid):
    g = note_guid(qid)
    assert g.isascii() and g.isalnum() and 1 <= len(g) <= 11


def test_markdown_code_and_bold_become_html_after_escaping(bank):
    back = next(r["Back"] for r in _anki_read(to_anki_csv(bank.questions.values(), bank.topics))[1]
                if "kv_cache_bytes" in r["Back"])
    assert "<code>minillm bench kv</code>" in back and "<b>paged</b>" in back
    assert "a &lt;b&gt; tag &amp; an ampersand" in back and "<b> tag" not in back
    assert "<pre><code>for b in table:<br>    print(b)</code></pre>" in back
    assert "<li><code>kv_cache_bytes</code> counts <b>KV</b> heads</li>" in back and "Copy-on-write &lt; copy" in back
    assert "Reading <code>n_heads</code> instead of <code>n_kv_heads</code>." in back


@pytest.mark.parametrize("text, html", [
    ("`a **b** c`", "<code>a **b** c</code>"),              # no bold inside code
    ("**`x`** and `<y>`", "<b><code>x</code></b> and <code>&lt;y&gt;</code>"),
    ("2 ** 3 is 8", "2 ** 3 is 8"),                          # not bold: spaces inside the stars
    ("an ` unpaired tick", "an ` unpaired tick"),
])
def test_inline_markdown(text, html):
    assert inline_html(text) == html


def _strays(field: str) -> list[str]:
    """Whitespace a reader would see as stray: leading/trailing, doubled, or blank lines (inside <pre> excepted)."""
    outside = re.sub(r"<pre>.*?</pre>", "<pre/>", field, flags=re.S)
    problems = []
    if field != field.strip():
        problems.append("leading/trailing whitespace")
    if re.search(r"  |\n", outside):
        problems.append("doubled space or newline")
    if re.search(r"<(p|li|dd|div|code|b)>\s|\s</(p|li|dd|div|code|b)>", field):
        problems.append("space just inside a tag")
    return problems


def test_no_stray_whitespace_in_any_anki_field(bank):
    text = to_anki_csv(bank.questions.values(), bank.topics)
    assert text.endswith("\n") and not text.endswith("\n\n") and "\r" not in text
    for row in _anki_read(text)[1]:
        for name, field in row.items():
            assert not _strays(field), (row["GUID"], name, _strays(field), field)


def test_markdown_export_has_no_stray_whitespace_and_keeps_fences(bank):
    md = to_markdown(list(bank.questions.values()), bank.topics)
    assert "\n\n\n" not in md and not re.search(r"[ \t]+\n", md) and md.endswith("\n") and not md.endswith("\n\n")
    assert "```\nfor b in table:\n    print(b)\n```" in md


@settings(max_examples=200, deadline=None, derandomize=True)
@given(st.text(alphabet=" \n\tab`*<&>", max_size=40))
def test_normalize_and_html_never_leave_stray_whitespace_or_raw_markup(text):
    norm = normalize(text)
    assert norm == norm.strip() and "  " not in norm.replace("\n", "|") or "```" in norm
    html = to_html(text)
    assert "<pre>" in html or not _strays(html) or html == ""
    assert not re.search(r"<(?!/?(code|b|pre|br)>)", html)       # every other '<' arrived escaped
