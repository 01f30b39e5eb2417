"""One step's scheduling on every stepping replica at once: the engine's policy (engine/scheduler.py), in columns.

The engine's FCFS policy with chunked prefill, per step:
1. running requests, oldest first: a decode takes 1 token, an unfinished prompt its next chunk (up to the budget
   left); if the pool cannot hold the new tokens, the newest running request is preempted (recompute) until it can;
2. if nothing was preempted: waiting requests in queue order while the budget, max_num_seqs and the free blocks
   allow (the prefix cache's hits are not recomputed), the last one admitted perhaps with a partial chunk; the
   first that does not fit blocks the rest.

What makes it vectorizable: a request admitted with a partial chunk used up the budget, so nothing is admitted
behind it until its prompt is done -- at most one running request per replica has an unfinished prompt, and it
is the newest; with max_num_seqs <= the budget every decoder runs every step. So step 1 is "every decoder, then
that one chunk", and step 2 a cumulative sum within each replica's queue. Only a replica whose pool is short runs
the preemption loop in Python (`relieve`), request by request, as the engine does.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from minillm.fleet.aggregate.pool import DECODE, PREFILL, WAITING
from minillm.fleet.aggregate.state import FleetState, cdiv


# ---------------------------------------------------------------------- runs of equal replica ids

def heads(g: np.ndarray) -> np.ndarray:
    """For sorted group ids, the index of each element's group's first element."""
    first = np.r_[True, g[1:] != g[:-1]] if len(g) else np.zeros(0, bool)
    return np.maximum.accumulate(np.where(first, np.arange(len(g)), 0))


def cumsum_in(x: np.ndarray, h: np.ndarray) -> np.ndarray:
    """Inclusive cumulative sum within each group (h from heads)."""
    cs = np.cumsum(x)
    return cs - (cs[h] - x[h])


def all_so_far(ok: np.ndarray, h: np.ndarray) -> np.ndarray:
    """Within each group, whether every element up to this one is ok (admission never overtakes)."""
    return cumsum_in((~ok).astype(np.int64), h) == 0


# ---------------------------------------------------------------------- admission

@dataclass
class Admission:
    rows: np.ndarray         # in queue order within each replica
    chunk: np.ndarray        # tokens each computes this step
    hit_blocks: np.ndarray
    held: np.ndarray         # (n, K) nodes each holds from now
    entries: np.ndarray      # (n, K)
    shared: np.ndarray       # blocks of each counted in the nodes


def choose(st: FleetState, ok: np.ndarray, start: np.ndarray, kicked: np.ndarray, budget: np.ndarray,
           free: np.ndarray) -> Admission | None:
    """Which waiting requests the replicas marked `ok` admit in the steps starting at `start`, given each one's
    token budget and free blocks left after its running requests; `admit_waiting` in columns.

    A step sees the requests that arrived before it started; a step that an arrival started on an idle replica
    (`kicked`) sees that one request (others arriving at the same instant wait for the next step, as in the
    exact simulator, where the step begins as the first of them is routed)."""
    p, w = st.pool, st.waiting
    rw = p.rep[w]
    cand = w[ok[rw] & ((p.arrival[w] < start[rw]) | (kicked[rw] & (p.arrival[w] == start[rw])))]
    if not len(cand):
        return None
    cand = cand[np.lexsort((p.order[cand], p.rep[cand]))]
    h = heads(p.rep[cand])
    seats = np.where(kicked, 1, st.cfg.max_num_seqs - st.running())[p.rep[cand]]
    cand = cand[np.arange(len(cand)) - h < seats]       # past max_num_seqs nobody is admitted: skip the lookups
    if not len(cand):
        return None
    rc, h = p.rep[cand], heads(p.rep[cand])
    hit_blocks, revived, held, entries, shared = st.hits(cand)
    hit = hit_blocks * st.bs
    left = p.prompt[cand] + p.emitted[cand] - hit
    before = budget[rc] - (cumsum_in(left, h) - left)
    chunk = np.minimum(left, before)
    blocks = cdiv(hit + chunk, st.bs) - shared + revived        # exactly what admit adds to the pool in use
    take = all_so_far((before > 0) & (cumsum_in(blocks, h) <= free[rc]), h)
    return Admission(cand[take], chunk[take], hit_blocks[take], held[take], entries[take], shared[take])


def admit(st: FleetState, a: Admission) -> None:
    """The admitted rows start running: blocks, held nodes, the cache hit; a partial chunk makes its row the
    replica's unfinished prompt. (Their outstanding tokens drop when the step commits, as in the engine.)"""
    p = st.pool
    rows, reps, hit = a.rows, p.rep[a.rows], a.hit_blocks * st.bs
    p.node_entry[rows] = a.entries
    p.node_ref[rows] = a.held
    st.hold(a.entries[a.held])
    p.shared[rows] = a.shared
    blocks = cdiv(hit + a.chunk, st.bs)
    st.take_blocks(reps, blocks - a.shared, blocks - a.hit_blocks)
    p.computed[rows] = hit
    p.hits[rows] += hit
    st.hit_tokens += int(hit.sum())
    p.cached[rows] = np.where(p.cached[rows] < 0, hit, p.cached[rows])
    p.own_blocks[rows] = 0
    p.admitted[rows] = st.admitted + np.arange(len(rows))
    st.admitted += len(rows)
    p.state[rows] = PREFILL
    partial = hit + a.chunk < p.prompt[rows] + p.emitted[rows]
    st.p_row[reps[partial]] = rows[partial]
    st.waiting = st.waiting[p.state[st.waiting] == WAITING]


