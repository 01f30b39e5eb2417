"""Property checks for a paged-KV block manager (anything with BlockManager's constructor and API).

tests/test_block_manager.py runs them against minillm's own ``BlockManager`` and against plausible wrong
implementations; the lab tests run them against learner-style block managers (lab02's paging core, lab05's pieces in
the BlockManager's seams). The lab02 grader drives learners' classes with the same driver
(``minillm.testing.run_operations``): the simulated KV pool is shared, the directed scenarios below are tests.

Every ``check_*`` function takes the *class* under test -- anything with the constructor and API of
``minillm.kv.block_manager.BlockManager`` -- builds its own instances, and raises AssertionError
(with a message saying what went wrong) if the implementation misbehaves. ``check_block_manager_properties``
runs them all.

The central tool is a simulated KV pool (``minillm.testing.KVModel``): writing position p of a sequence stores
``tuple(tokens[:p + 1])`` in the slot -- like real K/V, the value depends on the token, its position and
every token before it. The driver writes through ``slot_mapping``, performs the copy-on-write pairs that
``append_slots`` returns, and after every operation reads back every live sequence's table: each must
return exactly its own prefix. This catches missing copy-on-write, shared blocks freed too early, wrong
prefix-cache hits (hash without parent, undetected collisions), and bad slot mappings, without looking
at the implementation's internals.

Only the public API is used, plus ``ref_count(block)`` and ``check_invariants()`` if the class has them.

Two ways to generate random operation sequences:
* ``make_state_machine`` / ``check_random_ops``: a hypothesis state machine (tests);
* ``minillm.testing.operations()`` / ``run_operations``: a plain list of operation tuples such as
  ``[("admit", [0, 1, 0]), ("decode", 0, 1), ("fork", 0), ("decode", 1, 0)]`` -- what a grader runs under
  ``@given`` so the falsifying example prints as one readable list, with a trace of what happened.
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence

from hypothesis import HealthCheck, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test

from minillm.grading.core import fail as _fail
from minillm.testing import Driver, snapshot, table_of


def _prompt(*blocks: Sequence[int], tail: Sequence[int] = (99,)) -> list[int]:
    out: list[int] = []
    for b in blocks:
        out += list(b)
    return out + list(tail)


# --------------------------------------------------------------------------- directed checks
def check_prefix_reuse(cls) -> None:
    """Same prompt twice: the second reuses the full blocks (hits counted) and reads identical KV; a prompt
    sharing only the first block shares only that block; freed cached blocks are revived."""
    bs = 4
    d = Driver(cls, 16, bs)
    bm = d.bm
    P = list(range(10, 20))                    # 10 tokens: 2 full blocks + 2
    assert d.admit(1, P) == 0, "first prompt cannot hit an empty cache"
    d.prefill(1)
    d.check()
    h0, m0 = bm.stats.hits, bm.stats.misses
    cached = d.admit(2, P)
    if cached != 8:
        _fail(f"same 10-token prompt (block_size 4) re-admitted: expected 8 cached tokens, got {cached}")
    if bm.stats.hits - h0 != 2:
        _fail(f"expected 2 prefix-cache hits counted, got {bm.stats.hits - h0}")
    if bm.block_table(2)[:2] != bm.block_table(1)[:2]:
        _fail("the cached prefix must reuse the same physical blocks")
    d.prefill(2)
    d.check()
    if bm.block_table(2)[2] == bm.block_table(1)[2]:
        _fail("the partially filled last block must not be shared")
    Q = P[:4] + [77, 78, 79, 80] + [81, 82]    # same first block, different second
    cached = d.admit(3, Q)
    if cached != 4 or bm.block_table(3) != bm.block_table(1)[:1]:
        _fail(f"prompt sharing only the first block: expected 4 cached tokens and only block 0 shared, "
              f"got {cached} and table {bm.block_table(3)} vs {bm.block_table(1)}")
    d.prefill(3)
    d.check()
    if not 0.0 <= bm.stats.hit_rate <= 1.0:
        _fail(f"hit_rate {bm.stats.hit_rate} not in [0, 1]")
    d.free_all()
    cached = d.admit(4, P)                     # blocks are cached but unreferenced: revived
    if cached != 8:
        _fail(f"after all sequences were freed, their cached blocks must still hit: got {cached} cached tokens")
    if bm.num_free_blocks != bm.num_blocks - 2:
        _fail("reviving 2 cached blocks must take them out of the free pool")
    d.prefill(4)
    d.check()
    d.free_all()


def check_hash_chaining(cls) -> None:
    """A block's tokens under a different parent (prefix) must NOT hit: its KV depends on the prefix."""
    bs = 4
    d = Driver(cls, 16, bs)
    X, Y = [1, 2, 3, 4], [5, 6, 7, 8]
    d.admit(1, _prompt(X, Y))                  # caches X (pos 0-3) and Y after X (pos 4-7)
    d.prefill(1)
    cached = d.admit(2, _prompt(Y, X))         # Y at pos 0-3 has never been computed
    if cached != 0:
        _fail(f"prompt [Y, X, ...] after [X, Y, ...]: expected 0 cached tokens (Y's cached KV was computed after X, "
              f"at other positions), got {cached}: the block hash must include the parent's hash")
    d.prefill(2)
    d.check()
    cached = d.admit(3, _prompt(X, X))         # X hits; X-after-X does not
    if cached != 4:
        _fail(f"prompt [X, X, ...]: expected exactly the first block cached, got {cached} tokens")
    d.prefill(3)
    d.check()
    d.free_all()


