"""Checkers for lab02 — the paged KV cache.

Tasks (the notebook documents the same signatures; minillm's own versions in brackets):
  lab02_1  slot_mapping(block_table, start, end, block_size) -> list[int]: the flat KV slot of each position
           p in [start, end).                                                    [kv.block_manager.slot_mapping]
  lab02_2  BlockAllocator(num_blocks): allocate() -> block id (ref count 1; NoFreeBlocksError when none is free),
           share(block), free(block) (back to the pool at 0; ValueError for a free block), ref_count(block),
           num_free_blocks (property).                                         [kv.block_allocator.BlockAllocator]
  lab02_3  the paging core of a block manager: a subclass of minillm's BlockManager that writes
           num_blocks_needed, append_slots (with copy-on-write), fork and free itself, on `tables`, `computed`
           and `allocator` (its class attributes allocator_cls / slot_mapping_fn name the learner's pieces from
           tasks 1 and 2). It plugs into LLMEngine with prefix caching off.          [kv.block_manager.BlockManager]

Oracles: a position -> slot table built block by block (lab02_1); a model of every block's ref count driven next
to the allocator (lab02_2); random engine-like operation sequences through minillm.testing's driver, whose
simulated KV pool records what every write stored and catches every lost or foreign write (lab02_3); tests/ run the
same driver on minillm's own BlockManager.
"""
from __future__ import annotations

from collections import Counter
from typing import Any, Callable, Sequence

from hypothesis import example, given, strategies as st

from minillm.grading.core import GradingError, Hint, Task, as_int, as_ints, diagnose, fail, minillm_objects, \
    run_property
from minillm.kv.block_allocator import BlockAllocator, NoFreeBlocksError
from minillm.kv.block_manager import BlockManager, slot_mapping as engine_slot_mapping
from minillm.testing import operations, run_operations

__all__ = ["check_lab02_1", "check_lab02_2", "check_lab02_3", "TASKS", "NoFreeBlocksError"]


# --------------------------------------------------------------------------- lab02_1 slot mapping

def slot_table(block_table: Sequence[int], block_size: int) -> dict[int, int]:
    """Every position the table covers -> its slot, built block by block (the oracle)."""
    slots = {}
    for i, block in enumerate(block_table):
        for offset in range(block_size):
            slots[i * block_size + offset] = block * block_size + offset
    return slots


def _range_variant(lo: Callable[[int, int], int], hi: Callable[[int, int], int]) -> Callable[..., list[int]]:
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


def _ints_or_none(out: Any) -> list[int] | None:
    try:
        return as_ints(out, "slot_mapping's result")
    except GradingError:
        return None


@st.composite
def _mapping_cases(draw: st.DrawFn) -> tuple[list[int], int, int, int]:
    block_size = draw(st.sampled_from([1, 2, 3, 4, 8, 16]))
    # physical ids up to 2000: a byte-sized or fixed-capacity structure shows
    table = draw(st.lists(st.integers(0, draw(st.sampled_from([63, 2000]))), min_size=1, max_size=40, unique=True))
    cap = len(table) * block_size
    start = draw(st.integers(0, cap))
    return table, start, draw(st.integers(start, cap)), block_size


def verify_lab02_1(slot_mapping: Callable[..., Any]) -> None:
    @given(case=_mapping_cases())
    @example(case=([3, 0, 7], 0, 12, 4))      # a whole 3-block sequence
    @example(case=([3, 0, 7], 5, 6, 4))       # one decode position in the middle block
    @example(case=([6, 1, 4], 1, 7, 3))       # a prefill chunk crossing block boundaries
    @example(case=([9, 4], 2, 2, 4))          # nothing to compute
    @example(case=([5, 2, 8], 0, 3, 1))       # block_size 1
    @example(case=([300, 257, 1999], 3, 40, 16))   # block ids above 256
    def prop(case: tuple[list[int], int, int, int]) -> None:
        table, start, end, bs = case
        call = f"slot_mapping({table}, start={start}, end={end}, block_size={bs})"
        try:
            out = slot_mapping(list(table), start, end, bs)
        except NotImplementedError:
            raise
        except Exception as e:  # noqa: BLE001 — say which call broke, and why if it is a known mistake
            why = diagnose(slot_mapping, _SLOT_MISTAKES, _SLOT_PROBES, lambda a, b: _ints_or_none(a) == b)
            first = (str(e).strip().splitlines() or [""])[0]
            fail(f"{call} raised {type(e).__name__}: {first}" + (f" — {why}" if why else ""))
        got = as_ints(out, f"{call}'s result")
        slots = slot_table(table, bs)
        ref = [slots[p] for p in range(start, end)]
        if got == ref:
            return
        why = diagnose(slot_mapping, _SLOT_MISTAKES, [(list(table), start, end, bs)] + _SLOT_PROBES,
                       lambda a, b: _ints_or_none(a) == b)
        shown = got if len(got) <= 16 else got[:16] + ["…"]
        fail(f"{call} returned {shown}, expected {ref[:16]}{'…' if len(ref) > 16 else ''}"
             + (f" — {why}" if why else ""))

    run_property(prop, max_examples=80, hint=Hint(
        "paging: a position lives in a logical block of its sequence, and the block table says which physical "
        "block of the pool that is.",
        "the logical block of position p is p // block_size and its offset p % block_size; physical block k holds "
        "slots k·block_size … k·block_size + block_size − 1; positions run from start to end − 1.",
        "for p in range(start, end): slot = block_table[p // block_size] * block_size + p % block_size."))


