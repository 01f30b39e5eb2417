"""Checkers for lab04 — continuous batching: the scheduler's policy steps.

The learner subclasses `minillm.engine.scheduler.Scheduler` and overrides one public method per task (the notebook
documents the same contracts):
  lab04_1  schedule_running(self, out, budget): running sequences oldest first; a decode gets 1 token, an
           unfinished prompt its next chunk min(left, budget); reserve slots with bm.append_slots; when the pool
           cannot hold them, preempt the NEWEST running sequence (self.preempt) until it can.
  lab04_2  admit_waiting(self, out, budget): admit waiting sequences in arrival order (no overtaking) while budget,
           max_num_seqs and free blocks allow; the first chunk may be partial (chunked prefill); prefix-cache aware.
  lab04_3  preempt(self, seq): recompute-style preemption: leave `running`, free every block, forget the computed
           tokens, go back to the HEAD of the waiting queue, count the preemption.

How a checker works. The probe is the learner's class with the two policy methods it does not grade (and the
step plumbing: schedule, commit, fork, finish, ...) taken from minillm's Scheduler: the engine is the
environment, the graded method is the learner's. The probe drives a real `LLMEngine` (a tiny random Llama) on
request sets hypothesis draws (shared prefixes, staggered arrivals, n > 1 samples that fork and share blocks,
small pools that force preemption, small budgets that force chunking). Before every step the oracle, `fcfs_step`,
states what FCFS continuous batching does from the current state, simulated on a deep copy of the block manager;
`engine.add_step_observer` shows what the step did. Every step must keep the rules (budget, max_num_seqs,
newest-first victims listed in out.preempted, arrival-order admission, nothing admitted in a step that preempted)
and equal the oracle's decision; at the end every sample equals generating its request alone (greedy,
`SimpleGenerator`) and every block is back in the pool.
"""
from __future__ import annotations

import collections
import contextlib
import copy
import functools
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch
from hypothesis import example, given, strategies as st

from minillm.engine.llm_engine import LLMEngine
from minillm.engine.outputs import StepInfo
from minillm.engine.scheduler import Scheduler
from minillm.engine.sequence import Sequence, SequenceStatus
from minillm.engine.simple import SimpleGenerator
from minillm.grading.core import (GradingError, Hint, Task, TimedOut, as_int, check, fail, learner_location,
                                  minillm_objects, run_property, time_limit)
from minillm.kv.block_manager import BlockManager
from minillm.sampling.params import SamplingParams
from minillm.testing import tiny_model

__all__ = ["check_lab04_1", "check_lab04_2", "check_lab04_3", "TASKS", "fcfs_step", "Case", "make_case", "run_case"]

TIME_LIMIT_S = 20           # one example running longer than this has an endless loop somewhere
METHODS = ("schedule_running", "admit_waiting", "preempt")
PLUMBING = ("add", "has_unfinished", "finish", "abort", "schedule", "commit", "fork")


# --------------------------------------------------------------------------- the oracle: the policy, stated once

@dataclass(eq=False)
class Item:
    """A queued sequence as the oracle sees it, copied before the step (`seq` is only its identity)."""
    seq: object
    seq_id: int
    tokens: tuple
    computed: int


def fcfs_step(bm: BlockManager, running: list[Item], waiting: list[Item], budget: int, max_num_seqs: int):
    """What FCFS continuous batching schedules in one step. `bm` is a deep copy of the engine's block manager (this
    changes it); `running` (oldest first) and `waiting` (head first) are lists of Items.
    Returns (batch [(seq, first position, num tokens)] in order, preempted seqs, copy-on-write pairs)."""
    batch, preempted, copies = [], [], []
    seats = list(running)
    for item in running:                                  # 1. running sequences, oldest first
        if budget <= 0 or item not in seats:
            break
        end = min(len(item.tokens), item.computed + budget)
        while item in seats and bm.num_blocks_needed(item.seq_id, end) > bm.num_free_blocks:
            victim = seats.pop()                          # the newest one leaves, blocks and all
            bm.free(victim.seq_id)
            preempted.append(victim.seq)
        if item in seats:
            copies += bm.append_slots(item.seq_id, end)
            batch.append((item.seq, item.computed, end - item.computed))
            budget -= end - item.computed
    for item in [] if preempted else waiting:             # 2. then the queue, head first, no overtaking
        start = bm.peek_prefix(item.tokens)
        end = min(len(item.tokens), start + budget)
        if budget <= 0 or len(seats) >= max_num_seqs or bm.blocks_to_admit(item.tokens, end) > bm.num_free_blocks:
            break
        bm.allocate_prompt(item.seq_id, list(item.tokens))
        copies += bm.append_slots(item.seq_id, end)
        seats.append(item)
        batch.append((item.seq, start, end - start))
        budget -= end - start
    return batch, preempted, copies


# --------------------------------------------------------------------------- cases

