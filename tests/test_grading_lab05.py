"""lab05 checkers, graded both ways: minillm's own hash / lookup / LRU evictor pass the property suites; handed in
as answers (as they are, wrapped, subclassed) they are refused, and plausible wrong implementations fail. Plus: the
learner's pieces plugged into the BlockManager through its seams keep it correct (the BlockManager property suite),
and the checker's oracles agree with the engine."""
import functools
import hashlib

import pytest

import block_properties as props
from minillm.grading.lab05 import (TASKS, build_cache, check_lab05_1, check_lab05_2, check_lab05_3,
                                   reference_find_cached_prefix, reference_hash)
from minillm.interfaces import CachedBlock
from minillm.kv.block_manager import BlockManager
from minillm.kv.prefix_cache import LRUEvictor, default_hash_fn, find_cached_prefix
from grading_helpers import rejected


# ---------------------------------------------------------------- lab05_1 the chained block hash

def test_lab05_1_minillm_hash_passes():
    TASKS["lab05_1"].verify(default_hash_fn)


def test_lab05_1_rejects_minillm_hash_itself():
    rejected(check_lab05_1, default_hash_fn, "minillm's own answer", "default_hash_fn")
    rejected(check_lab05_1, reference_hash, "minillm's own answer")
    rejected(check_lab05_1, lambda parent, tokens: default_hash_fn(parent, tokens), "runs minillm's own")


def _blake(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=16).digest(), "little")


def _enc(parent, tokens):
    return repr(parent).encode() + b"|" + b",".join(str(t).encode() for t in tokens)


def hash_correct_sha(parent, tokens):            # a learner's correct version: sha256 of a text encoding
    return int(hashlib.sha256(f"{parent}/{list(tokens)}".encode()).hexdigest(), 16)


def hash_no_parent(parent, tokens):
    return _blake(_enc(None, tokens))


def hash_salted_str(parent, tokens):              # Python's hash() of a str: salted per process
    return _blake(str(hash(f"{parent}:{tokens}")).encode())


def hash_salted_tuple_of_strings(parent, tokens):
    return _blake(str(hash((str(parent),) + tuple(str(t) for t in tokens))).encode())


def hash_builtin_tuple(parent, tokens):           # deterministic for ints, but 64-bit and ints mod 2**61 - 1
    return hash((parent, tuple(tokens))) & (2**64 - 1)


def hash_sum_of_ids(parent, tokens):
    return _blake(_enc(parent, [sum(tokens)]))


def hash_sorted_ids(parent, tokens):
    return _blake(_enc(parent, sorted(tokens)))


def hash_joined_digits(parent, tokens):
    return _blake(repr(parent).encode() + b"|" + "".join(str(t) for t in tokens).encode())


def hash_parent_low_64_bits(parent, tokens):
    return _blake(_enc(None if parent is None else parent & (2**64 - 1), tokens))


def hash_returns_hexdigest(parent, tokens):
    return hashlib.blake2b(_enc(parent, tokens), digest_size=16).hexdigest()


def hash_crc32(parent, tokens):                   # deterministic and chained, but only 32 bits
    import zlib
    return zlib.crc32(_enc(parent, tokens))


HASH_WRONG = {
    "no_parent": (hash_no_parent, "parent hash must go into the hash"),
    "salted_str": (hash_salted_str, "not deterministic across processes"),
    "salted_tuple_of_strings": (hash_salted_tuple_of_strings, "salted per process"),
    "builtin_tuple_hash": (hash_builtin_tuple, "hash(2**61) == hash(1)"),
    "sum_of_ids": (hash_sum_of_ids, "ORDER of the tokens matters"),
    "sorted_ids": (hash_sorted_ids, "ORDER"),
    "joined_digits": (hash_joined_digits, "separator"),
    "parent_low_64_bits": (hash_parent_low_64_bits, "low 64 bits of the parent"),
    "hexdigest": (hash_returns_hexdigest, "must be an int"),
    "crc32": (hash_crc32, "64 bits or fewer"),
}


@pytest.mark.parametrize("name", HASH_WRONG)
def test_lab05_1_wrong_implementations_fail(name):
    fn, diagnosis = HASH_WRONG[name]
    rejected(check_lab05_1, fn, diagnosis, "Hint")


def test_lab05_1_correct_learner_versions_pass():
    check_lab05_1(hash_correct_sha)

    def with_helper(parent, tokens):                 # helper function + module global: shipped to the subprocess
        return _blake(_enc(parent, tokens))
    check_lab05_1(with_helper)


