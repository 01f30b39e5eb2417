"""Turns a SchedulerOutput into one forward pass: flat input_ids, positions, slot_mapping, block_tables.

Everything it needs about KV placement comes in the SchedulerOutput (the scheduler asked the block manager);
the runner only copies blocks, builds tensors and runs the model. The step's inputs travel as one StepInputs: in a
tensor- or pipeline-parallel engine rank 0 broadcasts it (one message per step) and every rank runs `forward` on it
with its own shard of the model and of the KV pool."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from minillm.engine.scheduler import SchedulerOutput
from minillm.engine.sequence import Sequence
from minillm.kv.cache import KVCache
from minillm.layers.attention import AttentionMetadata
from minillm.models.llama import ForwardContext, LlamaModel
from minillm.parallel.comm import Communicator


@dataclass
class StepInputs:
    """What every rank needs to run one step: the flat batch, its KV placement and which rows get logits."""
    input_ids: torch.Tensor        # [T] int64
    positions: torch.Tensor        # [T] int64
    query_lens: list[int]
    seq_lens: list[int]
    slot_mapping: torch.Tensor     # [T] int64
    block_tables: list[list[int]]
    block_copies: list[tuple[int, int]]
    sample_rows: list[int]         # rows of the batch whose logits are wanted, in order

    def metadata(self, block_size: int, seqs: slice = slice(None)) -> AttentionMetadata:
        tables = self.block_tables[seqs]
        width = max(len(t) for t in tables)
        qs = self.query_lens[seqs]
        start = sum(self.query_lens[:seqs.start or 0])
        return AttentionMetadata(
            query_lens=qs, seq_lens=self.seq_lens[seqs],
            slot_mapping=self.slot_mapping[start:start + sum(qs)],
            block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int64),
            block_size=block_size)

    def pack(self) -> torch.Tensor:
        """One int64 tensor: [T, S, copies, rows, ids, positions, slots, qlens, slens, table lengths, tables,
        copies, rows]."""
        T, S = len(self.input_ids), len(self.query_lens)
        head = torch.tensor([T, S, len(self.block_copies), len(self.sample_rows)], dtype=torch.int64)
        flat_tables = [b for t in self.block_tables for b in t]
        rest = torch.tensor(self.query_lens + self.seq_lens + [len(t) for t in self.block_tables] + flat_tables
                            + [x for pair in self.block_copies for x in pair] + self.sample_rows, dtype=torch.int64)
        return torch.cat([head, self.input_ids, self.positions, self.slot_mapping, rest])

    @staticmethod
    def unpack(buf: torch.Tensor) -> "StepInputs":
        T, S, C, R = (int(x) for x in buf[:4])
        at = 4
        ids, pos, slots = buf[at:at + T], buf[at + T:at + 2 * T], buf[at + 2 * T:at + 3 * T]
        at += 3 * T
        rest = buf[at:].tolist()
        qlens, slens, tlens = rest[:S], rest[S:2 * S], rest[2 * S:3 * S]
        at = 3 * S
        tables = []
        for n in tlens:
            tables.append(rest[at:at + n])
            at += n
        copies = [(rest[at + 2 * i], rest[at + 2 * i + 1]) for i in range(C)]
        at += 2 * C
        return StepInputs(ids.clone(), pos.clone(), qlens, slens, slots.clone(), tables, copies, rest[at:at + R])


class ModelRunner:
    """Runs steps on one rank. `comm` spans the ranks of a parallel engine: with `pipeline` set they are pipeline
    stages (this rank's model holds its stage's layers); otherwise they are tensor-parallel ranks (the model was
    built with the same communicator). `driver` is rank 0's link to the other ranks (parallel/workers.py)."""

    def __init__(self, model: LlamaModel, kv_cache: KVCache, backend, comm: Communicator | None = None,
                 pipeline: bool = False, micro_batches: int = 1, driver=None) -> None:
        self.model, self.kv_cache, self.backend = model, kv_cache, backend
        self.comm = comm or Communicator()
        self.pipeline, self.micro_batches, self.driver = pipeline, max(1, micro_batches), driver

    def prepare(self, out: SchedulerOutput) -> tuple[StepInputs, list[list[int]], list[Sequence]]:
        """The step's inputs, and for every sequence that gets logits, its rows of them: one row (the last
        position) for a sequence whose chunk reaches its end, k + 1 rows for one whose k speculative guesses are
        verified (the positions from its last real token on)."""
        ids, pos, qlens, slens, sample_rows, sample_seqs = [], [], [], [], [], []
        for seq, n in out.scheduled:
            start = seq.num_computed_tokens
            ids += seq.all_token_ids[start:start + n]
            pos += range(start, start + n)
            qlens.append(n)
            slens.append(start + n)
            last_real = seq.num_tokens - 1
            if start + n > last_real:     # this chunk reaches the last real token: those rows yield tokens
                first = len(ids) - n + max(0, last_real - start)
                sample_rows.append(list(range(first, len(ids))))
                sample_seqs.append(seq)
        inputs = StepInputs(torch.tensor(ids, dtype=torch.long), torch.tensor(pos, dtype=torch.long), qlens, slens,
                            torch.tensor(out.slot_mapping, dtype=torch.int64), [list(t) for t in out.block_tables],
                            list(out.block_copies), [r for rs in sample_rows for r in rs])
        return inputs, sample_rows, sample_seqs

    def execute(self, out: SchedulerOutput) -> tuple[list[Sequence], list[list[int]], torch.Tensor]:
        """Run the batch; return the sequences that get tokens this step, each one's rows of the logits, and the
        logits [rows, V] (fp32)."""
        inputs, rows, seqs = self.prepare(out)
        if self.driver is not None:
            self.driver.send_step(inputs)       # the other ranks start the same step
        try:
            logits = self.forward(inputs)
        except BaseException as e:
            # the other ranks are somewhere inside this step and can never line up with the next one: stop them all
            if self.driver is not None:
                raise self.driver.failure(e) from e
            raise
        offsets, local = 0, []
        for rs in rows:
            local.append(list(range(offsets, offsets + len(rs))))
            offsets += len(rs)
        return seqs, local, logits

    def forward(self, inputs: StepInputs) -> torch.Tensor | None:
        """Run one step on this rank; the logits of inputs.sample_rows on rank 0 (None on the others)."""
        self.kv_cache.copy_blocks(inputs.block_copies)
        if self.pipeline and self.comm.world_size > 1:
            return self._pipeline_forward(inputs)
        meta = inputs.metadata(self.kv_cache.block_size)
        hidden = self.model(inputs.input_ids, inputs.positions, ForwardContext(meta, self.kv_cache, self.backend))
        if not inputs.sample_rows:
            return hidden.new_empty((0, self.model.cfg.vocab_size), dtype=torch.float32)
        return self.model.compute_logits(hidden[inputs.sample_rows])

    def _pipeline_forward(self, inputs: StepInputs) -> torch.Tensor | None:
        """GPipe-style within one step: the batch is cut into micro-batches (whole sequences); stage s runs
        micro-batch m while stage s+1 runs m-1. Activations go stage to stage, the last stage's logits to rank 0."""
        comm, stage, last = self.comm, self.comm.rank, self.comm.world_size - 1
        H, V = self.model.cfg.hidden_size, self.model.cfg.vocab_size
        pending, counts = [], []
        for seqs, t0, t1, rows in micro_batches(inputs, self.micro_batches):
            meta = inputs.metadata(self.kv_cache.block_size, seqs)
            ctx = ForwardContext(meta, self.kv_cache, self.backend)
            hidden = None
            if stage > 0:
                hidden = comm.recv(torch.empty(t1 - t0, H, dtype=self.model.dtype), stage - 1)
            x = self.model(inputs.input_ids[t0:t1], inputs.positions[t0:t1], ctx, hidden)
            if stage < last:
                x = x.contiguous()
                pending.append((comm.send(x, stage + 1), x))   # x stays referenced until the send is done
            elif rows:
                lg = self.model.compute_logits(x[[r - t0 for r in rows]]).contiguous()
                pending.append((comm.send(lg, 0), lg))
            counts.append(len(rows))
        for work, _ in pending:
            work.wait()
        if stage != 0:
            return None
        out = [comm.recv(torch.empty(n, V, dtype=torch.float32), last) for n in counts if n]
        return torch.cat(out) if out else torch.empty(0, V)


def micro_batches(inputs: StepInputs, n: int):
    """Split a step into up to `n` groups of whole sequences with about equal token counts: (sequence slice, first
    token, end token, sample rows inside)."""
    T, S = len(inputs.input_ids), len(inputs.query_lens)
    n = max(1, min(n, S))
    bounds, start, acc = [], 0, 0
    for i, q in enumerate(inputs.query_lens):
        acc += q
        if len(bounds) < n - 1 and acc >= T * (len(bounds) + 1) / n and i + 1 < S:
            bounds.append(i + 1)
    edges = [0] + bounds + [S]
    tok = [0]
    for q in inputs.query_lens:
        tok.append(tok[-1] + q)
    for a, b in zip(edges, edges[1:]):
        t0, t1 = tok[a], tok[b]
        yield slice(a, b), t0, t1, [r for r in inputs.sample_rows if t0 <= r < t1]
