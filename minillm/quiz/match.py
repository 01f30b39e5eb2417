"""Which key points a typed answer mentions: a normalized keyword match, not a judge.

Both texts are normalized the same way: lower case, punctuation dropped, hyphens and underscores split,
number words to digits, x/×/times to one token, crude suffix stemming ("batching" = "batched" = "batches",
"quantization" = "quantized"). A key point counts as mentioned when at least 60% of its content words
(stopwords removed) appear in the answer. Hyphen and space variants are the same term: "KV-cache", "kv cache"
and "kvcache" match each other; a hyphenated term in the key point ("copy-on-write") must appear as a whole.
A key point may carry synonyms in the bank (other ways to say it); the point is ticked when it or any one of
its synonyms reaches the threshold, and `explain` says which words did it.

Filler words ("use", "shrink", "roughly", "about", ...) are never required: a key point's units skip them, so a
candidate is not marked down for saying "cuts" instead of "shrinks" or leaving out "roughly".

A key point may also carry negative cues (`not:` in the bank): phrases that state the mistake it refutes. When
the typed answer contains one of them (its words in order, articles ignored, stems compared), the point is not
ticked whatever its score, and `explain` names the phrase. So typing an entry's common mistake ("draft and target
must use identical sampling settings") cannot tick the point written to refute it. Beyond those cues it is still
a keyword match: it cannot tell a right statement from a wrong one that uses the same words.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Sequence

THRESHOLD = 0.6

STOPWORDS = frozenset("""
a an the and or but if then than so of to in on at by for from with without into onto over under per via as
is are was were be been being it its this that these those there their they them we you your our i me my
he she his her not no do does did done can could should would will may might must shall have has had
each every any some all both either neither more most less least much many few very also just only
what which who whom whose when where why how about across after before between through during against
up down out off again further once here own same such too s t x vs versus eg ie etc
""".split())

NUMBER_WORDS = {
    "zero": "0", "one": "1", "two": "2", "three": "3", "four": "4", "five": "5", "six": "6", "seven": "7",
    "eight": "8", "nine": "9", "ten": "10", "eleven": "11", "twelve": "12", "sixteen": "16", "hundred": "100",
    "thousand": "1000", "twice": "2 x", "double": "2 x", "half": "0.5", "times": "x", "multiplied": "x",
}

# Words a key point may contain but never requires: verbs and hedges with many equivalent phrasings.
FILLER = frozenset("""
use uses used using shrink shrinks shrank shrinking shrunk roughly approximately around nearly almost
typically usually often basically simply really quite rather somewhat
""".split())

_TOKEN = re.compile(r"[a-z0-9]+(?:\.[0-9]+)?")

# Abbreviations a candidate may spell out, or a key point may (and the other side not): either form matches.
ABBREVIATIONS = {
    "ttft": "time to first token", "tpot": "time per output token", "itl": "inter-token latency",
    "kv": "key value", "lru": "least recently used", "gqa": "grouped-query attention",
    "mqa": "multi-query attention", "mha": "multi-head attention", "dfa": "deterministic finite automaton",
    "cfg": "context-free grammar", "hbm": "high-bandwidth memory", "slo": "service level objective",
    "tp": "tensor parallelism", "pp": "pipeline parallelism", "ep": "expert parallelism", "dp": "data parallelism",
    "moe": "mixture of experts", "mla": "multi-head latent attention", "mtp": "multi-token prediction",
    "fsm": "finite state machine",
}

_KEEP_ING = frozenset({"string", "thing", "during", "bring", "spring", "nothing", "something"})


def _stem(word: str) -> str:
    """Crude suffix stripping, the same on both sides: 'caches'/'cached'/'caching' -> 'cach', 'batches'/'batched'/
    'batching' -> 'batch', 'quantization'/'quantized' -> 'quantiz', 'allocation'/'allocated' -> 'allocat'."""
    if len(word) <= 3 or any(c.isdigit() for c in word):
        return word
    if word.endswith("ies") and len(word) > 4:           # plurals and third person first ...
        word = word[:-3] + "y"
    elif word.endswith("sses"):
        word = word[:-2]
    elif word.endswith("s") and not word.endswith(("ss", "us", "is")):
        word = word[:-1]
    if word.endswith("ization") and len(word) > 9:       # ... then one derivational or inflectional ending
        word = word[:-5]
    elif word.endswith("ation") and len(word) > 7:
        word = word[:-3]
    elif word.endswith("ing") and len(word) >= 6 and word not in _KEEP_ING:
        word = _undouble(word[:-3])
    elif word.endswith("ed") and len(word) >= 5 and not word.endswith("eed"):
        word = _undouble(word[:-2])
    elif word.endswith("ically") and len(word) >= 8:
        word = word[:-4]
    elif word.endswith("ly") and len(word) >= 6:
        word = word[:-2]
    if len(word) > 3 and word.endswith("e") and not word.endswith("ee"):
        word = word[:-1]
    return word


def _undouble(stem: str) -> str:
    """'summ' (summed) -> 'sum', 'padd' -> 'pad'; 'prefill', 'pass' and 'buzz' keep their pair."""
    if len(stem) >= 3 and stem[-1] == stem[-2] and stem[-1] not in "aeiouylsz":
        return stem[:-1]
    return stem


def _prepare(text: str) -> str:
    text = text.lower().replace("×", " x ").replace("²", " 2").replace("³", " 3")
    text = re.sub(r"(?<=\d),(?=\d{3})", "", text)           # 4,096 -> 4096
    text = re.sub(r"(?<=\d)x\b", " x", text)                 # 2.8x -> 2.8 x
    text = re.sub(r"(?<=\d)(kib|mib|gib|tib|kb|mb|gb|tb|ms|us|ns)\b", r" \1", text)   # 128KiB -> 128 kib
    text = re.sub(r"\b(\w+)['’]s\b", r"\1", text)            # GPU's -> GPU
    return text


def _words(text: str) -> list[tuple[str, str]]:
    """(the word as written, lower-cased; its normalized token) for each token of `text`."""
    out: list[tuple[str, str]] = []
    for word in _TOKEN.findall(_prepare(text)):
        for w in NUMBER_WORDS.get(word, word).split():
            out.append((word, _stem(w)))
    return out


def tokens(text: str) -> list[str]:
    """Normalized tokens of `text`, stopwords kept (phrases need their positions)."""
    return [t for _, t in _words(text)]


@dataclass(frozen=True)
class _Unit:
    parts: tuple[str, ...]     # normalized tokens; more than one for a compound like copy-on-write
    shown: str                 # as the key point writes it, for the explanation


def _units(phrase: str) -> list[_Unit]:
    """The content units of a key point: single words, or a phrase for a hyphen/underscore compound
    ("copy-on-write" keeps its "on"). A slash means "or"/"per" ("GQA/MQA", "KiB/token"): separate words."""
    units: list[_Unit] = []
    for chunk in re.split(r"[\s/]+", _prepare(phrase)):
        words = _words(chunk)
        parts = tuple(t for _, t in words)
        if len(parts) > 1 and re.search(r"[a-z0-9][-_][a-z0-9]", chunk) and any(t not in STOPWORDS for t in parts):
            units.append(_Unit(parts, re.sub(r"^\W+|\W+$", "", chunk)))
        else:
            units += [_Unit((t,), w) for w, t in words if t not in STOPWORDS and w not in FILLER]
    seen: set[tuple[str, ...]] = set()
    return [u for u in units if not (u.parts in seen or seen.add(u.parts))]


def _expansion(abbreviation: str) -> set[str]:
    return {t for t in tokens(ABBREVIATIONS[abbreviation]) if t not in STOPWORDS}


def _found(units: list[_Unit], answer: list[str]) -> list[bool]:
    """Per unit: does the answer contain it? Adjacent answer tokens also count run together ("kv cache" in the
    answer matches "kvcache" in a key point), and adjacent key-point units do too ("kvcache" in the answer
    matches "kv cache" in the key point). An abbreviation matches its words spelled out, either way round."""
    vocab = set(answer) | {a + b for a, b in zip(answer, answer[1:])}
    for a in vocab & ABBREVIATIONS.keys():          # "ttft" -> time, first, token; "mla" -> multi, head, multihead, ...
        spelled = tokens(ABBREVIATIONS[a])
        vocab |= _expansion(a) | {x + y for x, y in zip(spelled, spelled[1:])}

    def has(parts: tuple[str, ...]) -> bool:
        if "".join(parts) in vocab:                      # a word, or a compound run together ("kvcache")
            return True
        if len(parts) == 1 and parts[0] in ABBREVIATIONS and _expansion(parts[0]) <= vocab:
            return True
        n = len(parts)
        return any(tuple(answer[i:i + n]) == parts for i in range(len(answer) - n + 1))

    hits = [has(u.parts) for u in units]
    for i in range(len(units) - 1):
        if "".join(units[i].parts + units[i + 1].parts) in vocab:
            hits[i] = hits[i + 1] = True
    return hits


_ARTICLES = frozenset({"a", "an", "the"})


def _cue_tokens(text: str) -> list[str]:
    """Normalized tokens with articles dropped: what a negative cue is compared on (negations kept)."""
    return [t for t in tokens(text) if t not in _ARTICLES]


# A cue preceded by one of these (within NEGATION_WINDOW tokens) is being denied, not asserted: "never offload the KV
# of sequences still decoding" does not say the mistake "offload the KV of sequences still decoding".
NEGATIONS = frozenset(_stem(w) for w in """not never no don doesn didn isn aren wasn weren won cannot avoid
avoids avoiding without nor neither nobody instead rather unlike against wrong mistake myth""".split())
NEGATION_WINDOW = 3


def says(typed: str, phrase: str) -> bool:
    """Does the typed answer assert the phrase: its tokens in order and adjacent (articles ignored, stems compared,
    so 'identical sampling settings' is found in 'the draft must use the identical sampling setting'), with no
    negation in the few tokens before it (the polarity check: 'do not require identical sampling settings' does
    not assert it)?"""
    cue, answer = _cue_tokens(phrase), _cue_tokens(typed)
    n = len(cue)
    if n == 0 or cue[0] in NEGATIONS:
        return n > 0 and any(answer[i:i + n] == cue for i in range(len(answer) - n + 1))
    return any(answer[i:i + n] == cue and not NEGATIONS & set(answer[max(0, i - NEGATION_WINDOW):i])
               for i in range(len(answer) - n + 1))


@dataclass(frozen=True)
class PointMatch:
    """Why a key point was (not) ticked: the words of the best phrasing that the answer has and lacks."""
    hit: bool
    score: float                    # fraction of the phrasing's content words found, 0..1
    matched: tuple[str, ...]        # as the phrasing writes them
    missing: tuple[str, ...]
    via: str | None = None          # the synonym that scored best; None when the key point's own words did
    refuted_by: str | None = None   # the negative cue the answer contains (then hit is False)

    def reason(self) -> str:
        """'matched: kv, cache, layers', 'matched via "paged KV": paged, kv', 'partly: kv' (a point not ticked),
        'not ticked: your answer says "..." (the mistake this point refutes)', or '' when no word matched."""
        if self.refuted_by is not None:
            return f'not ticked: your answer says "{self.refuted_by}", the mistake this point corrects'
        if not self.matched:
            return ""
        how = ("matched" if self.hit else "partly") + (f' via "{self.via}"' if self.via else "")
        return f"{how}: {', '.join(self.matched)}"


def _score(typed_tokens: list[str], phrase: str) -> tuple[float, tuple[str, ...], tuple[str, ...]]:
    units = _units(phrase)
    if not units:
        return 0.0, (), ()
    hits = _found(units, typed_tokens)
    return (sum(hits) / len(units), tuple(u.shown for u, h in zip(units, hits) if h),
            tuple(u.shown for u, h in zip(units, hits) if not h))


def explain(typed: str, key_point: str, synonyms: Sequence[str] = (), threshold: float = THRESHOLD,
            cues: Sequence[str] = ()) -> PointMatch:
    """Match the key point and each synonym against the typed answer; report the best-scoring phrasing
    (the key point itself on a tie). An answer containing one of the negative `cues` ticks nothing."""
    answer = tokens(typed) if typed.strip() else []
    candidates = []
    for via, phrase in [(None, key_point), *((s, s) for s in synonyms)]:
        score, matched, missing = _score(answer, phrase)
        candidates.append(PointMatch(score >= threshold - 1e-9, score, matched, missing, via))
    best = max(candidates, key=lambda m: (m.score, m.via is None))
    refuted = next((c for c in cues if says(typed, c)), None) if answer else None
    if refuted is not None:
        return PointMatch(False, best.score, best.matched, best.missing, best.via, refuted)
    return best


def key_point_score(typed: str, key_point: str) -> float:
    """Fraction of the key point's content units found in the typed answer (0..1); synonyms not consulted."""
    return _score(tokens(typed), key_point)[0]


def match_key_points(typed: str, key_points: Sequence[str], threshold: float = THRESHOLD,
                     synonyms: Sequence[Sequence[str]] | None = None,
                     cues: Sequence[Sequence[str]] | None = None) -> list[bool]:
    """Per key point: does the typed answer mention it (the point or one of its synonyms scores >= threshold)
    without saying one of the point's negative cues?"""
    if not typed.strip():
        return [False] * len(key_points)
    syns = list(synonyms) if synonyms is not None else [()] * len(key_points)
    negs = list(cues) if cues is not None else [()] * len(key_points)
    return [explain(typed, kp, s, threshold, c).hit for kp, s, c in zip(key_points, syns, negs)]
