"""Checkers for lab05 — prefix caching.

Tasks (the notebook documents the same signatures; minillm's own versions, the engine's seams, in brackets):
  lab05_1  hash_block(parent_hash, token_ids) -> int: the chained block hash. Deterministic across processes,
           sensitive to the parent, to every token and to their order, >= 128 bits.
                                                              [kv.prefix_cache.default_hash_fn; the HashFn seam]
  lab05_2  find_cached_prefix(token_ids, block_size, cache, hash_fn) -> list[int]: the prefix-cache lookup over a
           read-only mapping hash -> CachedBlock(block_id, parent, tokens).
                                                        [kv.prefix_cache.find_cached_prefix; the PrefixLookup seam]
  lab05_3  an LRU evictor class: add, remove, pop_lru, clear, len, iter (next victim first).
                                                                   [kv.prefix_cache.LRUEvictor; the Evictor seam]
All three plug into minillm's BlockManager: BlockManager(..., hash_fn=, prefix_lookup=, evictor_cls=), or
engine.plug(hash_fn=..., prefix_lookup=..., evictor_cls=...).

Oracles: properties of a good hash (equal in, equal out, in a fresh process too; any change of parent, token,
order or width changes the key), checked without a reference hash; for the lookup, every prefix length tried from
the longest down, each chain verified whole (reference_find_cached_prefix); for the evictor, a model that stamps
every block with the time of its last add (_LRUModel).
"""
from __future__ import annotations

import hashlib
import inspect
import json
import subprocess
import sys
from types import MappingProxyType
from typing import Any, Callable, Mapping, Optional, Sequence

from hypothesis import example, given, strategies as st

from minillm import config
from minillm.grading.core import GradingError, Hint, Task, as_int, as_ints, check, diagnose, fail, minillm_objects, \
    run_property
from minillm.interfaces import CachedBlock
from minillm.kv.block_manager import BlockManager
from minillm.kv.prefix_cache import HASH_MASK

__all__ = ["check_lab05_1", "check_lab05_2", "check_lab05_3", "TASKS", "CachedBlock", "build_cache",
           "reference_hash", "reference_find_cached_prefix"]


# --------------------------------------------------------------------------- lab05_1 hash_block

