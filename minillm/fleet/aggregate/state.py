"""The aggregate fleet's state and the block bookkeeping every path shares.

Per replica (numpy arrays indexed by replica) the simulator keeps only aggregates of what runs there:
* `n_dec` decoding requests and `dec_ctx` the sum of their computed positions: a decode step's features (tokens,
  KV read, attention pairs) follow from these two without touching a request;
* `phase[r, k]`: how many of its decoders need a fresh KV block at steps s with s = -k (mod block_size) -- a
  decoder whose context is c at step s needs one when c is a multiple of the block size, and c grows by one a
  step, so each decoder has a fixed phase: the step's new blocks are one lookup;
* `p_row`: the one request whose prompt is still being computed in chunks (under the engine's FCFS policy with
  chunked prefill at most one running request has an unfinished prompt: the last one admitted; see schedule.py);
* `private` + `shared` = KV blocks in use: requests' own blocks, and the cached prefix nodes they hold (once);
* `taken`: blocks taken from the pool so far (the node cache's eviction clock);
* `outstanding` (tokens not yet computed or produced) and `nreq` (requests there): what the routers read; a step
  is committed when it starts, so `pend_out` / `pend_req` keep what it changed, and a request arriving before the
  step ends is routed on the loads without it (`loads`), as the exact simulator would see them.

A decoder's own numbers (its context, tokens produced, last step) follow from its decode start and its replica's
step counter, so a step costs numpy work per replica, not per request; requests are touched when they arrive, are
admitted, finish their prompt, finish, or are preempted.
"""
from __future__ import annotations

import numpy as np

from minillm.fleet.aggregate.pool import DECODE, PREFILL, WAITING, Pool
from minillm.fleet.aggregate.prefix import NodeCache
from minillm.fleet.replica import ReplicaConfig


