#!/usr/bin/env python
"""Build the course book (Jupyter Book 1.x, offline) from the single sources: solutions/, labs/, questions/, the
CLI's parser and the engine's docstrings.

    python tools/build_book.py            # generate book/_generated, execute what the cache lacks, build the HTML
    python tools/build_book.py --check    # ... then check the site (every lab and topic has a page, links and
                                          #     images resolve, nothing loads from the network, no solution code)
    python tools/build_book.py --serve    # serve book/_build/html on 127.0.0.1

A lab's chapter is its *release* notebook (labs/labNN: answer cells hold the stub, never the solution) with the
outputs of the *solution* notebook run top to bottom (the answer cells' outputs dropped): the learner reads what
the lab shows without seeing an answer. Executions are cached in book/_cache, keyed by the solution notebook's
hash; `make test` fills the cache from its nbgrader autograde runs (store_execution), so the book's build there
executes nothing.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import hashlib
import http.server
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import build_notebooks  # noqa: E402

BOOK = ROOT / "book"
GENERATED = BOOK / "_generated"
CACHE = BOOK / "_cache"
HTML = BOOK / "_build" / "html"
EXECUTE_TIMEOUT = 1800      # a hang guard for one notebook, not a budget
SOLUTION_RE = re.compile(r"### BEGIN SOLUTION(.*?)### END SOLUTION", re.S)


# --------------------------------------------------------------------------- executions (cached)

def lab_ids() -> list[str]:
    return build_notebooks.lab_ids(ROOT)


def solution_path(lab: str) -> Path:
    return ROOT / "solutions" / lab / f"{lab}.ipynb"


def source_hash(lab: str) -> str:
    return hashlib.sha256(solution_path(lab).read_bytes()).hexdigest()[:16]


def cache_path(lab: str) -> Path:
    return CACHE / f"{lab}-{source_hash(lab)}.ipynb"


def store_execution(lab: str, executed: nbformat.NotebookNode) -> None:
    """Keep an executed run of the solution notebook as it is today (tests/test_course.py's autograde run calls
    this), replacing runs of older versions."""
    CACHE.mkdir(parents=True, exist_ok=True)
    for old in CACHE.glob(f"{lab}-*.ipynb"):
        old.unlink()
    tmp = cache_path(lab).with_suffix(".tmp")
    nbformat.write(executed, tmp)
    tmp.replace(cache_path(lab))


def execute(lab: str) -> nbformat.NotebookNode:
    """The solution notebook run top to bottom in a copy of its folder (what it writes stays there)."""
    from nbclient import NotebookClient
    nb = nbformat.read(solution_path(lab), as_version=4)
    with tempfile.TemporaryDirectory(prefix=f"minillm-book-{lab}-") as tmp:
        work = Path(tmp) / lab
        shutil.copytree(solution_path(lab).parent, work)
        env_cwd = str(work)
        NotebookClient(nb, timeout=EXECUTE_TIMEOUT, kernel_name="python3",
                       resources={"metadata": {"path": env_cwd}}).execute()
    store_execution(lab, nb)
    return nb


def executed(labs: list[str], jobs: int = 2, progress=print) -> dict[str, nbformat.NotebookNode]:
    """Every lab's executed solution notebook: from the cache, running the missing ones (`jobs` at a time)."""
    out = {lab: nbformat.read(cache_path(lab), as_version=4) for lab in labs if cache_path(lab).is_file()}
    missing = [lab for lab in labs if lab not in out]
    if missing and jobs > 1:
        # kernels running side by side each get an even share of the cores: torch's and the C kernels' OpenMP teams
        # spin at barriers and collapse when two teams fight over the same cores (the kernels inherit this)
        os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // jobs))
    if missing:
        progress(f"executing {len(missing)} notebook(s) not in book/_cache: {' '.join(missing)}")
        with concurrent.futures.ThreadPoolExecutor(max(1, jobs)) as pool:
            for lab, nb in zip(missing, pool.map(execute, missing)):
                progress(f"  executed {lab}")
                out[lab] = nb
    return out


# --------------------------------------------------------------------------- chapters

def is_answer(cell) -> bool:
    return bool(cell.metadata.get("nbgrader", {}).get("solution"))


