"""Plain-torch reference for PagedAttention decode (the test oracle).

Same signature as :func:`minillm.kernels.triton_paged_attention.paged_attention_decode_triton`.
It is deliberately slow and simple: one sequence at a time, gather that sequence's
K/V rows through its block table, expand KV heads for GQA, softmax in fp32.
An int8 pool (kv/int8.py) comes with k_scale / v_scale [num_blocks, block_size, KVH]:
each gathered row is dequantized as q * scale before the float math.
"""

from __future__ import annotations

import torch


def gather_kv(cache: torch.Tensor, block_table, seq_len: int) -> torch.Tensor:
    """K (or V) of positions 0 .. seq_len-1 of one sequence, read through its block table from a paged cache
    [num_blocks, block_size, KVH, D] (any strides) -> [seq_len, KVH, D] (a scale cache [num_blocks, block_size,
    KVH] -> [seq_len, KVH] likewise)."""
    block_size = cache.shape[1]
    blocks = torch.as_tensor(block_table)[: (int(seq_len) + block_size - 1) // block_size].long()
    return cache[blocks].flatten(0, 1)[: int(seq_len)]


def paged_attention_decode_ref(
    q: torch.Tensor,  # [S, H, D], one query token per sequence
    k_cache: torch.Tensor,  # [num_blocks, block_size, KVH, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, KVH, D]
    block_tables: torch.Tensor,  # int [S, max_blocks_per_seq]
    seq_lens: torch.Tensor,  # int [S], KV tokens per sequence (incl. the current one)
    scale: float,
    k_scale: torch.Tensor | None = None,  # int8 pool: [num_blocks, block_size, KVH] per-row scales
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    S, H, D = q.shape
    KVH = k_cache.shape[2]
    group = H // KVH
    out = torch.zeros_like(q)
    for s in range(S):
        n = int(seq_lens[s])
        if n == 0:
            continue
        k = gather_kv(k_cache, block_tables[s], n).float()  # [n, KVH, D]
        v = gather_kv(v_cache, block_tables[s], n).float()
        if k_scale is not None:
            k = k * gather_kv(k_scale, block_tables[s], n).float()[..., None]
            v = v * gather_kv(v_scale, block_tables[s], n).float()[..., None]
        k = k.repeat_interleave(group, dim=1)  # [n, H, D]: head h uses kv head h // group
        v = v.repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,nhd->hn", q[s].float(), k) * scale  # [H, n]
        probs = torch.softmax(scores, dim=-1)
        out[s] = torch.einsum("hn,nhd->hd", probs, v).to(q.dtype)
    return out
