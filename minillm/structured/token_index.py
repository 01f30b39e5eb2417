"""DFA x vocabulary -> token index: for every automaton state, the tokens whose bytes keep the text matchable and
the state each leads to; EOS only where the text so far is a full match. Special tokens are never allowed.

The vocabulary is a byte trie stored breadth first (node i's parent and byte; each node's children contiguous), so
one state's walk is one vectorized gather per byte depth over the live nodes only: tokens sharing a prefix share
its walk, and a dead prefix skips its whole subtree."""
from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field
from weakref import WeakKeyDictionary

import numpy as np

from minillm.structured.automata import DEAD, DFA, compile_regex


@dataclass(eq=False)          # hashed by identity: the index cache keys on the trie object itself
class VocabTrie:
    """Nodes 1..n in breadth-first order (0 is the root): levels[d] = (first, end) is the node slice at depth d + 1,
    and each node's children are the contiguous slice child_lo[i]:child_hi[i]."""
    parent: np.ndarray              # int32 [n + 1]
    byte: np.ndarray                # uint8 [n + 1]
    levels: list[tuple[int, int]]
    token_node: np.ndarray          # int32 [V]: the node spelling each token; 0 for tokens never allowed
    vocab_size: int
    token_bytes: list               # [V] each token's bytes (None: never allowed), what the trie was built from
    child_lo: np.ndarray            # int64 [n + 1]
    child_hi: np.ndarray

    @classmethod
    def build(cls, token_bytes: list[bytes | None]) -> "VocabTrie":
        children: list[dict[int, int]] = [{}]
        depth = [0]
        token_node = np.zeros(len(token_bytes), dtype=np.int64)
        for tid, data in enumerate(token_bytes):
            if not data:                          # special, unused or empty: never allowed
                continue
            node = 0
            for b in data:
                nxt = children[node].get(b)
                if nxt is None:
                    nxt = len(children)
                    children[node][b] = nxt
                    children.append({})
                    depth.append(depth[node] + 1)
                node = nxt
            token_node[tid] = node
        # renumber breadth-first: each level is a contiguous slice, and so are each node's children
        order = [0]
        for node in order:
            order.extend(kid for _, kid in sorted(children[node].items()))
        new_id = np.empty(len(order), dtype=np.int64)
        new_id[np.asarray(order)] = np.arange(len(order))
        parent = np.zeros(len(order), dtype=np.int32)
        byte = np.zeros(len(order), dtype=np.uint8)
        child_lo = np.zeros(len(order), dtype=np.int64)
        child_hi = np.zeros(len(order), dtype=np.int64)
        for old, kids in enumerate(children):
            ids = [new_id[kid] for kid in kids.values()]
            if ids:
                child_lo[new_id[old]], child_hi[new_id[old]] = min(ids), max(ids) + 1
            for b, kid in kids.items():
                parent[new_id[kid]], byte[new_id[kid]] = new_id[old], b
        depths = np.asarray(depth)[np.asarray(order)]
        levels = [(int(np.searchsorted(depths, d)), int(np.searchsorted(depths, d, side="right")))
                  for d in range(1, int(depths.max()) + 1)] if len(depths) > 1 else []
        return cls(parent, byte, levels, new_id[token_node].astype(np.int32), len(token_bytes), list(token_bytes),
                   child_lo, child_hi)

    def walk(self, padded: np.ndarray, state: int) -> np.ndarray:
        """The DFA state after each trie node's bytes, starting in `state` (DEAD where the text died), descending
        only below nodes still alive: a state that allows few tokens touches few nodes. `padded` is the DFA's
        transitions plus a last all-DEAD row, so that row -1 (DEAD) stays DEAD."""
        at = np.full(len(self.parent), DEAD, dtype=np.int32)
        at[0] = state
        nodes = np.array([0], dtype=np.int64)
        states = np.array([state], dtype=np.int32)
        while len(nodes):
            lo, hi = self.child_lo[nodes], self.child_hi[nodes]
            counts = hi - lo
            total = int(counts.sum())
            if total == 0:
                break
            # the children of every live node, each with its parent's state
            starts = np.repeat(lo - np.cumsum(counts) + counts, counts)
            kids = starts + np.arange(total)
            kid_states = padded[np.repeat(states, counts), self.byte[kids]]
            alive = kid_states != DEAD
            nodes, states = kids[alive], kid_states[alive]
            at[nodes] = states
        return at


MASK_CACHE_SIZE = 512          # per index: 512 x 49,152 bools = 25 MB for SmolLM2


