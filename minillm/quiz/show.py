"""Notebook use: `minillm.quiz.show(lab="lab02")` renders a lab's questions with their answers folded away.

In Jupyter it displays HTML (<details> blocks); anywhere else it prints Markdown. `render` returns the text.
"""
from __future__ import annotations

import html
from typing import Sequence

from minillm.quiz.bank import Bank, Question, load_bank, normalize_lab, normalize_topic
from minillm.quiz.export import _design, _html_list, _lab_label, to_markdown
from minillm.quiz.markup import to_html


def _select(bank: Bank | None, lab: str | None, topic: str | None, level: str | None) -> tuple[Bank, list[Question]]:
    bank = bank if bank is not None else load_bank()
    return bank, bank.select([topic] if topic else [], level=level, lab=lab)


def _title(lab: str | None, topic: str | None, bank: Bank) -> str:
    if lab:
        return f"Interview questions for {_lab_label(lab)}"
    if topic:
        return f"Interview questions: {bank.topics.get(topic, topic)}"
    return "minillm interview questions"


def _html(questions: Sequence[Question], title: str) -> str:
    e = html.escape
    parts = [f"<h3>{e(title)}</h3>"]
    if not questions:
        parts.append("<p><i>No questions yet.</i></p>")
    for q in questions:
        body = [f"<div>{to_html(q.answer)}</div>", "<p><b>Key points</b></p>" + _html_list(q.key_points),
                f"<p><b>Common mistake:</b> {to_html(q.common_mistake)}</p>"]
        if q.design is not None:
            body.append("<ul>" + "".join(f"<li><i>{n}:</i> {to_html(t)}</li>" for n, t in _design(q)) + "</ul>")
        body.append("<p><b>Follow-ups</b></p>" + _html_list(q.follow_ups))
        if q.evidence:
            body.append("<p><b>Evidence:</b> " + ", ".join(f"<code>{e(x)}</code>" for x in q.evidence) + "</p>")
        parts.append(f"<p><b>{to_html(q.question)}</b> <small>({e(q.level)}, {e(q.topic)})</small></p>"
                     f"<details><summary>Answer</summary>{''.join(body)}</details>")
    return "\n".join(parts)


def render(lab: str | None = None, topic: str | None = None, level: str | None = None, fmt: str = "markdown",
           bank: Bank | None = None) -> str:
    """The selected questions as 'markdown' or 'html' text (filters compared case-insensitively)."""
    bank, questions = _select(bank, lab, topic, level)
    title = _title(normalize_lab(lab) if lab else None, normalize_topic(topic, bank.topics) if topic else None, bank)
    if fmt == "html":
        return _html(questions, title)
    if fmt == "markdown":
        return to_markdown(questions, bank.topics, heading=title) if questions else f"# {title}\n\nNo questions yet.\n"
    raise ValueError(f"unknown format {fmt!r}; use 'markdown' or 'html'")


def _in_notebook() -> bool:
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    shell = get_ipython()
    return shell is not None and "IPKernelApp" in getattr(shell, "config", {})


def show(lab: str | None = None, topic: str | None = None, level: str | None = None, bank: Bank | None = None) -> None:
    """Display the questions of a lab (or topic/level): folded HTML in Jupyter, Markdown text elsewhere."""
    if _in_notebook():
        from IPython.display import HTML, display
        display(HTML(render(lab, topic, level, "html", bank)))
    else:
        print(render(lab, topic, level, "markdown", bank))
