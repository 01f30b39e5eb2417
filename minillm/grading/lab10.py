"""Checkers for lab10 — constrained decoding.

Tasks (the notebook documents the same signatures; minillm's own versions and the engine's seams in brackets):
  lab10_1  build_nfa(node, nfa) -> (start, end): Thompson's construction over UTF-8 BYTES. `node` is an AST of
           minillm.structured.regex (Chars(ranges) | Concat(parts) | Alt(options) | Repeat(node, min, max or None)),
           `nfa` a minillm.structured.automata.NFA to add states to (nfa.state() -> a new state id;
           nfa.edges[s].append((byte_lo, byte_hi, t)) an edge on any byte in lo..hi; nfa.eps[s].append(t) an
           epsilon edge). Returns the fragment's start and end: the texts that lead from start to end are exactly the
           UTF-8 encodings of the strings that `node` matches.              [structured.automata.NFA.build]
  lab10_2  determinize(nfa, start, accept) -> DFA: the subset construction. A DFA(transitions int32 [S, 256] with
           DEAD = -1 where no NFA state moves, accepting bool [S], start) accepting exactly the byte strings the NFA
           accepts (from `start`, ending with `accept` among the states it can be in).
                                                                           [structured.automata.determinize]
  lab10_3  build_token_index(dfa, vocab, eos_token_ids) -> TokenIndex: for every DFA state s, the sorted ids of the
           tokens whose WHOLE byte string (vocab.token_bytes[i]; None = special token) can be read from s without
           reaching DEAD, and the state each one leads to; never a special or empty token, never EOS (the TokenIndex
           allows eos_token_ids exactly in accepting states).
                                              [structured.token_index.build_token_index; the TokenIndexBuilder seam]
The first two compose into a RegexCompiler (pattern -> DFA): engine.plug(regex_compiler=..., token_index_builder=...).

Oracles, none of them minillm's automata code. lab10_1: Python's `re.fullmatch` (re.ASCII, the parser's reading of
\\d \\w \\s) on texts with 1- to 4-byte characters — matches the grader samples from the AST, their mutations,
random texts — plus raw byte strings, where anything that is not valid UTF-8 must be rejected; the learner's NFA is
run by a plain set-of-states simulation (nfa_accepts). lab10_2: exact language equivalence of the DFA and the NFA,
a breadth-first walk over pairs (DFA state, set of NFA states) that returns the shortest byte string on which they
disagree (first_difference). lab10_3: every token walked byte by byte through the DFA's table from every state
(_expected_index, the definition reference_token_walk states, inlined because it runs states x vocabulary times),
on random DFAs and vocabularies, DFAs of random patterns with tokens cut anywhere in their matches (partial
characters), and a 70,000-token vocabulary. Hand-picked cases run first, each naming the mistake it catches.
"""
from __future__ import annotations

import random
import re
from collections import deque

import numpy as np
from hypothesis import example, given, strategies as st

from minillm.grading.core import GradingError, Hint, Task, as_int, as_ints, check, fail, minillm_objects, run_property
from minillm.structured.automata import DEAD, DFA, NFA, RegexTooComplex, compile_regex
from minillm.structured.regex import Alt, Chars, Concat, parse
from minillm.structured.token_index import TokenIndex, VocabTrie

__all__ = ["check_lab10_1", "check_lab10_2", "check_lab10_3", "TASKS", "nfa_accepts", "first_difference",
           "reference_token_walk", "ALPHABET", "PATTERN_ATOMS"]

_re_compile = re.compile          # captured now: an answer cell that patches re later changes nothing here
_ASCII = re.ASCII
_Random = random.Random


def _fullmatch(pattern: str, text: str) -> bool:
    return _re_compile(pattern, _ASCII).fullmatch(text) is not None


