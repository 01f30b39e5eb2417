"""Regex AST -> byte-level automaton: UTF-8 byte sequences for code point ranges, a Thompson NFA over bytes, subset
construction (over byte classes, not 256 symbols) with a state cap and a time limit, then minimization and trimming.

The DFA reads the UTF-8 bytes of the text, so a token made of partial characters (byte-level BPE) can be walked
through it without decoding."""
from __future__ import annotations

import bisect
from dataclasses import dataclass

import numpy as np

from minillm.structured.regex import Alt, Chars, Concat, Repeat, parse

DEAD = -1
MAX_STATES = 10_000          # DFA states before a pattern is refused as too complex
# Work before the same: the byte-class transitions the subset construction walks plus the NFA states its closures
# gather. A count, not seconds, so a pattern gets the same verdict on a quiet and on a loaded machine (measured
# 100k-375k steps/s on a quiet 2-core machine, 2026-11-28: about 5-20 s of construction).
MAX_WORK = 2_000_000
MAX_NFA_STATES = 200_000


class RegexTooComplex(ValueError):
    """The automaton would be too large (e.g. `[ab]*a[ab]{20}` needs 2^21 DFA states)."""


# ---------------------------------------------------------------------------------------------- UTF-8

_LIMITS = (0x7F, 0x7FF, 0xFFFF, 0x10FFFF)


def _encode(cp: int) -> bytes:
    return chr(cp).encode("utf-8", "surrogatepass")


def utf8_sequences(lo: int, hi: int) -> list[list[tuple[int, int]]]:
    """The byte-range sequences whose concatenations are exactly the UTF-8 encodings of code points lo..hi
    (surrogates D800-DFFF excluded). Each sequence is a list of (byte_lo, byte_hi) per position."""
    out: list[list[tuple[int, int]]] = []
    stack = [(lo, hi)]
    while stack:
        lo, hi = stack.pop()
        if lo > hi:
            continue
        if lo <= 0xDFFF and hi >= 0xD800:                       # cut the surrogates out
            stack += [(lo, 0xD7FF), (0xE000, hi)]
            continue
        split = next((lim for lim in _LIMITS if lo <= lim < hi), None)
        if split is not None:                                   # different encoded lengths
            stack += [(lo, split), (split + 1, hi)]
            continue
        n = len(_encode(lo))
        for i in range(1, n):                                   # align so each byte position is one range
            m = (1 << (6 * i)) - 1
            if lo & ~m != hi & ~m:
                if lo & m:
                    stack += [(lo, lo | m), ((lo | m) + 1, hi)]
                    break
                if hi & m != m:
                    stack += [(lo, (hi & ~m) - 1), (hi & ~m, hi)]
                    break
        else:
            a, b = _encode(lo), _encode(hi)
            out.append([(a[j], b[j]) for j in range(n)])
    return out


# ---------------------------------------------------------------------------------------------- NFA

class NFA:
    """States 0..n-1; edges[s] = [(byte_lo, byte_hi, t)], eps[s] = [t]; one start and one accept state."""

    def __init__(self) -> None:
        self.edges: list[list[tuple[int, int, int]]] = []
        self.eps: list[list[int]] = []

    def state(self) -> int:
        if len(self.edges) >= MAX_NFA_STATES:
            raise RegexTooComplex(f"the pattern expands to more than {MAX_NFA_STATES} NFA states; shrink its "
                                  "repetition counts")
        self.edges.append([])
        self.eps.append([])
        return len(self.edges) - 1

    def build(self, node) -> tuple[int, int]:
        """A fragment (start, end) for `node` (Thompson's construction)."""
        if isinstance(node, Chars):
            s, e = self.state(), self.state()
            for lo, hi in node.ranges:
                for seq in utf8_sequences(lo, hi):
                    cur = s
                    for j, (b0, b1) in enumerate(seq):
                        nxt = e if j == len(seq) - 1 else self.state()
                        self.edges[cur].append((b0, b1, nxt))
                        cur = nxt
            return s, e
        if isinstance(node, Concat):
            s = e = self.state()
            for part in node.parts:
                ps, pe = self.build(part)
                self.eps[e].append(ps)
                e = pe
            return s, e
        if isinstance(node, Alt):
            s, e = self.state(), self.state()
            for option in node.options:
                os_, oe = self.build(option)
                self.eps[s].append(os_)
                self.eps[oe].append(e)
            return s, e
        if isinstance(node, Repeat):
            s = e = self.state()
            for _ in range(node.min):
                ps, pe = self.build(node.node)
                self.eps[e].append(ps)
                e = pe
            if node.max is None:                                 # a loop: e -> body -> e
                ps, pe = self.build(node.node)
                self.eps[e].append(ps)
                self.eps[pe].append(e)
            else:
                end = self.state()
                self.eps[e].append(end)
                for _ in range(node.max - node.min):             # each optional copy may stop early
                    ps, pe = self.build(node.node)
                    self.eps[e].append(ps)
                    self.eps[pe].append(end)
                    e = pe
                e = end
            return s, e
        raise TypeError(f"not a regex node: {node!r}")


