"""Export the bank: an Anki CSV (Front, Back, Tags) or one Markdown document with folded answers."""
from __future__ import annotations

import csv
import html
import io
from typing import Iterable, Sequence

from minillm.quiz.bank import LABS, Question

FORMATS = ("anki", "markdown")

# Anki (2.1.55+) reads these header lines: no import dialog fiddling to get HTML fields and tags right.
ANKI_HEADER = "#separator:comma\n#html:true\n#columns:Front,Back,Tags\n#tags column:3\n"


def _lab_label(lab: str) -> str:
    return f"{lab} ({LABS.get(lab.split('_')[0], '?')})"


def anki_rows(questions: Iterable[Question], titles: dict[str, str] | None = None) -> list[tuple[str, str, str]]:
    """(front, back, tags) per question; front and back are HTML, tags are space-separated (Anki's format)."""
    rows = []
    for q in questions:
        e = html.escape
        topic = (titles or {}).get(q.topic, q.topic)
        front = f"{e(q.question)}<br><small>{e(topic)} · {e(q.level)}</small>"
        back = [f"<p>{e(q.answer)}</p>", "<ul>" + "".join(f"<li>{e(k)}</li>" for k in q.key_points) + "</ul>",
                f"<p><b>Common mistake:</b> {e(q.common_mistake)}</p>"]
        if q.design is not None:
            back.append("<dl>" + "".join(f"<dt>{name}</dt><dd>{e(text)}</dd>" for name, text in _design(q)) + "</dl>")
        back.append(f"<p><small>Labs: {e(', '.join(_lab_label(l) for l in q.labs))}</small></p>")
        tags = ["minillm", q.topic, q.level, *q.labs]
        rows.append((front, "".join(back), " ".join(tags)))
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
    return " ".join(text.split())


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
