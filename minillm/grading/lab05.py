"""Checkers for lab05 — prefix caching.

Tasks (the notebook documents the same signatures):
  lab05_1  hash_block(parent_hash, token_ids) -> int: the chained block hash. parent_hash is None (first block
           of a sequence) or the int a previous call returned; token_ids a tuple of token ids. Deterministic
           across processes, sensitive to the parent and to every token and their order, >= 128 bits.
           Same contract as minillm.kv.prefix_cache.default_hash_fn (BlockManager(hash_fn=...)).
  lab05_2  find_cached_prefix(token_ids, block_size, cache, hash_fn) -> list[int]: the prefix-cache lookup.
           `cache` is a read-only mapping  hash -> CachedBlock(block_id, parent, tokens)  (parent: the block_id
           of the block holding the prefix before it, None at position 0). Returns the physical blocks of the
           longest chain of full blocks that hit AND verify (tokens and parent), at most (len - 1) // block_size
           of them, stopping at the first miss. Same contract as BlockManager._lookup.
  lab05_3  an LRU evictor class with the interface of minillm.kv.prefix_cache.LRUEvictor: add(block) (most
           recent; re-adding refreshes), remove(block), pop_lru() -> block, clear() -> blocks, len(), iter()
           (eviction order, next victim first). Checked on random operation sequences against a model, then
           plugged into a real BlockManager.

The references here (reference_hash, reference_find_cached_prefix, ReferenceLRU) are written independently of
the engine code the checkers also grade in tests/. `PluggedBlockManager` puts the learner's three pieces inside
minillm's BlockManager so that the notebook can run them in the real engine (engine.plug(block_manager=...)).
"""
from __future__ import annotations

import hashlib
import json
import marshal
import os
import pickle
import subprocess
import sys
import types
from collections import OrderedDict, namedtuple
from collections.abc import Mapping
from types import MappingProxyType
from typing import Callable, Optional, Sequence

from hypothesis import example, given, strategies as st

from minillm.grading.core import check, diagnose, fail, reject_reference, run_property
from minillm.kv.block_manager import BlockManager

__all__ = ["check_lab05_1", "check_lab05_2", "check_lab05_3", "CachedBlock", "PluggedBlockManager",
           "cache_view"]

CachedBlock = namedtuple("CachedBlock", ["block_id", "parent", "tokens"])
CachedBlock.__doc__ = """One entry of the prefix cache: physical block `block_id` holds the KV of `tokens` (a tuple
of block_size token ids) computed right after the block `parent` (a block_id; None: at position 0)."""

_MASK128 = (1 << 128) - 1


# --------------------------------------------------------------------------- references

