"""Checkers for lab04 — continuous batching: the scheduler step.

The learner subclasses `minillm.engine.scheduler.Scheduler` and overrides one method per task (the notebook
documents the same contracts):
  lab04_1  _schedule_running(self, out, budget): running sequences first, oldest first; a decode gets 1 token,
           an unfinished prompt its next chunk min(left, budget); reserve slots with bm.append_slots; when the
           pool cannot hold them, preempt the NEWEST running sequence (self.preempt) until it can.
  lab04_2  _admit_waiting(self, out, budget): admit waiting sequences in arrival order (no overtaking) while
           budget, max_num_seqs and free blocks allow; the first chunk may be partial (chunked prefill);
           prefix-cache aware (bm.peek_prefix / blocks_to_admit / allocate_prompt).
  lab04_3  preempt(self, seq): recompute-style preemption: leave `running`, free every block, forget the
           computed tokens, go back to the HEAD of the waiting queue, count the preemption.

How a checker works. It builds a probe class: the learner's class with the two methods it does not grade
replaced by the reference policy written here (`ReferenceScheduler`, not minillm's code), so each task is
graded on its own. The probe is plugged into a real `LLMEngine` running a tiny random Llama (built here)
on request sets hypothesis draws (random prompts, shared prefixes, staggered arrivals, small KV pools that
force preemption, small token budgets that force chunking). Every step is validated as it happens (token
budget, max_num_seqs, slots reserved, victims newest-first, FCFS admission, preemption state, block-manager
invariants); at the end the outputs must equal generating each request alone (greedy, `SimpleGenerator`),
every block must be back in the pool, and the step-by-step decisions must equal the reference policy's.
Exceptions from the learner's code are reported with the step, the engine state and a hint.
"""
from __future__ import annotations

import functools
import signal
import threading
import traceback
from dataclasses import dataclass, field

import torch
from hypothesis import example, given, strategies as st

from minillm.engine.scheduler import Scheduler, SchedulerOutput
from minillm.engine.sequence import SequenceStatus
from minillm.grading.core import fail, reject_reference, run_property

__all__ = ["check_lab04_1", "check_lab04_2", "check_lab04_3", "ReferenceScheduler", "Case", "run_case",
           "tiny_model"]

TIME_LIMIT_S = 30           # one example running longer than this has an endless loop somewhere


# --------------------------------------------------------------------------- the tiny model

@functools.lru_cache(maxsize=None)
def tiny_model(seed: int = 0, heads: int = 4, kv_heads: int = 2, head_dim: int = 16, layers: int = 2,
               vocab: int = 128, max_pos: int = 512):
    """A minillm LlamaModel with random weights (wide enough that greedy outputs notice a wrong KV cache)."""
    from minillm.config import ModelConfig
    from minillm.models.llama import LlamaModel
    cfg = ModelConfig(vocab_size=vocab, hidden_size=heads * head_dim, intermediate_size=3 * heads * head_dim,
                      num_layers=layers, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
                      max_position_embeddings=max_pos, tie_word_embeddings=False, eos_token_id=2)
    state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        model = LlamaModel(cfg)
        with torch.no_grad():
            for p in model.parameters():
                p.normal_(0, 0.3) if p.dim() > 1 else p.uniform_(0.5, 1.5)
    finally:
        torch.random.set_rng_state(state)
    return model.float().eval()


class _one_thread:
    """The tiny model's ops take microseconds: extra threads only add overhead (and contention)."""

    def __enter__(self):
        self.threads = torch.get_num_threads()
        torch.set_num_threads(1)

    def __exit__(self, *exc):
        torch.set_num_threads(self.threads)
        return False


@functools.lru_cache(maxsize=4096)
def _alone(prompt: tuple[int, ...], max_tokens: int) -> tuple[int, ...]:
    """The truth: the request generated on its own, greedily, with a contiguous cache."""
    from minillm.engine.simple import SimpleGenerator
    from minillm.sampling.params import SamplingParams
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    with _one_thread():
        return tuple(SimpleGenerator(tiny_model(), None).generate(list(prompt), params)[1])


# --------------------------------------------------------------------------- the reference policy (the spec)

