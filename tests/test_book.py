"""The course book (book/, tools/build_book.py): built offline with warnings as errors, every lab of solutions/ and
every topic of questions/ a page, local links and images that resolve, nothing loaded from the network, no
solution code anywhere, and a page a browser renders.

Marked `book`: `make test` runs these after the main suite, whose nbgrader autograde runs leave executed solution
notebooks in book/_cache, so the build executes nothing there (a lab missing from the cache is executed).
"""
from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import book_checks  # noqa: E402
import build_book  # noqa: E402

pytestmark = pytest.mark.book


@pytest.fixture(scope="module")
def site() -> Path:
    return build_book.build(progress=lambda msg: print(f"[book] {msg}"))


def test_every_lab_and_topic_has_a_page_and_the_site_is_self_contained(site):
    labs, topics = build_book.lab_ids(), sorted(build_book.question_pages())
    assert labs and topics
    assert book_checks.problems(site.parent, labs, topics) == []
    toc = (build_book.BOOK / "_toc.yml").read_text()
    assert all(f"_generated/labs/{lab}" in toc for lab in labs)       # a new lab folder gets its chapter


def test_chapters_show_outputs_and_never_an_answer(site):
    """A chapter carries the solution run's outputs (plots included) while its answer cells show the release stub."""
    html = (site.parent / "_generated" / "labs" / "lab01.html").read_text()
    page = book_checks._Page()
    page.feed(html)
    text = " ".join(" ".join(page.text).split())
    assert "raise NotImplementedError" in text                  # the answer cells' stubs
    assert "cell_output" in html and "<img" in html              # outputs of the run, a plot among them


def test_the_checks_catch_a_leak_a_remote_asset_and_a_broken_link(tmp_path):
    """The site checks can fail: a page showing a solution line, loading a CDN script and linking a missing file."""
    lab = build_book.lab_ids()[1]
    line = sorted(book_checks.solution_lines([lab])[lab])[0]
    html = tmp_path / "html"
    (html / "_generated" / "labs").mkdir(parents=True)
    (html / "index.html").write_text(
        f'<html><head><script src="https://cdn.example/mathjax.js"></script></head><body><pre>{line}</pre>'
        '<a href="missing.html">x</a><a href="https://example.org/">fine: a link, not a load</a></body></html>')
    found = book_checks.problems(html, [lab], [])
    assert any("loads from the network" in p for p in found)
    assert any("shows solution code" in p for p in found)
    assert any("points at no file" in p for p in found)
    assert any(f"lab {lab} has no chapter" in p for p in found)
    assert not any("example.org" in p for p in found)


def _chromium() -> str | None:
    return next((shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome") if shutil.which(n)), None)


@pytest.mark.parametrize("page", ["index.html", "_generated/labs/lab02.html"])
def test_a_browser_renders_the_page(site, page):
    browser = _chromium()
    if browser is None:
        pytest.skip("no Chromium on this machine (Debian: apt-get install chromium; `make book-browser` tries)")
    from PIL import Image
    shots = site.parent / "_screenshots"
    shots.mkdir(exist_ok=True)
    png = shots / (page.replace("/", "_").replace(".html", ".png"))
    png.unlink(missing_ok=True)
    with tempfile.TemporaryDirectory() as profile:
        # a virtual-time budget lets the page load its styles and scripts before the shot
        done = subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                               f"--user-data-dir={profile}", "--virtual-time-budget=5000", "--window-size=1280,900",
                               f"--screenshot={png}", (site.parent / page).as_uri()],
                              capture_output=True, text=True, timeout=300, check=False)   # a hang guard
    assert png.is_file(), f"Chromium wrote no screenshot of {page}: {done.stderr[-1500:]}"
    img = Image.open(png).convert("L")
    lo, hi = img.getextrema()
    assert img.size == (1280, 900) and hi - lo > 100, f"the screenshot of {page} is blank"


def test_math_renders_from_the_books_own_mathjax(site):
    """The architecture page's formula is typeset by the MathJax copy inside the site (no CDN)."""
    browser = _chromium()
    if browser is None:
        pytest.skip("no Chromium on this machine (Debian: apt-get install chromium; `make book-browser` tries)")
    with tempfile.TemporaryDirectory() as profile:
        done = subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", f"--user-data-dir={profile}",
                               "--virtual-time-budget=15000", "--dump-dom",
                               (site.parent / "architecture.html").as_uri()],
                              capture_output=True, text=True, timeout=300, check=False)     # a hang guard
    assert 'class="MathJax_Display"' in done.stdout and done.stdout.count('class="MathJax"') >= 5, done.stderr[-1500:]
