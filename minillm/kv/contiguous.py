"""The classic KV cache: every sequence reserves max_len slots up front, contiguous in memory.

It is a KVCache with one block of max_len tokens per sequence, so the paged attention code reads it unchanged;
the cost is the reservation: slots past a sequence's real length are allocated but never used."""
from __future__ import annotations

import torch

from minillm.config import ModelConfig
from minillm.kv.cache import KVCache
from minillm.kv.metadata import AttentionMetadata, build_metadata


class ContiguousKVCache(KVCache):
    def __init__(self, cfg: ModelConfig, max_batch: int, max_len: int,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> None:
        super().__init__(cfg, num_blocks=max_batch, block_size=max_len, dtype=dtype, device=device)
        self.max_len = max_len

    def metadata(self, rows: list[int], num_cached: list[int], query_lens: list[int]) -> AttentionMetadata:
        """Sequence in cache row rows[i] already holds num_cached[i] tokens and now adds query_lens[i]."""
        slots = []
        for row, start, n in zip(rows, num_cached, query_lens):
            if start + n > self.max_len:
                raise ValueError(f"sequence needs {start + n} KV slots but the cache reserved {self.max_len}")
            slots.extend(range(row * self.max_len + start, row * self.max_len + start + n))
        return build_metadata(query_lens, [s + n for s, n in zip(num_cached, query_lens)], slots,
                              [[r] for r in rows], self.max_len, self.k.device)
