"""The real question bank in questions/: schema and extra rules per file, sources.yaml against the bank and the
seed collections, evidence that resolves, numbers that recompute, and `minillm quiz --list` over it all."""
from __future__ import annotations

import contextlib
import importlib
import importlib.util
import inspect
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
    # a `plan` check runs minillm fleet plan (simulations, seconds each): with the slow tests
    return [pytest.param(q, i, marks=[pytest.mark.slow] if q.checks[i]["fn"] in ("plan", "simulate") else [])
            for q in b.questions.values() for i in range(len(q.checks))]


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


_PLAN_FLAGS = ("model", "gpu", "rps", "slo", "prompt_len", "output_len", "prefix_len", "weights", "verify",
               "duration", "seed")


def test_plan_figures_come_from_the_plan_command_the_entry_cites(bank):
    """A `plan` check must be what the `minillm fleet plan ...` line in the entry's evidence prints: the same
    flags, the CLI's defaults for the ones the check leaves out (so a reader who runs the cited command sees the
    cited figures)."""
    from minillm.quiz.numbers import FUNCTIONS
    defaults = {k: v.default for k, v in inspect.signature(FUNCTIONS["plan"]).parameters.items()
                if v.default is not inspect.Parameter.empty}
    seen = 0
    for q in bank.questions.values():
        commands = []
        for ref in q.evidence:
            if ref.startswith("minillm fleet plan "):
                with contextlib.redirect_stderr(io.StringIO()):
                    args = build_parser().parse_args(shlex.split(ref)[1:])
                commands.append({k: getattr(args, k) for k in _PLAN_FLAGS})
        for c in q.checks:
            if c["fn"] != "plan":
                continue
            want = {k: c["args"].get(k, defaults.get(k)) for k in _PLAN_FLAGS}
            assert want in commands, f"{q.id}: plan check {c['claim']!r} runs {want}, which no `minillm fleet " \
                                     f"plan` line in its evidence does ({commands})"
            seen += 1
    assert seen >= 5, "the system-design entries cite figures of minillm fleet plan"


def test_simulated_figures_come_from_a_command_the_entry_cites(bank):
    """A `simulate` check runs a `minillm fleet simulate ...` line that stands, letter for letter, in the entry's
    evidence, so a reader can rerun it and see the cited cells."""
    seen = 0
    for q in bank.questions.values():
        for c in q.checks:
            if c["fn"] == "simulate":
                assert c["args"]["command"] in q.evidence, f"{q.id}: {c['claim']!r} comes from a command its " \
                                                           "evidence does not list"
                seen += 1
    assert seen >= 5


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
              for t in ([k["point"], *k.get("synonyms", []), *k.get("not", [])] if isinstance(k, dict) else [k])]
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


# --- figures about minillm itself come from measurement records (issue 32, mechanism 1) ---------------------------
# An entry cites each one as measured: [{claim, record, key}]; results/<record>.json holds the value, the command
# that wrote it, the date and machine, and a hash of the code it measured (minillm.quiz.records).

def _measured():
    try:
        b = load_bank(BANK_DIR)
    except Exception:
        return []
    return [(q, i) for q in b.questions.values() for i in range(len(q.measured))]


def _all_texts(q) -> list[str]:
    """Everything a learner reads in a loaded entry, whitespace-normalized."""
    texts = [q.question, q.answer, q.common_mistake, *q.key_points, *q.follow_ups]
    texts += [t for syns in q.synonyms for t in syns]
    if q.design:
        texts += [" ".join(t.split()) for t in vars(q.design).values()]
    return texts


@pytest.mark.parametrize("q, i", _measured(), ids=lambda v: v.id if hasattr(v, "id") else str(v))
def test_measured_figure_matches_its_record_and_is_in_the_text(q, i):
    from minillm.quiz.records import verify_measured
    item = q.measured[i]
    verify_measured(item)
    assert any(item["claim"] in t for t in _all_texts(q)), \
        f"{q.id}: the measured claim {item['claim']!r} does not appear in the entry's text"


