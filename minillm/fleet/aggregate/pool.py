"""The requests in flight across the whole fleet, as columns (one row a request, any replica): memory grows with
the requests in flight, never with the run. Rows are reused through a free list; the columns double when full."""
from __future__ import annotations

import numpy as np

# A row's state. WAITING: queued on its replica (new, or preempted); PREFILL: the one running request of its
# replica whose prompt is still being computed in chunks; DECODE: running, one token a step.
FREE, WAITING, PREFILL, DECODE = 0, 1, 2, 3

# name -> dtype of the per-request columns. Times are NaN until they happen.
COLUMNS = {
    "rid": np.int64, "rep": np.int64, "arrival": np.float64, "prompt": np.int64,
    "out": np.int64,            # the output length it will reach (capped by the context limit)
    "charge": np.int64,         # its share of the replica's outstanding tokens (what least-tokens routes on)
    "state": np.int8,
    "order": np.int64,          # queue position key: arrival order; a preempted request goes to the head
    "admitted": np.int64,       # admission order: running requests are served, and preempted, by it
    "computed": np.int64,       # KV positions computed (WAITING, PREFILL; a decoder's follow from its step count)
    "emitted": np.int64,        # output tokens produced (a decoder: at its decode start)
    "s0": np.int64,             # a decoder's first decode step (its replica's step counter)
    "c0": np.int64,             # a decoder's computed positions at its decode start
    "finish_step": np.int64,    # a decoder's last step
    "due": np.int64,            # a decoder: the round to look at it (when it can finish at the earliest), else -1
    "first_sched": np.float64, "first_token": np.float64,
    "cached": np.int64,         # prompt tokens its first admission found in the prefix cache (-1: not yet)
    "hits": np.int64,           # cached tokens over all its admissions (token conservation)
    "lost": np.int64,           # positions computed then thrown away by preemption
    "preemptions": np.int64,
    "shared": np.int64,         # blocks of its table that are counted in the cache's nodes, not as its own
    "own_blocks": np.int64,     # a preempted request's own blocks left in the cache, and until when they stay
    "own_until": np.int64,
}


class Pool:
    def __init__(self, capacity: int = 1024) -> None:
        self.capacity = 0
        self.width = self.fwidth = 0
        self.free: list[int] = []
        self.cols: dict[str, np.ndarray] = {k: np.zeros(0, t) for k, t in COLUMNS.items()}
        self.node_key = self.node_blocks = self.node_entry = np.zeros((0, 0), np.int64)
        self.node_ref = np.zeros((0, 0), bool)
        self.fin_key = self.fin_blocks = self.fin_parent = np.zeros((0, 0), np.int64)
        self.grow(capacity)

    def __getattr__(self, name: str) -> np.ndarray:     # pool.rep, pool.state, ...: the columns
        try:
            return self.__dict__["cols"][name]
        except KeyError:
            raise AttributeError(name) from None

    @property
    def in_flight(self) -> int:
        return self.capacity - len(self.free)

    def grow(self, capacity: int, width: int = 0, fwidth: int = 0) -> None:
        """At least `capacity` rows and node matrices `width` / `fwidth` wide (new rows FREE, new nodes empty)."""
        old = self.capacity
        if capacity > old:
            capacity = max(capacity, 2 * old)
            for k, v in self.cols.items():
                self.cols[k] = np.concatenate([v, np.full(capacity - old, -1 if k == "due" else 0, v.dtype)])
            self.free.extend(range(capacity - 1, old - 1, -1))
            self.capacity = capacity
        capacity = self.capacity
        self.width, self.fwidth = max(self.width, width), max(self.fwidth, fwidth)
        self.node_key = _fit(self.node_key, capacity, self.width)
        self.node_blocks = _fit(self.node_blocks, capacity, self.width)
        self.node_entry = _fit(self.node_entry, capacity, self.width, -1)
        self.node_ref = _fit(self.node_ref, capacity, self.width)
        self.fin_key = _fit(self.fin_key, capacity, self.fwidth)
        self.fin_blocks = _fit(self.fin_blocks, capacity, self.fwidth)
        self.fin_parent = _fit(self.fin_parent, capacity, self.fwidth)

    def take(self, n: int) -> np.ndarray:
        """n free rows (their columns still hold old values: the caller sets every one it reads)."""
        if n > len(self.free):
            self.grow(self.in_flight + n)
        rows = np.array(self.free[-n:][::-1] if n else [], np.int64)
        del self.free[len(self.free) - n:]
        return rows

    def release(self, rows: np.ndarray) -> None:
        self.state[rows] = FREE
        self.due[rows] = -1
        self.node_ref[rows] = False
        self.node_entry[rows] = -1
        self.free.extend(rows.tolist())


def _fit(a: np.ndarray, rows: int, width: int, fill=0) -> np.ndarray:
    if a.shape == (rows, width):
        return a
    out = np.full((rows, width), fill, a.dtype)
    out[:a.shape[0], :a.shape[1]] = a
    return out
