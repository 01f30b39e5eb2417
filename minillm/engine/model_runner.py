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
        ids, pos, qlens, slens, sample_rows, sample_seqs = [], [], [], [], [], []
        for seq, n in out.scheduled:
            start = seq.num_computed_tokens
            ids += seq.token_ids[start:start + n]
            pos += range(start, start + n)
            qlens.append(n)
            slens.append(start + n)
            if start + n == seq.num_tokens:   # this chunk reaches the end: its last row yields the next token
                sample_rows.append(len(ids) - 1)
                sample_seqs.append(seq)
        width = max(len(t) for t in out.block_tables)
        meta = AttentionMetadata(
            query_lens=qlens, seq_lens=slens, slot_mapping=torch.tensor(out.slot_mapping, dtype=torch.int64),
            block_tables=torch.tensor([t + [0] * (width - len(t)) for t in out.block_tables], dtype=torch.int64),
            block_size=self.kv_cache.block_size)
        return torch.tensor(ids, dtype=torch.long), torch.tensor(pos, dtype=torch.long), meta, sample_rows, sample_seqs

    def execute(self, out: SchedulerOutput) -> tuple[list[Sequence], torch.Tensor]:
        """Run the batch; return the sequences that sample this step and their logits [len, V] (fp32)."""
        self.kv_cache.copy_blocks(list(out.block_copies))
        input_ids, positions, meta, rows, seqs = self.prepare(out)
        hidden = self.model(input_ids, positions, ForwardContext(meta, self.kv_cache, self.backend))
        if not rows:
            return [], hidden.new_empty((0, self.model.cfg.vocab_size), dtype=torch.float32)
        return seqs, self.model.compute_logits(hidden[rows])