def check_lru_eviction(cls) -> None:
    """Never-cached free blocks are used before cached ones; cached unreferenced blocks are evicted least
    recently freed first, and a sequence's tail blocks before its prefix blocks."""
    bs = 2
    d = Driver(cls, 8, bs)
    bm = d.bm
    A = [1, 1, 2, 2, 9]        # 2 full blocks (cached) + 1
    B = [3, 3, 4, 4, 9]
    for sid, p in ((1, A), (2, B)):
        d.admit(sid, p)
        d.prefill(sid)
    d.free(1)                  # A's blocks: tail (uncached) -> free, [a1, a0] evictable
    d.free(2)                  # then [b1, b0]: LRU order a1, a0, b1, b0
    d.admit(3, A)              # revive A's two blocks (a hit refreshes them)...
    d.prefill(3)
    d.free(3)                  # ...and free again: now LRU order is b1, b0, a1, a0
    d.check()
    # 8 blocks: 4 cached-evictable + 4 plain free. A 12-token prompt needs 6: 4 plain + 2 evictions.
    d.admit(4, [50 + i for i in range(12)])
    d.prefill(4)
    d.check()
    if bm.stats.evictions != 2:
        _fail(f"expected exactly 2 evictions (plain free blocks must be used before evicting cached ones), "
              f"got {bm.stats.evictions}")
    d.free(4)
    ca, cb = d.admit(5, A), d.admit(6, B)
    if (ca, cb) != (4, 0):
        _fail(f"after evicting 2 of the 4 cached blocks, A (refreshed last) should still hit 4 tokens and B "
              f"(least recently freed) 0; got A={ca}, B={cb}: eviction must be LRU by time of last free")
    d.free_all()
    # Tail-first: free a 3-full-block sequence, evict one block -> its prefix still hits.
    d2 = Driver(cls, 4, bs)
    C = [7, 7, 8, 8, 9, 9, 1]
    d2.admit(1, C)
    d2.prefill(1)                               # 4 blocks: c0 c1 c2 cached, c3 partial
    d2.free(1)
    d2.admit(2, [60, 61, 62, 63])               # needs 2 blocks: c3 (plain) + 1 eviction
    d2.prefill(2)
    cached = d2.admit(3, C)
    if cached != 4:
        _fail(f"a freed sequence's blocks must be evicted tail first (prefix blocks last): after one eviction "
              f"the 3-block prefix should still hit 2 blocks (4 tokens), got {cached} tokens")
    d2.free_all()


def check_collision_detection(cls) -> None:
    """With a hash_fn that always collides, a hit on a block holding other tokens is a miss, counted
    in stats.collisions, and nobody reads wrong KV."""
    bs = 2
    d = Driver(cls, 16, bs, hash_fn=lambda parent, tokens: 12345)
    bm = d.bm
    P = [1, 2, 3, 4, 5, 6, 7]
    d.admit(1, P)
    d.prefill(1)
    c0 = bm.stats.collisions
    cached = d.admit(2, [8, 9, 3, 4, 5])
    if cached != 0:
        _fail(f"constant hash_fn: a prompt whose first block differs got {cached} cached tokens (wrong reuse)")
    if bm.stats.collisions <= c0:
        _fail("constant hash_fn: the hash hit on a block with different tokens was not counted in stats.collisions")
    d.prefill(2)
    d.check()
    cached = d.admit(3, P)
    if cached > bs:
        _fail(f"constant hash_fn: only one block can be cached under the single hash value, yet {cached} tokens hit")
    d.prefill(3)
    d.check()
    cached = d.admit(4, [3, 4, 3, 4, 0])        # block (3, 4) at position 0: never computed there
    if cached != 0:
        _fail(f"constant hash_fn: prompt [3, 4, ...] got {cached} cached tokens")
    d.prefill(4)
    d.check()
    d.free_all()


