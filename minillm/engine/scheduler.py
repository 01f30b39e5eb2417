"""Iteration-level scheduling: every step decides which sequences run and how many tokens each computes.

The scheduler is the only component that talks to the block manager during a step: it reserves KV slots for what
it schedules, hands the model runner the block tables and slot mapping in its SchedulerOutput, records what the
forward pass computed (commit), forks n > 1 samples and frees finished sequences.

Policy (FCFS, like vLLM's default), in three public steps a subclass may replace (lab04):
1. schedule_running: running sequences first, oldest first: a decode needs 1 token, an unfinished prompt gets the
   next chunk. If the pool cannot hold the new tokens, preempt the newest running sequence until it can.
2. admit_waiting: admit waiting sequences in arrival order while the token budget, max_num_seqs and free blocks
   allow. Prompts longer than the remaining budget are split (chunked prefill), so long prompts never stall the
   decodes of everyone else. A waiting sequence that does not fit blocks the ones behind it (no overtaking).
   Nothing is admitted in a step that had to preempt: the pool is under pressure.
3. preempt: recompute-style preemption: free all blocks; the sequence re-enters at the head of the queue.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from minillm import interfaces
from minillm.config import SchedulerConfig
from minillm.engine.sequence import Sequence, SequenceStatus


@dataclass
class SchedulerOutput:
    scheduled: list[tuple[Sequence, int]] = field(default_factory=list)   # (sequence, num_new_tokens)
    block_copies: list[tuple[int, int]] = field(default_factory=list)     # copy-on-write (src, dst) blocks
    preempted: list[Sequence] = field(default_factory=list)
    # Filled by Scheduler.schedule() after the policy ran: what the model runner needs, per scheduled sequence.
    block_tables: list[list[int]] = field(default_factory=list)
    slot_mapping: list[int] = field(default_factory=list)                 # flat, in scheduled order

    @property
    def num_batched_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: interfaces.BlockManager) -> None:
        self.config = config
        self.block_manager = block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    # ------------------------------------------------------------------ queue management
    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.FINISHED
        if seq in self.running:
            self.running.remove(seq)
        self.block_manager.free(seq.seq_id)

    def abort(self, request_id: str) -> list[Sequence]:
        """Drop every sequence of the request, wherever it is; unknown ids are a no-op."""
        gone = [s for s in list(self.waiting) + self.running if s.request_id == request_id]
        for s in gone:
            if s in self.waiting:
                self.waiting.remove(s)
            self.finish(s)
        return gone

    # ------------------------------------------------------------------ one step
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        self.schedule_running(out, budget)
        if not out.preempted:
            self.admit_waiting(out, budget - out.num_batched_tokens)
        bm = self.block_manager
        for seq, n in out.scheduled:
            if not 0 < n <= seq.num_uncomputed:   # a policy's mistake: refuse it before any wrong math runs
                raise ValueError(f"the scheduling policy gave request {seq.request_id!r} {n} token(s) to compute, "
                                 f"but it has {seq.num_uncomputed} left ({seq.num_computed_tokens} of "
                                 f"{seq.num_tokens} computed): schedule between 1 and that many")
            out.block_tables.append(bm.block_table(seq.seq_id))
            out.slot_mapping += bm.slot_mapping(seq.seq_id, seq.num_computed_tokens, seq.num_computed_tokens + n)
        return out

    def commit(self, out: SchedulerOutput) -> None:
        """The forward pass wrote the KV of the scheduled tokens: advance the sequences and tell the block manager
        (which registers newly full blocks in the prefix cache). With speculative decoding the engine commits only
        the positions that became real tokens: the slots reserved past them are rolled back, and a block left
        holding none of the kept positions goes back to the pool."""
        bm = self.block_manager
        for seq, n in out.scheduled:
            seq.num_computed_tokens += n
            bm.commit_computed(seq.seq_id, seq.token_ids, seq.num_computed_tokens)
            if len(bm.block_table(seq.seq_id)) * bm.block_size >= seq.num_computed_tokens + bm.block_size:
                bm.trim(seq.seq_id, seq.num_computed_tokens)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """An n > 1 sample starts running beside its parent, sharing all of its blocks."""
        self.block_manager.fork(parent.seq_id, child.seq_id)
        child.status = SequenceStatus.RUNNING
        self.running.append(child)

    # ------------------------------------------------------------------ the policy
    def schedule_running(self, out: SchedulerOutput, budget: int) -> None:
        """Running sequences, oldest first, within `budget` tokens; preempt the newest when the pool is short."""
        bm = self.block_manager
        chunked = self.config.enable_chunked_prefill
        for seq in list(self.running):
            if budget <= 0 or seq not in self.running:    # out of budget, or preempted to make room
                break
            left = seq.num_uncomputed
            if left > budget and not chunked:
                continue
            n = min(left, budget)
            target = seq.num_computed_tokens + n
            while bm.num_blocks_needed(seq.seq_id, target) > bm.num_free_blocks:
                victim = self.running[-1]                   # newest first: it has the least work to lose
                self.preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    return
            out.block_copies.extend(bm.append_slots(seq.seq_id, target))
            out.scheduled.append((seq, n))
            budget -= n

    def admit_waiting(self, out: SchedulerOutput, budget: int) -> None:
        """Waiting sequences in arrival order while budget, max_num_seqs and free blocks allow (no overtaking)."""
        bm = self.block_manager
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            left = seq.num_tokens - bm.peek_prefix(seq.token_ids)
            if left > budget and not self.config.enable_chunked_prefill:
                return
            n = min(left, budget)
            if bm.blocks_to_admit(seq.token_ids, seq.num_tokens - left + n) > bm.num_free_blocks:
                return
            self.waiting.popleft()
            cached = bm.allocate_prompt(seq.seq_id, seq.token_ids)
            if seq.metrics.first_scheduled_time is None:
                seq.metrics.num_cached_tokens = cached
            seq.num_computed_tokens = cached
            out.block_copies.extend(bm.append_slots(seq.seq_id, cached + n))
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.scheduled.append((seq, n))
            budget -= n

    def preempt(self, seq: Sequence) -> None:
        """Recompute-style preemption: free all blocks; the sequence re-enters at the head of the queue."""
        self.block_manager.free(seq.seq_id)
        self.running.remove(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.metrics.num_preemptions += 1
        self.waiting.appendleft(seq)