def test_lab05_1_learner_hash_plugs_into_block_manager():
    """BlockManager with the learner's hash (its hash_fn seam) passes the property suite's prefix-cache checks."""
    LearnerHashBM = type("LearnerHashBM", (BlockManager,), {"hash_fn": staticmethod(hash_correct_sha)})
    props.check_prefix_reuse(LearnerHashBM)
    props.check_hash_chaining(LearnerHashBM)


def test_lab05_1_aliasing_and_symmetric_chains_fail():
    import numpy as np

    def uint16_ids(parent, tokens):        # ids cast to 16 bits: id and id + 65536 collide
        data = (b"N" if parent is None else parent.to_bytes(32, "little")) + np.array(tokens).astype(np.uint16).tobytes()
        return int.from_bytes(hashlib.sha256(data).digest(), "little")

    def xor_chain(parent, tokens):         # parent ^ H(block): the chain (A, B) equals (B, A)
        own = int.from_bytes(hashlib.sha256(np.array(tokens, dtype=np.int64).tobytes()).digest(), "little")
        return own if parent is None else parent ^ own
    rejected(check_lab05_1, uint16_ids, "plus 2**16")
    rejected(check_lab05_1, xor_chain, "symmetrically")


def test_lab05_1_unshippable_hash_fails_with_a_message():
    import threading
    lock = threading.Lock()

    def locked(parent, tokens):
        with lock:
            return hash_correct_sha(parent, tokens)
    rejected(check_lab05_1, locked, "could not send hash_block to a fresh Python process")


# ---------------------------------------------------------------- lab05_2 the prefix-cache lookup

def test_lab05_2_minillm_lookup_passes():
    TASKS["lab05_2"].verify(find_cached_prefix)


def test_lab05_2_rejects_minillm_and_the_reference():
    rejected(check_lab05_2, reference_find_cached_prefix, "itself")
    rejected(check_lab05_2, find_cached_prefix, "itself")
    rejected(check_lab05_2, lambda *a: find_cached_prefix(*a), "runs minillm's own implementation")


def _find(token_ids, block_size, cache, hash_fn, *, cap=True, tokens=True, parent=True, stop=True,
          own_hash=None, as_list_slice=False, parent_is=False):
    n = (len(token_ids) - 1) // block_size if cap else len(token_ids) // block_size
    out, ph, pb = [], None, None
    for i in range(n):
        blk = token_ids[i * block_size:(i + 1) * block_size]
        key = blk if as_list_slice else tuple(blk)
        h = (own_hash or hash_fn)(ph, tuple(blk))
        e = cache.get(h)
        if e is None or (tokens and e.tokens != key) or \
                (parent and (e.parent is not pb if parent_is else e.parent != pb)):
            if stop:
                break
            ph = h
            continue
        out.append(e.block_id)
        ph, pb = h, e.block_id
    return out


LOOKUP_WRONG = {
    "no_cap": (functools.partial(_find, cap=False), "at least one token must be left"),
    "no_token_check": (functools.partial(_find, tokens=False), "compare the cached block's tokens"),
    "no_parent_check": (functools.partial(_find, parent=False), "compare the cached block's parent"),
    "continues_after_miss": (functools.partial(_find, stop=False, parent=False), "stop at the first miss"),
    "own_hash": (functools.partial(_find, own_hash=hash_correct_sha), "hash_fn argument"),
    # block ids above 256 are distinct int objects when equal: `is` works on small ids only
    "parent_compared_with_is": (functools.partial(_find, parent_is=True), "expected"),
    "list_vs_tuple": (functools.partial(_find, as_list_slice=True), "tuples"),
    "returns_hashes": (lambda t, b, c, f: [f(None, tuple(t[:b]))] if len(t) > b and f(None, tuple(t[:b])) in c
                       else [], "Smallest failing example"),
}


@pytest.mark.parametrize("name", LOOKUP_WRONG)
def test_lab05_2_wrong_implementations_fail(name):
    fn, diagnosis = LOOKUP_WRONG[name]
    rejected(check_lab05_2, fn, diagnosis, "Smallest failing example", "Hint")


def test_lab05_2_correct_learner_code_passes():
    check_lab05_2(functools.partial(_find))


def test_lab05_2_cannot_write_into_the_cache():
    def writes(token_ids, block_size, cache, hash_fn):
        cache[0] = CachedBlock(0, None, ())
        return []
    rejected(check_lab05_2, writes, "TypeError")


