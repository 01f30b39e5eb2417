"""The aggregate fleet simulation: every replica of a large fleet advanced together, in rounds.

A round: take the earliest time anything can happen (a replica's next step, the next arrival), t0; route every
arrival up to t0 + window in one batch; every replica whose next step starts by then takes one step, all of them in
one pass of numpy (schedule.py, commit.py), each on its own clock. A request is only admitted by a step that
starts after it arrived, so the window costs no causality; what it costs is that a round's arrivals are routed on
the loads at the first one's arrival (the exact simulator routes each on the loads of its instant; a step's effects
are hidden from a router until the step ends: FleetState.loads). The window is the mean step time of the last
round, so most replicas step once per round.

What it keeps of the real policy: the token budget, chunked prefill mixing prompt chunks with decodes in one step,
max_num_seqs, KV blocks (decode blocks one per block_size tokens, a chunk's blocks, the pool's capacity) with
preemption by recompute when the pool is short, and prefix-cache hits through nodes (prefix.py); the step time is
the StepModel applied to the step's features, vectorized. What it drops: per-request Python work per step -- a
decoder's context and its tokens follow from its replica's step counter, so a replica's step is O(1) numpy work
whatever it runs. Memory: the requests in flight (pool.py), the cached nodes, and the arrival batch being routed.
"""
from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable

import numpy as np
from tqdm.auto import tqdm

from minillm.fleet.aggregate.arrivals import Arrivals, queue
from minillm.fleet.aggregate.columns import RequestBatch
from minillm.fleet.aggregate.commit import OnFinish, decoders_done, prompts_done
from minillm.fleet.aggregate.routing import BatchRouter
from minillm.fleet.aggregate.schedule import (admit, charge, choose, chunk_of_prefill, decode_blocks, relieve,
                                               running_rows)
from minillm.fleet.aggregate.state import FleetState
from minillm.fleet.policies import Slo
from minillm.fleet.replica import ReplicaConfig
from minillm.fleet.simulator import FleetResult
from minillm.fleet.step_model import StepFeatures, StepModel

SWEEP_EVERY = 64        # rounds between forgetting evicted cache entries (bounds the dict)


