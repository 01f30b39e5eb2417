"""Export the bank: an Anki CSV (GUID, Front, Back, Tags) or one Markdown document with folded answers."""
from __future__ import annotations

import csv
import hashlib
import io
from typing import Iterable, Sequence

from minillm.quiz.bank import LABS, Question
from minillm.quiz.markup import inline_html, normalize, to_html

FORMATS = ("anki", "markdown")

# Anki (2.1.55+) reads these header lines (its manual, "Importing > Text Files > File Headers"): HTML fields,
# the tags column, and a GUID column so that importing a newer export updates the notes already imported (their
# review history kept) instead of adding duplicates. Column 1 holds the GUID, as in Anki's own text export.
ANKI_HEADER = ("#separator:comma\n#html:true\n#notetype:Basic\n#columns:GUID,Front,Back,Tags\n"
               "#guid column:1\n#tags column:4\n")

_BASE62 = "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"


def note_guid(qid: str) -> str:
    """The Anki note GUID for a bank entry: 64 bits of sha256('minillm:' + id) in base 62, the shape of Anki's
    own random 64-bit GUIDs without their punctuation. It depends on the id alone, so it is the same on every
    export and whatever the order; renaming an entry's id makes a new note."""
    n = int.from_bytes(hashlib.sha256(f"minillm:{qid}".encode()).digest()[:8], "big")
    out = ""
    while True:
        n, r = divmod(n, 62)
        out = _BASE62[r] + out
        if not n:
            return out


def _lab_label(lab: str) -> str:
    return f"{lab} ({LABS.get(lab.split('_')[0], '?')})"


def _html_list(items: Iterable[str]) -> str:
    return "<ul>" + "".join(f"<li>{to_html(i)}</li>" for i in items) + "</ul>"


def anki_rows(questions: Iterable[Question], titles: dict[str, str] | None = None) -> list[tuple[str, str, str, str]]:
    """(guid, front, back, tags) per question; front and back are single-line HTML, tags space-separated."""
    rows = []
    for q in questions:
        topic = (titles or {}).get(q.topic, q.topic)
        front = f"{to_html(q.question)}<br><small>{inline_html(topic)} · {q.level}</small>"
        back = [f"<div>{to_html(q.answer)}</div>", _html_list(q.key_points),
                f"<p><b>Common mistake:</b> {to_html(q.common_mistake)}</p>"]
        if q.design is not None:
            back.append("<dl>" + "".join(f"<dt>{name}</dt><dd>{to_html(text)}</dd>" for name, text in _design(q))
                        + "</dl>")
        back.append(f"<p><small>Labs: {inline_html(', '.join(_lab_label(l) for l in q.labs))}</small></p>")
        tags = ["minillm", q.topic, q.level, *q.labs]
        rows.append((note_guid(q.id), front, "".join(back), " ".join(tags)))
    return rows


def to_anki_csv(questions: Iterable[Question], titles: dict[str, str] | None = None) -> str:
    buf = io.StringIO()
    buf.write(ANKI_HEADER)
    csv.writer(buf, lineterminator="\n").writerows(anki_rows(questions, titles))
    return buf.getvalue()


def _design(q: Question) -> list[tuple[str, str]]:
    d = q.design
    assert d is not None
    return [("Requirements", d.requirements), ("Estimate", d.estimate), ("Architecture", d.architecture),
            ("Trade-offs", d.trade_offs)]


def _one_line(text: str) -> str:
    """The text as one Markdown paragraph (a fenced block keeps its own lines)."""
    return normalize(text)


def question_markdown(q: Question, heading: str = "###") -> str:
    """One question: heading, level and labs, then everything else folded inside <details>."""
    out = [f"{heading} {_one_line(q.question)}", "",
           f"*{q.level}* · {', '.join(_lab_label(l) for l in q.labs)} · `{q.id}`", "",
           "<details><summary>Answer</summary>", "", _one_line(q.answer), "", "**Key points**", ""]
    out += [f"- {k}" for k in q.key_points]
    out += ["", f"**Common mistake:** {_one_line(q.common_mistake)}", ""]
    if q.design is not None:
        out += ["**Design**", ""] + [f"- *{name}:* {_one_line(text)}" for name, text in _design(q)] + [""]
    out += ["**Follow-ups**", ""] + [f"- {f}" for f in q.follow_ups] + [""]
    if q.evidence:
        out += ["**Evidence:** " + ", ".join(f"`{e}`" for e in q.evidence), ""]
    out += ["</details>", ""]
    return "\n".join(out)


def to_markdown(questions: Sequence[Question], titles: dict[str, str], heading: str | None = None) -> str:
    """One section per topic (in bank order), each question with its answer folded."""
    out = [f"# {heading or 'minillm interview questions'}", ""]
    by_topic: dict[str, list[Question]] = {}
    for q in questions:
        by_topic.setdefault(q.topic, []).append(q)
    for topic in [t for t in titles if t in by_topic] + [t for t in by_topic if t not in titles]:
        out += [f"## {titles.get(topic, topic)} (`{topic}`)", ""]
        out += [question_markdown(q) for q in by_topic[topic]]
    return "\n".join(out).rstrip() + "\n"