# ---------------------------------------------------------------- lab05_3 the LRU evictor

class WrappedLRU:
    """minillm's LRUEvictor behind a forwarding class (composition, not a subclass): refused by the tracer."""

    def __init__(self):
        self.ev = LRUEvictor()

    def add(self, b):
        self.ev.add(b)

    def remove(self, b):
        self.ev.remove(b)

    def pop_lru(self):
        return self.ev.pop_lru()

    def clear(self):
        return self.ev.clear()

    def __len__(self):
        return len(self.ev)

    def __iter__(self):
        return iter(self.ev)


def test_lab05_3_minillm_evictor_passes():
    TASKS["lab05_3"].verify(LRUEvictor)


def test_lab05_3_rejects_minillm_evictor_itself_wrapped_and_subclassed():
    rejected(check_lab05_3, LRUEvictor, "minillm's own answer")
    rejected(check_lab05_3, WrappedLRU, "runs minillm's own implementation")

    class Sub(LRUEvictor):
        pass
    rejected(check_lab05_3, Sub, "runs minillm's own implementation")


class DictLRU:
    """A learner's correct version on a plain dict."""

    def __init__(self):
        self.d = {}

    def add(self, b):
        self.d.pop(b, None)
        self.d[b] = True

    def remove(self, b):
        del self.d[b]

    def pop_lru(self):
        b = next(iter(self.d))
        del self.d[b]
        return b

    def clear(self):
        out = list(self.d)
        self.d = {}
        return out

    def __len__(self):
        return len(self.d)

    def __iter__(self):
        return iter(list(self.d))


class MRUEvictor(DictLRU):
    def pop_lru(self):
        b = list(self.d)[-1]
        del self.d[b]
        return b

    def __iter__(self):
        return iter(reversed(list(self.d)))


class NoRefreshOnReadd(DictLRU):
    """add() ignores a block that is already there: FIFO by first insertion."""

    def add(self, b):
        if b not in self.d:
            self.d[b] = True


class FirstInsertionFIFO:
    """Remembers when a block was first seen, forever: FIFO by first insertion, even across remove/re-add."""

    def __init__(self):
        self.first, self.live, self.n = {}, set(), 0

    def add(self, b):
        if b not in self.first:
            self.first[b] = self.n
            self.n += 1
        self.live.add(b)

    def remove(self, b):
        self.live.remove(b)

    def pop_lru(self):
        b = min(self.live, key=self.first.__getitem__)
        self.live.remove(b)
        return b

    def clear(self):
        out = sorted(self.live, key=self.first.__getitem__)
        self.live = set()
        return out

    def __len__(self):
        return len(self.live)

    def __iter__(self):
        return iter(sorted(self.live, key=self.first.__getitem__))


class ClearReturnsNothing(DictLRU):
    def clear(self):
        self.d.clear()


class PopKeepsBlock(DictLRU):
    def pop_lru(self):
        return next(iter(self.d))


class StackLIFO:
    """A list used as a stack: pop() from the end."""

    def __init__(self):
        self.s = []

    def add(self, b):
        if b in self.s:
            self.s.remove(b)
        self.s.append(b)

    def remove(self, b):
        self.s.remove(b)

    def pop_lru(self):
        return self.s.pop()

    def clear(self):
        out, self.s = self.s, []
        return out

    def __len__(self):
        return len(self.s)

    def __iter__(self):
        return iter(list(self.s))


class IdentityListLRU(StackLIFO):
    """A list in LRU order whose membership and removal compare block ids with `is` (true only for small ints)."""

    def add(self, b):
        self.s = [x for x in self.s if x is not b]
        self.s.append(b)

    def remove(self, b):
        self.s = [x for x in self.s if x is not b]

    def pop_lru(self):
        return self.s.pop(0)


def _bounded(capacity):
    """An LRU that silently drops its oldest block past a fixed capacity (a cache idiom, wrong for an evictor)."""
    def add(self, b):
        DictLRU.add(self, b)
        if len(self.d) > capacity:
            del self.d[next(iter(self.d))]
    return type(f"BoundedLRU{capacity}", (DictLRU,), {"add": add})


