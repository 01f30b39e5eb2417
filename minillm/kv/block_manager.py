"""Paged-KV block manager: block tables, ref counts, copy-on-write and prefix caching.

The KV pool (kv/cache.py) is `num_blocks` fixed-size blocks of `block_size` token slots. This
module only does the bookkeeping (pure Python, no tensors):

* every sequence (an int ``seq_id``) has a *block table*: the physical block ids holding its
  positions 0, 1, 2, ... (position p lives in slot ``table[p // bs] * bs + p % bs``);
* a block can be in several tables (prefix-cache hits, ``fork`` for n>1 sampling / beams), so
  each block has a ref count = number of table entries holding it;
* a shared block is never written: before writing into a block with ref_count > 1 the sequence
  gets a private copy (copy-on-write); the manager returns ``(src, dst)`` pairs and the caller
  copies the K/V (``KVCache.copy_blocks``);
* full blocks whose KV has been computed are registered in the prefix cache under a chained hash
  (see prefix_cache.py); when their last user frees them they stay *cached but evictable* and
  can be revived by a later prompt with the same prefix, until evicted (LRU).

How ``num_computed_tokens`` reaches ``append_slots``
----------------------------------------------------
The manager tracks it per sequence: ``allocate_prompt`` sets it to the number of cached tokens
and ``commit_computed(seq_id, token_ids, n)`` (called after every forward pass) sets it to ``n``.
``append_slots(seq_id, num_tokens)`` uses the tracked value, so the normal engine loop is::

    cached = bm.allocate_prompt(sid, prompt)                  # num_computed = cached
    copies = bm.append_slots(sid, len(prompt))               # or a chunk: cached + chunk
    kv.copy_blocks(copies); slots = bm.slot_mapping(sid, cached, len(prompt))
    ... forward pass writes K/V into `slots` ...
    bm.commit_computed(sid, tokens, len(prompt))              # num_computed = len(prompt)
    # decode: tokens.append(t); bm.append_slots(sid, len(tokens)); ...; commit_computed(...)

``append_slots`` also takes an optional keyword-only override ``num_computed_tokens=`` (e.g. to
roll back after rejected speculative tokens); when given it *replaces* the tracked value.
There is no separate setter.
"""
from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

from minillm.kv.prefix_cache import HashFn, LRUEvictor, PrefixCacheStats, default_hash_fn

__all__ = ["BlockManager", "NoFreeBlocksError", "PrefixCacheStats", "default_hash_fn"]


class NoFreeBlocksError(RuntimeError):
    """Not enough free blocks for the request. The BlockManager's state is unchanged."""


# Identity of one block's *content*: (block id, generation). A block's generation is bumped whenever its
# content changes (it is taken from the free pool, or rewritten after a roll-back), so a stale reference
# to a block that has since been reused never matches.
BlockRef = tuple[int, int]


@dataclass
class _SeqState:
    table: list[int] = field(default_factory=list)
    num_computed: int = 0               # KV is valid for positions [0, num_computed)
    # For each computed full block i (len <= num_computed // block_size):
    block_hashes: list[int] = field(default_factory=list)  # chained hash h_i = hash_fn(h_{i-1}, tokens_i)
    canon: list[BlockRef] = field(default_factory=list)    # a block holding exactly the KV of prefix blocks 0..i
                                                            # (this seq's own block, or an equal cached one)