class AggregateFleet:
    """N identical replicas (one StepModel, one ReplicaConfig) behind a batch router. `window`: seconds of arrivals
    routed per round (None: the last round's mean step time)."""

    def __init__(self, step_model: StepModel, cfg: ReplicaConfig, num_replicas: int, router: BatchRouter,
                 name: str = "", slo: Slo | None = None, on_finish: OnFinish | None = None,
                 on_round: Callable[["AggregateFleet"], None] | None = None, window: float | None = None) -> None:
        self.sm, self.router, self.on_finish, self.on_round = step_model, router, on_finish, on_round
        self.st = FleetState(cfg, num_replicas)
        self.res = FleetResult(name or type(router).__name__, num_replicas, slo=slo, layout=str(num_replicas),
                               block_size=cfg.block_size)
        self.fixed_window, self.window = window, 0.0
        self.rounds = 0
        self.peak_in_flight = 0

    @property
    def token_budget(self) -> int:
        """Tokens one step may compute (max_num_batched_tokens)."""
        return self.st.cfg.max_num_batched_tokens

    # ------------------------------------------------------------------ the step time
    def step_seconds(self, prefill, decode, kv, pairs, seqs) -> np.ndarray:
        """StepModel.seconds for every stepping replica at once (features as arrays)."""
        sm, tokens = self.sm, prefill + decode

        def t(k: dict) -> np.ndarray:
            over = k["o_step"] + k["o_seq"] * seqs + k["o_token"] * tokens
            comp = k["c_token"] * tokens + k["c_pair"] * pairs + k["c_seq"] * seqs
            mem = k["m_step"] + k["m_kv"] * kv
            return over + (np.maximum(comp, mem) if sm.form == "max" else comp + mem)
        if not sm.prefill_coeffs:
            return t(sm.coeffs)
        with_prefill = t(sm.prefill_coeffs)
        if sm.short_prefill_coeffs:
            with_prefill = np.where(tokens <= sm.short_prefill_tokens, t(sm.short_prefill_coeffs), with_prefill)
        return np.where(prefill > 0, with_prefill, t(sm.coeffs))

    # ------------------------------------------------------------------ the run
    def run(self, batches: Iterable[RequestBatch], progress: bool = False, horizon: float | None = None
            ) -> FleetResult:
        arrivals, t0_wall = Arrivals(batches), time.perf_counter()
        bar = tqdm(total=horizon, unit="sim s", disable=not progress or horizon is None, mininterval=0.5,
                   bar_format="{l_bar}{bar}| {n:.0f}/{total:.0f} simulated s [{elapsed}<{remaining}]")
        shown = 0.0
        while True:
            start, kicked = self.starts()
            t0 = min(float(start.min()), arrivals.next_time())
            if t0 == math.inf:
                break
            end = t0 + (self.window if self.fixed_window is None else self.fixed_window)
            if self.arrive(arrivals.until(end)):
                start, kicked = self.starts()
            stepping = start <= end
            if stepping.any():
                self.step(stepping, start, kicked)
            self.rounds += 1
            self.st.round = self.rounds
            if self.rounds % SWEEP_EVERY == 0:
                self.st.cache.sweep(self.st.taken)
            if self.on_round is not None:
                self.on_round(self)
            if progress and horizon and self.rounds % 256 == 0 and min(t0, horizon) > shown:
                bar.update(min(t0, horizon) - shown)
                shown = min(t0, horizon)
        bar.close()
        return self._result(time.perf_counter() - t0_wall)

    def starts(self) -> tuple[np.ndarray, np.ndarray]:
        """When each replica's next step starts (inf: nothing to do), and whether an arrival starts it (kicks an
        idle replica). A replica with work starts when its step ends; an idle one at its first queued arrival."""
        st, p = self.st, self.st.pool
        first = np.full(st.R, math.inf)
        if len(st.waiting):
            np.minimum.at(first, p.rep[st.waiting], p.arrival[st.waiting])
        idle = st.running() == 0
        kicked = idle & (first >= st.free_at) & (first < math.inf)
        return np.where(idle, np.maximum(st.free_at, first), st.free_at), kicked

    # ------------------------------------------------------------------ arrivals
    def arrive(self, batch: RequestBatch) -> bool:
        """Route a batch and queue it (a request the engine would refuse fails at once, as in the simulator)."""
        if not len(batch):
            return False
        st, p = self.st, self.st.pool
        ok = (batch.prompt_len > 0) & (batch.prompt_len < st.max_model_len)
        cost = np.where(ok, batch.prompt_len + batch.output_len, 0)
        reps = self.router.route(batch, cost, *st.loads(float(batch.arrival[0])))
        self.res.first_arrival = min(self.res.first_arrival, float(batch.arrival[0]))
        self.res.failed += int((~ok).sum())
        b = batch.take(ok)
        rows = p.take(len(b))
        p.grow(p.capacity, b.node_key.shape[1] if st.caching else 0, b.finish_key.shape[1] if st.caching else 0)
        reps = reps[ok]
        queue(st, rows, b, reps)
        np.add.at(st.nreq, reps, 1)
        np.add.at(st.outstanding, reps, b.prompt_len + b.output_len)
        st.waiting = np.concatenate([st.waiting, rows])
        self.peak_in_flight = max(self.peak_in_flight, p.in_flight)
        return True

    # ------------------------------------------------------------------ one step on every stepping replica
    def step(self, stepping: np.ndarray, start: np.ndarray, kicked: np.ndarray) -> None:
        """One step on every stepping replica: the running requests (preempting where the pool is short), then
        admissions where nothing was preempted, the step time, the commit."""
        st = self.st
        S = np.flatnonzero(stepping)
        budget, free = self.token_budget - st.n_dec[S], st.room(S)
        p_n, p_blocks = chunk_of_prefill(st, S, budget)
        short = (decode_blocks(st, S) + p_blocks) > free
        preempted = np.zeros(st.R, bool)
        if short.any():
            for r, rows in running_rows(st, S[short]).items():
                preempted[r] = relieve(st, r, rows, self.token_budget)
        budget = self.token_budget - st.n_dec[S]
        p_n, p_blocks = chunk_of_prefill(st, S, budget)
        dec_blocks = decode_blocks(st, S)
        st.take_blocks(S, dec_blocks + p_blocks, dec_blocks + p_blocks)
        p_rows = st.p_row[S]                 # before admission names a new unfinished prompt
        ok = stepping & ~preempted
        room_budget, room_blocks = np.zeros(st.R, np.int64), np.zeros(st.R, np.int64)
        room_budget[S], room_blocks[S] = budget - p_n, st.room(S)
        a = choose(st, ok, start, kicked, room_budget, room_blocks)
        if a is not None:
            admit(st, a)
        chunks = self._chunks(p_rows, p_n, a)
        dt = self._time(S, chunks)
        self._commit(S, start[S] + dt, dt, chunks, a)

    def _chunks(self, p_rows: np.ndarray, p_n: np.ndarray, a) -> tuple[np.ndarray, ...]:
        """The step's prompt chunks: (rows, computed before, new tokens)."""
        p = self.st.pool
        has = (p_rows >= 0) & (p_n > 0)
        rows, c, n = [p_rows[has]], [p.computed[p_rows[has]]], [p_n[has]]
        if a is not None:
            rows.append(a.rows)
            c.append(p.computed[a.rows])
            n.append(a.chunk)
        return np.concatenate(rows), np.concatenate(c), np.concatenate(n)

    def _time(self, S: np.ndarray, chunks) -> np.ndarray:
        """The step model on each stepping replica's features: its decoders (each 1 token after its context)
        plus its chunks (StepFeatures.of in columns)."""
        st, p = self.st, self.st.pool
        rows, c, n = chunks
        where = np.searchsorted(S, p.rep[rows])
        is_dec = (n == 1) & (c >= p.prompt[rows])
        feats = [np.bincount(where, w, minlength=len(S)) for w in
                 (np.where(is_dec, 0, n), is_dec, c + n, n * c + n * (n + 1) // 2, np.ones(len(rows)))]
        nd, ctx = st.n_dec[S], st.dec_ctx[S]
        step = (feats[0], nd + feats[1], ctx + nd + feats[2], ctx + nd + feats[3], nd + feats[4])  # StepFeatures order
        dt = self.step_seconds(*step)
        if (dt < 0).any():
            i = int(np.argmin(dt))
            raise self.sm.negative_step_error(StepFeatures(*(int(x[i]) for x in step)), float(dt[i]))
        if (step[4] == 0).any():
            raise RuntimeError("a replica with requests queued scheduled nothing: the KV pool cannot hold the next "
                               "request")
        return dt

    def _account(self, S: np.ndarray, dt: np.ndarray, chunk_tokens: np.ndarray) -> None:
        """The step's KV use (time-weighted, peak) and computed tokens, as the exact simulator counts them."""
        st = self.st
        used = st.used(S)
        st.kv_area[S] += used * dt
        st.kv_peak = max(st.kv_peak, float(used.max()) / st.cfg.num_blocks)
        st.prefill_tokens += int(chunk_tokens.sum())
        st.decode_tokens += int(st.n_dec[S].sum())
        self.res.steps += len(S)

    def _commit(self, S: np.ndarray, end: np.ndarray, dt: np.ndarray, chunks, a) -> None:
        """The steps of S end at `end`: decoders advance one token (finishing ones leave), chunks are computed
        (finished prompts sample their first token), step counters and clocks move on."""
        st, p = self.st, self.st.pool
        out0, req0 = st.outstanding[S].copy(), st.nreq[S].copy()
        rows, c, n = chunks
        self._account(S, dt, n)
        end_of = np.zeros(st.R)
        end_of[S] = end
        stepped = np.zeros(st.R, bool)
        stepped[S] = True
        st.dec_ctx[S] += st.n_dec[S]           # every decoder computed one position and produced one token
        st.outstanding[S] -= st.n_dec[S]
        if a is not None:
            p.first_sched[a.rows] = np.where(np.isnan(p.first_sched[a.rows]), end_of[p.rep[a.rows]],
                                             p.first_sched[a.rows])
        decoders_done(st, stepped, end_of, self.res, self.on_finish)
        new = np.zeros(len(rows), bool)
        if a is not None:
            new[len(rows) - len(a.rows):] = True          # admitted this step: their cache hit counts too
        charge(st, rows, np.minimum(p.prompt[rows], c + n) - np.where(new, 0, np.minimum(p.prompt[rows], c)))
        p.computed[rows] += n
        if st.caching:
            st.publish(rows)
        done = rows[p.computed[rows] >= p.prompt[rows] + p.emitted[rows]]
        reps = p.rep[done]
        prompts_done(st, done, st.steps[reps], end_of[reps], self.res, self.on_finish)
        st.steps[S] += 1
        st.free_at[S] = end
        st.pend_out[S], st.pend_req[S] = st.outstanding[S] - out0, st.nreq[S] - req0
        if self.fixed_window is None:      # about one step: most replicas step once a round, loads stay fresh
            self.window = float(dt.mean())

    # ------------------------------------------------------------------ the result
    def _result(self, wall: float) -> FleetResult:
        st, res = self.st, self.res
        res.wall_s = wall
        res.prefill_tokens, res.decode_tokens = st.prefill_tokens, st.decode_tokens
        res.kv_usage_peak = st.kv_peak
        if res.first_arrival < math.inf:
            end = max(res.last_finish, float(st.free_at.max()))
            res.replica_seconds = st.R * max(0.0, end - res.first_arrival)
            if res.replica_seconds > 0:
                res.kv_usage_mean = float(st.kv_area.sum()) / st.cfg.num_blocks / res.replica_seconds
        return res

