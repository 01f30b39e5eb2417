"""Arrivals: request batches consumed in time order, one batch ahead at most, and the pool rows new requests
take."""
from __future__ import annotations

import math
from collections.abc import Iterable, Iterator

import numpy as np

from minillm.fleet.aggregate.columns import RequestBatch, empty_batch
from minillm.fleet.aggregate.pool import WAITING
from minillm.fleet.aggregate.state import FleetState


class Arrivals:
    """The request batches, consumed in time order without holding more than one batch ahead."""

    def __init__(self, batches: Iterable[RequestBatch]) -> None:
        self._it: Iterator[RequestBatch] = iter(batches)
        self._cur, self._pos = empty_batch(), 0
        self._fill()

    def _fill(self) -> None:
        while self._pos >= len(self._cur):
            nxt = next(self._it, None)
            if nxt is None:
                return
            self._cur, self._pos = nxt, 0

    def next_time(self) -> float:
        return float(self._cur.arrival[self._pos]) if self._pos < len(self._cur) else math.inf

    def until(self, t: float) -> RequestBatch:
        """Every request arriving at or before t."""
        parts = []
        while self._pos < len(self._cur):
            end = int(np.searchsorted(self._cur.arrival, t, side="right"))
            if end > self._pos:
                parts.append(self._cur.take(slice(self._pos, end)))
            self._pos = max(self._pos, end)
            if self._pos < len(self._cur):
                break
            self._fill()
        return parts[0] if len(parts) == 1 else RequestBatch.concat(parts) if parts else empty_batch()


def queue(st: FleetState, rows: np.ndarray, b: RequestBatch, reps: np.ndarray) -> None:
    """New requests (batch b, accepted ones) take pool rows on their replicas' queues, in arrival order."""
    p = st.pool
    c = p.cols
    c["rid"][rows], c["rep"][rows], c["arrival"][rows], c["prompt"][rows] = b.request_id, reps, b.arrival, \
        b.prompt_len
    c["out"][rows] = np.minimum(b.output_len, st.max_model_len - b.prompt_len)
    c["charge"][rows] = b.prompt_len + b.output_len
    c["state"][rows] = WAITING
    c["order"][rows] = st.arrived + np.arange(len(rows))
    st.arrived += len(rows)
    for name in ("computed", "emitted", "hits", "lost", "preemptions", "shared", "own_blocks", "own_until"):
        c[name][rows] = 0
    c["cached"][rows] = -1
    c["first_sched"][rows] = c["first_token"][rows] = np.nan
    k, kf = (b.node_key.shape[1], b.finish_key.shape[1]) if st.caching else (0, 0)
    for mat, src, width in ((p.node_key, b.node_key, k), (p.node_blocks, b.node_blocks, k),
                            (p.fin_key, b.finish_key, kf), (p.fin_blocks, b.finish_blocks, kf),
                            (p.fin_parent, b.finish_parent, kf)):
        mat[rows] = 0
        mat[rows, :width] = src[:, :width]
    p.node_blocks[rows] = np.where(p.node_key[rows] != 0, p.node_blocks[rows], 0)
    p.node_entry[rows], p.node_ref[rows] = -1, False