def reference_hash(parent: Optional[int], tokens: Sequence[int]) -> int:
    """The grader's own good hash (to build caches for lab05_2): 128-bit BLAKE2b of a tagged encoding."""
    h = hashlib.blake2b(digest_size=16, person=b"lab05-reference")
    if parent is None:
        h.update(b"N")
    else:
        p = int(parent)
        h.update(b"P" + p.to_bytes((p.bit_length() + 8) // 8, "little", signed=True) + b"|")
    for t in tokens:
        h.update(int(t).to_bytes(8, "little", signed=True))
    return int.from_bytes(h.digest(), "little")


def _mutate(tokens: tuple, kind: str, i: int, j: int, v: int):
    """A different block of tokens (or None when this mutation can't change `tokens`)."""
    n, t = len(tokens), list(tokens)
    if kind == "change":
        t[i % n] = v if v != t[i % n] else v + 1
    elif kind.startswith("alias"):                      # the same id modulo a power of two
        t[i % n] += 2 ** int(kind[5:])
    elif kind == "swap":
        a, b = i % n, j % n
        if tokens[a] == tokens[b]:
            return None
        t[a], t[b] = t[b], t[a]
    elif kind == "reverse":
        t.reverse()
    elif kind == "extend":
        t.append(v)
    elif kind == "shorten":
        t.pop()
    return tuple(t) if t and tuple(t) != tokens else None


_ALIAS = ("a token id and the same id plus 2**{k} got the same hash: your encoding keeps only the low {k} bits of "
          "each id (a {k}-bit array, a mask or a cast) — vocabularies have more ids than that (Llama 3: 128k)")
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
    **{f"alias{k}": _ALIAS.format(k=k) for k in (8, 16)},   # ids stay below 2**32
}


def _hasher(hash_block: Callable[..., Any]) -> Callable[[int | None, Sequence[int]], int]:
    def h(parent: int | None, tokens: Sequence[int]) -> int:
        out = as_int(hash_block(parent, tuple(tokens)), f"hash_block({parent}, {tuple(tokens)})")
        check(out >= 0, f"hash_block({parent}, {tuple(tokens)}) returned a negative number {out}: return an int >= 0")
        return out
    return h


# (key, key of the parent's result or None, literal parent, tokens): a chain of three blocks and two singles
_PROCESS_INPUTS = [("a", None, None, [1, 2, 3, 4]), ("b", "a", None, [5, 6, 7, 8]), ("c", "b", None, [9, 9, 9, 9]),
                   ("d", None, 12345678901234567890123456789, [42]), ("e", None, None, list(range(16)))]

_CHILD = r"""
import json, sys, cloudpickle
inputs = json.loads(sys.argv[1])
fn = cloudpickle.loads(sys.stdin.buffer.read())
if isinstance(fn, tuple) and len(fn) == 3 and fn[0] == "minillm-answer/1":   # as handed in from a notebook
    fn = fn[1]
out = {}
for key, parent_key, parent, tokens in inputs:
    p = out.get(parent_key) if parent_key is not None else parent
    try:
        out[key] = str(fn(None if p is None else int(p), tuple(tokens)))
    except Exception as e:
        out[key] = "error: %s: %s" % (type(e).__name__, e)
print("RESULT", json.dumps(out))
"""


def _run_here(fn: Callable[..., Any]) -> dict:
    out = {}
    for key, parent_key, parent, tokens in _PROCESS_INPUTS:
        p = out.get(parent_key) if parent_key is not None else parent
        out[key] = str(fn(None if p is None else int(p), tuple(tokens)))
    return out


def _ship(fn: Callable[..., Any]) -> bytes:
    """fn by value (its module's helpers and globals too), for a fresh interpreter; a decorated fn as what it wraps."""
    import cloudpickle
    if isinstance(getattr(fn, "payload", None), bytes):      # trusted grading's stand-in: the answer's own bytes
        return fn.payload
    fn = inspect.unwrap(fn)       # functools.lru_cache / wraps: a cache changes no hash
    module = sys.modules.get(getattr(fn, "__module__", None) or "")
    by_value = module is not None and module.__name__ not in ("__main__", "builtins") and \
        not module.__name__.startswith(("minillm", "hashlib"))
    if by_value:
        cloudpickle.register_pickle_by_value(module)
    try:
        return cloudpickle.dumps(fn)
    finally:
        if by_value:
            cloudpickle.unregister_pickle_by_value(module)


def _check_cross_process(hash_block: Callable[..., Any]) -> None:
    """The same inputs give the same hashes in two fresh interpreters with different hash seeds."""
    __tracebackhide__ = True
    here = _run_here(hash_block)
    how = ("keep hash_block self-contained: a plain function of its arguments that uses modules (hashlib), "
           "constants and helper functions, nothing bound to this notebook's session (an open file, a lock, ...).")
    try:
        payload = _ship(hash_block)
    except Exception as e:  # noqa: BLE001
        fail(f"the checker could not send hash_block to a fresh Python process to check it gives the same hashes "
             f"there ({type(e).__name__}: {e})", how)
    for seed in ("1", "2"):
        r = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(_PROCESS_INPUTS)], input=payload,
                           capture_output=True, env=config.child_env(PYTHONHASHSEED=seed), timeout=120)
        lines = [ln for ln in r.stdout.decode(errors="replace").splitlines() if ln.startswith("RESULT ")]
        if not lines:
            err = (r.stderr.decode(errors="replace").strip().splitlines() or ["no output"])[-1]
            fail(f"hash_block could not run in a fresh Python process ({err[:200]}), so the checker cannot tell "
                 "whether it is deterministic across processes", how)
        there = json.loads(lines[0][len("RESULT "):])
        for key, parent_key, parent, tokens in _PROCESS_INPUTS:
            if there[key] != here[key]:
                what = f"hash_block({'<hash of the previous block>' if parent_key else parent}, {tuple(tokens[:4])}...)"
                fail(f"hash_block is not deterministic across processes: {what} gave {here[key]} here but "
                     f"{there[key]} in a fresh Python process (PYTHONHASHSEED={seed}) — Python's built-in hash() "
                     "of str/bytes (and of anything containing them) is salted per process, so two workers, or "
                     "a restarted server, would never agree on a prefix's key",
                     "build the hash with hashlib (e.g. hashlib.blake2b or hashlib.sha256) over bytes you encode "
                     "yourself from the parent and the token ids; never call hash().")


