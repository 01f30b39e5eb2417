"""Tests for minillm.kv.block_manager: the reusable property checks (minillm/grading/block_properties.py)
against the real BlockManager, unit tests of the API details, and proof that the checks catch
plausible wrong implementations."""
from __future__ import annotations

import pytest

import block_properties as props  # one suite: tests and the lab02/lab05 graders
from minillm.kv.block_manager import BlockManager, NoFreeBlocksError
from minillm.kv.prefix_cache import LRUEvictor, PrefixCacheStats, default_hash_fn


# --------------------------------------------------------------------------- the real implementation
@pytest.mark.parametrize("check", props.DIRECTED_CHECKS, ids=lambda c: c.__name__)
def test_directed_property(check):
    check(BlockManager)


def test_random_ops():
    props.check_random_ops(BlockManager, max_examples=50)


def test_random_ops_colliding_hash():
    # A hash with only 3 values: most "hits" are collisions, which must all be detected.
    props.check_random_ops(BlockManager, max_examples=30, hash_fn=lambda parent, tokens: sum(tokens) % 3)


def test_random_ops_with_rollback():
    props.check_random_ops(BlockManager, max_examples=30, rollback=True, hash_fn=lambda parent, tokens: sum(tokens) % 3)


def test_random_ops_no_prefix_caching_bigger_blocks():
    props.check_random_ops(BlockManager, max_examples=15, block_size=3, num_blocks=6, vocab=3,
                           enable_prefix_caching=False)


# --------------------------------------------------------------------------- API details
def test_default_hash_is_deterministic_and_chained():
    a = default_hash_fn(None, (1, 2, 3))
    assert a == default_hash_fn(None, (1, 2, 3))
    assert 0 <= a < 2 ** 128
    assert default_hash_fn(a, (1, 2, 3)) != a                 # parent matters
    assert default_hash_fn(None, (1, 2)) != default_hash_fn(None, (1, 2, 0))
    assert default_hash_fn(None, (-1,)) != default_hash_fn(None, (-2,))   # unlike hash(-1) == hash(-2)
    assert default_hash_fn(None, (2 ** 70,)) != default_hash_fn(None, (2 ** 70 + 1,))  # > int64 fallback


def test_default_hash_stable_across_processes():
    import subprocess
    import sys
    code = "from minillm.kv.prefix_cache import default_hash_fn as h; print(h(h(None, (5, 6)), (7, 8)))"
    outs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env={"PYTHONHASHSEED": seed}).stdout for seed in ("1", "2")}
    assert outs == {f"{default_hash_fn(default_hash_fn(None, (5, 6)), (7, 8))}\n"}


def test_parentless_hash_would_give_a_wrong_hit():
    """Why hashes are chained: the naive key hash(block tokens) maps [Y] at position 0 onto the block that
    holds Y *after X* -- a wrong hit. With the chained key it is a miss."""
    X, Y = (1, 2, 3, 4), (5, 6, 7, 8)
    h_x = default_hash_fn(None, X)
    assert default_hash_fn(None, Y) != default_hash_fn(h_x, Y)         # chained: different keys
    # The real manager with a hash_fn that ignores the parent: the stored (parent, tokens) check still
    # refuses the hit and counts a collision.
    bm = BlockManager(8, 4, hash_fn=lambda parent, tokens: default_hash_fn(None, tokens))
    bm.allocate_prompt(1, [*X, *Y, 0])
    bm.append_slots(1, 9)
    bm.commit_computed(1, [*X, *Y, 0], 9)
    assert bm.allocate_prompt(2, [*Y, 0]) == 0
    assert bm.stats.collisions == 1
    # The naive implementation (key without parent, tokens-only check) hits, and reads wrong KV.
    with pytest.raises(AssertionError, match="wrong prefix-cache hit|parent"):
        props.check_hash_chaining(WrongNoParentHash)


def test_identical_prompts_computed_concurrently_keep_the_chain():
    """F and S compute the same prefix before either commits: S's duplicate blocks aren't registered, but
    S's later, different block is chained to F's equal cached blocks, so it is still found."""
    bm = BlockManager(16, 2)
    p = [1, 2, 3, 4, 5]
    for sid in (0, 1):
        assert bm.allocate_prompt(sid, p) == 0
        bm.append_slots(sid, 5)
    bm.commit_computed(0, p, 5)
    bm.commit_computed(1, p, 5)
    s = p + [6]                                          # S's 3rd block (5, 6) differs from F's (5, 7)
    bm.append_slots(1, 6)
    bm.commit_computed(1, s, 6)
    f = p + [7]
    bm.append_slots(0, 6)
    bm.commit_computed(0, f, 6)
    assert bm.usage()["num_cached"] == 4                 # (1,2) (3,4) from F, (5,6) from S, (5,7) from F
    assert bm.allocate_prompt(2, s + [0]) == 6
    assert bm.allocate_prompt(3, f + [0]) == 6
    assert bm.block_table(2)[:2] == bm.block_table(3)[:2] == bm.block_table(0)[:2]
    assert bm.block_table(2)[2] == bm.block_table(1)[2]
    bm.check_invariants()


