"""The page at `/` in headless Chromium (Debian's, driven by Playwright): type a message, see the answer stream in,
see the engine view's KV-pool picture change; a screenshot is saved. Skips with the reason where Chromium or
Playwright is missing (`make book-browser` installs Chromium on Debian)."""
from __future__ import annotations

import shutil

import httpx
import pytest

from minillm import LLM
from minillm.serve.server import BackgroundServer
from tests.tiny_models import tiny_model_dir

CHROMIUM = next((shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome") if shutil.which(n)), None)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = tiny_model_dir(tmp_path_factory.mktemp("tiny") / "model", context=256)
    with LLM(str(path), num_blocks=64, block_size=4) as llm, BackgroundServer(llm.engine, name="tiny") as s:
        yield s


def test_the_page_and_its_files_are_served_from_the_server_itself(server):
    page = httpx.get(server.base + "/")
    assert page.status_code == 200 and "text/html" in page.headers["content-type"]
    for ref in ("/static/app.js", "/static/style.css"):
        assert ref in page.text and httpx.get(server.base + ref).status_code == 200
    assert "http://" not in page.text and "https://" not in page.text          # nothing loaded from elsewhere
    state = httpx.get(server.base + "/engine/state").json()
    assert state["num_blocks"] == 64 and len(state["pool"]) == 64 and state["used"] == 0
    assert state["used"] + state["cached"] + state["free"] == 64 and state["running"] == []


@pytest.mark.slow
def test_chat_streams_and_the_pool_picture_changes_in_chromium(server, tmp_path):
    if CHROMIUM is None:
        pytest.skip("no Chromium on this machine (Debian: apt-get install chromium; `make book-browser` tries)")
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (pip install playwright)")
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 860})
            page.set_default_timeout(120_000)       # a hang guard for a busy machine, not a budget
            page.goto(server.base + "/")
            page.wait_for_selector("#conn.ok")                                      # the event stream is live
            page.wait_for_function("document.getElementById('model').textContent === 'tiny'")
            before = page.evaluate("document.getElementById('pool').toDataURL()")
            page.fill("#max_tokens", "40")
            page.fill("#input", "ab ab ab")
            page.press("#input", "Enter")
            page.wait_for_selector(".msg.assistant .meta", timeout=60_000)         # streamed to the end
            answer = page.inner_text(".msg.assistant")
            assert "first token after" in answer and "error" not in answer
            page.wait_for_function("Number(document.getElementById('step').textContent) > 0")
            page.wait_for_function(f"document.getElementById('pool').toDataURL() !== {before!r}")
            page.wait_for_function("document.getElementById('poolinfo').textContent.includes(': 0 in use')")
            info = page.inner_text("#poolinfo")                                   # the request's end, seen live
            assert "64 blocks of 4 tokens" in info and " 0 cached" not in info     # the prefix stays cached
            page.screenshot(path=str(tmp_path / "serve-page.png"), full_page=True)
        finally:
            browser.close()
    assert (tmp_path / "serve-page.png").stat().st_size > 20_000