@dataclass(frozen=True)
class Case:
    """A request set and an engine configuration. Request i arrives at step arrivals[i] and wants n[i] samples."""
    prompts: tuple
    max_tokens: tuple
    arrivals: tuple
    n: tuple
    block_size: int
    num_blocks: int
    budget: int
    max_num_seqs: int
    prefix_caching: bool = False

    def __repr__(self) -> str:
        reqs = ", ".join(f"'{i}': {len(p)}-token prompt + {m} out{f' x{k}' if k > 1 else ''} @step {a}"
                         for i, (p, m, a, k) in enumerate(zip(self.prompts, self.max_tokens, self.arrivals, self.n)))
        return (f"[{reqs}]; max_num_batched_tokens={self.budget}, max_num_seqs={self.max_num_seqs}, KV pool "
                f"{self.num_blocks} blocks x {self.block_size} tokens, prefix caching "
                f"{'on' if self.prefix_caching else 'off'}")

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:     # hypothesis prints falsifying examples with this
        p.text(repr(self))


def make_case(requests: list[tuple], *, block_size: int = 4, num_blocks: int | None = None, spare_blocks: int = 0,
              budget: int = 16, max_num_seqs: int = 8, prefix_caching: bool = False,
              arrivals: list[int] | None = None) -> Case:
    """requests: [(prompt tokens, max_tokens)] or [(prompt, max_tokens, n)]. Without num_blocks the pool holds the
    longest sequence plus `spare_blocks` blocks (small pools force preemption)."""
    prompts = tuple(tuple(int(t) for t in r[0]) for r in requests)
    outs = tuple(int(r[1]) for r in requests)
    ns = tuple(int(r[2]) if len(r) > 2 else 1 for r in requests)
    if num_blocks is None:
        num_blocks = -(-max(len(p) + m for p, m in zip(prompts, outs)) // block_size) + spare_blocks
    return Case(prompts, outs, tuple(arrivals or [0] * len(prompts)), ns, block_size, num_blocks, budget,
                max_num_seqs, prefix_caching)


def _toks(seed: int, n: int) -> list[int]:
    return torch.randint(3, 128, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@st.composite
def cases(draw: st.DrawFn, pressure: bool = False) -> Case:
    """Random request sets; `pressure` draws more, longer-running requests into a pool barely larger than the
    longest one, so most cases preempt. Token ids come from seeds, so hypothesis shrinks lengths, not tokens."""
    k = draw(st.integers(2, 5) if pressure else st.integers(1, 5))
    shared = _toks(draw(st.integers(0, 99)), draw(st.integers(0, 12)))
    reqs = []
    for i in range(k):
        own = _toks(1000 + 37 * i + draw(st.integers(0, 99)), draw(st.integers(1, 36)))
        reqs.append(((shared if draw(st.booleans()) else []) + own,
                     draw(st.integers(4, 16) if pressure else st.integers(1, 10)),
                     draw(st.sampled_from([1, 1, 1, 2, 3]))))
    gaps = draw(st.lists(st.integers(0, 1 if pressure else 3), min_size=k, max_size=k))
    return make_case(reqs, block_size=draw(st.sampled_from([4, 2, 1, 8])),
                     spare_blocks=draw(st.integers(0, 2) if pressure else st.integers(0, 12)),
                     budget=draw(st.integers(2, 48)),
                     max_num_seqs=draw(st.integers(2, 5) if pressure else st.integers(1, 5)),
                     prefix_caching=draw(st.booleans()), arrivals=[sum(gaps[:i]) for i in range(k)])


# Hand-picked cases every checker runs first.
CHUNKING = make_case([(_toks(1, 40), 3)], block_size=4, num_blocks=20, budget=8)             # prompt 5x the budget
DECODE_PLUS_CHUNK = make_case([(_toks(2, 3), 12), (_toks(3, 37), 2)], block_size=4, num_blocks=30, budget=8,
                              arrivals=[0, 1])                                               # decode + 7-token chunk
TINY_BUDGET = make_case([(_toks(4 + i, 5), 6) for i in range(4)], block_size=4, num_blocks=40, budget=2)
PRESSURE = make_case([(_toks(10 + i, 12), 30) for i in range(3)], block_size=4, num_blocks=12, budget=64,
                     max_num_seqs=4)                                                         # pool for 1.3 requests
PRESSURE_CHUNKED = make_case([(_toks(20, 27), 16), (_toks(21, 30), 16), (_toks(22, 20), 16)], block_size=4,
                             num_blocks=14, budget=12, max_num_seqs=3)
ONE_AT_A_TIME = make_case([(_toks(30 + i, 6), 4) for i in range(3)], block_size=2, num_blocks=40, budget=32,
                          max_num_seqs=1)
# '1' does not fit next to '0' for a while; '2' would, but must not overtake it
HEAD_BLOCKS = make_case([(_toks(40, 20), 20), (_toks(41, 30), 2), (_toks(42, 3), 2)], block_size=4, num_blocks=12,
                        budget=64, max_num_seqs=4, arrivals=[0, 1, 1])
SHARED_PREFIX = make_case([(_toks(50, 16) + _toks(51 + i, 5), 4) for i in range(3)], block_size=4, num_blocks=30,
                          budget=16, max_num_seqs=3, prefix_caching=True, arrivals=[0, 3, 3])
# n = 3 samples fork after the prompt, share its blocks (copy-on-write in the partly filled last block) and outgrow
# the pool: forked children are preempted, recompute and must still equal the request generated alone
FORKED_PRESSURE = make_case([(_toks(60, 10), 14, 3), (_toks(61, 7), 10)], block_size=4, num_blocks=9, budget=32,
                            max_num_seqs=4, arrivals=[0, 1])
# the shared prefix in a pool with room for little more: a waiting prompt's blocks are blocks_to_admit(tokens, cached +
# n) (its cached prefix costs nothing unless evictable, and the chunk ends at cached + n, not n)
SHARED_PREFIX_TIGHT = make_case([(_toks(50, 16) + _toks(51 + i, 5), 4) for i in range(3)], block_size=4, num_blocks=9,
                                budget=16, max_num_seqs=3, prefix_caching=True, arrivals=[0, 2, 2])
# preempt(seq) called on the OLDEST of three running sequences (the policy only ever picks the newest: a preempt that
# ignores its argument would pass the engine's runs)
MID_PREEMPT = make_case([(_toks(80 + i, 6), 5) for i in range(3)], block_size=4, num_blocks=40, budget=64,
                        max_num_seqs=4)
# max_num_seqs counts sequences: the 3 samples of '0' fill every seat, '1' waits although it is one request
FORKS_FILL_SEATS = make_case([(_toks(70, 6), 8, 3), (_toks(71, 5), 4)], block_size=2, num_blocks=60, budget=32,
                             max_num_seqs=3, arrivals=[0, 2])


# --------------------------------------------------------------------------- running a case

@contextlib.contextmanager
def _guarded(seconds: float):
    """One torch thread (the tiny model's ops take microseconds: more only add contention) and a time limit
    against endless loops (core.time_limit, nested in the check's own; main thread on POSIX only)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with time_limit(seconds) as limit:
            yield limit
    finally:
        torch.set_num_threads(threads)


@functools.lru_cache(maxsize=4096)
def _alone(prompt: tuple, max_tokens: int) -> tuple:
    """The truth: the request generated on its own, greedily, with a contiguous cache."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return tuple(SimpleGenerator(tiny_model(), None).generate(list(prompt), params)[1])


def _label(seq: Sequence) -> str:
    return f"'{seq.request_id}'" + (f"#{seq.index}" if seq.index else "")


def _labels(seqs: Iterable[Sequence]) -> str:
    return "[" + ", ".join(_label(s) for s in seqs) + "]"


def _fmt(batch: list[tuple[Sequence, int, int]], preempted: list[Sequence]) -> str:
    text = "[" + ", ".join(f"{_label(s)}: {n}" for s, _, n in batch) + "]"
    return text + (f" and preempts {_labels(preempted)}" if preempted else "")


def _items(seqs: Iterable[Sequence], what: str) -> list:
    """The live queue, copied for the oracle (its sequences must be the engine's Sequence objects)."""
    seqs = list(seqs)
    for s in seqs:
        check(type(s) is Sequence, f"self.{what} must hold the engine's Sequence objects, found {type(s).__name__}")
    return [Item(s, s.seq_id, tuple(s.token_ids), as_int(s.num_computed_tokens, "num_computed_tokens")) for s in seqs]


def _state(running: list[Item], waiting: list[Item], free_blocks: int, budget: int) -> str:
    run = ", ".join(f"{_label(i.seq)} {i.computed}/{len(i.tokens)}" for i in running) or "none"
    wait = ", ".join(f"{_label(i.seq)} {len(i.tokens)} tok" for i in waiting) or "none"
    return (f"running [{run}] (computed/total tokens), waiting [{wait}], {free_blocks} free blocks, "
            f"budget {budget}")


StepRecord = collections.namedtuple("StepRecord", "step batch preempted state")   # batch: [(seq, start, n)]


def run_case(cls, case: Case, *, time_limit: float = TIME_LIMIT_S) -> list:
    """Run `case` through an LLMEngine with the scheduler class `cls` as it is; check every step against the oracle
    and the rules, then the outputs and the pool. Returns the steps (StepRecords); raises GradingError at the first
    thing wrong."""
    __tracebackhide__ = True
    engine = LLMEngine.from_model(tiny_model(), None, block_size=case.block_size, num_blocks=case.num_blocks,
                                  max_num_seqs=case.max_num_seqs, max_num_batched_tokens=case.budget,
                                  enable_prefix_caching=case.prefix_caching, attention_backend="torch")
    limit = None
    try:
        with _guarded(time_limit) as limit:
            return _drive(engine, cls, case)
    except TimedOut as e:
        if limit is None or e.limit is not limit:
            raise
        where = f" ({e.where})" if e.where else ""
        fail(f"the scheduler did not return within {time_limit:g} s{where}: an endless loop? (a while loop whose "
             "condition never changes, e.g. preempting a sequence that stays in self.running)")


def _drive(engine: LLMEngine, cls, case: Case) -> list:
    __tracebackhide__ = True
    try:
        sched = cls(engine.scheduler.config, engine.block_manager)
        engine.plug(scheduler=sched)
    except (GradingError, NotImplementedError, TimedOut):
        raise
    except Exception as e:  # noqa: BLE001 — the learner's code may raise anything
        fail(f"building your scheduler raised {type(e).__name__}: {e}{learner_location(e)}")
    seen, records, done, bm = [], [], {}, engine.block_manager
    engine.add_step_observer(seen.append)
    order = sorted(range(len(case.prompts)), key=lambda i: case.arrivals[i])
    tick = 0
    while order or engine.has_unfinished_requests():
        while order and case.arrivals[order[0]] <= tick:
            i = order.pop(0)
            engine.add_request(list(case.prompts[i]), SamplingParams(temperature=0, max_tokens=case.max_tokens[i],
                                                                     ignore_eos=True, n=case.n[i]),
                               request_id=str(i))
        tick += 1
        if not engine.has_unfinished_requests():
            continue
        k = len(records) + 1
        check(k <= 2000, "no progress: 2000 steps and requests are still unfinished — some request is starving")
        check(sched.block_manager is bm, "your scheduler replaced self.block_manager: keep the engine's")
        running, waiting = _items(sched.running, "running"), _items(sched.waiting, "waiting")
        state = _state(running, waiting, bm.num_free_blocks, case.budget)
        expected = fcfs_step(copy.deepcopy(bm), running, waiting, case.budget, case.max_num_seqs)
        try:
            for o in engine.step():
                if o.finished:
                    done[o.request_id] = [c.token_ids for c in o.outputs]
        except (GradingError, NotImplementedError, TimedOut):
            raise
        except Exception as e:  # noqa: BLE001
            fail(_crash(e, k, state, expected, [i.seq for i in running], [i.seq for i in waiting], sched, bm))
        check(len(seen) == 1, f"step {k}: the engine called its step observer {len(seen)} times")
        records.append(_check_step(k, seen.pop(), expected, state, sched, case))
    _check_end(engine, bm, case, done)
    return records


def _check_step(k: int, info: StepInfo, expected: tuple, state: str, sched: Scheduler, case: Case) -> StepRecord:
    """The step's rules, then its decision against the oracle's."""
    __tracebackhide__ = True
    where = f"step {k} ({state})"
    out = info.scheduler_output
    if type(out.scheduled) is not list or type(out.preempted) is not list:
        fail(f"{where}: out.scheduled and out.preempted must stay lists (append to them)")
    batch, ids = [], set()
    for item in out.scheduled:
        if type(item) is not tuple or len(item) != 2 or type(item[0]) is not Sequence:
            fail(f"{where}: out.scheduled must hold (seq, num_new_tokens) tuples, got {item!r:.80}")
        seq, n = item[0], as_int(item[1], f"the number of tokens scheduled for {_label(item[0])}")
        check(n >= 1, f"{where}: {_label(seq)} was scheduled with {n} tokens; every scheduled sequence computes at "
                      "least 1 token (stop when the budget is used up)")
        check(id(seq) not in ids, f"{where}: {_label(seq)} appears twice in out.scheduled")
        ids.add(id(seq))
        batch.append((seq, as_int(seq.num_computed_tokens, "num_computed_tokens") - n, n))   # commit added n
    total = sum(n for _, _, n in batch)
    check(total <= case.budget, f"{where}: the step schedules {total} tokens ({_fmt(batch, [])}), more than "
                                f"max_num_batched_tokens={case.budget}")
    before, queued = [s.seq for s in info.running_before], [s.seq for s in info.waiting_before]
    now = {id(s) for s in sched.running}
    gone = _victims(where, before, sched)
    listed = list(out.preempted)
    if {id(s) for s in gone} != {id(s) for s in listed}:
        fail(f"{where}: out.preempted lists {_labels(listed)} but the sequences that left self.running are "
             f"{_labels(gone)}: append every victim to out.preempted")
    old = {id(s) for s in before}
    admitted = [s for s, _, _ in batch if id(s) not in old]
    joined = [s for s in queued if id(s) in now and id(s) not in ids]
    if joined:
        fail(f"{where}: {_labels(joined)} joined self.running without being scheduled: give an admitted sequence "
             "its first chunk in the same step")
    outside = [s for s, _, _ in batch if id(s) not in now and not s.is_finished]
    check(not outside, f"{where}: {_labels(outside)} were scheduled but are not in self.running: an admitted "
                       "sequence joins self.running (append it), or the engine never schedules it again")
    idle = [s for s in admitted if s.status is not SequenceStatus.RUNNING and not s.is_finished]
    check(not idle, f"{where}: admitted {_labels(idle)} still have status {idle[0].status if idle else ''}: set "
                    "seq.status = SequenceStatus.RUNNING")
    if admitted:
        check(not gone, f"{where}: {_labels(admitted)} were admitted in a step that had to preempt: the pool is under "
                        "pressure, admit nothing in such a step")
        if [id(s) for s in admitted] != [id(s) for s in queued[:len(admitted)]]:
            last = max((queued.index(a) for a in admitted if a in queued), default=0)
            skipped = [s for s in queued[:last] if s not in admitted]
            fail(f"{where}: you admitted {_labels(admitted)} while {_labels(skipped)}, ahead of them in the queue, "
                 "kept waiting: admit in arrival order and stop at the first request that does not fit (no "
                 "overtaking)")
        seats = len(before) - len(gone) + len(admitted)
        check(seats <= case.max_num_seqs, f"{where}: {seats} sequences run after admitting {_labels(admitted)}, more "
                                          f"than max_num_seqs={case.max_num_seqs} (a request with n > 1 runs n "
                                          "sequences: count sequences, not requests)")
    want, want_out, want_copies = expected
    if [(id(s), a, n) for s, a, n in batch] != [(id(s), a, n) for s, a, n in want] or \
            {id(s) for s in listed} != {id(s) for s in want_out}:
        fail(f"{where}: the policy schedules {_fmt(want, want_out)}, yours scheduled {_fmt(batch, listed)} — "
             + _diff(batch, listed, want, want_out, before))
    copies = sorted(tuple(as_int(x, "a block id in out.block_copies") for x in pair) for pair in out.block_copies)
    check(copies == sorted(want_copies),
          f"{where}: out.block_copies is {copies} but bm.append_slots returned the copy-on-write pairs "
          f"{sorted(want_copies)}: add what append_slots returns to out.block_copies (a sample forked with n > 1 "
          "shares its blocks; the engine must copy a shared block before writing into it)")
    return StepRecord(k, batch, listed, state)


def _victims(where: str, before: list, sched: Scheduler) -> list:
    """The sequences preempted in the step (they left self.running unfinished): the newest ones, or fail."""
    __tracebackhide__ = True
    now = {id(s) for s in sched.running}
    gone = [s for s in before if id(s) not in now and not s.is_finished]
    if gone and {id(s) for s in gone} != {id(s) for s in before[-len(gone):]}:
        kept = [s for s in before[before.index(gone[0]):] if s not in gone]
        fail(f"{where}: you preempted {_labels(gone)} while newer {_labels(kept)} kept running: preempt the NEWEST "
             "running sequence (self.running[-1]) first — it has done the least work, and the oldest must always "
             "make progress")
    return gone


def _diff(batch: list[tuple], listed: list, want: list[tuple], want_out: list, before: list) -> str:
    """Why the learner's decision differs from the oracle's, in the policy's words."""
    got = {id(s): (a, n) for s, a, n in batch}
    if want_out and not listed:
        return ("the pool cannot hold the new tokens of a running sequence: preempt the newest running sequence "
                "(self.preempt(self.running[-1])) and add it to out.preempted, instead of waiting (nothing frees "
                "blocks while nobody runs)")
    if listed and not want_out:
        return "preempt only while bm.num_blocks_needed(seq.seq_id, seq.num_computed_tokens + n) > bm.num_free_blocks"
    if {id(s) for s in listed} != {id(s) for s in want_out}:
        return "preempt the newest running sequence, one at a time, only until the pool holds the new tokens"
    old = {id(s) for s in before}
    for seq, start, n in want:
        running = id(seq) in old
        if id(seq) not in got:
            left = len(seq.token_ids) - start           # it did not run: its tokens are as they were
            if running and n < left:
                return (f"running {_label(seq)} has {left} tokens left to compute, more than the budget left: give "
                        f"it a chunk n = min(tokens left, budget) = {n} — never skip it")
            if running:
                return (f"running {_label(seq)} should get {n} token(s) this step: serve every running sequence, "
                        "oldest first, while budget > 0"
                        + ("; stop early only when the victim is seq itself (compare sequences by identity, "
                           "`victim is seq`: a request with n > 1 has several)" if listed else ""))
            return (f"waiting {_label(seq)} fits (budget, max_num_seqs and free blocks allow it): admit it"
                    + (" with a partial first chunk n = min(tokens left, budget) (chunked prefill)" if n < left
                       else ""))
        a, m = got[id(seq)]
        if (a, m) != (start, n):
            if a != start:
                return (f"{_label(seq)} starts at position {a} but {start} of its tokens are already computed (the "
                        "prefix cache holds them): set seq.num_computed_tokens to what bm.allocate_prompt returns")
            return (f"{_label(seq)} should get min(tokens left, budget left) = {n}, not {m}"
                    + ("" if running else ", where tokens left = seq.num_tokens - bm.peek_prefix(seq.token_ids)"))
    extra = [s for s, _, _ in batch if all(s is not w for w, _, _ in want)]
    if extra:
        return (f"{_labels(extra)} should not run this step (out of budget, max_num_seqs reached, no free blocks for "
                "it, or a sequence ahead of it in the queue does not fit)")
    return "serve sequences in order: the running ones oldest first, then the waiting queue from its head"


_HINTS = {
    "NoFreeBlocksError": "a sequence's slots were reserved though the pool does not have them: check "
                         "bm.num_blocks_needed(...) (running) or bm.blocks_to_admit(...) (waiting) against "
                         "bm.num_free_blocks first — preempt the newest running sequence, or stop admitting",
    "KeyError": "a preempted sequence has no blocks any more: when the victim is seq itself, stop (return) "
                "instead of scheduling it",
}


def _crash(e: BaseException, k: int, state: str, expected: tuple, before: list, queued: list, sched: Scheduler,
           bm: BlockManager) -> str:
    """The message for a step that raised."""
    __tracebackhide__ = True
    msg = (str(e).strip().splitlines() or [""])[0]
    want = f"the policy schedules {_fmt(expected[0], expected[1])} here"
    gone = _victims(f"step {k} ({state})", before, sched)
    if isinstance(e, RuntimeError) and "made no progress" in msg:
        return (f"step {k} ({state}): your scheduler scheduled nothing although requests are unfinished"
                + (f" (it preempted {_labels(gone)})" if gone else "") + f"; {want} — "
                + _diff([], gone, *expected[:2], before))
    hint = _HINTS.get(type(e).__name__, "")
    if isinstance(e, KeyError) and any(f"seq_id {s.seq_id} " in msg for s in queued):
        hint = ("a waiting sequence has no block table yet: admit it with bm.allocate_prompt(seq.seq_id, "
                "seq.token_ids) before reserving its slots with bm.append_slots")
    if "num_computed_tokens" in msg and "append_slots" in msg:
        hint = ("after bm.allocate_prompt, seq.num_computed_tokens is what it returns (the cached prefix); reserve "
                "slots up to seq.num_computed_tokens + n")
    elif "slot_mapping" in msg:
        hint = "reserve the slots of every scheduled token: bm.append_slots(seq.seq_id, seq.num_computed_tokens + n)"
    for seq in sched.running:
        if bm.has_seq(seq.seq_id) and len(bm.block_table(seq.seq_id)) * bm.block_size >= seq.num_tokens + bm.block_size:
            hint = (f"{_label(seq)} was given slots past its {seq.num_tokens} tokens: n = min(tokens left, budget), "
                    "and for a waiting sequence tokens left = seq.num_tokens - bm.peek_prefix(seq.token_ids) (its "
                    "cached prefix is not computed again)")
    return (f"step {k} ({state}): the engine failed with {type(e).__name__}: {msg}{learner_location(e)}; {want}"
            + (f" — {hint}" if hint else ""))


def _check_end(engine: LLMEngine, bm: BlockManager, case: Case, done: dict) -> None:
    __tracebackhide__ = True
    for i, (p, m, n) in enumerate(zip(case.prompts, case.max_tokens, case.n)):
        samples, want = done.get(str(i)), list(_alone(p, m))
        check(samples is not None, f"request '{i}' never finished")
        check(len(samples) == n, f"request '{i}' asked for n={n} samples and returned {len(samples)}")
        for j, got in enumerate(samples):
            if got != want:
                d = next((t for t, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
                fail(f"request '{i}'{f' sample {j}' if n > 1 else ''} generated {got}, but generated alone it gives "
                     f"{want} (first difference at output token {d}): its KV cache was not what it computed — "
                     "a preempted sequence must recompute everything (num_computed_tokens = 0), an admitted one "
                     "starts at the cached prefix allocate_prompt returns")
    check(bm.num_free_blocks == case.num_blocks and not engine.has_unfinished_requests(),
          f"after every request finished, {case.num_blocks - bm.num_free_blocks} KV blocks are still in use"
          f"{' and sequences are still queued' if engine.has_unfinished_requests() else ''}")


# --------------------------------------------------------------------------- the probes and the checkers

def _probe(cls: type, task: int) -> type:
    """The learner's class with everything but the graded method taken from minillm's Scheduler."""
    graded = METHODS[task - 1]
    env = {m: vars(Scheduler)[m] for m in PLUMBING + METHODS if m != graded}
    if task == 3:
        env["preempt"] = _checked_preempt(getattr(cls, "preempt"))
    return type(cls.__name__, (cls,), env)


def _checked_preempt(fn: Callable[[Scheduler, Sequence], None]) -> Callable[[Scheduler, Sequence], None]:
    """The learner's preempt(seq), followed by a check of the state it must leave behind."""
    def preempt(self, seq: Sequence) -> None:
        __tracebackhide__ = True
        count, rest, queue = seq.metrics.num_preemptions, [s for s in self.running if s is not seq], list(self.waiting)
        fn(self, seq)
        rid, bm = f"preempt({_label(seq)})", self.block_manager
        check(all(s is not seq for s in self.running), f"after {rid} the sequence is still in self.running: remove it")
        check(not bm.has_seq(seq.seq_id), f"after {rid} its KV blocks are still allocated: free them with self."
                                          "block_manager.free(seq.seq_id) (recompute-style preemption keeps nothing)")
        computed = as_int(seq.num_computed_tokens, "num_computed_tokens")
        check(computed == 0, f"after {rid} num_computed_tokens is still {computed}: its KV is gone, so reset it to 0 "
                             "(it will recompute prompt + generated tokens)")
        check(seq.status is SequenceStatus.WAITING,
              f"after {rid} its status is {seq.status}: set SequenceStatus.WAITING")
        if not self.waiting or self.waiting[0] is not seq:
            where = "not in the waiting queue" if seq not in self.waiting else \
                f"at position {list(self.waiting).index(seq)} of the waiting queue"
            fail(f"after {rid} it is {where}: put it at the HEAD (self.waiting.appendleft) — it arrived before "
                 "everyone waiting, and FCFS must resume it first")
        check([id(s) for s in list(self.waiting)[1:]] == [id(s) for s in queue],
              f"{rid} changed the rest of the waiting queue: only seq goes to its head")
        lost = [s for s in rest if all(s is not r for r in self.running) or not bm.has_seq(s.seq_id)]
        check(not lost, f"{rid} also took {_labels(lost)} out of self.running or freed their blocks: preempt only seq "
                        "(a request with n > 1 runs n sequences, each with its own seq_id; match by identity, not "
                        "by request_id)")
        now = as_int(seq.metrics.num_preemptions, "seq.metrics.num_preemptions")
        check(now == count + 1, f"{rid} changed seq.metrics.num_preemptions from {count} to {now}: add 1 (the engine "
                                "reports it per request)")
    return preempt


SUITES = {   # task -> (hand-picked cases, hint, max_examples, pressure only)
    1: ((CHUNKING, DECODE_PLUS_CHUNK, TINY_BUDGET, PRESSURE, PRESSURE_CHUNKED, FORKED_PRESSURE), Hint(
        "schedule_running serves the running sequences oldest first within the token budget and reserves their KV "
        "slots; when the pool is short, the NEWEST running sequence is preempted to make room.",
        "a decode gets 1 token, an unfinished prompt min(tokens left, budget); compare bm.num_blocks_needed with "
        "bm.num_free_blocks before bm.append_slots; a victim goes into out.preempted, and when the victim is the "
        "sequence itself, stop; the block copies append_slots returns go into out.block_copies.",
        "for seq in self.running (oldest first) while budget > 0: n = min(seq.num_uncomputed, budget); while "
        "bm.num_blocks_needed(seq.seq_id, seq.num_computed_tokens + n) > bm.num_free_blocks: preempt "
        "self.running[-1] (add it to out.preempted; return if it was seq); then out.block_copies += "
        "bm.append_slots(...), out.scheduled.append((seq, n)), budget -= n."), 20, False),
    2: ((CHUNKING, ONE_AT_A_TIME, HEAD_BLOCKS, SHARED_PREFIX, SHARED_PREFIX_TIGHT, DECODE_PLUS_CHUNK,
         FORKS_FILL_SEATS), Hint(
        "admit_waiting takes sequences from the HEAD of the waiting queue, in order (no overtaking), while the "
        "budget, max_num_seqs and the free blocks allow; a prompt's first chunk may be partial.",
        "a waiting prompt starts after its cached prefix (bm.peek_prefix); stop at the first sequence whose blocks "
        "do not fit (bm.blocks_to_admit against bm.num_free_blocks); to admit one, bm.allocate_prompt gives its "
        "num_computed_tokens, then reserve the chunk's slots, mark it RUNNING and schedule it.",
        "while waiting and budget > 0 and len(running) < max_num_seqs: seq = waiting[0]; cached = "
        "bm.peek_prefix(seq.token_ids); n = min(seq.num_tokens - cached, budget); stop if bm.blocks_to_admit("
        "seq.token_ids, cached + n) > bm.num_free_blocks; else popleft, seq.num_computed_tokens = "
        "bm.allocate_prompt(...), append_slots(seq.seq_id, seq.num_computed_tokens + n), status RUNNING, "
        "running.append, schedule (seq, n), budget -= n."), 20, False),
    3: ((PRESSURE, PRESSURE_CHUNKED, FORKED_PRESSURE), Hint(
        "recompute-style preemption: the victim keeps nothing of its KV, and it goes back to the front of the queue.",
        "take it out of self.running, free all its blocks, forget what it has computed, mark it WAITING, count the "
        "preemption in its metrics, and put it at the HEAD of self.waiting (it arrived before everyone waiting).",
        "remove seq from self.running, self.block_manager.free(seq.seq_id), status = SequenceStatus.WAITING, "
        "num_computed_tokens = 0, metrics.num_preemptions += 1, self.waiting.appendleft(seq)."), 12, True),
}


def _verify(task: int, cls, time_limit: float) -> None:
    __tracebackhide__ = True
    examples, hint, max_examples, pressure_only = SUITES[task]
    probe = _probe(cls if isinstance(cls, type) else type(cls), task)
    timed_out = []

    def prop(case: Case) -> None:
        if timed_out:   # an endless loop: fail every further example at once (else shrinking would hang too)
            raise GradingError(timed_out[0])
        try:
            run_case(probe, case, time_limit=time_limit)
        except GradingError as e:
            if "endless loop" in str(e):
                timed_out.append(str(e))
            raise

    for ex in reversed(examples):
        prop = example(case=ex)(prop)
    strategy = cases(pressure=True) if pressure_only else st.one_of(cases(), cases(pressure=True))
    run_property(given(case=strategy)(prop), max_examples=max_examples, hint=hint)


def verify_lab04_1(cls, *, time_limit: float = TIME_LIMIT_S) -> None:
    _verify(1, cls, time_limit)


def verify_lab04_2(cls, *, time_limit: float = TIME_LIMIT_S) -> None:
    _verify(2, cls, time_limit)


def verify_lab04_3(cls, *, time_limit: float = TIME_LIMIT_S) -> None:
    _verify(3, cls, time_limit)
    probe = _probe(cls if isinstance(cls, type) else type(cls), 3)
    with _guarded(time_limit):
        _preempt_the_oldest(probe)


def _preempt_the_oldest(probe: type) -> None:
    """preempt(seq) on a sequence that is not the newest: the engine's policy never does that, but the contract is
    `seq`, whichever it is. Then the requests run to the end and must still be right."""
    __tracebackhide__ = True
    case = MID_PREEMPT
    engine = LLMEngine.from_model(tiny_model(), None, block_size=case.block_size, num_blocks=case.num_blocks,
                                  max_num_seqs=case.max_num_seqs, max_num_batched_tokens=case.budget,
                                  enable_prefix_caching=False, attention_backend="torch")
    sched = probe(engine.scheduler.config, engine.block_manager)
    engine.plug(scheduler=sched)
    for i, (p, m) in enumerate(zip(case.prompts, case.max_tokens)):
        engine.add_request(list(p), SamplingParams(temperature=0, max_tokens=m, ignore_eos=True), request_id=str(i))
    done: dict = {}
    for _ in range(2):                                  # the prompts, then one decode step: all three run
        engine.step()
    oldest = sched.running[0]
    calls = (f"{len(case.prompts)} requests of 6 tokens, 2 engine steps (all running: "
             f"{_labels(sched.running)}), then preempt({_label(oldest)}) — the oldest")
    try:
        sched.preempt(oldest)
    except GradingError as e:
        fail(f"{e.message} (preempt called on the oldest of 3 running sequences: it must act on the sequence it "
             "is given, whichever it is)", SUITES[3][1], example=calls)
    except Exception as e:  # noqa: BLE001 — the learner's code may raise anything
        fail(f"preempt({_label(oldest)}) of the oldest running sequence raised {type(e).__name__}: "
             f"{e}{learner_location(e)}", SUITES[3][1], example=calls)
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                done[o.request_id] = [c.token_ids for c in o.outputs]
    _check_end(engine, engine.block_manager, case, done)


def _task(k: int, verify: Callable[..., None]) -> Task:
    name = METHODS[k - 1]
    return Task(f"lab04_{k}", what=name, verify=verify, kind="methods", base=Scheduler, methods=(name,),
                instances="grader", engine=minillm_objects(f"minillm.engine.scheduler:Scheduler.{name}"),
                oracles=lambda: [fcfs_step])


TASKS = {t.id: t for t in (_task(1, verify_lab04_1), _task(2, verify_lab04_2), _task(3, verify_lab04_3))}

check_lab04_1 = TASKS["lab04_1"].checker(
    'schedule_running(self, out, budget): token budget, chunked prefill, preempt the newest when short.')
check_lab04_2 = TASKS["lab04_2"].checker(
    'admit_waiting(self, out, budget): FCFS admission by budget, max_num_seqs and free blocks.')
check_lab04_3 = TASKS["lab04_3"].checker('preempt(self, seq): recompute-style preemption.')
