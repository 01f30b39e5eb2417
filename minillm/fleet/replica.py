"""One simulated replica: the engine's own Scheduler and BlockManager on a simulated clock, with no model.

Each step does what LLMEngine.step does, minus the forward pass: schedule() (token budget, chunked prefill,
max_num_seqs, block-granular KV allocation, preemption by recompute and prefix-cache hits all come from the real
code), the step model says how long the pass would take, and when it ends every sequence whose chunk reached its
last token gets one token, the scheduler commits the step, and sequences at their output length are finished
(their blocks freed). So a change to the scheduling policy reaches the simulator without touching it.

The step is split in two (begin_step / end_step) because the fleet simulator interleaves replicas on one event
queue: requests that arrive while a pass runs wait for the next schedule(), as they would in the engine.

Fleet features that reach into a replica:
* disaggregated decode (`add_prefilled`): a request whose prompt KV arrived from a prefill replica is admitted with
  its prompt already computed, the way vLLM's KV connector reports externally computed tokens: blocks for the whole
  context are allocated (local prefix-cache hits reused), written and committed, and the sequence joins the running
  list with num_computed_tokens = prompt length, so its next step is a decode. It waits (in arrival order, ahead of
  nothing the scheduler owns) while the pool or max_num_seqs has no room. A decode replica preempted under memory
  pressure still recomputes by the engine's policy: that shows up as its prefill_tokens, not hidden;
* failures (`fail`): everything in flight comes back with what it had computed (the lost work);
* a host KV tier (offload.py): evicted prefix blocks go to host memory; loads back are charged to the next step.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from itertools import islice

from minillm.config import SchedulerConfig
from minillm.engine.scheduler import Scheduler, SchedulerOutput
from minillm.engine.sequence import Sequence, SequenceStatus
from minillm.fleet.offload import HostTier, OffloadingBlockManager, swap_in
from minillm.fleet.step_model import StepFeatures, StepModel
from minillm.fleet.workloads import SimRequest
from minillm.kv.block_manager import BlockManager
from minillm.sampling.params import SamplingParams

# One params object for every simulated sequence: the scheduler never reads it, and the output length lives in the
# replica (a request finishes at its drawn length, as with ignore_eos and max_tokens in the engine).
_PARAMS = SamplingParams(max_tokens=1 << 30, ignore_eos=True)


@dataclass(frozen=True)
class ReplicaConfig:
    num_blocks: int
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    max_model_len: int | None = None      # None: the whole pool (the engine's cap when the model allows more)

    @classmethod
    def of(cls, step_model: StepModel, **overrides) -> "ReplicaConfig":
        """The settings the step model was measured with (its `replica` dict), with `overrides` on top."""
        known = {k: v for k, v in step_model.replica.items() if k in cls.__dataclass_fields__}
        settings = known | {k: v for k, v in overrides.items() if v is not None}
        if "num_blocks" not in settings:
            raise ValueError("the replica's KV pool size is unknown: the step model carries no num_blocks; pass it")
        return cls(**settings)


@dataclass(frozen=True, slots=True)
class Finished:
    """A finished (or failed) request's timeline; the simulator folds it into histograms and drops it."""
    request_id: int
    arrival: float
    first_scheduled: float
    first_token: float
    finished: float
    output_len: int
    prompt_len: int
    cached_tokens: int
    preemptions: int
    failed: bool = False


@dataclass(frozen=True, slots=True)
class InFlight:
    """A request a failed replica held: the request as that replica got it, the output tokens it had produced, and
    the KV positions it had computed (lost with the replica: the work a retry redoes)."""
    request: SimRequest
    emitted: list[int]
    computed_tokens: int
    first_scheduled: float | None
    first_token: float | None
    cached_tokens: int
    preemptions: int


