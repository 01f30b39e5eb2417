"""The routers of routers.py deciding a whole batch of arrivals at once, each request as the original would, given
the replicas' loads at the batch's start plus what the batch itself added (the aggregate simulator routes the
arrivals of one round together: the loads it sees are at most one step old).

* round-robin: a counter, vectorized;
* least-tokens: a heap of (outstanding tokens, replica) over the k + 1 least loaded replicas (k arrivals can
  only ever reach those), so a batch costs O(R) numpy + O(k log k) Python;
* prefix-aware: the same ring and bounded-load rule as routers.PrefixAware (its ring, its capacity formula),
  the ring position by numpy for the whole batch; a request whose first replica is full walks on in ring order,
  starting, for the hot keys, where the last walk of the batch found room (loads only grow within a batch).
"""
from __future__ import annotations

import heapq
from typing import Protocol

import numpy as np

from minillm.fleet.aggregate.columns import RequestBatch
from minillm.fleet.routers import PrefixAware, load_bound


class BatchRouter(Protocol):
    def route(self, batch: RequestBatch, cost: np.ndarray, outstanding: np.ndarray, nreq: np.ndarray) -> np.ndarray:
        """Replica of each request. `cost`: the tokens each adds to its replica's outstanding (0 for a request the
        replica refuses); `outstanding`, `nreq`: the loads now (not to be modified)."""


class RoundRobinBatch:
    def __init__(self, num_replicas: int) -> None:
        self.R, self.next = num_replicas, 0

    def route(self, batch, cost, outstanding, nreq) -> np.ndarray:
        reps = (self.next + np.arange(len(batch))) % self.R
        self.next = int(self.next + len(batch)) % self.R
        return reps


class LeastTokensBatch:
    def route(self, batch, cost, outstanding, nreq) -> np.ndarray:
        R, k = len(outstanding), len(batch)
        if k + 1 < R:    # (load, index) is a strict order: the k + 1 smallest are the only candidates
            cand = np.argpartition(outstanding * R + np.arange(R), k)[:k + 1]
        else:
            cand = np.arange(R)
        heap = list(zip(outstanding[cand].tolist(), cand.tolist()))
        heapq.heapify(heap)
        reps = []
        for c in cost.tolist():
            load, r = heap[0]
            reps.append(r)
            heapq.heapreplace(heap, (load + c, r))
        return np.array(reps, np.int64)


class PrefixAwareBatch:
    def __init__(self, ring: PrefixAware, num_replicas: int) -> None:
        points, owners = ring.ring()
        self.points, self.owners = np.array(points, np.uint64), np.array(owners, np.int64)
        self.R, self.eps = num_replicas, ring.epsilon
        self._orders: dict[int, np.ndarray] = {}
        if self.owners.max() >= num_replicas:
            raise ValueError("the prefix-aware ring has more replicas than the fleet")

    def order(self, start: int) -> list[int]:
        """Distinct replicas in ring order from point `start` (what PrefixAware.route walks)."""
        got = self._orders.get(start)
        if got is None:
            rolled = np.roll(self.owners, -start)
            _, first = np.unique(rolled, return_index=True)
            got = rolled[np.sort(first)].tolist()
            if len(self._orders) > 256:      # hot keys are few; don't let a trace of unique keys pile up
                self._orders.clear()
            self._orders[start] = got
        return got

    def route(self, batch, cost, outstanding, nreq) -> np.ndarray:
        starts = (np.searchsorted(self.points, batch.route_key, side="left") % len(self.points)).tolist()
        first = self.owners[starts].tolist()
        load, tokens = nreq.tolist(), outstanding.tolist()
        total, walks = int(nreq.sum()), {}
        reps = []
        for j, (ok, c) in enumerate(zip(batch.route_ok.tolist(), cost.tolist())):
            if not ok:      # shorter than a block: no key, least outstanding tokens (PrefixAware's fallback)
                r = min(range(self.R), key=lambda i: (tokens[i], i))
            else:
                cap = load_bound(total, self.R, self.eps)
                r = first[j]
                if load[r] >= cap:      # full: walk on in ring order, from where this batch's last walk stopped
                    w = walks.get(starts[j])
                    if w is None or w[0] != cap:
                        w = walks[starts[j]] = self._walk_from(starts[j], cap, nreq)
                    order, i = w[1], w[2]
                    while i < len(order) and load[order[i]] >= cap:
                        i += 1
                    w[2] = i
                    r = order[i] if i < len(order) else min(range(self.R), key=lambda k: (load[k], k))
            reps.append(r)
            load[r] += c > 0            # a refused request (cost 0) never joins its replica
            total += c > 0
            tokens[r] += c
        return np.array(reps, np.int64)

    def _walk_from(self, start: int, cap: int, loads0: np.ndarray) -> list:
        """[cap, the ring order from `start`, where to begin]: loads only grow within a batch, so the first
        replica under `cap` at the batch's start (numpy over its loads) is a lower bound for every walk of the
        batch from `start` with that cap. (None under cap: PrefixAware's least-tokens fallback, unreachable since
        some replica is at or below the mean.)"""
        order = self.order(start)
        below = np.flatnonzero(loads0[order] < cap)
        return [cap, order, int(below[0]) if len(below) else len(order)]


def make_batch_router(name: str, num_replicas: int, ring: PrefixAware | None = None) -> BatchRouter:
    if name == "round-robin":
        return RoundRobinBatch(num_replicas)
    if name == "least-tokens":
        return LeastTokensBatch()
    if name == "prefix-aware":
        if ring is None:
            raise ValueError("prefix-aware needs its ring (a routers.PrefixAware)")
        return PrefixAwareBatch(ring, num_replicas)
    raise ValueError(f"the fast engine has no batch version of router {name!r}: use --engine exact")