def _tokens_only_hash(parent, tokens) -> int:
    return hash(tuple(tokens))       # ints hash the same in every process: deterministic


def check_reused_parent_block(cls) -> None:
    """A cached block whose parent block was evicted and reused for other content must not match: its KV was
    computed after the parent's old content. With the chained hash the chain itself differs; with a hash of the
    block's tokens only, the cached entry has the right tokens and the right parent *block id*, so only the
    parent's identity (which content it held) can refuse it.

    F and S compute the same first block (1, 2) at once, so S's next block (5, 6) is cached as the child of F's
    block; F finishes and its block, evicted, is reused by B for (8, 8) at position 0; [8, 8, 5, 6, ...] then
    finds (8, 8) in that very block, and (5, 6) under it -- a wrong hit unless the parent's identity is checked."""
    bs = 2
    for hash_fn in (None, _tokens_only_hash):
        kw = {} if hash_fn is None else {"hash_fn": hash_fn}
        what = "the default chained hash" if hash_fn is None else "a hash of the block's tokens only"
        d = Driver(cls, 6, bs, **kw)
        d.admit(1, [1, 2, 7])
        d.admit(2, [1, 2, 5, 6, 7])          # admitted before 1 commits: computes its own copy of (1, 2)
        d.prefill(1)
        d.prefill(2)                         # its (5, 6) is cached as the child of 1's block (1, 2)
        d.check()
        parent = table_of(d.bm, 1)[0]
        d.free(1)                            # (1, 2) cached, evictable
        d.admit(3, [10, 11, 12, 13])
        d.prefill(3)                         # takes the two free blocks: (1, 2) is the only evictable one
        d.admit(4, [8, 8])
        d.prefill(4)                         # evicts (1, 2) and writes (8, 8) at position 0 into its block
        d.check()
        if table_of(d.bm, 4)[0] != parent:
            _fail(f"with one evictable block ({parent}) and no free one, a new block must come from evicting it; "
                  f"got block {table_of(d.bm, 4)[0]}")
        collisions = getattr(getattr(d.bm, "stats", None), "collisions", None)
        d.free(3)
        try:
            cached = d.admit(5, [8, 8, 5, 6, 0])
        except AssertionError as e:
            _fail(f"{what}: a block cached after (1, 2) matched under (8, 8), which now lives in the reused parent "
                  f"block {parent}: the cached entry must remember which content its parent held, not only its block "
                  f"id ({e})")
        if cached != bs:
            _fail(f"{what}: [8, 8, 5, 6, 0] must reuse exactly (8, 8) ({bs} tokens), got {cached}")
        if hash_fn is not None and collisions is not None and d.bm.stats.collisions <= collisions:
            _fail(f"{what}: the hash hit on (5, 6) cached under the old parent was refused but not counted in "
                  "stats.collisions")
        d.prefill(5)
        d.check()
        d.free_all()


def check_prefix_cap(cls) -> None:
    """A prompt of exactly k full blocks reuses at most k - 1 (at least one token is left to compute, and
    the block written next is never a shared cached block)."""
    bs = 4
    d = Driver(cls, 16, bs)
    bm = d.bm
    P = list(range(30, 42))                    # 3 full blocks
    d.admit(1, P)
    d.prefill(1)
    cached = d.admit(2, P)
    if cached != 8:
        _fail(f"a 12-token prompt (3 full blocks) fully cached must reuse exactly 2 blocks (8 tokens), got {cached}")
    copies = d.prefill(2)
    d.check()
    if bm.block_table(2)[2] == bm.block_table(1)[2]:
        _fail("the last block of a block-aligned prompt must be recomputed into a private block")
    cached = d.admit(3, P[:1])
    if cached != 0:
        _fail(f"a 1-token prompt can never hit, got {cached}")
    d.prefill(3)
    d.check()
    del copies
    d.free_all()


