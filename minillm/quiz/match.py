"""Which key points a typed answer mentions: a normalized keyword match, not a judge.

Both texts are normalized the same way (lower case, punctuation dropped, hyphens and underscores split,
number words to digits, x/×/times to one token, crude suffix stemming). A key point counts as mentioned
when at least 60% of its content words (stopwords removed) appear in the answer; a hyphenated term in the
key point ("copy-on-write", "kv-cache") must appear as a phrase (hyphenated, spaced or run together).
It cannot tell a right statement from a wrong one that uses the same words.
"""
from __future__ import annotations

import re
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

_TOKEN = re.compile(r"[a-z0-9]+(?:\.[0-9]+)?")


_KEEP_ING = frozenset({"string", "thing", "during", "bring", "spring", "nothing", "something"})


def _stem(word: str) -> str:
    """Crude suffix stripping, applied to both sides, so 'caches'/'cached'/'caching' all become 'cach'."""
    if word.isdigit() or len(word) <= 3:
        return word
    if word.endswith("ies") and len(word) > 4:
        word = word[:-3] + "y"
    elif word.endswith("sses"):
        word = word[:-2]
    elif word.endswith("ing") and len(word) >= 6 and word not in _KEEP_ING:
        word = word[:-3]
    elif word.endswith("ed") and len(word) >= 5 and not word.endswith("eed"):
        word = word[:-2]
    elif word.endswith("s") and not word.endswith(("ss", "us", "is")):
        word = word[:-1]
    if len(word) > 3 and word.endswith("e") and not word.endswith("ee"):
        word = word[:-1]
    return word


def _prepare(text: str) -> str:
    text = text.lower().replace("×", " x ").replace("²", " 2").replace("³", " 3")
    text = re.sub(r"(?<=\d),(?=\d{3})", "", text)           # 4,096 -> 4096
    text = re.sub(r"(?<=\d)x\b", " x", text)                 # 2.8x -> 2.8 x
    text = re.sub(r"(?<=\d)(kib|mib|gib|tib|kb|mb|gb|tb|ms|us|ns)\b", r" \1", text)   # 128KiB -> 128 kib
    text = re.sub(r"\b(\w+)'s\b", r"\1", text)               # GPU's -> GPU
    return text


def tokens(text: str) -> list[str]:
    """Normalized tokens of `text`, stopwords kept (phrases need their positions)."""
    out: list[str] = []
    for word in _TOKEN.findall(_prepare(text)):
        for w in NUMBER_WORDS.get(word, word).split():
            out.append(_stem(w))
    return out


def _units(key_point: str) -> list[tuple[str, ...]]:
    """The content units of a key point: single words, or a phrase for a hyphen/underscore compound
    ("copy-on-write" keeps its "on"). A slash means "or"/"per" ("GQA/MQA", "KiB/token"): separate words."""
    units: list[tuple[str, ...]] = []
    for chunk in re.split(r"[\s/]+", _prepare(key_point)):
        parts = tuple(tokens(chunk))
        if len(parts) > 1 and re.search(r"[a-z0-9][-_][a-z0-9]", chunk) and any(t not in STOPWORDS for t in parts):
            units.append(parts)
        else:
            units += [(t,) for t in parts if t not in STOPWORDS]
    seen: set[tuple[str, ...]] = set()
    return [u for u in units if not (u in seen or seen.add(u))]


def _has(unit: tuple[str, ...], answer: list[str], vocab: set[str]) -> bool:
    if len(unit) == 1:
        return unit[0] in vocab
    if "".join(unit) in vocab:                                # "kvcache" for "kv-cache"
        return True
    n = len(unit)
    return any(tuple(answer[i:i + n]) == unit for i in range(len(answer) - n + 1))


def key_point_score(typed: str, key_point: str) -> float:
    """Fraction of the key point's content units found in the typed answer (0..1)."""
    units = _units(key_point)
    if not units:
        return 0.0
    answer = tokens(typed)
    # Adjacent pairs run together too, so "kv cache" in the answer matches "kvcache" in a key point...
    vocab = set(answer) | {a + b for a, b in zip(answer, answer[1:])}
    hits = [_has(u, answer, vocab) for u in units]
    # ... and "kv cache" in the key point matches "kvcache" in the answer.
    for i in range(len(units) - 1):
        if "".join(units[i] + units[i + 1]) in vocab:
            hits[i] = hits[i + 1] = True
    return sum(hits) / len(units)


def match_key_points(typed: str, key_points: Sequence[str], threshold: float = THRESHOLD) -> list[bool]:
    """Per key point: does the typed answer mention it (score >= threshold)?"""
    if not typed.strip():
        return [False] * len(key_points)
    return [key_point_score(typed, kp) >= threshold - 1e-9 for kp in key_points]

