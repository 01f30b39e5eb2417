"""The question bank: `questions/<topic>.yaml` files, loaded and validated into `Question` objects.

Validation is the JSON Schema in `questions/schema.json` plus the rules a schema cannot express (file name =
topic, unique ids across files, 60-200-word answers). Every problem is reported with the file, the entry and
the field, so a content writer can go straight to it.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

import yaml

from minillm import config
from minillm.quiz.markup import normalize

LEVELS: tuple[str, ...] = ("easy", "medium", "hard", "system-design", "scenario")

# The labs of ../shared/CURRICULUM.md. Entries may also name a part of a lab (lab04_2).
LABS: dict[str, str] = {
    "lab00": "anatomy of inference",
    "lab01": "the KV cache",
    "lab02": "paged KV cache",
    "lab03": "PagedAttention kernel",
    "lab04": "continuous batching",
    "lab05": "prefix caching",
    "lab06": "sampling",
    "lab07": "speculative decoding",
    "lab08": "quantization",
    "lab09": "tensor parallelism",
    "lab10": "constrained decoding",
    "lab11": "serving and benchmarking",
    "lab12": "from one engine to a fleet",
}

# The topic files questions/README.md plans; `--list` shows the ones not written yet.
PLANNED_TOPICS: tuple[str, ...] = (
    "fundamentals", "kv-cache", "paged-attention", "batching", "prefix-caching", "sampling",
    "speculative-decoding", "quantization", "parallelism", "structured-output", "serving", "platform")

ANSWER_WORDS = (60, 200)
NOT_TOPIC_FILES = {"sources.yaml"}


class BankError(ValueError):
    """The bank could not be loaded; `problems` lists every 'file: entry ... field ...: what' line."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        shown = problems[:25]
        more = f"\n... and {len(problems) - len(shown)} more" if len(problems) > len(shown) else ""
        super().__init__("\n".join(shown) + more)


@dataclass(frozen=True)
class Design:
    requirements: str
    estimate: str
    architecture: str
    trade_offs: str


@dataclass(frozen=True)
class Question:
    id: str
    topic: str
    level: str
    question: str
    answer: str
    key_points: tuple[str, ...]      # the points' text; a point written as {point, ...} gives its point
    common_mistake: str
    follow_ups: tuple[str, ...]
    labs: tuple[str, ...]
    evidence: tuple[str, ...]
    sources: tuple[str, ...]
    design: Design | None = None
    checks: tuple[dict[str, Any], ...] = ()
    file: Path | None = field(default=None, compare=False)
    synonyms: tuple[tuple[str, ...], ...] = ()   # per key point, other ways to say it (empty tuples when none)
    cues: tuple[tuple[str, ...], ...] = ()       # per key point, phrases of the mistake it refutes (`not:`)
    measured: tuple[dict[str, Any], ...] = ()    # figures about minillm, each read from a results/ record

    @classmethod
    def from_dict(cls, d: dict[str, Any], file: Path | None = None) -> "Question":
        points = [kp if isinstance(kp, dict) else {"point": kp} for kp in d["key_points"]]
        return cls(id=d["id"], topic=d["topic"], level=d["level"], question=normalize(d["question"]),
                   answer=normalize(d["answer"]), key_points=tuple(normalize(p["point"]) for p in points),
                   synonyms=tuple(tuple(p.get("synonyms") or ()) for p in points),
                   cues=tuple(tuple(p.get("not") or ()) for p in points),
                   measured=tuple(d.get("measured") or ()),
                   common_mistake=normalize(d["common_mistake"]), follow_ups=tuple(map(normalize, d["follow_ups"])),
                   labs=tuple(d["labs"]), evidence=tuple(d["evidence"]), sources=tuple(d["sources"]),
                   design=Design(**{k: normalize(v) for k, v in d["design"].items()}) if d.get("design") else None,
                   checks=tuple(d.get("checks") or ()), file=file)

    def key_point_synonyms(self, i: int) -> tuple[str, ...]:
        return self.synonyms[i] if i < len(self.synonyms) else ()

    def key_point_cues(self, i: int) -> tuple[str, ...]:
        return self.cues[i] if i < len(self.cues) else ()

    def in_lab(self, lab: str) -> bool:
        """`lab04` matches lab04 and its parts (lab04_2); `lab04_2` matches only that part."""
        return any(l == lab or ("_" not in lab and l.startswith(lab + "_")) for l in self.labs)


