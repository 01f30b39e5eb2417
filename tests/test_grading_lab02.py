"""lab02 checkers, graded both ways: minillm's own slot mapping / ref counting / block manager pass (wrapped), the
very objects and plausible wrong implementations fail. The correct classes below are the notebook's solutions."""
from collections import deque

import pytest

from minillm.grading import block_properties as props
from minillm.grading.lab02 import (BlockManagerScaffold, NoFreeBlocksError, ReferenceAllocator, check_lab02_1,
                                   check_lab02_2, check_lab02_3, slot_mapping_ref)
from minillm.kv.block_manager import BlockManager


def rejected(checker, obj, *needles, example=True):
    with pytest.raises(AssertionError) as e:
        checker(obj)
    msg = str(e.value)
    for needle in needles:
        assert needle in msg, msg
    if example:
        assert "Smallest failing example" in msg and "Hint" in msg, msg
    assert "Traceback" not in msg and len(msg.splitlines()) < 12, msg
    return msg


# ---------------------------------------------------------------- lab02_1 slot mapping

def slot_mapping(block_table, start, end, block_size):
    return [block_table[p // block_size] * block_size + p % block_size for p in range(start, end)]


def via_minillm_block_manager(block_table, start, end, block_size):
    """minillm's own BlockManager.slot_mapping, on a sequence whose table is the given one."""
    bm = BlockManager(max(block_table) + 1, block_size, enable_prefix_caching=False)
    bm.allocate_prompt(0, [1])
    bm._seqs[0].table = list(block_table)
    return bm.slot_mapping(0, start, end)


def test_lab02_1_correct_and_minillm_wrapped_pass():
    check_lab02_1(slot_mapping)
    check_lab02_1(via_minillm_block_manager)
    check_lab02_1(lambda *a: slot_mapping_ref(*a))


def test_lab02_1_rejects_the_references_themselves():
    rejected(check_lab02_1, slot_mapping_ref, "minillm's own implementation", example=False)
    rejected(check_lab02_1, BlockManager.slot_mapping, "minillm's own implementation", example=False)


SLOT_WRONG = {
    "positions_not_slots": (lambda t, s, e, b: list(range(s, e)), "positions, not slots"),
    "assumes_contiguous_blocks": (lambda t, s, e, b: [t[0] * b + p for p in range(s, e)], "not contiguous"),
    "end_inclusive": (lambda t, s, e, b: [t[p // b] * b + p % b for p in range(s, min(e + 1, len(t) * b))],
                      "end is exclusive"),
    "shifted_by_one": (lambda t, s, e, b: [t[p // b] * b + p % b for p in range(s + 1, e + 1)], "off by one"),
    "relative_positions": (lambda t, s, e, b: [t[p // b] * b + p % b for p in range(0, e - s)], "absolute"),
    "forgot_block_size": (lambda t, s, e, b: [t[p // b] + p % b for p in range(s, e)], "multiply the physical block"),
    "swapped_div_mod": (lambda t, s, e, b: [t[p % b] * b + p // b for p in range(s, e)], "other way round"),
}


@pytest.mark.parametrize("name", SLOT_WRONG)
def test_lab02_1_wrong_implementations_fail(name):
    fn, diagnosis = SLOT_WRONG[name]
    rejected(check_lab02_1, fn, diagnosis)


def test_lab02_1_blank_fails():
    def blank(block_table, start, end, block_size):
        raise NotImplementedError()
    rejected(check_lab02_1, blank, "not implemented yet")


# ---------------------------------------------------------------- lab02_2 block allocator

class BlockAllocator:
    def __init__(self, num_blocks):
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self.free_pool = deque(range(num_blocks))

    @property
    def num_free_blocks(self):
        return len(self.free_pool)

    def allocate(self):
        if not self.free_pool:
            raise NoFreeBlocksError("out of blocks")
        b = self.free_pool.popleft()
        self.ref_counts[b] = 1
        return b

    def share(self, block):
        if self.ref_counts[block] == 0:
            raise ValueError(f"block {block} is free")
        self.ref_counts[block] += 1

    def free(self, block):
        if self.ref_counts[block] == 0:
            raise ValueError(f"double free of block {block}")
        self.ref_counts[block] -= 1
        if self.ref_counts[block] == 0:
            self.free_pool.append(block)

    def ref_count(self, block):
        return self.ref_counts[block]


class MinillmRefCounts:
    """minillm's BlockManager doing the ref counting: a block = a one-token sequence; share = fork; free = free one
    of the sequences holding it."""

    def __init__(self, num_blocks):
        self.bm = BlockManager(num_blocks, 1, enable_prefix_caching=False)
        self.holders = {}
        self.next_id = 0

    @property
    def num_free_blocks(self):
        return self.bm.num_free_blocks

    def allocate(self):
        if not self.bm.num_free_blocks:
            raise NoFreeBlocksError("out of blocks")
        sid, self.next_id = self.next_id, self.next_id + 1
        self.bm.allocate_prompt(sid, [0])
        self.bm.append_slots(sid, 1)
        b = self.bm.block_table(sid)[0]
        self.holders.setdefault(b, []).append(sid)
        return b

    def share(self, block):
        if not self.holders.get(block):
            raise ValueError("free block")
        sid, self.next_id = self.next_id, self.next_id + 1
        self.bm.fork(self.holders[block][0], sid)
        self.holders[block].append(sid)

    def free(self, block):
        if not self.holders.get(block):
            raise ValueError("double free")
        self.bm.free(self.holders[block].pop())

    def ref_count(self, block):
        return self.bm.ref_count(block)


def test_lab02_2_correct_and_minillm_wrapped_pass():
    check_lab02_2(BlockAllocator)
    check_lab02_2(MinillmRefCounts)
    check_lab02_2(type("Wrapped", (ReferenceAllocator,), {}))


def test_lab02_2_rejects_the_reference_itself():
    rejected(check_lab02_2, ReferenceAllocator, "minillm's own implementation", example=False)


class FreeIgnoresRefCount(BlockAllocator):
    """free() returns the block to the pool at once, even when another table still holds it."""

    def free(self, block):
        if self.ref_counts[block] == 0:
            raise ValueError("double free")
        self.ref_counts[block] = 0
        self.free_pool.append(block)


class NeverDecrements(BlockAllocator):
    """free() only releases a block whose count is 1; a shared block's count is never decremented (a leak)."""

    def free(self, block):
        if self.ref_counts[block] == 0:
            raise ValueError("double free")
        if self.ref_counts[block] == 1:
            self.ref_counts[block] = 0
            self.free_pool.append(block)


class NoDoubleFreeCheck(BlockAllocator):
    """free() of a free block puts it in the pool a second time."""

    def free(self, block):
        self.ref_counts[block] = max(0, self.ref_counts[block] - 1)
        if self.ref_counts[block] == 0:
            self.free_pool.append(block)


class AllocatePeeks(BlockAllocator):
    """allocate() hands out the head of the pool without taking it out."""

    def allocate(self):
        if not self.free_pool:
            raise NoFreeBlocksError("out of blocks")
        b = self.free_pool[0]
        self.ref_counts[b] = 1
        return b


class ShareIsNoop(BlockAllocator):
    def share(self, block):
        if self.ref_counts[block] == 0:
            raise ValueError("free block")


class ReturnsNoneWhenEmpty(BlockAllocator):
    def allocate(self):
        return super().allocate() if self.free_pool else None


ALLOC_WRONG = {
    FreeIgnoresRefCount: "another table still holds it",
    NeverDecrements: "leaks",
    NoDoubleFreeCheck: "double free",
    AllocatePeeks: "leave the free pool",
    ShareIsNoop: "did not increment",
    ReturnsNoneWhenEmpty: "raise NoFreeBlocksError",
}


@pytest.mark.parametrize("wrong", list(ALLOC_WRONG), ids=lambda c: c.__name__)
def test_lab02_2_wrong_implementations_fail(wrong):
    rejected(check_lab02_2, wrong, ALLOC_WRONG[wrong], "Calls: a = BlockAllocator(")


def test_lab02_2_blank_and_instance_fail():
    class Blank:
        def __init__(self, num_blocks):
            raise NotImplementedError()
    rejected(check_lab02_2, Blank, "not implemented yet")
    rejected(check_lab02_2, BlockAllocator(4), "pass the class itself", example=False)


# ---------------------------------------------------------------- lab02_3 block manager

class MyBlockManager(BlockManagerScaffold):
    allocator_class = BlockAllocator
    slot_mapping_fn = staticmethod(slot_mapping)

    def num_blocks_needed(self, seq_id, num_tokens):
        if seq_id not in self.tables:
            return self._cdiv(num_tokens)
        table = self.tables[seq_id]
        new = max(0, self._cdiv(num_tokens) - len(table))
        shared = [i for i in self._written_blocks(seq_id, num_tokens) if self.allocator.ref_count(table[i]) > 1]
        return new + len(shared)

    def append_slots(self, seq_id, num_tokens):
        table = self._table(seq_id, "append_slots")
        need = self.num_blocks_needed(seq_id, num_tokens)
        if need > self.num_free_blocks:
            raise NoFreeBlocksError(f"need {need} blocks, {self.num_free_blocks} free")
        copies = []
        for i in self._written_blocks(seq_id, num_tokens):
            if self.allocator.ref_count(table[i]) > 1:
                src, dst = table[i], self.allocator.allocate()
                table[i] = dst
                self.allocator.free(src)
                copies.append((src, dst))
        while len(table) * self.block_size < num_tokens:
            table.append(self.allocator.allocate())
        return copies

    def fork(self, parent_seq_id, child_seq_id):
        table = self._table(parent_seq_id, "fork")
        if child_seq_id in self.tables:
            raise ValueError(f"seq {child_seq_id} exists")
        for b in table:
            self.allocator.share(b)
        self.tables[child_seq_id] = list(table)
        self.computed[child_seq_id] = self.computed[parent_seq_id]

    def free(self, seq_id):
        table = self.tables.pop(seq_id, None)
        if table is None:
            return
        del self.computed[seq_id]
        for b in reversed(table):
            self.allocator.free(b)


class MinillmWrapped:
    """minillm's BlockManager (no prefix caching) behind a thin wrapper: the learner's-own-class path."""

    def __init__(self, num_blocks, block_size, enable_prefix_caching=False, hash_fn=None):
        self._bm = BlockManager(num_blocks, block_size, enable_prefix_caching=False)

    def __getattr__(self, name):
        return getattr(self._bm, name)


def test_lab02_3_correct_and_minillm_wrapped_pass():
    check_lab02_3(MyBlockManager)
    check_lab02_3(MinillmWrapped)


def test_lab02_3_solution_passes_with_its_own_allocator_and_mapping():
    """What the plug-in runs: no isolation, the learner's allocator and slot mapping inside."""
    from hypothesis import given, settings
    @settings(max_examples=80, deadline=None, derandomize=True, database=None)
    @given(ops=props.operations())
    def run(ops):
        props.run_operations(MyBlockManager, ops, num_blocks=6, block_size=2)
    run()
    props.check_fork_cow(MyBlockManager)
    props.check_all_or_nothing(MyBlockManager)
    props.check_bad_input(MyBlockManager)
    props.check_prefix_caching_disabled(MyBlockManager)


def test_lab02_3_rejects_minillm_itself_and_subclasses():
    rejected(check_lab02_3, BlockManager, "minillm's own implementation", example=False)
    rejected(check_lab02_3, BlockManager(4, 2), "minillm's own implementation", example=False)
    rejected(check_lab02_3, type("Sub", (BlockManager,), {"__module__": "__main__"}), "inherits from minillm",
             example=False)
    rejected(check_lab02_3, BlockManagerScaffold, "the scaffold itself", example=False)


class NoCopyOnWrite(MyBlockManager):
    """Writes into the shared last block in place."""

    def _written_blocks(self, seq_id, num_tokens):
        return []


class CowWithoutCopyPairs(MyBlockManager):
    """Gives the sequence a fresh block but forgets to return (src, dst): the copied positions are garbage."""

    def append_slots(self, seq_id, num_tokens):
        super().append_slots(seq_id, num_tokens)
        return []


class CowKeepsOldReference(MyBlockManager):
    """Copy-on-write without dropping the reference to the old block (a leak)."""

    def append_slots(self, seq_id, num_tokens):
        table = self._table(seq_id, "append_slots")
        need = self.num_blocks_needed(seq_id, num_tokens)
        if need > self.num_free_blocks:
            raise NoFreeBlocksError("out of blocks")
        copies = []
        for i in self._written_blocks(seq_id, num_tokens):
            if self.allocator.ref_count(table[i]) > 1:
                src, dst = table[i], self.allocator.allocate()
                table[i] = dst
                copies.append((src, dst))
        while len(table) * self.block_size < num_tokens:
            table.append(self.allocator.allocate())
        return copies


class FreeReleasesShared(MyBlockManager):
    """free() drops every reference of each block at once, ignoring the other tables that hold it."""

    def free(self, seq_id):
        table = self.tables.pop(seq_id, None)
        if table is None:
            return
        del self.computed[seq_id]
        for b in table:
            while self.allocator.ref_count(b):
                self.allocator.free(b)


class FreeLeaksShared(MyBlockManager):
    """free() only releases blocks the sequence owns alone; a shared block's count is never decremented."""

    def free(self, seq_id):
        table = self.tables.pop(seq_id, None)
        if table is None:
            return
        del self.computed[seq_id]
        for b in table:
            if self.allocator.ref_count(b) == 1:
                self.allocator.free(b)


class ForkCopiesWithoutSharing(MyBlockManager):
    """fork() copies the table but does not add references: the first free returns blocks the other still uses."""

    def fork(self, parent_seq_id, child_seq_id):
        self.tables[child_seq_id] = list(self._table(parent_seq_id, "fork"))
        self.computed[child_seq_id] = self.computed[parent_seq_id]


class NeededIgnoresCow(MyBlockManager):
    """num_blocks_needed counts only new blocks, not copy-on-write copies (the scheduler would over-admit)."""

    def num_blocks_needed(self, seq_id, num_tokens):
        if seq_id not in self.tables:
            return self._cdiv(num_tokens)
        return max(0, self._cdiv(num_tokens) - len(self.tables[seq_id]))


class NotAllOrNothing(MyBlockManager):
    """Grabs blocks one by one and raises midway when the pool runs dry."""

    def append_slots(self, seq_id, num_tokens):
        table = self._table(seq_id, "append_slots")
        while len(table) * self.block_size < num_tokens:
            if not self.num_free_blocks:
                raise NoFreeBlocksError("out of blocks")
            table.append(self.allocator.allocate())
        return super().append_slots(seq_id, num_tokens)


class ForkForgetsComputed(MyBlockManager):
    """fork() leaves the child's computed count at 0: copy-on-write then thinks nothing needs copying."""

    def fork(self, parent_seq_id, child_seq_id):
        super().fork(parent_seq_id, child_seq_id)
        self.computed[child_seq_id] = 0


class CopiesEveryWrite(MyBlockManager):
    """Copies the partly filled block it writes into whether or not it is shared (a wasted copy every step)."""

    def num_blocks_needed(self, seq_id, num_tokens):
        if seq_id not in self.tables:
            return self._cdiv(num_tokens)
        return max(0, self._cdiv(num_tokens) - len(self.tables[seq_id])) + len(self._written_blocks(seq_id, num_tokens))

    def append_slots(self, seq_id, num_tokens):
        table = self._table(seq_id, "append_slots")
        if self.num_blocks_needed(seq_id, num_tokens) > self.num_free_blocks:
            raise NoFreeBlocksError("out of blocks")
        copies = []
        for i in self._written_blocks(seq_id, num_tokens):
            src, dst = table[i], self.allocator.allocate()
            table[i] = dst
            self.allocator.free(src)
            copies.append((src, dst))
        while len(table) * self.block_size < num_tokens:
            table.append(self.allocator.allocate())
        return copies


MANAGER_WRONG = {
    NoCopyOnWrite: "no copy-on-write",
    CowWithoutCopyPairs: "return [(",
    CowKeepsOldReference: "drop its reference",
    FreeReleasesShared: "which the parent still uses",
    FreeLeaksShared: "blocks leak)",
    ForkCopiesWithoutSharing: "add one reference",
    NeededIgnoresCow: "num_blocks_needed must count copy-on-write",
    NotAllOrNothing: "all or nothing",
    ForkForgetsComputed: "computed-token count",
    CopiesEveryWrite: "no longer shared",
}


@pytest.mark.parametrize("wrong", list(MANAGER_WRONG), ids=lambda c: c.__name__)
def test_lab02_3_wrong_implementations_fail(wrong):
    rejected(check_lab02_3, wrong, MANAGER_WRONG[wrong], "Calls (block_size")


def test_lab02_3_blank_fails_and_unset_hooks_are_explained():
    class Blank(BlockManagerScaffold):
        allocator_class = BlockAllocator
        slot_mapping_fn = staticmethod(slot_mapping)
    rejected(check_lab02_3, Blank, "not implemented yet")

    class NoHooks(MyBlockManager):
        allocator_class = None
    with pytest.raises(TypeError, match="allocator_class = BlockAllocator"):
        NoHooks(4, 2)


def test_lab02_3_isolated_from_a_broken_allocator_and_mapping():
    """Task 3 is graded with the grader's allocator and slot mapping: broken tasks 1-2 don't fail it."""
    class OnBrokenParts(MyBlockManager):
        allocator_class = FreeIgnoresRefCount
        slot_mapping_fn = staticmethod(SLOT_WRONG["swapped_div_mod"][0])
    check_lab02_3(OnBrokenParts)
    with pytest.raises(Exception):
        props.check_fork_cow(OnBrokenParts)