def _show(data: bytes) -> str:
    """A byte string for a message: its text when it is valid UTF-8, with the bytes of non-ASCII text."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return f"the bytes {data!r} (not valid UTF-8)"
    return repr(text) if text.isascii() else f"{text!r} (UTF-8 bytes {data.hex(' ').upper()})"


def _raised(e: Exception, what: str, hint: str) -> None:
    __tracebackhide__ = True
    first = (str(e).strip().splitlines() or [""])[0]
    fail(f"your {what} raised {type(e).__name__}{': ' + first[:200] if first else ''}", hint)


# --------------------------------------------------------------------------- texts and patterns

# The edges of every class (\d \w \s, ranges) and of every UTF-8 length, plus ordinary characters.
ALPHABET = ("a", "b", "c", "0", "7", "_", "-", ".", " ", "\t", "\n", "\x00", "\x7f", "\x80", "é", "ß", "ÿ", "Ā",
            "ɐ", "\u07ff", "\u0800", "中", "€", "\uffff", "\U00010000", "😀", "\U0010fffe", "\U0010ffff")
PATTERN_ATOMS = ("a", "b", "é", "中", "😀", "-", r"\.", r"\d", r"\w", r"\s", r"\W", ".", "[a-c]", "[^a-c]",
                 "[à-\u07ff]", "[^\\d\\s]", "[é-\U0001f600]", "[\x7f-\u0800]", "[^\U0010fffe]")
_QUANTIFIERS = ("*", "+", "?", "{2}", "{0,2}", "{1,}", "{2,3}", "{0}")


def _patterns():
    """Random patterns: atoms joined by concatenation, alternation and the quantifiers, each operand grouped."""
    def extend(inner):
        seq = st.lists(inner, min_size=2, max_size=3).map(lambda xs: "".join(f"(?:{x})" for x in xs))
        alt = st.lists(inner, min_size=2, max_size=3).map(lambda xs: "|".join(f"(?:{x})" for x in xs))
        rep = st.tuples(inner, st.sampled_from(_QUANTIFIERS)).map(lambda t: f"(?:{t[0]}){t[1]}")
        return st.one_of(seq, alt, rep)
    return st.recursive(st.sampled_from(PATTERN_ATOMS), extend, max_leaves=5)


def _code_point(ranges, rng: random.Random) -> int:
    while True:
        lo, hi = rng.choice(ranges)
        cp = rng.choice([lo, hi, rng.randint(lo, hi), rng.randint(lo, min(hi, lo + 300))])
        if not 0xD800 <= cp <= 0xDFFF:
            return cp


def _sample_match(node, rng: random.Random, budget: list) -> str:
    """A random string `node` matches (the AST read as a generator)."""
    if isinstance(node, Chars):
        return chr(_code_point(node.ranges, rng)) if node.ranges else ""
    if isinstance(node, Concat):
        return "".join(_sample_match(p, rng, budget) for p in node.parts)
    if isinstance(node, Alt):
        return _sample_match(rng.choice(node.options), rng, budget)
    top = node.min + 3 if node.max is None else node.max
    n = rng.randint(node.min, top) if budget[0] > 0 else node.min
    budget[0] -= n
    return "".join(_sample_match(node.node, rng, budget) for _ in range(n))


def _corpus(pattern: str, seed: int) -> list[bytes]:
    """Byte strings to try: matches sampled from the AST, their mutations, random texts, broken UTF-8."""
    rng = _Random(seed)
    node = parse(pattern)
    matches = [_sample_match(node, rng, [12]) for _ in range(6)]
    texts = list(matches)
    for m in matches:
        chars = list(m)
        op = rng.choice(["drop", "insert", "replace", "double"])
        i = rng.randint(0, len(chars))
        if op == "drop" and chars:
            del chars[min(i, len(chars) - 1)]
        elif op == "insert" or not chars:
            chars.insert(i, rng.choice(ALPHABET))
        elif op == "replace":
            chars[min(i, len(chars) - 1)] = rng.choice(ALPHABET)
        else:
            chars = chars + chars
        texts.append("".join(chars))
    texts += ["".join(rng.choice(ALPHABET) for _ in range(rng.randint(0, 4))) for _ in range(5)]
    out = [t.encode("utf-8") for t in texts]
    for m in matches:                                   # the bytes of a match, cut or corrupted
        data = m.encode("utf-8")
        if data:
            out.append(data[:-1])
            j = rng.randrange(len(data))
            out.append(data[:j] + bytes([rng.choice([0x80, 0xBF, 0xC3, 0xE4, 0xF0, 0xFF, 0xC0])]) + data[j + 1:])
    return list(dict.fromkeys(out))


def _expected(pattern: str, data: bytes) -> bool:
    """Does `pattern` fully match the text whose UTF-8 bytes are `data`? (Not valid UTF-8: no text, no match.)"""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return _fullmatch(pattern, text)


# --------------------------------------------------------------------------- lab10_1 Thompson's construction

def _closure(eps, states) -> frozenset:
    """The states reachable from `states` by epsilon edges (a fixed point)."""
    seen, todo = set(states), list(states)
    while todo:
        for t in eps[todo.pop()]:
            if t not in seen:
                seen.add(t)
                todo.append(t)
    return frozenset(seen)


def nfa_accepts(edges, eps, start: int, end: int, data: bytes) -> bool:
    """The NFA's verdict on `data`, by definition: the set of states it can be in, moved on each byte."""
    current = _closure(eps, [start])
    for b in data:
        current = _closure(eps, {t for s in current for lo, hi, t in edges[s] if lo <= b <= hi})
        if not current:
            return False
    return end in current


_BYTES_HINT = Hint(
    "the NFA reads the UTF-8 BYTES of the text, not characters: a character above U+007F is 2 to 4 bytes (é is "
    "C3 A9, 中 is E4 B8 AD).",
    "so each (lo, hi) range of a Chars node becomes a few sequences of byte ranges, each a path of one edge per "
    "byte through fresh states.",
    "for each (lo, hi) of a Chars node, utf8_sequences(lo, hi) gives byte-range sequences like [(0xC3, 0xC3), "
    "(0xA0, 0xBF)]: chain one edge per byte through fresh states.")
_THOMPSON_HINT = Hint(
    "build each node's fragment from its children's fragments, joined by epsilon edges.",
    "Concat chains them, Alt branches from a new start and joins at a new end, Repeat makes min copies then "
    "(max - min) optional ones, or a loop when max is None — a NEW fragment (another build_nfa call) for every "
    "copy.")


def _read_nfa(nfa, pre: int, before, result, where: str):
    """The learner's NFA as plain lists (edges as (lo, hi, t) ints, eps as ints) and its fragment, checked."""
    __tracebackhide__ = True
    pair = as_ints(result, f"build_nfa's result for {where}")
    check(len(pair) == 2, f"build_nfa must return (start, end), got {len(pair)} numbers for {where}")
    if type(nfa.edges) is not list or type(nfa.eps) is not list:
        fail(f"nfa.edges and nfa.eps must stay lists (add to them with nfa.state(), nfa.edges[s].append(...), "
             f"nfa.eps[s].append(...)); yours became {type(nfa.edges).__name__} / {type(nfa.eps).__name__}")
    n = len(nfa.edges)
    check(len(nfa.eps) == n, f"nfa.edges has {n} states but nfa.eps {len(nfa.eps)}: add states with nfa.state()")
    edges, eps = [], []
    for s in range(n):
        if type(nfa.edges[s]) is not list or type(nfa.eps[s]) is not list:
            fail(f"nfa.edges[{s}] and nfa.eps[{s}] must be lists, got {type(nfa.edges[s]).__name__} / "
                 f"{type(nfa.eps[s]).__name__}")
        row = []
        for e in nfa.edges[s]:
            if type(e) not in (list, tuple) or len(e) != 3:
                fail(f"state {s} has the edge {e!r:.80}: an edge is a tuple (byte_lo, byte_hi, target)")
            lo, hi, t = as_ints(e, f"an edge of state {s} (byte_lo, byte_hi, target)")
            if not 0 <= lo <= hi <= 255:
                fail(f"your NFA for {where} has the edge ({lo:#x}, {hi:#x}) -> {t}: edge labels are bytes, "
                     f"0 <= byte_lo <= byte_hi <= 255" + (" — you used code points as symbols" if hi > 255 else ""),
                     _BYTES_HINT)
            check(0 <= t < n, f"state {s} has an edge to state {t}, which does not exist (states are 0..{n - 1})")
            row.append((lo, hi, t))
        edges.append(row)
        targets = as_ints(nfa.eps[s], f"nfa.eps[{s}]")
        bad = [t for t in targets if not 0 <= t < n]
        check(not bad, f"state {s} has an epsilon edge to state {bad[0] if bad else 0}, which does not exist")
        eps.append(targets)
    start, end = pair
    for name, s in (("start", start), ("end", end)):
        check(0 <= s < n, f"build_nfa returned {name} = {s}, which is not a state of the NFA (0..{n - 1})")
        check(s >= pre, f"build_nfa returned {name} = {s}, a state that existed before the call (the NFA already "
                        f"had {pre} states): make new states with nfa.state() and return the ids it gave you",
              "the NFA may already hold other fragments (your own recursive calls build into the same NFA): never "
              "assume numbering starts at 0.")
    if edges[:pre] != before[0] or eps[:pre] != before[1]:
        fail(f"build_nfa changed states that existed before the call (states 0..{pre - 1}) for {where}: only add "
             "edges from the states you create")
    return edges, eps, start, end