class ReferenceScheduler(Scheduler):
    """FCFS continuous batching, written out independently of minillm's Scheduler (same policy):
    running first (oldest first, decodes 1 token, prompts their next chunk, preempt the newest when the pool is
    short), then admission in arrival order while budget, max_num_seqs and free blocks allow; nothing is
    admitted in a step that preempted."""

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        self._schedule_running(out, budget)
        if not out.preempted:
            self._admit_waiting(out, budget - out.num_batched_tokens)
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> None:
        bm, chunked = self.block_manager, self.config.enable_chunked_prefill
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            left = seq.num_tokens - seq.num_computed_tokens
            n = min(left, budget)
            if n < left and not chunked:
                i += 1
                continue
            while bm.num_blocks_needed(seq.seq_id, seq.num_computed_tokens + n) > bm.num_free_blocks:
                victim = self.running[-1]
                self.preempt(victim)
                if victim in self.running:      # a broken preempt() would make this loop endless
                    raise _Violation("preempt(seq) must remove seq from self.running (it is still there after "
                                     "the call)", "preempt")
                out.preempted.append(victim)
                if victim is seq:
                    return
            out.block_copies += bm.append_slots(seq.seq_id, seq.num_computed_tokens + n)
            out.scheduled.append((seq, n))
            budget -= n
            i += 1

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> None:
        bm, chunked = self.block_manager, self.config.enable_chunked_prefill
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            cached = bm.peek_prefix(seq.token_ids)
            left = seq.num_tokens - cached
            n = min(left, budget)
            if n < left and not chunked:
                return
            if bm.blocks_to_admit(seq.token_ids, cached + n) > bm.num_free_blocks:
                return
            self.waiting.popleft()
            seq.num_computed_tokens = bm.allocate_prompt(seq.seq_id, seq.token_ids)
            if seq.metrics.first_scheduled_time is None:
                seq.metrics.num_cached_tokens = seq.num_computed_tokens
            out.block_copies += bm.append_slots(seq.seq_id, seq.num_computed_tokens + n)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.scheduled.append((seq, n))
            budget -= n

    def preempt(self, seq) -> None:
        self.running.remove(seq)
        self.block_manager.free(seq.seq_id)
        seq.status = SequenceStatus.WAITING
        seq.num_computed_tokens = 0
        seq.metrics.num_preemptions += 1
        self.waiting.appendleft(seq)


# The method each task grades, and the reference methods the probe borrows for the others.
TASK_METHOD = {1: "_schedule_running", 2: "_admit_waiting", 3: "preempt"}


class _Violation(Exception):
    """A broken rule, found while the engine runs. `task` says which method's rule it is."""

    def __init__(self, message: str, task: str | None = None) -> None:
        super().__init__(message)
        self.task = task


# --------------------------------------------------------------------------- cases

@dataclass(frozen=True)
class Case:
    """A request set and an engine configuration. Request i arrives at step arrivals[i]."""
    prompts: tuple[tuple[int, ...], ...]
    max_tokens: tuple[int, ...]
    arrivals: tuple[int, ...]
    block_size: int
    num_blocks: int
    budget: int
    max_num_seqs: int
    prefix_caching: bool = False

    def __repr__(self) -> str:
        reqs = ", ".join(f"'{i}': {len(p)}-token prompt + {m} out @step {a}"
                         for i, (p, m, a) in enumerate(zip(self.prompts, self.max_tokens, self.arrivals)))
        return (f"[{reqs}]; max_num_batched_tokens={self.budget}, max_num_seqs={self.max_num_seqs}, "
                f"KV pool {self.num_blocks} blocks x {self.block_size} tokens, "
                f"prefix caching {'on' if self.prefix_caching else 'off'}")

    def _repr_pretty_(self, p, cycle) -> None:     # hypothesis prints falsifying examples with this
        p.text(repr(self))