def test_rewritten_parent_block_invalidates_cached_children():
    """A cached block whose parent block was rewritten with other content must not hit, even when the
    hash function can't tell the prefixes apart (the stored parent reference carries a generation)."""
    bm = BlockManager(8, 2, hash_fn=lambda parent, tokens: hash(tokens))   # ignores the parent
    bm.allocate_prompt(0, [1, 1, 2, 2, 0])
    bm.append_slots(0, 5)
    bm.commit_computed(0, [1, 1, 2, 2, 0], 5)           # a0=(1,1) and a1=(2,2)-after-a0 cached
    a0, a1, _ = bm.block_table(0)
    # Roll back to 1 computed token and rewrite position 1: a0 now holds (1, 3); a1 stays cached.
    assert bm.append_slots(0, 2, num_computed_tokens=1) == []
    bm.commit_computed(0, [1, 3], 2)
    bm.check_invariants()
    assert bm.usage()["num_cached"] == 2
    # [1, 3, 2, 2]: a0 hits; a1 has the right tokens and a parent with the right block id, but its KV was
    # computed after (1, 1): a collision, not a hit.
    assert bm.allocate_prompt(1, [1, 3, 2, 2, 0]) == 2
    assert bm.block_table(1) == [a0]
    assert bm.stats.collisions == 1
    bm.check_invariants()


def test_engine_loop_tracks_num_computed():
    bm = BlockManager(8, 4)
    tokens = [1, 2, 3, 4, 5, 6]
    assert bm.allocate_prompt(0, tokens) == 0
    assert bm.num_computed_tokens(0) == 0
    assert bm.append_slots(0, 4) == []                 # chunked prefill: first 4 tokens
    assert bm.slot_mapping(0, 0, 4) == [bm.block_table(0)[0] * 4 + i for i in range(4)]
    bm.commit_computed(0, tokens, 4)
    assert bm.num_computed_tokens(0) == 4
    assert bm.append_slots(0, 6) == []
    bm.commit_computed(0, tokens, 6)
    t = bm.block_table(0)
    assert bm.slot_mapping(0, 4, 6) == [t[1] * 4, t[1] * 4 + 1]
    assert bm.usage()["num_cached"] == 1
    bm.check_invariants()


def test_append_slots_explicit_num_computed_and_rollback():
    bm = BlockManager(8, 2)
    toks = [1, 2, 3, 4, 5]
    bm.allocate_prompt(0, toks)
    bm.append_slots(0, 5, num_computed_tokens=0)
    bm.commit_computed(0, toks, 5)                      # blocks (1,2), (3,4) cached
    assert bm.usage()["num_cached"] == 2
    # Roll back to 3 computed tokens (e.g. rejected speculative tokens) and rewrite position 3 with a new token:
    # block (3,4) will be overwritten, so it must leave the cache.
    assert bm.append_slots(0, 4, num_computed_tokens=3) == []
    assert bm.num_computed_tokens(0) == 3
    assert bm.usage()["num_cached"] == 1
    new = [1, 2, 3, 9]
    bm.commit_computed(0, new, 4)
    bm.check_invariants()
    bm.free(0)
    assert bm.allocate_prompt(1, [1, 2, 3, 4, 0]) == 2   # (3,4) is gone; (3,9) is cached instead
    assert bm.allocate_prompt(2, [1, 2, 3, 9, 0]) == 4
    bm.check_invariants()
    with pytest.raises(ValueError):
        bm.append_slots(2, 3)                            # fewer tokens than computed
    with pytest.raises(ValueError):
        bm.append_slots(2, 8, num_computed_tokens=7)     # computed beyond the table


def test_no_free_blocks_error_is_all_or_nothing_and_reports_counts():
    bm = BlockManager(3, 2)
    bm.allocate_prompt(0, [1] * 5)
    before = (bm.num_free_blocks, bm.block_table(0), bm.usage())
    assert bm.num_blocks_needed(0, 8) == 4
    with pytest.raises(NoFreeBlocksError, match="needs 4 blocks"):
        bm.append_slots(0, 8)
    assert (bm.num_free_blocks, bm.block_table(0), bm.usage()) == before
    bm.check_invariants()