def cdiv(a, b: int):
    return -(-a // b)


def previous_blocks(blocks: np.ndarray) -> np.ndarray:
    """For node block counts (n, K) (0: no node), the count of the node before each (0 for the first)."""
    before = np.maximum.accumulate(blocks, axis=1)
    return np.concatenate([np.zeros((len(blocks), 1), np.int64), before[:, :-1]], axis=1)


class FleetState:
    def __init__(self, cfg: ReplicaConfig, num_replicas: int) -> None:
        check_supported(cfg)
        self.cfg, self.R, self.bs = cfg, num_replicas, cfg.block_size
        pool_tokens = cfg.num_blocks * cfg.block_size
        self.max_model_len = min(cfg.max_model_len or pool_tokens, pool_tokens)
        self.caching = cfg.enable_prefix_caching
        z = lambda: np.zeros(num_replicas, np.int64)     # noqa: E731
        self.steps, self.n_dec, self.dec_ctx, self.private, self.shared = z(), z(), z(), z(), z()
        self.taken, self.outstanding, self.nreq = z(), z(), z()
        self.pend_out, self.pend_req = z(), z()     # what the last step did to them: seen from when it ends
        self.p_row = np.full(num_replicas, -1, np.int64)
        self.phase = np.zeros((num_replicas, self.bs), np.int64)
        self.free_at = np.zeros(num_replicas)
        self.kv_area = np.zeros(num_replicas)
        self.pool, self.cache = Pool(), NodeCache()
        self.waiting = np.zeros(0, np.int64)
        self.round = 0                                      # rounds done (decoders are due by round)
        self.arrived = self.admitted = self.preempted = 0    # order counters
        self.prefill_tokens = self.decode_tokens = self.hit_tokens = self.lost_tokens = 0
        self.kv_peak = 0.0

    # ------------------------------------------------------------------ pool usage
    def used(self, reps=slice(None)) -> np.ndarray:
        return self.private[reps] + self.shared[reps]

    def room(self, reps) -> np.ndarray:
        """Blocks not in use (free or evictable) on those replicas."""
        return self.cfg.num_blocks - self.used(reps)

    def loads(self, t: float) -> tuple[np.ndarray, np.ndarray]:
        """(outstanding tokens, requests) per replica as a router sees them at time t: without what a step still
        running at t will do."""
        running = self.free_at > t
        return self.outstanding - np.where(running, self.pend_out, 0), self.nreq - np.where(running, self.pend_req, 0)

    def running(self) -> np.ndarray:
        return self.n_dec + (self.p_row >= 0)

    def take_blocks(self, reps: np.ndarray, own: np.ndarray, new: np.ndarray) -> None:
        """Requests on `reps` now hold `own` more blocks of their own, `new` of them fresh from the pool (the rest
        revived from the cache)."""
        np.add.at(self.private, reps, own)
        np.add.at(self.taken, reps, new)

    # ------------------------------------------------------------------ cached nodes
    def hold(self, entries: np.ndarray) -> None:
        """Requests start holding these entries (repeats allowed): those nobody held now count as in use."""
        up = self.cache.hold(entries, +1)
        np.add.at(self.shared, self.cache.rep[up], self.cache.excl[up])

    def unhold(self, entries: np.ndarray) -> None:
        """...stop holding them: the last holder gone, an entry is evictable and survives the blocks its replica
        has room for (see prefix.py)."""
        down = self.cache.hold(entries, -1)
        reps = self.cache.rep[down]
        np.subtract.at(self.shared, reps, self.cache.excl[down])
        self.cache.until[down] = self.taken[reps] + self.room(reps)

    def release(self, rows: np.ndarray, computed: np.ndarray) -> None:
        """Rows leave their replica's pool (finished or preempted) with `computed` positions written: their own
        blocks go back (the partial last one to the free list, which delays eviction: taken steps back), and the
        nodes they held are released."""
        p = self.pool
        reps = p.rep[rows]
        np.subtract.at(self.private, reps, cdiv(computed, self.bs) - p.shared[rows])
        np.subtract.at(self.taken, reps, (computed % self.bs != 0).astype(np.int64))
        self.unhold(p.node_entry[rows][p.node_ref[rows]])
        p.node_ref[rows] = False
        p.shared[rows] = 0

    def hits(self, rows: np.ndarray) -> tuple[np.ndarray, ...]:
        """What waiting rows would find cached now: (hit blocks, blocks of nodes nobody held that they would hold,
        which nodes they would hold (n, K), the entries (n, K), blocks of theirs counted in the nodes).

        A hit is the deepest node whose whole chain is cached, at most (tokens - 1) // block_size blocks (one token
        is always computed). A preempted request's own blocks count when they reach further: those not yet evicted
        (the engine frees a table tail first, so its tail goes first, and all of it once the blocks it had room for
        are taken; see prefix.py)."""
        p = self.pool
        reps, ntok = p.rep[rows], p.prompt[rows] + p.emitted[rows]
        cap = (ntok - 1) // self.bs
        keys = p.node_key[rows]
        entries, _ = self.cache.find(keys, reps)
        alive = self.cache.alive(entries, self.taken)
        held = np.logical_and.accumulate(alive | (keys == 0), axis=1) & alive
        blocks = np.minimum(np.max(np.where(held, p.node_blocks[rows], 0), axis=1, initial=0), cap)
        e = np.maximum(entries, 0)
        excl = np.where(held, self.cache.excl[e], 0)
        revived = np.where(held & (self.cache.refs[e] == 0), excl, 0).sum(axis=1)
        shared = excl.sum(axis=1)        # = blocks when the chains agree; what the pool counts either way
        kept = np.clip(p.own_until[rows] - self.taken[reps], 0, p.own_blocks[rows])   # evicted tail first
        own = kept > blocks
        blocks = np.where(own, np.minimum(kept, cap), blocks)
        held[own] = False
        return blocks, np.where(own, 0, revived), held, entries, np.where(own, 0, shared)

    def publish(self, rows: np.ndarray) -> None:
        """Rows computed more of their prompts: the nodes now wholly computed enter the cache, held by the row (the
        engine registers every full block at commit). A node already cached stays the other request's (the engine
        keeps the existing block for a hash; this row's copy stays its own); of two rows publishing one node in a
        step, the first registers it."""
        p = self.pool
        computed = (p.computed[rows] // self.bs)[:, None]
        keys = np.where(p.node_ref[rows] | (p.node_blocks[rows] > computed), 0, p.node_key[rows])
        if not keys.any():
            return
        reps = p.rep[rows]
        entries, mixed = self.cache.find(keys, reps)
        alive = self.cache.alive(entries, self.taken)
        i, j = np.nonzero((keys != 0) & ~alive)
        key = mixed[i, j]
        _, first = np.unique(key, return_index=True)
        i, j, key = i[first], j[first], key[first]
        new = entries[i, j] < 0
        excl = (p.node_blocks[rows] - previous_blocks(p.node_blocks[rows]))[i, j]
        entries[i[new], j[new]] = self.cache.add(key[new], reps[i[new]], excl[new], np.zeros(new.sum(), np.int64))
        self.cache.excl[entries[i, j]] = excl          # an evicted entry registered again: this row's chain
        got = entries[i, j]
        p.node_entry[rows[i], j] = got
        p.node_ref[rows[i], j] = True
        np.add.at(p.shared, rows[i], excl)
        np.subtract.at(self.private, reps[i], excl)
        self.hold(got)

    def leave(self, rows: np.ndarray) -> None:
        """Finished rows leave their finish nodes (their answers' blocks) in the cache, evictable."""
        p = self.pool
        keys = p.fin_key[rows]
        if not keys.size or not keys.any():
            return
        reps = p.rep[rows]
        entries, mixed = self.cache.find(keys, reps)
        until = (self.taken[reps] + self.room(reps))[:, None] + np.zeros_like(keys)
        old = (entries >= 0) & (self.cache.refs[np.maximum(entries, 0)] == 0)
        self.cache.until[entries[old]] = np.maximum(self.cache.until[entries[old]], until[old])
        excl = p.fin_blocks[rows] - p.fin_parent[rows]
        i, j = np.nonzero((keys != 0) & (entries < 0))
        key, first = np.unique(mixed[i, j], return_index=True)
        self.cache.add(key, reps[i[first]], excl[i[first], j[first]], until[i[first], j[first]])


def check_supported(cfg: ReplicaConfig) -> None:
    """The aggregate replica assumes the engine's default policy: chunked prefill, and a token budget that holds a
    decode for every running request (so every running request decodes every step)."""
    if not cfg.enable_chunked_prefill:
        raise ValueError("the fast engine models chunked prefill only (enable_chunked_prefill is off): use "
                         "--engine exact")
    if cfg.max_num_seqs > cfg.max_num_batched_tokens:
        raise ValueError(f"the fast engine needs max_num_seqs ({cfg.max_num_seqs}) <= the token budget "
                         f"({cfg.max_num_batched_tokens}), so every running request decodes every step: raise "
                         "--max-num-batched-tokens or use --engine exact")


__all__ = ["DECODE", "FleetState", "PREFILL", "WAITING", "cdiv", "check_supported", "previous_blocks"]
