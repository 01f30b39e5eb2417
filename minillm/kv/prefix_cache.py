"""Prefix-cache building blocks: the chained block hash, the cached-prefix lookup, the LRU evictor, and stats.

A *full* KV block is identified by the tokens it holds **and everything before it**: the K/V of token t depends
on all tokens before t (attention) and on t's position (RoPE). So block i's key is chained,
``h_i = hash_fn(h_{i-1}, tokens_of_block_i)`` with ``h_{-1} = None``; two blocks get the same key only if their
whole prefixes are equal -- up to hash collisions, which the lookup guards against exactly: every cached block
records its tokens and the block holding its prefix (``CachedBlock``), and a hit counts only when both agree, so
the hash only finds candidates. These are the engine's implementations of three seams (minillm.interfaces):
HashFn (default_hash_fn), PrefixLookup (find_cached_prefix) and Evictor (LRUEvictor).
"""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Iterator, Optional, Sequence

from minillm.interfaces import CachedBlock, HashFn

__all__ = ["CachedBlock", "HASH_MASK", "LRUEvictor", "PrefixCacheStats", "default_hash_fn", "find_cached_prefix"]

HASH_MASK = (1 << 128) - 1   # block hashes are 128-bit: a parent hash is taken modulo 2**128


def default_hash_fn(parent: int | None, tokens: Sequence[int]) -> int:
    """128-bit BLAKE2b of (parent hash, token ids), as a non-negative int.

    Why not ``hash((parent, tokens))``?
      * It is only 64 bits and not collision resistant: ``hash(-1) == hash(-2)`` and tuple
        hashes are easy to collide on purpose; a collision in a prefix cache silently serves
        another request's KV (a correctness and a privacy bug).
      * BLAKE2b is deterministic across processes, machines and Python versions (no
        PYTHONHASHSEED dependence for any input type), so hashes can be logged, compared
        between runs, or used by a cache shared between workers.
    Cost: ~1 us per block (one hash per ``block_size`` tokens) -- negligible next to a forward pass.
    """
    h = hashlib.blake2b(digest_size=16)
    if parent is None:
        h.update(b"\x00")
    else:
        h.update(b"\x01")
        h.update((parent & HASH_MASK).to_bytes(16, "little"))
    try:
        h.update(array("q", tokens).tobytes())
    except OverflowError:  # token ids beyond int64: fall back to a length-prefixed encoding
        for t in tokens:
            b = int(t).to_bytes((int(t).bit_length() + 8) // 8, "little", signed=True)
            h.update(len(b).to_bytes(1, "little") + b)
    return int.from_bytes(h.digest(), "little")


def find_cached_prefix(token_ids: Sequence[int], block_size: int, cache: Mapping[int, CachedBlock],
                       hash_fn: HashFn) -> list[int]:
    """Physical blocks of the longest chain of cached full blocks the prompt starts with.

    Stops at the first block whose hash misses or whose cached entry holds other tokens or another parent (a
    collision), and never takes the prompt's last token: at most (len - 1) // block_size blocks, so at least one
    token is computed (its logits give the next token) and a block-aligned prompt does not end on a shared block."""
    blocks: list[int] = []
    parent_hash: Optional[int] = None
    for start in range(0, (len(token_ids) - 1) // block_size * block_size, block_size):
        tokens = tuple(token_ids[start:start + block_size])
        parent_hash = hash_fn(parent_hash, tokens)
        entry = cache.get(parent_hash)
        if entry is None or entry.tokens != tokens or entry.parent != (blocks[-1] if blocks else None):
            break
        blocks.append(entry.block_id)
    return blocks


@dataclass
class PrefixCacheStats:
    """Counters for the prefix cache.

    hits / misses: per full prompt block eligible for reuse at admission (a block after the first
    miss can't be a hit, so it counts as a miss); hit_rate = hits / (hits + misses).
    collisions: lookups whose hash matched a cached block holding different content (tokens or prefix).
    evictions: cached, unreferenced blocks reclaimed for new data (they lose their hash).
    """
    hits: int = 0
    misses: int = 0
    collisions: int = 0
    evictions: int = 0

    @property
    def queries(self) -> int:
        return self.hits + self.misses

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0

    def reset(self) -> None:
        self.hits = self.misses = self.collisions = self.evictions = 0


class LRUEvictor:
    """The set of cached blocks with ref_count 0, in eviction order (least recently freed first)."""

    def __init__(self) -> None:
        self.order: OrderedDict[int, None] = OrderedDict()

    def add(self, block: int) -> None:
        """Mark `block` evictable as the most recently used (it is evicted last)."""
        self.order.pop(block, None)
        self.order[block] = None

    def remove(self, block: int) -> None:
        """Take `block` out (it was revived by a prefix hit, or un-cached)."""
        del self.order[block]

    def pop_lru(self) -> int:
        """Remove and return the least recently freed block."""
        return self.order.popitem(last=False)[0]

    def clear(self) -> list[int]:
        blocks = list(self.order)
        self.order.clear()
        return blocks

    def __contains__(self, block: object) -> bool:
        return block in self.order

    def __len__(self) -> int:
        return len(self.order)

    def __iter__(self) -> Iterator[int]:
        """Blocks in eviction order (next victim first)."""
        return iter(self.order)