def check_fork_cow(cls) -> None:
    """fork shares every block; the first write into a shared partially filled block copies it (the
    (src, dst) pair is returned); both sequences keep reading their own tokens, also after the other is freed."""
    bs = 4
    d = Driver(cls, 12, bs)
    bm = d.bm
    d.admit(1, [1, 2, 3, 4, 5])                # block 0 full, block 1 holds 1 token
    d.prefill(1)
    d.fork(1, 2)
    d.check()
    if bm.num_blocks_needed(2, 6) != 1:
        _fail(f"writing position 5 of a forked sequence (shared partial block) needs 1 copy-on-write block, "
              f"num_blocks_needed says {bm.num_blocks_needed(2, 6)}")
    src = bm.block_table(1)[1]
    copies = d.decode(2, 100)
    if len(copies) != 1 or copies[0][0] != src or copies[0][1] != bm.block_table(2)[1]:
        _fail(f"child's first decode after fork must copy its shared last block {src} into a new block; "
              f"append_slots returned {copies}, child table {bm.block_table(2)}")
    d.check()
    copies = d.decode(1, 200)                  # parent is now the only user of its block: write in place
    if copies:
        _fail(f"parent's block is no longer shared; no copy expected, got {copies}")
    d.check()
    if bm.block_table(1)[0] != bm.block_table(2)[0]:
        _fail("the full first block must stay shared after the divergence")
    for t in (101, 102, 103):
        d.decode(2, t)
        d.decode(1, t + 100)
        d.check()
    d.fork(2, 3)                                # fork at a block boundary (8 tokens computed)
    d.decode(3, 7)
    d.decode(2, 8)
    d.check()
    d.free(2)                                   # its blocks still used by 1 / 3 must survive
    d.check()
    filler = 40
    while bm.num_free_blocks:                   # overwrite every free block
        d.admit(filler, [filler] * bs)
        d.prefill(filler)
        filler += 1
        d.check()
    d.free_all()


def check_all_or_nothing(cls) -> None:
    """NoFreeBlocksError leaves the state unchanged, also for copy-on-write; a smaller request then succeeds."""
    bs = 2
    d = Driver(cls, 4, bs)
    bm = d.bm
    err = d.err
    d.admit(1, [1, 2, 3, 4, 5])
    d.prefill(1)                               # 3 blocks, 1 free
    d.admit(2, [9, 8, 7, 6, 5])
    try:
        d.prefill(2)
        _fail("append_slots for 3 blocks with 1 free did not raise NoFreeBlocksError")
    except err:
        pass
    d.check()
    d.prefill(2, chunk=2)                      # 1 block fits
    d.check()
    d.fork(1, 3)                               # shared partial block, 0 free
    try:
        d.decode(3, 11)
        _fail("copy-on-write with no free block did not raise NoFreeBlocksError")
    except err:
        pass
    d.check()
    d.free(2)
    d.decode(3, 11)
    d.check()
    d.free_all()


def check_bad_input(cls) -> None:
    bm = cls(8, 4)
    try:
        bm.append_slots(12345, 3)
        _fail("append_slots for an unknown seq_id must raise KeyError")
    except KeyError as e:
        if "12345" not in str(e):
            _fail(f"the KeyError for an unknown seq_id should name it; got {e!r}")
    bm.allocate_prompt(1, [1, 2, 3])
    try:
        bm.allocate_prompt(1, [1, 2, 3])
        _fail("allocate_prompt for an already-allocated seq_id must raise ValueError")
    except ValueError:
        pass
    try:
        bm.allocate_prompt(2, [])
        _fail("allocate_prompt with empty token_ids must raise ValueError")
    except ValueError:
        pass
    if bm.has_seq(2):
        _fail("a failed allocate_prompt must not create the sequence")
    if bm.num_blocks_needed(777, 9) != 3:
        _fail(f"num_blocks_needed for an unknown seq must be ceil(9/4)=3, got {bm.num_blocks_needed(777, 9)}")
    bm.free(777)                               # unknown: no-op
    bm.free(1)
    bm.check_invariants()
    if bm.num_free_blocks != 8:
        _fail("num_free_blocks must be num_blocks once everything is freed")


def check_prefix_caching_disabled(cls) -> None:
    d = Driver(cls, 8, 2, enable_prefix_caching=False)
    P = [1, 2, 3, 4, 5]
    d.admit(1, P)
    d.prefill(1)
    if d.admit(2, P) != 0:
        _fail("enable_prefix_caching=False must never reuse blocks")
    d.prefill(2)
    d.check()
    d.free_all()
    if d.bm.usage()["num_cached_evictable"] != 0:
        _fail("enable_prefix_caching=False must not keep cached blocks")