def reference_hash(parent: Optional[int], tokens: Sequence[int]) -> int:
    """128-bit BLAKE2b over a tagged, fixed-width encoding of (parent, tokens)."""
    h = hashlib.blake2b(digest_size=16, person=b"lab05-reference")
    if parent is None:
        h.update(b"N")
    else:
        p = int(parent)
        h.update(b"P" + p.to_bytes((p.bit_length() + 8) // 8, "little", signed=True) + b"|")
    for t in tokens:
        h.update(int(t).to_bytes(8, "little", signed=True))
    return int.from_bytes(h.digest(), "little")


def reference_find_cached_prefix(token_ids, block_size, cache, hash_fn, *, cap=True, verify_tokens=True,
                                 verify_parent=True, stop_at_miss=True, return_hashes=False):
    """Longest verified chain of cached full blocks (the keyword arguments build the classic mistakes)."""
    n = (len(token_ids) - 1) // block_size if cap else len(token_ids) // block_size
    blocks, parent_hash, parent = [], None, None
    for i in range(n):
        tokens = tuple(token_ids[i * block_size:(i + 1) * block_size])
        h = hash_fn(parent_hash, tokens)
        e = cache.get(h)
        ok = (e is not None and (not verify_tokens or tuple(e.tokens) == tokens)
              and (not verify_parent or e.parent == parent))
        if not ok:
            if stop_at_miss:
                break
            parent_hash, parent = h, None
            continue
        blocks.append(h if return_hashes else e.block_id)
        parent_hash, parent = h, e.block_id
    return blocks


class ReferenceLRU:
    """Blocks in eviction order (least recently added first); an OrderedDict does all the work."""

    def __init__(self):
        self._order = OrderedDict()

    def add(self, block):
        self._order.pop(block, None)
        self._order[block] = None

    def remove(self, block):
        del self._order[block]

    def pop_lru(self):
        return self._order.popitem(last=False)[0]

    def clear(self):
        blocks = list(self._order)
        self._order.clear()
        return blocks

    def __len__(self):
        return len(self._order)

    def __iter__(self):
        return iter(self._order)

    def __contains__(self, block):
        return block in self._order


# --------------------------------------------------------------------------- running a function in a fresh process

class _Unshippable(Exception):
    pass


def _code_names(code) -> set:
    names = set(code.co_names)
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            names |= _code_names(c)
    return names


def _ship(fn) -> bytes:
    """Serialize `fn` (a plain function, e.g. defined in a notebook) with what it needs from its module: the
    modules it uses (by name), helper functions of the same module (their code, via marshal: same interpreter),
    and picklable values. Raises _Unshippable for anything else (e.g. a class defined in the notebook)."""
    if not isinstance(fn, types.FunctionType):
        try:
            return pickle.dumps({"pickled_root": pickle.dumps(fn)})
        except Exception as e:  # noqa: BLE001
            raise _Unshippable(repr(e)) from None
    G = fn.__globals__
    funcs, gspecs, todo = {}, {}, [fn]

    def spec(v):
        if isinstance(v, types.ModuleType):
            return ("module", v.__name__)
        if isinstance(v, types.FunctionType) and v.__globals__ is G:
            todo.append(v)
            return ("func", id(v))
        if isinstance(v, type) and v.__module__ == G.get("__name__"):
            raise _Unshippable(f"class {v.__name__}")
        try:
            return ("pickle", pickle.dumps(v))
        except Exception as e:  # noqa: BLE001
            raise _Unshippable(repr(e)) from None

    while todo:
        f = todo.pop()
        if id(f) in funcs:
            continue
        funcs[id(f)] = None
        for name in sorted(_code_names(f.__code__)):
            if name in G and name not in gspecs:
                gspecs[name] = None
                gspecs[name] = spec(G[name])
        funcs[id(f)] = (marshal.dumps(f.__code__), f.__name__,
                        None if f.__defaults__ is None else [spec(d) for d in f.__defaults__],
                        None if not f.__kwdefaults__ else {k: spec(d) for k, d in f.__kwdefaults__.items()},
                        [spec(c.cell_contents) for c in (f.__closure__ or ())])
    return pickle.dumps({"root": id(fn), "funcs": funcs, "globals": gspecs})


_CHILD = r"""
import importlib, json, marshal, pickle, sys, types
d = pickle.load(sys.stdin.buffer)
inputs = json.loads(sys.argv[1])
try:
    if "pickled_root" in d:
        fn = pickle.loads(d["pickled_root"])
    else:
        g = {"__name__": "__learner__", "__builtins__": __builtins__}
        made, cells = {}, {}
        for k, (code, name, _, _, clo) in d["funcs"].items():
            cs = tuple(types.CellType() for _ in clo)
            made[k] = types.FunctionType(marshal.loads(code), g, name, None, cs or None)
            cells[k] = cs
        def val(s):
            if s[0] == "module":
                return importlib.import_module(s[1])
            if s[0] == "func":
                return made[s[1]]
            return pickle.loads(s[1])
        for name, s in d["globals"].items():
            g[name] = val(s)
        for k, (_, _, defaults, kwdefaults, clo) in d["funcs"].items():
            if defaults is not None:
                made[k].__defaults__ = tuple(val(s) for s in defaults)
            if kwdefaults:
                made[k].__kwdefaults__ = {n: val(s) for n, s in kwdefaults.items()}
            for cell, s in zip(cells[k], clo):
                cell.cell_contents = val(s)
        fn = made[d["root"]]
except Exception as e:
    print("UNSHIPPABLE", repr(e))
    sys.exit(0)
out = {}
for key, parent_key, parent, tokens in inputs:
    p = out[parent_key] if parent_key is not None else parent
    try:
        out[key] = fn(None if p is None else int(p), tuple(tokens))
    except Exception as e:
        out[key] = "error: %s: %s" % (type(e).__name__, e)
print("RESULT", json.dumps({k: str(v) for k, v in out.items()}))
"""

# (key, key of the parent's result or None, literal parent, tokens): a chain of three blocks and two singles
_DETERMINISM_INPUTS = [("a", None, None, [1, 2, 3, 4]), ("b", "a", None, [5, 6, 7, 8]), ("c", "b", None, [9, 9, 9, 9]),
                       ("d", None, 12345678901234567890123456789, [42]), ("e", None, None, list(range(16)))]


def _run_here(fn):
    out = {}
    for key, parent_key, parent, tokens in _DETERMINISM_INPUTS:
        p = out[parent_key] if parent_key is not None else parent
        out[key] = fn(None if p is None else int(p), tuple(tokens))
    return {k: str(v) for k, v in out.items()}


def _run_in_fresh_process(payload: bytes, seed: int) -> dict | None:
    env = dict(os.environ, PYTHONHASHSEED=str(seed))
    r = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(_DETERMINISM_INPUTS)], input=payload,
                       capture_output=True, env=env, timeout=120)
    for line in r.stdout.decode(errors="replace").splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
        if line.startswith("UNSHIPPABLE"):
            return None
    return None