class Replica:
    def __init__(self, step_model: StepModel, config: ReplicaConfig,
                 on_step: Callable[[float, SchedulerOutput], None] | None = None, host: HostTier | None = None) -> None:
        self.step_model, self.config, self.host = step_model, config, host
        if host is not None and not config.enable_prefix_caching:
            raise ValueError("a host KV tier extends the prefix cache: it needs enable_prefix_caching")
        self.block_manager = BlockManager(config.num_blocks, config.block_size, config.enable_prefix_caching) \
            if host is None else OffloadingBlockManager(config.num_blocks, config.block_size, host)
        self.scheduler = Scheduler(SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens,
                                                   config.enable_chunked_prefill), self.block_manager)
        pool = config.num_blocks * config.block_size
        self.max_model_len = min(config.max_model_len or pool, pool)
        self.on_step = on_step
        self._requests: dict[Sequence, SimRequest] = {}
        self._charge: dict[Sequence, int] = {}
        self._pending: SchedulerOutput | None = None
        self._pending_feats = StepFeatures()
        self._kv_ready: deque[Sequence] = deque()   # disaggregated decode: prompt KV here, not yet admitted
        self.busy = False                 # a pass is running (between begin_step and end_step)
        self.outstanding_tokens = 0       # prompt + output tokens not yet produced, over the requests here
        self.num_steps = 0
        self.prefill_tokens = 0           # computed here, over the run (a decode pool's should stay 0)
        self.decode_tokens = 0

    # ------------------------------------------------------------------ requests
    @property
    def num_requests(self) -> int:
        return len(self._requests)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting) + len(self._kv_ready)

    def has_work(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._kv_ready)

    def add(self, req: SimRequest) -> Finished | None:
        """Queue a request. One the engine would refuse (prompt too long for the pool or context, or for the step
        budget with chunked prefill off) comes back at once as failed, as LLMEngine.add_request raises for it."""
        c = self.config
        too_long_unchunked = not c.enable_chunked_prefill and req.prompt_len > c.max_num_batched_tokens
        if req.prompt_len >= self.max_model_len or req.prompt_len == 0 or too_long_unchunked:
            return Finished(req.request_id, req.arrival, req.arrival, req.arrival, req.arrival, 0, req.prompt_len,
                            0, 0, failed=True)
        seq = Sequence(str(req.request_id), req.prompt, _PARAMS, None, None, req.arrival)
        self._requests[seq] = req
        self._charge[seq] = req.prompt_len + req.output_len
        self.scheduler.add(seq)
        self.outstanding_tokens += req.prompt_len + req.output_len
        return None

    def add_prefilled(self, req: SimRequest, first_scheduled: float, first_token: float, cached_tokens: int = 0,
                      preemptions: int = 0) -> None:
        """Queue a request whose prompt KV and first output token were computed elsewhere (a prefill replica); it
        is admitted by `_admit_prefilled` with num_computed_tokens = its prompt length (see the module doc)."""
        if req.output_len < 2 or req.prompt_len + 1 >= self.max_model_len:
            raise ValueError(f"request {req.request_id}: a prefilled request needs output_len >= 2 and a context "
                             f"shorter than {self.max_model_len} tokens")
        seq = Sequence(str(req.request_id), req.prompt, _PARAMS, None, None, req.arrival)
        seq.token_ids.append(output_token(req, 0))
        m = seq.metrics
        m.first_scheduled_time, m.first_token_time = first_scheduled, first_token
        m.num_cached_tokens, m.num_preemptions = cached_tokens, preemptions
        self._requests[seq] = req
        self._charge[seq] = req.output_len - 1
        self.outstanding_tokens += req.output_len - 1
        self._kv_ready.append(seq)

    def _admit_prefilled(self) -> None:
        bm, sched = self.block_manager, self.scheduler
        while self._kv_ready and len(sched.running) < self.config.max_num_seqs:
            seq = self._kv_ready[0]
            n = seq.num_prompt_tokens
            if bm.blocks_to_admit(seq.token_ids, n) > bm.num_free_blocks:
                return
            self._kv_ready.popleft()
            bm.allocate_prompt(seq.seq_id, seq.token_ids)
            bm.append_slots(seq.seq_id, n)
            bm.commit_computed(seq.seq_id, seq.token_ids, n)
            seq.num_computed_tokens = n
            seq.status = SequenceStatus.RUNNING
            sched.running.append(seq)

    def fail(self) -> list[InFlight]:
        """The replica dies: every request it held, with what it had produced and computed. The replica is not
        usable afterwards (the simulator replaces it)."""
        lost = []
        for seq, req in self._requests.items():
            m = seq.metrics
            lost.append(InFlight(req, seq.token_ids[seq.num_prompt_tokens:], seq.num_computed_tokens,
                                 m.first_scheduled_time, m.first_token_time, m.num_cached_tokens,
                                 m.num_preemptions))
        self._requests.clear()
        self._charge.clear()
        self._kv_ready.clear()
        self.scheduler.waiting.clear()     # its KV pool is gone with it: nothing left to schedule
        self.scheduler.running.clear()
        self._pending, self.busy, self.outstanding_tokens = None, False, 0
        return lost

    # ------------------------------------------------------------------ one step
    def begin_step(self) -> float | None:
        """schedule() and the pass's duration in seconds (None when there is nothing to run)."""
        self._admit_prefilled()
        swap_s = 0.0
        if self.host is not None:     # host-tier hits of the sequences about to be admitted: load, charge PCIe
            room = max(0, self.config.max_num_seqs - len(self.scheduler.running))
            swap_s = swap_in(self.block_manager, list(islice(self.scheduler.waiting, room))) * \
                self.host.seconds_per_block
        sched = self.scheduler.schedule()
        if sched.is_empty:
            if self.has_work():
                raise RuntimeError("scheduler made no progress: the KV pool cannot hold the next request")
            return None
        self.num_steps += 1
        self._pending, self.busy = sched, True
        feats = StepFeatures.of((s.num_computed_tokens, n, s.num_prompt_tokens) for s, n in sched.scheduled)
        self._pending_feats = feats
        seconds = self.step_model.seconds(feats)
        if seconds < 0:
            raise self.step_model.negative_step_error(feats, seconds)
        return seconds + swap_s

    def end_step(self, now: float) -> list[Finished]:
        """The pass ended at `now`: tokens for the sequences that reached their end, commit, finish (mirrors
        LLMEngine._commit for n = 1 without speculation)."""
        sched, self._pending, self.busy = self._pending, None, False
        self.prefill_tokens += self._pending_feats.prefill_tokens     # counted once committed: a pass a failure
        self.decode_tokens += self._pending_feats.decode_tokens       # cuts short computed nothing that stays
        if self.on_step is not None:
            self.on_step(now, sched)
        appended: list[Sequence] = []
        for seq, n in sched.scheduled:
            if seq.metrics.first_scheduled_time is None:
                seq.metrics.first_scheduled_time = now
            if seq.num_computed_tokens + n >= seq.num_tokens:     # the chunk reached the last token: it samples
                appended.append(seq)
        for seq in appended:
            req, m = self._requests[seq], seq.metrics
            k = seq.num_tokens - seq.num_prompt_tokens
            seq.token_ids.append(output_token(req, k))
            if m.first_token_time is None:
                m.first_token_time = now
            if k + 1 >= req.output_len or seq.num_tokens >= self.max_model_len:
                m.finished_time = now
        self.scheduler.commit(sched)
        for seq, _ in sched.scheduled:
            self._recharge(seq)
        done = []
        for seq in appended:
            if seq.metrics.finished_time is not None:
                self.scheduler.finish(seq)
                self.outstanding_tokens -= self._charge.pop(seq)
                req, m = self._requests.pop(seq), seq.metrics
                done.append(Finished(req.request_id, req.arrival, m.first_scheduled_time, m.first_token_time,
                                     now, seq.num_tokens - seq.num_prompt_tokens, req.prompt_len,
                                     m.num_cached_tokens, m.num_preemptions))
        return done

    def _recharge(self, seq: Sequence) -> None:
        """A request's share of outstanding_tokens: prompt positions not computed + output tokens not produced
        (a preempted sequence's share grows back when it is rescheduled: its KV is recomputed)."""
        req = self._requests[seq]
        new = max(0, seq.num_prompt_tokens - seq.num_computed_tokens) + req.output_len - \
            (seq.num_tokens - seq.num_prompt_tokens)
        self.outstanding_tokens += new - self._charge[seq]
        self._charge[seq] = new


def output_token(req: SimRequest, k: int) -> int:
    """The k-th output token of a request: its given output_ids, else a dummy distinct per request, so two equal
    prompts do not share output blocks in the prefix cache by accident."""
    if req.output_ids is not None:
        return req.output_ids[k]
    return (req.request_id * 1_000_003 + k * 7919) % 1_000_000_007
