"""The end of a step (LLMEngine._commit in columns): prompts that reached their last token sample their first
token and start decoding; decoders at their length finish; finished requests are folded into the result and their
rows freed."""
from __future__ import annotations

from collections.abc import Callable

import numpy as np

from minillm.fleet.aggregate.pool import DECODE
from minillm.fleet.aggregate.schedule import charge
from minillm.fleet.aggregate.state import FleetState
from minillm.fleet.simulator import FleetResult

# What on_finish gets: a dict of columns of the requests finished at one step end (tests read it).
OnFinish = Callable[[dict[str, np.ndarray]], None]


def prompts_done(st: FleetState, rows: np.ndarray, s: np.ndarray, end: np.ndarray, res: FleetResult,
                 on_finish: OnFinish | None) -> None:
    """Rows whose prompt (plus any tokens it had produced before a preemption) is now computed, in steps s that
    ended at `end`: each samples a token; it finishes, or decodes from s + 1."""
    p = st.pool
    reps = p.rep[rows]
    p.emitted[rows] += 1
    charge(st, rows, np.ones(len(rows), np.int64))
    p.first_token[rows] = np.where(np.isnan(p.first_token[rows]), end, p.first_token[rows])
    was_partial = st.p_row[reps] == rows
    st.p_row[reps[was_partial]] = -1
    done = p.emitted[rows] >= p.out[rows]
    finish(st, rows[done], p.computed[rows[done]], end[done], res, on_finish)
    rows, s, reps = rows[~done], s[~done], reps[~done]
    p.state[rows] = DECODE
    p.s0[rows], p.c0[rows] = s + 1, p.computed[rows]
    p.finish_step[rows] = s + p.out[rows] - p.emitted[rows]
    p.due[rows] = st.round + p.out[rows] - p.emitted[rows]      # a replica steps at most once a round
    np.add.at(st.n_dec, reps, 1)
    np.add.at(st.dec_ctx, reps, p.c0[rows])
    np.add.at(st.phase, (reps, (p.c0[rows] - p.s0[rows]) % st.bs), 1)


def decoders_done(st: FleetState, stepped: np.ndarray, end_of: np.ndarray, res: FleetResult,
                  on_finish: OnFinish | None) -> None:
    """Decoders on the replicas that just stepped whose last token that step was (their step counters not yet
    advanced): they leave with their full length. Only the decoders due this round are looked at: a replica steps
    at most once a round, so one with m steps to go cannot finish within m rounds (pool column `due`)."""
    p = st.pool
    due = np.flatnonzero((p.due <= st.round) & (p.due >= 0))   # (a round without a step looks at none)
    reps = p.rep[due]
    now = stepped[reps] & (p.finish_step[due] == st.steps[reps])
    later = due[~now]       # its replica skipped rounds: look again when it can finish at the earliest
    p.due[later] = st.round + 1 + p.finish_step[later] - st.steps[p.rep[later]] - stepped[p.rep[later]]
    rows = due[now]
    if not len(rows):
        return
    reps = p.rep[rows]
    steps = st.steps[reps] - p.s0[rows] + 1                 # decode steps it ran, this one included
    computed = p.c0[rows] + steps
    np.subtract.at(st.n_dec, reps, 1)
    np.subtract.at(st.dec_ctx, reps, computed)             # dec_ctx already counts this step's token
    np.subtract.at(st.phase, (reps, (p.c0[rows] - p.s0[rows]) % st.bs), 1)
    p.emitted[rows] += steps
    p.charge[rows] -= steps
    finish(st, rows, computed, end_of[reps], res, on_finish)


def finish(st: FleetState, rows: np.ndarray, computed: np.ndarray, end: np.ndarray, res: FleetResult,
           on_finish: OnFinish | None) -> None:
    """Rows finished at `end` with `computed` KV positions: blocks and nodes released, their answers' nodes left
    in the cache, their latencies folded into `res`, their rows freed."""
    if not len(rows):
        return
    p = st.pool
    reps = p.rep[rows]
    np.subtract.at(st.outstanding, reps, p.charge[rows])     # what is left: the part past the context limit
    np.subtract.at(st.nreq, reps, 1)
    st.release(rows, computed)
    if st.caching:
        st.leave(rows)
    cols = {"request_id": p.rid[rows], "arrival": p.arrival[rows], "first_scheduled": p.first_sched[rows],
            "first_token": p.first_token[rows], "finished": end, "output_len": p.emitted[rows],
            "prompt_len": p.prompt[rows], "cached_tokens": p.cached[rows], "preemptions": p.preemptions[rows]}
    res.add_many(*(cols[k] for k in ("arrival", "first_scheduled", "first_token", "finished", "output_len",
                                     "prompt_len", "cached_tokens", "preemptions")))
    if on_finish is not None:
        on_finish(cols | {"replica": reps, "hits": p.hits[rows], "lost": p.lost[rows]})
    p.release(rows)