# --------------------------------------------------------------------------- lab02_2 block allocator

_ALLOC_OPS = st.lists(st.one_of(st.tuples(st.just("allocate")),
                                st.tuples(st.just("share"), st.integers(0, 7)),
                                st.tuples(st.just("free"), st.integers(0, 7))), max_size=24)


def _allocator_run(cls, num_blocks: int, ops: Sequence[tuple[Any, ...]]) -> None:
    """Drive an allocator class through `ops` next to a model of the ref counts; assert on the first
    disagreement. ("share", k) / ("free", k) act on the k-th block handed out (k modulo their number)."""
    calls: list[str] = []

    def bad(msg: str) -> None:
        shown = calls if len(calls) <= 30 else calls[:12] + [f"... {len(calls) - 24} more ..."] + calls[-12:]
        fail(msg, example="; ".join(shown) if shown else "(no calls)")       # the calls made, as made

    calls.append(f"a = BlockAllocator({num_blocks})")
    a = cls(num_blocks)
    model = [0] * num_blocks
    handed: list[int] = []

    def compare(after: str) -> None:
        free = as_int(a.num_free_blocks, "num_free_blocks")
        want = model.count(0)
        many = getattr(a.ref_count, "map_calls", None)      # an allocator in a grading sandbox: one request for all
        counts = many(range(num_blocks)) if many is not None else [a.ref_count(b) for b in range(num_blocks)]
        refs = {b: as_int(c, f"ref_count({b})") for b, c in enumerate(counts)}
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
            before_free = as_int(a.num_free_blocks, "num_free_blocks")
            b = as_int(a.allocate(), "allocate()'s block id")
            calls[-1] += f" -> {b!r}"
            if not 0 <= b < num_blocks:
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
        before_free, before_ref = as_int(a.num_free_blocks, "num_free_blocks"), as_int(a.ref_count(b), "ref_count")
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
        after_free, after_ref = as_int(a.num_free_blocks, "num_free_blocks"), as_int(a.ref_count(b), "ref_count")
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
    got = [as_int(a.allocate(), "allocate()'s block id") for _ in range(num_blocks)]
    calls.append(f"allocate() × {num_blocks} -> {got}")
    if sorted(got) != list(range(num_blocks)):
        dup = sorted(b for b, c in Counter(got).items() if c > 1)
        bad(f"with every block free, {num_blocks} allocate() calls must hand out each block once; got {got}"
            + (f" (block(s) {dup} twice: the pool holds duplicates)" if dup else ""))


def verify_lab02_2(allocator_cls: type) -> None:
    @given(num_blocks=st.integers(1, 6) | st.sampled_from([257, 300, 600]), ops=_ALLOC_OPS)
    @example(num_blocks=3, ops=[("allocate",), ("share", 0), ("free", 0)])               # free of a shared block
    @example(num_blocks=3, ops=[("allocate",), ("share", 0), ("free", 0), ("free", 0)])  # ... and of its last user
    @example(num_blocks=2, ops=[("allocate",), ("free", 0), ("free", 0)])                # double free
    @example(num_blocks=2, ops=[("allocate",), ("allocate",), ("allocate",)])            # pool exhausted
    @example(num_blocks=2, ops=[("allocate",), ("free", 0), ("allocate",), ("allocate",)])  # reuse after free
    @example(num_blocks=300, ops=[("allocate",)] * 3 + [("share", 2), ("free", 1)])      # ids above 256
    def prop(num_blocks: int, ops: list[tuple[Any, ...]]) -> None:
        _allocator_run(allocator_cls, num_blocks, ops)

    run_property(prop, max_examples=120, hint=Hint(
        "an allocator is a free pool plus a reference count per block: follow the count of the block each call "
        "touches.",
        "allocate hands out a free block with count 1 (NoFreeBlocksError when none is free); share adds a reference; "
        "free drops one and returns the block to the pool only at 0; share or free of a free block is a ValueError.",
        "keep a free pool (e.g. a deque of block ids) and a ref_count per block: allocate pops a block and sets its "
        "count to 1; share adds 1; free subtracts 1 and puts the block back only at 0; raise ValueError for "
        "share/free of a free block, NoFreeBlocksError when the pool is empty."))