def _check(cond: bool, msg: str) -> None:
    if not cond:  # not `assert`: must also work under python -O
        raise AssertionError(msg)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 hash_fn: Optional[Callable[[Optional[int], tuple], int]] = None,
                 evictor_cls: Optional[Callable[[], LRUEvictor]] = None) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"num_blocks and block_size must be positive, got {num_blocks}, {block_size}")
        self.num_blocks = int(num_blocks)
        self.block_size = int(block_size)
        self.enable_prefix_caching = bool(enable_prefix_caching)
        self.hash_fn: HashFn = hash_fn if hash_fn is not None else default_hash_fn
        self.stats = PrefixCacheStats()
        self._ref = [0] * self.num_blocks
        # Free pool = _free (hold no cached data; allocated first, FIFO) + _evictor (cached, ref 0, LRU).
        self._free: deque[int] = deque(range(self.num_blocks))
        self._evictor = (evictor_cls or LRUEvictor)()   # any class with LRUEvictor's interface (lab05)
        # Prefix cache: hash -> block, block -> hash, and block -> (parent BlockRef, tokens): what the block
        # really holds, compared on every hit so that hash collisions can never serve wrong KV.
        self._hash_to_block: dict[int, int] = {}
        self._block_hash: dict[int, int] = {}
        self._block_key: dict[int, tuple[Optional[BlockRef], tuple]] = {}
        self._gen = [0] * self.num_blocks
        self._seqs: dict[int, _SeqState] = {}

    # ------------------------------------------------------------------ queries
    @property
    def num_free_blocks(self) -> int:
        """Blocks allocatable now: never-used/free ones plus cached-but-unreferenced (evictable) ones."""
        return len(self._free) + len(self._evictor)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    def has_seq(self, seq_id: int) -> bool:
        return seq_id in self._seqs

    def block_table(self, seq_id: int) -> list[int]:
        """Physical block ids of `seq_id`, in position order (a copy)."""
        return list(self._seq(seq_id, "block_table").table)

    def num_computed_tokens(self, seq_id: int) -> int:
        """The tracked number of positions whose KV is valid (see module docstring)."""
        return self._seq(seq_id, "num_computed_tokens").num_computed

    def ref_count(self, block_id: int) -> int:
        return self._ref[block_id]

    def _seq(self, seq_id: int, op: str) -> _SeqState:
        try:
            return self._seqs[seq_id]
        except KeyError:
            raise KeyError(f"{op}: unknown seq_id {seq_id!r} (not allocated with allocate_prompt/fork, "
                           f"or already freed)") from None

    def _cdiv(self, n: int) -> int:
        return -(-n // self.block_size)

    # ------------------------------------------------------------------ hashing / lookup
    def _hash(self, parent: Optional[int], tokens: tuple) -> int:
        return self.hash_fn(parent, tokens)

    def _matches(self, block: int, parent: Optional[BlockRef], tokens: tuple) -> bool:
        """Does cached `block` really hold `tokens` right after the content `parent` (None: at position 0)?

        Comparing the parent's *identity* (block id + generation) rather than the parent's hash value makes
        the check exact by induction, whatever hash_fn is: the hash only has to find candidates."""
        return self._block_key.get(block) == (parent, tokens)

    def _ref_of(self, block: int) -> BlockRef:
        return (block, self._gen[block])

    def _lookup(self, token_ids: Sequence[int], count_stats: bool) -> tuple[list[int], list[int]]:
        """Longest cached prefix of full blocks, capped so >= 1 token is left to compute.
        Returns (blocks, their hashes)."""
        bs = self.block_size
        max_blocks = (len(token_ids) - 1) // bs
        blocks: list[int] = []
        hashes: list[int] = []
        if not self.enable_prefix_caching:
            return blocks, hashes
        parent_hash: Optional[int] = None
        parent: Optional[BlockRef] = None
        for i in range(max_blocks):
            tokens = tuple(token_ids[i * bs:(i + 1) * bs])
            h = self._hash(parent_hash, tokens)
            b = self._hash_to_block.get(h)
            if b is None:
                break
            if not self._matches(b, parent, tokens):
                if count_stats:
                    self.stats.collisions += 1
                break
            blocks.append(b)
            hashes.append(h)
            parent_hash, parent = h, self._ref_of(b)
        if count_stats:
            self.stats.hits += len(blocks)
            self.stats.misses += max_blocks - len(blocks)
        return blocks, hashes

    def peek_prefix(self, token_ids: Sequence[int]) -> int:
        """Number of tokens allocate_prompt(token_ids) would get from the cache now (no side effects)."""
        return len(self._lookup(token_ids, count_stats=False)[0]) * self.block_size

    def blocks_to_admit(self, token_ids: Sequence[int], num_tokens: Optional[int] = None) -> int:
        """By how much num_free_blocks would drop for allocate_prompt(token_ids) followed by
        append_slots(seq, num_tokens or len(token_ids)): new blocks for the uncached part plus cached
        hits that are currently evictable (reviving them takes them out of the free pool)."""
        n = len(token_ids) if num_tokens is None else num_tokens
        hits, _ = self._lookup(token_ids, count_stats=False)
        revived = sum(1 for b in hits if self._ref[b] == 0)
        return max(0, self._cdiv(n) - len(hits)) + revived

    # ------------------------------------------------------------------ allocation primitives
    def _take_free_block(self) -> int:
        """A block with no live data, ref 0 -> 1. Prefers never-cached blocks; else evicts the LRU cached one."""
        if self._free:
            b = self._free.popleft()
        elif len(self._evictor):
            b = self._evictor.pop_lru()
            self._uncache(b)
            self.stats.evictions += 1
        else:  # callers check capacity first; reaching here is a bug
            raise NoFreeBlocksError("no free blocks")
        self._ref[b] = 1
        self._gen[b] += 1  # new content: stale references to the old content must not match
        return b

    def _uncache(self, b: int) -> None:
        h = self._block_hash.pop(b, None)
        if h is not None:
            self._block_key.pop(b, None)
            if self._hash_to_block.get(h) == b:
                del self._hash_to_block[h]

    def _release(self, b: int) -> None:
        """Drop one reference to block b."""
        self._ref[b] -= 1
        if self._ref[b] == 0:
            if b in self._block_hash:
                self._evictor.add(b)    # keep its KV around for future prefix hits
            else:
                self._free.append(b)

    # ------------------------------------------------------------------ public API
    def allocate_prompt(self, seq_id: int, token_ids: Sequence[int]) -> int:
        """Admit `seq_id`: create its table from the longest cached prefix and return num_cached_tokens.

        Only full blocks are reused, at most (len(token_ids) - 1) // block_size of them, so at least
        one token is left to compute and the block written next is never a shared cached block.
        Blocks for the uncached rest are NOT allocated here: call append_slots.
        """
        if seq_id in self._seqs:
            raise ValueError(f"allocate_prompt: seq_id {seq_id!r} is already allocated")
        if len(token_ids) == 0:
            raise ValueError(f"allocate_prompt: empty token_ids for seq_id {seq_id!r}")
        blocks, hashes = self._lookup(token_ids, count_stats=True)
        for b in blocks:
            if self._ref[b] == 0:
                self._evictor.remove(b)  # revive a cached, unreferenced block
            self._ref[b] += 1
        self._seqs[seq_id] = _SeqState(table=list(blocks), num_computed=len(blocks) * self.block_size,
                                       block_hashes=hashes, canon=[self._ref_of(b) for b in blocks])
        return len(blocks) * self.block_size

    def _plan(self, st: _SeqState, num_tokens: int, nc: int) -> tuple[list[int], int]:
        """(table indices needing copy-on-write, number of brand-new blocks to append)."""
        bs = self.block_size
        cow: list[int] = []
        if num_tokens > nc:
            last = min((num_tokens - 1) // bs, len(st.table) - 1)
            for i in range(nc // bs, last + 1):   # existing blocks that positions [nc, num_tokens) write into
                if self._ref[st.table[i]] > 1:
                    cow.append(i)
        return cow, max(0, self._cdiv(num_tokens) - len(st.table))

    def num_blocks_needed(self, seq_id: int, num_tokens: int, *, num_computed_tokens: Optional[int] = None) -> int:
        """New blocks append_slots(seq_id, num_tokens) would take (incl. copy-on-write).
        Unknown seq_id: ceil(num_tokens / block_size)."""
        st = self._seqs.get(seq_id)
        if st is None:
            return self._cdiv(num_tokens)
        nc = st.num_computed if num_computed_tokens is None else num_computed_tokens
        cow, new = self._plan(st, num_tokens, nc)
        return len(cow) + new

    def append_slots(self, seq_id: int, num_tokens: int, *,
                     num_computed_tokens: Optional[int] = None) -> list[tuple[int, int]]:
        """Make the table cover positions [0, num_tokens); return copy-on-write pairs (src, dst).

        The positions to be written are [num_computed, num_tokens), num_computed being the tracked
        value (set by allocate_prompt / commit_computed) unless `num_computed_tokens` is given, in which
        case it replaces the tracked value (a smaller value = roll back). Any existing block those
        positions fall in that is shared (ref_count > 1) is replaced in this sequence's table by a
        fresh block; if it holds valid KV (positions < num_computed) the pair (src, dst) is returned
        and the caller must copy the block's K/V before the forward pass.
        All or nothing: raises NoFreeBlocksError without changing anything if blocks are short.
        """
        st = self._seq(seq_id, "append_slots")
        bs = self.block_size
        nc = st.num_computed if num_computed_tokens is None else int(num_computed_tokens)
        if not 0 <= nc <= len(st.table) * bs:
            raise ValueError(f"append_slots: num_computed_tokens={nc} outside [0, {len(st.table) * bs}] "
                             f"(table of seq {seq_id!r} has {len(st.table)} blocks)")
        if num_tokens < nc:
            raise ValueError(f"append_slots: num_tokens={num_tokens} < num_computed_tokens={nc} for seq {seq_id!r}")
        cow, new = self._plan(st, num_tokens, nc)
        if len(cow) + new > self.num_free_blocks:
            raise NoFreeBlocksError(
                f"append_slots(seq {seq_id!r}, {num_tokens} tokens) needs {len(cow) + new} blocks "
                f"({new} new + {len(cow)} copy-on-write), only {self.num_free_blocks} free")
        # --- commit point: nothing below can fail ---
        if nc < st.num_computed:
            self._rollback(st, nc)
        st.num_computed = nc
        copies: list[tuple[int, int]] = []
        for i in cow:
            src = st.table[i]
            dst = self._take_free_block()
            st.table[i] = dst
            self._release(src)         # ref > 1, so it stays alive for its other users
            if i * bs < nc:            # it holds valid KV that this sequence still needs
                copies.append((src, dst))
        for i in range(nc // bs, min(len(st.table), self._cdiv(num_tokens)) if num_tokens > nc else 0):
            # Existing blocks written in place (now private to this seq): their content changes. Normally that is
            # just the partially filled last block; after a roll-back it may be a registered full block, which
            # must leave the cache, and blocks cached as its children must stop matching (generation bump).
            b = st.table[i]
            if i in cow:
                continue
            if b in self._block_hash:
                self._uncache(b)
            self._gen[b] += 1
        for _ in range(new):
            st.table.append(self._take_free_block())
        return copies

    def _rollback(self, st: _SeqState, nc: int) -> None:
        st.num_computed = nc
        del st.block_hashes[nc // self.block_size:]
        del st.canon[nc // self.block_size:]

    def slot_mapping(self, seq_id: int, start: int, end: int) -> list[int]:
        """Flat KV slot of each position in [start, end): table[p // bs] * bs + p % bs."""
        st = self._seq(seq_id, "slot_mapping")
        bs = self.block_size
        if not 0 <= start <= end <= len(st.table) * bs:
            raise ValueError(f"slot_mapping: [{start}, {end}) outside the {len(st.table) * bs} slots of seq {seq_id!r}")
        t = st.table
        return [t[p // bs] * bs + p % bs for p in range(start, end)]

    def commit_computed(self, seq_id: int, token_ids: Sequence[int], num_computed_tokens: int) -> None:
        """KV for positions [0, num_computed_tokens) of `token_ids` is now written: record that, and
        register every newly full block in the prefix cache (keeping an existing mapping for its hash)."""
        st = self._seq(seq_id, "commit_computed")
        bs = self.block_size
        nc = int(num_computed_tokens)
        if not 0 <= nc <= min(len(token_ids), len(st.table) * bs):
            raise ValueError(f"commit_computed: num_computed_tokens={nc} outside [0, min(len(token_ids)="
                             f"{len(token_ids)}, table slots={len(st.table) * bs})] for seq {seq_id!r}")
        if nc < st.num_computed:
            self._rollback(st, nc)
        st.num_computed = nc
        if not self.enable_prefix_caching:
            return
        for i in range(len(st.block_hashes), nc // bs):
            parent_hash = st.block_hashes[-1] if st.block_hashes else None
            parent = st.canon[-1] if st.canon else None
            tokens = tuple(token_ids[i * bs:(i + 1) * bs])
            h = self._hash(parent_hash, tokens)
            st.block_hashes.append(h)  # kept even if the block isn't registered: it chains the next one
            b = st.table[i]
            existing = self._hash_to_block.get(h)
            if existing is not None and self._matches(existing, parent, tokens):
                # The same content is already cached (b itself, or an equal block computed by another
                # sequence): keep that mapping, and chain our next block to it.
                st.canon.append(self._ref_of(existing))
                continue
            if b in self._block_hash:
                self._uncache(b)       # stale registration of this block under other content
            if existing is None:
                self._hash_to_block[h] = b
                self._block_hash[b] = h
                self._block_key[b] = (parent, tokens)
            # else: a hash collision with other content -- keep the existing mapping; b stays uncached.
            st.canon.append(self._ref_of(b))

    def fork(self, parent_seq_id: int, child_seq_id: int) -> None:
        """The child shares all of the parent's blocks (ref_count += 1 each); writes are copy-on-write."""
        p = self._seq(parent_seq_id, "fork")
        if child_seq_id in self._seqs:
            raise ValueError(f"fork: child seq_id {child_seq_id!r} is already allocated")
        for b in p.table:
            self._ref[b] += 1
        self._seqs[child_seq_id] = _SeqState(table=list(p.table), num_computed=p.num_computed,
                                             block_hashes=list(p.block_hashes), canon=list(p.canon))

    def free(self, seq_id: int) -> None:
        """Drop the table and its references (tail first, so prefix blocks are evicted last). Unknown id: no-op."""
        st = self._seqs.pop(seq_id, None)
        if st is None:
            return
        for b in reversed(st.table):
            self._release(b)

    def reset_prefix_cache(self) -> None:
        """Forget every cached hash; evictable blocks become plain free blocks. Blocks in use keep their KV
        (and sequences keep their hash chains) but are no longer findable."""
        for b in self._evictor.clear():
            self._free.append(b)
        self._hash_to_block.clear()
        self._block_hash.clear()
        self._block_key.clear()

    # ------------------------------------------------------------------ introspection
    def usage(self) -> dict:
        return {
            "num_blocks": self.num_blocks,
            "block_size": self.block_size,
            "num_free": self.num_free_blocks,
            "num_used": self.num_used_blocks,
            "num_cached_evictable": len(self._evictor),
            "num_cached": len(self._block_hash),
            "num_seqs": len(self._seqs),
            "seq_table_lens": {sid: len(st.table) for sid, st in self._seqs.items()},
        }

    def check_invariants(self) -> None:
        """Raise AssertionError describing the first broken invariant, if any."""
        n, bs = self.num_blocks, self.block_size
        _check(len(self._ref) == n, f"ref_count array has {len(self._ref)} entries, expected {n}")
        counts: Counter[int] = Counter()
        for sid, st in self._seqs.items():
            for b in st.table:
                _check(0 <= b < n, f"seq {sid}: block id {b} out of range [0, {n})")
            counts.update(st.table)
            _check(0 <= st.num_computed <= len(st.table) * bs,
                   f"seq {sid}: num_computed={st.num_computed} exceeds its {len(st.table)} blocks")
            if self.enable_prefix_caching:
                _check(len(st.block_hashes) <= st.num_computed // bs,
                       f"seq {sid}: {len(st.block_hashes)} block hashes but only {st.num_computed // bs} full computed blocks")
                _check(len(st.canon) == len(st.block_hashes),
                       f"seq {sid}: {len(st.canon)} canonical block refs for {len(st.block_hashes)} block hashes")
        for b in range(n):
            _check(self._ref[b] == counts[b],
                   f"block {b}: ref_count={self._ref[b]} but it appears {counts[b]} time(s) in block tables")
        free_list = list(self._free)
        free_set = set(free_list)
        _check(len(free_set) == len(free_list),
               f"duplicate block(s) in the free list: {sorted(b for b, c in Counter(free_list).items() if c > 1)}")
        evictable = set(self._evictor)
        both = free_set & evictable
        _check(not both, f"block(s) {sorted(both)} both in the free list and evictable")
        pool = free_set | evictable
        for b in pool:
            _check(self._ref[b] == 0, f"block {b} is in the free pool but has ref_count={self._ref[b]}")
        used = {b for b in range(n) if self._ref[b] > 0}
        _check(len(pool) + len(used) == n,
               f"free ({len(pool)}) + used ({len(used)}) != num_blocks ({n}); "
               f"lost blocks: {sorted(set(range(n)) - pool - used)}")
        _check(self.num_free_blocks == len(pool), "num_free_blocks disagrees with the free pool")
        for b in evictable:
            _check(b in self._block_hash, f"evictable block {b} has no hash (it should be in the plain free list)")
        for b in free_set:
            _check(b not in self._block_hash, f"plain free block {b} is still registered in the prefix cache")
        _check(len(self._hash_to_block) == len(self._block_hash),
               f"hash->block ({len(self._hash_to_block)}) and block->hash ({len(self._block_hash)}) sizes differ")
        for h, b in self._hash_to_block.items():
            _check(self._block_hash.get(b) == h, f"hash map: {h:#x} -> block {b}, but block {b} -> {self._block_hash.get(b)}")
        _check(set(self._block_key) == set(self._block_hash), "cached blocks without stored (parent, tokens), or vice versa")
        for b, (parent, tokens) in self._block_key.items():
            _check(len(tokens) == bs, f"cached block {b} stores {len(tokens)} tokens, expected a full block of {bs}")
            _check(parent is None or (0 <= parent[0] < n and parent[1] <= self._gen[parent[0]]),
                   f"cached block {b} has an invalid parent reference {parent}")
        if not self.enable_prefix_caching:
            _check(not self._hash_to_block and not evictable, "prefix caching is disabled but blocks are cached")
