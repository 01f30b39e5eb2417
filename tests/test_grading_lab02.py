"""lab02 checkers, graded both ways: minillm's own slot mapping, allocator and block manager pass the property
suites (TASKS[...].verify); handed in as answers (as they are, wrapped, subclassed) they are refused, and plausible
wrong implementations fail with their diagnosis. The correct classes below are written like the notebook's."""
from collections import deque

import pytest
from hypothesis import given, settings

import block_properties as props
from minillm.grading.lab02 import TASKS, NoFreeBlocksError, check_lab02_1, check_lab02_2, check_lab02_3, slot_table
from minillm.kv.block_allocator import BlockAllocator as MinillmAllocator
from minillm.kv.block_manager import BlockManager, slot_mapping as minillm_slot_mapping
from minillm.testing import operations, run_operations
import grading_helpers


def rejected(checker, obj, *needles, example=True):     # lab02's refusals carry an example unless told
    return grading_helpers.rejected(checker, obj, *needles, example=example)


# ---------------------------------------------------------------- lab02_1 slot mapping

def slot_mapping(block_table, start, end, block_size):
    return [block_table[p // block_size] * block_size + p % block_size for p in range(start, end)]


def test_lab02_1_minillm_passes_and_learner_code_passes():
    TASKS["lab02_1"].verify(minillm_slot_mapping)
    check_lab02_1(slot_mapping)


def test_lab02_1_rejects_minillm_and_the_oracle():
    rejected(check_lab02_1, minillm_slot_mapping, "minillm's own answer", example=False)
    rejected(check_lab02_1, BlockManager.slot_mapping, "minillm's own answer", example=False)
    rejected(check_lab02_1, lambda *a: minillm_slot_mapping(*a), "runs minillm's own implementation", example=False)
    rejected(check_lab02_1, lambda t, s, e, b: [slot_table(t, b)[p] for p in range(s, e)],
             "grader's reference answer", example=False)


def test_lab02_1_large_block_ids_catch_a_byte_sized_table():
    def bytes_table(block_table, start, end, block_size):
        table = bytearray(b % 256 for b in block_table)        # a byte per block id
        return [table[p // block_size] * block_size + p % block_size for p in range(start, end)]
    rejected(check_lab02_1, bytes_table, "expected")


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
    rejected(check_lab02_1, blank, "not implemented yet", example=False)


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


@pytest.mark.slow      # seconds: the checker's full run on correct code; the wrong answers stay fast
def test_lab02_2_minillm_passes_and_learner_code_passes():
    TASKS["lab02_2"].verify(MinillmAllocator)
    check_lab02_2(BlockAllocator)


def test_lab02_2_rejects_minillm_and_wrappers():
    rejected(check_lab02_2, MinillmAllocator, "minillm's own answer", example=False)
    rejected(check_lab02_2, type("Sub", (MinillmAllocator,), {"__module__": "__main__"}), "runs minillm's own",
             example=False)


class FixedCapacity(BlockAllocator):
    """A free list in a fixed-size array of 256 entries (a common embedded-systems habit)."""

    def __init__(self, num_blocks):
        super().__init__(num_blocks)
        self.free_pool = deque(range(min(num_blocks, 256)))


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
    FixedCapacity: "num_free_blocks",
    FreeIgnoresRefCount: "another table still holds it",
    NeverDecrements: "leaks",
    NoDoubleFreeCheck: "double free",
    AllocatePeeks: "leave the free pool",
    ShareIsNoop: "did not increment",
    ReturnsNoneWhenEmpty: "raise NoFreeBlocksError",
}


@pytest.mark.parametrize("wrong", list(ALLOC_WRONG), ids=lambda c: c.__name__)
def test_lab02_2_wrong_implementations_fail(wrong):
    rejected(check_lab02_2, wrong, ALLOC_WRONG[wrong], "Smallest failing example: a = BlockAllocator(")


def test_lab02_2_blank_and_instance_fail():
    class Blank:                        # the released starter: every method body is `raise NotImplementedError()`
        def __init__(self, num_blocks):
            raise NotImplementedError()

        def allocate(self):
            raise NotImplementedError()

        share = free = ref_count = allocate
    rejected(check_lab02_2, Blank, "not implemented yet", example=False)
    rejected(check_lab02_2, type("NoShare", (), {"__module__": "__main__", "allocate": lambda self: 0}), "lacks",
             example=False)


# ---------------------------------------------------------------- lab02_3 block manager

class MyBlockManager(BlockManager):
    allocator_cls = BlockAllocator
    slot_mapping_fn = slot_mapping

    def num_blocks_needed(self, seq_id, num_tokens):
        if seq_id not in self.tables:
            return self.cdiv(num_tokens)
        table = self.tables[seq_id]
        new = max(0, self.cdiv(num_tokens) - len(table))
        shared = [i for i in self.written_blocks(seq_id, num_tokens) if self.allocator.ref_count(table[i]) > 1]
        return new + len(shared)

    def append_slots(self, seq_id, num_tokens):
        table = self.table(seq_id, "append_slots")
        need = self.num_blocks_needed(seq_id, num_tokens)
        if need > self.num_free_blocks:
            raise NoFreeBlocksError(f"need {need} blocks, {self.num_free_blocks} free")
        copies = []
        for i in self.written_blocks(seq_id, num_tokens):
            if self.allocator.ref_count(table[i]) > 1:
                src, dst = table[i], self.allocator.allocate()
                table[i] = dst
                self.allocator.free(src)
                copies.append((src, dst))
        while len(table) * self.block_size < num_tokens:
            table.append(self.allocator.allocate())
        return copies

    def fork(self, parent_seq_id, child_seq_id):
        table = self.table(parent_seq_id, "fork")
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


class ReadsRefCountsDirectly(MyBlockManager):
    """Correct, and reads its own allocator's `ref_counts` list instead of calling ref_count()."""

    def num_blocks_needed(self, seq_id, num_tokens):
        if seq_id not in self.tables:
            return self.cdiv(num_tokens)
        table = self.tables[seq_id]
        shared = sum(self.allocator.ref_counts[table[i]] > 1 for i in self.written_blocks(seq_id, num_tokens))
        return max(0, self.cdiv(num_tokens) - len(table)) + shared


@pytest.mark.slow      # seconds: the checker's full run on correct code; the wrong answers stay fast
def test_lab02_3_minillm_passes_and_learner_code_passes():
    TASKS["lab02_3"].verify(BlockManager)
    check_lab02_3(MyBlockManager)
    check_lab02_3(ReadsRefCountsDirectly)      # a correct allocator is graded as is: its attributes are there


def test_lab02_3_solution_passes_with_its_own_allocator_and_mapping():
    """What the plug-in runs: the learner's allocator and slot mapping inside."""
    @settings(max_examples=80, deadline=None, derandomize=True, database=None)
    @given(ops=operations())
    def run(ops):
        run_operations(MyBlockManager, ops, num_blocks=6, block_size=2, enable_prefix_caching=False)
    run()
    kw = {"enable_prefix_caching": False}
    for check in (props.check_fork_cow, props.check_all_or_nothing):
        check(type("NoCache", (MyBlockManager,), {"__init__": lambda self, n, b, **k: MyBlockManager.__init__(
            self, n, b, **kw)}))


def test_lab02_3_rejects_minillm_itself_and_delegation():
    rejected(check_lab02_3, BlockManager, "minillm's own code", example=False)
    rejected(check_lab02_3, type("Sub", (BlockManager,), {"__module__": "__main__"}), "does not define",
             example=False)
    calls_super = type("CallsSuper", (MyBlockManager,), {
        "__module__": "__main__", "free": lambda self, seq_id: BlockManager.free(self, seq_id)})
    rejected(check_lab02_3, calls_super, "runs minillm's own implementation", example=False)


class NoCopyOnWrite(MyBlockManager):
    """Writes into the shared last block in place."""

    def written_blocks(self, seq_id, num_tokens, num_computed_tokens=None):
        return []


class CowWithoutCopyPairs(MyBlockManager):
    """Gives the sequence a fresh block but forgets to return (src, dst): the copied positions are garbage."""

    def append_slots(self, seq_id, num_tokens):
        super().append_slots(seq_id, num_tokens)
        return []


class CowKeepsOldReference(MyBlockManager):
    """Copy-on-write without dropping the reference to the old block (a leak)."""

    def append_slots(self, seq_id, num_tokens):
        table = self.table(seq_id, "append_slots")
        need = self.num_blocks_needed(seq_id, num_tokens)
        if need > self.num_free_blocks:
            raise NoFreeBlocksError("out of blocks")
        copies = []
        for i in self.written_blocks(seq_id, num_tokens):
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
        self.tables[child_seq_id] = list(self.table(parent_seq_id, "fork"))
        self.computed[child_seq_id] = self.computed[parent_seq_id]


class NeededIgnoresCow(MyBlockManager):
    """num_blocks_needed counts only new blocks, not copy-on-write copies (the scheduler would over-admit)."""

    def num_blocks_needed(self, seq_id, num_tokens):
        if seq_id not in self.tables:
            return self.cdiv(num_tokens)
        return max(0, self.cdiv(num_tokens) - len(self.tables[seq_id]))


class NotAllOrNothing(MyBlockManager):
    """Grabs blocks one by one and raises midway when the pool runs dry."""

    def append_slots(self, seq_id, num_tokens):
        table = self.table(seq_id, "append_slots")
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
            return self.cdiv(num_tokens)
        return max(0, self.cdiv(num_tokens) - len(self.tables[seq_id])) + len(self.written_blocks(seq_id, num_tokens))

    def append_slots(self, seq_id, num_tokens):
        table = self.table(seq_id, "append_slots")
        if self.num_blocks_needed(seq_id, num_tokens) > self.num_free_blocks:
            raise NoFreeBlocksError("out of blocks")
        copies = []
        for i in self.written_blocks(seq_id, num_tokens):
            src, dst = table[i], self.allocator.allocate()
            table[i] = dst
            self.allocator.free(src)
            copies.append((src, dst))
        while len(table) * self.block_size < num_tokens:
            table.append(self.allocator.allocate())
        return copies


class NeededZeroForUnknown(MyBlockManager):
    """A sequence it does not hold needs nothing (the statement: ceil(num_tokens / block_size))."""

    def num_blocks_needed(self, seq_id, num_tokens):
        if seq_id not in self.tables:
            return 0
        return MyBlockManager.num_blocks_needed(self, seq_id, num_tokens)


class NeededFloorsForUnknown(MyBlockManager):
    """Rounds down for a sequence it does not hold."""

    def num_blocks_needed(self, seq_id, num_tokens):
        if seq_id not in self.tables:
            return num_tokens // self.block_size
        return MyBlockManager.num_blocks_needed(self, seq_id, num_tokens)


class NeededRaisesForUnknown(MyBlockManager):
    """Looks the table up with self.table(), which raises KeyError for a sequence not admitted yet."""

    def num_blocks_needed(self, seq_id, num_tokens):
        table = self.table(seq_id, "num_blocks_needed")
        new = max(0, self.cdiv(num_tokens) - len(table))
        shared = [i for i in self.written_blocks(seq_id, num_tokens) if self.allocator.ref_count(table[i]) > 1]
        return new + len(shared)


class FreeRaisesForUnknown(MyBlockManager):
    """free() of a sequence it does not hold raises KeyError (the statement: a no-op)."""

    def free(self, seq_id):
        table = self.tables.pop(seq_id)
        del self.computed[seq_id]
        for b in reversed(table):
            self.allocator.free(b)


MANAGER_WRONG = {
    NeededZeroForUnknown: "a sequence the manager does not hold has no blocks yet",
    NeededFloorsForUnknown: "expected ⌈9 / 4⌉ = 3",
    NeededRaisesForUnknown: "raised KeyError for a seq_id never admitted",
    FreeRaisesForUnknown: "raised KeyError",
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
    rejected(check_lab02_3, wrong, MANAGER_WRONG[wrong], "Smallest failing example: a BlockManager(")


def test_lab02_3_blank_fails():
    def blank(self, *args):
        raise NotImplementedError()
    Blank = type("Blank", (BlockManager,), {"__module__": "__main__", "allocator_cls": BlockAllocator,
                                            **{m: blank for m in ("num_blocks_needed", "append_slots", "fork", "free")}})
    rejected(check_lab02_3, Blank, "not implemented yet", example=False)


def test_lab02_3_isolated_from_a_broken_allocator_and_mapping():
    """Task 3 is graded with minillm's allocator and slot mapping when the learner's fail their own tasks."""
    class OnBrokenParts(MyBlockManager):
        allocator_cls = FreeIgnoresRefCount
        slot_mapping_fn = SLOT_WRONG["swapped_div_mod"][0]
    check_lab02_3(OnBrokenParts)
    with pytest.raises(Exception):
        props.check_fork_cow(OnBrokenParts)