@dataclass
class Bank:
    dir: Path
    questions: dict[str, Question]   # by id, in file then entry order
    topics: dict[str, str]           # topic -> title, in file order

    def __len__(self) -> int:
        return len(self.questions)

    def by_topic(self, topic: str) -> list[Question]:
        return [q for q in self.questions.values() if q.topic == topic]

    def by_level(self, level: str) -> list[Question]:
        return [q for q in self.questions.values() if q.level == level]

    def by_lab(self, lab: str) -> list[Question]:
        return [q for q in self.questions.values() if q.in_lab(lab)]

    def labs(self) -> list[str]:
        """Every lab id that some entry names (parts included), sorted."""
        return sorted({l for q in self.questions.values() for l in q.labs})

    def select(self, topics: Iterable[str] = (), level: str | None = None, lab: str | None = None) -> list[Question]:
        """The questions matching every filter given, compared case-insensitively; raises SelectionError naming
        the valid values."""
        topics = [normalize_topic(t, self.topics) for t in topics]
        level = normalize_level(level) if level is not None else None
        lab = normalize_lab(lab) if lab is not None else None
        return [q for q in self.questions.values()
                if (not topics or q.topic in topics) and (level is None or q.level == level)
                and (lab is None or q.in_lab(lab))]


def normalize_topic(topic: str, topics: Iterable[str]) -> str:
    valid = list(topics)
    t = topic.strip().lower()
    if t not in valid:
        raise SelectionError(f"unknown topic {topic!r}; valid topics: {', '.join(valid) or '(none yet)'}")
    return t


# `--list` heads the system-design column "design"; accept that spelling (and a space for the hyphen) too.
_LEVEL_ALIASES = {"design": "system-design", "system design": "system-design", "system_design": "system-design"}


def normalize_level(level: str) -> str:
    v = " ".join(level.strip().lower().split())
    v = _LEVEL_ALIASES.get(v, v)
    if v not in LEVELS:
        raise SelectionError(f"unknown level {level!r}; valid levels: {', '.join(LEVELS)}")
    return v


def normalize_lab(lab: str) -> str:
    """'LAB04' -> 'lab04', 'lab4' -> 'lab04', 'lab04_2' stays: a lab of CURRICULUM.md or one of its parts."""
    m = re.fullmatch(r"lab(\d{1,2})(_[1-9])?", lab.strip().lower())
    v = f"lab{int(m.group(1)):02d}{m.group(2) or ''}" if m else ""
    if v.split("_")[0] not in LABS:
        raise SelectionError(f"unknown lab {lab!r}; valid labs: {', '.join(LABS)} (or a part such as lab04_2)")
    return v


class SelectionError(ValueError):
    """A --topic/--level/--lab value the bank does not know; the message lists the valid ones."""


def default_bank_dir() -> Path:
    """`MINILLM_QUESTIONS`, else the repository's `questions/` next to the package."""
    return config.questions_dir() or Path(__file__).resolve().parents[2] / "questions"


def _show(path: Path) -> str:
    """A path as the user would type it: relative to the working directory when under it."""
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


class _UniqueKeyLoader(getattr(yaml, "CSafeLoader", yaml.SafeLoader)):  # libyaml's parser: ~10x faster
    """SafeLoader that rejects a repeated key: PyYAML would silently keep the last `answer:`."""


