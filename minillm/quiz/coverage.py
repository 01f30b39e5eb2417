"""How much of the source material the bank answers: sources.yaml mappings against the loaded bank."""
from __future__ import annotations

from dataclasses import dataclass, field

from minillm.quiz.bank import Bank, load_sources


@dataclass
class Coverage:
    seed_questions: int                 # seed lines mapped in sources.yaml
    referenced: list[str]               # distinct bank ids sources.yaml points at
    missing: list[str]                  # referenced but not in the bank (yet)
    unreferenced: list[str]             # bank entries no seed maps to and not marked CURRICULUM.md
    without_evidence: list[str]
    by_lab: dict[str, int] = field(default_factory=dict)


def coverage(bank: Bank) -> Coverage:
    sources = load_sources(bank.dir)
    referenced = list(dict.fromkeys(str(s.get("id")) for s in sources))
    ref_set = set(referenced)
    by_lab: dict[str, int] = {}
    for q in bank.questions.values():
        for lab in sorted({l.split("_")[0] for l in q.labs}):
            by_lab[lab] = by_lab.get(lab, 0) + 1
    return Coverage(
        seed_questions=len(sources), referenced=referenced,
        missing=[i for i in referenced if i not in bank.questions],
        unreferenced=[q.id for q in bank.questions.values() if q.id not in ref_set and "CURRICULUM.md" not in q.sources],
        without_evidence=[q.id for q in bank.questions.values() if not q.evidence],
        by_lab=dict(sorted(by_lab.items())))
