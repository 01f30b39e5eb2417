"""Iteration-level scheduling: every step decides which sequences run and how many tokens each computes.

Policy (FCFS, like vLLM's default):
1. Running sequences first, oldest first: a decode needs 1 token, an unfinished prompt gets the next chunk.
   If the pool cannot hold the new tokens, preempt the newest running sequence (free its blocks; it will
   recompute later) until it can.
2. Then admit waiting sequences in arrival order while the token budget, max_num_seqs and free blocks allow.
   Prompts longer than the remaining budget are split (chunked prefill), so long prompts never stall the
   decodes of everyone else. A waiting sequence that does not fit blocks the ones behind it (no overtaking).
Nothing is admitted in a step that had to preempt: the pool is under pressure.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from minillm.config import SchedulerConfig
from minillm.engine.sequence import Sequence, SequenceStatus
from minillm.kv.block_manager import BlockManager


@dataclass
class SchedulerOutput:
    scheduled: list[tuple[Sequence, int]] = field(default_factory=list)   # (sequence, num_new_tokens)
    block_copies: list[tuple[int, int]] = field(default_factory=list)     # copy-on-write (src, dst) blocks
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager) -> None:
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

    def preempt(self, seq: Sequence) -> None:
        """Recompute-style preemption: free all blocks; the sequence re-enters at the head of the queue."""
        self.running.remove(seq)
        self.block_manager.free(seq.seq_id)
        seq.status = SequenceStatus.WAITING
        seq.num_computed_tokens = 0
        seq.metrics.num_preemptions += 1
        self.waiting.appendleft(seq)

    # ------------------------------------------------------------------ the policy
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        self._schedule_running(out, budget)
        budget -= out.num_batched_tokens
        if not out.preempted:
            self._admit_waiting(out, budget)
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> None:
        bm = self.block_manager
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_uncomputed, budget)
            if not self.config.enable_chunked_prefill and n < seq.num_uncomputed:
                i += 1
                continue
            while bm.num_blocks_needed(seq.seq_id, seq.num_computed_tokens + n) > bm.num_free_blocks:
                victim = self.running[-1]          # newest first: it has the least work to lose
                self.preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    return
            out.block_copies += bm.append_slots(seq.seq_id, seq.num_computed_tokens + n)
            out.scheduled.append((seq, n))
            budget -= n
            i += 1

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> None:
        bm = self.block_manager
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            cached = bm.peek_prefix(seq.token_ids)
            n = min(seq.num_tokens - cached, budget)
            if not self.config.enable_chunked_prefill and n < seq.num_tokens - cached:
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