def _mapping_without_duplicates(loader: _UniqueKeyLoader, node: yaml.MappingNode, deep: bool = False):
    seen: dict[Any, yaml.Node] = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            raise yaml.constructor.ConstructorError(
                "while constructing a mapping", node.start_mark, f"found duplicate key {key!r}", key_node.start_mark)
        seen[key] = key_node
    return loader.construct_mapping(node, deep=deep)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _mapping_without_duplicates)


def read_yaml(path: Path) -> Any:
    """Parse one YAML file; a syntax error becomes a BankError with file:line:column."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise BankError([f"{_show(path)}: cannot read the file: {e}"]) from None
    try:
        return yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
        where = f":{mark.line + 1}:{mark.column + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e)
        context = getattr(e, "context", None)
        detail = f"{problem} ({context})" if context else problem
        raise BankError([f"{_show(path)}{where}: malformed YAML: {detail}. Fix the indentation or quoting "
                         "there (quote text containing ': ' or starting with a special character)."]) from None


def load_schema(bank_dir: Path) -> dict[str, Any]:
    """The bank's own schema.json, else the repository's (so a scratch bank needs only topic files)."""
    for candidate in (bank_dir / "schema.json", Path(__file__).resolve().parents[2] / "questions" / "schema.json"):
        if candidate.is_file():
            return json.loads(candidate.read_text(encoding="utf-8"))
    raise BankError([f"{_show(bank_dir)}: no schema.json here or in the repository's questions/; "
                     "restore questions/schema.json"])


def _entry_name(doc: Any, index: int) -> str:
    try:
        entry_id = doc["questions"][index].get("id")
    except (TypeError, KeyError, IndexError, AttributeError):
        entry_id = None
    return f"entry {entry_id!r}" if isinstance(entry_id, str) else f"entry #{index + 1}"


def _field_path(parts: Iterable[Any]) -> str:
    out = ""
    for p in parts:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out


def _where(path: Path, doc: Any, abs_path: list[Any]) -> str:
    """'questions/kv-cache.yaml: entry 'x' field key_points' for a JSON path like [questions, 3, key_points]."""
    if len(abs_path) >= 2 and abs_path[0] == "questions" and isinstance(abs_path[1], int):
        rest = _field_path(abs_path[2:])
        return f"{_show(path)}: {_entry_name(doc, abs_path[1])}" + (f" field {rest}" if rest else "")
    return f"{_show(path)}: field {_field_path(abs_path)}" if abs_path else f"{_show(path)}: top level"


def _validator_class():
    """jsonschema's Draft202012Validator, imported without its optional `iri` format backend: importing
    rfc3987_syntax builds a grammar for ~3.5 s, every `minillm quiz` start, and the bank schema uses no formats."""
    import sys
    if "jsonschema" not in sys.modules and "rfc3987_syntax" not in sys.modules:
        sys.modules["rfc3987_syntax"] = None  # type: ignore[assignment]  # makes its import raise ImportError
        try:
            from jsonschema import Draft202012Validator
        finally:
            if sys.modules.get("rfc3987_syntax", 0) is None:
                del sys.modules["rfc3987_syntax"]   # later, explicit imports of it still work
    from jsonschema import Draft202012Validator
    return Draft202012Validator


def _schema_problem(e: Any) -> list[tuple[list[Any], str]]:
    """(path to append to the error's path, message): name the field itself for missing/unknown keys."""
    if e.validator == "required" and isinstance(e.instance, dict):
        missing = [k for k in e.validator_value if k not in e.instance]
        hint = (" (system-design entries need design: {requirements, estimate, architecture, trade_offs})"
                if "design" in missing else "")
        return [([k], f"missing required field{hint}") for k in missing]
    if e.validator == "additionalProperties" and isinstance(e.instance, dict):
        allowed = list(e.schema.get("properties", {}))
        return [([k], f"unknown field; allowed fields: {', '.join(allowed)}") for k in e.instance if k not in allowed]
    if e.validator in ("anyOf", "oneOf") and e.context:
        # "is not valid under any of the given schemas" says nothing: report what is wrong in the form the value
        # has (a key point that is a string: its length; a mapping: its fields), not that it is not the other form.
        specific = [c for c in e.context if not (c.validator == "type" and not c.relative_path)]
        if specific:
            return [(list(c.relative_path) + rest, what) for c in specific for rest, what in _schema_problem(c)]
    return [([], e.message)]


def validate_file(path: Path, doc: Any, schema: dict[str, Any]) -> list[str]:
    """Schema problems, then the extra rules, each as one 'file: entry field: what' line."""
    problems = []
    errors = sorted(_validator_class()(schema).iter_errors(doc), key=lambda e: [str(p) for p in e.absolute_path])
    for e in errors:
        at = list(e.absolute_path)
        for rest, what in _schema_problem(e):
            problems.append(f"{_where(path, doc, at + rest)}: {what}")
    if problems or not isinstance(doc, dict):
        return problems
    if doc["topic"] != path.stem:
        problems.append(f"{_show(path)}: field topic: {doc['topic']!r} differs from the file name; "
                        f"write topic: {path.stem} or rename the file to {doc['topic']}.yaml")
    for i, entry in enumerate(doc["questions"]):
        where = f"{_show(path)}: {_entry_name(doc, i)}"
        if entry["topic"] != doc["topic"]:
            problems.append(f"{where} field topic: {entry['topic']!r} but the file's topic is {doc['topic']!r}; "
                            "move the entry to its topic's file or fix the field")
        words = len(entry["answer"].split())
        lo, hi = ANSWER_WORDS
        if not lo <= words <= hi:
            problems.append(f"{where} field answer: {words} words; answers must be {lo}-{hi} words "
                            "(put the detail in key_points, follow_ups or design)")
        for j, lab in enumerate(entry["labs"]):
            if lab.split("_")[0] not in LABS:
                problems.append(f"{where} field labs[{j}]: unknown lab {lab!r}; valid labs: {', '.join(LABS)}")
    return problems


def topic_files(bank_dir: Path) -> list[Path]:
    return sorted(p for p in bank_dir.glob("*.yaml") if p.name not in NOT_TOPIC_FILES and not p.name.startswith("."))


def load_bank(dir: str | Path | None = None) -> Bank:
    """Load and validate every topic file; raise BankError listing every problem found."""
    bank_dir = Path(dir) if dir is not None else default_bank_dir()
    if not bank_dir.is_dir():
        raise BankError([f"question bank directory {_show(bank_dir)} does not exist; run from a minillm checkout, "
                         "pass --bank DIR, or set MINILLM_QUESTIONS to the questions/ folder"])
    schema = load_schema(bank_dir)
    problems: list[str] = []
    questions: dict[str, Question] = {}
    topics: dict[str, str] = {}
    for path in topic_files(bank_dir):
        try:
            doc = read_yaml(path)
        except BankError as e:
            problems += e.problems
            continue
        file_problems = validate_file(path, doc, schema)
        problems += file_problems
        if file_problems:
            continue
        topics[doc["topic"]] = doc["title"]
        for i, entry in enumerate(doc["questions"]):
            q = Question.from_dict(entry, path)
            if q.id in questions:
                problems.append(f"{_show(path)}: {_entry_name(doc, i)} field id: duplicate id, already used in "
                                f"{_show(questions[q.id].file)}; ids must be unique across the bank")
                continue
            questions[q.id] = q
    if problems:
        raise BankError(problems)
    return Bank(bank_dir, questions, topics)


def load_sources(bank_dir: Path) -> list[dict[str, Any]]:
    """questions/sources.yaml: [{seed, line, quote, id, implied?}, ...] (empty when the file is absent)."""
    path = bank_dir / "sources.yaml"
    if not path.is_file():
        return []
    doc = read_yaml(path)
    if not isinstance(doc, dict) or not isinstance(doc.get("questions"), list):
        raise BankError([f"{_show(path)}: expected a mapping with a 'questions' list"])
    return doc["questions"]
