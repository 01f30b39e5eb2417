"""Attention over a paged KV cache, behind one interface.

The model hands each layer's q, k, v (flat over the T tokens of the batch) to a backend together with an
AttentionMetadata that says which sequence every token belongs to and where its K/V goes (slot_mapping).
Backends write K/V into the pool, then attend: prefill chunks one sequence at a time (causal, with
whatever context is already cached), decode tokens all at once.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F

from minillm.kv.cache import KVCache


@dataclass
class AttentionMetadata:
    """Per-step batch description, built once by the runner and shared by all layers.

    Sequences are ordered; tokens of sequence i are rows query_start[i]:query_start[i+1] of q.
    seq_lens[i] is the number of KV tokens sequence i has after this step (cached context + new tokens).
    """
    query_lens: list[int]
    seq_lens: list[int]
    slot_mapping: torch.Tensor          # [T] int64: flat slot (block * block_size + offset) for each new token
    block_tables: torch.Tensor          # [S, max_blocks] int64 (padded with 0)
    block_size: int
    query_start: list[int] = field(init=False)
    _decode: tuple | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        starts = [0]
        for n in self.query_lens:
            starts.append(starts[-1] + n)
        self.query_start = starts

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    def context_slots(self, i: int) -> torch.Tensor:
        """Flat slots of positions 0..seq_lens[i]-1 of sequence i."""
        pos = torch.arange(self.seq_lens[i], device=self.block_tables.device)
        return self.block_tables[i, pos // self.block_size] * self.block_size + pos % self.block_size

    def decode_view(self) -> tuple[list[int], torch.Tensor, torch.Tensor]:
        """(indices of decode sequences, their context slots [Sd, Lmax], validity mask [Sd, Lmax]); cached per step."""
        if self._decode is None:
            idx = [i for i, n in enumerate(self.query_lens) if n == 1]
            if idx:
                lens = torch.tensor([self.seq_lens[i] for i in idx], device=self.block_tables.device)
                lmax = int(lens.max())
                pos = torch.arange(lmax, device=lens.device)
                tables = self.block_tables[idx][:, : (lmax + self.block_size - 1) // self.block_size]
                slots = tables[:, pos // self.block_size] * self.block_size + pos % self.block_size
                mask = pos[None, :] < lens[:, None]
                self._decode = (idx, slots, mask)
            else:
                self._decode = (idx, None, None)
        return self._decode


AttendFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]


def causal_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Attention of the last n positions of a sequence over all L of its keys.

    q: [n, H, D]; k, v: [L, KVH, D] with L >= n (the first L-n are cached context). Returns [n, H, D].
    GQA/MQA: head h reads kv head h // (H // KVH)."""
    n, L = q.shape[0], k.shape[0]
    qh, kh, vh = q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None]
    if n == L:
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale, enable_gqa=True)
    else:
        # Query i sits at absolute position L-n+i and may see keys 0..L-n+i.
        mask = torch.arange(L, device=q.device)[None, :] <= (L - n + torch.arange(n, device=q.device))[:, None]
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1)


class TorchAttentionBackend:
    """Reference backend in plain torch: gathers K/V through the block tables.

    `attend_fn` lets a lab swap in the learner's attention (it is then used for every sequence, one at a time)."""

    name = "torch"

    def __init__(self, attend_fn: AttendFn | None = None) -> None:
        self.attend_fn = attend_fn

    @staticmethod
    def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
        kvh, d = k.shape[1], k.shape[2]
        k_cache.view(-1, kvh, d).index_copy_(0, slot_mapping, k)
        v_cache.view(-1, kvh, d).index_copy_(0, slot_mapping, v)

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: AttentionMetadata, cache: KVCache, scale: float) -> torch.Tensor:
        k_cache, v_cache = cache.layer(layer)
        self.write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        out = torch.empty_like(q)
        decode_idx: list[int] = []
        if self.attend_fn is None:
            decode_idx = meta.decode_view()[0]
            if decode_idx:
                self._decode(q, out, meta, k_cache, v_cache, scale)
        done = set(decode_idx)
        kflat, vflat = k_cache.view(-1, *k.shape[1:]), v_cache.view(-1, *v.shape[1:])
        attend = self.attend_fn or causal_attend
        for i in range(meta.num_seqs):
            if i in done:
                continue
            a, b = meta.query_start[i], meta.query_start[i + 1]
            if meta.seq_lens[i] == b - a:  # nothing cached before this chunk: use the fresh K/V directly
                ki, vi = k[a:b], v[a:b]
            else:
                slots = meta.context_slots(i)
                ki, vi = kflat[slots], vflat[slots]
            out[a:b] = attend(q[a:b], ki, vi, scale)
        return out

    def _decode(self, q, out, meta, k_cache, v_cache, scale) -> None:
        idx, slots, mask = meta.decode_view()
        rows = torch.tensor([meta.query_start[i] for i in idx], device=q.device)
        kvh, d = k_cache.shape[-2], k_cache.shape[-1]
        keys = k_cache.view(-1, kvh, d)[slots].transpose(1, 2)      # [Sd, KVH, L, D]
        vals = v_cache.view(-1, kvh, d)[slots].transpose(1, 2)
        qd = q[rows][:, :, None, :]                                   # [Sd, H, 1, D]
        o = F.scaled_dot_product_attention(qd, keys, vals, attn_mask=mask[:, None, None, :],
                                           scale=scale, enable_gqa=True)
        out[rows] = o[:, :, 0, :]


class TritonAttentionBackend(TorchAttentionBackend):
    """Decode through the Triton PagedAttention kernel; prefill chunks through the torch path."""

    name = "triton"

    def _decode(self, q, out, meta, k_cache, v_cache, scale) -> None:
        from minillm.kernels.triton_paged_attention import paged_attention_decode_triton
        idx = meta.decode_view()[0]
        rows = torch.tensor([meta.query_start[i] for i in idx], device=q.device)
        tables = meta.block_tables[idx].to(torch.int32).contiguous()
        lens = torch.tensor([meta.seq_lens[i] for i in idx], dtype=torch.int32, device=q.device)
        out[rows] = paged_attention_decode_triton(q[rows].contiguous(), k_cache, v_cache, tables, lens, scale)


def get_attention_backend(name: str = "auto", device: str | torch.device = "cpu"):
    """'auto' = the Triton kernel on CUDA, the torch reference on CPU (the interpreter is far too slow to serve)."""
    if name == "auto":
        name = "triton" if torch.device(device).type == "cuda" else "torch"
    if name == "torch":
        return TorchAttentionBackend()
    if name == "triton":
        return TritonAttentionBackend()
    raise ValueError(f"unknown attention backend {name!r}: use 'torch', 'triton' or 'auto'")
