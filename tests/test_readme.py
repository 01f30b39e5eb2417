"""README.md stays short and true: a newcomer's page (the long tables live in docs/), whose links resolve, whose
commands exist, whose parallel example shards the default model, whose list of refused JSON Schema keywords is what
minillm refuses, and whose layout diagram is the floors tests/test_layering.py holds. The book's benchmarks page
is built from docs/benchmarks.md, so it is checked here too."""
from __future__ import annotations

import argparse
import re
import shlex
import sys
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
BENCHMARKS = DOCS / "benchmarks.md"
MAX_README_LINES = 200


def text_of(path: Path) -> str:
    return path.read_text(encoding="utf-8")


def prose(md: str) -> str:
    """The Markdown outside fenced code blocks and inline code (where a `[x](y)` is not a link)."""
    md = re.sub(r"^```.*?^```", "", md, flags=re.S | re.M)
    return re.sub(r"`[^`\n]*`", "", md)


def code_blocks(md: str, lang: str = "") -> list[str]:
    return re.findall(rf"^```{lang}[^\n]*\n(.*?)^```", md, flags=re.S | re.M)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(md: str) -> set[str]:
    return {slug(h) for h in re.findall(r"^#+ (.+)$", re.sub(r"^```.*?^```", "", md, flags=re.S | re.M), re.M)}


def broken_links(path: Path, md: str | None = None) -> list[str]:
    """Every relative link or image of a Markdown file that points at no file (or at no heading of it)."""
    md = text_of(path) if md is None else md
    problems = []
    for target in re.findall(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)", prose(md)):
        if re.match(r"[a-z]+:", target):                       # https:, mailto:: not a file here
            continue
        file, _, frag = target.partition("#")
        dest = path if not file else (path.parent / file)
        if not dest.exists():
            problems.append(f"{path.name}: {target} points at no file")
        elif frag and dest.suffix == ".md" and frag not in anchors(text_of(dest)):
            problems.append(f"{path.name}: {target} names no heading of {dest.name}")
    return problems


def cli_parser() -> argparse.ArgumentParser:
    from minillm.cli import build_parser
    return build_parser()


def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


# ----------------------------------------------------------------------------------------------- short and linked

def test_readme_is_short():
    lines = text_of(README).count("\n")
    assert lines <= MAX_README_LINES, (f"README.md has {lines} lines (at most {MAX_README_LINES}): move detail and "
                                       "measurements to docs/ and link them")


def test_readme_counts_no_tests():
    """A test count in README goes stale with the next test; docs/testing.md says what the tests hold instead."""
    assert not re.search(r"\b\d+ (tests|passed|test cases)\b", text_of(README))