def _records():
    from minillm.quiz.records import RESULTS_DIR
    return sorted(p.stem for p in RESULTS_DIR.glob("*.json")) if RESULTS_DIR.is_dir() else []


@pytest.mark.parametrize("key", _records())
def test_record_is_not_older_than_the_code_it_measured(key):
    from minillm.quiz.records import load_record, stale
    record = load_record(key)
    assert record.date and record.machine.get("cores") and record.command.startswith("python tools/"), \
        f"{key}: a record names its date, machine and the command that wrote it"
    why = stale(record)
    assert why is None, why


def test_every_record_is_cited_and_every_citation_has_a_record(bank):
    cited = {m["record"] for q in bank.questions.values() for m in q.measured}
    assert cited <= set(_records()), f"entries cite records that results/ lacks: {sorted(cited - set(_records()))}"
    assert set(_records()) <= cited, f"records no entry cites (delete or cite them): {sorted(set(_records()) - cited)}"


# A figure about minillm: a sentence naming minillm, a lab, SmolLM2 or a `minillm` command, with a number and a unit
# that a run produces (steps, ms, tok/s, x, %, sequences). Each must be a `measured` claim or an arithmetic `checks`
# claim of the same entry, so no figure about the project is quoted from memory.
# Sentences quoting minillm's serving estimator are outputs of a model, not runs: their numbers are `checks`.
_ABOUT_MINILLM = re.compile(r"minillm|\blab\d\d\b|smollm2|\bin the run\b", re.IGNORECASE)
_ESTIMATOR = re.compile(r"estimator|memory plan|minillm\.fleet", re.IGNORECASE)
_RUN_FIGURE = re.compile(r"~?\d[\d,]*(?:\.\d+)?(?:-\d[\d,]*(?:\.\d+)?)?\s?(?:ms/token|ms\b|tok/s|tokens/s|steps|"
                         r"x\b|×|%|sequences)")


def _sentences(text: str) -> list[str]:
    return [s for s in re.split(r"(?<=[.;!?])\s+", " ".join(text.split())) if s]


def uncited_minillm_figures(q) -> list[str]:
    claims = [c["claim"] for c in q.checks] + [m["claim"] for m in q.measured]
    out = []
    for text in _all_texts(q):
        for sentence in _sentences(text):
            if not _ABOUT_MINILLM.search(sentence) or _ESTIMATOR.search(sentence):
                continue
            for m in _RUN_FIGURE.finditer(sentence):
                figure = m.group(0)
                if not any(figure.strip("~ ") in c or c.strip("~ ") in figure for c in claims):
                    out.append(f"{q.id}: {figure!r} in “{sentence[:110]}”")
    return out


def test_every_figure_about_minillm_is_cited_from_a_record_or_a_check(bank):
    problems = [p for q in bank.questions.values() for p in uncited_minillm_figures(q)]
    assert not problems, ("figures about minillm quoted without a `measured` record or a `checks` item "
                          "(cite them, or say 'in the run above' without the number):\n" + "\n".join(problems))


def test_uncited_figure_rule_catches_the_issue_32_staleness():
    """The rule on the entries issue 32 found stale: a lab04 step count and a bench decode time quoted bare."""
    from minillm.quiz.bank import Question
    base = load_bank(BANK_DIR).questions["continuous-batching"]
    stale_q = Question.from_dict({**_raw_entry("continuous-batching"), "answer": base.answer
                                  + " On CPU, lab04 runs 10 requests: 80 steps instead of 122.", "measured": None})
    assert any("80 steps" in p for p in uncited_minillm_figures(stale_q))
    decode = Question.from_dict({**_raw_entry("two-phases"), "answer": "x " * 60 +
                                 "`minillm bench decode` measured 50.5 ms/token against an 18.5 ms bound."})
    flagged = {p.split(": ")[1].split(" in ")[0] for p in uncited_minillm_figures(decode)}
    assert {"'50.5 ms/token'", "'18.5 ms'"} <= flagged