# ---------------------------------------------------------------------------------------------- DFA

@dataclass
class DFA:
    """transitions[s, byte] -> next state or DEAD; every state can still reach an accepting one (trimmed)."""
    transitions: np.ndarray         # int32 [num_states, 256]
    accepting: np.ndarray           # bool [num_states]
    start: int = 0

    @property
    def num_states(self) -> int:
        return len(self.accepting)

    def step(self, state: int, data: bytes) -> int:
        """The state after reading `data` from `state` (DEAD once the text can no longer match)."""
        t = self.transitions
        for b in data:
            if state == DEAD:
                return DEAD
            state = int(t[state, b])
        return state

    def matches(self, data: bytes | str) -> bool:
        if isinstance(data, str):
            data = data.encode("utf-8", "surrogatepass")
        s = self.step(self.start, data)
        return s != DEAD and bool(self.accepting[s])

    def is_empty(self) -> bool:
        """True when no text matches (trimming removed every state)."""
        return self.num_states == 0


def _byte_classes(nfa: NFA) -> list[tuple[int, int]]:
    """Cut 0..255 at every edge boundary: bytes of one class behave the same everywhere."""
    cuts = {0, 256}
    for edges in nfa.edges:
        for lo, hi, _ in edges:
            cuts.update((lo, hi + 1))
    cuts = sorted(cuts)
    return [(a, b - 1) for a, b in zip(cuts, cuts[1:])]


def determinize(nfa: NFA, start: int, accept: int, pattern: str = "", max_states: int = MAX_STATES,
                max_work: int = MAX_WORK) -> DFA:
    """Subset construction over byte classes. A DFA state is the set of NFA states with byte edges (plus the
    accept state) in the epsilon-closure: the others only pass through, so leaving them out merges subsets that
    behave the same."""
    classes = _byte_classes(nfa)
    firsts = [lo for lo, _ in classes]
    # each NFA edge as the run of byte classes it covers
    cedges = [[(bisect.bisect_left(firsts, b0), bisect.bisect_right(firsts, b1) - 1, t) for b0, b1, t in es]
              for es in nfa.edges]
    kernel_closure: dict[int, frozenset] = {}

    def closure1(s: int) -> frozenset:
        hit = kernel_closure.get(s)
        if hit is None:
            seen, stack = {s}, [s]
            while stack:
                for t in nfa.eps[stack.pop()]:
                    if t not in seen:
                        seen.add(t)
                        stack.append(t)
            hit = kernel_closure[s] = frozenset(x for x in seen if cedges[x] or x == accept)
        return hit

    closed: dict[frozenset, frozenset] = {}
    unions = [0]          # NFA states gathered by the closures computed: with the transitions below, the work

    def close(states: frozenset) -> frozenset:
        hit = closed.get(states)
        if hit is None:
            parts = [closure1(s) for s in states]
            unions[0] += sum(map(len, parts))
            hit = closed[states] = frozenset().union(*parts)
        return hit

    work = 0
    first = close(frozenset([start]))
    index = {first: 0}
    order = [first]
    rows: list[list[int]] = []
    i = 0
    while i < len(order):
        buckets: dict[int, set] = {}
        for s in order[i]:
            for c0, c1, t in cedges[s]:
                work += c1 - c0 + 1
                for c in range(c0, c1 + 1):
                    buckets.setdefault(c, set()).add(t)
        row = []
        for c in range(len(classes)):
            targets = buckets.get(c)
            if not targets:
                row.append(DEAD)
                continue
            nxt = close(frozenset(targets))
            if nxt not in index:
                if len(order) >= max_states or work + unions[0] > max_work:
                    raise RegexTooComplex(
                        f"regex {pattern!r:.200} needs more than {len(order)} automaton states "
                        f"(or {max_work:,} steps of construction) — typically a repeated class after an unbounded "
                        "one, like "
                        "[ab]*a[ab]{20}, or long bounded repeats; bound or simplify the pattern")
                index[nxt] = len(order)
                order.append(nxt)
            row.append(index[nxt])
        rows.append(row)
        i += 1
    trans = np.full((len(order), 256), DEAD, dtype=np.int32)
    for s, row in enumerate(rows):
        for (lo, hi), t in zip(classes, row):
            trans[s, lo:hi + 1] = t
    accepting = np.array([accept in st for st in order], dtype=bool)
    return DFA(trans, accepting, 0)