# --------------------------------------------------------------------------- random operation sequences
_OPS = ("admit", "admit", "advance", "advance", "advance", "advance", "advance", "fork", "fork", "free")


def make_state_machine(cls, *, num_blocks: int = 8, block_size: int = 2, vocab: int = 2, max_seqs: int = 4,
                       max_prompt: int = 7, hash_fn: Optional[Callable] = None,
                       enable_prefix_caching: bool = True, rollback: bool = False) -> type[RuleBasedStateMachine]:
    """A hypothesis state machine that drives `cls` with random admit/prefill/decode/fork/free sequences
    over a small pool and a tiny vocabulary (so prefixes, fork divergence and evictions are frequent).
    rollback=True adds roll-backs (commit_computed with fewer tokens, then recompute), an extension
    beyond the required API."""
    ops = _OPS + (("rollback", "rollback") if rollback else ())
    kw = dict(enable_prefix_caching=enable_prefix_caching)
    if hash_fn is not None:
        kw["hash_fn"] = hash_fn

    class BlockManagerMachine(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            self.d = Driver(cls, num_blocks, block_size, **kw)
            self.next_id = 0

        def _new_id(self) -> int:
            self.next_id += 1
            return self.next_id

        # One rule choosing a weighted operation: hypothesis' stateful engine has no rule weights, and
        # separate rules with preconditions waste many steps on no-ops.
        @rule(data=st.data(), op=st.sampled_from(ops))
        def step(self, data, op):
            d = self.d
            if op == "admit" or not d.live:
                if len(d.live) < max_seqs:
                    prompt = data.draw(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=max_prompt),
                                       label="prompt")
                    d.admit(self._new_id(), prompt)
                return
            sid = data.draw(st.sampled_from(d.live), label="seq")
            if op == "advance":
                n, nc = len(d.tokens[sid]), d.computed[sid]
                pass_nc = data.draw(st.booleans(), label="pass num_computed_tokens")
                try:
                    if nc < n:
                        d.prefill(sid, data.draw(st.integers(1, n - nc), label="chunk"), pass_nc)
                    else:
                        d.decode(sid, data.draw(st.integers(0, vocab - 1), label="token"), pass_nc)
                except d.err:
                    pass  # Driver.step already checked that the state is unchanged
            elif op == "rollback":
                if d.computed[sid]:
                    d.rollback(sid, data.draw(st.integers(1, min(d.computed[sid], 3)), label="rollback"))
            elif op == "fork":
                if len(d.live) < max_seqs:
                    d.fork(sid, self._new_id())
            elif op == "free":
                d.free(sid)
                before = snapshot(d.bm, d.live)
                d.bm.free(10_000)
                if snapshot(d.bm, d.live) != before:
                    _fail("free() of an unknown seq_id must be a no-op")

        @invariant()
        def consistent(self):
            self.d.check()

        def teardown(self):
            self.d.free_all()

    return BlockManagerMachine


def check_random_ops(cls, *, max_examples: int = 150, step_count: int = 30, shrink: bool = True, **machine_kw) -> None:
    """Random operation sequences; after every step: the class's own check_invariants, the external
    invariants, and every live sequence reads back exactly its own KV."""
    from hypothesis import Phase
    phases = [Phase.explicit, Phase.generate] + ([Phase.shrink] if shrink else [])
    run_state_machine_as_test(
        make_state_machine(cls, **machine_kw),
        settings=settings(max_examples=max_examples, stateful_step_count=step_count, deadline=None,
                          derandomize=True, database=None, phases=phases,
                          suppress_health_check=list(HealthCheck), print_blob=False),
    )


DIRECTED_CHECKS = (check_bad_input, check_prefix_reuse, check_hash_chaining, check_prefix_cap, check_fork_cow,
                   check_all_or_nothing, check_lru_eviction, check_collision_detection, check_reused_parent_block,
                   check_prefix_caching_disabled)


def check_block_manager_properties(cls, *, random_examples: int = 150) -> None:
    """Run every check against `cls`; raises AssertionError on the first failure."""
    for check in DIRECTED_CHECKS:
        check(cls)
    check_random_ops(cls, max_examples=random_examples)
    check_random_ops(cls, max_examples=max(5, random_examples // 3), hash_fn=lambda p, t: sum(t) % 3)