def _raw_entry(qid: str) -> dict:
    for path in TOPIC_FILES:
        for entry in read_yaml(path)["questions"]:
            if entry["id"] == qid:
                return dict(entry)
    raise KeyError(qid)


# Solutions prose that quotes a run either says "in the run above" (the numbers are on the learner's screen) or is
# cited like the bank; quoting "this lab's" numbers from memory goes stale when the lab changes (issue 32, finding 3).
_QUOTES_A_RUN = re.compile(r"\b(?:in this lab|this lab's (?:measurement|run)|we measured|the lab measured)\b[^.]*?"
                           r"\d[\d,.]*\s?(?:requests|steps|ms|tok/s|×|x\b|%)", re.IGNORECASE)


def _markdown_prose(path: Path) -> str:
    """The markdown cells of a jupytext percent script, comment markers stripped."""
    out, in_md = [], False
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.startswith("# %%"):
            in_md = "[markdown]" in line
            continue
        if in_md and line.startswith("#"):
            out.append(line[1:].strip())
    return " ".join(out)


@pytest.mark.parametrize("path", sorted((REPO / "solutions").glob("lab*/lab*.py")), ids=lambda p: p.name)
def test_solution_prose_does_not_quote_a_run_from_memory(path):
    quoted = [m.group(0) for m in _QUOTES_A_RUN.finditer(_markdown_prose(path))]
    assert not quoted, (f"{path.relative_to(REPO)} quotes a run's numbers in prose: {quoted}; say 'in the run "
                        "above' (the learner's own output) instead of numbers that go stale")


def test_run_quote_rule_catches_the_old_lab04_sentence():
    old = "keeping seats full raises throughput — in this lab the same 10 requests needed about a third fewer steps"
    assert _QUOTES_A_RUN.search(old)
    assert not _QUOTES_A_RUN.search("in the run above the same requests needed fewer steps")


# --- a quiz that cannot be fooled (issue 32, mechanism 2) ----------------------------------------------------------

def _entries():
    try:
        return list(load_bank(BANK_DIR).questions.values())
    except Exception:
        return []


@pytest.mark.parametrize("q", _entries(), ids=lambda q: q.id)
def test_typing_the_common_mistake_ticks_no_key_point(q):
    from minillm.quiz.match import explain
    ticked = [f"{kp!r} ({m.reason()})" for i, kp in enumerate(q.key_points)
              if (m := explain(q.common_mistake, kp, q.key_point_synonyms(i), cues=q.key_point_cues(i))).hit]
    assert not ticked, (f"{q.id}: typing its common_mistake as the answer ticks {len(ticked)} key point(s): "
                        + "; ".join(ticked) + ". Give the point a `not:` cue quoting the mistake's phrasing.")


@pytest.mark.parametrize("q", _entries(), ids=lambda q: q.id)
def test_the_answer_itself_ticks_its_key_points_despite_the_cues(q):
    """Negative cues must not block the right answer: the entry's own answer (plus design text) still ticks every
    point that it ticked without cues."""
    from minillm.quiz.match import explain
    text = " ".join([q.answer] + ([*vars(q.design).values()] if q.design else []))
    blocked = [f"{kp!r} by {m.refuted_by!r}" for i, kp in enumerate(q.key_points)
               if (m := explain(text, kp, q.key_point_synonyms(i), cues=q.key_point_cues(i))).refuted_by]
    assert not blocked, f"{q.id}: a negative cue fires on the entry's own answer: {blocked}"


def test_no_key_point_requires_a_filler_word(bank):
    from minillm.quiz.match import FILLER, _units
    assert {"use", "shrink", "roughly"} <= FILLER
    required = [f"{q.id}: {kp!r} requires {u.shown!r}" for q in bank.questions.values()
                for kp in [*q.key_points, *(s for syns in q.synonyms for s in syns)]
                for u in _units(kp) if u.shown.lower() in FILLER]
    assert not required, "\n".join(required)