def make_case(requests, *, block_size=4, num_blocks=None, spare_blocks=0, budget=16, max_num_seqs=8,
              prefix_caching=False, arrivals=None) -> Case:
    """requests: [(prompt token list, max_tokens)]. Without num_blocks, the pool holds the longest request plus
    `spare_blocks` blocks (small pools force preemption)."""
    prompts = tuple(tuple(int(t) for t in p) for p, _ in requests)
    outs = tuple(int(m) for _, m in requests)
    if num_blocks is None:
        longest = max(len(p) + m for p, m in zip(prompts, outs))
        num_blocks = -(-longest // block_size) + spare_blocks
    return Case(prompts, outs, tuple(arrivals or [0] * len(prompts)), block_size, num_blocks, budget,
                max_num_seqs, prefix_caching)


def _toks(seed: int, n: int, lo: int = 3, hi: int = 128) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(lo, hi, (n,), generator=g).tolist()


@st.composite
def cases(draw, pressure: bool = False):
    """Random request sets; `pressure` draws more, longer-running requests into a pool barely larger than the
    longest one, so most cases preempt. Token ids come from seeds, so hypothesis shrinks lengths, not tokens."""
    n = draw(st.integers(2, 5) if pressure else st.integers(1, 5))
    shared = _toks(draw(st.integers(0, 99)), draw(st.integers(0, 12)))
    reqs = []
    for i in range(n):
        own = _toks(1000 + 37 * i + draw(st.integers(0, 99)), draw(st.integers(1, 36)))
        prompt = (shared if draw(st.booleans()) else []) + own
        reqs.append((prompt, draw(st.integers(4, 16) if pressure else st.integers(1, 10))))
    gaps = draw(st.lists(st.integers(0, 1 if pressure else 3), min_size=n, max_size=n))
    return make_case(reqs, block_size=draw(st.sampled_from([4, 2, 1, 8])),
                     spare_blocks=draw(st.integers(0, 2) if pressure else st.integers(0, 12)),
                     budget=draw(st.integers(2, 48)),
                     max_num_seqs=draw(st.integers(2, 5) if pressure else st.integers(1, 5)),
                     prefix_caching=draw(st.booleans()), arrivals=[sum(gaps[:i]) for i in range(n)])


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


# --------------------------------------------------------------------------- running a case

@dataclass
class Step:
    scheduled: tuple                # ((request id, n), ...)
    preempted: tuple                # (request id, ...)
    state: str                      # the engine state before the step, for messages


@dataclass
class RunResult:
    outputs: dict = field(default_factory=dict)     # request id -> tuple of output token ids
    trace: list = field(default_factory=list)       # [Step]
    error: BaseException | None = None
    error_step: int = 0
    error_state: str = ""
    error_where: str = ""
    free_blocks_at_end: int = 0
    leftover: str = ""
    stall_hint: str = ""


def _state(sched, bm, budget) -> str:
    def s(q):
        return (f"'{q.request_id}' {q.num_computed_tokens}/{q.num_tokens}"
                + ("" if q.num_tokens > q.num_prompt_tokens else " (prompt)"))
    run = ", ".join(s(q) for q in sched.running) or "none"
    wait = ", ".join(f"'{q.request_id}' {q.num_tokens} tok" for q in sched.waiting) or "none"
    return (f"running [{run}] (computed/total tokens), waiting [{wait}], {bm.num_free_blocks} free blocks, "
            f"budget {budget}")


def _where(exc: BaseException) -> str:
    """The innermost frame of the learner's own code (not minillm's) in the traceback."""
    frames = traceback.extract_tb(exc.__traceback__)
    mine = [f for f in frames if "/minillm/" not in f.filename.replace("\\", "/") and "hypothesis" not in f.filename]
    if not mine:
        return ""
    f = mine[-1]
    return f" (in {f.name}, line {f.lineno}: `{(f.line or '').strip()}`)"


def _validate(pre, out, sched, bm, case: Case, step: int) -> None:
    """The rules every step must keep, whatever the policy details."""
    pre_running, pre_waiting, state = pre
    where = f"step {step} ({state})"
    if not isinstance(out, SchedulerOutput):
        raise _Violation(f"schedule() returned {type(out).__name__}, not a SchedulerOutput", None)
    for item in out.scheduled:
        if not (isinstance(item, tuple) and len(item) == 2):
            raise _Violation(f"out.scheduled must hold (sequence, num_new_tokens) pairs, got {item!r}", None)
    # --- preemption: victims are the newest running sequences, and are listed
    post_running = list(sched.running)
    gone = [s for s in pre_running if s not in post_running and not s.is_finished]
    listed = list(out.preempted)
    if gone:
        newest = pre_running[-len(gone):]
        if {id(s) for s in gone} != {id(s) for s in newest}:
            newer = [s.request_id for s in pre_running
                     if s not in gone and pre_running.index(s) > min(pre_running.index(g) for g in gone)]
            raise _Violation(f"{where}: you preempted {[s.request_id for s in gone]} while newer {newer} kept "
                             "running: preempt the NEWEST running sequence (self.running[-1]) first — it has done "
                             "the least work, and the oldest request must always make progress", "victim")
    if {id(s) for s in gone} != {id(s) for s in listed}:
        raise _Violation(f"{where}: out.preempted lists {[s.request_id for s in listed]} but the sequences that "
                         f"left self.running are {[s.request_id for s in gone]}: append every victim to "
                         "out.preempted", "preempt_list")
    for s in gone:
        if s.num_computed_tokens != 0 or bm.has_seq(s.seq_id) or s.status is not SequenceStatus.WAITING \
                or s not in sched.waiting:
            raise _Violation(f"{where}: preempted request '{s.request_id}' is not back in the waiting queue "
                             "with no blocks and num_computed_tokens=0", "preempt")
    # --- what is scheduled
    seen = set()
    for seq, n in out.scheduled:
        rid = getattr(seq, "request_id", "?")
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise _Violation(f"{where}: request '{rid}' was scheduled with {n!r} tokens; every scheduled sequence "
                             "computes at least 1 token (stop when the budget is used up)", "budget")
        if seq.num_computed_tokens + n > seq.num_tokens:
            cached = (" — its first tokens came from the prefix cache (bm.allocate_prompt returned "
                      f"{seq.num_computed_tokens}): n = min(seq.num_tokens - bm.peek_prefix(seq.token_ids), budget)"
                      if seq not in pre_running and seq.num_computed_tokens > 0 else "")
            raise _Violation(f"{where}: request '{rid}' was scheduled for {n} tokens but only "
                             f"{seq.num_tokens - seq.num_computed_tokens} are left to compute "
                             f"({seq.num_computed_tokens} of {seq.num_tokens} done){cached}", "count")
        if id(seq) in seen:
            raise _Violation(f"{where}: request '{rid}' appears twice in out.scheduled", "count")
        seen.add(id(seq))
        if seq not in sched.running:
            raise _Violation(f"{where}: request '{rid}' was scheduled but is not in self.running", "running")
        if not bm.has_seq(seq.seq_id) or len(bm.block_table(seq.seq_id)) * bm.block_size < seq.num_computed_tokens + n:
            raise _Violation(f"{where}: request '{rid}' was scheduled for positions [{seq.num_computed_tokens}, "
                             f"{seq.num_computed_tokens + n}) but holds no KV slots for them: reserve them with "
                             "bm.append_slots(seq.seq_id, seq.num_computed_tokens + n) before scheduling", "slots")
        if bm.num_computed_tokens(seq.seq_id) != seq.num_computed_tokens:
            raise _Violation(f"{where}: request '{rid}' says num_computed_tokens={seq.num_computed_tokens} but its "
                             f"blocks hold {bm.num_computed_tokens(seq.seq_id)} computed tokens: set "
                             "seq.num_computed_tokens to what bm.allocate_prompt returns (the cached prefix)",
                             "computed")
    total = out.num_batched_tokens
    if total > case.budget:
        sizes = ", ".join(f"'{s.request_id}': {n}" for s, n in out.scheduled)
        raise _Violation(f"{where}: the step schedules {total} tokens ({sizes}), more than max_num_batched_tokens="
                         f"{case.budget}", "budget")
    if len(sched.running) > case.max_num_seqs:
        raise _Violation(f"{where}: {len(sched.running)} sequences are running after the step, more than "
                         f"max_num_seqs={case.max_num_seqs}", "max_seqs")
    # --- admission: first come, first served
    admitted = [s for s in post_running if s not in pre_running]
    if admitted:
        if gone:
            raise _Violation(f"{where}: {[s.request_id for s in admitted]} were admitted in a step that had to "
                             "preempt: the pool is under pressure, admit nothing in such a step", "admit_after_preempt")
        if [id(s) for s in admitted] != [id(s) for s in pre_waiting[:len(admitted)]]:
            last = max((pre_waiting.index(a) for a in admitted if a in pre_waiting), default=0)
            skipped = [s.request_id for s in pre_waiting[:last] if s not in admitted]
            raise _Violation(f"{where}: you admitted {[s.request_id for s in admitted]} while {skipped}, ahead of "
                             "them in the queue, kept waiting: admit in arrival order and stop at the first "
                             "request that does not fit (no overtaking)", "overtake")
        sched_ids = {id(s) for s, _ in out.scheduled}
        for s in admitted:
            if id(s) not in sched_ids:
                raise _Violation(f"{where}: request '{s.request_id}' was admitted into self.running but not "
                                 "scheduled: give it its first chunk in the same step", "admit_unscheduled")


def _stall_hint(sched, bm, case: Case) -> str:
    """Why a scheduler that schedules nothing in this state is wrong (computed before each step)."""
    budget = case.budget
    for seq in sched.running:
        left = seq.num_tokens - seq.num_computed_tokens
        if left > budget:
            return (f"running request '{seq.request_id}' has {left} prompt tokens left, more than the budget "
                    f"({budget}): give it a chunk n = min(tokens left, budget) — never skip it")
    for seq in sched.running:
        n = min(seq.num_tokens - seq.num_computed_tokens, budget)
        if bm.has_seq(seq.seq_id) and \
                bm.num_blocks_needed(seq.seq_id, seq.num_computed_tokens + n) > bm.num_free_blocks:
            return (f"running request '{seq.request_id}' needs more blocks than are free: make room by preempting "
                    "the newest running sequence (self.preempt(self.running[-1])) instead of waiting — nothing "
                    "frees blocks while nobody runs")
    if sched.waiting and len(sched.running) < case.max_num_seqs:
        head = sched.waiting[0]
        if head.num_tokens > budget:
            return (f"waiting request '{head.request_id}' has a {head.num_tokens}-token prompt, more than the budget "
                    f"({budget}): admit it with a partial first chunk n = min(tokens left, budget) (chunked "
                    "prefill); only free blocks and max_num_seqs make it wait")
        return (f"waiting request '{head.request_id}' fits ({bm.num_free_blocks} free blocks): admit it")
    return ""


class _Timeout(Exception):
    pass


class _time_limit:
    """SIGALRM-based guard against endless loops (main thread on POSIX only; elsewhere a no-op)."""

    def __init__(self, seconds: float) -> None:
        self.seconds, self.active = seconds, False

    def __enter__(self):
        if hasattr(signal, "SIGALRM") and threading.current_thread() is threading.main_thread() \
                and signal.getitimer(signal.ITIMER_REAL)[0] == 0:
            def handler(signum, frame):
                raise _Timeout()
            self.old = signal.signal(signal.SIGALRM, handler)
            signal.setitimer(signal.ITIMER_REAL, self.seconds)
            self.active = True
        return self

    def __exit__(self, *exc):
        if self.active:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, self.old)
        return False


