"""Turns a SchedulerOutput into one forward pass: flat input_ids, positions, slot_mapping, block_tables.

Everything it needs about KV placement comes in the SchedulerOutput (the scheduler asked the block manager);
the runner only copies blocks, builds tensors and runs the model."""
from __future__ import annotations

import torch

from minillm.engine.scheduler import SchedulerOutput
from minillm.engine.sequence import Sequence
from minillm.kv.cache import KVCache
from minillm.layers.attention import AttentionMetadata
from minillm.models.llama import ForwardContext, LlamaModel


class ModelRunner:
    def __init__(self, model: LlamaModel, kv_cache: KVCache, backend) -> None:
        self.model, self.kv_cache, self.backend = model, kv_cache, backend

    def prepare(self, out: SchedulerOutput):
        """Flat inputs for the step, and for every sequence that gets logits, its rows of them: one row (the last
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
        width = max(len(t) for t in out.block_tables)
        meta = AttentionMetadata(
            query_lens=qlens, seq_lens=slens, slot_mapping=torch.tensor(out.slot_mapping, dtype=torch.int64),
            block_tables=torch.tensor([t + [0] * (width - len(t)) for t in out.block_tables], dtype=torch.int64),
            block_size=self.kv_cache.block_size)
        return torch.tensor(ids, dtype=torch.long), torch.tensor(pos, dtype=torch.long), meta, sample_rows, sample_seqs

    def execute(self, out: SchedulerOutput) -> tuple[list[Sequence], list[list[int]], torch.Tensor]:
        """Run the batch; return the sequences that get tokens this step, each one's rows of the logits, and the
        logits [rows, V] (fp32)."""
        self.kv_cache.copy_blocks(list(out.block_copies))
        input_ids, positions, meta, rows, seqs = self.prepare(out)
        hidden = self.model(input_ids, positions, ForwardContext(meta, self.kv_cache, self.backend))
        flat = [r for rs in rows for r in rs]
        if not flat:
            return [], [], hidden.new_empty((0, self.model.cfg.vocab_size), dtype=torch.float32)
        logits = self.model.compute_logits(hidden[flat])
        offsets, local = 0, []
        for rs in rows:
            local.append(list(range(offsets, offsets + len(rs))))
            offsets += len(rs)
        return seqs, local, logits