def test_every_cue_is_a_phrase_of_its_common_mistake_or_a_plain_wrong_claim(bank):
    """A cue must be a real phrase: at least two words, not a single generic term that a right answer also uses."""
    from minillm.quiz.match import _cue_tokens
    short = [f"{q.id}: {c!r}" for q in bank.questions.values() for cues in q.cues for c in cues
             if len(_cue_tokens(c)) < 2]
    assert not short, "negative cues of one word block right answers too:\n" + "\n".join(short)


# --- issue 32's findings, each guarded: retired claims must not come back, dated facts must stay, and claims about
# minillm's own code are checked against the code ---------------------------------------------------------------

# (pattern, the finding it guards). Checked in everything but common_mistake, where naming an error is the point.
RETIRED_CLAIMS = [
    (r"gain shrinks toward zero", "1: verifying 5 positions at batch 100 stays under the memory time; the fleet is "
                                  "prefill-dominated"),
    (r"(?:needs|on|fits) (?:at least )?two 80 GB GPUs|two 80 GB GPUs and one",
     "2: two 80 GB GPUs hold ~134 GB after the runtime, no KV for a 16-bit 70B: four"),
    (r"\b10 requests\b|\b122\b", "3: lab04 runs 8 requests (results/lab04-batching.json)"),
    (r"\b18\.5 ms\b|\b50\.5 ms", "4: bench decode defaults to the quantized path (results/bench-decode.json)"),
    (r"streams? the KV layer by layer|KV streamed per layer", "7: P/D connectors pull finished blocks; layer-wise "
                                                               "streaming is an optimisation"),
    (r"\b(?:almost|nearly) linearly\b", "8: every sequence adds its own KV reads"),
    (r"fragmentation-free|free of fragmentation|without copies or fragmentation",
     "12: internal fragmentation remains in each last block"),
    (r"decode is already compute-bound", "13: KV reads keep real contexts memory-bound"),
    (r"~16x", "14: batching_speedup gives 15.45, ~15x"),
    (r"saves nothing in decode", "15: a shared prefix is stored once, so more sequences fit"),
    (r"TP=72|one TP (?:or expert-parallel )?group spans|TP group of 72", "16: NVL72 serves wide EP with DP attention"),
    (r"PCIe Gen4", "11: H100 hosts have PCIe Gen5 (~50 GB/s)"),
    (r"V1[^.]{0,60}recomputes?[^.]{0,20}by default|recompute is vLLM V1's default",
     "21: recompute is V1's only preemption mode"),
    (r"TGI[^.]*maintenance mode(?![^.]*archived)", "20: TGI's repository is archived read-only (March 2026)"),
]

# Facts that dated answers lacked (findings 17-22 and the design answers to strengthen): each entry keeps them.
REQUIRED_MENTIONS = {
    "speculative-decoding": ["EAGLE-3", "MTP"],
    "speculative-decoding-design": ["EAGLE-3", "MTP", "tree", "CUDA graph", "every rank"],
    "gqa-serving-economics": ["MLA", "Kimi K2", "gpt-oss", "Gemma 3", "linear-attention"],
    "hardware-selection": ["B300", "MI355X", "Ironwood"],
    "quantization-design": ["B300", "MI355X"],
    "sharding-design": ["B300", "MI355X", "Ironwood", "~33 ms"],
    "compare-two-engines": ["archived"],
    "low-throughput-big-gpu": ["archived"],
    "preemption-kv-pressure": ["only preemption mode"],
    "oom-long-context": ["only mode"],
    "preemption-fix": ["prefix caching on"],
    "kv-offloading": ["offloading connector", "KVBM"],
    "disaggregated-serving": ["NIXL", "pulls"],
    "design-10k-rps": ["tokeniz", "prefill-dominated", "~7.9 ms"],
    "cost-reduction-plan": ["H200", "NVFP4", "~$0.88", "one forward pass each"],
    "design-70b-p95": ["MoE", "share each step's forward pass"],
    "greedy-vs-sampling": ["exponential race"],
}