def charge(st: FleetState, rows: np.ndarray, done: np.ndarray) -> None:
    """`done` more of each row's outstanding tokens are computed or produced."""
    st.pool.charge[rows] -= done
    np.subtract.at(st.outstanding, st.pool.rep[rows], done)


# ---------------------------------------------------------------------- the running requests

def chunk_of_prefill(st: FleetState, reps: np.ndarray, budget: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The unfinished prompt's chunk on each replica (0 where none): tokens and new blocks."""
    p, rows = st.pool, st.p_row[reps]
    has = rows >= 0
    r = np.maximum(rows, 0)
    c = p.computed[r]
    n = np.where(has, np.maximum(0, np.minimum(p.prompt[r] + p.emitted[r] - c, budget)), 0)
    return n, np.where(has, cdiv(c + n, st.bs) - cdiv(c, st.bs), 0)


def decode_blocks(st: FleetState, reps: np.ndarray) -> np.ndarray:
    """New blocks the decoders of each replica need this step (see FleetState.phase)."""
    return st.phase[reps, (-st.steps[reps]) % st.bs]


def running_rows(st: FleetState, reps: np.ndarray) -> dict[int, list[int]]:
    """The running rows of each of `reps`, oldest admitted first (one pass over the pool)."""
    p = st.pool
    on = np.zeros(st.R, bool)
    on[reps] = True
    rows = np.flatnonzero(((p.state == DECODE) | (p.state == PREFILL)) & on[p.rep])
    rows = rows[np.lexsort((p.admitted[rows], p.rep[rows]))]
    out: dict[int, list[int]] = {int(r): [] for r in reps}
    for r, row in zip(p.rep[rows].tolist(), rows.tolist()):
        out[r].append(row)
    return out


def relieve(st: FleetState, r: int, rows: list[int], budget: int) -> bool:
    """schedule_running on one replica whose pool is short: walk its running rows (oldest admitted first) within
    the token budget, preempting the newest until each one's tokens fit (engine/scheduler.py). Whether it
    preempted anything."""
    p = st.pool
    free, s, preempted = int(st.room(r)), int(st.steps[r]), False
    for row in list(rows):
        if row not in rows or budget <= 0:
            break
        if p.state[row] == DECODE:
            n, need = 1, int((p.c0[row] - p.s0[row] + s) % st.bs == 0)
        else:
            c = int(p.computed[row])
            n = min(int(p.prompt[row] + p.emitted[row]) - c, budget)
            need = cdiv(c + n, st.bs) - cdiv(c, st.bs)
        while need > free:
            victim = rows.pop()
            free += preempt(st, victim, s)
            preempted = True
            if victim == row:
                return True
        free, budget = free - need, budget - n
    return preempted


def preempt(st: FleetState, row: int, s: int) -> int:
    """Recompute-style preemption of one running row before step s: its blocks go back (cached, so its own KV may
    still be found when it is readmitted), it re-enters at the head of its queue. Blocks freed."""
    p, r = st.pool, int(st.pool.rep[row])
    before = int(st.used(r))
    if p.state[row] == DECODE:
        done = s - int(p.s0[row])
        c, emitted, left = int(p.c0[row]) + done, int(p.emitted[row]) + done, int(p.charge[row]) - done
        st.n_dec[r] -= 1
        st.dec_ctx[r] -= c
        st.phase[r, (p.c0[row] - p.s0[row]) % st.bs] -= 1
    else:
        c, emitted, left = int(p.computed[row]), int(p.emitted[row]), int(p.charge[row])
        st.p_row[r] = -1
    rows = np.array([row])
    st.release(rows, np.array([c]))
    recompute = min(int(p.prompt[row]), c)
    p.charge[row] = left + recompute
    st.outstanding[r] += recompute
    p.own_blocks[row] = c // st.bs if st.caching else 0
    p.own_until[row] = st.taken[r] + st.room(r)
    p.state[row], p.computed[row], p.emitted[row], p.due[row] = WAITING, 0, emitted, -1
    st.preempted += 1
    p.order[row] = -st.preempted                 # the head of the queue, the latest preempted first
    p.preemptions[row] += 1
    p.lost[row] += c
    st.lost_tokens += c
    st.waiting = np.append(st.waiting, row)
    return before - int(st.used(r))