def _check_cross_process(hash_block) -> None:
    """The same inputs give the same hashes in two fresh interpreters with different hash seeds."""
    __tracebackhide__ = True
    here = _run_here(hash_block)
    try:
        payload = _ship(hash_block)
    except _Unshippable:
        return  # e.g. uses a class defined in the notebook: can't rebuild it elsewhere; the in-process checks ran
    for seed in (1, 2):
        there = _run_in_fresh_process(payload, seed)
        if there is None:
            return
        for key, parent_key, parent, tokens in _DETERMINISM_INPUTS:
            if there[key] != here[key]:
                what = (f"hash_block({'<hash of the previous block>' if parent_key else parent}, {tuple(tokens)})"
                        if len(tokens) < 8 else f"hash_block(None, {tuple(tokens[:4])[:-1]}, ...)")
                fail(f"hash_block is not deterministic across processes: {what} gave {here[key]} here but "
                     f"{there[key]} in a fresh Python process (PYTHONHASHSEED={seed}) — Python's built-in hash() "
                     "of str/bytes (and of anything containing them) is salted per process, so two workers, or "
                     "a restarted server, would never agree on a prefix's key",
                     "build the hash with hashlib (e.g. hashlib.blake2b or hashlib.sha256) over bytes you encode "
                     "yourself from the parent and the token ids; never call hash().")


# --------------------------------------------------------------------------- lab05_1 hash_block

def _mutate(tokens: tuple, kind: str, i: int, j: int, v: int):
    """A different block of tokens (or None when this mutation can't change `tokens`)."""
    n = len(tokens)
    if kind == "change":
        t = list(tokens)
        t[i % n] = v if v != t[i % n] else v + 1
        return tuple(t)
    if kind == "swap":
        a, b = i % n, j % n
        if tokens[a] == tokens[b]:
            return None
        t = list(tokens)
        t[a], t[b] = t[b], t[a]
        return tuple(t)
    if kind == "reverse":
        return tuple(reversed(tokens)) if tuple(reversed(tokens)) != tokens else None
    if kind == "extend":
        return tokens + (v,)
    if kind == "shorten":
        return tokens[:-1] if n > 1 else None
    raise ValueError(kind)