EVICTOR_WRONG = {
    "identity_compare": (IdentityListLRU, "expected"),
    "bounded_256": (_bounded(256), "no fixed capacity"),
    "bounded_1024": (_bounded(1024), "no fixed capacity"),
    "bounded_4096": (_bounded(4096), "no fixed capacity"),
    "mru": (MRUEvictor, "MOST recently added"),
    "no_refresh_on_readd": (NoRefreshOnReadd, "LAST add, not first"),
    "fifo_by_first_insertion": (FirstInsertionFIFO, "LAST add, not first"),
    "clear_returns_none": (ClearReturnsNothing, "clear() returned None"),
    "pop_keeps_block": (PopKeepsBlock, "len() is"),
    "byte_ids": (type("ByteIds", (DictLRU,), {"add": lambda self, b: DictLRU.add(self, b % 256)}), "expected"),
    "stack_pop": (StackLIFO, "MOST recently added"),
}


@pytest.mark.parametrize("name", EVICTOR_WRONG)
def test_lab05_3_wrong_implementations_fail(name):
    cls, diagnosis = EVICTOR_WRONG[name]
    rejected(check_lab05_3, cls, diagnosis, "Hint")


def test_lab05_3_correct_learner_code_passes():
    check_lab05_3(DictLRU)


def test_lab05_3_missing_method():
    class NoClear:
        def add(self, b): ...
    rejected(check_lab05_3, NoClear, "lacks")


# ---------------------------------------------------------------- the pieces inside the engine's BlockManager

class AllLearnerPieces(BlockManager):
    """minillm's BlockManager with correct learner-style pieces in its seams: as correct as minillm's own."""
    hash_fn = staticmethod(hash_correct_sha)
    prefix_lookup = staticmethod(functools.partial(_find))
    evictor_cls = DictLRU


def test_plugged_block_manager_passes_the_block_manager_properties():
    props.check_block_manager_properties(AllLearnerPieces, random_examples=60)


def test_plugged_block_manager_with_a_wrong_lookup_serves_wrong_kv():
    NoTokenCheck = type("NoTokenCheck", (BlockManager,), {
        "prefix_lookup": staticmethod(functools.partial(_find, tokens=False, parent=False))})
    with pytest.raises((AssertionError, ValueError)):
        props.check_collision_detection(NoTokenCheck)


def test_reference_lookup_agrees_with_the_engine_on_a_real_cache():
    """The brute-force lookup over the BlockManager's cached_blocks view agrees with the engine's lookup."""
    bm = BlockManager(16, 2, hash_fn=lambda p, t: sum(t) % 3)            # weak hash: collisions galore
    prompts = [[1, 2, 3, 4, 5], [1, 2, 4, 3, 5, 6], [3, 4, 1, 2, 0]]
    for sid, p in enumerate(prompts):
        bm.allocate_prompt(sid, p)
        bm.append_slots(sid, len(p))
        bm.commit_computed(sid, p, len(p))
    bm.free(1)
    for q in ([1, 2, 3, 4, 9], [1, 2, 4, 3, 5, 6, 7], [3, 4, 1, 2], [4, 3, 1, 2, 2], [2, 1, 0]):
        ref = reference_find_cached_prefix(q, 2, bm.cached_blocks, bm.hash_fn)
        assert ref == find_cached_prefix(q, 2, bm.cached_blocks, bm.hash_fn), q
        assert len(ref) * 2 == bm.peek_prefix(q), q


def test_build_cache_agrees_with_block_manager():
    """The checker's simulated cache holds the same (tokens, parent) chains as a real BlockManager."""
    prompts = [[0, 1, 2, 3, 0, 0], [0, 1, 3, 3, 1], [2, 2, 1, 1, 3]]
    for fn in (reference_hash, lambda p, t: sum(t) % 3):
        bm = BlockManager(32, 2, hash_fn=fn)
        for sid, p in enumerate(prompts):
            bm.allocate_prompt(sid, p)
            bm.append_slots(sid, len(p))
            bm.commit_computed(sid, p, len(p))
        mine = build_cache(prompts, 2, fn)
        view = dict(bm.cached_blocks)
        assert set(mine) == set(view)
        for q in prompts + [[0, 1, 2, 3, 0, 0, 5], [2, 2, 1, 1, 3, 3, 3]]:
            assert (len(reference_find_cached_prefix(q, 2, mine, fn))
                    == len(reference_find_cached_prefix(q, 2, view, fn)) == bm.peek_prefix(q) // 2)


def test_reference_hash_is_chained_and_wide():
    x = reference_hash(None, (1, 2))
    assert x != reference_hash(x, (1, 2)) and x != reference_hash(None, (2, 1)) and x < 2**128