def test_bad_input_messages():
    bm = BlockManager(4, 2)
    with pytest.raises(KeyError, match="unknown seq_id 7"):
        bm.append_slots(7, 1)
    with pytest.raises(KeyError, match="unknown seq_id 7"):
        bm.commit_computed(7, [1], 1)
    with pytest.raises(KeyError, match="unknown seq_id 7"):
        bm.fork(7, 8)
    bm.allocate_prompt(1, [1, 2, 3])
    with pytest.raises(ValueError, match="already allocated"):
        bm.allocate_prompt(1, [4])
    with pytest.raises(ValueError, match="already allocated"):
        bm.fork(1, 1)
    with pytest.raises(ValueError, match="empty"):
        bm.allocate_prompt(2, [])
    with pytest.raises(ValueError):
        bm.commit_computed(1, [1, 2, 3], 3)              # no slots allocated yet
    with pytest.raises(ValueError):
        BlockManager(0, 4)


def test_stats_hit_rate_and_reset_prefix_cache():
    bm = BlockManager(16, 2)
    p = [1, 2, 3, 4, 5, 6, 7]                           # 3 eligible full blocks
    bm.allocate_prompt(0, p)
    assert (bm.stats.hits, bm.stats.misses) == (0, 3)
    bm.append_slots(0, 7)
    bm.commit_computed(0, p, 7)
    bm.allocate_prompt(1, p)
    assert (bm.stats.hits, bm.stats.misses) == (3, 3)
    assert bm.stats.hit_rate == 0.5
    bm.free(0)
    bm.free(1)
    assert bm.usage()["num_cached_evictable"] == 3
    bm.reset_prefix_cache()
    bm.check_invariants()
    assert bm.usage()["num_cached_evictable"] == 0 and bm.num_free_blocks == 16
    assert bm.allocate_prompt(2, p) == 0
    assert PrefixCacheStats().hit_rate == 0.0


def test_reset_prefix_cache_with_live_sequences():
    bm = BlockManager(8, 2)
    p = [1, 2, 3, 4, 5]
    bm.allocate_prompt(0, p)
    bm.append_slots(0, 5)
    bm.commit_computed(0, p, 5)
    bm.reset_prefix_cache()
    bm.check_invariants()
    assert bm.allocate_prompt(1, p) == 0
    p2 = p + [6, 7]
    bm.append_slots(0, 7)
    bm.commit_computed(0, p2, 7)                         # chain continues from the seq's own hashes
    assert bm.usage()["num_cached"] == 1                # only the block completed after the reset
    bm.free(0)
    bm.check_invariants()
    assert bm.allocate_prompt(2, p2 + [8]) == 0          # its parents were forgotten: unreachable, harmless
    bm.check_invariants()


def test_lru_evictor_order():
    ev = LRUEvictor()
    for b in (3, 1, 2):
        ev.add(b)
    ev.add(3)                                            # re-added: now most recent
    assert list(ev) == [1, 2, 3]
    ev.remove(2)
    assert ev.pop_lru() == 1 and len(ev) == 1 and 3 in ev


def test_check_invariants_reports_corruption():
    bm = BlockManager(4, 2)
    bm.allocate_prompt(0, [1, 2, 3])
    bm.append_slots(0, 3)
    bm.allocator.ref_counts[bm.block_table(0)[0]] += 1
    with pytest.raises(AssertionError, match="ref_count=2 but it appears 1"):
        bm.check_invariants()
    bm.allocator.ref_counts[bm.block_table(0)[0]] -= 1
    bm.allocator.free_blocks.append(bm.allocator.free_blocks[0])
    with pytest.raises(AssertionError, match="duplicate"):
        bm.check_invariants()


def test_usage_shape():
    bm = BlockManager(6, 2)
    bm.allocate_prompt(5, [1, 2, 3])
    bm.append_slots(5, 3)
    u = bm.usage()
    assert u["num_blocks"] == 6 and u["num_free"] == 4 and u["num_used"] == 2
    assert u["seq_table_lens"] == {5: 2} and u["num_cached_evictable"] == 0


# --------------------------------------------------------------------------- wrong implementations
class WrongFreeReleasesShared(BlockManager):
    """free() returns every block of the table to the pool at once, ignoring other users (ref counts)."""

    def free(self, seq_id):
        table = self.tables.pop(seq_id, None)
        if table is None:
            return
        del self.computed[seq_id]
        for b in reversed(table):
            while self.allocator.ref_count(b) > 0:
                self.release(b)


class WrongFreeLeaksShared(BlockManager):
    """free() only releases blocks it owns alone; shared ones are never decremented (a leak)."""

    def free(self, seq_id):
        table = self.tables.pop(seq_id, None)
        if table is None:
            return
        del self.computed[seq_id]
        for b in reversed(table):
            if self.ref_count(b) == 1:
                self.release(b)


def _parentless_hash(parent, tokens):
    return default_hash_fn(None, tokens)


