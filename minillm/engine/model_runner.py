"""Turns a SchedulerOutput into one forward pass: flat input_ids, positions, slot_mapping, block_tables."""
from __future__ import annotations

import torch

from minillm.engine.sequence import Sequence
from minillm.kv.block_manager import BlockManager
from minillm.kv.cache import KVCache
from minillm.layers.attention import AttentionMetadata
from minillm.models.llama import ForwardContext, LlamaModel


class ModelRunner:
    def __init__(self, model: LlamaModel, kv_cache: KVCache, block_manager: BlockManager, backend) -> None:
        self.model, self.kv_cache, self.block_manager, self.backend = model, kv_cache, block_manager, backend

    def prepare(self, scheduled: list[tuple[Sequence, int]]):
        bm = self.block_manager
        ids, pos, slots, tables, qlens, slens, sample_rows, sample_seqs = [], [], [], [], [], [], [], []
        for seq, n in scheduled:
            start = seq.num_computed_tokens
            ids += seq.token_ids[start:start + n]
            pos += range(start, start + n)
            slots += bm.slot_mapping(seq.seq_id, start, start + n)
            tables.append(bm.block_table(seq.seq_id))
            qlens.append(n)
            slens.append(start + n)
            if start + n == seq.num_tokens:   # this chunk reaches the end: its last row yields the next token
                sample_rows.append(len(ids) - 1)
                sample_seqs.append(seq)
        width = max(len(t) for t in tables)
        meta = AttentionMetadata(
            query_lens=qlens, seq_lens=slens, slot_mapping=torch.tensor(slots, dtype=torch.int64),
            block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int64),
            block_size=self.kv_cache.block_size)
        return torch.tensor(ids, dtype=torch.long), torch.tensor(pos, dtype=torch.long), meta, sample_rows, sample_seqs

    def execute(self, scheduled: list[tuple[Sequence, int]],
                block_copies: list[tuple[int, int]] = ()) -> tuple[list[Sequence], torch.Tensor]:
        """Run the batch; return the sequences that sample this step and their logits [len, V] (fp32)."""
        self.kv_cache.copy_blocks(list(block_copies))
        input_ids, positions, meta, rows, seqs = self.prepare(scheduled)
        hidden = self.model(input_ids, positions, ForwardContext(meta, self.kv_cache, self.backend))
        if not rows:
            return [], hidden.new_empty((0, self.model.cfg.vocab_size), dtype=torch.float32)
        return seqs, self.model.compute_logits(hidden[rows])