@dataclass
class TokenIndex:
    """allowed[s]: sorted token ids allowed in state s; next_states[s]: the state each leads to (same order)."""
    dfa: DFA
    allowed: list[np.ndarray]
    next_states: list[np.ndarray]
    eos_token_ids: tuple[int, ...]
    vocab_size: int
    build_seconds: float = 0.0
    _masks: OrderedDict = field(default_factory=OrderedDict, repr=False)

    def is_accepting(self, state: int) -> bool:
        return bool(self.dfa.accepting[state])

    def next_state(self, state: int, token_id: int) -> int:
        """The state after `token_id` (DEAD when it is not allowed; EOS is never a transition)."""
        ids = self.allowed[state]
        i = int(np.searchsorted(ids, token_id))
        return int(self.next_states[state][i]) if i < len(ids) and ids[i] == token_id else DEAD

    def allowed_token_ids(self, state: int) -> np.ndarray:
        """Allowed tokens in `state`, EOS included exactly when the text so far is a full match."""
        ids = self.allowed[state]
        if self.is_accepting(state) and self.eos_token_ids:
            ids = np.union1d(ids, np.asarray(self.eos_token_ids, dtype=ids.dtype))
        return ids

    def is_terminated(self, state: int) -> bool:
        """The text is a full match and no token can extend it: only EOS is left."""
        return self.is_accepting(state) and len(self.allowed[state]) == 0

    def mask(self, state: int, size: int | None = None, device=None):
        """A bool tensor [size or vocab_size], True where allowed (cached per state; ids past vocab_size, e.g. a
        padded embedding's, are never allowed). The MASK_CACHE_SIZE most recently used masks are kept (one is a
        vocabulary's worth of bytes). `device` (a GPU): the mask kept there, copied once from the host's."""
        import torch
        key = (state, size) if device is None else (state, size, str(device))
        m = self._masks.get(key)
        if m is None:
            if device is not None:
                m = self.mask(state, size).to(device)
            else:
                m = torch.zeros(max(size or 0, self.vocab_size), dtype=torch.bool)[:size or self.vocab_size]
                m[torch.from_numpy(self.allowed_token_ids(state).astype(np.int64))] = True
            self._masks[key] = m
            if len(self._masks) > MASK_CACHE_SIZE:
                self._masks.popitem(last=False)
        else:
            self._masks.move_to_end(key)
        return m


def build_token_index(dfa: DFA, trie: VocabTrie, eos_token_ids=()) -> TokenIndex:
    t0 = time.perf_counter()
    allowed, nexts = [], []
    tokens = np.arange(trie.vocab_size, dtype=np.int32)
    live = trie.token_node > 0
    padded = np.vstack([dfa.transitions, np.full((1, 256), DEAD, dtype=np.int32)])
    for s in range(dfa.num_states):
        after = trie.walk(padded, s)[trie.token_node]
        ok = live & (after != DEAD)
        allowed.append(tokens[ok])
        nexts.append(after[ok])
    return TokenIndex(dfa, allowed, nexts, tuple(eos_token_ids), trie.vocab_size, time.perf_counter() - t0)


def prune_unspellable(index: TokenIndex, pattern: str = "") -> TokenIndex:
    """Drop transitions into states from which no token sequence reaches a full match (a byte automaton can need
    bytes no token spells). Every state left then offers a token or EOS, so a masked row is never all -inf.
    Raises ValueError when the vocabulary cannot spell any match at all."""
    n = index.dfa.num_states
    good = index.dfa.accepting.copy()
    while True:                       # grow "some token path reaches an accepting state" to a fixed point
        new = good | np.array([bool(good[nx].any()) for nx in index.next_states], dtype=bool)
        if (new == good).all():
            break
        good = new
    if n == 0 or not good[index.dfa.start]:
        raise ValueError(f"no text that this tokenizer can spell matches {pattern!r}: check the pattern (or "
                         "schema) for an empty language")
    if good.all():
        return index
    keep = [good[nx] for nx in index.next_states]
    return TokenIndex(index.dfa, [ids[k] for ids, k in zip(index.allowed, keep)],
                      [nx[k] for nx, k in zip(index.next_states, keep)], index.eos_token_ids, index.vocab_size,
                      index.build_seconds)


# ---------------------------------------------------------------------------------------------- caches

_TRIES: "WeakKeyDictionary" = WeakKeyDictionary()
_INDEXES: "OrderedDict[tuple, TokenIndex]" = OrderedDict()
INDEX_CACHE_SIZE = 32


def vocab_trie(tokenizer) -> VocabTrie:
    """The tokenizer's byte trie, built once per tokenizer object."""
    trie = _TRIES.get(tokenizer)
    if trie is None:
        trie = _TRIES[tokenizer] = VocabTrie.build(tokenizer.token_bytes())
    return trie


def regex_token_index(pattern: str, tokenizer, compile_fn=compile_regex, index_fn=None) -> TokenIndex:
    """The token index of `pattern` for `tokenizer`, built with compile_fn (regex -> DFA) and index_fn (DFA x
    vocabulary -> TokenIndex; default build_token_index), from an LRU cache keyed by all four. Plugged pieces (a
    learner's) are checked for their types; states no token path can complete are pruned either way."""
    index_fn = index_fn or build_token_index
    key = (pattern, vocab_trie(tokenizer), compile_fn, index_fn)
    hit = _INDEXES.get(key)
    if hit is not None:
        _INDEXES.move_to_end(key)
        return hit
    dfa = compile_fn(pattern)
    if type(dfa) is not DFA:
        raise TypeError(f"the regex compiler must return a minillm.structured.automata.DFA, got {type(dfa).__name__}")
    index = index_fn(dfa, key[1], tuple(sorted(tokenizer.stop_token_ids)))
    if type(index) is not TokenIndex or len(index.allowed) != dfa.num_states:
        raise TypeError(f"the token index builder must return a TokenIndex with one allowed-token array per DFA "
                        f"state ({dfa.num_states}), got {type(index).__name__}")
    index = _INDEXES[key] = prune_unspellable(index, pattern)
    while len(_INDEXES) > INDEX_CACHE_SIZE:
        _INDEXES.popitem(last=False)
    return index