def _fresh_nfa(pre: int):
    nfa = NFA()
    for i in range(pre):                 # unrelated states already there: a byte loop and an epsilon self-edge
        nfa.state()
    for i in range(pre):
        nfa.edges[i].append((0x61, 0x7A, i))
        nfa.eps[i].append(i)
    return nfa, ([[(0x61, 0x7A, i)] for i in range(pre)], [[i] for i in range(pre)])


def _build(build_nfa, pattern: str, pre: int):
    __tracebackhide__ = True
    nfa, before = _fresh_nfa(pre)
    where = f"the pattern {pattern!r}"
    node = parse(pattern)
    try:
        result = build_nfa(node, nfa)
    except (NotImplementedError, GradingError):
        raise
    except RecursionError as e:
        _raised(e, f"build_nfa on {where}", "a fragment that links to itself without consuming a byte?")
    except RegexTooComplex as e:
        _raised(e, f"build_nfa on {where}", "a class such as . or [^a] holds over a million code points: never "
                                           "enumerate them one by one — utf8_sequences(lo, hi) turns a whole range "
                                           "into a few byte-range sequences.")
    except Exception as e:  # noqa: BLE001 — the learner's code may raise anything
        _raised(e, f"build_nfa on {where} ({node!r:.200})",
                "handle the four node types: Chars(ranges), Concat(parts) (parts may be empty: the empty pattern), "
                "Alt(options), Repeat(node, min, max) with max None for unbounded.")
    return _read_nfa(nfa, pre, before, result, where)


def _nfa_verdict(build_nfa, pattern, data, built=None, why=None, pre=0):
    __tracebackhide__ = True
    edges, eps, start, end = built or _build(build_nfa, pattern, pre)
    got, want = nfa_accepts(edges, eps, start, end, data), _expected(pattern, data)
    if got != want:
        verdict = "accepts" if got else "rejects"
        truth = ("it is not valid UTF-8, so no text matches it" if want is False and _not_utf8(data) else
                 f"re.fullmatch({pattern!r}, text) says it {'matches' if want else 'does not match'}")
        fail(f"your NFA for {pattern!r} {verdict} {_show(data)}, but {truth}" + (f" — {why}" if why else ""),
             _BYTES_HINT if not data.isascii() else _THOMPSON_HINT)
    return edges, eps, start, end


def _not_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return True
    return False


# (pattern, text or raw bytes, what a wrong verdict means)
_COPIES = ("every copy of a repeated node is a separate fragment: call build_nfa on the body once per copy — linking "
           "one fragment twice makes a loop")
NFA_PROBES = (
    ("ab", "ab", "concatenation: link each part's end to the next part's start with an epsilon edge"),
    ("ab", "a", "concatenation: the text must go through every part"),
    ("a|bc", "bc", "alternation: epsilon edges from a new start to each option's start, and from each option's end "
                   "to a new end"),
    ("a|bc", "b", "alternation: each option is matched whole"),
    ("", "", "the empty pattern parses to Concat(()), no parts: it matches only the empty text (start == end, or "
             "an epsilon edge between them)"),
    ("(?:ab|)c", "c", "an empty option, Concat(()), matches the empty text"),
    ("[a-c]", "c", "an edge (lo, hi, t) reads any byte from lo to hi, both included"),
    ("a*", "", "x* matches zero copies too: an epsilon path that skips the body"),
    ("a*", "aaa", "x* repeats: an epsilon edge from the body's end back to where another copy starts"),
    ("a+", "", "x+ needs at least one copy (Repeat(x, 1, None))"),
    ("a{2}", "a", _COPIES),
    ("a{2}", "aaa", _COPIES),
    ("a{0,2}", "a", "x{m,n} is m copies, then n - m copies that may each be left out (the text may stop after any "
                    "of them)"),
    ("a{1,3}", "aaaa", "x{1,3} allows at most 3 copies"),
    ("(?:a){0}b", "b", "x{0} matches only the empty text"),
    ("(?:ab)*c", "ababc", "a repeated group: the loop goes around the whole body"),
    # a loop whose body ends in a loop: without fresh enter/leave states around each loop, the outer loop's skip
    # edge lands on the inner loop's end, whose back edge then reads the inner body on its own
    ("(?:ab*)*a", "ba", "a loop inside a loop: wrap every loop in its own enter and leave states (enter ─ε─► body "
                        "─ε─► leave, body end ─ε─► body start, enter ─ε─► leave), so that nothing but the loop's own "
                        "back edge leaves the body's end"),
    ("(?:a|b*)*c", "bbac", "a loop inside an alternation inside a loop: the outer loop repeats whole options"),
    # a loop whose body STARTS with a loop: an outer skip edge that leaves from the body's start (no enter state
    # of its own) is also reachable after the inner loop went round, so the text may stop inside a copy
    ("(?:b*a)*", "b", "a loop whose body starts with a loop: wrap every loop in its own enter and leave states (enter "
                      "─ε─► body ─ε─► leave, body end ─ε─► body start, enter ─ε─► leave): the skip edge must leave "
                      "from the loop's own enter state, which nothing inside the body leads back to"),
    ("(?:a*b*)*c", "abac", "a loop of loops: the outer loop repeats any mix of a's and b's"),
    ("(?:a|)*b", "aab", "a loop whose body can match the empty text (an epsilon cycle): still a loop"),
    ("(?:(?:a*)?)*b", "b", "an optional loop inside a loop: epsilon cycles must not stop the match"),
    ("(?:)*", "", "a loop of the empty pattern matches only the empty text"),
    ("中", "中", "中 is U+4E2D: three bytes in UTF-8, E4 B8 AD"),
    ("é", "é", "é is U+00E9: two bytes in UTF-8, C3 A9"),
    ("é", b"\xe9", "the single byte E9 is é in Latin-1, not in UTF-8 (C3 A9): it is not valid UTF-8"),
    ("[à-\u07ff]", "Ā", "a range of 2-byte characters is not one byte range per position: U+0100 is C4 80, outside "
                        "C3..DF x A0..BF — use every byte-range sequence that utf8_sequences(lo, hi) returns"),
    (".", "😀", "😀 is U+1F600: four bytes in UTF-8, F0 9F 98 80"),
    (".", b"\x80", "a lone continuation byte (80..BF) is not a character"),
    ("[^a]", "中", "a negated class covers every other code point, multi-byte ones included"),
)