_MUTATION_WHY = {
    "change": "changing one token id did not change the hash: every token of the block must go into it",
    "swap": "swapping two tokens did not change the hash: the ORDER of the tokens matters (their KV depends "
            "on their positions) — a sum, a set or sorted() of the ids throws the order away",
    "reverse": "reversing the block did not change the hash: the ORDER of the tokens matters — a sum, a set or "
               "sorted() of the ids throws the order away",
    "extend": "a block and the same block plus one more token got the same hash: encode every token "
              "unambiguously (fixed-width bytes, or a separator)",
    "shorten": "a block and the same block minus its last token got the same hash: encode every token "
               "unambiguously (fixed-width bytes, or a separator)",
}


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def check_lab05_1(hash_block):
    """hash_block(parent_hash: int | None, token_ids: tuple[int, ...]) -> int, chained and process-independent."""
    __tracebackhide__ = True
    from minillm.kv.prefix_cache import default_hash_fn  # only to recognise it, never called here
    reject_reference(hash_block, default_hash_fn, reference_hash)

    def h(parent, tokens):
        out = hash_block(parent, tuple(tokens))
        if not _is_int(out):
            assert False, (f"hash_block({parent}, {tuple(tokens)}) returned {out!r} ({type(out).__name__}): return "
                           "a Python int (e.g. int.from_bytes(digest, 'little'))")
        if out < 0:
            assert False, f"hash_block({parent}, {tuple(tokens)}) returned a negative number {out}: return an int >= 0"
        return out

    parents = st.none() | st.integers(1, _MASK128)

    @given(parent=parents, tokens=st.lists(st.integers(0, 200_000), min_size=1, max_size=16),
           kind=st.sampled_from(sorted(_MUTATION_WHY)), i=st.integers(0, 15), j=st.integers(0, 15),
           v=st.integers(0, 200_000), other=parents)
    @example(parent=None, tokens=[1, 2], kind="swap", i=0, j=1, v=0, other=7)                  # order
    @example(parent=None, tokens=[1, 2, 3, 4], kind="reverse", i=0, j=0, v=0, other=2**64)      # order
    @example(parent=5, tokens=[1, 23], kind="change", i=0, j=0, v=12, other=5 + 2**64)          # parent's high bits
    @example(parent=1, tokens=[3, 4], kind="change", i=1, j=0, v=5, other=2**61)                # hash(2**61) == hash(1)
    def prop(parent, tokens, kind, i, j, v, other):
        base = h(parent, tokens)
        again = h(None if parent is None else int(str(parent)), list(tokens))   # equal values, fresh objects
        if again != base:
            assert False, (f"hash_block({parent}, {tuple(tokens)}) gave {base}, then {again} for the same inputs: "
                           "equal inputs must give equal hashes (no randomness, no id(), no time)")
        mutated = _mutate(tuple(tokens), kind, i, j, v)
        if mutated is not None and h(parent, mutated) == base:
            assert False, (f"hash_block({parent}, {tuple(tokens)}) == hash_block({parent}, {mutated}) — "
                           + _MUTATION_WHY[kind])
        if other != parent:
            if h(other, tokens) == base:
                why = ("the parent hash must go into the hash: a block's KV depends on every token before it, "
                       "so the same tokens after a different prefix are a different block")
                if parent is not None and other is not None and (parent ^ other) >> 64 and not (parent ^ other) & (2**64 - 1):
                    why = ("only the low 64 bits of the parent count: the parent is a 128-bit (or wider) int, "
                           "encode all of it")
                elif parent is not None and other is not None and (other - parent) % (2**61 - 1) == 0:
                    why = ("Python's hash() of an int is the int modulo 2**61 - 1, so hash(2**61) == hash(1): "
                           "don't pass the parent through hash(), encode its bytes into a hashlib digest")
                assert False, f"hash_block({parent}, {tuple(tokens)}) == hash_block({other}, {tuple(tokens)}) — {why}"
        child = h(base, tokens)
        if child == base:
            assert False, (f"hash_block(h, {tuple(tokens)}) == h for h = hash_block({parent}, {tuple(tokens)}): the "
                           "same tokens one block later must get a new hash (chain the parent in)")
        # the ambiguity of concatenated decimal digits: (1, 23) vs (12, 3)
        if len(tokens) >= 2 and tokens[0] < 10 and 10 <= tokens[1] < 100:
            split = (tokens[0] * 10 + tokens[1] // 10, tokens[1] % 10) + tuple(tokens[2:])
            if h(parent, split) == base:
                assert False, (f"hash_block({parent}, {tuple(tokens)}) == hash_block({parent}, {split}): joining the "
                               "token ids' digits without a separator makes different blocks the same bytes — "
                               "use a separator or fixed-width bytes per token")

    run_property(prop, max_examples=120,
                 hint="hash a byte encoding of (parent, tokens) with hashlib, e.g. blake2b(digest_size=16) or sha256: "
                      "mark the parent as None or encode all its bytes, give every token a fixed width (or a "
                      "separator), then int.from_bytes(digest, 'little').")

    # width: a 64-bit hash collides after ~2**32 blocks (birthday bound), far too soon for a shared cache
    outs = [hash_block(None, (k, k + 1, k + 2)) for k in range(32)]
    check(max(outs) >= 2**64,
          f"all 32 hashes of hash_block(None, (k, k+1, k+2)), k < 32, are below 2**64 (largest: {max(outs)}): the "
          "hash has 64 bits or fewer — with billions of cached blocks (a fleet, a day) 64-bit keys collide "
          "(birthday bound ~2**32 blocks), and Python's hash() is 64-bit and easy to collide on purpose",
          "use a digest of at least 128 bits: hashlib.blake2b(digest_size=16) or hashlib.sha256, "
          "then int.from_bytes(digest, 'little').")
    _check_cross_process(hash_block)


# --------------------------------------------------------------------------- lab05_2 find_cached_prefix

def _parentless(parent, tokens):
    return reference_hash(None, tokens)


def _sum3(parent, tokens):
    return sum(tokens) % 3


def _constant(parent, tokens):
    return 12345


_HASHES = {"strong": reference_hash, "ignores the parent": _parentless, "sum(tokens) % 3": _sum3,
           "constant": _constant}


def build_cache(prompts, block_size, hash_fn, evict=()):
    """Register the full blocks of `prompts` the way the BlockManager's commit_computed does (an existing,
    verified entry is reused; on a hash collision the first entry stays and the new block is not cached), then
    drop the entries whose index is in `evict` (evicted blocks). Returns {hash: CachedBlock}."""
    cache, next_id = {}, 0
    for p in prompts:
        parent_hash, parent = None, None
        for i in range(len(p) // block_size):
            tokens = tuple(p[i * block_size:(i + 1) * block_size])
            h = hash_fn(parent_hash, tokens)
            e = cache.get(h)
            if e is not None and e.tokens == tokens and e.parent == parent:
                b = e.block_id
            else:
                b, next_id = 100 + next_id, next_id + 1
                if e is None:
                    cache[h] = CachedBlock(b, parent, tokens)
            parent_hash, parent = h, b
    for k in sorted({int(k) % max(1, len(cache)) for k in evict}, reverse=True):
        if cache:
            del cache[list(cache)[k]]
    return cache


@st.composite
def _prefix_scenarios(draw):
    bs = draw(st.integers(1, 4))
    alphabet = st.integers(0, 3)
    prompts = [draw(st.lists(alphabet, min_size=1, max_size=14))]
    for _ in range(draw(st.integers(0, 3))):
        base = draw(st.sampled_from(prompts))
        cut = draw(st.integers(0, len(base)))
        prompts.append(base[:cut] + draw(st.lists(alphabet, min_size=0 if cut else 1, max_size=10)))
    hash_name = draw(st.sampled_from(sorted(_HASHES)))
    evict = draw(st.lists(st.integers(0, 50), max_size=2)) if draw(st.booleans()) else []
    base = draw(st.sampled_from(prompts))
    how = draw(st.sampled_from(["same", "aligned", "cut", "extend", "mutate", "rotate"]))
    if how == "same":
        query = list(base)
    elif how == "aligned":                       # exactly k full blocks: at most k - 1 may come from the cache
        query = base[:max(1, len(base) // bs) * bs] if len(base) >= bs else list(base)
    elif how == "cut":
        query = base[:draw(st.integers(1, len(base)))]
    elif how == "extend":
        query = base + draw(st.lists(alphabet, min_size=1, max_size=8))
    elif how == "mutate":
        query = list(base)
        query[draw(st.integers(0, len(base) - 1))] = draw(alphabet)
    else:                                         # the same blocks in another order (parents differ)
        k = draw(st.integers(0, max(0, len(base) // bs - 1)))
        query = base[k * bs:] + base[:k * bs]
    return bs, prompts, hash_name, evict, query


_PREFIX_MISTAKES = [
    ("nothing ever hits: compute the keys with the hash_fn argument (the cache was built with it), and compare "
     "tokens as tuples (CachedBlock.tokens is a tuple; a list slice never equals a tuple)", None),
    ("at most (len(token_ids) - 1) // block_size blocks may come from the cache: at least one token must be "
     "left to compute (its logits give the next token), and a block-aligned prompt would otherwise end on a "
     "shared cached block", dict(cap=False)),
    ("a hash hit is only a candidate: compare the cached block's tokens with the prompt's block (hashes collide)",
     dict(verify_tokens=False)),
    ("compare the cached block's parent with the block you matched just before (None for the first block): the "
     "same tokens after a different prefix have different KV, and the hash may not tell them apart",
     dict(verify_parent=False)),
    ("stop at the first miss: the blocks after it would attend to KV you don't have", dict(stop_at_miss=False)),
    ("stop at the first miss: the blocks after it would attend to KV you don't have",
     dict(stop_at_miss=False, verify_parent=False)),
    ("return the physical block ids (CachedBlock.block_id), not the hashes", dict(return_hashes=True)),
]
_PREFIX_PROBES = [
    (1, [[0, 1, 2, 3], [1, 2, 0, 3, 3]], "ignores the parent", [1], [1, 2, 0, 3]),
    (2, [[0, 1, 2, 3, 0, 0]], "strong", [], [0, 1, 2, 3]),
    (2, [[0, 1, 2, 3, 0, 0], [2, 2, 1, 1, 3]], "sum(tokens) % 3", [0], [0, 1, 2, 3, 0, 0, 1]),
    (1, [[3, 2, 1, 0], [2, 1]], "strong", [2], [3, 2, 1, 0, 0]),
    (2, [[1, 1, 0, 2, 3, 3]], "constant", [], [1, 1, 3, 3, 0]),
]


def _probe_args(bs, prompts, hash_name, evict, query):
    fn = _HASHES[hash_name]
    return (list(query), bs, MappingProxyType(build_cache(prompts, bs, fn, evict)), fn)


def _diagnose_prefix(find, args):
    variants = []
    for why, kw in _PREFIX_MISTAKES:
        if kw is None:   # the learner's own hash instead of hash_fn: nothing can ever hit
            variants.append((why, lambda t, b, c, f: []))
        else:
            variants.append((why, (lambda kw: lambda t, b, c, f: reference_find_cached_prefix(t, b, c, f, **kw))(kw)))
    probes = [args] + [_probe_args(*p) for p in _PREFIX_PROBES]
    return diagnose(find, variants, probes, lambda a, b: _as_list(a) == list(b))


def _as_list(x):
    try:
        return list(x)
    except TypeError:
        return None


def check_lab05_2(find_cached_prefix):
    """find_cached_prefix(token_ids, block_size, cache, hash_fn) -> block ids of the longest verified cached prefix."""
    __tracebackhide__ = True
    reject_reference(find_cached_prefix, reference_find_cached_prefix, BlockManager._lookup)

    @given(scenario=_prefix_scenarios())
    @example(scenario=(2, [[0, 1, 2, 3, 0, 0]], "strong", [], [0, 1, 2, 3, 0, 0, 1]))          # plain reuse
    @example(scenario=(2, [[0, 1, 2, 3, 0, 0]], "strong", [], [0, 1, 2, 3]))                   # block-aligned: cap
    @example(scenario=(1, [[0, 1, 2, 3], [1, 2, 0, 3, 3]], "ignores the parent", [], [1, 2, 0, 3]))  # parent check
    @example(scenario=(2, [[1, 1, 0, 2, 3, 3]], "constant", [], [1, 1, 3, 3, 0]))              # forced collision
    @example(scenario=(1, [[3, 2, 1, 0]], "strong", [1], [3, 2, 1, 0, 0]))                     # a gap: stop there
    def prop(scenario):
        bs, prompts, hash_name, evict, query = scenario
        args = _probe_args(bs, prompts, hash_name, evict, query)
        cache = args[2]
        want = reference_find_cached_prefix(*args)
        got = find_cached_prefix(list(query), bs, cache, args[3])
        shown = {h if h < 2**32 else f"{h:#x}"[:10] + "…": tuple(e) for h, e in cache.items()}
        setting = (f"block_size={bs}, hash_fn={hash_name}, token_ids={query}, cache (hash -> (block_id, parent, "
                   f"tokens)) = {shown}")
        lst = _as_list(got)
        if lst is None or not all(_is_int(b) for b in lst):
            assert False, f"find_cached_prefix must return a list of block ids (ints), got {got!r} for {setting}"
        if lst == want:
            return
        why = _diagnose_prefix(find_cached_prefix, args)
        assert False, f"find_cached_prefix returned {lst}, expected {want} for {setting}" + (f" — {why}" if why else "")

    run_property(prop, max_examples=150,
                 hint="walk the full blocks i = 0, 1, ... < (len(token_ids) - 1) // block_size: h = hash_fn(parent "
                      "hash, tuple(block tokens)); e = cache.get(h); stop unless e exists, e.tokens equals the "
                      "block's tokens and e.parent equals the previous matched block_id (None first); else keep "
                      "e.block_id and chain h.")


# --------------------------------------------------------------------------- lab05_3 the LRU evictor

_OPS = st.lists(st.tuples(st.sampled_from(["add", "add", "add", "remove", "pop", "readd", "clear"]),
                          st.integers(0, 7)), max_size=40)


def _run_ops(cls, ops):
    """Apply `ops` to a fresh cls() and to ReferenceLRU; raise AssertionError at the first disagreement."""
    ev, ref = cls(), ReferenceLRU()
    log = []

    def state():
        return f"after {', '.join(log)}" if log else "on a fresh evictor"

    for op, b in ops:
        if op in ("remove", "readd", "pop") and not len(ref):
            continue
        if op == "readd":
            op, b = "add", list(ref)[b % len(ref)]
        if op == "add":
            ev.add(b)
            ref.add(b)
            log.append(f"add({b})")
        elif op == "remove":
            b = list(ref)[b % len(ref)]
            ev.remove(b)
            ref.remove(b)
            log.append(f"remove({b})")
        elif op == "pop":
            got, want = ev.pop_lru(), ref.pop_lru()
            if got != want:
                why = _evictor_why(cls)
                assert False, f"pop_lru() returned {got!r}, expected {want} (the least recently added) {state()}{why}"
            log.append(f"pop_lru() -> {got}")
        elif op == "clear":
            want = list(ref)
            got = ev.clear()
            ref.clear()
            got_list = _as_list(got) if got is not None else None
            if got_list is None or sorted(got_list) != sorted(want):
                assert False, (f"clear() returned {got!r}, expected the evictable blocks {want} {state()}: "
                               "BlockManager.reset_prefix_cache() turns them back into free blocks")
            log.append("clear()")
        n = len(ev)
        if n != len(ref):
            assert False, f"len() is {n}, expected {len(ref)} {state()}"
        order = _as_list(iter(ev))
        if order != list(ref):
            why = _evictor_why(cls)
            if not why and order == list(reversed(list(ref))) and len(ref) > 1:
                why = " — iterate in eviction order: the next victim (least recently added) first"
            assert False, (f"iterating gives {order}, expected {list(ref)} (eviction order: next victim first) "
                           f"{state()}{why}")


def _evictor_why(cls) -> str:
    """Name the classic mistake from three fixed probes (empty string when none applies)."""
    def pops(*steps):
        try:
            ev = cls()
            for op, b in steps:
                getattr(ev, op)(b)
            return ev.pop_lru()
        except Exception:  # noqa: BLE001
            return None
    if pops(("add", 1), ("add", 2), ("add", 3)) == 3:
        return " — that evicts the MOST recently added block (MRU, a stack): evict the least recently added first"
    if pops(("add", 1), ("add", 2), ("add", 1)) == 1 or pops(("add", 1), ("add", 2), ("remove", 1), ("add", 1)) == 1:
        return (" — adding a block that was there before (still, or again after remove/pop_lru) makes it the MOST "
                "recent: the order is by LAST add, not first")
    return ""


def _block_manager_scenario(cls) -> None:
    """The evictor inside a real BlockManager (as `bm._evictor`): LRU by time of last free, tail blocks first."""
    bm = BlockManager(8, 2)
    bm._evictor = cls()

    def run(sid, prompt):
        cached = bm.allocate_prompt(sid, prompt)
        bm.append_slots(sid, len(prompt))
        bm.commit_computed(sid, prompt, len(prompt))
        return cached

    A, B = [1, 1, 2, 2, 9], [3, 3, 4, 4, 9]
    run(1, A), run(2, B)
    bm.free(1)
    bm.free(2)                       # evictable, oldest first: A's 2 blocks, then B's 2
    run(3, A)                        # a hit revives A's blocks ...
    bm.free(3)                       # ... and freeing them again makes them the most recent
    bm.check_invariants()
    run(4, [50 + i for i in range(12)])    # 6 blocks: the 4 plain free ones + 2 evictions
    ev = bm.stats.evictions
    check(ev == 2, f"inside a BlockManager: a 12-token prompt needing 6 of 8 blocks caused {ev} evictions, expected 2",
          "pop_lru() must remove the block it returns, and len() must count the evictable blocks.")
    bm.free(4)
    ca, cb = bm.allocate_prompt(5, A), bm.allocate_prompt(6, B)
    check((ca, cb) == (4, 0),
          f"inside a BlockManager: after 2 evictions, prompt A (freed most recently) got {ca} cached tokens and "
          f"prompt B (freed long ago) {cb}; expected A 4 and B 0 — the evictor must evict the least recently freed "
          "blocks first, and a block freed again after a prefix hit counts as recent",
          "add() puts a block at the most-recent end; pop_lru() takes from the least-recent end.")
    bm.free(5), bm.free(6)
    bm.check_invariants()
    bm.reset_prefix_cache()
    bm.check_invariants()
    check(bm.num_free_blocks == bm.num_blocks and len(bm._evictor) == 0,
          "inside a BlockManager: after reset_prefix_cache() every block must be free and the evictor empty",
          "clear() must empty the evictor and return the blocks it held.")


def check_lab05_3(evictor_cls):
    """An LRU evictor class: add, remove, pop_lru, clear, len, iter (eviction order)."""
    __tracebackhide__ = True
    from minillm.kv.prefix_cache import LRUEvictor
    reject_reference(evictor_cls, LRUEvictor, ReferenceLRU)
    if isinstance(evictor_cls, type) and issubclass(evictor_cls, (LRUEvictor, ReferenceLRU)):
        fail("your class subclasses minillm's LRUEvictor: write the evictor yourself (a plain class).")
    check(callable(evictor_cls), f"pass the class itself (e.g. check_lab05_3(MyLRU)), got {evictor_cls!r}")
    missing = [m for m in ("add", "remove", "pop_lru", "clear", "__len__", "__iter__")
               if not callable(getattr(evictor_cls, m, None))]
    check(not missing, f"the evictor class lacks {', '.join(missing)}",
          "BlockManager calls add(block), remove(block), pop_lru(), clear(), len(evictor) and iterates over it.")

    @given(ops=_OPS)
    @example(ops=[("add", 1), ("add", 2), ("add", 3), ("pop", 0)])                              # LRU, not MRU
    @example(ops=[("add", 1), ("add", 2), ("add", 1), ("pop", 0)])                              # re-add refreshes
    @example(ops=[("add", 1), ("add", 2), ("remove", 0), ("add", 1), ("pop", 0)])               # remove, add again
    @example(ops=[("add", 4), ("add", 5), ("clear", 0), ("add", 6), ("pop", 0)])
    def prop(ops):
        _run_ops(evictor_cls, ops)

    run_property(prop, max_examples=150,
                 hint="keep the blocks in an OrderedDict (or a plain dict, which keeps insertion order): add = "
                      "pop the block if present, then insert it at the end; pop_lru = take the first; iterate in "
                      "that order.")
    try:
        _block_manager_scenario(evictor_cls)
    except AssertionError:
        raise
    except Exception as e:  # noqa: BLE001
        fail(f"inside a BlockManager the evictor raised {type(e).__name__}: {e}",
             "BlockManager calls add(block), remove(block), pop_lru(), clear(), len(evictor) and iterates over it.")


# --------------------------------------------------------------------------- the learner's pieces in the engine

_STALE = object()


class _CacheView(Mapping):
    """A BlockManager's prefix cache seen through lab05's API: hash -> CachedBlock(block_id, parent, tokens).
    The BlockManager stores the parent as (block id, generation); a parent whose block has since been reused for
    other content (generation bumped) is shown as an object that equals no block id."""

    def __init__(self, bm: BlockManager) -> None:
        self._bm = bm

    def __getitem__(self, h):
        bm = self._bm
        b = bm._hash_to_block[h]
        parent_ref, tokens = bm._block_key[b]
        if parent_ref is None:
            parent = None
        else:
            pb, gen = parent_ref
            parent = pb if bm._gen[pb] == gen else _STALE
        return CachedBlock(b, parent, tokens)

    def __iter__(self):
        return iter(list(self._bm._hash_to_block))

    def __len__(self):
        return len(self._bm._hash_to_block)


def cache_view(bm: BlockManager) -> Mapping:
    """Read-only view of `bm`'s prefix cache: {hash: CachedBlock(block_id, parent, tokens)}."""
    return _CacheView(bm)


class PluggedBlockManager(BlockManager):
    """minillm's BlockManager with (any of) the learner's pieces: the block hash (hash_fn), the lookup
    (find_cached_prefix(token_ids, block_size, cache, hash_fn) -> block ids) and the evictor class.
    Give it the engine's pool size and pass it to engine.plug(block_manager=...)."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True, *,
                 hash_fn: Optional[Callable] = None, find_cached_prefix: Optional[Callable] = None,
                 evictor_cls: Optional[type] = None) -> None:
        super().__init__(num_blocks, block_size, enable_prefix_caching, hash_fn=hash_fn)
        self.find_cached_prefix = find_cached_prefix
        if evictor_cls is not None:
            self._evictor = evictor_cls()

    def _lookup(self, token_ids, count_stats):
        if self.find_cached_prefix is None or not self.enable_prefix_caching:
            return super()._lookup(token_ids, count_stats)
        bs = self.block_size
        max_blocks = (len(token_ids) - 1) // bs
        blocks = [int(b) for b in self.find_cached_prefix(list(token_ids), bs, _CacheView(self), self.hash_fn)]
        hashes, parent_hash = [], None
        for i in range(len(blocks) + (1 if len(blocks) < max_blocks else 0)):
            parent_hash = self._hash(parent_hash, tuple(token_ids[i * bs:(i + 1) * bs]))
            hashes.append(parent_hash)
        if count_stats:
            if len(blocks) < max_blocks and hashes[-1] in self._hash_to_block:
                self.stats.collisions += 1          # the hash hit, the learner's verification said no
            self.stats.hits += len(blocks)
            self.stats.misses += max_blocks - len(blocks)
        return blocks, hashes[:len(blocks)]


__all__ += ["reference_hash", "reference_find_cached_prefix", "ReferenceLRU", "build_cache"]