def chapter(lab: str, run: nbformat.NotebookNode) -> nbformat.NotebookNode:
    """The release notebook with the solution run's outputs; answer cells keep their stub and show no output."""
    release = nbformat.read(ROOT / "labs" / lab / f"{lab}.ipynb", as_version=4)
    if [c.cell_type for c in release.cells] != [c.cell_type for c in run.cells]:
        raise SystemExit(f"labs/{lab} and solutions/{lab} have different cells: run `make labs`")
    for mine, ran in zip(release.cells, run.cells):
        if mine.cell_type != "code":
            continue
        mine.outputs = [] if is_answer(mine) else ran.get("outputs", [])
        mine.execution_count = None if is_answer(mine) else ran.get("execution_count")
        if SOLUTION_RE.search(mine.source):
            raise SystemExit(f"labs/{lab}: a solution region survived the release: run `make labs`")
    release.metadata.pop("widgets", None)
    return release


# --------------------------------------------------------------------------- question pages

def _md(text: str) -> str:
    return " ".join(str(text).split())


def topic_page(topic: str, title: str, questions: list) -> str:
    lines = [f"# {title}", "",
             f"The `{topic}` questions of the bank (`questions/{topic}.yaml`), answered in the project's own words; "
             f"rehearse them with `minillm quiz --topic {topic}`.", ""]
    for q in questions:
        labs = ", ".join(_lab_link(lab) for lab in q.labs)
        lines += [f"## {_md(q.question)}", "", f"*{q.level}* · labs: {labs}", "",
                  ":::{dropdown} Answer", _md(q.answer), ""]
        if q.design is not None:
            for name, text in vars(q.design).items():
                lines += [f"**{name.replace('_', ' ').capitalize()}.** {_md(text)}", ""]
        lines += ["**Key points**", ""] + [f"- {_md(p)}" for p in q.key_points] + [""]
        lines += [f"**A common mistake.** {_md(q.common_mistake)}", ""]
        if q.evidence:
            lines += ["**Evidence:** " + ", ".join(f"`{e}`" for e in q.evidence), ""]
        lines += [":::", ""]
    return "\n".join(lines)


def _lab_link(lab: str) -> str:
    """A link to the lab's chapter, or its name alone for a lab the bank cites before it exists (planned)."""
    folder = lab.split("_")[0]
    if folder in lab_ids():
        return f"[{lab}](../labs/{folder}.ipynb)"
    return f"{lab} (planned)"


def question_pages() -> dict[str, str]:
    from minillm.quiz.bank import load_bank
    bank = load_bank(ROOT / "questions")
    topics: dict[str, list] = {}
    for q in bank.questions.values():
        topics.setdefault(q.topic, []).append(q)
    titles = {}
    for path in sorted((ROOT / "questions").glob("*.yaml")):
        import yaml
        data = yaml.safe_load(path.read_text())
        if isinstance(data, dict) and "topic" in data:
            titles[data["topic"]] = data.get("title", data["topic"])
    return {t: topic_page(t, titles.get(t, t), qs) for t, qs in sorted(topics.items())}


# --------------------------------------------------------------------------- reference pages

def cli_page() -> str:
    from minillm.cli import build_parser
    parser = build_parser()
    lines = ["# Command line", "", "Generated from the `minillm` command's own parser: what `--help` prints.", "",
             "```text", parser.format_help().rstrip(), "```", ""]
    sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    for name, p in sub.choices.items():
        lines += [f"## `minillm {name}`", "", "```text", p.format_help().rstrip(), "```", ""]
    return "\n".join(lines)


API_OBJECTS = [
    ("The offline API", ["minillm.llm.LLM", "minillm.sampling.params.SamplingParams",
                         "minillm.structured.params.StructuredOutputsParams", "minillm.config.SpeculativeConfig"]),
    ("The engine", ["minillm.config.EngineConfig", "minillm.engine.llm_engine.LLMEngine",
                    "minillm.engine.outputs.RequestOutput", "minillm.engine.outputs.StepInfo"]),
]


def api_page() -> str:
    lines = ["# Python API", "", "Generated from the docstrings. `from minillm import LLM, SamplingParams` is the "
             "public surface; the engine's parts are reachable by their modules. The seams a lab piece implements "
             "are the Protocols of `minillm.interfaces`, listed at the end.", ""]
    for title, names in API_OBJECTS:
        lines += [f"## {title}", ""]
        for name in names:
            lines += ["```{eval-rst}", f".. autoclass:: {name}", "   :members:", "   :no-index:", "```", ""]
    from minillm import interfaces
    table = interfaces.__doc__.split("\n\n")
    seams = next(p for p in table if "plugged with" in p)
    lines += ["## The seams (`minillm.interfaces`)", "", "Each seam, minillm's own implementation of it, and where a "
              "learner's piece plugs in:", "", "```text", seams.rstrip(), "```", ""]
    protocols = (n for n, v in vars(interfaces).items()
                 if isinstance(v, type) and getattr(v, "_is_protocol", False) and v.__module__ == interfaces.__name__)
    for name in sorted(protocols):
        lines += ["```{eval-rst}", f".. autoclass:: minillm.interfaces.{name}", "   :members:", "   :no-index:",
                  "```", ""]
    return "\n".join(lines)