def _lookup(token_ids, block_size, cache, hash_fn, *, check_tokens=True, check_parent=True):
    blocks, h = [], None
    for start in range(0, (len(token_ids) - 1) // block_size * block_size, block_size):
        tokens = tuple(token_ids[start:start + block_size])
        h = hash_fn(h, tokens)
        e = cache.get(h)
        if e is None or (check_tokens and e.tokens != tokens) or \
                (check_parent and e.parent != (blocks[-1] if blocks else None)):
            break
        blocks.append(e.block_id)
    return blocks


class WrongNoParentHash(BlockManager):
    """Prefix-cache key = hash of the block's tokens only, verified against the tokens only."""
    hash_fn = staticmethod(_parentless_hash)
    prefix_lookup = staticmethod(lambda t, b, c, f: _lookup(t, b, c, f, check_parent=False))


class WrongNoCopyOnWrite(BlockManager):
    """append_slots writes straight into shared blocks."""

    def _cow_and_new(self, seq_id, num_tokens, nc):
        return [], super()._cow_and_new(seq_id, num_tokens, nc)[1]


class WrongNoCollisionCheck(BlockManager):
    """Trusts the hash: any hash hit is reused without comparing the stored tokens or parent."""
    prefix_lookup = staticmethod(lambda t, b, c, f: _lookup(t, b, c, f, check_tokens=False, check_parent=False))


class MRUEvictor(LRUEvictor):
    def pop_lru(self):
        return self.order.popitem(last=True)[0]


class WrongEvictsMostRecent(BlockManager):
    """Evicts the most recently freed cached block (MRU) instead of the least recently freed one."""
    evictor_cls = MRUEvictor


class WrongNoIdentityOnReuse(BlockManager):
    """A block taken from the pool (free or evicted) keeps its identity: cached children of its old content still
    name it as their parent (the parent reference is the bare block id)."""

    def take_block(self):
        b = super().take_block()
        self._gen[b] -= 1          # undo the new identity the real manager gives reused blocks
        return b


class WrongPartialAllocation(BlockManager):
    """append_slots grabs blocks one at a time and raises midway when the pool runs dry."""

    def append_slots(self, seq_id, num_tokens, *, num_computed_tokens=None):
        table = self.table(seq_id, "append_slots")
        while len(table) * self.block_size < num_tokens:
            if not self.num_free_blocks:
                raise NoFreeBlocksError("out of blocks")
            table.append(self.take_block())
        return super().append_slots(seq_id, num_tokens, num_computed_tokens=num_computed_tokens)


WRONG = {
    WrongFreeReleasesShared: props.check_fork_cow,
    WrongFreeLeaksShared: props.check_fork_cow,
    WrongNoParentHash: props.check_hash_chaining,
    WrongNoCopyOnWrite: props.check_fork_cow,
    WrongNoCollisionCheck: props.check_collision_detection,
    WrongEvictsMostRecent: props.check_lru_eviction,
    WrongPartialAllocation: props.check_all_or_nothing,
    WrongNoIdentityOnReuse: props.check_reused_parent_block,
}


@pytest.mark.parametrize("wrong", list(WRONG), ids=lambda c: c.__name__)
def test_directed_check_catches_wrong_implementation(wrong):
    with pytest.raises((AssertionError, ValueError)):   # ValueError: the manager refuses a malformed lookup
        WRONG[wrong](wrong)


@pytest.mark.parametrize("wrong", [WrongFreeReleasesShared, WrongFreeLeaksShared, WrongNoParentHash,
                                   WrongNoCopyOnWrite, WrongPartialAllocation], ids=lambda c: c.__name__)
def test_random_ops_catch_wrong_implementation(wrong):
    """The random state machine alone (no directed scenario) finds each bug."""
    with pytest.raises(AssertionError):
        props.check_random_ops(wrong, max_examples=150, shrink=False)


def test_random_ops_catch_missing_collision_check():
    with pytest.raises(AssertionError):
        props.check_random_ops(WrongNoCollisionCheck, max_examples=60, shrink=False,
                               hash_fn=lambda parent, tokens: sum(tokens) % 3)


@pytest.mark.parametrize("wrong", list(WRONG), ids=lambda c: c.__name__)
def test_full_property_suite_rejects_wrong_implementation(wrong):
    with pytest.raises((AssertionError, ValueError)):
        props.check_block_manager_properties(wrong, random_examples=20)


def test_full_property_suite_accepts_real_implementation():
    props.check_block_manager_properties(BlockManager, random_examples=5)


@pytest.mark.parametrize("wrong", list(WRONG), ids=lambda c: c.__name__)
def test_checks_do_not_rely_on_the_implementations_own_invariants(wrong):
    """A grader can't trust the student's check_invariants: with it disabled, the external invariants and
    the KV content model still catch every wrong implementation."""
    blind = type(f"Blind{wrong.__name__}", (wrong,), {"check_invariants": lambda self: None})
    with pytest.raises((AssertionError, ValueError)):
        WRONG[wrong](blind)