def verify_lab10_1(build_nfa) -> None:
    for pattern, text, why in NFA_PROBES:
        data = text if isinstance(text, bytes) else text.encode("utf-8")
        _nfa_verdict(build_nfa, pattern, data, why=why)

    @given(pattern=_patterns(), seed=st.integers(0, 2**32 - 1), pre=st.integers(0, 3))
    @example(pattern="(?:(?:a)*)*", seed=1, pre=0)                  # nested loops: epsilon cycles
    @example(pattern="(?:[^a-c]){2,3}", seed=2, pre=2)              # a big class, copied; states before the call
    @example(pattern="(?:(?:é)|(?:\\d))+(?:-)?", seed=3, pre=1)
    @example(pattern="(?:[\x7f-\u0800])(?:😀)?", seed=4, pre=0)
    def prop(pattern, seed, pre):
        built = _build(build_nfa, pattern, pre)
        for data in _corpus(pattern, seed):
            _nfa_verdict(build_nfa, pattern, data, built=built)

    run_property(prop, max_examples=60, hint=Hint(      # failures inside that carry their own hint keep it
        "Thompson's construction over UTF-8 bytes: build each node's fragment from its children's fragments, "
        "joined by epsilon edges; a character class becomes paths of byte ranges.",
        "Chars: a path from start to end for every UTF-8 byte-range sequence of its ranges (utf8_sequences); "
        "Concat: chain the parts (no parts: one epsilon edge); Alt: epsilon edges into and out of every option; "
        "Repeat: min chained copies, then max − min optional ones, or a loop when max is None."))


# --------------------------------------------------------------------------- lab10_2 the subset construction

def first_difference(transitions, accepting, start: int, edges, eps, nfa_start: int, accept: int,
                     limit: int = 50_000):
    """The shortest byte string on which the DFA (transitions [S, 256] with DEAD = -1, accepting [S], start) and the
    NFA (edges, eps, nfa_start, accept) disagree, as (bytes, the DFA accepts it), or None when they accept the same
    language. A breadth-first walk over pairs (DFA state, set of NFA states); bytes that behave alike on both
    sides (no edge bound and no change in the DFA's row between them) are tried once."""
    first = (start, _closure(eps, [nfa_start]))
    seen, queue = {first}, deque([(first, b"")])
    while queue:
        (d, subset), path = queue.popleft()
        dfa_says = d != DEAD and bool(accepting[d])
        if dfa_says != (accept in subset):
            return path, dfa_says
        if d == DEAD and not subset:
            continue
        here = {0, 256}
        for s in subset:
            for lo, hi, _ in edges[s]:
                here.update((lo, hi + 1))
        if d != DEAD:
            here.update((np.flatnonzero(np.diff(transitions[d])) + 1).tolist())
        bounds = sorted(here)
        for lo, hi in zip(bounds, bounds[1:]):
            b = next((c for c in (0x61, 0x30, 0x20) if lo <= c < hi), lo)      # a readable byte if there is one
            nxt = (DEAD if d == DEAD else int(transitions[d, b]),
                   _closure(eps, {t for s in subset for a, z, t in edges[s] if a <= b <= z}))
            if nxt not in seen:
                if len(seen) >= limit:
                    fail(f"your DFA and the NFA together reach more than {limit} state pairs: the DFA is far larger "
                         "than the subset construction gives")
                seen.add(nxt)
                queue.append((nxt, path + bytes([b])))
    return None


def _make_nfa(n: int, edges, eps):
    nfa = NFA()
    for _ in range(n):
        nfa.state()
    for s in range(n):
        nfa.edges[s].extend(edges[s])
        nfa.eps[s].extend(eps[s])
    return nfa


def _read_dfa(dfa, where: str):
    """The learner's DFA as plain arrays, checked: exact types, shapes, state numbers."""
    __tracebackhide__ = True
    if type(dfa) is not DFA:
        fail(f"determinize's result must be a minillm.structured.automata.DFA for {where}, got a "
             f"{type(dfa).__module__}.{type(dfa).__qualname__}", "return DFA(transitions, accepting, start).")
    t, acc = dfa.transitions, dfa.accepting
    if type(t) is not np.ndarray or t.dtype != np.int32 or t.ndim != 2 or t.shape[1] != 256:
        fail(f"dfa.transitions must be a numpy int32 array [num_states, 256] for {where}, got "
             + (f"an array of dtype {t.dtype} and shape {t.shape}" if type(t) is np.ndarray
                else f"a {type(t).__name__}"),
             "np.array(rows, dtype=np.int32): one row of 256 next states (or DEAD = -1) per DFA state.")
    n = t.shape[0]
    if type(acc) is not np.ndarray or acc.dtype != np.bool_ or acc.shape != (n,):
        fail(f"dfa.accepting must be a numpy bool array [{n}] (one flag per state) for {where}, got "
             + (f"an array of dtype {acc.dtype} and shape {acc.shape}" if type(acc) is np.ndarray
                else f"a {type(acc).__name__}"))
    start = as_int(dfa.start, "dfa.start")
    check(n >= 1 and 0 <= start < n, f"dfa.start = {start} is not a state of your DFA (it has {n} states) for "
                                     f"{where}: the start state is the epsilon-closure of the NFA's start")
    t, acc = t.copy(), acc.copy()
    bad = (t < DEAD) | (t >= n)
    if bad.any():
        s, b = (int(v) for v in np.argwhere(bad)[0])
        fail(f"dfa.transitions[{s}, {b}] = {int(t[s, b])} for {where}: every entry is a state (0..{n - 1}) or DEAD "
             "(-1)")
    return t, acc, start