def run_case(scheduler_cls, case: Case, max_steps: int = 5000, validate: bool = True) -> RunResult:
    """Run `case` through an LLMEngine whose scheduler is `scheduler_cls(config, block_manager)`; record the
    trace, validate every step, stop at the first error (kept in the result, not raised)."""
    from minillm.engine.llm_engine import LLMEngine
    engine = LLMEngine.from_model(tiny_model(), None, block_size=case.block_size, num_blocks=case.num_blocks,
                                  max_num_seqs=case.max_num_seqs, max_num_batched_tokens=case.budget,
                                  enable_prefix_caching=case.prefix_caching, attention_backend="torch")
    with _one_thread():
        return _run(engine, scheduler_cls, case, max_steps, validate)


def _run(engine, scheduler_cls, case: Case, max_steps: int, validate: bool) -> RunResult:
    from minillm.sampling.params import SamplingParams
    res = RunResult()
    bm = engine.block_manager
    try:
        sched = scheduler_cls(engine.scheduler.config, bm)
        engine.plug(scheduler=sched)
    except NotImplementedError:
        raise
    except Exception as e:  # noqa: BLE001
        res.error, res.error_where = e, _where(e)
        return res
    inner = sched.schedule
    step_no = [0]

    def recorded():
        pre = (list(sched.running), list(sched.waiting), _state(sched, bm, case.budget))
        res.error_state = pre[2]
        out = inner()
        if validate:
            _validate(pre, out, sched, bm, case, step_no[0])
        res.trace.append(Step(tuple((s.request_id, n) for s, n in out.scheduled),
                              tuple(s.request_id for s in out.preempted), pre[2]))
        return out

    sched.schedule = recorded
    order = sorted(range(len(case.prompts)), key=lambda i: case.arrivals[i])
    tick = 0
    try:
        while order or engine.has_unfinished_requests():
            while order and case.arrivals[order[0]] <= tick:
                i = order.pop(0)
                engine.add_request(list(case.prompts[i]), SamplingParams(temperature=0, max_tokens=case.max_tokens[i],
                                                                         ignore_eos=True), request_id=str(i))
            if engine.has_unfinished_requests():
                step_no[0] += 1
                if step_no[0] > max_steps:
                    raise _Violation(f"no progress: {max_steps} steps and requests are still unfinished "
                                     f"({_state(sched, bm, case.budget)}) — some request is starving", "starve")
                if validate:
                    res.stall_hint = _stall_hint(sched, bm, case)
                for o in engine.step():
                    if o.finished:
                        res.outputs[o.request_id] = tuple(o.outputs[0].token_ids)
                if validate:
                    try:
                        bm.check_invariants()
                    except AssertionError as e:
                        raise _Violation(f"after step {step_no[0]} the block manager is inconsistent: {e}",
                                         "invariants") from None
            tick += 1
    except NotImplementedError:
        raise
    except BaseException as e:  # noqa: BLE001 — the learner's code may raise anything
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        res.error, res.error_step, res.error_where = e, step_no[0], _where(e)
        return res
    res.free_blocks_at_end = bm.num_free_blocks
    if sched.running or sched.waiting:
        res.leftover = _state(sched, bm, case.budget)
    return res