def _reader_texts(q) -> list[tuple[str, str]]:
    texts = [("answer", q.answer), ("question", q.question), *(("key_points", k) for k in q.key_points),
             *(("follow_ups", f) for f in q.follow_ups)]
    texts += [(f"design.{k}", " ".join(v.split())) for k, v in (vars(q.design).items() if q.design else [])]
    return texts


def retired_claims(q) -> list[str]:
    return [f"{q.id} {field}: “{m.group(0)}” (finding {why})" for field, text in _reader_texts(q)
            for pattern, why in RETIRED_CLAIMS for m in [re.search(pattern, text)] if m]


def test_no_retired_claim_comes_back(bank):
    problems = [p for q in bank.questions.values() for p in retired_claims(q)]
    assert not problems, "claims issue 32 found wrong are back:\n" + "\n".join(problems)


def test_retired_claim_rules_catch_the_original_wording():
    from minillm.quiz.bank import Question
    for wrong in ["with ~100-sequence batches verification competes for compute and the gain shrinks toward zero",
                  "the difference between two 80 GB GPUs and one", "lab04 runs 10 requests: 80 steps instead of 122",
                  "50.5 ms vs an 18.5 ms bound", "prefill instances stream the KV layer by layer, as it is produced",
                  "aggregate TPS climbs almost linearly", "paged KV makes admission cheap and fragmentation-free",
                  "at high concurrency decode is already compute-bound", "~16x at 4K",
                  "saves nothing in decode", "one TP or expert-parallel group spans nine nodes",
                  "over PCIe Gen4 (~25 GB/s)", "vLLM V1 recomputes by default",
                  "TGI, in maintenance mode since December 2025"]:
        q = Question.from_dict({**_raw_entry("batching-why"), "answer": wrong})
        assert retired_claims(q), wrong


def test_dated_facts_stay_in_their_entries(bank):
    missing = [f"{qid}: {phrase!r}" for qid, phrases in REQUIRED_MENTIONS.items() for phrase in phrases
               if not any(phrase in t for _, t in _reader_texts(bank.questions[qid]))]
    assert not missing, "entries lost facts issue 32 added:\n" + "\n".join(missing)


def test_what_the_bank_says_about_the_sampler_is_what_the_code_does(bank):
    import inspect
    from minillm.sampling import sampler
    source = inspect.getsource(sampler.draw)
    texts = [t for q in bank.questions.values() for _, t in _reader_texts(q)]
    says_multinomial = [t for t in texts if re.search(r"\bSampler\b[^.]*\bdraws?\b[^.]*torch\.multinomial", t)]
    says_race = [t for t in texts if "argmax(p / E)" in t or "exponential race" in t]
    assert not says_multinomial or "multinomial" in source, f"the bank says the Sampler uses torch.multinomial: " \
                                                            f"{says_multinomial[0][:120]}"
    assert says_race and "exponential_" in source and ".argmax(" in source, \
        "the bank describes minillm's draw as an exponential race argmax(p / E); sampler.draw must be one"


def test_what_the_bank_says_about_bench_decode_defaults_is_what_the_cli_does(bank):
    texts = [t for q in bank.questions.values() for _, t in _reader_texts(q)]
    assert any("by default SmolLM2 keeps packed int4" in t for t in texts)
    from minillm.bench.cli import _quantizations
    from minillm.config import EngineConfig
    with contextlib.redirect_stderr(io.StringIO()):
        args = build_parser().parse_args(["bench", "decode"])
    assert _quantizations(args)[0] == "auto" and EngineConfig().quantization == "auto", \
        "the bank says `minillm bench decode` measures the packed (auto) path by default; its default changed"