def _dead_step(transitions, s0: int, edges, eps, start: int, data: bytes) -> str | None:
    """Along the counterexample, the first byte where the DFA goes DEAD and the NFA does not, or the other way
    round: a mistake in the moves themselves (byte ranges, DEAD), whatever the closures did."""
    d, subset = s0, _closure(eps, [start])
    for b in data:
        targets = {t for s in subset for lo, hi, t in edges[s] if lo <= b <= hi}
        nd = int(transitions[d, b])
        if targets and nd == DEAD:
            lo, hi = next((lo, hi) for s in subset for lo, hi, t in edges[s] if lo <= b <= hi)
            return (f"your DFA has no transition on byte {b:#04x}, although the NFA has the edge ({lo:#04x}, "
                    f"{hi:#04x}) there: an edge (lo, hi, t) covers every byte from lo to hi, both ends included, "
                    "bytes above 0x7F too")
        if not targets and nd != DEAD:
            return (f"on byte {b:#04x} no NFA state has an edge, yet your DFA goes to state {nd}: where no NFA "
                    "state has an edge for a byte, the transition is DEAD (-1) — not state 0")
        d, subset = nd, _closure(eps, targets)
    return None


def _snapshot(nfa):
    return [list(r) for r in nfa.edges], [list(r) for r in nfa.eps]


def _determinize_and_compare(determinize, nfa, start, accept, where, why=None):
    __tracebackhide__ = True
    edges, eps = _snapshot(nfa)
    try:
        dfa = determinize(nfa, start, accept)
    except (NotImplementedError, GradingError):
        raise
    except RecursionError as e:
        _raised(e, f"determinize on {where}", "the NFA has epsilon cycles: compute the closure with a work list and a "
                                             "set of states already seen, not by unbounded recursion.")
    except Exception as e:  # noqa: BLE001
        _raised(e, f"determinize on {where}", "nfa.edges[s] is a list of (byte_lo, byte_hi, target), nfa.eps[s] a "
                                             "list of targets; sets of NFA states make good dict keys as frozensets.")
    if _snapshot(nfa) != (edges, eps):
        fail(f"determinize changed the NFA it was given ({where}): read it, don't modify it")
    t, acc, s0 = _read_dfa(dfa, where)
    diff = first_difference(t, acc, s0, edges, eps, start, accept)
    if diff is not None:
        data, dfa_says = diff
        if not any(eps):               # no epsilon edges: the DFA's states are single NFA states, closures aside
            why = _dead_step(t, s0, edges, eps, start, data) or why
        fail(f"your DFA {'accepts' if dfa_says else 'rejects'} {_show(data)} but the NFA ({where}) "
             f"{'does not' if dfa_says else 'does'}" + (f" — {why}" if why else ""),
             "the start state is the epsilon-closure of {start}; from a set of states, a byte leads to the "
             "epsilon-closure of every target of an edge (lo, hi, t) with lo <= byte <= hi, or to DEAD (-1) when "
             "there is none; a set is accepting when it contains `accept`.")


# (what a wrong answer means, number of states, edges, eps, start, accept)
def _frozen_probes(probes):
    return tuple((why, n, tuple(tuple(r) for r in edges), tuple(tuple(r) for r in eps), start, accept)
                 for why, n, edges, eps, start, accept in probes)


DETERMINIZE_PROBES = _frozen_probes([
    ("where no NFA state has an edge for a byte, the transition is DEAD (-1)",
     2, [[(0x61, 0x61, 1)], []], [[], []], 0, 1),
    ("an edge (lo, hi, t) covers every byte from lo to hi, both ends included, bytes above 0x7F too",
     2, [[(0x61, 0x63, 1), (0x80, 0xFF, 1)], []], [[], []], 0, 1),
    ("the start state must be the epsilon-closure of {start}: here the only edge leaves a state reached from the "
     "start by an epsilon edge", 3, [[], [(0x61, 0x61, 2)], []], [[1], [], []], 0, 2),
    ("after each move, follow epsilon edges: the state after a byte is the epsilon-closure of the edges' targets",
     3, [[(0x61, 0x61, 1)], [], []], [[], [2], []], 0, 2),
    ("the closure follows epsilon edges transitively, any number of steps (0 -> 1 -> 2 here, and 3 -> 4 -> 5)",
     6, [[], [], [(0x61, 0x61, 3)], [], [], []], [[1], [2], [], [4], [5], []], 0, 5),
    ("a DFA state is a SET of NFA states: the same byte can lead from several of them, to several targets",
     5, [[(0x61, 0x63, 1), (0x62, 0x64, 2)], [(0x78, 0x78, 3)], [(0x79, 0x79, 4)], [], []],
     [[], [], [], [4], []], 0, 4),
    ("when the start is the accepting state, the empty text is accepted",
     1, [[(0x61, 0x61, 0)]], [[]], 0, 0),
    ("epsilon cycles (0 -> 1 -> 0): the closure must stop at states it has already seen",
     3, [[], [(0x61, 0x61, 2)], []], [[1], [0], [0]], 0, 2),
])


@st.composite
def _random_nfas(draw):
    n = draw(st.integers(1, 7))
    byte = st.sampled_from([0x00, 0x2D, 0x30, 0x61, 0x62, 0x63, 0x7F, 0x80, 0xA9, 0xC3, 0xE4, 0xFF])
    edges = [[(lo, min(255, lo + w), t) for lo, w, t in
              draw(st.lists(st.tuples(byte, st.integers(0, 3), st.integers(0, n - 1)), max_size=3))]
             for _ in range(n)]
    eps = [draw(st.lists(st.integers(0, n - 1), max_size=2)) for _ in range(n)]
    return n, edges, eps, draw(st.integers(0, n - 1)), draw(st.integers(0, n - 1))


def verify_lab10_2(determinize) -> None:
    for why, n, edges, eps, start, accept in DETERMINIZE_PROBES:
        edges, eps = [list(r) for r in edges], [list(r) for r in eps]
        _determinize_and_compare(determinize, _make_nfa(n, edges, eps), start, accept,
                                 f"edges {edges}, epsilon edges {eps}, start {start}, accept {accept}", why)

    @given(case=_random_nfas(), pattern=_patterns())
    @example(case=(3, [[(0x61, 0x61, 1)], [(0x62, 0x62, 2)], []], [[1], [0, 2], [0]], 0, 2), pattern="(?:(?:a)*)*")
    @example(case=(2, [[(0x80, 0xBF, 1)], [(0xC3, 0xC3, 0)]], [[], []], 1, 1), pattern="(?:[^a-c]){2,3}")
    def prop(case, pattern):
        n, edges, eps, start, accept = case
        _determinize_and_compare(determinize, _make_nfa(n, edges, eps), start, accept,
                                 f"edges {edges}, epsilon edges {eps}, start {start}, accept {accept}")
        nfa = NFA()                                   # the Thompson NFA of a pattern over UTF-8 bytes
        s, e = nfa.build(parse(pattern))
        _determinize_and_compare(determinize, nfa, s, e, f"the Thompson NFA of {pattern!r}")

    run_property(prop, max_examples=60, hint=Hint(
        "the subset construction: a DFA state stands for a set of NFA states, closed under epsilon edges.",
        "start from the epsilon-closure of {start}; from a set, the next set on byte b is the closure of the states "
        "its edges reach on b (none: DEAD); a set accepts when it holds accept; number each new set once, with a "
        "work list."))


