"""The little Markdown the bank's text uses, for every place that shows it: `code`, **bold** and fenced code
blocks. `normalize` collapses whitespace outside fences (YAML folding leaves ragged spaces); `to_html` renders
for Anki and notebooks, escaping the text first so a '<' in an answer stays a '<'.
"""
from __future__ import annotations

import html
import re
import textwrap

# A fence: ``` (optionally ```lang) on its own line, the code, ``` on its own line.
_FENCE = re.compile(r"^[ \t]*```[^\n`]*\n(.*?)^[ \t]*```[ \t]*$", re.M | re.S)
_CODE = re.compile(r"`([^`\s](?:[^`\n]*[^`\s])?)`")     # `x`, `a b`; not ` ` or a lone tick
_BOLD = re.compile(r"\*\*(?=\S)(.+?)(?<=\S)\*\*")


def split_fences(text: str) -> list[tuple[bool, str]]:
    """[(is_code, chunk), ...] in order; code chunks are dedented, without their fence lines or final newline."""
    out: list[tuple[bool, str]] = []
    at = 0
    for m in _FENCE.finditer(text):
        out.append((False, text[at:m.start()]))
        out.append((True, textwrap.dedent(m.group(1)).rstrip("\n")))
        at = m.end()
    out.append((False, text[at:]))
    return [(code, chunk) for code, chunk in out if code or chunk.strip()]


def normalize(text: str) -> str:
    """Whitespace collapsed to single spaces outside fenced blocks; each fence kept on lines of its own."""
    return "\n".join(f"```\n{chunk}\n```" if code else " ".join(chunk.split()) for code, chunk in split_fences(text))


def inline_html(text: str) -> str:
    """One paragraph: whitespace collapsed, escaped, then `code` -> <code>, **bold** -> <b> (not inside code)."""
    codes: list[str] = []

    def keep(m: re.Match) -> str:
        codes.append(f"<code>{m.group(1)}</code>")
        return f"\x00{len(codes) - 1}\x00"

    out = _CODE.sub(keep, html.escape(" ".join(text.split()), quote=False))
    out = _BOLD.sub(r"<b>\1</b>", out)
    return re.sub(r"\x00(\d+)\x00", lambda m: codes[int(m.group(1))], out)


def to_html(text: str) -> str:
    """Paragraph text and fenced code as HTML on one line: code lines joined by <br> inside <pre><code>."""
    parts = []
    for code, chunk in split_fences(text):
        if code:
            parts.append("<pre><code>" + "<br>".join(html.escape(l, quote=False) for l in chunk.split("\n"))
                         + "</code></pre>")
        else:
            parts.append(inline_html(chunk))
    return "".join(parts)
