"""Paged-KV block manager: block tables, ref counts, copy-on-write and prefix caching.

The KV pool (kv/cache.py) is `num_blocks` fixed-size blocks of `block_size` token slots. This module only does
the bookkeeping (pure Python, no tensors):

* every sequence (an int ``seq_id``) has a *block table*: the physical block ids holding its positions
  0, 1, 2, ... (position p lives in slot ``table[p // bs] * bs + p % bs``);
* a block can be in several tables (prefix-cache hits, ``fork`` for n>1 sampling / beams): the allocator counts
  the holders of every block;
* a shared block is never written: before writing into a block another table also holds, the sequence gets a
  private copy (copy-on-write); the manager returns ``(src, dst)`` pairs and the caller copies the K/V
  (``KVCache.copy_blocks``);
* full blocks whose KV has been computed are registered in the prefix cache under a chained hash (see
  prefix_cache.py). The cache holds a reference of its own on every block it registers, so when the last
  sequence lets go the block stays *cached but evictable* (in the evictor) and a later prompt with the same
  prefix can revive it, until it is evicted (LRU) for new data.

The seams (minillm.interfaces): the allocator, the slot mapping, the block hash, the prefix lookup and the
evictor are class attributes a subclass may set, or constructor arguments. A subclass may also replace the
paging core -- ``num_blocks_needed``, ``append_slots``, ``fork``, ``free`` (lab02) -- working on ``tables``,
``computed`` and ``allocator`` with the helpers ``table``, ``cdiv`` and ``written_blocks``; such a subclass
runs with ``enable_prefix_caching=False`` (prefix caching needs the core's cache bookkeeping).

How ``num_computed_tokens`` reaches ``append_slots``: ``allocate_prompt`` sets it to the number of cached
tokens and ``commit_computed(seq_id, token_ids, n)`` (called after every forward pass) sets it to ``n``;
``append_slots(seq_id, num_tokens)`` writes positions [num_computed, num_tokens). Its keyword-only override
``num_computed_tokens=`` replaces the tracked value (a smaller one rolls back, e.g. rejected speculative tokens).
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional, Sequence

from minillm import interfaces
from minillm.interfaces import CachedBlock
from minillm.kv.block_allocator import BlockAllocator, NoFreeBlocksError
from minillm.kv.prefix_cache import LRUEvictor, PrefixCacheStats, default_hash_fn, find_cached_prefix

__all__ = ["BlockManager", "NoFreeBlocksError", "PrefixCacheStats", "default_hash_fn", "slot_mapping"]

# Identity of one block's *content*: (block id, generation). A block's generation is bumped whenever its content
# changes (it is taken from the free pool, or rewritten after a roll-back), so a stale reference to a block that
# has since been reused never matches.
BlockRef = tuple[int, int]


class _Stale:
    """The parent of a cached block whose parent block has been reused since: equal to no block id."""

    def __repr__(self) -> str:
        return "<stale parent>"


_STALE = _Stale()


def slot_mapping(block_table: Sequence[int], start: int, end: int, block_size: int) -> list[int]:
    """Flat KV-pool slot of each position in [start, end): table[p // bs] * bs + p % bs, one block's run at a
    time (a prefill chunk is a few contiguous runs, and range() builds each in C)."""
    slots: list[int] = []
    for i in range(start // block_size, -(-end // block_size)):
        first, last = max(start, i * block_size), min(end, (i + 1) * block_size)
        base = block_table[i] * block_size - i * block_size
        slots.extend(range(base + first, base + last))
    return slots


@dataclass
class _HashChain:
    """Prefix-cache state of one sequence, for each computed full block i:"""
    hashes: list[int] = field(default_factory=list)     # h_i = hash_fn(h_{i-1}, tokens_i)
    canon: list[BlockRef] = field(default_factory=list)  # a block holding exactly the KV of blocks 0..i (its own
    #                                                      block, or an equal one already cached)


def _check(cond: bool, msg: str) -> None:
    if not cond:  # not `assert`: must also work under python -O
        raise AssertionError(msg)


class BlockManager:
    # The seams, overridable by a subclass (class attributes) or per instance (constructor arguments).
    allocator_cls: Callable[[int], interfaces.BlockAllocator] = BlockAllocator
    slot_mapping_fn: interfaces.SlotMapping = staticmethod(slot_mapping)
    hash_fn: interfaces.HashFn = staticmethod(default_hash_fn)
    prefix_lookup: interfaces.PrefixLookup = staticmethod(find_cached_prefix)
    evictor_cls: Callable[[], interfaces.Evictor] = LRUEvictor

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True, *,
                 allocator_cls: Optional[Callable[[int], interfaces.BlockAllocator]] = None,
                 slot_mapping_fn: Optional[interfaces.SlotMapping] = None,
                 hash_fn: Optional[interfaces.HashFn] = None,
                 prefix_lookup: Optional[interfaces.PrefixLookup] = None,
                 evictor_cls: Optional[Callable[[], interfaces.Evictor]] = None) -> None:
        if not (isinstance(num_blocks, int) and isinstance(block_size, int)) or num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"num_blocks and block_size must be positive integers, got {num_blocks!r}, {block_size!r}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.enable_prefix_caching = bool(enable_prefix_caching)
        cls = type(self)   # read through the class: a plain function stored on it must not bind to self
        self.allocator: interfaces.BlockAllocator = (allocator_cls or cls.allocator_cls)(num_blocks)
        self.slot_mapping_fn = slot_mapping_fn or cls.slot_mapping_fn
        self.hash_fn = hash_fn or cls.hash_fn
        self.prefix_lookup = prefix_lookup or cls.prefix_lookup
        self.evictor: interfaces.Evictor = (evictor_cls or cls.evictor_cls)()
        self.stats = PrefixCacheStats()
        # Per sequence: its block table, how many of its positions hold computed KV, its hash chain.
        self.tables: dict[int, list[int]] = {}
        self.computed: dict[int, int] = {}
        self._chains: dict[int, _HashChain] = {}
        # The prefix cache: hash -> block, block -> hash, and block -> (parent BlockRef, tokens), what the block
        # really holds (compared on every hit, so a hash collision can never serve wrong KV).
        self._hash_to_block: dict[int, int] = {}
        self._block_hash: dict[int, int] = {}
        self._block_key: dict[int, tuple[Optional[BlockRef], tuple]] = {}
        self._gen = [0] * num_blocks

    # ------------------------------------------------------------------ queries
    @property
    def num_free_blocks(self) -> int:
        """Blocks allocatable now: the allocator's free ones plus cached-but-unreferenced (evictable) ones."""
        return self.allocator.num_free_blocks + len(self.evictor)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    def has_seq(self, seq_id: int) -> bool:
        return seq_id in self.tables

    def block_table(self, seq_id: int) -> list[int]:
        """Physical block ids of `seq_id`, in position order (a copy)."""
        return list(self.table(seq_id, "block_table"))

    def num_computed_tokens(self, seq_id: int) -> int:
        """The tracked number of positions whose KV is valid (see module docstring)."""
        self.table(seq_id, "num_computed_tokens")
        return self.computed[seq_id]

    def ref_count(self, block_id: int) -> int:
        """How many block-table entries hold the block (the prefix cache's own hold is not counted)."""
        return self.allocator.ref_count(block_id) - (block_id in self._block_hash)

    @property
    def cached_blocks(self) -> Mapping[int, CachedBlock]:
        """The prefix cache, read-only: {hash: CachedBlock(block_id, parent, tokens)} (the PrefixLookup seam's view)."""
        return _CacheView(self)

    # ------------------------------------------------------------------ helpers (also for subclasses)
    def table(self, seq_id: int, op: str = "table") -> list[int]:
        """The sequence's block table itself (mutable), or a KeyError naming the operation and the unknown id."""
        try:
            return self.tables[seq_id]
        except KeyError:
            raise KeyError(f"{op}: unknown seq_id {seq_id!r} (not allocated with allocate_prompt/fork, "
                           f"or already freed)") from None

    def cdiv(self, n: int) -> int:
        """ceil(n / block_size): blocks that n positions occupy."""
        return -(-int(n) // self.block_size)

    def written_blocks(self, seq_id: int, num_tokens: int, num_computed_tokens: Optional[int] = None) -> list[int]:
        """Indices into the table of the blocks the sequence already has that positions [computed, num_tokens)
        fall in: the existing blocks a write would touch."""
        table = self.table(seq_id, "append_slots")
        done = self.computed[seq_id] if num_computed_tokens is None else num_computed_tokens
        if num_tokens <= done:
            return []
        return list(range(done // self.block_size, min(self.cdiv(num_tokens), len(table))))

    def take_block(self) -> int:
        """A block with no live data for one table (ref 1): a free one if any, else the LRU evictable cached one."""
        if not self.allocator.num_free_blocks:
            if not len(self.evictor):  # callers check capacity first; reaching here is a bug
                raise NoFreeBlocksError("no free blocks")
            self._uncache(self.evictor.pop_lru(), popped=True)
            self.stats.evictions += 1
        b = self.allocator.allocate()
        self._gen[b] += 1  # new content: stale references to the old content must not match
        return b

    def release(self, block: int) -> None:
        """Drop one table's hold on `block`. A cached block nobody else holds becomes evictable."""
        self.allocator.free(block)
        if block in self._block_hash and self.allocator.ref_count(block) == 1:
            self.evictor.add(block)    # only the cache holds it now: keep its KV for future prefix hits

    def _uncache(self, b: int, popped: bool = False) -> None:
        """Forget cached block b and drop the cache's hold (popped: the evictor already let go of it)."""
        if not popped and self.allocator.ref_count(b) == 1:
            self.evictor.remove(b)     # nobody but the cache held it
        h = self._block_hash.pop(b)
        self._block_key.pop(b)
        if self._hash_to_block.get(h) == b:
            del self._hash_to_block[h]
        self.allocator.free(b)

    # ------------------------------------------------------------------ prefix lookup
    def _ref_of(self, block: int) -> BlockRef:
        return (block, self._gen[block])

    def _lookup(self, token_ids: Sequence[int], count_stats: bool) -> list[int]:
        """The cached blocks the prompt may reuse (through the prefix_lookup seam), checked for shape."""
        max_blocks = (len(token_ids) - 1) // self.block_size
        if not self.enable_prefix_caching or max_blocks <= 0:
            if count_stats and self.enable_prefix_caching:
                self.stats.misses += max_blocks
            return []
        blocks = self.prefix_lookup(list(token_ids), self.block_size, _CacheView(self), self.hash_fn)
        blocks = list(blocks)
        if len(blocks) > max_blocks or len(set(blocks)) != len(blocks) or \
                any(type(b) is not int or b not in self._block_hash for b in blocks):
            raise ValueError(f"prefix_lookup returned {blocks!r} for a {len(token_ids)}-token prompt: expected at "
                             f"most {max_blocks} distinct ids of cached blocks (keys of cached_blocks' entries)")
        if count_stats:
            if len(blocks) < max_blocks:   # did a hash hit that verification turned down?
                bs, h = self.block_size, None
                for i in range(len(blocks) + 1):
                    h = self.hash_fn(h, tuple(token_ids[i * bs:(i + 1) * bs]))
                if h in self._hash_to_block:
                    self.stats.collisions += 1
            self.stats.hits += len(blocks)
            self.stats.misses += max_blocks - len(blocks)
        return blocks

    def peek_prefix(self, token_ids: Sequence[int]) -> int:
        """Number of tokens allocate_prompt(token_ids) would get from the cache now (no side effects)."""
        return len(self._lookup(token_ids, count_stats=False)) * self.block_size

    def blocks_to_admit(self, token_ids: Sequence[int], num_tokens: Optional[int] = None) -> int:
        """By how much num_free_blocks would drop for allocate_prompt(token_ids) followed by
        append_slots(seq, num_tokens or len(token_ids)): new blocks for the uncached part plus cached
        hits that are currently evictable (reviving them takes them out of the free pool)."""
        n = len(token_ids) if num_tokens is None else num_tokens
        hits = self._lookup(token_ids, count_stats=False)
        revived = sum(1 for b in hits if self.ref_count(b) == 0)
        return max(0, self.cdiv(n) - len(hits)) + revived

    # ------------------------------------------------------------------ the sequence life cycle
    def allocate_prompt(self, seq_id: int, token_ids: Sequence[int]) -> int:
        """Admit `seq_id`: create its table from the longest cached prefix and return num_cached_tokens.

        Only full blocks are reused, at most (len(token_ids) - 1) // block_size of them, so at least
        one token is left to compute and the block written next is never a shared cached block.
        Blocks for the uncached rest are NOT allocated here: call append_slots.
        """
        if seq_id in self.tables:
            raise ValueError(f"allocate_prompt: seq_id {seq_id!r} is already allocated")
        if len(token_ids) == 0:
            raise ValueError(f"allocate_prompt: empty token_ids for seq_id {seq_id!r}")
        blocks = self._lookup(token_ids, count_stats=True)
        bs, chain, h = self.block_size, _HashChain(), None
        for i, b in enumerate(blocks):
            if self.allocator.ref_count(b) == 1:
                self.evictor.remove(b)  # revive a cached block only the cache held
            self.allocator.share(b)
            h = self.hash_fn(h, tuple(token_ids[i * bs:(i + 1) * bs]))
            chain.hashes.append(h)
            chain.canon.append(self._ref_of(b))
        self.tables[seq_id] = list(blocks)
        self.computed[seq_id] = len(blocks) * bs
        if self.enable_prefix_caching:
            self._chains[seq_id] = chain
        return len(blocks) * bs

    def _cow_and_new(self, seq_id: int, num_tokens: int, nc: int) -> tuple[list[int], int]:
        """(table indices needing copy-on-write, number of brand-new blocks to append)."""
        table = self.tables[seq_id]
        cow = [i for i in self.written_blocks(seq_id, num_tokens, nc) if self.ref_count(table[i]) > 1]
        return cow, max(0, self.cdiv(num_tokens) - len(table))

    def num_blocks_needed(self, seq_id: int, num_tokens: int, *, num_computed_tokens: Optional[int] = None) -> int:
        """New blocks append_slots(seq_id, num_tokens) would take (incl. copy-on-write).
        Unknown seq_id: ceil(num_tokens / block_size)."""
        if seq_id not in self.tables:
            return self.cdiv(num_tokens)
        nc = self.computed[seq_id] if num_computed_tokens is None else num_computed_tokens
        cow, new = self._cow_and_new(seq_id, num_tokens, nc)
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
        table = self.table(seq_id, "append_slots")
        bs = self.block_size
        nc = self.computed[seq_id] if num_computed_tokens is None else int(num_computed_tokens)
        if not 0 <= nc <= len(table) * bs:
            raise ValueError(f"append_slots: num_computed_tokens={nc} outside [0, {len(table) * bs}] "
                             f"(table of seq {seq_id!r} has {len(table)} blocks)")
        if num_tokens < nc:
            raise ValueError(f"append_slots: num_tokens={num_tokens} < num_computed_tokens={nc} for seq {seq_id!r}")
        cow, new = self._cow_and_new(seq_id, num_tokens, nc)
        if len(cow) + new > self.num_free_blocks:
            raise NoFreeBlocksError(
                f"append_slots(seq {seq_id!r}, {num_tokens} tokens) needs {len(cow) + new} blocks "
                f"({new} new + {len(cow)} copy-on-write), only {self.num_free_blocks} free")
        # --- commit point: nothing below can fail ---
        if nc < self.computed[seq_id]:
            self._rollback(seq_id, nc)
        self.computed[seq_id] = nc
        copies: list[tuple[int, int]] = []
        for i in self.written_blocks(seq_id, num_tokens):
            b = table[i]
            if i in cow:
                table[i] = dst = self.take_block()
                self.release(b)            # shared, so it stays alive for its other holders
                if i * bs < nc:            # it holds valid KV that this sequence still needs
                    copies.append((b, dst))
                continue
            # Written in place (private to this seq): its content changes. Normally that is the partially filled
            # last block; after a roll-back it may be a registered full block, which must leave the cache, and
            # blocks cached as its children must stop matching (generation bump).
            if b in self._block_hash:
                self._uncache(b)
            self._gen[b] += 1
        for _ in range(new):
            table.append(self.take_block())
        return copies

    def _rollback(self, seq_id: int, nc: int) -> None:
        self.computed[seq_id] = nc
        chain = self._chains.get(seq_id)
        if chain is not None:
            del chain.hashes[nc // self.block_size:]
            del chain.canon[nc // self.block_size:]

    def slot_mapping(self, seq_id: int, start: int, end: int) -> list[int]:
        """Flat KV slot of each position in [start, end), through the slot_mapping_fn seam."""
        table = self.table(seq_id, "slot_mapping")
        if not 0 <= start <= end <= len(table) * self.block_size:
            raise ValueError(f"slot_mapping: [{start}, {end}) outside the {len(table) * self.block_size} slots "
                             f"of seq {seq_id!r}")
        slots = self.slot_mapping_fn(list(table), start, end, self.block_size)
        if len(slots) != end - start:
            raise ValueError(f"slot_mapping_fn returned {len(slots)} slots for the {end - start} positions "
                             f"[{start}, {end}) of seq {seq_id!r}")
        return [int(s) for s in slots]

    def commit_computed(self, seq_id: int, token_ids: Sequence[int], num_computed_tokens: int) -> None:
        """KV for positions [0, num_computed_tokens) of `token_ids` is now written: record that, and
        register every newly full block in the prefix cache (keeping an existing mapping for its hash)."""
        table = self.table(seq_id, "commit_computed")
        bs = self.block_size
        nc = int(num_computed_tokens)
        if not 0 <= nc <= min(len(token_ids), len(table) * bs):
            raise ValueError(f"commit_computed: num_computed_tokens={nc} outside [0, min(len(token_ids)="
                             f"{len(token_ids)}, table slots={len(table) * bs})] for seq {seq_id!r}")
        if nc < self.computed[seq_id]:
            self._rollback(seq_id, nc)
        self.computed[seq_id] = nc
        if not self.enable_prefix_caching:
            return
        chain = self._chains.setdefault(seq_id, _HashChain())
        for i in range(len(chain.hashes), nc // bs):
            parent = chain.canon[-1] if chain.canon else None
            tokens = tuple(token_ids[i * bs:(i + 1) * bs])
            h = self.hash_fn(chain.hashes[-1] if chain.hashes else None, tokens)
            chain.hashes.append(h)  # kept even if the block isn't registered: it chains the next one
            b = table[i]
            existing = self._hash_to_block.get(h)
            if existing is not None and self._block_key[existing] == (parent, tokens):
                # The same content is already cached (b itself, or an equal block computed by another
                # sequence): keep that mapping, and chain our next block to it.
                chain.canon.append(self._ref_of(existing))
                continue
            if b in self._block_hash:
                self._uncache(b)       # stale registration of this block under other content
            if existing is None:
                self._hash_to_block[h] = b
                self._block_hash[b] = h
                self._block_key[b] = (parent, tokens)
                self.allocator.share(b)    # the cache's own hold
            # else: a hash collision with other content -- keep the existing mapping; b stays uncached.
            chain.canon.append(self._ref_of(b))

    def fork(self, parent_seq_id: int, child_seq_id: int) -> None:
        """The child shares all of the parent's blocks (one more holder each); writes are copy-on-write."""
        table = self.table(parent_seq_id, "fork")
        if child_seq_id in self.tables:
            raise ValueError(f"fork: child seq_id {child_seq_id!r} is already allocated")
        for b in table:
            self.allocator.share(b)
        self.tables[child_seq_id] = list(table)
        self.computed[child_seq_id] = self.computed[parent_seq_id]
        chain = self._chains.get(parent_seq_id)
        if chain is not None:
            self._chains[child_seq_id] = _HashChain(list(chain.hashes), list(chain.canon))

    def trim(self, seq_id: int, num_tokens: int) -> None:
        """Give back the table's blocks past the first ceil(num_tokens / block_size) (tail first): after a roll-back
        (rejected speculative tokens) a block that holds no kept position is empty again."""
        table = self.table(seq_id, "trim")
        if num_tokens < self.computed[seq_id]:
            raise ValueError(f"trim: seq {seq_id!r} has {self.computed[seq_id]} computed tokens, more than the "
                             f"{num_tokens} to keep: roll back with commit_computed first")
        keep = self.cdiv(num_tokens)
        while len(table) > keep:
            self.release(table.pop())

    def free(self, seq_id: int) -> None:
        """Drop the table and its holds (tail first, so prefix blocks are evicted last). Unknown id: no-op."""
        table = self.tables.pop(seq_id, None)
        if table is None:
            return
        del self.computed[seq_id]
        self._chains.pop(seq_id, None)
        for b in reversed(table):
            self.release(b)

    def reset_prefix_cache(self) -> None:
        """Forget every cached hash; evictable blocks become plain free blocks. Blocks in use keep their KV
        (and sequences keep their hash chains) but are no longer findable."""
        for b in self.evictor.clear():     # held by nobody but the cache: back to the free pool, LRU first
            self._uncache(b, popped=True)
        for b in list(self._block_hash):   # still in tables: they keep their KV, unfindable
            self._uncache(b)

    # ------------------------------------------------------------------ introspection
    def usage(self) -> dict:
        return {
            "num_blocks": self.num_blocks,
            "block_size": self.block_size,
            "num_free": self.num_free_blocks,
            "num_used": self.num_used_blocks,
            "num_cached_evictable": len(self.evictor),
            "num_cached": len(self._block_hash),
            "num_seqs": len(self.tables),
            "seq_table_lens": {sid: len(t) for sid, t in self.tables.items()},
        }

    def check_invariants(self) -> None:
        """Raise AssertionError describing the first broken invariant, if any."""
        n, bs = self.num_blocks, self.block_size
        _check(set(self.computed) == set(self.tables), "tables and computed counts name different sequences")
        counts: Counter[int] = Counter()
        for sid, table in self.tables.items():
            for b in table:
                _check(0 <= b < n, f"seq {sid}: block id {b} out of range [0, {n})")
            counts.update(table)
            _check(0 <= self.computed[sid] <= len(table) * bs,
                   f"seq {sid}: num_computed={self.computed[sid]} exceeds its {len(table)} blocks")
            chain = self._chains.get(sid)
            if chain is not None:
                _check(len(chain.hashes) <= self.computed[sid] // bs,
                       f"seq {sid}: {len(chain.hashes)} block hashes but only {self.computed[sid] // bs} full "
                       "computed blocks")
                _check(len(chain.canon) == len(chain.hashes),
                       f"seq {sid}: {len(chain.canon)} canonical block refs for {len(chain.hashes)} block hashes")
        _check(set(self._chains) <= set(self.tables), "hash chains of sequences that no longer exist")
        for b in range(n):
            _check(self.ref_count(b) == counts[b],
                   f"block {b}: ref_count={self.ref_count(b)} but it appears {counts[b]} time(s) in block tables")
        evictable = list(self.evictor)
        _check(len(set(evictable)) == len(evictable), f"duplicate block(s) in the evictor: {evictable}")
        for b in evictable:
            _check(b in self._block_hash, f"evictable block {b} has no hash (it should be a plain free block)")
            _check(counts[b] == 0, f"evictable block {b} is in {counts[b]} block table(s)")
        for b in self._block_hash:
            _check(counts[b] > 0 or b in self.evictor, f"cached block {b} is in no table and not evictable: lost")
        if isinstance(self.allocator, BlockAllocator):
            pool = list(self.allocator.free_blocks)
            _check(len(set(pool)) == len(pool),
                   f"duplicate block(s) in the free list: {sorted(b for b, c in Counter(pool).items() if c > 1)}")
        held = sum(1 for b in range(n) if self.allocator.ref_count(b) > 0)
        _check(self.allocator.num_free_blocks == n - held,
               f"the allocator has {self.allocator.num_free_blocks} free blocks but {n - held} blocks have no holder")
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


class _CacheView(Mapping):
    """A BlockManager's prefix cache as the PrefixLookup seam sees it: hash -> CachedBlock(block_id, parent, tokens).
    The manager stores the parent as (block id, generation); a parent block reused since reads as stale."""

    def __init__(self, bm: BlockManager) -> None:
        self._bm = bm

    def __getitem__(self, h: int) -> CachedBlock:
        bm = self._bm
        b = bm._hash_to_block[h]
        parent_ref, tokens = bm._block_key[b]
        if parent_ref is None:
            return CachedBlock(b, None, tokens)
        pb, gen = parent_ref
        return CachedBlock(b, pb if bm._gen[pb] == gen else _STALE, tokens)

    def __iter__(self) -> Iterator[int]:
        return iter(list(self._bm._hash_to_block))

    def __len__(self) -> int:
        return len(self._bm._hash_to_block)
