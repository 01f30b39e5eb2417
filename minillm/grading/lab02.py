"""Checkers for lab02 — the paged KV cache.

Tasks (the notebook documents the same signatures):
  lab02_1  slot_mapping(block_table, start, end, block_size) -> list[int]: the flat KV slot of each position
           p in [start, end): block_table[p // block_size] * block_size + p % block_size.
  lab02_2  BlockAllocator(num_blocks): allocate() -> block id (ref count 1; NoFreeBlocksError when none is
           free), share(block) (ref count += 1), free(block) (ref count -= 1, back to the pool at 0, ValueError
           when the block is already free), ref_count(block), num_free_blocks (property).
  lab02_3  a block manager class built on BlockManagerScaffold (below): the learner writes num_blocks_needed,
           append_slots (with copy-on-write), fork and free. It must plug into LLMEngine in place of
           minillm.kv.block_manager.BlockManager(enable_prefix_caching=False).

lab02_1 and lab02_2 are checked against references written here; lab02_3 with the shared block-manager
properties (minillm/grading/block_properties.py: a simulated KV pool that catches every lost write) that
tests/test_block_manager.py runs against minillm's own BlockManager. lab02_3 runs the learner's class with the
grader's own allocator and slot mapping, so a mistake in task 1 or 2 does not fail task 3 too.
"""
from __future__ import annotations

from collections import Counter, deque

from hypothesis import example, given, strategies as st

from minillm.grading import block_properties as props
from minillm.grading.core import diagnose, fail, reject_reference, run_property
from minillm.kv.block_manager import NoFreeBlocksError
from minillm.kv.prefix_cache import PrefixCacheStats

__all__ = ["check_lab02_1", "check_lab02_2", "check_lab02_3", "BlockManagerScaffold", "NoFreeBlocksError",
           "slot_mapping_ref", "ReferenceAllocator"]


# --------------------------------------------------------------------------- lab02_1 slot mapping