# --------------------------------------------------------------------------- lab10_3 the token index

def reference_token_walk(transitions, state: int, data: bytes) -> int:
    """The DFA state after reading every byte of `data` from `state`, or DEAD (the definition, one byte at a
    time: once DEAD, always DEAD)."""
    for b in data:
        state = int(transitions[state, b])
        if state == DEAD:
            return DEAD
    return state


def _numpy_walk(transitions, state: int, data: bytes) -> int:
    """What a walk that indexes the table with DEAD = -1 computes: numpy reads row -1 as the LAST state's row."""
    for b in data:
        state = int(transitions[state, b])
    return state


def _read_index(index, dfa, T, acc, start, V: int, eos, where: str):
    """The learner's TokenIndex as plain lists (allowed ids and next states per state), checked."""
    __tracebackhide__ = True
    if type(index) is not TokenIndex:
        fail(f"build_token_index's result must be a minillm.structured.token_index.TokenIndex for {where}, got a "
             f"{type(index).__module__}.{type(index).__qualname__}",
             "return TokenIndex(dfa, allowed, next_states, tuple(eos_token_ids), vocab_size).")
    d = index.dfa
    if type(d) is not DFA or type(d.transitions) is not np.ndarray or type(d.accepting) is not np.ndarray \
            or not np.array_equal(d.transitions, T) or not np.array_equal(d.accepting, acc) \
            or type(d.start) not in (int, np.int32, np.int64) or int(d.start) != start:
        fail(f"index.dfa must be the DFA build_token_index was given ({where}): the engine reads its start state and "
             "its accepting states from it")
    size = as_int(index.vocab_size, "index.vocab_size")
    check(size == V, f"index.vocab_size = {size}, but the vocabulary has {V} tokens (len(vocab.token_bytes)) for "
                     f"{where}")
    got_eos = as_ints(index.eos_token_ids, "index.eos_token_ids")
    if sorted(got_eos) != sorted(eos):
        fail(f"index.eos_token_ids = {tuple(got_eos)} but build_token_index was given {tuple(eos)} ({where}): pass "
             "them on — TokenIndex allows EOS exactly in accepting states, where the text is a full match",
             "TokenIndex(dfa, allowed, next_states, tuple(eos_token_ids), vocab_size)")
    S = T.shape[0]
    for name in ("allowed", "next_states"):
        v = getattr(index, name)
        if type(v) not in (list, tuple) or len(v) != S:
            fail(f"index.{name} must be a list with one numpy array per DFA state ({S}) for {where}, got "
                 + (f"{len(v)} entries" if type(v) in (list, tuple) else f"a {type(v).__name__}"))
    allowed, nexts = [], []
    for s in range(S):
        a, nx = index.allowed[s], index.next_states[s]
        for name, arr in (("allowed", a), ("next_states", nx)):
            if type(arr) is not np.ndarray or arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
                fail(f"index.{name}[{s}] must be a 1-D numpy array of integers, got "
                     + (f"an array of dtype {arr.dtype} and shape {arr.shape}" if type(arr) is np.ndarray
                        else f"a {type(arr).__name__}") + f" ({where})")
        a, nx = [int(x) for x in a.tolist()], [int(x) for x in nx.tolist()]
        check(len(a) == len(nx), f"index.allowed[{s}] has {len(a)} tokens but index.next_states[{s}] {len(nx)} "
                                 f"states ({where}): one next state per allowed token, in the same order")
        if any(x >= y for x, y in zip(a, a[1:])):
            i = next(i for i, (x, y) in enumerate(zip(a, a[1:])) if x >= y)
            fail(f"index.allowed[{s}] must be sorted ascending without repeats ({a[i]} comes before {a[i + 1]}) "
                 f"({where}): the TokenIndex finds a token with a binary search (np.searchsorted)"
                 + (" — the ids here go past 65535: keep them in int32 / int64 arrays" if V > 2**16 else ""),
                 "collect the allowed ids in increasing order, or sort them with their next states (np.argsort).")
        bad = [x for x in a if not 0 <= x < V]
        check(not bad, f"index.allowed[{s}] holds token id {bad[0] if bad else 0}, outside the vocabulary "
                       f"[0, {V}) ({where})")
        bad = [x for x in nx if not 0 <= x < S]
        check(not bad, f"index.next_states[{s}] holds {bad[0] if bad else 0}, which is not a state of the DFA "
                       f"(0..{S - 1}) ({where}): a token that leads to DEAD is not allowed at all")
        allowed.append(a)
        nexts.append(nx)
    return allowed, nexts


def _expected_index(T, token_bytes) -> list[dict]:
    """Per state, {token: the state after all its bytes} for every token whose bytes can all be read — the
    definition, walked one byte at a time (inline: it runs states x vocabulary times)."""
    rows = T.tolist()
    spelled = [(t, data) for t, data in enumerate(token_bytes) if data]
    out = []
    for s in range(len(rows)):
        ok = {}
        for t, data in spelled:
            state = s
            for b in data:
                state = rows[state][b]
                if state == DEAD:
                    break
            if state != DEAD:
                ok[t] = state
        out.append(ok)
    return out


_CHAR_WHY = (" — the token is part of a character (byte-level BPE splits multi-byte characters between tokens): "
             "walk its bytes, never decode it to text")


_WALK_HINT = Hint(
    "a token is allowed in state s only when ALL its bytes can be read from s, one transition per byte.",
    "walk its bytes from s through dfa.transitions and stop at the first DEAD (-1): allowed only when no byte hit "
    "DEAD, and its next state is where its last byte led.")


