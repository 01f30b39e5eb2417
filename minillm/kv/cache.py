"""The KV pool: one K and one V tensor per layer, laid out as [num_blocks, block_size, kv_heads, head_dim].

A contiguous per-sequence cache is the special case block_size = max_model_len with one block per sequence,
so the same attention code reads both (see kv/contiguous.py)."""
from __future__ import annotations

import torch

from minillm.config import ModelConfig


class KVCache:
    def __init__(self, cfg: ModelConfig, num_blocks: int, block_size: int,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> None:
        shape = (cfg.num_layers, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.num_blocks, self.block_size = num_blocks, block_size

    @staticmethod
    def bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
        return cfg.kv_bytes_per_token(torch.finfo(dtype).bits // 8) * block_size

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[i], self.v[i]

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write: duplicate whole blocks (src -> dst) in every layer."""
        if not pairs:
            return
        src = torch.tensor([s for s, _ in pairs], device=self.k.device)
        dst = torch.tensor([d for _, d in pairs], device=self.k.device)
        self.k[:, dst] = self.k[:, src]
        self.v[:, dst] = self.v[:, src]
