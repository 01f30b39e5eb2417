"""The KV pool: one K and one V tensor per layer, holding num_blocks blocks of block_size token slots.

Logical view (what kernels and the block manager talk about): [num_blocks, block_size, kv_heads, head_dim].
Physical layout: [kv_heads, num_blocks * block_size, head_dim] per layer, head-major, so gathering one
sequence's slots yields [kv_heads, L, head_dim] — exactly the operand a batched matmul wants, with no second
copy to permute it (on CPU the gather is the cost of decode attention).

A contiguous per-sequence cache is the special case block_size = max_model_len with one block per sequence,
so the same attention code reads both (see kv/contiguous.py)."""
from __future__ import annotations

import math

import torch

from minillm.config import ModelConfig


def zeros_lazily(shape: tuple[int, ...], dtype: torch.dtype, device: str | torch.device) -> torch.Tensor:
    """Zeros whose pages are committed only when first written, on CPU: a pool sized for a large budget costs
    nothing until it holds KV (torch.zeros would write every byte up front). calloc, through numpy, gives
    pages the OS zero-fills on first touch."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    import numpy as np
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    return torch.from_numpy(np.zeros(nbytes, dtype=np.uint8)).view(dtype).view(shape)


class KVCache:
    def __init__(self, cfg: ModelConfig, num_blocks: int, block_size: int,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> None:
        shape = (cfg.num_layers, cfg.num_kv_heads, num_blocks * block_size, cfg.head_dim)
        self.k = zeros_lazily(shape, dtype, device)
        self.v = zeros_lazily(shape, dtype, device)
        self.num_blocks, self.block_size = num_blocks, block_size
        self.num_kv_heads, self.head_dim = cfg.num_kv_heads, cfg.head_dim

    @staticmethod
    def bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
        return cfg.kv_bytes_per_token(torch.finfo(dtype).bits // 8) * block_size

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def layer_slots(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer i's K and V as [kv_heads, num_slots, head_dim] (the physical layout)."""
        return self.k[i], self.v[i]

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer i's K and V as strided views [num_blocks, block_size, kv_heads, head_dim]."""
        shape = (self.num_kv_heads, self.num_blocks, self.block_size, self.head_dim)
        return self.k[i].view(shape).permute(1, 2, 0, 3), self.v[i].view(shape).permute(1, 2, 0, 3)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write: duplicate whole blocks (src -> dst) in every layer."""
        if not pairs:
            return
        bs = self.block_size
        src = torch.cat([torch.arange(s * bs, (s + 1) * bs) for s, _ in pairs]).to(self.k.device)
        dst = torch.cat([torch.arange(d * bs, (d + 1) * bs) for _, d in pairs]).to(self.k.device)
        self.k[:, :, dst] = self.k[:, :, src]
        self.v[:, :, dst] = self.v[:, :, src]