def _first_mismatch(T, acc, token_bytes, eos, allowed, nexts, where: str) -> None:
    """Fail at the first (state, token) where the learner's index differs from walking the token's bytes."""
    __tracebackhide__ = True
    eos = set(eos)
    expected = _expected_index(T, token_bytes)
    for s in range(T.shape[0]):
        got, want_all = dict(zip(allowed[s], nexts[s])), expected[s]
        if got == want_all:
            continue
        state = f"state {s} ({'accepting' if acc[s] else 'not accepting'})"
        for t in allowed[s]:
            data = token_bytes[t]
            if t in eos:
                fail(f"your index puts EOS (token {t}) in allowed[{s}], {state} ({where})"
                     + ("" if acc[s] else ": there the text so far is not a full match, and stopping would leave "
                                          "invalid output"),
                     "leave EOS out of allowed: TokenIndex(..., eos_token_ids, ...) allows it exactly in accepting "
                     "states (index.allowed_token_ids(state) adds it there).")
            if data is None:
                fail(f"your index allows token {t} in {state}, but it is a special token (vocab.token_bytes[{t}] is "
                     f"None) ({where}): special tokens are never allowed", _WALK_HINT)
            if data == b"":
                fail(f"your index allows token {t} in {state}, but it spells no bytes (b'') ({where}): an empty "
                     "token never moves the automaton, and a model could emit it forever — never allow it",
                     _WALK_HINT)
            want = want_all.get(t, DEAD)
            if got[t] != want and _not_utf8(data):
                fail(f"your index {'allows' if want == DEAD else 'sends'} token {t} {_show(data)} "
                     + (f"in {state}, but its bytes cannot all be read from there" if want == DEAD else
                        f"from {state} to state {got[t]}, but reading its bytes leads to state {want}")
                     + f" ({where}){_CHAR_WHY}", _WALK_HINT)
            if want == DEAD:
                k = next(i for i in range(1, len(data) + 1) if reference_token_walk(T, s, data[:i]) == DEAD)
                why = ""
                if k < len(data) and _numpy_walk(T, s, data) == got[t]:
                    why = (" — the walk died and came back: DEAD is -1, and numpy reads transitions[-1] as the "
                           "LAST state's row; stop at DEAD (or give the table an extra all-DEAD row for -1 to hit)")
                elif k > 1:
                    why = (" — you allow a token when only a prefix of its bytes matches: the model would emit all "
                           "of its bytes, so every byte must keep the DFA alive")
                fail(f"your index allows token {t} {_show(data)} in {state}, but its bytes die at byte {k} "
                     f"({_show(data[:k - 1]) if k > 1 else 'the first byte'} "
                     f"{'is fine, then ' if k > 1 else ''}{data[k - 1]:#04x} has no transition) ({where}){why}",
                     _WALK_HINT)
            if got[t] != want:
                why = (" — that is where its FIRST byte leads; the next state is after all its bytes"
                       if len(data) > 1 and got[t] == reference_token_walk(T, s, data[:1]) else
                       " — that is the state before its last byte" if len(data) > 1 and
                       got[t] == reference_token_walk(T, s, data[:-1]) else
                       " — that is the state you started from" if got[t] == s else "")
                fail(f"your index sends token {t} {_show(data)} from {state} to state {got[t]}, but reading its "
                     f"bytes leads to state {want} ({where}){why}", _WALK_HINT)
        for t, want in want_all.items():
            if t not in got and t not in eos:
                data = token_bytes[t]
                why = ""
                if _not_utf8(data):
                    why = _CHAR_WHY
                elif t >= 2**16:
                    why = " — token ids go past 65535: keep them in int32/int64 arrays"
                fail(f"your index does not allow token {t} {_show(data)} in {state}, but all its bytes can be read "
                     f"from there (it leads to state {want}) ({where}){why}", _WALK_HINT)


def _index_case(build_token_index, T, acc, start, token_bytes, eos, where: str) -> None:
    __tracebackhide__ = True
    dfa = DFA(T.copy(), acc.copy(), start)
    vocab = VocabTrie.build(list(token_bytes))
    given_eos = tuple(eos)
    try:
        index = build_token_index(dfa, vocab, given_eos)
    except (NotImplementedError, GradingError):
        raise
    except Exception as e:  # noqa: BLE001
        _raised(e, f"build_token_index on {where}",
                "vocab.token_bytes[i] is token i's bytes (None for a special token); dfa.transitions[s, byte] is "
                "the next state or DEAD (-1); dfa.num_states states.")
    if not (np.array_equal(dfa.transitions, T) and np.array_equal(dfa.accepting, acc) and dfa.start == start):
        fail(f"build_token_index changed the DFA it was given ({where}): read it, don't modify it")
    allowed, nexts = _read_index(index, dfa, T, acc, start, len(token_bytes), list(eos), where)
    _first_mismatch(T, acc, token_bytes, eos, allowed, nexts, where)


def _table(num_states: int, edges: dict, accepting) -> tuple[np.ndarray, np.ndarray]:
    T = np.full((num_states, 256), DEAD, dtype=np.int32)
    for (s, b), t in edges.items():
        T[s, b] = t
    return T, np.array(accepting, dtype=bool)


def _regex_dfa(pattern: str):
    d = compile_regex(pattern)
    return d.transitions.copy(), d.accepting.copy(), int(d.start)


def _index_probes():
    """(what a wrong answer means, T, accepting, start, token_bytes, eos ids), built when the check runs."""
    a, b = 0x61, 0x62
    revive_T, revive_acc = _table(2, {(0, a): 1, (1, b): 1}, [False, True])
    digits = [None, None, b"1", b"12", b"123", b"1234", b"1a", b"a", b"3-", b"-"]
    utf8 = [None, None, b"\xc3", b"\xa9", b"\xc3\xa9", b"\xe4\xb8", b"\xad", b"\xe4", b"\xb8\xad", "é中".encode(),
            b"x", "é".encode() + b"x"]
    return [
        ("a token is allowed only when ALL its bytes can be read", *_regex_dfa(r"\d{3}-?"), digits, (1,)),
        ("once DEAD, a walk stays DEAD", revive_T, revive_acc, 0, [None, b"a", b"b", b"ab", b"bb", b"ba", b"abb"],
         (0,)),
        ("special (None) and empty tokens are never allowed", *_regex_dfa("a*"),
         [b"a", None, None, b"", b"aa", None], (2,)),
        ("EOS is not among the allowed tokens", *_regex_dfa("(?:ab)?"), [b"ab", None, b"a", b"b"], (1,)),
        ("tokens can split a multi-byte character", *_regex_dfa("(?:é|中)+x?"), utf8, (0, 1)),
        ("the next state is the one after all of the token's bytes", *_regex_dfa("abc|abd"),
         [None, b"a", b"ab", b"abc", b"b", b"bc", b"c", b"abd"], (0,)),
    ]