@pytest.mark.parametrize("path", [README, *sorted(DOCS.glob("*.md"))], ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_and_images_resolve(path):
    assert broken_links(path) == []


def test_the_link_check_can_fail(tmp_path):
    page = tmp_path / "page.md"
    (tmp_path / "there.md").write_text("# Here it is\n")
    page.write_text("[a](missing.md) ![b](gone.png) [c](there.md#here-it-is) [d](there.md#nowhere) "
                    "`[e](in-code.md)` [f](https://example.org/x)\n```\n[g](in-a-block.md)\n```\n")
    assert broken_links(page) == ["page.md: missing.md points at no file", "page.md: gone.png points at no file",
                                  "page.md: there.md#nowhere names no heading of there.md"]


def test_readme_links_the_moved_sections():
    linked = set(re.findall(r"\]\((docs/[\w.-]+\.md)", text_of(README)))
    assert {"docs/benchmarks.md", "docs/engine.md", "docs/course.md", "docs/instructors.md", "docs/layout.md",
            "docs/testing.md"} <= linked


# ----------------------------------------------------------------------------------------------------- commands

def test_every_command_readme_names_exists_and_the_table_lists_them_all():
    readme = text_of(README)
    named = set(re.findall(r"`minillm ([a-z][\w-]*)", readme))
    named |= {m for block in code_blocks(readme, "bash")
              for m in re.findall(r"(?:^|\s)minillm ([a-z][\w-]*)", block, re.M)}
    real = subcommands(cli_parser())
    assert named - set(real) == set(), f"README names commands minillm does not have: {sorted(named - set(real))}"
    table = set(re.findall(r"^\| `minillm ([a-z][\w-]*)", readme, re.M))
    assert table == set(real), f"README's command table lists {sorted(table)}; `minillm --help` has {sorted(real)}"


def test_every_bench_the_docs_name_exists():
    bench = subcommands(cli_parser())["bench"]
    action = [a for a in bench._actions if isinstance(a, argparse._SubParsersAction)]
    benches = set(action[0].choices) if action else {c for a in bench._actions if a.choices for c in a.choices}
    for path in [README, *sorted(DOCS.glob("*.md"))]:
        named = set(re.findall(r"minillm bench ([a-z][\w-]*)", text_of(path))) - {"BENCH"}
        assert named <= benches, f"{path.name} names benches that do not exist: {sorted(named - benches)}"


# ------------------------------------------------------------------------------------------------- parallelism

def parallel_sizes(cmd: list[str]) -> tuple[int, int]:
    """(tensor, pipeline) sizes of a `minillm ...` command line, as the CLI's EngineConfig would have them (an
    unset flag is EngineConfig's default; the config refuses layouts it cannot run)."""
    from minillm.config import EngineConfig
    ns = cli_parser().parse_args(cmd)
    given = {k: getattr(ns, k) for k in ("tensor_parallel_size", "pipeline_parallel_size")
             if getattr(ns, k) is not None}
    par = EngineConfig.from_kwargs(**given).parallel
    return par.tensor_parallel_size, par.pipeline_parallel_size


def torchrun_commands(md: str) -> list[list[str]]:
    cmds = []
    for block in code_blocks(md, "bash"):
        for line in block.replace("\\\n", " ").splitlines():
            if line.strip().startswith("torchrun "):
                cmds.append(shlex.split(line, comments=True))
    return cmds


def readme_layouts() -> list[tuple[list[str], int, int, int]]:
    """(command, processes, tensor size, pipeline size) of each torchrun line in README, read by torchrun's own parser
    and minillm's."""
    from torch.distributed.run import get_args_parser
    layouts = []
    for cmd in torchrun_commands(text_of(README)):
        run = get_args_parser().parse_args(["0" if a == "R" else a for a in cmd[1:]])   # R: the node rank
        assert run.module and run.training_script == "minillm", cmd
        tp, pp = parallel_sizes(run.training_script_args)
        layouts.append((cmd, int(str(run.nnodes).split(":")[-1]) * int(run.nproc_per_node), tp, pp))
    return layouts


def test_readme_torchrun_examples_parse_and_start_one_process_per_rank():
    layouts = readme_layouts()
    assert layouts, "README shows no torchrun example"
    for cmd, processes, tp, pp in layouts:
        assert processes == tp * pp, f"{shlex.join(cmd)}: {processes} processes for {tp} x {pp} ranks"


@pytest.mark.slow      # reads the default model's config (the real SmolLM2 file)
def test_readme_torchrun_examples_shard_the_default_model():
    """The sizes come from README, the verdict from the model's config: heads, KV heads and MLP must split."""
    from minillm.distributed.sharding import check_pp_size, tp_problems
    from minillm.loading.loader import peek_config
    cfg = peek_config("default")
    for cmd, _, tp, pp in readme_layouts():
        assert tp_problems(cfg, tp) == [], (shlex.join(cmd), tp_problems(cfg, tp))
        check_pp_size(cfg, pp)


@pytest.mark.slow      # reads the default model's config
def test_readme_parallel_sizes_and_head_counts_match_the_default_model():
    from minillm.distributed.sharding import tp_problems, valid_tp_sizes
    from minillm.loading.loader import peek_config
    cfg = peek_config("default")
    readme = " ".join(text_of(README).split())
    for size in re.findall(r"(?:--tensor-parallel-size |tensor_parallel_size=)(\d+)", readme):
        problems = tp_problems(cfg, int(size))
        assert problems == [], f"README uses tensor-parallel size {size}: {problems}"
    heads = re.search(r"(\d+) query heads and (\d+) KV heads, so its tensor-parallel sizes are ([\d, and]+?)\.",
                      readme)
    assert heads, "README no longer states the default model's heads and its valid tensor-parallel sizes"
    assert (int(heads[1]), int(heads[2])) == (cfg.num_heads, cfg.num_kv_heads)
    assert [int(n) for n in re.findall(r"\d+", heads[3])] == valid_tp_sizes(cfg)


# ------------------------------------------------------------------------------------------- structured outputs

REFUSED = {   # README's words -> schemas minillm must refuse for them
    "`minimum`": [{"type": "integer", "minimum": 0}],
    "`multipleOf`": [{"type": "number", "multipleOf": 2}],
    "`uniqueItems`": [{"type": "array", "uniqueItems": True}],
    "`patternProperties`": [{"type": "object", "patternProperties": {"^a": {"type": "string"}}}],
    "`prefixItems`": [{"type": "array", "prefixItems": [{"type": "string"}]}],
    "`not`": [{"not": {"type": "string"}}],
    "`pattern` together with `minLength`/`maxLength`": [{"type": "string", "pattern": "a+", "maxLength": 3},
                                                         {"type": "string", "pattern": "a+", "minLength": 2}],
    "`pattern` together with `format`": [{"type": "string", "pattern": "a+", "format": "date"}],
    "`format` together with `minLength`/`maxLength`": [{"type": "string", "format": "date", "maxLength": 12}],
    "`allOf` of more than one schema": [{"allOf": [{"type": "string"}, {"type": "string", "maxLength": 2}]}],
    "`additionalProperties` other than false next to `properties`": [
        {"type": "object", "properties": {"a": {"type": "string"}}, "additionalProperties": True},
        {"type": "object", "properties": {"a": {"type": "string"}}, "additionalProperties": {"type": "integer"}}],
    "`items` as a list": [{"type": "array", "items": [{"type": "string"}]}],
    "remote or recursive `$ref`s": [{"$ref": "https://example.org/schema.json"},
                                     {"$defs": {"n": {"type": "object", "properties": {"next": {"$ref": "#/$defs/n"}}}},
                                      "$ref": "#/$defs/n"}],
    "schemas no value matches": [False, {"type": "array", "minItems": 3, "maxItems": 1}],
}


def test_readme_lists_what_json_schema_compilation_refuses():
    from minillm.structured.json_schema import FORMATS, SchemaError, schema_to_regex
    from minillm.structured.params import StructuredOutputsParams
    readme = " ".join(text_of(README).split())
    for words, schemas in REFUSED.items():
        assert words in readme, f"README's list of refused schemas lost {words!r}"
        for schema in schemas:
            with pytest.raises(SchemaError):
                schema_to_regex(schema)
    formats = re.search(r"formats other than ([\w, -]+?) and (\w+),", readme)
    assert formats, "README no longer lists the supported string formats"
    assert set(formats[1].split(", ")) | {formats[2]} == set(FORMATS)
    assert "`grammar=`" in readme
    with pytest.raises(ValueError, match="grammar"):
        StructuredOutputsParams(grammar='root ::= "a"')
    # and what README says compiles does: the refusals above are not everything-refused
    schema_to_regex({"type": "object", "properties": {"code": {"type": "string", "pattern": "[A-Z]{3}"},
                                                      "day": {"type": "string", "format": "date"},
                                                      "tags": {"type": "array", "items": {"type": "string"}}},
                     "required": ["code"], "additionalProperties": False})


# ------------------------------------------------------------------------------------------------------- layout

def test_readme_layout_diagram_is_the_floors_the_layering_test_holds():
    from tests.test_layering import FLOORS
    readme = text_of(README)
    section = readme[readme.index("\n## Layout\n"):]
    diagram = next(b for b in code_blocks(section) if "<" in b)
    floors = [tuple(name.strip() for name in floor.split(",")) for floor in " ".join(diagram.split()).split("<")]
    assert floors == [tuple(f) for f in FLOORS]


# ------------------------------------------------------------------------------------------------ benchmarks

def test_benchmarks_doc_dates_its_rows_and_says_how_to_read_them():
    doc = text_of(BENCHMARKS)
    assert "ratios were measured side by side in one run; absolute times vary with the machine and its load" in \
        " ".join(doc.split()).lower()
    rows = [r for r in doc.splitlines() if r.startswith("| ") and not r.startswith("| benchmark |")
            and not set(r) <= set("|- ")]
    bench_rows = [r for r in rows if "`minillm bench" in r]
    assert len(bench_rows) >= 10, "docs/benchmarks.md lost its CPU benchmark table"
    assert "a row that names no date is from" in doc
    assert re.search(r"Measured on a lent NVIDIA \w+, \d{4}-\d\d-\d\d", doc), "the GPU section lost its date"


def test_the_books_benchmarks_page_has_the_tables_and_its_images_resolve():
    sys.path.insert(0, str(ROOT / "tools"))
    import build_book
    page = build_book.benchmarks_page()
    assert page.startswith("# Benchmarks")
    assert page.count("`minillm bench") >= 10 and "| layer, rows |" in page
    where = build_book.GENERATED / "reference"                        # where the book writes the page
    images = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", page)
    assert images and all((where / img).resolve().is_file() for img in images), images
    links = re.findall(r"(?<!!)\[[^\]]*\]\((?!https?:)([^)#]+)", prose(page))
    assert all((where / link).resolve().exists() for link in links), links


# ---------------------------------------------------------------------------------------------- the API example

@pytest.mark.slow
def test_readme_python_example_runs_and_its_empty_completion_note_holds():
    """README's Python block runs as written on the default model, and its note is true: a bare question sent as raw
    text ends at once ('' with a warning pointing at llm.chat) while llm.chat answers it."""
    block = code_blocks(text_of(README), "python")[0]
    scope: dict = {}
    exec(compile(block.replace('print(out[0].text)', 'answer = out[0].text'), "README.md", "exec"), scope)
    assert "4" in scope["answer"]
    assert scope["outs"][0].outputs[0].token_ids
    from minillm import SamplingParams
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        raw = scope["llm"].generate("What is 2+2?", SamplingParams(temperature=0), use_tqdm=False)
    assert raw[0].text == ""
    assert any("llm.chat" in str(w.message) for w in caught)
