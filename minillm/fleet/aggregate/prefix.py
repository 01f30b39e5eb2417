"""Every replica's prefix cache, as nodes (shareable prefixes, see columns.py) instead of blocks.

An entry is one (replica, node): the node's blocks are cached on that replica. `refs` counts the running requests
there that hold it; `excl` is its blocks beyond its parent node's (what it adds to the pool, counted once however
many requests share it). An entry nobody holds is *evictable*, as the engine's evictor keeps a released block's KV
until the pool needs it:

    the engine takes a block from its free list first, then evicts the least recently released cached block;
    so a node released when the pool had `room` blocks not in use survives the next `room` blocks taken.

`taken` (per replica, kept by the caller) counts blocks taken from the pool; a released entry stays alive while
taken < until = taken at release + room. That is LRU at node granularity, without a block list.

Lookups go through one dict (mixed key -> entry row); rows are numpy columns, recycled by `sweep`, so the dict
holds what is cached or held, which the pool size bounds.
"""
from __future__ import annotations

import numpy as np

from minillm.fleet.aggregate.columns import mix


class NodeCache:
    def __init__(self, capacity: int = 1024) -> None:
        self.index: dict[int, int] = {}
        self.key = np.zeros(0, np.int64)        # its mixed key (0: the row is free)
        self.rep = np.zeros(0, np.int64)
        self.refs = np.zeros(0, np.int64)
        self.until = np.zeros(0, np.int64)      # alive while its replica's taken < until (when refs == 0)
        self.excl = np.zeros(0, np.int64)
        self.free: list[int] = []
        self._grow(capacity)

    def __len__(self) -> int:
        return len(self.index)

    def _grow(self, capacity: int) -> None:
        old = len(self.key)
        for name in ("key", "rep", "refs", "until", "excl"):
            a = getattr(self, name)
            setattr(self, name, np.concatenate([a, np.zeros(capacity - old, np.int64)]))
        self.free.extend(range(capacity - 1, old - 1, -1))

    def find(self, node_key: np.ndarray, rep: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """For node keys (n, K) (0: none) of requests on replicas rep (n,): their entry rows (-1: not cached) and
        their mixed dict keys (0 where there is no node)."""
        where = np.nonzero(node_key)
        mixed = np.zeros_like(node_key)
        mixed[where] = mix(node_key[where], rep[where[0]])
        rows = np.full(node_key.shape, -1, np.int64)
        get = self.index.get
        rows[where] = [get(k, -1) for k in mixed[where].tolist()]
        return rows, mixed

    def alive(self, rows: np.ndarray, taken: np.ndarray) -> np.ndarray:
        """Whether each entry (-1: none) is cached now: held, or released and not yet evicted."""
        r = np.maximum(rows, 0)
        return (rows >= 0) & ((self.refs[r] > 0) | (taken[self.rep[r]] < self.until[r]))

    def add(self, mixed: np.ndarray, rep: np.ndarray, excl: np.ndarray, until: np.ndarray) -> np.ndarray:
        """New entries (keys not in the index, distinct), unheld; their rows."""
        if len(mixed) > len(self.free):
            self._grow(max(2 * len(self.key), len(self.key) + len(mixed)))
        rows = np.array(self.free[len(self.free) - len(mixed):][::-1], np.int64)
        del self.free[len(self.free) - len(mixed):]
        self.key[rows], self.rep[rows], self.excl[rows], self.until[rows] = mixed, rep, excl, until
        self.refs[rows] = 0
        self.index.update(zip(mixed.tolist(), rows.tolist()))
        return rows

    def hold(self, rows: np.ndarray, delta: int) -> np.ndarray:
        """refs += delta for each row (repeats count); the distinct rows whose holders went 0 -> some (delta > 0)
        or some -> 0 (delta < 0): their blocks start / stop counting as in use."""
        if not len(rows):
            return rows
        u, c = np.unique(rows, return_counts=True)
        before = self.refs[u].copy()
        self.refs[u] += delta * c
        return u[before == 0] if delta > 0 else u[self.refs[u] == 0]

    def sweep(self, taken: np.ndarray) -> int:
        """Forget the entries evicted by now; how many."""
        dead = np.flatnonzero((self.key != 0) & (self.refs == 0) & (taken[self.rep] >= self.until))
        for k in self.key[dead].tolist():
            del self.index[k]
        self.key[dead] = 0
        self.free.extend(dead.tolist())
        return len(dead)