def slot_mapping_ref(block_table, start, end, block_size):
    """Position p lives in logical block p // block_size, i.e. physical block block_table[p // block_size],
    at offset p % block_size; the pool's flat slot index is physical_block * block_size + offset."""
    return [block_table[p // block_size] * block_size + p % block_size for p in range(start, end)]


def _range_variant(lo, hi):
    return lambda t, s, e, b: [t[p // b] * b + p % b for p in range(lo(s, e), min(hi(s, e), len(t) * b))]


_SLOT_MISTAKES = [
    ("you returned positions, not slots: a sequence's blocks sit anywhere in the pool — look each position's "
     "block up in the block table", lambda t, s, e, b: list(range(s, e))),
    ("the blocks of a sequence are not contiguous: table[0] * block_size + p assumes they are — look up "
     "block_table[p // block_size] for every position", lambda t, s, e, b: [t[0] * b + p for p in range(s, e)]),
    ("the end is exclusive: positions start, start + 1, ..., end - 1",
     _range_variant(lambda s, e: s, lambda s, e: e + 1)),
    ("off by one: positions start, ..., end - 1 (start included, end excluded)",
     _range_variant(lambda s, e: s + 1, lambda s, e: e + 1)),
    ("positions are absolute: the first one is `start`, not 0", _range_variant(lambda s, e: 0, lambda s, e: e - s)),
    ("multiply the physical block id by block_size: block k holds slots k·block_size … k·block_size + "
     "block_size − 1", lambda t, s, e, b: [t[p // b] + p % b for p in range(s, e)]),
    ("the logical block of position p is p // block_size and its offset p % block_size, not the other way "
     "round", lambda t, s, e, b: [t[p % b] * b + p // b for p in range(s, e)]),
    ("the offset inside the block is p % block_size (not p)",
     lambda t, s, e, b: [t[p // b] * b + p for p in range(s, e)]),
    ("the block index is p // block_size: multiplying by block_size takes you to another block",
     lambda t, s, e, b: [t[p // b] * b + (p % b) * b for p in range(s, e)]),
]
_SLOT_PROBES = [([7, 2, 9, 4], 1, 14, 4), ([5, 0, 3], 3, 8, 3), ([11, 6], 2, 3, 2)]


def _as_int_list(out):
    try:
        return [int(x) for x in out]
    except Exception:  # noqa: BLE001
        return None


@st.composite
def _mapping_cases(draw):
    block_size = draw(st.sampled_from([1, 2, 3, 4, 8, 16]))
    table = draw(st.lists(st.integers(0, 63), min_size=1, max_size=6, unique=True))
    cap = len(table) * block_size
    start = draw(st.integers(0, cap))
    end = draw(st.integers(start, cap))
    return table, start, end, block_size


def check_lab02_1(slot_mapping):
    """slot_mapping(block_table, start, end, block_size) -> [slot of position p for p in range(start, end)]."""
    __tracebackhide__ = True
    from minillm.kv.block_manager import BlockManager
    reject_reference(slot_mapping, slot_mapping_ref, BlockManager.slot_mapping)

    @given(case=_mapping_cases())
    @example(case=([3, 0, 7], 0, 12, 4))      # a whole 3-block sequence
    @example(case=([3, 0, 7], 5, 6, 4))       # one decode position in the middle block
    @example(case=([6, 1, 4], 1, 7, 3))       # a prefill chunk crossing block boundaries
    @example(case=([9, 4], 2, 2, 4))          # nothing to compute
    @example(case=([5, 2, 8], 0, 3, 1))       # block_size 1
    def prop(case):
        table, start, end, bs = case
        call = f"slot_mapping({table}, start={start}, end={end}, block_size={bs})"
        try:
            out = slot_mapping(list(table), start, end, bs)
        except NotImplementedError:
            raise
        except Exception as e:  # noqa: BLE001 — say which call broke, and why if it is a known mistake
            why = diagnose(slot_mapping, _SLOT_MISTAKES, _SLOT_PROBES, lambda a, b: _as_int_list(a) == b)
            first = (str(e).strip().splitlines() or [""])[0]
            assert False, f"{call} raised {type(e).__name__}: {first}" + (f" — {why}" if why else "")
        got = _as_int_list(out) if out is not None else None
        if got is None:
            assert False, f"{call} returned {out!r}: return a list of ints, one slot per position"
        ref = slot_mapping_ref(table, start, end, bs)
        if got == ref:
            return
        why = diagnose(slot_mapping, _SLOT_MISTAKES, [(list(table), start, end, bs)] + _SLOT_PROBES,
                       lambda a, b: _as_int_list(a) == b)
        shown = got if len(got) <= 16 else got[:16] + ["…"]
        assert False, f"{call} returned {shown}, expected {ref}" + (f" — {why}" if why else "")

    run_property(prop, max_examples=80,
                 hint="for p in range(start, end): slot = block_table[p // block_size] * block_size + "
                      "p % block_size.")


# --------------------------------------------------------------------------- lab02_2 block allocator

class ReferenceAllocator:
    """The grader's allocator: a FIFO free pool and one reference count per block."""

    def __init__(self, num_blocks):
        self.num_blocks = int(num_blocks)
        self._ref_counts = [0] * self.num_blocks
        self._free_pool = deque(range(self.num_blocks))

    @property
    def num_free_blocks(self):
        return len(self._free_pool)

    def allocate(self):
        if not self._free_pool:
            raise NoFreeBlocksError(f"all {self.num_blocks} blocks are in use")
        b = self._free_pool.popleft()
        self._ref_counts[b] = 1
        return b

    def share(self, block):
        if self._ref_counts[block] == 0:
            raise ValueError(f"share({block}): block {block} is free")
        self._ref_counts[block] += 1

    def free(self, block):
        if self._ref_counts[block] == 0:
            raise ValueError(f"free({block}): block {block} is already free (double free)")
        self._ref_counts[block] -= 1
        if self._ref_counts[block] == 0:
            self._free_pool.append(block)

    def ref_count(self, block):
        return self._ref_counts[block]


_ALLOC_OPS = st.lists(st.one_of(st.tuples(st.just("allocate")),
                                st.tuples(st.just("share"), st.integers(0, 7)),
                                st.tuples(st.just("free"), st.integers(0, 7))), max_size=24)


def _allocator_run(cls, num_blocks, ops):
    """Drive an allocator class through `ops` next to a model of the ref counts; assert on the first
    disagreement. ("share", k) / ("free", k) act on the k-th block handed out (k modulo their number)."""
    calls: list[str] = []

    def bad(msg):
        raise AssertionError(f"{msg} | Calls: {'; '.join(calls) if calls else '(none)'}")

    calls.append(f"a = BlockAllocator({num_blocks})")
    a = cls(num_blocks)
    model = [0] * num_blocks
    handed: list[int] = []

    def compare(after):
        free = a.num_free_blocks
        want = model.count(0)
        refs = {b: a.ref_count(b) for b in range(num_blocks)}
        for b in range(num_blocks):
            if refs[b] != model[b]:
                bad(f"after {after}: ref_count({b}) = {refs[b]}, expected {model[b]}")
        if free != want:
            bad(f"after {after}: num_free_blocks = {free}, expected {want} (blocks with ref_count 0)")

    compare("the constructor")
    for op in ops:
        if op[0] == "allocate":
            calls.append("allocate()")
            if model.count(0) == 0:
                try:
                    b = a.allocate()
                except NoFreeBlocksError:
                    calls[-1] += " -> NoFreeBlocksError"
                    compare("allocate() raised NoFreeBlocksError")
                    continue
                bad(f"allocate() with all {num_blocks} blocks in use returned {b!r}: raise NoFreeBlocksError "
                    "(and change nothing) — there is no free block to hand out")
            before_free = a.num_free_blocks
            b = a.allocate()
            calls[-1] += f" -> {b!r}"
            if isinstance(b, bool) or not isinstance(b, int) or not 0 <= b < num_blocks:
                bad(f"allocate() returned {b!r}: a block id must be an int in [0, {num_blocks})")
            if model[b] != 0:
                bad(f"allocate() returned block {b}, which is still in use (ref_count {model[b]}): hand out only "
                    "free blocks, and take them out of the free pool")
            if a.num_free_blocks != before_free - 1:
                bad(f"allocate() -> {b}: num_free_blocks went {before_free} -> {a.num_free_blocks}, expected "
                    f"{before_free - 1}: the block must leave the free pool, else it is handed out twice")
            model[b] = 1
            handed.append(b)
            compare(f"allocate() -> {b}")
            continue
        if not handed:
            continue
        b = handed[op[1] % len(handed)]
        name = f"{op[0]}({b})"
        calls.append(name)
        before_free, before_ref = a.num_free_blocks, a.ref_count(b)
        if model[b] == 0:
            try:
                getattr(a, op[0])(b)
            except ValueError:
                calls[-1] += " -> ValueError"
                compare(f"{name} raised ValueError")
                continue
            if op[0] == "free":
                bad(f"{name}: block {b} is already free, yet free() accepted it (num_free_blocks "
                    f"{before_free} -> {a.num_free_blocks}): raise ValueError on a double free — else the block "
                    "enters the pool twice and two sequences get it")
            bad(f"{name}: block {b} is free, yet share() accepted it: raise ValueError — only a block in use can "
                "be shared")
        getattr(a, op[0])(b)
        after_free, after_ref = a.num_free_blocks, a.ref_count(b)
        if op[0] == "share":
            model[b] += 1
            if after_ref == before_ref:
                bad(f"{name} did not increment ref_count({b}) (still {after_ref}): a second table now holds the "
                    "block, so it must survive the first table's free")
        else:
            model[b] -= 1
            if model[b] > 0 and after_ref == 0:
                bad(f"{name} of a block with ref_count {before_ref} returned it to the free pool (num_free_blocks "
                    f"{before_free} -> {after_free}): another table still holds it — decrement the count and free "
                    "the block only when it reaches 0")
            if after_ref == before_ref:
                bad(f"{name} did not decrement ref_count({b}) (still {after_ref}): the block can never return to "
                    "the pool — it leaks")
            if model[b] == 0 and after_free == before_free:
                bad(f"{name} dropped the last reference but block {b} did not return to the free pool "
                    f"(num_free_blocks still {after_free}): it leaks")
        compare(name)
    # everything back, then the whole pool must be allocatable once, without repeats
    for b in range(num_blocks):
        while model[b]:
            calls.append(f"free({b})")
            a.free(b)
            model[b] -= 1
    compare("freeing every block")
    got = []
    for _ in range(num_blocks):
        got.append(a.allocate())
    calls.append(f"allocate() × {num_blocks} -> {got}")
    if sorted(got) != list(range(num_blocks)):
        dup = sorted(b for b, c in Counter(got).items() if c > 1)
        bad(f"with every block free, {num_blocks} allocate() calls must hand out each block once; got {got}"
            + (f" (block(s) {dup} twice: the pool holds duplicates)" if dup else ""))


def check_lab02_2(allocator_cls):
    """BlockAllocator(num_blocks) with allocate / share / free / ref_count / num_free_blocks and ref counts."""
    __tracebackhide__ = True
    reject_reference(allocator_cls, ReferenceAllocator)
    if not isinstance(allocator_cls, type):
        fail(f"pass the class itself (e.g. check_lab02_2(BlockAllocator)), not {type(allocator_cls).__name__!r}")

    @given(num_blocks=st.integers(1, 6), ops=_ALLOC_OPS)
    @example(num_blocks=3, ops=[("allocate",), ("share", 0), ("free", 0)])               # free of a shared block
    @example(num_blocks=3, ops=[("allocate",), ("share", 0), ("free", 0), ("free", 0)])  # ... and of its last user
    @example(num_blocks=2, ops=[("allocate",), ("free", 0), ("free", 0)])                # double free
    @example(num_blocks=2, ops=[("allocate",), ("allocate",), ("allocate",)])            # pool exhausted
    @example(num_blocks=2, ops=[("allocate",), ("free", 0), ("allocate",), ("allocate",)])  # reuse after free
    def prop(num_blocks, ops):
        _allocator_run(allocator_cls, num_blocks, ops)

    run_property(prop, max_examples=120,
                 hint="keep a free pool (e.g. a deque of block ids) and a ref_count per block: allocate pops a "
                      "block and sets its count to 1; share adds 1; free subtracts 1 and puts the block back "
                      "only at 0; raise ValueError for share/free of a free block, NoFreeBlocksError when the "
                      "pool is empty.")


# --------------------------------------------------------------------------- lab02_3 block manager

class BlockManagerScaffold:
    """A paged-KV block manager without its four core methods (lab02, task 3).

    The engine talks to a block manager through this interface (minillm/kv/block_manager.py has the full one,
    with prefix caching). The scaffold keeps the bookkeeping:

      self.allocator        your BlockAllocator (class attribute `allocator_class`) over num_blocks blocks
      self.tables[seq_id]   the sequence's block table: physical block ids for positions 0, bs, 2·bs, ...
      self.computed[seq_id] how many positions of the sequence hold computed K/V (set by commit_computed)
      self._table(seq_id, "op")   the table, or KeyError naming the unknown seq_id
      self._cdiv(n)         ceil(n / block_size)
      self._written_blocks(seq_id, num_tokens)   indices (into the table) of the blocks the sequence already
                            has that positions [computed, num_tokens) fall in — the blocks a write would touch

    and answers the scheduler's and the runner's questions (allocate_prompt, slot_mapping via your
    `slot_mapping_fn`, commit_computed, num_free_blocks, block_table, ref_count, usage, check_invariants).
    A subclass sets `allocator_class` and `slot_mapping_fn` and writes num_blocks_needed, append_slots, fork
    and free. No prefix caching here: lab05 adds it.
    """

    allocator_class = None       # your BlockAllocator class (task 2)
    slot_mapping_fn = None       # your slot_mapping function (task 1)

    def __init__(self, num_blocks, block_size, enable_prefix_caching=False, hash_fn=None):
        if enable_prefix_caching:
            raise ValueError("this block manager has no prefix cache: build the engine with "
                             "enable_prefix_caching=False")
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"num_blocks and block_size must be positive, got {num_blocks}, {block_size}")
        if self.allocator_class is None or self.slot_mapping_fn is None:
            raise TypeError(f"{type(self).__name__} must set `allocator_class = BlockAllocator` and "
                            "`slot_mapping_fn = slot_mapping` (your classes from tasks 1 and 2)")
        self.num_blocks, self.block_size = int(num_blocks), int(block_size)
        self.enable_prefix_caching = False
        self.stats = PrefixCacheStats()          # stays at zero: no prefix cache
        self.allocator = self.allocator_class(self.num_blocks)
        self.tables: dict[int, list[int]] = {}
        self.computed: dict[int, int] = {}

    # ------------------------------------------------------------------ the four methods a subclass writes
    def num_blocks_needed(self, seq_id, num_tokens):
        raise NotImplementedError()

    def append_slots(self, seq_id, num_tokens):
        raise NotImplementedError()

    def fork(self, parent_seq_id, child_seq_id):
        raise NotImplementedError()

    def free(self, seq_id):
        raise NotImplementedError()

    # ------------------------------------------------------------------ helpers
    def _table(self, seq_id, op):
        try:
            return self.tables[seq_id]
        except KeyError:
            raise KeyError(f"{op}: unknown seq_id {seq_id!r} (not allocated, or already freed)") from None

    def _cdiv(self, n):
        return -(-int(n) // self.block_size)

    def _written_blocks(self, seq_id, num_tokens):
        table, done = self._table(seq_id, "append_slots"), self.computed[seq_id]
        if num_tokens <= done:
            return []
        return list(range(done // self.block_size, min(self._cdiv(num_tokens), len(table))))

    # ------------------------------------------------------------------ what the scheduler and runner call
    @property
    def num_free_blocks(self):
        return self.allocator.num_free_blocks

    @property
    def num_used_blocks(self):
        return self.num_blocks - self.num_free_blocks

    def has_seq(self, seq_id):
        return seq_id in self.tables

    def block_table(self, seq_id):
        return list(self._table(seq_id, "block_table"))

    def num_computed_tokens(self, seq_id):
        self._table(seq_id, "num_computed_tokens")
        return self.computed[seq_id]

    def ref_count(self, block_id):
        return self.allocator.ref_count(block_id)

    def peek_prefix(self, token_ids):
        return 0                                  # no prefix cache: nothing is ever cached

    def blocks_to_admit(self, token_ids, num_tokens=None):
        return self._cdiv(len(token_ids) if num_tokens is None else num_tokens)

    def allocate_prompt(self, seq_id, token_ids):
        """Admit a sequence: an empty table, nothing computed. Returns the number of cached tokens (0)."""
        if seq_id in self.tables:
            raise ValueError(f"allocate_prompt: seq_id {seq_id!r} is already allocated")
        if len(token_ids) == 0:
            raise ValueError(f"allocate_prompt: empty token_ids for seq_id {seq_id!r}")
        self.tables[seq_id] = []
        self.computed[seq_id] = 0
        return 0

    def slot_mapping(self, seq_id, start, end):
        table = self._table(seq_id, "slot_mapping")
        if not 0 <= start <= end <= len(table) * self.block_size:
            raise ValueError(f"slot_mapping: [{start}, {end}) outside the {len(table) * self.block_size} slots "
                             f"of seq {seq_id!r}")
        return [int(s) for s in type(self).slot_mapping_fn(list(table), start, end, self.block_size)]

    def commit_computed(self, seq_id, token_ids, num_computed_tokens):
        """The forward pass wrote K/V for positions [0, num_computed_tokens)."""
        table = self._table(seq_id, "commit_computed")
        n = int(num_computed_tokens)
        if not 0 <= n <= min(len(token_ids), len(table) * self.block_size):
            raise ValueError(f"commit_computed: {n} tokens but the table of seq {seq_id!r} has "
                             f"{len(table) * self.block_size} slots")
        self.computed[seq_id] = n

    def reset_prefix_cache(self):
        pass

    def usage(self):
        return {"num_blocks": self.num_blocks, "block_size": self.block_size, "num_free": self.num_free_blocks,
                "num_used": self.num_used_blocks, "num_cached_evictable": 0, "num_cached": 0,
                "num_seqs": len(self.tables), "seq_table_lens": {s: len(t) for s, t in self.tables.items()}}

    def check_invariants(self):
        """Ref counts = table entries; free blocks = blocks in no table. Raises AssertionError."""
        counts = Counter(b for t in self.tables.values() for b in t)
        for b in range(self.num_blocks):
            if self.allocator.ref_count(b) != counts[b]:
                raise AssertionError(f"block {b}: ref_count={self.allocator.ref_count(b)} but it is in "
                                     f"{counts[b]} block table entr{'y' if counts[b] == 1 else 'ies'}")
        if self.num_free_blocks != self.num_blocks - len(counts):
            raise AssertionError(f"num_free_blocks={self.num_free_blocks} but {len(counts)} of {self.num_blocks} "
                                 "blocks are in block tables")
        if set(self.computed) != set(self.tables):
            raise AssertionError("self.computed and self.tables must have the same sequences")


def _isolate(cls):
    """Run a scaffold-based class with the grader's allocator and slot mapping (task 3 is graded on its own)."""
    if isinstance(cls, type) and issubclass(cls, BlockManagerScaffold):
        return type(cls.__name__, (cls,), {"allocator_class": ReferenceAllocator,
                                           "slot_mapping_fn": staticmethod(slot_mapping_ref),
                                           "__module__": __name__, "__qualname__": cls.__qualname__})
    return cls


def _diagnose_manager(cls):
    """Name the mistake from a fixed fork / copy-on-write / free scenario; None when it goes through."""
    try:
        return _scenario(cls)
    except Exception:  # noqa: BLE001 — the learner's code may raise anything: no diagnosis then
        return None


def _scenario(cls):
    bs, n = 4, 8
    bm = cls(n, bs, enable_prefix_caching=False)
    if bm.num_blocks_needed(777, 9) != 3:
        return "num_blocks_needed of a sequence without blocks yet (unknown seq_id) is ceil(num_tokens / block_size)"
    toks = [1, 2, 3, 4, 5]
    bm.allocate_prompt(0, toks)
    if bm.num_blocks_needed(0, 5) != 2:
        return "num_blocks_needed(seq, 5) with block_size 4 and an empty table is 2 new blocks"
    if bm.append_slots(0, 5):
        return "append_slots returned copies for a sequence that shares nothing"
    t0 = bm.block_table(0)
    if len(t0) != 2 or bm.num_free_blocks != n - 2:
        return (f"append_slots(seq, 5) with block_size 4 must give the sequence exactly ceil(5/4) = 2 blocks "
                f"(got table {t0}, {n - bm.num_free_blocks} blocks taken)")
    bm.commit_computed(0, toks, 5)
    a, b = t0
    bm.fork(0, 1)
    if bm.block_table(1) != t0 or bm.num_free_blocks != n - 2:
        return "fork must give the child a copy of the parent's block table — the same blocks, no new ones"
    if bm.ref_count(a) != 2 or bm.ref_count(b) != 2:
        return ("fork must add one reference to every block of the parent's table (allocator.share): both "
                "tables hold them now")
    if bm.num_computed_tokens(1) != 5:
        return "fork must copy the parent's computed-token count to the child (self.computed)"
    need = bm.num_blocks_needed(1, 6)
    copies = bm.append_slots(1, 6)
    t1 = bm.block_table(1)
    if t1[1] == b:
        return ("no copy-on-write: the child's next token goes into a block its parent also uses (ref_count 2), "
                "so the write would corrupt the parent's K/V — give the child a fresh block for it and return "
                "(src, dst) so the engine copies the block's K/V")
    if t1[0] != a:
        return "copy-on-write copies only the block about to be written; the full first block stays shared"
    if list(copies) == [(t1[1], b)]:
        return "copy pairs are (src, dst): (old shared block, new private block)"
    if list(copies) != [(b, t1[1])]:
        return (f"append_slots replaced the shared block {b} by {t1[1]} but returned {copies}: return "
                f"[({b}, {t1[1]})] so the engine copies the K/V of the positions already in that block")
    if bm.ref_count(b) != 1 or bm.num_free_blocks != n - 3:
        return (f"after copy-on-write the child no longer holds block {b}: drop its reference "
                f"(allocator.free({b})) — ref_count({b}) should be 1, it is {bm.ref_count(b)}")
    if need != 1:
        return (f"num_blocks_needed must count copy-on-write: writing position 5 of the forked child lands in its "
                f"last block, shared with the parent, which needs 1 private copy (you said {need})")
    bm.commit_computed(1, toks + [6], 6)
    if bm.append_slots(0, 6):
        return ("the parent's last block is no longer shared (ref_count 1): write it in place — copy only blocks "
                "with ref_count > 1")
    if bm.block_table(0) != t0:
        return "the parent's last block is private again: append_slots must not replace it"
    bm.commit_computed(0, toks + [7], 6)
    bm.free(1)
    if bm.has_seq(1):
        return "free(seq) must forget the sequence (remove its table)"
    if bm.ref_count(a) == 0 or bm.num_free_blocks > n - 2:
        return (f"free released block {a}, which the parent still uses: free drops ONE reference per table entry "
                "(allocator.free); only blocks whose count reaches 0 go back to the pool")
    if bm.ref_count(a) != 1:
        return (f"free must drop one reference for every block of the table (allocator.free): after freeing the "
                f"child, block {a} is held by the parent only, so its ref_count must be 1, not {bm.ref_count(a)} — "
                "else it can never return to the pool (blocks leak)")
    if bm.num_free_blocks < n - 2:
        return (f"free must release every block of the table: after freeing the child only the parent's 2 blocks "
                f"may stay in use, {n - bm.num_free_blocks} are — blocks leak")
    bm.free(0)
    if bm.num_free_blocks != n:
        return f"after freeing every sequence all {n} blocks must be free, {bm.num_free_blocks} are — blocks leak"
    bm.free(0)
    if bm.num_free_blocks != n:
        return "free of an unknown (or already freed) seq_id must do nothing"
    small = cls(3, 2, enable_prefix_caching=False)
    small.allocate_prompt(0, [1] * 7)
    try:
        small.append_slots(0, 7)
    except NoFreeBlocksError:
        if small.num_free_blocks != 3 or small.block_table(0):
            return ("append_slots raised NoFreeBlocksError after taking blocks: check num_blocks_needed against "
                    "num_free_blocks FIRST, then change anything (all or nothing)")
        return None
    return "append_slots(seq, 7) needs 4 blocks of 2 with only 3 in the pool: raise NoFreeBlocksError"


def check_lab02_3(block_manager_cls):
    """A BlockManager (scaffold subclass) with num_blocks_needed / append_slots (copy-on-write) / fork / free."""
    __tracebackhide__ = True
    from minillm.kv.block_manager import BlockManager
    if block_manager_cls is BlockManagerScaffold:
        fail("that is the scaffold itself: pass your subclass (e.g. check_lab02_3(MyBlockManager)).")
    reject_reference(block_manager_cls, BlockManager)
    if not isinstance(block_manager_cls, type):
        fail(f"pass the class itself (e.g. check_lab02_3(MyBlockManager)), not a {type(block_manager_cls).__name__}")
    if issubclass(block_manager_cls, BlockManager):
        fail("your class inherits from minillm's own BlockManager: build it on BlockManagerScaffold and write the "
             "four methods yourself.")
    cls = _isolate(block_manager_cls)

    @given(num_blocks=st.integers(2, 10), block_size=st.sampled_from([1, 2, 4]), ops=props.operations())
    # n = 2 sampling: fork after the prompt, both children decode (copy-on-write of the shared last block)
    @example(num_blocks=8, block_size=4, ops=[("admit", [1, 2, 3, 4, 5]), ("decode", 0, 0), ("fork", 0),
                                              ("decode", 1, 1), ("decode", 0, 2), ("free", 0), ("decode", 1, 2)])
    # a finished sequence's shared blocks must survive for its sibling; then everything is reused
    @example(num_blocks=4, block_size=2, ops=[("admit", [1, 2, 0]), ("prefill", 0, 3), ("fork", 0), ("free", 0),
                                              ("admit", [2, 2, 2, 2, 2]), ("prefill", 2, 5), ("decode", 1, 1)])
    # the pool runs dry: all or nothing
    @example(num_blocks=3, block_size=2, ops=[("admit", [0, 1, 2, 0, 1]), ("prefill", 0, 5), ("fork", 0),
                                              ("decode", 1, 0), ("free", 0), ("decode", 1, 0)])
    def prop(num_blocks, block_size, ops):
        try:
            props.run_operations(cls, ops, num_blocks=num_blocks, block_size=block_size, enable_prefix_caching=False)
        except AssertionError as e:
            what, _, calls = str(e).partition(" | Calls: ")
            why = _diagnose_manager(cls)
            raise AssertionError(what + (f" — {why}" if why else "")
                                 + (f"\nCalls (block_size {block_size}, {num_blocks} blocks): {calls}" if calls else "")
                                 ) from None

    run_property(prop, max_examples=150,
                 hint="append_slots: first count what is needed (num_blocks_needed) and raise NoFreeBlocksError "
                      "if it is more than num_free_blocks; replace every shared block (ref_count > 1) that the new "
                      "positions [computed, num_tokens) fall in by a fresh block, free your reference to the old "
                      "one and return (old, new); then append blocks until the table covers num_tokens. fork: copy "
                      "the table and share each block. free: one allocator.free per table entry.")