def verify_lab05_1(hash_block: Callable[..., Any]) -> None:
    h = _hasher(hash_block)
    parents = st.none() | st.integers(1, HASH_MASK)

    @given(parent=parents, tokens=st.lists(st.integers(0, 200_000), min_size=1, max_size=16),
           kind=st.sampled_from(sorted(_MUTATION_WHY)), i=st.integers(0, 15), j=st.integers(0, 15),
           v=st.integers(0, 200_000), other=parents, second=st.lists(st.integers(0, 200_000), min_size=1, max_size=8))
    @example(parent=None, tokens=[1, 2], kind="swap", i=0, j=1, v=0, other=7, second=[3])          # order
    @example(parent=None, tokens=[1, 2, 3, 4], kind="reverse", i=0, j=0, v=0, other=2**64, second=[5])
    @example(parent=5, tokens=[1, 23], kind="change", i=0, j=0, v=12, other=5 + 2**64, second=[4])  # parent's high bits
    @example(parent=1, tokens=[3, 4], kind="change", i=1, j=0, v=5, other=2**61, second=[6])       # hash(2**61)==hash(1)
    @example(parent=None, tokens=[7, 65001], kind="alias16", i=1, j=0, v=0, other=3, second=[7])   # 16-bit ids
    @example(parent=9, tokens=[100, 200], kind="alias8", i=0, j=0, v=0, other=None, second=[100, 201])
    @example(parent=None, tokens=[5, 6], kind="change", i=0, j=0, v=1, other=4, second=[8, 9])     # reordered chain
    def prop(parent: int | None, tokens: list[int], kind: str, i: int, j: int, v: int, other: int | None,
             second: list[int]) -> None:
        base = h(parent, tokens)
        again = h(None if parent is None else int(str(parent)), list(tokens))   # equal values, fresh objects
        if again != base:
            fail(f"hash_block({parent}, {tuple(tokens)}) gave {base}, then {again} for the same inputs: equal inputs "
                 "must give equal hashes (no randomness, no id(), no time)")
        mutated = _mutate(tuple(tokens), kind, i, j, v)
        if mutated is not None and h(parent, mutated) == base:
            fail(f"hash_block({parent}, {tuple(tokens)}) == hash_block({parent}, {mutated}) — {_MUTATION_WHY[kind]}")
        if other != parent and h(other, tokens) == base:
            why = ("the parent hash must go into the hash: a block's KV depends on every token before it, so the "
                   "same tokens after a different prefix are a different block")
            if parent is not None and other is not None and (parent ^ other) >> 64 and not (parent ^ other) & (2**64 - 1):
                why = "only the low 64 bits of the parent count: the parent is a 128-bit (or wider) int, encode all of it"
            elif parent is not None and other is not None and (other - parent) % (2**61 - 1) == 0:
                why = ("Python's hash() of an int is the int modulo 2**61 - 1, so hash(2**61) == hash(1): don't pass "
                       "the parent through hash(), encode its bytes into a hashlib digest")
            fail(f"hash_block({parent}, {tuple(tokens)}) == hash_block({other}, {tuple(tokens)}) — {why}")
        if h(base, tokens) == base:
            fail(f"hash_block(h, {tuple(tokens)}) == h for h = hash_block({parent}, {tuple(tokens)}): the same tokens "
                 "one block later must get a new hash (chain the parent in)")
        if tuple(second) != tuple(tokens) and h(h(parent, tokens), second) == h(h(parent, second), tokens):
            fail(f"the chain {tuple(tokens)} then {tuple(second)} got the same key as {tuple(second)} then "
                 f"{tuple(tokens)}: combining the parent and the block symmetrically (xor, +) forgets which came "
                 "first — hash the parent's bytes together with the tokens instead")
        if len(tokens) >= 2 and tokens[0] < 10 and 10 <= tokens[1] < 100:      # (1, 23) vs (12, 3)
            split = (tokens[0] * 10 + tokens[1] // 10, tokens[1] % 10) + tuple(tokens[2:])
            if h(parent, split) == base:
                fail(f"hash_block({parent}, {tuple(tokens)}) == hash_block({parent}, {split}): joining the token ids' "
                     "digits without a separator makes different blocks the same bytes — use a separator or "
                     "fixed-width bytes per token")

    run_property(prop, max_examples=120, example=False, hint=Hint(     # the messages show the calls compared
        "a prefix-cache key must be equal for equal inputs in every process, and must change with the parent, "
        "with any token and with their order.",
        "Python's hash() is salted per process for str/bytes and collides for ints: hash bytes you encode yourself "
        "with hashlib; encode the whole parent (or a marker for None) and every token at a fixed width (or with "
        "separators), and keep at least 128 bits.",
        "hash a byte encoding of (parent, tokens) with hashlib, e.g. blake2b(digest_size=16) or sha256: mark the "
        "parent as None or encode all its bytes, give every token a fixed width of at least 4 bytes (or a "
        "separator), then int.from_bytes(digest, 'little')."))
    # width: a 64-bit hash collides after ~2**32 blocks (birthday bound), far too soon for a shared cache
    outs = [h(None, (k, k + 1, k + 2)) for k in range(32)]
    check(max(outs) >= 2**64,
          f"all 32 hashes of hash_block(None, (k, k+1, k+2)), k < 32, are below 2**64 (largest: {max(outs)}): the "
          "hash has 64 bits or fewer — with billions of cached blocks (a fleet, a day) 64-bit keys collide "
          "(birthday bound ~2**32 blocks), and Python's hash() is 64-bit and easy to collide on purpose",
          "use a digest of at least 128 bits: hashlib.blake2b(digest_size=16) or hashlib.sha256, then "
          "int.from_bytes(digest, 'little').")
    _check_cross_process(hash_block)


# --------------------------------------------------------------------------- lab05_2 find_cached_prefix

def reference_find_cached_prefix(token_ids: Sequence[int], block_size: int, cache: Mapping[int, CachedBlock],
                                 hash_fn: Callable[..., int]) -> list[int]:
    """The longest k <= (len - 1) // block_size whose first k blocks ALL verify (entry exists, holds the block's
    tokens, was computed after the entry of the block before), trying every k from the longest down."""
    bs = block_size
    for k in range((len(token_ids) - 1) // bs, 0, -1):
        keys, h = [], None
        for i in range(k):
            h = hash_fn(h, tuple(token_ids[i * bs:(i + 1) * bs]))
            keys.append(h)
        entries = [cache.get(key) for key in keys]
        if all(e is not None for e in entries) and \
                all(e.tokens == tuple(token_ids[i * bs:(i + 1) * bs]) for i, e in enumerate(entries)) and \
                all(e.parent == (entries[i - 1].block_id if i else None) for i, e in enumerate(entries)):
            return [e.block_id for e in entries]
    return []


def _walk(token_ids: Sequence[int], block_size: int, cache: Mapping[int, CachedBlock], hash_fn: Callable[..., int], *,
          cap: bool = True, verify_tokens: bool = True, verify_parent: bool = True, stop_at_miss: bool = True,
          return_hashes: bool = False) -> list[int]:
    """The lookup with one knob turned to a classic mistake (for diagnosis only)."""
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


def _parentless(parent: int | None, tokens: Sequence[int]) -> int:
    return reference_hash(None, tokens)


def _sum3(parent: int | None, tokens: Sequence[int]) -> int:
    return sum(tokens) % 3


def _constant(parent: int | None, tokens: Sequence[int]) -> int:
    return 12345


_HASHES = {"strong": reference_hash, "ignores the parent": _parentless, "sum(tokens) % 3": _sum3,
           "constant": _constant}


def _fresh(x: int) -> int:
    """An int equal to x but not the same object (above 256 CPython does not share ints): code that compares block
    ids or hashes with `is` instead of `==` shows."""
    return int(str(x))


def build_cache(prompts: Sequence[Sequence[int]], block_size: int, hash_fn: Callable[..., int],
                evict: Sequence[int] = ()) -> dict[int, CachedBlock]:
    """Register `prompts`' full blocks as BlockManager.commit_computed does (a verified entry is reused; on a hash
    collision the first entry stays, the new block is not cached), then drop the entries indexed in `evict`.
    Block ids start at 1000 and every entry's parent is an equal but distinct int object (`is` is not `==`)."""
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
                b, next_id = 1000 + next_id, next_id + 1
                if e is None:
                    cache[h] = CachedBlock(_fresh(b), None if parent is None else _fresh(parent), tokens)
            parent_hash, parent = h, b
    for k in sorted({int(k) % max(1, len(cache)) for k in evict}, reverse=True):
        if cache:
            del cache[list(cache)[k]]
    return cache


@st.composite
def _prefix_scenarios(draw: st.DrawFn) -> tuple:
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
    (2, [[1, 1, 0, 2]], "constant", [], [3, 3, 5]),
]


def _probe_args(bs: int, prompts: list[list[int]], hash_name: str, evict: list[int], query: list[int]) -> tuple:
    fn = _HASHES[hash_name]
    return (list(query), bs, MappingProxyType(build_cache(prompts, bs, fn, evict)), fn)


def _as_list(x: Any) -> list[int] | None:
    try:
        return as_ints(x, "find_cached_prefix's result")
    except GradingError:
        return None


def _diagnose_prefix(find: Callable[..., Any], args: tuple) -> str | None:
    variants = [(why, (lambda kw: (lambda t, b, c, f: []) if kw is None else
                       (lambda t, b, c, f: _walk(t, b, c, f, **kw)))(kw)) for why, kw in _PREFIX_MISTAKES]
    probes = [args] + [_probe_args(*p) for p in _PREFIX_PROBES]
    return diagnose(find, variants, probes, lambda a, b: _as_list(a) == list(b))


def verify_lab05_2(find_cached_prefix: Callable[..., Any]) -> None:
    @given(scenario=_prefix_scenarios())
    @example(scenario=(2, [[0, 1, 2, 3, 0, 0]], "strong", [], [0, 1, 2, 3, 0, 0, 1]))          # plain reuse
    @example(scenario=(2, [[0, 1, 2, 3, 0, 0]], "strong", [], [0, 1, 2, 3]))                   # block-aligned: cap
    @example(scenario=(1, [[0, 1, 2, 3], [1, 2, 0, 3, 3]], "ignores the parent", [], [1, 2, 0, 3]))  # parent check
    @example(scenario=(2, [[1, 1, 0, 2, 3, 3]], "constant", [], [1, 1, 3, 3, 0]))              # forced collision
    @example(scenario=(2, [[1, 1, 0, 2]], "constant", [], [3, 3, 5]))                          # same parent, other tokens
    @example(scenario=(1, [[3, 2, 1, 0]], "strong", [1], [3, 2, 1, 0, 0]))                     # a gap: stop there
    def prop(scenario: tuple) -> None:
        bs, prompts, hash_name, evict, query = scenario
        args = _probe_args(bs, prompts, hash_name, evict, query)
        cache = args[2]
        got = as_ints(find_cached_prefix(list(query), bs, cache, args[3]), "find_cached_prefix's result")
        want = reference_find_cached_prefix(*args)
        if got == want:
            return
        shown = {h if h < 2**32 else f"{h:#x}"[:10] + "…": tuple(e) for h, e in cache.items()}
        why = _diagnose_prefix(find_cached_prefix, args)
        fail(f"find_cached_prefix returned {got}, expected {want} for block_size={bs}, hash_fn={hash_name}, "
             f"token_ids={query}, cache (hash -> (block_id, parent, tokens)) = {shown}" + (f" — {why}" if why else ""))

    run_property(prop, max_examples=150, hint=Hint(
        "the lookup walks the prompt block by block from the start, chaining the hashes, and stops at the first "
        "block the cache cannot vouch for.",
        "only full blocks count, and never the block holding the last token (it must be computed to give logits); "
        "an entry matches only when its tokens and its parent block are the ones expected (hashes collide); return "
        "the block ids of the matched prefix.",
        "walk the full blocks i = 0, 1, ... < (len(token_ids) - 1) // block_size: h = hash_fn(parent hash, "
        "tuple(block tokens)); e = cache.get(h); stop unless e exists, e.tokens equals the block's tokens and "
        "e.parent equals the previous matched block_id (None first); else keep e.block_id and chain h."))


# --------------------------------------------------------------------------- lab05_3 the LRU evictor

class _LRUModel:
    """Every block stamped with the time of its last add: the next victim has the oldest stamp."""

    def __init__(self):
        self.clock, self.stamp = 0, {}

    def add(self, block: int) -> None:
        self.clock += 1
        self.stamp[block] = self.clock

    def remove(self, block: int) -> None:
        del self.stamp[block]

    def order(self):
        return sorted(self.stamp, key=self.stamp.get)

    def pop_lru(self):
        victim = self.order()[0]
        del self.stamp[victim]
        return victim

    def clear(self):
        blocks = self.order()
        self.stamp.clear()
        return blocks


_OPS = st.lists(st.tuples(st.sampled_from(["add", "add", "add", "remove", "pop", "readd", "clear"]),
                          st.integers(0, 7) | st.integers(250, 600)), max_size=40)


def _run_ops(cls, ops: list[tuple[str, int]]) -> None:
    """Apply `ops` to a fresh cls() and to the model; fail at the first disagreement."""
    ev, model = cls(), _LRUModel()
    log = []

    def state():
        return f"after {', '.join(log)}" if log else "on a fresh evictor"

    for op, b in ops:
        if op in ("remove", "readd", "pop") and not model.stamp:
            continue
        if op == "readd":
            op, b = "add", model.order()[b % len(model.stamp)]
        if op == "add":
            ev.add(_fresh(b))
            model.add(b)
            log.append(f"add({b})")
        elif op == "remove":
            b = model.order()[b % len(model.stamp)]
            ev.remove(_fresh(b))
            model.remove(b)
            log.append(f"remove({b})")
        elif op == "pop":
            got, want = as_int(ev.pop_lru(), "pop_lru()'s block"), model.pop_lru()
            if got != want:
                fail(f"pop_lru() returned {got}, expected {want} (the least recently added) {state()}"
                     f"{_evictor_why(cls)}")
            log.append(f"pop_lru() -> {got}")
        elif op == "clear":
            want, got = model.clear(), ev.clear()
            if got is None or sorted(as_ints(got, "clear()'s result")) != sorted(want):
                fail(f"clear() returned {got!r}, expected the evictable blocks {want} {state()}: "
                     "BlockManager.reset_prefix_cache() turns them back into free blocks")
            log.append("clear()")
        if len(ev) != len(model.stamp):
            fail(f"len() is {len(ev)}, expected {len(model.stamp)} {state()}")
        order = as_ints(list(iter(ev)), "the blocks iter() yields")
        if order != model.order():
            why = _evictor_why(cls)
            if not why and order == model.order()[::-1] and len(order) > 1:
                why = " — iterate in eviction order: the next victim (least recently added) first"
            fail(f"iterating gives {order}, expected {model.order()} (eviction order: next victim first) {state()}{why}")


_MANY = 5000     # blocks in the evictor at once: a pool holds tens of thousands; a capped container shows


def _many_blocks(cls) -> None:
    """Thousands of evictable blocks at once (every block of a big pool can be cached and unreferenced): the
    evictor must keep all of them, in LRU order."""
    __tracebackhide__ = True
    ev, model = cls(), _LRUModel()
    ids = [300 + (k * 7919) % _MANY for k in range(_MANY)]          # a permutation: not in id order
    for b in ids:
        ev.add(_fresh(b))
        model.add(b)
    n = as_int(len(ev), "len(evictor)")
    if n != _MANY:
        fail(f"after {_MANY} add() of distinct block ids: len() is {n}, expected {_MANY} — the evictor must keep "
             "every block added (no fixed capacity): a block it drops is neither free nor findable again, so it "
             "leaks", "the evictor holds every block it is given, however many: a pool has tens of thousands of "
             "blocks and any of them can be cached and unreferenced at once.",
             example=f"{_MANY} add() of distinct block ids 300..{300 + _MANY - 1}, then len()")
    for b in ids[:3]:                                               # re-adds: the oldest become the newest
        ev.add(_fresh(b))
        model.add(b)
    for b in ids[5:7]:
        ev.remove(_fresh(b))
        model.remove(b)
    steps = (f"{_MANY} add() of distinct block ids 300..{300 + _MANY - 1}, then add() again of the first 3 and "
             "remove() of the 6th and 7th")
    n = as_int(len(ev), "len(evictor)")
    hint = ("the evictor holds every block it is given, however many: a pool has tens of thousands of blocks and "
            "any of them can be cached and unreferenced at once.")
    if n != len(model.stamp):
        fail(f"after {steps}: len() is {n}, expected {len(model.stamp)} — the evictor must keep every block added "
             "(no fixed capacity): a block it drops is neither free nor findable again, so it leaks", hint,
             example=steps)
    order = as_ints(list(iter(ev)), "the blocks iter() yields")
    if order != model.order():
        first = next((i for i, (a, b) in enumerate(zip(order, model.order())) if a != b), min(len(order), n))
        fail(f"after {steps}: iterating gives {order[first:first + 5]}… from position {first}, expected "
             f"{model.order()[first:first + 5]}… (eviction order: next victim first)", hint, example=steps)
    for k in range(10):
        got, want = as_int(ev.pop_lru(), "pop_lru()'s block"), model.pop_lru()
        if got != want:
            fail(f"after {steps}: pop_lru() number {k + 1} returned {got}, expected {want} (the least recently "
                 "added)", hint, example=steps)
    got = ev.clear()
    want = model.clear()
    if got is None or sorted(as_ints(got, "clear()'s result")) != sorted(want):
        fail(f"after {steps} and 10 pop_lru(): clear() did not return the {len(want)} blocks still evictable",
             hint, example=steps)


def _evictor_why(cls) -> str:
    """Name the classic mistake from three fixed probes (empty string when none applies)."""
    def pops(*steps: tuple[str, int]) -> Any:
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
    """The evictor inside a real BlockManager (its evictor_cls seam): LRU by time of last free, tail blocks first."""
    bm = BlockManager(8, 2, evictor_cls=cls)

    def run(sid: int, prompt: list[int]) -> int:
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
    bm.reset_prefix_cache()
    bm.check_invariants()
    check(bm.num_free_blocks == bm.num_blocks and len(bm.evictor) == 0,
          "inside a BlockManager: after reset_prefix_cache() every block must be free and the evictor empty",
          "clear() must empty the evictor and return the blocks it held.")


def verify_lab05_3(evictor_cls: type) -> None:
    @given(ops=_OPS)
    @example(ops=[("add", 1), ("add", 2), ("add", 3), ("pop", 0)])                              # LRU, not MRU
    @example(ops=[("add", 1), ("add", 2), ("add", 1), ("pop", 0)])                              # re-add refreshes
    @example(ops=[("add", 1), ("add", 2), ("remove", 0), ("add", 1), ("pop", 0)])               # remove, add again
    @example(ops=[("add", 4), ("add", 5), ("clear", 0), ("add", 6), ("pop", 0)])
    @example(ops=[("add", 300), ("add", 2), ("add", 599), ("pop", 0), ("pop", 0)])             # ids above 256
    def prop(ops: list[tuple[str, int]]) -> None:
        _run_ops(evictor_cls, ops)

    run_property(prop, max_examples=150, hint=Hint(
        "least recently used: the evictor keeps its blocks ordered by when each was last added.",
        "adding a block that is already there makes it the most recent; pop_lru takes the oldest; iteration goes "
        "from the next victim on; remove and clear drop blocks.",
        "keep the blocks in an OrderedDict (or a plain dict, which keeps insertion order): add = pop the block if "
        "present, then insert it at the end; pop_lru = take the first; iterate in that order."))
    _many_blocks(evictor_cls)
    try:
        _block_manager_scenario(evictor_cls)
    except (GradingError, NotImplementedError):
        raise
    except Exception as e:  # noqa: BLE001
        fail(f"inside a BlockManager the evictor raised {type(e).__name__}: {e}",
             "BlockManager calls add(block), remove(block), pop_lru(), clear(), len(evictor) and iterates over it.")


# --------------------------------------------------------------------------- the tasks

TASKS = {t.id: t for t in (
    Task("lab05_1", what="hash_block", verify=verify_lab05_1,
         engine=minillm_objects("minillm.kv.prefix_cache:default_hash_fn"), oracles=lambda: [reference_hash]),
    Task("lab05_2", what="find_cached_prefix", verify=verify_lab05_2,
         engine=minillm_objects("minillm.kv.prefix_cache:find_cached_prefix"),
         oracles=lambda: [reference_find_cached_prefix]),
    Task("lab05_3", what="evictor", verify=verify_lab05_3, kind="class",
         methods=("add", "remove", "pop_lru", "clear", "__len__", "__iter__"),
         engine=minillm_objects("minillm.kv.prefix_cache:LRUEvictor"), oracles=lambda: [_LRUModel]),
)}

check_lab05_1 = TASKS["lab05_1"].checker(
    'hash_block(parent_hash: int | None, token_ids: tuple[int, ...]) -> int, chained and process-independent.')
check_lab05_2 = TASKS["lab05_2"].checker(
    'find_cached_prefix(token_ids, block_size, cache, hash_fn) -> block ids of the longest verified cached prefix.')
check_lab05_3 = TASKS["lab05_3"].checker(
    'An LRU evictor class: add, remove, pop_lru, clear, len, iter (eviction order).')