@functools.lru_cache(maxsize=512)
def reference_run(case: Case) -> RunResult:
    res = run_case(ReferenceScheduler, case)
    if res.error is not None:   # the reference must run every case the strategies can draw
        raise RuntimeError(f"the reference scheduler failed on {case!r}: {res.error!r}")
    return res


# --------------------------------------------------------------------------- judging a run

_HINTS = {
    1: {
        "NoFreeBlocksError": "you reserved slots the pool does not have: while bm.num_blocks_needed(seq.seq_id, "
                             "seq.num_computed_tokens + n) > bm.num_free_blocks, preempt the newest running "
                             "sequence (self.preempt(self.running[-1])) — and stop if the victim is seq itself",
        "KeyError": "a preempted sequence has no blocks any more: when the victim is seq itself, stop (return) "
                    "instead of scheduling it",
    },
    2: {
        "NoFreeBlocksError": "admit a sequence only if bm.blocks_to_admit(seq.token_ids, cached + n) <= "
                             "bm.num_free_blocks; otherwise stop admitting",
        "ValueError": "after bm.allocate_prompt, seq.num_computed_tokens is what it returns (the prompt tokens found "
                      "in the prefix cache); reserve slots up to seq.num_computed_tokens + n",
    },
    3: {},
}


def _judge(task: int, case: Case, res: RunResult) -> None:
    """Turn a learner's run into an AssertionError with a diagnosis, or return when it equals the reference."""
    if res.error is not None:
        e = res.error
        if isinstance(e, _Violation):
            assert False, str(e)
        if isinstance(e, _Timeout):
            assert False, (f"the scheduler did not return within {TIME_LIMIT_S} s at step {res.error_step} "
                           f"({res.error_state}): an endless loop?")
        name = type(e).__name__
        msg = (str(e).strip().splitlines() or [""])[0]
        if isinstance(e, RuntimeError) and "made no progress" in msg:
            hint = res.stall_hint
            assert False, (f"starvation at step {res.error_step}: the scheduler scheduled nothing although "
                           f"requests are unfinished ({res.error_state})" + (f" — {hint}" if hint else ""))
        hint = _HINTS[task].get(name, "")
        assert False, (f"the engine failed at step {res.error_step} with {name}: {msg}{res.error_where} "
                       f"[{res.error_state}]" + (f" — {hint}" if hint else ""))
    for i, (p, m) in enumerate(zip(case.prompts, case.max_tokens)):
        got, want = res.outputs.get(str(i)), _alone(p, m)
        if got is None:
            assert False, f"request '{i}' never finished"
        if got != want:
            k = next((j for j, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
            why = {3: " — a preempted sequence has no KV left: reset num_computed_tokens to 0 so it recomputes",
                   2: " — after bm.allocate_prompt the sequence's num_computed_tokens is what it returns (cached "
                      "tokens); the first chunk starts there"}.get(task, "")
            assert False, (f"request '{i}' generated {list(got)}, but generated alone it gives {list(want)} "
                           f"(first difference at output token {k}){why}")
    if res.free_blocks_at_end != case.num_blocks or res.leftover:
        assert False, (f"after every request finished, {case.num_blocks - res.free_blocks_at_end} KV blocks are "
                       f"still in use{' and the queues are not empty: ' + res.leftover if res.leftover else ''}")
    ref = reference_run(case)
    for k, (a, b) in enumerate(zip(res.trace, ref.trace), start=1):
        if (a.scheduled, a.preempted) != (b.scheduled, b.preempted):
            why = _diff_hint(a, b)
            assert False, (f"step {k} ({b.state}): the policy schedules {_fmt(b)}, yours scheduled {_fmt(a)}"
                           + (f" — {why}" if why else ""))
    if len(res.trace) != len(ref.trace):
        assert False, f"your run took {len(res.trace)} steps, the policy takes {len(ref.trace)}"


def _fmt(step: Step) -> str:
    s = "[" + ", ".join(f"'{r}': {n}" for r, n in step.scheduled) + "]"
    return s + (f" and preempts {list(step.preempted)}" if step.preempted else "")


def _diff_hint(mine: Step, ref: Step) -> str:
    a, b = dict(mine.scheduled), dict(ref.scheduled)
    if ref.preempted and not mine.preempted:
        return "when the pool cannot hold a sequence's new tokens, preempt the newest running sequence"
    if mine.preempted and not ref.preempted:
        return "preempt only when bm.num_blocks_needed(...) exceeds bm.num_free_blocks"
    for r, n in ref.scheduled:
        if r not in a:
            return (f"request '{r}' should get {n} token(s) this step: serve the running sequences oldest first, "
                    "then admit waiting ones while budget, max_num_seqs and free blocks allow (chunking prompts "
                    "that exceed the budget)")
        if a[r] != n:
            return f"request '{r}' should get min(tokens left, budget left) = {n}, not {a[r]}"
    extra = [r for r in a if r not in b]
    if extra:
        return f"{extra} should not run this step (budget, max_num_seqs, free blocks, or a preemption in this step)"
    return "serve sequences in order: running ones oldest first, then the waiting queue from its head"


# --------------------------------------------------------------------------- the checkers

def _probe(cls, task: int):
    """The learner's class with the other two tasks' methods (and schedule()) taken from the reference."""
    if not isinstance(cls, type):
        cls = type(cls)
    if not issubclass(cls, Scheduler):
        fail(f"pass your scheduler class (a subclass of minillm's Scheduler), got {cls.__name__}",
             "class MyScheduler(Scheduler): ... then check(MyScheduler)")
    name = TASK_METHOD[task]
    fn = getattr(cls, name)
    owner = next(k for k in cls.__mro__ if name in vars(k))
    if owner is Scheduler or owner is ReferenceScheduler or (owner.__module__ or "").startswith("minillm."):
        fail(f"{cls.__name__} does not define {name}: write it in the answer cell (it inherits minillm's).")
    from minillm.engine.scheduler import Scheduler as _S
    reject_reference(fn, getattr(_S, name), getattr(ReferenceScheduler, name))
    borrowed = {"schedule": ReferenceScheduler.schedule}
    for t, m in TASK_METHOD.items():
        if t != task:
            borrowed[m] = getattr(ReferenceScheduler, m)
    if task == 3:
        borrowed["preempt"] = _checked_preempt(fn)
    return type(cls.__name__, (cls,), borrowed)


def _checked_preempt(fn):
    """The learner's preempt(seq), followed by a check of the state it must leave behind."""
    def preempt(self, seq):
        before = seq.metrics.num_preemptions
        first_waiting = self.waiting[0] if self.waiting else None
        fn(self, seq)
        rid = f"'{seq.request_id}'"
        if seq in self.running:
            raise _Violation(f"after preempt({rid}) the sequence is still in self.running: remove it", "preempt")
        if self.block_manager.has_seq(seq.seq_id):
            raise _Violation(f"after preempt({rid}) its KV blocks are still allocated: free them with "
                             "self.block_manager.free(seq.seq_id) (recompute-style preemption keeps nothing)",
                             "preempt")
        if seq.num_computed_tokens != 0:
            raise _Violation(f"after preempt({rid}) num_computed_tokens is still {seq.num_computed_tokens}: its KV "
                             "is gone, so reset it to 0 (it will recompute prompt + generated tokens)", "preempt")
        if seq.status is not SequenceStatus.WAITING:
            raise _Violation(f"after preempt({rid}) its status is {seq.status}: set SequenceStatus.WAITING",
                             "preempt")
        if not self.waiting or self.waiting[0] is not seq:
            where = "not in the waiting queue" if seq not in self.waiting else \
                f"at position {list(self.waiting).index(seq)} of the waiting queue"
            raise _Violation(f"after preempt({rid}) it is {where}: put it at the HEAD (self.waiting.appendleft) — "
                             "it arrived before everyone waiting, and FCFS must resume it first", "preempt")
        if list(self.waiting)[1:2] != ([first_waiting] if first_waiting is not None else []):
            raise _Violation(f"preempt({rid}) reordered the rest of the waiting queue", "preempt")
        if seq.metrics.num_preemptions != before + 1:
            raise _Violation(f"preempt({rid}) changed seq.metrics.num_preemptions from {before} to "
                             f"{seq.metrics.num_preemptions}: add 1 (the engine reports it per request)", "preempt")
    return preempt


def _check(task: int, cls, strategy, examples, hint: str, max_examples: int) -> None:
    __tracebackhide__ = True
    probe = _probe(cls, task)
    timed_out = []

    def prop(case):
        if timed_out:   # an endless loop: fail every further example at once (else shrinking would hang too)
            assert False, timed_out[0]
        ref = reference_run(case)
        with _time_limit(TIME_LIMIT_S):
            res = run_case(probe, case, max_steps=3 * len(ref.trace) + 20)
        if isinstance(res.error, _Timeout):
            timed_out.append(f"the scheduler did not return within {TIME_LIMIT_S} s at step {res.error_step} "
                             f"({res.error_state}): an endless loop?")
        _judge(task, case, res)

    for ex in examples:
        prop = example(case=ex)(prop)
    prop = given(case=strategy)(prop)
    run_property(prop, max_examples=max_examples, hint=hint)


def check_lab04_1(scheduler_cls):
    """_schedule_running(self, out, budget): token budget, chunked prefill, preempt the newest when short."""
    __tracebackhide__ = True
    _check(1, scheduler_cls, st.one_of(cases(), cases(pressure=True)),
           [CHUNKING, DECODE_PLUS_CHUNK, TINY_BUDGET, PRESSURE, PRESSURE_CHUNKED],
           "for seq in self.running (oldest first) while budget > 0: n = min(seq.num_uncomputed, budget); while "
           "bm.num_blocks_needed(seq.seq_id, seq.num_computed_tokens + n) > bm.num_free_blocks: preempt "
           "self.running[-1] (add it to out.preempted; return if it was seq); then out.block_copies += "
           "bm.append_slots(...), out.scheduled.append((seq, n)), budget -= n.", max_examples=25)


def check_lab04_2(scheduler_cls):
    """_admit_waiting(self, out, budget): FCFS admission by budget, max_num_seqs and free blocks."""
    __tracebackhide__ = True
    _check(2, scheduler_cls, st.one_of(cases(), cases(pressure=True)),
           [CHUNKING, ONE_AT_A_TIME, HEAD_BLOCKS, SHARED_PREFIX, DECODE_PLUS_CHUNK],
           "while waiting and budget > 0 and len(running) < max_num_seqs: seq = waiting[0]; cached = "
           "bm.peek_prefix(seq.token_ids); n = min(seq.num_tokens - cached, budget); stop if bm.blocks_to_admit("
           "seq.token_ids, cached + n) > bm.num_free_blocks; else popleft, seq.num_computed_tokens = "
           "bm.allocate_prompt(...), append_slots(seq.seq_id, seq.num_computed_tokens + n), status RUNNING, "
           "running.append, schedule (seq, n), budget -= n.", max_examples=25)


def check_lab04_3(scheduler_cls):
    """preempt(self, seq): recompute-style preemption."""
    __tracebackhide__ = True
    _check(3, scheduler_cls, cases(pressure=True), [PRESSURE, PRESSURE_CHUNKED],
           "remove seq from self.running, self.block_manager.free(seq.seq_id), status = SequenceStatus.WAITING, "
           "num_computed_tokens = 0, metrics.num_preemptions += 1, self.waiting.appendleft(seq).", max_examples=15)