_VOCAB_BYTES = (0x00, 0x20, 0x22, 0x2D, 0x30, 0x31, 0x61, 0x62, 0x63, 0x7B, 0x7D, 0x80, 0x9F, 0xA9, 0xAD, 0xB8,
                0xC3, 0xE4, 0xF0, 0xFF)


@st.composite
def _random_dfa_case(draw):
    n = draw(st.integers(1, 6))
    active = draw(st.lists(st.sampled_from(_VOCAB_BYTES), min_size=1, max_size=6, unique=True))
    edges = {(s, c): draw(st.integers(DEAD, n - 1)) for s in range(n) for c in active}
    T, acc = _table(n, {k: v for k, v in edges.items() if v != DEAD},
                    draw(st.lists(st.booleans(), min_size=n, max_size=n)))
    return T, acc, draw(st.integers(0, n - 1)), draw(st.integers(0, 2**32 - 1)), active


def _random_vocab(rng: random.Random, pieces: list[int], size: int, text: bytes = b"") -> tuple[list, tuple]:
    """Token byte strings: random ones over `pieces`, cuts of `text` at any byte offset (partial characters),
    repeats and prefixes of each other; a few special (None) ids, one of them EOS, and an empty token."""
    vocab: list = []
    while len(vocab) < size:
        if text and rng.random() < 0.6:
            i = rng.randrange(len(text))
            vocab.append(text[i:i + rng.choice([1, 1, 2, 3, 4, 6])])
        else:
            vocab.append(bytes(rng.choice(pieces) for _ in range(rng.choice([1, 1, 2, 3, 5]))))
    specials = rng.sample(range(size), 3)
    for i in specials:
        vocab[i] = None
    vocab[rng.choice([i for i in range(size) if i not in specials])] = b""
    return vocab, tuple(sorted(rng.sample(specials, rng.choice([1, 2]))))


def verify_lab10_3(build_token_index) -> None:
    for why, T, acc, start, token_bytes, eos in _index_probes():
        _index_case(build_token_index, T, acc, start, token_bytes, eos,
                    f"a {T.shape[0]}-state DFA and the vocabulary {token_bytes} with EOS {eos}; checked: {why}")

    @given(case=_random_dfa_case(), pattern=_patterns(), seed=st.integers(0, 2**32 - 1))
    def prop(case, pattern, seed):
        T, acc, start, vseed, active = case
        rng = _Random(vseed)
        vocab, eos = _random_vocab(rng, list(active) + [rng.choice(_VOCAB_BYTES)], rng.randint(5, 40))
        _index_case(build_token_index, T, acc, start, vocab, eos,
                    f"a {T.shape[0]}-state DFA (start {start}) and the vocabulary {vocab} with EOS {eos}")
        rng = _Random(seed)
        text = "".join(_sample_match(parse(pattern), rng, [10]) + rng.choice(ALPHABET) for _ in range(8))
        vocab, eos = _random_vocab(rng, list(text.encode("utf-8")[:8]) or [0x61], 60, text.encode("utf-8"))
        T, acc, start = _regex_dfa(pattern)
        _index_case(build_token_index, T, acc, start, vocab, eos,
                    f"the DFA of {pattern!r} and a vocabulary of {len(vocab)} tokens cut from {text!r}, EOS {eos}")

    run_property(prop, max_examples=40, hint=Hint(
        "a token is allowed in a DFA state when its WHOLE byte string can be read from that state without "
        "reaching DEAD.",
        "walk every token's bytes through dfa.transitions from every state and keep the token id (sorted) with the "
        "state where it ends; special (None) and empty tokens and EOS never go in."))
    _large_vocabulary(build_token_index)


def _large_vocabulary(build_token_index) -> None:
    """A vocabulary of 70,000 tokens (ids beyond 16 bits, like Llama 3's 128k), for a small JSON-ish pattern."""
    __tracebackhide__ = True
    rng = _Random(10)
    text = '{"id": 12, "name": "é中x"} [1, 2, "ab"]'.encode("utf-8")
    vocab, _ = _random_vocab(rng, list(b'{}":, 0123456789abcdeinmx') + [0xC3, 0xA9, 0xE4, 0xB8, 0xAD], 70_000, text)
    eos = (69_999,)
    vocab[69_999] = None
    T, acc, start = _regex_dfa(r'\{"(?:id|name)": (?:\d+|"[^"]*")\}')
    _index_case(build_token_index, T, acc, start, vocab, eos,
                f"a {T.shape[0]}-state DFA and a vocabulary of {len(vocab)} tokens (ids up to 69,999)")


# --------------------------------------------------------------------------- the tasks

TASKS = {t.id: t for t in (
    Task("lab10_1", what="build_nfa", verify=verify_lab10_1,
         engine=minillm_objects("minillm.structured.automata:NFA.build"), oracles=lambda: [nfa_accepts]),
    Task("lab10_2", what="determinize", verify=verify_lab10_2,
         engine=minillm_objects("minillm.structured.automata:determinize",
                                "minillm.structured.automata:compile_regex"),
         oracles=lambda: [first_difference, _closure]),
    Task("lab10_3", what="build_token_index", verify=verify_lab10_3,
         engine=minillm_objects("minillm.structured.token_index:build_token_index",
                                "minillm.structured.token_index:VocabTrie.walk",
                                "minillm.structured.token_index:regex_token_index",
                                "minillm.structured.automata:DFA.step"),
         oracles=lambda: [reference_token_walk, _expected_index, _numpy_walk]),
)}


check_lab10_1 = TASKS["lab10_1"].checker(
    'build_nfa(node, nfa) -> (start, end): the Thompson fragment of a regex AST, over UTF-8 bytes, built into nfa.')
check_lab10_2 = TASKS["lab10_2"].checker(
    'determinize(nfa, start, accept) -> DFA(transitions int32 [S, 256] with DEAD = -1, accepting bool [S], start): '
    'the subset construction, with epsilon-closures.')
check_lab10_3 = TASKS["lab10_3"].checker(
    'build_token_index(dfa, vocab, eos_token_ids) -> TokenIndex: per state the sorted tokens whose whole byte '
    'string keeps the DFA alive, and where each leads; no special, empty or EOS token.')