# --------------------------------------------------------------------------- lab02_3 the paging core

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




def _pieces_of(cls):
    """The learner's allocator and slot mapping when they pass their own tasks; else minillm's, so task 3 is graded
    on its own. Returns (class to drive, note for messages)."""
    swap, notes = {}, []
    for attr, verify, engine, task in (("allocator_cls", verify_lab02_2, BlockAllocator, "2"),
                                       ("slot_mapping_fn", verify_lab02_1, engine_slot_mapping, "1")):
        mine = getattr(cls, attr)              # through the class: a plain function stays unbound
        if mine is engine:
            continue
        try:
            verify(mine)
        except GradingError:
            swap[attr] = engine if attr == "allocator_cls" else staticmethod(engine)
            notes.append(f"your task-{task} {'allocator' if task == '2' else 'slot mapping'} does not pass yet, "
                         "so minillm's ran in its place")
    if not swap:
        return cls, ""
    return type(cls.__name__, (cls,), {**swap, "__module__": cls.__module__}), " (" + "; ".join(notes) + ")"


_UNKNOWN_HINT = ("for an unknown seq_id (not admitted yet, or freed) num_blocks_needed is ⌈num_tokens / block_size⌉ "
                 "(self.cdiv): the scheduler asks it before a sequence has a table — don't return 0, and don't raise.")


