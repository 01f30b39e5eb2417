"""The real question bank in questions/: schema and extra rules per file, sources.yaml against the bank and the
seed collections, evidence that resolves, numbers that recompute, and `minillm quiz --list` over it all."""
from __future__ import annotations

import contextlib
import importlib
import importlib.util
import io
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from minillm.cli import build_parser
from minillm.quiz.bank import PLANNED_TOPICS, load_bank, load_schema, load_sources, read_yaml, topic_files, validate_file

REPO = Path(__file__).resolve().parents[1]
BANK_DIR = REPO / "questions"
TOPIC_FILES = topic_files(BANK_DIR)


def _seed_module():
    spec = importlib.util.spec_from_file_location("seed_questions", REPO / "tools" / "seed_questions.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def bank():
    return load_bank(BANK_DIR)


@pytest.fixture(scope="module")
def sources():
    return load_sources(BANK_DIR)


@pytest.mark.parametrize("path", TOPIC_FILES, ids=[p.name for p in TOPIC_FILES])
def test_topic_file_validates(path):
    problems = validate_file(path, read_yaml(path), load_schema(BANK_DIR))
    assert not problems, "\n".join(problems)


def test_whole_bank_loads_with_unique_ids(bank):
    assert set(bank.topics) == {p.stem for p in TOPIC_FILES}


def test_every_id_in_sources_yaml_is_in_the_bank(bank, sources):
    missing = sorted({s["id"] for s in sources} - set(bank.questions))
    assert not missing, (f"{len(missing)} ids that questions/sources.yaml maps seed questions to have no bank "
                         f"entry yet: {', '.join(missing)}")


def test_every_entry_comes_from_a_seed_or_the_curriculum(bank, sources):
    referenced = {s["id"] for s in sources}
    orphans = [q.id for q in bank.questions.values() if q.id not in referenced and "CURRICULUM.md" not in q.sources]
    assert not orphans, ("entries no seed question maps to in sources.yaml and without CURRICULUM.md in sources: "
                         + ", ".join(orphans))


def test_sources_yaml_entries_are_well_formed(sources):
    assert sources, "questions/sources.yaml lists no questions"
    for s in sources:
        assert {"seed", "line", "quote", "id"} <= set(s), f"sources.yaml entry {s} lacks seed, line, quote or id"


def test_every_entry_has_a_lab(bank):
    assert all(q.labs for q in bank.questions.values())


def _evidence():
    try:
        b = load_bank(BANK_DIR)
    except Exception:       # reported by test_topic_file_validates / test_whole_bank_loads_with_unique_ids
        return []
    return [(q.id, ref) for q in b.questions.values() for ref in q.evidence]


def _checks():
    try:
        b = load_bank(BANK_DIR)
    except Exception:
        return []
    return [(q, i) for q in b.questions.values() for i in range(len(q.checks))]


def resolve_evidence(ref: str) -> None:
    """Raise ValueError unless `ref` is an importable minillm name or a `minillm ...` command line
    that the CLI parser accepts."""
    if ref.startswith("minillm "):
        try:
            with contextlib.redirect_stderr(io.StringIO()):
                build_parser().parse_args(shlex.split(ref)[1:])
        except SystemExit:
            raise ValueError(f"evidence {ref!r}: the minillm CLI does not accept this command") from None
        return
    if not ref.startswith("minillm."):
        raise ValueError(f"evidence {ref!r}: write a dotted name under minillm (minillm.kv.sizing.kv_cache_bytes) "
                         "or a command starting with 'minillm '")
    parts = ref.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            if not hasattr(obj, attr):
                raise ValueError(f"evidence {ref!r}: {'.'.join(parts[:i])} has no attribute path "
                                 f"{'.'.join(parts[i:])}")
            obj = getattr(obj, attr)
        return
    raise ValueError(f"evidence {ref!r}: no such module")


@pytest.mark.parametrize("qid, ref", _evidence())
def test_evidence_resolves(qid, ref):
    resolve_evidence(ref)


@pytest.mark.parametrize("q, i", _checks(), ids=lambda v: v.id if hasattr(v, "id") else str(v))
def test_check_verifies_and_its_claim_is_in_the_text(q, i):
    from minillm.quiz.numbers import verify_check
    check = q.checks[i]
    verify_check(check)
    texts = [q.answer] + ([" ".join(t.split()) for t in vars(q.design).values()] if q.design else [])
    assert any(check["claim"] in t for t in texts), \
        f"{q.id}: the claim {check['claim']!r} does not appear in the answer or design text"


def test_verify_check_rejects_a_wrong_claim():
    from minillm.quiz.numbers import verify_check
    good = {"claim": "1 GiB", "fn": "kv_cache_bytes", "args": {"config": "llama-2-7b", "tokens": 2048}}
    verify_check(good)
    with pytest.raises(AssertionError, match="claim '3 GiB'"):
        verify_check({**good, "claim": "3 GiB"})


def test_every_seed_question_is_mapped_with_a_true_short_quote(sources):
    mod = _seed_module()
    seed_dir = mod.default_seed_dir()
    if not seed_dir.is_dir():
        pytest.skip(f"seed collections not found at {seed_dir} (set MINILLM_SEEDS to check sources.yaml against them)")
    seeds = mod.seed_questions(seed_dir)
    assert seeds, f"no seed questions read from {seed_dir}"
    mapped = {(s["seed"], int(s["line"])): s for s in sources}
    unmapped = [f"{q.seed}:{q.line} {q.text[:60]}" for q in seeds if (q.seed, q.line) not in mapped]
    assert not unmapped, "seed questions missing from questions/sources.yaml:\n" + "\n".join(unmapped)
    bad = []
    for q in seeds:
        quote = str(mapped[(q.seed, q.line)]["quote"])
        if quote not in q.text:
            bad.append(f"{q.seed}:{q.line}: quote {quote!r} is not in the seed text")
        if len(quote.split()) > 12:
            bad.append(f"{q.seed}:{q.line}: quote has {len(quote.split())} words (at most 12)")
    assert not bad, "\n".join(bad)


def test_quiz_list_shows_every_topic_file():
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("MINILLM_QUESTIONS", None)
    r = subprocess.run([sys.executable, "-m", "minillm", "quiz", "--list", "--planned"], capture_output=True,
                       text=True, cwd=REPO, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    rows = {line.split()[0]: line for line in r.stdout.splitlines() if line.strip()}
    for path in TOPIC_FILES:
        assert path.stem in rows and "(no file yet)" not in rows[path.stem], f"{path.stem} missing from --list"
    assert "coverage:" in r.stdout
    missing = [t for t in PLANNED_TOPICS if "(no file yet)" in rows.get(t, "(no file yet)")]
    assert not missing, f"planned topics (questions/README.md) without a file: {', '.join(missing)}"


def _seed_lock() -> dict:
    import json
    return json.loads((REPO / "questions" / "seeds.lock.json").read_text())["seeds"]


def test_sources_yaml_maps_every_locked_seed_question(sources):
    """Runs without the seed files: every question line recorded in seeds.lock.json has one sources.yaml row."""
    locked = {(name, line) for name, info in _seed_lock().items() for line in info["question_lines"]}
    rows = [(s["seed"], int(s["line"])) for s in sources]
    assert len(rows) == len(set(rows)), "a seed question is listed twice in sources.yaml"
    assert set(rows) == locked, (f"missing: {sorted(locked - set(rows))[:5]}; "
                                 f"not a locked seed question: {sorted(set(rows) - locked)[:5]}")
    assert len(locked) == 115


def test_seed_lock_matches_the_seed_files():
    import hashlib
    mod = _seed_module()
    seed_dir = mod.default_seed_dir()
    if not seed_dir.is_dir():
        pytest.skip(f"seed collections not found at {seed_dir}; seeds.lock.json stands in for them")
    lock = _seed_lock()
    assert sorted(p.name for p in seed_dir.glob("*.txt")) == sorted(lock)
    for name, info in lock.items():
        assert hashlib.sha256((seed_dir / name).read_bytes()).hexdigest() == info["sha256"], f"{name} changed"
        assert [q.line for q in mod.seed_questions(seed_dir) if q.seed == name] == info["question_lines"]


# --- labs named by an entry must exist in solutions/, or be marked planned (questions/README.md, Rules) ---

_LAB_NAME = re.compile(r"\blab(\d{2})(?:_\d+)?\b", re.IGNORECASE)   # lab04, Lab01, lab04_2 -> labNN


def _written_labs(solutions: Path = REPO / "solutions") -> set[str]:
    """The labs that exist now: solutions/labNN directories, read when the test runs (a lab may land any day)."""
    return {p.name for p in solutions.iterdir() if p.is_dir() and re.fullmatch(r"lab\d\d", p.name)}


def _entry_texts(entry: dict) -> list[tuple[str, str]]:
    """(field, text) for every piece of prose a learner reads in an entry."""
    texts = [("question", entry["question"]), ("answer", entry["answer"]), ("common_mistake", entry["common_mistake"])]
    texts += [("key_points", t) for k in entry["key_points"]                 # a point may be {point, synonyms}
              for t in ([k["point"], *k["synonyms"]] if isinstance(k, dict) else [k])]
    texts += [("follow_ups", f) for f in entry["follow_ups"]]
    texts += [(f"design.{k}", v) for k, v in (entry.get("design") or {}).items()]
    return texts


def _lab_problems(entry: dict, written: set[str]) -> list[str]:
    """One line per unwritten lab the entry names without marking it planned, and per stale planned mark."""
    named: dict[str, list[str]] = {}     # labNN -> the fields that name it
    for lab in entry["labs"]:
        named.setdefault(lab.split("_")[0], []).append("labs")
    for field, text in _entry_texts(entry):
        for m in _LAB_NAME.finditer(text):
            fields = named.setdefault(f"lab{m.group(1)}", [])
            if field not in fields:
                fields.append(field)
    planned = set(entry.get("planned_labs") or ())
    problems = [f"entry {entry['id']!r} names {lab} (in {', '.join(fields)}) but solutions/{lab} does not exist: "
                f"list it in planned_labs and say what {lab} will show, or cite a lab that exists"
                for lab, fields in sorted(named.items()) if lab not in written and lab not in planned]
    problems += [f"entry {entry['id']!r} lists {lab} in planned_labs but solutions/{lab} exists now: drop the mark "
                 f"and say what {lab} shows, in the present tense" for lab in sorted(planned & written)]
    problems += [f"entry {entry['id']!r} lists {lab} in planned_labs but names it nowhere: drop the mark"
                 for lab in sorted(planned - written - set(named))]
    return problems


def test_every_lab_an_entry_names_exists_or_is_marked_planned():
    written = _written_labs()
    problems = [f"{path.relative_to(REPO)}: {p}" for path in TOPIC_FILES
                for entry in read_yaml(path)["questions"] for p in _lab_problems(entry, written)]
    assert not problems, (f"{len(problems)} lab references to fix (solutions/ holds {', '.join(sorted(written))}):\n"
                          + "\n".join(problems))


def _entry(**fields) -> dict:
    base = {"id": "x", "question": "q?", "answer": "a", "common_mistake": "m", "key_points": ["k"],
            "follow_ups": ["f?"], "labs": ["lab04"]}
    return {**base, **fields}


@pytest.mark.parametrize("entry, expected", [
    (_entry(), []),
    (_entry(labs=["lab04_2"], answer="Lab04 and minillm.grading.lab04 show it."), []),
    (_entry(labs=["lab11"]), ["names lab11 (in labs)"]),
    (_entry(answer="In lab12 you build a router."), ["names lab12 (in answer)"]),
    (_entry(labs=["lab11_2"], design={"trade_offs": "lab11 sweeps it"}), ["names lab11 (in labs, design.trade_offs)"]),
    (_entry(follow_ups=["What does LAB08 measure?"], key_points=["see lab08"]), ["names lab08 (in key_points, follow_ups)"]),
    (_entry(key_points=[{"point": "p", "synonyms": ["as lab12 shows"]}]), ["names lab12 (in key_points)"]),
    (_entry(labs=["lab11"], answer="lab11 will time it", planned_labs=["lab11"]), []),
    (_entry(planned_labs=["lab04"]), ["lists lab04 in planned_labs but solutions/lab04 exists now"]),
    (_entry(planned_labs=["lab12"]), ["lists lab12 in planned_labs but names it nowhere"]),
    (_entry(answer="lab120 and xlab11 are not lab names"), []),
])
def test_lab_problems_names_the_entry_and_the_lab(entry, expected):
    problems = _lab_problems(entry, written={"lab00", "lab04"})
    assert len(problems) == len(expected), problems
    for problem, fragment in zip(problems, expected):
        assert problem.startswith("entry 'x' ") and fragment in problem, problem


def test_written_labs_reads_solutions_when_called(tmp_path):
    for name in ["lab00", "lab08", "lab1", "README.md", "lab99x"]:
        (tmp_path / name).mkdir()
    assert _written_labs(tmp_path) == {"lab00", "lab08"}


# --- a scenario's assumptions, checked across entries (issue 16): one footprint per model and format, the
# embeddings and LM head counted the way real checkpoints store them, requests inside the model's window ---

_NESTED = {"ratio": lambda a: [(a["fn"], a["a"]), (a["fn"], a["b"])],
           "mix": lambda a: [(fn, args) for _, fn, args in a["parts"]],
           "scaled": lambda a: [(a["fn"], a["args"])], "units_needed": lambda a: [(a["fn"], a["args"])]}


def _leaves(fn: str, args: dict):
    """(fn, args) of every function a check ends up calling, through ratio/mix/scaled/units_needed."""
    if fn in _NESTED:
        for inner in _NESTED[fn](args):
            yield from _leaves(*inner)
    else:
        yield fn, args


def _footprint(check: dict):
    """For a check whose claim is a whole catalog model's weight bytes: (key, claimed bytes, bytes with everything
    quantized, bytes with 16-bit embeddings and LM head); None for any other check. The key is the model's
    parameter count (Llama-3 and 3.1 share shapes), bits, group size and scale bits."""
    from minillm.catalog import KNOWN_MODELS, model_shape
    from minillm.quant.memory import WeightFormat, checkpoint_bytes, weight_format
    from minillm.quiz.numbers import parse_claim
    fn, a = check["fn"], check.get("args", {})
    if fn == "checkpoint_bytes":
        cfg, fmt = model_shape(a["model"]), weight_format(a["format"])
    elif fn == "weight_bytes" and a.get("num_params") in {m.num_params() for m in KNOWN_MODELS.values()}:
        cfg = next(m for m in KNOWN_MODELS.values() if m.num_params() == a["num_params"])
        fmt = WeightFormat("as-claimed", a["bits"], a.get("group_size"), a.get("scale_bits", 16))
    else:
        return None
    grouped = fmt.bits < 16 and fmt.group_size
    key = (cfg.num_params(), fmt.bits, fmt.group_size if grouped else None, fmt.scale_bits if grouped else None)
    return (key, parse_claim(check["claim"]), checkpoint_bytes(cfg, fmt, embeddings_bits=fmt.bits),
            checkpoint_bytes(cfg, fmt))


def _footprint_conflicts(checks: list[tuple[str, dict]], spread: float = 0.02) -> list[str]:
    """One line per (model, format) whose claimed footprints differ by more than `spread` across the bank."""
    groups: dict = {}
    for qid, check in checks:
        fp = _footprint(check)
        if fp:
            groups.setdefault(fp[0], []).append((fp[1], qid, check["claim"]))
    return [f"{len(claims)} footprints of the same model at {key[1]} bits disagree: "
            + ", ".join(f"{qid} says {claim!r}" for _, qid, claim in sorted(claims))
            for key, claims in groups.items() if max(claims)[0] > min(claims)[0] * (1 + spread)]


def _embedding_problems(checks: list[tuple[str, dict]]) -> list[str]:
    """A quantized footprint computed as params x bits, where counting the embeddings and LM head at 16 bits
    (as GPTQ/AWQ, FP8 and NVFP4 checkpoints store them) moves it by more than the claim's tolerance."""
    out = []
    for qid, check in checks:
        fp = _footprint(check)
        if fp and check["fn"] == "weight_bytes" and check["args"]["bits"] < 16:
            if abs(fp[2] - fp[3]) > float(check.get("rel_tol", 0.05)) * fp[3]:
                out.append(f"{qid}: {check['claim']!r} is params x {check['args']['bits']} bits; with the 16-bit "
                           f"embeddings and LM head real checkpoints keep it is {fp[3] / 1e9:.1f} GB: use fn "
                           "checkpoint_bytes (embeddings_bits only for formats that quantize them, like GGUF)")
    return out


def _context_problems(checks: list[tuple[str, dict]]) -> list[str]:
    """A serving scenario whose requests do not fit the model's context window (Llama-3 has 8K, Llama-3.1 128K)."""
    from minillm.catalog import model_shape
    out = []
    for qid, check in checks:
        for fn, a in _leaves(check["fn"], check.get("args", {})):
            if fn in ("serving", "prefill_devices", "prefill_flops_per_s") and "prompt" in a:
                tokens = a["prompt"] + a["output"]
            elif fn in ("decode_step", "batching_speedup"):
                tokens = a["context"]
            else:
                continue
            window = model_shape(a["model"]).max_position_embeddings
            if tokens > window:
                out.append(f"{qid}: {check['claim']!r} runs {a['model']} at {tokens:,} tokens, past its "
                           f"{window:,}-token window (use a model that has the context, e.g. Llama-3.1)")
    return out


def _bank_checks() -> list[tuple[str, dict]]:
    return [(q.id, c) for q in load_bank(BANK_DIR).questions.values() for c in q.checks]


def test_one_footprint_per_model_and_format_across_the_bank():
    problems = _footprint_conflicts(_bank_checks())
    assert not problems, "\n".join(problems)


def test_quantized_footprints_count_embeddings_as_checkpoints_store_them():
    problems = _embedding_problems(_bank_checks())
    assert not problems, "\n".join(problems)


def test_serving_scenarios_fit_the_models_context_window():
    problems = _context_problems(_bank_checks())
    assert not problems, "\n".join(problems)


def test_cross_entry_rules_catch_the_issue_16_mistakes():
    """The rules above, on the figures issue 16 found wrong (they must fail) and their corrections (they pass)."""
    int4_naive = {"claim": "35 GB", "fn": "weight_bytes", "args": {"num_params": 70553706496, "bits": 4}}
    int4_real = {"claim": "39.5 GB", "fn": "checkpoint_bytes", "args": {"model": "llama-3.1-70b", "format": "int4"}}
    fp8_naive = {"claim": "~71 GB", "fn": "weight_bytes", "args": {"num_params": 70553706496, "bits": 8}}
    fp8_real = {"claim": "72.7 GB", "fn": "checkpoint_bytes", "args": {"model": "llama-3-70b", "format": "fp8"}}
    gguf = {"claim": "~3.8 GB", "fn": "checkpoint_bytes",
            "args": {"model": "llama-2-7b", "format": "q4_0", "embeddings_bits": 4.5}}
    assert _embedding_problems([("a", int4_naive)]) and not _embedding_problems([("a", int4_real), ("b", gguf)])
    assert _footprint_conflicts([("a", fp8_naive), ("b", fp8_real)]) and not _footprint_conflicts(
        [("a", int4_real), ("b", {**int4_real, "claim": "~39.5 GB"}), ("c", fp8_real)])
    long_llama3 = {"claim": "1 s", "fn": "scaled", "args": {"factor": 1, "fn": "serving", "args": {
        "field": "ttft_s", "model": "llama-3-70b", "gpu": "h100-sxm", "tp": 4, "prompt": 32000, "output": 100}}}
    assert _context_problems([("a", long_llama3)])
    long_llama31 = {**long_llama3, "args": {**long_llama3["args"], "args": {
        **long_llama3["args"]["args"], "model": "llama-3.1-70b"}}}
    assert not _context_problems([("a", long_llama31)])
