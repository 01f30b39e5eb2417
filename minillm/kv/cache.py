"""The KV pool: one K and one V tensor per layer, holding num_blocks blocks of block_size token slots.

Logical view (what kernels and the block manager talk about): [num_blocks, block_size, kv_heads, head_dim].
Physical layout: [kv_heads, num_blocks * block_size, head_dim] per layer, head-major, so gathering one
sequence's slots yields [kv_heads, L, head_dim] — exactly the operand a batched matmul wants, with no second
copy to permute it (on CPU the gather is the cost of decode attention).

A contiguous per-sequence cache is the special case block_size = max_model_len with one block per sequence,
so the same attention code reads both (see kv/contiguous.py).

An int8 pool (dtype=torch.int8, kv_cache_dtype="int8") keeps K and V in the same layout as int8 and beside them one
float16 scale per (layer, kv head, slot): k_scale / v_scale [layers, kv_heads, num_slots] (kv/int8.py). Writers go
through write(), readers either dequantize a gather (gather()) or read q and scale in place (the kernels)."""
from __future__ import annotations

import math
import mmap

import torch

from minillm.config import KV_CACHE_DTYPES, ModelConfig
from minillm.kv.int8 import SCALE_BYTES, SCALE_DTYPE, dequantize_rows, quantize_rows


def zeros_lazily(shape: tuple[int, ...], dtype: torch.dtype, device: str | torch.device) -> torch.Tensor:
    """Zeros whose pages are committed only when first written, on CPU: a pool sized for a large budget costs
    nothing until it holds KV (torch.zeros would write every byte up front). An anonymous mmap gives pages the OS
    zero-fills on first touch. Not numpy's calloc (what this was until 2026-11-28): numpy advises huge pages for
    large arrays, and a KV block touches one 4 KiB page per (layer, head) scattered over the pool, so each first
    touch went through the kernel's huge-page path: writing 40 sequences x 400 tokens of SmolLM2's float32 KV into a
    fresh pool took 4.4 s that way and 0.9-1.1 s from a plain mmap (tools/measure_kv_touch.py), and `bench
    throughput` spent ~5 % of its time in those first writes."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    try:
        buf = mmap.mmap(-1, nbytes)
    except (OSError, OverflowError) as e:      # past the address space or the overcommit limit
        raise MemoryError(f"cannot map {nbytes} bytes: {e}") from None
    return torch.frombuffer(buf, dtype=torch.uint8).view(dtype).view(shape)


def pool_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The dtype a pool stores for an engine setting: "auto" -> the model's, "int8" -> torch.int8."""
    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype == "int8":
        return torch.int8
    raise ValueError(f"unknown kv_cache_dtype {kv_cache_dtype!r}: use one of {', '.join(KV_CACHE_DTYPES)}")


class KVCache:
    def __init__(self, cfg: ModelConfig, num_blocks: int, block_size: int,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu", spare_blocks: int = 0) -> None:
        """`spare_blocks` more blocks sit past the num_blocks the block manager hands out (slots from
        num_blocks * block_size on): a CUDA graph's padding rows write their K/V there (worker/cuda_graphs.py)."""
        if not (dtype.is_floating_point or dtype == torch.int8):
            raise ValueError(f"a KV pool stores a float dtype or torch.int8 (with scales), got {dtype}")
        shape = (cfg.num_layers, cfg.num_kv_heads, (num_blocks + spare_blocks) * block_size, cfg.head_dim)
        self.k = zeros_lazily(shape, dtype, device)
        self.v = zeros_lazily(shape, dtype, device)
        self.k_scale: torch.Tensor | None = None
        self.v_scale: torch.Tensor | None = None
        if dtype == torch.int8:
            self.k_scale = zeros_lazily(shape[:-1], SCALE_DTYPE, device)
            self.v_scale = zeros_lazily(shape[:-1], SCALE_DTYPE, device)
        self.num_blocks, self.block_size, self.spare_blocks = num_blocks, block_size, spare_blocks
        self.num_kv_heads, self.head_dim = cfg.num_kv_heads, cfg.head_dim

    @property
    def quantized(self) -> bool:
        """True for an int8 pool: its slots hold int8 rows that read as q * scale (see write / gather)."""
        return self.k_scale is not None

    @staticmethod
    def bytes_per_token(cfg: ModelConfig, dtype: torch.dtype) -> int:
        """Pool bytes one token takes in every layer (K and V, and for int8 their fp16 scales)."""
        if dtype == torch.int8:
            return 2 * cfg.num_layers * cfg.num_kv_heads * (cfg.head_dim + SCALE_BYTES)
        return cfg.kv_bytes_per_token(torch.finfo(dtype).bits // 8)

    @staticmethod
    def bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
        return KVCache.bytes_per_token(cfg, dtype) * block_size

    @property
    def nbytes(self) -> int:
        scales = self.k_scale.nbytes + self.v_scale.nbytes if self.quantized else 0
        return self.k.nbytes + self.v.nbytes + scales

    def layer_slots(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer i's K and V as [kv_heads, num_slots, head_dim] (the physical layout; int8 in an int8 pool)."""
        return self.k[i], self.v[i]

    def layer_scales(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """An int8 pool's layer i K and V scales as [kv_heads, num_slots] (float16)."""
        return self.k_scale[i], self.v_scale[i]

    def layer_scale_views(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """layer_scales(i) as strided views [num_blocks, block_size, kv_heads], to go with layer(i)."""
        shape = (self.num_kv_heads, self.num_blocks + self.spare_blocks, self.block_size)
        return self.k_scale[i].view(shape).permute(1, 2, 0), self.v_scale[i].view(shape).permute(1, 2, 0)

    def write(self, i: int, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Store layer i's new K and V rows ([T, kv_heads, head_dim]) at slot_mapping ([T]); quantized here for an
        int8 pool (the float path's backends write in place themselves: TorchAttentionBackend.write_kv)."""
        k_slots, v_slots = self.layer_slots(i)
        if not self.quantized:
            k_slots.index_copy_(1, slot_mapping, k.transpose(0, 1).to(k_slots.dtype))
            v_slots.index_copy_(1, slot_mapping, v.transpose(0, 1).to(v_slots.dtype))
            return
        k_scale, v_scale = self.layer_scales(i)
        for x, slots, scales in ((k, k_slots, k_scale), (v, v_slots, v_scale)):
            q, s = quantize_rows(x)
            slots.index_copy_(1, slot_mapping, q.transpose(0, 1))
            scales.index_copy_(1, slot_mapping, s.transpose(0, 1))

    def gather(self, i: int, slots: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer i's K and V at `slots` ([n]) as [kv_heads, n, head_dim] in `dtype` (dequantized for int8)."""
        k_slots, v_slots = self.layer_slots(i)
        k, v = torch.index_select(k_slots, 1, slots), torch.index_select(v_slots, 1, slots)
        if not self.quantized:
            return k.to(dtype), v.to(dtype)
        k_scale, v_scale = self.layer_scales(i)
        return (dequantize_rows(k, torch.index_select(k_scale, 1, slots), dtype),
                dequantize_rows(v, torch.index_select(v_scale, 1, slots), dtype))

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer i's K and V as strided views [num_blocks, block_size, kv_heads, head_dim]."""
        shape = (self.num_kv_heads, self.num_blocks + self.spare_blocks, self.block_size, self.head_dim)
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
        if self.quantized:       # a row without its scale would read as garbage
            self.k_scale[:, :, dst] = self.k_scale[:, :, src]
            self.v_scale[:, :, dst] = self.v_scale[:, :, src]