def _unknown_seqs(cls: type, note: str) -> None:
    """The statement's contract for a seq_id the manager does not hold (never admitted, or freed): num_blocks_needed
    is ceil(num_tokens / block_size) (what admitting it would take), free is a no-op. The operation driver only
    touches sequences it holds, so this is checked on its own."""
    __tracebackhide__ = True
    calls: list[str] = []

    def bad(msg: str, hint: str) -> None:
        fail(msg + note, hint, example="a BlockManager(300 blocks, block_size 4), then: " + "; ".join(calls))

    def needed(bm: Any, sid: int, n: int, why: str) -> None:
        try:
            got = bm.num_blocks_needed(sid, n)
        except NotImplementedError:
            raise
        except Exception as e:  # noqa: BLE001 — the statement gives an answer for an unknown seq_id
            calls.append(f"num_blocks_needed({sid}, {n}) -> {type(e).__name__}")
            bad(f"num_blocks_needed({sid}, {n}) raised {type(e).__name__} for {why}: the statement gives the answer "
                f"for a seq_id the manager does not hold — ⌈num_tokens / block_size⌉", _UNKNOWN_HINT)
        calls.append(f"num_blocks_needed({sid}, {n}) -> {got!r}")
        got = as_int(got, f"num_blocks_needed({sid}, {n})")
        want = -(-n // bm.block_size)
        if got != want:
            bad(f"num_blocks_needed({sid}, {n}) = {got} for {why}, expected ⌈{n} / {bm.block_size}⌉ = {want}: a "
                "sequence the manager does not hold has no blocks yet, so it needs one block per block_size tokens",
                _UNKNOWN_HINT)

    bm = cls(300, 4, enable_prefix_caching=False)
    needed(bm, 777, 9, "a seq_id never admitted")
    needed(bm, 5, 1, "a seq_id never admitted")
    needed(bm, 300, 1000, "a seq_id never admitted")
    calls.append("allocate_prompt(0, [1, 2, 3, 4, 5])")
    bm.allocate_prompt(0, [1, 2, 3, 4, 5])
    calls.append("append_slots(0, 5)")
    bm.append_slots(0, 5)
    needed(bm, 1, 6, "a seq_id never admitted (while seq 0 holds 2 blocks)")
    for what in ("a seq_id never admitted",):
        before = as_int(bm.num_free_blocks, "num_free_blocks")
        calls.append("free(42)")
        try:
            bm.free(42)
        except Exception as e:  # noqa: BLE001 — the statement says no-op
            bad(f"free(42) of {what} raised {type(e).__name__}: {e}",
                "free of an unknown (or already freed) seq_id is a no-op: return without changing anything.")
        if bm.num_free_blocks != before or not bm.has_seq(0) or len(bm.block_table(0)) != 2:
            bad(f"free(42) of {what} changed the manager (num_free_blocks {before} -> {bm.num_free_blocks}, seq 0's "
                f"table {bm.block_table(0) if bm.has_seq(0) else 'gone'})",
                "free of an unknown (or already freed) seq_id is a no-op: return without changing anything.")
    calls.append("free(0)")
    bm.free(0)
    needed(bm, 0, 9, "a seq_id just freed")
    calls.append("free(0)")
    try:
        bm.free(0)
    except Exception as e:  # noqa: BLE001
        bad(f"free(0) of a seq_id already freed raised {type(e).__name__}: {e}",
            "free of an unknown (or already freed) seq_id is a no-op: return without changing anything.")
    if bm.num_free_blocks != 300:
        bad(f"free(0) of a seq_id already freed changed num_free_blocks to {bm.num_free_blocks} (all 300 were "
            "free): it must do nothing", "free of an unknown (or already freed) seq_id is a no-op.")


def verify_lab02_3(block_manager_cls: type) -> None:
    cls, note = _pieces_of(block_manager_cls)

    @given(num_blocks=st.integers(2, 10) | st.just(300), block_size=st.sampled_from([1, 2, 4]), ops=operations())
    # n = 2 sampling: fork after the prompt, both children decode (copy-on-write of the shared last block)
    @example(num_blocks=8, block_size=4, ops=[("admit", [1, 2, 3, 4, 5]), ("decode", 0, 0), ("fork", 0),
                                              ("decode", 1, 1), ("decode", 0, 2), ("free", 0), ("decode", 1, 2)])
    # a finished sequence's shared blocks must survive for its sibling; then everything is reused
    @example(num_blocks=4, block_size=2, ops=[("admit", [1, 2, 0]), ("prefill", 0, 3), ("fork", 0), ("free", 0),
                                              ("admit", [2, 2, 2, 2, 2]), ("prefill", 2, 5), ("decode", 1, 1)])
    # the pool runs dry: all or nothing
    @example(num_blocks=3, block_size=2, ops=[("admit", [0, 1, 2, 0, 1]), ("prefill", 0, 5), ("fork", 0),
                                              ("decode", 1, 0), ("free", 0), ("decode", 1, 0)])
    # a big pool: block ids above 256
    @example(num_blocks=300, block_size=1, ops=[("admit", [1] * 7), ("prefill", 0, 6), ("fork", 0),
                                                ("decode", 1, 2), ("free", 0), ("decode", 1, 0)])
    def prop(num_blocks: int, block_size: int, ops: list[tuple[Any, ...]]) -> None:
        try:
            run_operations(cls, ops, num_blocks=num_blocks, block_size=block_size, enable_prefix_caching=False)
        except GradingError as e:
            what, _, calls = e.message.partition(" | Calls: ")
            why = _diagnose_manager(cls)
            fail(what + (f" — {why}" if why else "") + note,
                 example=f"a BlockManager({num_blocks} blocks, block_size {block_size}), then: {calls}" if calls
                 else None)

    run_property(prop, max_examples=150, hint=Hint(
        "copy-on-write paging: a block that two tables share (ref_count > 1) must not be written in place, and a "
        "step either gets all the blocks it needs or changes nothing.",
        "num_blocks_needed counts the new blocks plus the private copies the next write needs; append_slots checks "
        "that against num_free_blocks before touching anything, copies the shared blocks about to be written "
        "(returning (old, new) pairs) and appends blocks; fork shares every block of the parent; free drops one "
        "reference per table entry.",
        "append_slots: first count what is needed (num_blocks_needed) and raise NoFreeBlocksError if it is more "
        "than num_free_blocks; replace every shared block (ref_count > 1) that the new positions [computed, "
        "num_tokens) fall in by a fresh block, free your reference to the old one and return (old, new); then "
        "append blocks until the table covers num_tokens. fork: copy the table and share each block. free: one "
        "allocator.free per table entry."))
    _unknown_seqs(cls, note)


# --------------------------------------------------------------------------- the tasks

_CORE = ("num_blocks_needed", "append_slots", "fork", "free")
TASKS = {t.id: t for t in (
    Task("lab02_1", what="slot_mapping", verify=verify_lab02_1,
         engine=minillm_objects("minillm.kv.block_manager:slot_mapping", "minillm.kv.block_manager:BlockManager.slot_mapping"),
         oracles=lambda: [slot_table]),
    Task("lab02_2", what="BlockAllocator", verify=verify_lab02_2, kind="class",
         methods=("allocate", "share", "free", "ref_count"),
         engine=minillm_objects("minillm.kv.block_allocator:BlockAllocator")),
    Task("lab02_3", what="block manager", verify=verify_lab02_3, kind="methods", base=BlockManager, methods=_CORE,
         engine=minillm_objects(*(f"minillm.kv.block_manager:BlockManager.{m}" for m in _CORE + ("_cow_and_new",)))),
)}


check_lab02_1 = TASKS["lab02_1"].checker(
    'slot_mapping(block_table, start, end, block_size) -> [slot of position p for p in range(start, end)].')
check_lab02_2 = TASKS["lab02_2"].checker(
    'BlockAllocator(num_blocks) with allocate / share / free / ref_count / num_free_blocks and ref counts.')
check_lab02_3 = TASKS["lab02_3"].checker(
    'A BlockManager subclass with its own num_blocks_needed / append_slots (copy-on-write) / fork / free.')