def trim(dfa: DFA) -> DFA:
    """Drop states that cannot reach an accepting state (their edges become DEAD): a live state means 'the text
    so far can still be completed'. An empty language gives a DFA with no states."""
    n = dfa.num_states
    live = dfa.accepting.copy()
    ok = dfa.transitions != DEAD
    safe = np.where(ok, dfa.transitions, 0)
    while True:                                       # grow "can reach an accepting state" to a fixed point
        new = live | (ok & live[safe]).any(axis=1)
        if (new == live).all():
            break
        live = new
    if not live[dfa.start]:
        return DFA(np.zeros((0, 256), dtype=np.int32), np.zeros(0, dtype=bool), 0)
    # keep live states reachable from the start, numbered in BFS order
    order, index = [dfa.start], {dfa.start: 0}
    for s in order:
        for t in np.unique(dfa.transitions[s]):
            t = int(t)
            if t != DEAD and live[t] and t not in index:
                index[t] = len(order)
                order.append(t)
    remap = np.full(n + 1, DEAD, dtype=np.int32)          # index n stands for DEAD
    for old, new in index.items():
        remap[old] = new
    old_t = dfa.transitions[order]
    new_t = remap[np.where(old_t == DEAD, n, old_t)]
    return DFA(new_t.astype(np.int32), dfa.accepting[order].copy(), 0)


def _row_ids(sig: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """Number the distinct rows of sig (equal rows, equal numbers). Rows are hashed by a random linear form mod
    2**64 and every row is then compared with its hash group's first row; a collision (never seen in practice)
    falls back to an exact row sort."""
    h = (sig.astype(np.uint64) * weights[:sig.shape[1]]).sum(axis=1, dtype=np.uint64)
    _, first, ids = np.unique(h, return_index=True, return_inverse=True)
    ids = ids.reshape(-1)
    if not (sig == sig[first][ids]).all():
        ids = np.unique(sig, axis=0, return_inverse=True)[1].reshape(-1)
    return ids


def minimize(dfa: DFA) -> DFA:
    """Moore's partition refinement: states equivalent when they agree on accepting and on the block of every
    byte's successor. The result is the unique minimal DFA (numbered in BFS order from the start). Bytes that
    every state treats alike are one column."""
    n = dfa.num_states
    if n == 0:
        return dfa
    cols = np.sort(np.unique(dfa.transitions, axis=1, return_index=True)[1])
    t = dfa.transitions[:, cols]
    weights = np.random.default_rng(0).integers(1, 2 ** 63, size=len(cols) + 1, dtype=np.uint64)
    block = np.unique(dfa.accepting, return_inverse=True)[1].reshape(-1).astype(np.int64)   # 0-based block ids
    num_blocks = int(block.max()) + 1
    while True:
        succ = np.where(t == DEAD, -1, block[np.maximum(t, 0)])
        new = _row_ids(np.concatenate([block[:, None], succ], axis=1), weights)
        k = int(new.max()) + 1
        if k == num_blocks:
            break
        block, num_blocks = new, k
    trans = np.full((num_blocks, 256), DEAD, dtype=np.int32)
    acc = np.zeros(num_blocks, dtype=bool)
    # successors' blocks agree within a block (that is what the last round found)
    trans[block] = np.where(dfa.transitions == DEAD, -1, block[np.maximum(dfa.transitions, 0)])
    acc[block] = dfa.accepting
    return trim(DFA(trans, acc, int(block[dfa.start])))


def compile_regex(pattern: str, max_states: int = MAX_STATES, max_work: int = MAX_WORK) -> DFA:
    """The minimal, trimmed byte-level DFA of `pattern` (full-match semantics). Raises RegexError for patterns
    outside the subset and RegexTooComplex past the state cap or the work cap."""
    nfa = NFA()
    start, accept = nfa.build(parse(pattern))
    return minimize(trim(determinize(nfa, start, accept, pattern, max_states, max_work)))
