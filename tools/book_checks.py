"""Checks of the built book (book/_build/html), shared by `tools/build_book.py --check` and tests/test_book.py.

`problems(html_dir, labs, topics)` lists what is wrong, one line each (empty: the site is fine):
  - a lab of solutions/ or a topic of questions/ without its page;
  - a local link or image (href / src) that points at no file;
  - anything the page would load from the network (a script, stylesheet, image, font or CSS @import over http);
  - a line of any `### BEGIN SOLUTION` region of solutions/ in a page's text or in the book's generated sources.
"""
from __future__ import annotations

import json
import re
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit

ROOT = Path(__file__).resolve().parents[1]
SOLUTION_RE = re.compile(r"### BEGIN SOLUTION\n(.*?)### END SOLUTION", re.S)
LOADED = {("script", "src"), ("img", "src"), ("link", "href"), ("source", "src"), ("iframe", "src"),
          ("video", "src"), ("audio", "src"), ("embed", "src")}
MIN_LINE = 24       # shorter solution lines (`return out`) also occur in ordinary prose and stubs


class _Page(HTMLParser):
    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.refs: list[tuple[str, str, str]] = []    # (tag, attribute, value)
        self.text: list[str] = []

    def handle_starttag(self, tag: str, attrs: list) -> None:
        for name, value in attrs:
            if name in ("href", "src") and value:
                self.refs.append((tag, name, value))

    def handle_data(self, data: str) -> None:
        self.text.append(data)


def solution_lines(labs: list[str]) -> dict[str, set[str]]:
    """Per lab, the solution regions' lines worth looking for (whitespace-normalized, at least MIN_LINE long)."""
    out = {}
    for lab in labs:
        src = (ROOT / "solutions" / lab / f"{lab}.py").read_text()
        lines = set()
        for region in SOLUTION_RE.findall(src):
            for line in region.splitlines():
                line = " ".join(line.lstrip("# ").split()) if line.lstrip().startswith("# ") else " ".join(line.split())
                if len(line) >= MIN_LINE:
                    lines.add(line)
        out[lab] = lines
    return out


def _released_lines(lab: str) -> str:
    """The release notebook's text: a line it shows anyway (the statement spelling out a step, a stub's docstring)
    is no leak."""
    nb = json.loads((ROOT / "labs" / lab / f"{lab}.ipynb").read_text())
    text = " ".join("".join(c["source"]) if isinstance(c["source"], list) else c["source"] for c in nb["cells"])
    return " ".join(text.replace("`", " ").split())


def problems(html_dir: Path, labs: list[str], topics: list[str]) -> list[str]:
    found: list[str] = []
    pages = sorted(html_dir.rglob("*.html"))
    if not pages:
        return [f"{html_dir}: no HTML pages (build the book first: make book)"]
    for lab in labs:
        if not (html_dir / "_generated" / "labs" / f"{lab}.html").is_file():
            found.append(f"lab {lab} has no chapter (_generated/labs/{lab}.html)")
    for topic in topics:
        if not (html_dir / "_generated" / "questions" / f"{topic}.html").is_file():
            found.append(f"question topic {topic} has no page (_generated/questions/{topic}.html)")
    secret = solution_lines(labs)
    shown = {lab: _released_lines(lab) for lab in labs}
    for page in pages:
        parser = _Page()
        source = page.read_text(errors="replace")
        parser.feed(source)
        rel = page.relative_to(html_dir)
        if rel.parts[0] in ("_static", "_sources"):      # theme templates and page sources, not pages
            continue
        for tag, attr, value in parser.refs:
            parts = urlsplit(value)
            if parts.scheme in ("http", "https") or value.startswith("//"):
                if (tag, attr) in LOADED and (tag != "link" or _is_loaded_link(source, value)):
                    found.append(f"{rel}: <{tag} {attr}={value!r}> loads from the network")
                continue
            if parts.scheme or value.startswith("#") or not parts.path:
                continue
            target = (page.parent / unquote(parts.path)).resolve()
            if not target.exists():
                found.append(f"{rel}: <{tag} {attr}={value!r}> points at no file")
        text = " ".join(" ".join(parser.text).split())
        for lab, lines in secret.items():
            for line in lines:
                if line in text and line not in shown[lab]:
                    found.append(f"{rel}: shows solution code of {lab}: {line[:80]!r}")
    for css in html_dir.rglob("*.css"):
        for url in re.findall(r"@import\s+(?:url\()?['\"]?(https?://[^'\")]+)", css.read_text(errors="replace")):
            found.append(f"{css.relative_to(html_dir)}: @import {url} loads from the network")
    generated = html_dir.parents[1] / "_generated"
    for src in generated.rglob("*") if generated.is_dir() else []:
        if src.suffix in (".ipynb", ".md"):
            text = " ".join(src.read_text(errors="replace").split())
            for lab, lines in secret.items():
                leaked = [ln for ln in lines if ln in text and ln not in shown[lab]]
                if leaked:
                    found.append(f"book/_generated/{src.relative_to(generated)}: holds solution code of {lab}: "
                                 f"{leaked[0][:80]!r}")
    return found


def _is_loaded_link(page_source: str, href: str) -> bool:
    """A <link> loads its href when it is a stylesheet, a preload or an icon; a canonical/alternate one does not."""
    for m in re.finditer(r"<link\b[^>]*>", page_source):
        tag = m.group(0)
        if href in tag:
            rel = re.search(r'rel="([^"]*)"', tag)
            return bool(rel and re.search(r"stylesheet|preload|icon|modulepreload|prefetch", rel.group(1)))
    return True