BENCHMARKS = ROOT / "docs" / "benchmarks.md"


def benchmarks_page() -> str:
    """docs/benchmarks.md as it is (every measured table with its command and date; README keeps only a summary),
    its relative links and images rewritten to resolve from book/_generated/reference."""
    body = BENCHMARKS.read_text()
    return re.sub(r"\]\((?!https?://|#)([^)#]+)(#[^)]*)?\)",
                  lambda m: f"]({_repo_link(BENCHMARKS.parent, m.group(1))}{m.group(2) or ''})", body)


def _repo_link(base: Path, target: str) -> str:
    """A link relative to the folder `base` (inside the repository), as seen from book/_generated/reference: the
    page sits three folders below the repository root (Sphinx copies the images it finds into the site)."""
    path = Path(os.path.normpath((base / target).relative_to(ROOT))).as_posix()
    return "../../../" + path


# --------------------------------------------------------------------------- the architecture figure

def architecture_figure(path: Path) -> None:
    """The request path as boxes and arrows, each box labelled with the lab whose piece plugs in there."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyArrowPatch, FancyBboxPatch
    boxes = {   # name: (x, y, text, labs)
        "tok": (0.6, 3.0, "tokenizer\n+ chat template", ""),
        "sched": (2.7, 3.0, "Scheduler\n(continuous batching,\nchunked prefill)", "lab04"),
        "bm": (2.7, 1.2, "BlockManager\n(paged KV, ref counts,\nprefix cache)", "lab02 · lab05"),
        "runner": (4.9, 3.0, "ModelRunner\n(flat batch, slot_mapping,\nblock_tables)", ""),
        "model": (4.9, 1.2, "Llama model\n(KV cache, quantized\nand TP linears)", "lab01 · lab08 · lab09"),
        "attn": (7.1, 1.2, "attention backend\n(PagedAttention\nkernel)", "lab03"),
        "sampler": (7.1, 3.0, "Sampler /\nRejectionSampler\n(+ token masks)", "lab06 · lab07 · lab10"),
        "out": (9.1, 3.0, "detokenize, stops,\nmetrics", "lab00 · lab11"),
    }
    arrows = [("tok", "sched"), ("sched", "bm"), ("sched", "runner"), ("runner", "model"), ("model", "attn"),
              ("runner", "sampler"), ("sampler", "out")]
    fig, ax = plt.subplots(figsize=(11, 4.2))
    for name, (x, y, text, labs) in boxes.items():
        ax.add_patch(FancyBboxPatch((x - 0.85, y - 0.55), 1.7, 1.1, boxstyle="round,pad=0.05",
                                    fc="#eef4fb" if labs else "#f4f4f4", ec="#35608f"))
        ax.text(x, y + 0.05, text, ha="center", va="center", fontsize=8.5)
        if labs:
            ax.text(x, y - 0.72, labs, ha="center", va="center", fontsize=8, color="#b0441c", weight="bold")
    for a, b in arrows:
        (x0, y0, *_), (x1, y1, *_) = boxes[a], boxes[b]
        dx, dy = x1 - x0, y1 - y0
        sx = 0.9 if dx else 0
        sy = 0.6 if dy else 0
        ax.add_patch(FancyArrowPatch((x0 + sx * (dx > 0) - sx * (dx < 0), y0 + sy * (dy > 0) - sy * (dy < 0)),
                                     (x1 - sx * (dx > 0) + sx * (dx < 0), y1 - sy * (dy > 0) + sy * (dy < 0)),
                                     arrowstyle="-|>", mutation_scale=12, color="#35608f"))
    ax.set_xlim(-0.4, 10.1)
    ax.set_ylim(0.2, 3.8)
    ax.axis("off")
    ax.set_title("One request's path through minillm (red: the lab whose piece plugs in there)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=130, metadata={"Software": None})    # the same bytes every build
    plt.close(fig)


# --------------------------------------------------------------------------- the book

def toc(labs: list[str], topics: list[str]) -> str:
    lines = ["format: jb-book", "root: intro", "parts:", "  - caption: The labs", "    chapters:"]
    lines += [f"      - file: _generated/labs/{lab}" for lab in labs]
    lines += ["  - caption: Interview questions", "    chapters:"]
    lines += [f"      - file: _generated/questions/{t}" for t in topics]
    lines += ["  - caption: Reference", "    chapters:", "      - file: architecture",
              "      - file: _generated/reference/benchmarks", "      - file: _generated/reference/cli",
              "      - file: _generated/reference/api"]
    return "\n".join(lines) + "\n"


def _write(path: Path, data: str | bytes) -> Path:
    """Write only what changed: Sphinx rebuilds the pages whose sources are newer, so an unchanged book rebuilds
    in seconds."""
    data = data.encode() if isinstance(data, str) else data
    if not path.is_file() or path.read_bytes() != data:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    return path


def generate(jobs: int = 2, progress=print) -> None:
    """Write book/_generated and book/_toc.yml from the sources (and remove what no source makes any more)."""
    labs = lab_ids()
    runs = executed(labs, jobs, progress)
    made = [_write(GENERATED / "labs" / f"{lab}.ipynb", nbformat.writes(chapter(lab, runs[lab])))
            for lab in labs]
    pages = question_pages()
    made += [_write(GENERATED / "questions" / f"{topic}.md", text) for topic, text in pages.items()]
    made += [_write(GENERATED / "reference" / "cli.md", cli_page()),
             _write(GENERATED / "reference" / "api.md", api_page()),
             _write(GENERATED / "reference" / "benchmarks.md", benchmarks_page())]
    with tempfile.TemporaryDirectory() as tmp:
        architecture_figure(Path(tmp) / "architecture.png")
        made.append(_write(GENERATED / "architecture.png", (Path(tmp) / "architecture.png").read_bytes()))
    for stale in set(GENERATED.rglob("*.*")) - set(made):
        stale.unlink()
    _write(BOOK / "_toc.yml", toc(labs, sorted(pages)))


def mathjax_assets() -> None:
    """MathJax from the jupyter-server-mathjax wheel into book/_mathjax/mathjax (the site's /mathjax): pages render
    math without a CDN."""
    import jupyter_server_mathjax
    src = Path(jupyter_server_mathjax.__file__).parent / "static"
    dst = BOOK / "_mathjax" / "mathjax"
    if not (dst / "MathJax.js").is_file():
        shutil.copytree(src, dst, dirs_exist_ok=True)


def build(jobs: int = 2, progress=print) -> Path:
    generate(jobs, progress)
    mathjax_assets()
    cmd = [str(Path(sys.executable).with_name("jupyter-book")), "build", str(BOOK), "--warningiserror",
           "--keep-going"]
    progress("building the HTML (jupyter-book build --warningiserror)")
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        sys.stderr.write(done.stdout[-6000:] + done.stderr[-6000:])
        raise SystemExit(f"jupyter-book build failed (exit {done.returncode})")
    return HTML / "index.html"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--jobs", type=int, default=2, help="notebooks executed at once when the cache lacks them")
    ap.add_argument("--check", action="store_true", help="check the built site (tools/book_checks.py)")
    ap.add_argument("--serve", action="store_true", help="serve the built site on 127.0.0.1 (no build)")
    ap.add_argument("--port", type=int, default=8010)
    args = ap.parse_args(argv)
    if args.serve:
        handler = lambda *a, **k: http.server.SimpleHTTPRequestHandler(*a, directory=str(HTML), **k)  # noqa: E731
        print(f"serving {HTML} on http://127.0.0.1:{args.port}/ (Ctrl-C stops)")
        with http.server.ThreadingHTTPServer(("127.0.0.1", args.port), handler) as httpd:
            try:
                httpd.serve_forever()
            except KeyboardInterrupt:
                pass
        return 0
    index = build(args.jobs)
    print(f"book: {index}")
    if args.check:
        import book_checks
        problems = book_checks.problems(HTML, lab_ids(), sorted(question_pages()))
        if problems:
            print("\n".join(problems), file=sys.stderr)
            return 1
        print("book checks: every lab and topic has a page; links, images and assets resolve locally")
    return 0


if __name__ == "__main__":
    sys.exit(main())
