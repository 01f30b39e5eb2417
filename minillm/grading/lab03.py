"""Checkers for lab03 — the PagedAttention kernel.

Tasks (the notebook documents the same signatures):
  lab03_1  gather_kv(cache, block_table, seq_len) -> [seq_len, KVH, D]: the K (or V) rows of positions
           0 .. seq_len-1 of one sequence, read through its block table from a paged cache
           [num_blocks, block_size, KVH, D] (possibly a strided view, like the engine's KVCache.layer(i)).
  lab03_2  online_softmax_update(m, l, acc, scores, values) -> (m, l, acc): fold one block of scores
           [G, T] and values [T, D] into the running max m [G], running sum l [G] and un-normalised
           accumulator acc [G, D]; after the last block softmax(all scores) @ all values = acc / l[:, None].
  lab03_3  paged_attention_kernel: a @triton.jit PagedAttention decode kernel with the signature of
           minillm.kernels.triton_paged_attention.paged_attention_decode_kernel, launched by
           `launch_paged_attention` (grid (S, KVH)); checked in Triton's interpreter on tiny paged caches
           (ragged lengths, shuffled block tables, GQA, unused slots poisoned with NaN) against a float64
           dense reference written here, then compiled ahead of time for an NVIDIA sm80 target.

The references here gather from the *contiguous* K/V a case was built from, never from minillm's kernels.
The Triton interpreter must be on (TRITON_INTERPRET=1 set before the kernel is decorated) to run lab03_3.
"""
from __future__ import annotations

import hashlib
import inspect
import json
import os
import subprocess
import sys
import tempfile
import textwrap
import types
from dataclasses import dataclass

import torch
from hypothesis import example, given, strategies as st

from minillm.grading.core import diagnose, fail, reject_reference, run_property

__all__ = ["check_lab03_1", "check_lab03_2", "check_lab03_3", "launch_paged_attention", "compile_kernel_for_gpu",
           "PagedCase", "make_paged_case", "gather_kv_ref", "online_softmax_ref", "dense_decode_ref", "next_pow2"]


def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


# --------------------------------------------------------------------------- a paged test case

@dataclass
class PagedCase:
    """A tiny paged KV cache and the contiguous K/V it was scattered from (the ground truth)."""
    q: torch.Tensor                  # [S, H, D]
    k_cache: torch.Tensor            # [num_blocks, block_size, KVH, D] (maybe a head-major strided view)
    v_cache: torch.Tensor
    block_tables: torch.Tensor       # int32 [S, max_blocks], padding entries point at a poisoned block
    seq_lens: torch.Tensor           # int32 [S]
    scale: float
    dense_k: list                    # per sequence [n, KVH, D]
    dense_v: list


def make_paged_case(seq_lens, H, KVH, D, block_size, seed, *, layout="engine", share_prefix=False,
                    magnitude=1.0, poison=float("nan"), dtype=torch.float32, extra_blocks=2) -> PagedCase:
    """Random per-sequence K/V scattered into a paged cache through shuffled block tables.

    layout="engine": the engine's KVCache layout (head-major storage [KVH, num_slots, D] seen through a permuted
    view [num_blocks, block_size, KVH, D]); layout="blocks": a contiguous [num_blocks, block_size, KVH, D] tensor.
    Every slot a sequence must not read (other blocks, the tail of its last block, spare blocks) holds `poison`,
    and block-table padding points at a poisoned block. share_prefix: sequences whose first block is full reuse
    sequence 0's first physical block (same contents), as after a prefix-cache hit."""
    g = torch.Generator().manual_seed(int(seed))
    S = len(seq_lens)
    bs = int(block_size)
    nblk = [-(-int(n) // bs) for n in seq_lens]
    shared = [share_prefix and s > 0 and seq_lens[0] >= bs and seq_lens[s] >= bs for s in range(S)]
    n_phys = sum(nblk) - sum(shared) + extra_blocks
    perm = torch.randperm(n_phys, generator=g).tolist()
    spare = perm.pop()                                   # never used by anyone: the padding target
    width = max(nblk) + 1
    tables = torch.full((S, width), spare, dtype=torch.int32)
    for s in range(S):
        for b in range(nblk[s]):
            tables[s, b] = tables[0, 0] if (b == 0 and shared[s]) else perm.pop()
    store_k = torch.full((KVH, n_phys * bs, D), poison, dtype=torch.float32)
    store_v = torch.full((KVH, n_phys * bs, D), poison, dtype=torch.float32)
    dense_k, dense_v = [], []
    for s, n in enumerate(seq_lens):
        k = torch.randn(n, KVH, D, generator=g) * magnitude
        v = torch.randn(n, KVH, D, generator=g)
        if shared[s]:
            k[:bs], v[:bs] = dense_k[0][:bs], dense_v[0][:bs]
        dense_k.append(k.to(dtype))
        dense_v.append(v.to(dtype))
        pos = torch.arange(n)
        slots = tables[s, pos // bs].long() * bs + pos % bs
        store_k[:, slots] = k.transpose(0, 1)
        store_v[:, slots] = v.transpose(0, 1)
    q = (torch.randn(S, H, D, generator=g) * magnitude).to(dtype)
    scale = float(0.2 + 0.6 * torch.rand((), generator=g))
    store_k, store_v = store_k.to(dtype), store_v.to(dtype)
    if layout == "engine":
        kc = store_k.view(KVH, n_phys, bs, D).permute(1, 2, 0, 3)
        vc = store_v.view(KVH, n_phys, bs, D).permute(1, 2, 0, 3)
    elif layout == "blocks":
        kc = store_k.view(KVH, n_phys, bs, D).permute(1, 2, 0, 3).contiguous()
        vc = store_v.view(KVH, n_phys, bs, D).permute(1, 2, 0, 3).contiguous()
    else:
        raise ValueError(layout)
    return PagedCase(q, kc, vc, tables, torch.tensor(seq_lens, dtype=torch.int32), scale, dense_k, dense_v)


def _describe_case(c: PagedCase) -> str:
    nb, bs, KVH, D = c.k_cache.shape
    rows = [c.block_tables[s, :-(-int(n) // bs)].tolist() for s, n in enumerate(c.seq_lens.tolist())]
    return f"seq_lens={c.seq_lens.tolist()}, block_size={bs}, block_tables={rows}"


# --------------------------------------------------------------------------- references (float64)

def gather_kv_ref(cache: torch.Tensor, block_table, seq_len: int) -> torch.Tensor:
    """Positions 0..seq_len-1 of one sequence: position p lives in block block_table[p // bs], row p % bs."""
    bs = cache.shape[1]
    table = torch.as_tensor(block_table).long()
    pos = torch.arange(int(seq_len))
    return cache[table[pos // bs], pos % bs]


def dense_decode_ref(q, dense_k, dense_v, scale, *, kv_head_of=None) -> torch.Tensor:
    """Decode attention on the contiguous K/V, float64: out[s, h] = softmax(scale q[s,h]·K_s[:, kv(h)]) @ V_s."""
    S, H, D = q.shape
    out = torch.zeros(S, H, D, dtype=torch.float64)
    for s in range(S):
        k, v = dense_k[s].double(), dense_v[s].double()
        KVH = k.shape[1]
        group = H // KVH
        heads = torch.tensor([kv_head_of(h, H, KVH) if kv_head_of else h // group for h in range(H)])
        scores = torch.einsum("hd,nhd->hn", q[s].double(), k[:, heads]) * scale
        out[s] = torch.einsum("hn,nhd->hd", torch.softmax(scores, -1), v[:, heads])
    return out


def online_softmax_ref(m, l, acc, scores, values):
    """The update the notebook asks for (float64 inside, returned in the inputs' dtype)."""
    dt = acc.dtype
    m, l, acc, s, v = (x.double() for x in (m, l, acc, scores, values))
    m_new = torch.maximum(m, s.amax(-1))
    alpha = torch.exp(m - m_new)                      # 0 on the first block (m = -inf), 1 if the max held
    p = torch.exp(s - m_new[:, None])                 # 0 on masked (-inf) scores
    return m_new.to(dt), (l * alpha + p.sum(-1)).to(dt), (acc * alpha[:, None] + p @ v).to(dt)


# --------------------------------------------------------------------------- lab03_1: gather through the table

def _gather_mistakes(bs):
    def contiguous(cache, table, n):
        return cache.reshape(-1, *cache.shape[2:])[:n]

    def untrimmed(cache, table, n):
        return cache[torch.as_tensor(table).long()[:-(-n // bs)]].reshape(-1, *cache.shape[2:])

    def whole_table(cache, table, n):
        return cache[torch.as_tensor(table).long()].reshape(-1, *cache.shape[2:])[:n]

    def swapped(cache, table, n):
        pos = torch.arange(n)
        t = torch.as_tensor(table).long()
        return cache[t[(pos % bs).clamp(max=len(t) - 1)], (pos // bs).clamp(max=bs - 1)]

    return [
        ("the cache is paged: position p lives in physical block block_table[p // block_size] at row "
         "p % block_size — follow the block table instead of reading the cache as one contiguous array",
         contiguous),
        ("keep only seq_len rows: the last block is usually only partly filled (its tail holds garbage)",
         untrimmed),
        ("keep only seq_len rows: the block table may have padding entries past the sequence's last block",
         whole_table),
        ("block index is p // block_size and the row inside the block is p % block_size (not the other way round)",
         swapped),
    ]


def check_lab03_1(gather_kv):
    """gather_kv(cache [num_blocks, block_size, KVH, D], block_table [>= cdiv(seq_len, bs)], seq_len) -> [seq_len, KVH, D]."""
    __tracebackhide__ = True
    from minillm.kernels.paged_attention_ref import paged_attention_decode_ref
    from minillm.layers.attention import AttentionMetadata
    reject_reference(gather_kv, gather_kv_ref, paged_attention_decode_ref, AttentionMetadata.context_slots)

    @given(seq_lens=st.lists(st.integers(1, 20), min_size=1, max_size=3), block_size=st.sampled_from([1, 2, 4, 8]),
           kv_heads=st.integers(1, 3), head_dim=st.sampled_from([1, 2, 4]),
           layout=st.sampled_from(["engine", "blocks"]), as_list=st.booleans(), seed=st.integers(0, 2**16))
    @example(seq_lens=[6, 3], block_size=4, kv_heads=1, head_dim=2, layout="blocks", as_list=False, seed=1)
    @example(seq_lens=[9, 4, 13], block_size=4, kv_heads=2, head_dim=2, layout="engine", as_list=False, seed=2)
    @example(seq_lens=[5], block_size=8, kv_heads=3, head_dim=4, layout="engine", as_list=True, seed=3)
    def prop(seq_lens, block_size, kv_heads, head_dim, layout, as_list, seed):
        c = make_paged_case(seq_lens, kv_heads, kv_heads, head_dim, block_size, seed, layout=layout)
        k_before = c.k_cache.clone()
        for s, n in enumerate(seq_lens):
            table = c.block_tables[s].tolist() if as_list else c.block_tables[s]
            got = gather_kv(c.k_cache, table, n)
            want = c.dense_k[s]
            where = (f"sequence {s} (seq_len={n}, block_size={block_size}, block_table={c.block_tables[s].tolist()}, "
                     f"the last entry is padding)")
            if not isinstance(got, torch.Tensor):
                assert False, f"gather_kv must return a torch.Tensor, got {type(got).__name__}"
            if (got.shape == want.shape and torch.equal(got, want)):
                continue
            why = diagnose(gather_kv, _gather_mistakes(block_size), [(c.k_cache, table, n)],
                           lambda a, b: isinstance(a, torch.Tensor) and a.shape == b.shape
                           and torch.equal(a.nan_to_num(-7.0), b.nan_to_num(-7.0)))
            if why is None and tuple(got.shape) != tuple(want.shape):
                why = f"expected shape {tuple(want.shape)} = [seq_len, KVH, D], got {tuple(got.shape)}"
            if why is None and torch.isnan(got).any():
                why = ("your result holds NaN: every slot that is not one of this sequence's positions is poisoned "
                       "with NaN, so you read a slot outside 0..seq_len-1")
            assert False, f"wrong rows for {where}" + (f" — {why}" if why else "")
        if not torch.equal(c.k_cache.nan_to_num(0.0), k_before.nan_to_num(0.0)):
            assert False, "gather_kv modified the cache: it must only read it"

    run_property(prop, max_examples=40,
                 hint="positions p = 0..seq_len-1 live at cache[block_table[p // bs], p % bs]; e.g. index the cache "
                      "with the first cdiv(seq_len, bs) table entries, reshape the [n_blocks, bs, KVH, D] result "
                      "to [n_blocks*bs, KVH, D] and keep the first seq_len rows. The engine's cache is a strided "
                      "view: use .reshape, not .view.")


# --------------------------------------------------------------------------- lab03_2: online softmax

def _os_variant(kind):
    def wrong(m, l, acc, scores, values):
        m, l, acc, s, v = (x.double() for x in (m, l, acc, scores, values))
        blk = s.amax(-1)
        m_new = blk if kind == "block_max" else torch.maximum(m, blk)
        alpha = torch.exp(m - m_new)
        if kind == "inverted":
            alpha = torch.exp(m_new - m).nan_to_num(0.0, posinf=float("inf"))
        p = torch.exp(s - m_new[:, None])
        if kind == "no_max":
            p = torch.exp(s)
            return m_new, l + p.sum(-1), acc + p @ v
        if kind == "no_max_rescaled":
            p = torch.exp(s)
            return m_new, l * alpha + p.sum(-1), acc * alpha[:, None] + p @ v
        if kind == "acc":
            return m_new, l * alpha + p.sum(-1), acc + p @ v
        if kind == "l":
            return m_new, l + p.sum(-1), acc * alpha[:, None] + p @ v
        return m_new, l * alpha + p.sum(-1), acc * alpha[:, None] + p @ v
    return wrong


_OS_MISTAKES = [
    ("when the running max grows, rescale the accumulator too: acc = acc * exp(m_old - m_new) + p @ values",
     _os_variant("acc")),
    ("when the running max grows, rescale the running sum too: l = l * exp(m_old - m_new) + sum(p)",
     _os_variant("l")),
    ("the correction factor is exp(m_old - m_new) (<= 1), not exp(m_new - m_old)", _os_variant("inverted")),
    ("m is the running max over ALL blocks so far: m_new = max(m_old, max of this block)", _os_variant("block_max")),
    ("subtract the running max before exp(): exp(score) overflows for large scores (and l, acc are defined "
     "relative to m)", _os_variant("no_max")),
    ("subtract the running max before exp(): p = exp(scores - m_new), not exp(scores) (exp overflows for large "
     "scores, and l, acc are defined relative to m)", _os_variant("no_max_rescaled")),
]


def _os_probes():
    g = torch.Generator().manual_seed(5)
    G, D = 2, 3
    init = (torch.full((G,), float("-inf"), dtype=torch.float64), torch.zeros(G, dtype=torch.float64),
            torch.zeros(G, D, dtype=torch.float64))
    a = torch.randn(G, 3, generator=g, dtype=torch.float64)
    va = torch.randn(3, D, generator=g, dtype=torch.float64)
    after_a = online_softmax_ref(*init, a, va)
    up = torch.randn(G, 2, generator=g, dtype=torch.float64) + 3.0     # this block raises the max
    down = torch.randn(G, 4, generator=g, dtype=torch.float64) - 3.0   # this one does not
    vb = torch.randn(2, D, generator=g, dtype=torch.float64)
    vc = torch.randn(4, D, generator=g, dtype=torch.float64)
    return [(*init, a, va), (*after_a, up, vb), (*after_a, down, vc)]


def _same_state(a, b):
    try:
        a = [torch.as_tensor(x).double() for x in a]
    except Exception:  # noqa: BLE001
        return False
    b = [torch.as_tensor(x).double() for x in b]
    return len(a) == 3 and all(x.shape == y.shape and torch.allclose(x, y, rtol=1e-6, atol=1e-9, equal_nan=True)
                               for x, y in zip(a, b))


@st.composite
def _softmax_cases(draw):
    G = draw(st.integers(1, 4))
    D = draw(st.integers(1, 5))
    sizes = draw(st.lists(st.integers(1, 6), min_size=1, max_size=5))     # the blocks of one row of scores
    magnitude = draw(st.sampled_from([1.0, 1.0, 5.0, 300.0]))
    masked = draw(st.floats(0.0, 0.6))
    trend = draw(st.sampled_from(["none", "up", "down"]))
    seed = draw(st.integers(0, 2**16))
    return G, D, sizes, magnitude, masked, trend, seed


def _softmax_case(G, D, sizes, magnitude, masked, trend, seed, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    T = sum(sizes)
    scores = torch.randn(G, T, generator=g, dtype=torch.float64) * magnitude
    if trend != "none":     # blocks whose scores rise (or fall) one after the other: the max moves every block
        ramp = torch.arange(T, dtype=torch.float64) * (3.0 * max(magnitude, 1.0) / max(T, 1))
        scores = scores + (ramp if trend == "up" else -ramp)
    drop = torch.rand(G, T, generator=g) < masked
    start = 0
    for n in sizes:                 # every block keeps at least one real score per row
        drop[:, start] = False
        start += n
    scores = scores.masked_fill(drop, float("-inf"))
    values = torch.randn(T, D, generator=g, dtype=torch.float64)
    return scores.to(dtype), values.to(dtype)


def check_lab03_2(online_softmax_update):
    """online_softmax_update(m [G], l [G], acc [G, D], scores [G, T], values [T, D]) -> (m, l, acc)."""
    __tracebackhide__ = True
    reject_reference(online_softmax_update, online_softmax_ref)

    @given(case=_softmax_cases(), dtype=st.sampled_from([torch.float64, torch.float64, torch.float32]))
    @example(case=(1, 1, [2, 2], 1.0, 0.0, "up", 0), dtype=torch.float64)               # the max moves up
    @example(case=(2, 3, [3, 1, 4], 1.0, 0.3, "down", 1), dtype=torch.float64)          # masked -inf scores
    @example(case=(2, 2, [4, 4], 300.0, 0.0, "up", 2), dtype=torch.float32)             # huge scores
    @example(case=(3, 2, [1, 5, 2], 800.0, 0.2, "none", 3), dtype=torch.float64)        # overflow even in float64
    def prop(case, dtype):
        G, D, sizes, magnitude, masked, trend, seed = case
        scores, values = _softmax_case(G, D, sizes, magnitude, masked, trend, seed, dtype)
        tol = dict(rtol=1e-9, atol=1e-12) if dtype == torch.float64 else dict(rtol=2e-5, atol=1e-6)
        m = torch.full((G,), float("-inf"), dtype=dtype)
        l = torch.zeros(G, dtype=dtype)
        acc = torch.zeros(G, D, dtype=dtype)
        start = 0
        s64, v64 = scores.double(), values.double()
        for i, n in enumerate(sizes):
            blk, vblk = scores[:, start:start + n], values[start:start + n]
            state_in = (m.clone(), l.clone(), acc.clone(), blk.clone(), vblk.clone())
            got = online_softmax_update(m.clone(), l.clone(), acc.clone(), blk.clone(), vblk.clone())
            try:
                gm, gl, gacc = (torch.as_tensor(x) for x in got)
            except Exception:  # noqa: BLE001
                assert False, f"online_softmax_update must return a tuple (m, l, acc), got {type(got).__name__}"
            start += n
            seen, vseen = s64[:, :start], v64[:start]
            want_m = seen.amax(-1)
            p = torch.exp(seen - want_m[:, None])
            want = (want_m, p.sum(-1), p @ vseen)
            shapes = [(G,), (G,), (G, D)]
            names = ["m", "l", "acc"]
            where = f"after block {i} of sizes {sizes} (G={G}, D={D}, |scores| ~ {magnitude:g}, {dtype})"
            for name, x, shape in zip(names, (gm, gl, gacc), shapes):
                if tuple(x.shape) != shape:
                    assert False, f"{name} has shape {tuple(x.shape)}, expected {shape} {where}"
            bad = [name for name, x, y in zip(names, (gm, gl, gacc), want)
                   if not torch.allclose(x.double(), y, **tol)]
            if not bad:
                m, l, acc = gm.to(dtype), gl.to(dtype), gacc.to(dtype)
                continue
            probes = [tuple(x.double() for x in state_in)] + _os_probes()
            why = diagnose(online_softmax_update, _OS_MISTAKES, probes, _same_state)
            if why is None and not all(torch.isfinite(x).all() for x in (gl, gacc)):
                why = "your state holds inf/NaN: subtract the running max before exp()"
            msg = (f"the running {'/'.join(bad)} {'is' if len(bad) == 1 else 'are'} wrong {where}: expected "
                   f"m = max of the scores so far, l = sum exp(score - m), acc = sum exp(score - m) * value")
            assert False, msg + (f" — {why}" if why else "")
        out = acc.double() / l.double()[:, None]
        want_out = torch.softmax(s64, -1) @ v64
        if not torch.allclose(out, want_out, rtol=1e-5, atol=1e-6):
            assert False, "acc / l after the last block differs from softmax(scores) @ values"

    run_property(prop, max_examples=60,
                 hint="m_new = max(m, scores.max(-1)); alpha = exp(m - m_new) (0 on the first block, where m = -inf); "
                      "p = exp(scores - m_new[:, None]); l_new = l * alpha + p.sum(-1); "
                      "acc_new = acc * alpha[:, None] + p @ values.")


# --------------------------------------------------------------------------- lab03_3: the Triton kernel

def launch_paged_attention(kernel, q, k_cache, v_cache, block_tables, seq_lens, scale, out=None):
    """Launch a paged decode kernel exactly like the notebook's `paged_attention_decode` wrapper does:
    grid (S, KVH), one program per (sequence, kv head), strides in elements, head dim contiguous."""
    S, H, D = q.shape
    num_blocks, block_size, KVH, _ = k_cache.shape
    group = H // KVH
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1 and q.stride(-1) == 1
    block_tables = block_tables.to(torch.int32).contiguous()
    seq_lens = seq_lens.to(torch.int32).contiguous()
    if out is None:
        out = torch.empty((S, H, D), dtype=q.dtype, device=q.device)
    kernel[(S, KVH)](
        out, q, k_cache, v_cache, block_tables, seq_lens, float(scale),
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        GROUP=group, GROUP_PAD=next_pow2(group), HEAD_DIM=D, D_PAD=next_pow2(D), BLOCK_SIZE=block_size,
    )
    return out


def _kernel_variant(case: PagedCase, *, kv_map="div", rescale=True, tail="mask", row="stride", scale_mul=1.0):
    """The kernel's algorithm in float64 with one knob turned to a known mistake (for diagnosis only)."""
    q, kc, vc, bt, sl = case.q.double(), case.k_cache.double(), case.v_cache.double(), case.block_tables.long(), \
        case.seq_lens.tolist()
    S, H, D = q.shape
    _, bs, KVH, _ = kc.shape
    G = H // KVH
    flat = bt.flatten()
    out = torch.zeros(S, H, D, dtype=torch.float64)
    for s in range(S):
        n = sl[s]
        for h in range(H):
            kvh = h // G if kv_map == "div" else h % KVH
            m, l, acc = torch.tensor(float("-inf"), dtype=torch.float64), torch.tensor(0.0, dtype=torch.float64), \
                torch.zeros(D, dtype=torch.float64)
            for b in range(-(-n // bs)):
                phys = {"stride": bt[s, b], "flat": flat[s + b], "row0": bt[0, b]}[row]
                valid = torch.arange(bs) < n - b * bs
                k = torch.where(valid[:, None], kc[phys, :, kvh], 0.0)
                v = torch.where(valid[:, None], vc[phys, :, kvh], 0.0)
                x = (k @ q[s, h]) * case.scale * scale_mul
                if tail == "mask":
                    x = x.masked_fill(~valid, float("-inf"))
                m_new = torch.maximum(m, x.max())
                alpha = torch.exp(m - m_new)
                p = torch.exp(x - m_new)
                l = l * alpha + p.sum()
                acc = (acc * alpha if rescale else acc) + p @ v
                m = m_new
            out[s, h] = acc / l
    return out


_KERNEL_MISTAKES = [
    ("query head h reads kv head h // GROUP (this program's heads are kv_head * GROUP + 0..GROUP-1), "
     "not h % KVH", dict(kv_map="mod")),
    ("rescale the accumulator when the running max grows: acc = acc * alpha[:, None] + p @ V with "
     "alpha = exp(m_old - m_new)", dict(rescale=False)),
    ("positions past seq_len in the last block must get score -inf (a masked load with other=0 still gives "
     "score 0, which takes a share of the softmax)", dict(tail="zeros")),
    ("read the block ids from this sequence's row of the block table: block_tables_ptr + seq * stride_bt + b",
     dict(row="flat")),
    ("read the block ids from this sequence's row of the block table (row `seq`, not row 0)", dict(row="row0")),
    ("multiply q·k by `scale`", dict(scale_mul=None)),
    ("apply `scale` once (it looks applied twice)", dict(scale_mul="twice")),
]


def _variant_output(c: PagedCase, kw: dict) -> torch.Tensor:
    opts = dict(kw)
    if opts.get("scale_mul", 1.0) is None:
        opts["scale_mul"] = 1.0 / c.scale
    elif opts.get("scale_mul") == "twice":
        opts["scale_mul"] = c.scale
    return _kernel_variant(c, **opts)


_PROBES: list = []


def _kernel_probes() -> list[tuple[PagedCase, list[torch.Tensor]]]:
    """Fixed probes (GQA with KVH > 1, ragged tails, several sequences, a moving max) with every mistake's output
    on them, computed once."""
    if not _PROBES:
        for c in (make_paged_case([7, 10], 4, 2, 4, 4, seed=21, magnitude=1.5),
                  make_paged_case([6, 3, 9], 6, 2, 4, 4, seed=22, layout="blocks", magnitude=1.5)):
            _PROBES.append((c, [_variant_output(c, kw) for _, kw in _KERNEL_MISTAKES]))
    return _PROBES


def _diagnose_kernel(run, case: PagedCase, probe_outputs: list) -> str | None:
    """The known mistake `run` (the learner's kernel, launched) agrees with on the failing case and the probes."""
    try:
        out = run(case)
    except Exception:  # noqa: BLE001
        return None
    for i, (why, kw) in enumerate(_KERNEL_MISTAKES):
        candidates = [(out, _variant_output(case, kw))] + [(o, alts[i]) for o, (_, alts) in
                                                          zip(probe_outputs, _kernel_probes())]
        if all(a is not None and a.shape == b.shape and torch.allclose(a, b, rtol=1e-4, atol=1e-4, equal_nan=True)
               for a, b in candidates):
            return why
    return None


def _triton_kernel_types():
    import triton
    from triton.runtime.interpreter import InterpretedFunction
    return triton.runtime.jit.JITFunction, InterpretedFunction


def _check_is_kernel(kernel):
    __tracebackhide__ = True
    jit_t, interp_t = _triton_kernel_types()
    if isinstance(kernel, jit_t):
        fail("your kernel was compiled for a GPU (TRITON_INTERPRET was not set when @triton.jit ran), and there "
             "is no GPU here.",
             "run the notebook's first cell (it sets TRITON_INTERPRET=1) before the kernel's cell; restart the "
             "kernel if TRITON_INTERPRET was set too late.")
    if not isinstance(kernel, interp_t):
        fail(f"pass the @triton.jit kernel itself (got {type(kernel).__name__}): the checker launches it on grid "
             "(S, KVH) with the arguments of the signature in the statement.",
             "check_lab03_3(paged_attention_kernel), where paged_attention_kernel is decorated with @triton.jit.")


def _unwrap_not_implemented(exc: BaseException):
    """The interpreter wraps errors raised inside a kernel in InterpreterError: surface NotImplementedError."""
    seen = exc
    while seen is not None:
        if isinstance(seen, NotImplementedError):
            raise NotImplementedError() from None
        seen = seen.__cause__ or seen.__context__
    raise exc


@st.composite
def _kernel_cases(draw):
    block_size = draw(st.sampled_from([4, 8]))
    seq_lens = draw(st.lists(st.integers(1, 4 * block_size), min_size=1, max_size=3))
    heads = draw(st.sampled_from([(1, 1), (2, 1), (3, 1), (4, 2), (6, 2), (2, 2)]))
    head_dim = draw(st.sampled_from([4, 8, 16]))
    layout = draw(st.sampled_from(["engine", "blocks"]))
    share = draw(st.booleans())
    magnitude = draw(st.sampled_from([1.0, 1.0, 2.0, 20.0]))
    seed = draw(st.integers(0, 2**16))
    return dict(seq_lens=seq_lens, heads=heads, head_dim=head_dim, block_size=block_size, layout=layout,
                share_prefix=share, magnitude=magnitude, seed=seed)


_EXPLICIT_KERNEL_CASES = [
    # one sequence, one head, one token: the smallest case there is
    dict(seq_lens=[1], heads=(1, 1), head_dim=4, block_size=4, layout="blocks", share_prefix=False,
         magnitude=1.0, seed=0),
    # several blocks per sequence, ragged tails, 3 sequences, GQA 6/2 (group 3, padded to 4), the engine layout
    dict(seq_lens=[7, 16, 2], heads=(6, 2), head_dim=8, block_size=4, layout="engine", share_prefix=False,
         magnitude=1.5, seed=1),
    # SmolLM2-like group of 3 query heads per kv head, a shared prefix block, a non-power-of-two head dim
    dict(seq_lens=[8, 13], heads=(3, 1), head_dim=12, block_size=8, layout="blocks", share_prefix=True,
         magnitude=1.0, seed=2),
    # large scores: the softmax must stay finite in fp32
    dict(seq_lens=[11, 5], heads=(4, 2), head_dim=8, block_size=4, layout="engine", share_prefix=False,
         magnitude=20.0, seed=3),
]


def _kernel_property(kernel):
    """The property behind check_lab03_3 (no rejection, no compile): usable on any Triton kernel."""
    probe_outputs: list = []

    def run(c):
        return launch_paged_attention(kernel, c.q, c.k_cache, c.v_cache, c.block_tables, c.seq_lens, c.scale).double()

    def probes():                      # the kernel's outputs on the fixed probes, once per check
        if not probe_outputs:
            for c, _ in _kernel_probes():
                try:
                    probe_outputs.append(run(c))
                except Exception:  # noqa: BLE001
                    probe_outputs.append(None)
        return probe_outputs

    @given(case=_kernel_cases())
    @example(case=_EXPLICIT_KERNEL_CASES[0])
    @example(case=_EXPLICIT_KERNEL_CASES[1])
    @example(case=_EXPLICIT_KERNEL_CASES[2])
    @example(case=_EXPLICIT_KERNEL_CASES[3])
    def prop(case):
        H, KVH = case["heads"]
        c = make_paged_case(case["seq_lens"], H, KVH, case["head_dim"], case["block_size"], case["seed"],
                            layout=case["layout"], share_prefix=case["share_prefix"], magnitude=case["magnitude"])
        out = torch.full_like(c.q, float("nan"))          # a head the kernel never stores stays NaN
        try:
            launch_paged_attention(kernel, c.q, c.k_cache, c.v_cache, c.block_tables, c.seq_lens, c.scale, out=out)
        except Exception as exc:  # noqa: BLE001
            _unwrap_not_implemented(exc)
        want = dense_decode_ref(c.q, c.dense_k, c.dense_v, c.scale)
        got = out.double()
        if torch.allclose(got, want, rtol=1e-4, atol=1e-4):
            return
        err = (got - want).abs().nan_to_num(float("inf"))
        s, h = divmod(int(err.flatten(0, 1).amax(-1).argmax()), H)
        where = (f"{_describe_case(c)}, H={H}, KVH={KVH}, D={case['head_dim']}: out[{s}, {h}] is wrong "
                 f"(max abs error {err.max().item():.3g})")
        why = _diagnose_kernel(run, c, probes())
        if why is None and torch.isnan(got).any():
            why = ("your output holds NaN: either a (sequence, head) row was never stored (store all GROUP heads of "
                   "the program, mask only the GROUP_PAD padding rows) or the kernel read a slot it must not: every "
                   "slot past seq_len in the last block, and every block not in the sequence's table, holds NaN — "
                   "mask the K/V loads with `offs_t < seq_len - b * BLOCK_SIZE` (and other=0.0)")
        assert False, where + (f" — {why}" if why else "")

    return prop


_KERNEL_HINT = ("program (seq, kv_head) handles query heads kv_head*GROUP + [0, GROUP); loop b over cdiv(seq_len, "
                "BLOCK_SIZE) blocks, phys = load(block_tables_ptr + seq*stride_bt + b), load a [BLOCK_SIZE, D_PAD] K/V "
                "tile at phys*stride_kb + t*stride_kt + kv_head*stride_kh + d with mask t < seq_len - b*BLOCK_SIZE; "
                "scores -inf on masked t; online softmax in fp32 (m, l, acc with alpha = exp(m - m_new)); "
                "store acc / l.")


def check_lab03_3(kernel):
    """A @triton.jit PagedAttention decode kernel with the statement's signature (grid (S, KVH))."""
    __tracebackhide__ = True
    from minillm.kernels import triton_paged_attention as tpa
    from minillm.kernels.paged_attention_ref import paged_attention_decode_ref
    _check_is_kernel(kernel)
    reject_reference(getattr(kernel, "fn", kernel), tpa._KERNEL_PY_FN, tpa.paged_attention_decode_triton,
                     paged_attention_decode_ref)
    reject_reference(kernel, tpa.paged_attention_decode_kernel)
    run_property(_kernel_property(kernel), max_examples=10, hint=_KERNEL_HINT)
    try:
        compile_kernel_for_gpu(kernel, arch=80)
    except KernelCompileError as e:
        fail("your kernel is right in the interpreter but does not compile for a real GPU (sm80, fp16, head_dim 64, "
             f"block_size 16, group 3): {e.summary}",
             "the interpreter runs your kernel as plain Python and accepts things compiled Triton does not: "
             "int()/float()/.item() on tensor values, numpy/torch/math calls on tensors, shapes in tl.arange/tl.full "
             "that are not tl.constexpr, global constants not wrapped in tl.constexpr(...). Keep to tl.* operations.")


# --------------------------------------------------------------------------- AOT compile of a learner's kernel

class KernelCompileError(RuntimeError):
    def __init__(self, summary: str, detail: str) -> None:
        super().__init__(f"{summary}\n{detail}")
        self.summary, self.detail = summary, detail


_COMPILED: dict = {}


def _kernel_source(kernel) -> str:
    """The kernel's module-level source for a fresh file: imports, the helpers/constants it uses, the function."""
    import triton.language as tl
    fn = getattr(kernel, "fn", kernel)
    jit_t, interp_t = _triton_kernel_types()
    parts, done = [], set()

    def add(f, top=True):
        if f.__name__ in done:
            return
        done.add(f.__name__)
        for name in f.__code__.co_names:
            if name in done or name not in f.__globals__:
                continue
            obj = f.__globals__[name]
            if isinstance(obj, types.ModuleType):
                parts.append(f"import {obj.__name__} as {name}\n")
                done.add(name)
            elif isinstance(obj, (interp_t, jit_t)) and obj.fn.__module__.split(".")[0] == "triton":
                parts.append(f"{name} = __import__('importlib').import_module({obj.fn.__module__!r})."
                             f"{obj.fn.__name__}\n")               # triton's own helpers, e.g. tl.standard
                done.add(name)
            elif isinstance(obj, (interp_t, jit_t)):
                add(obj.fn, top=False)
            elif isinstance(obj, tl.constexpr):
                parts.append(f"{name} = tl.constexpr({obj.value!r})\n")
                done.add(name)
            elif isinstance(obj, bool | int | float):
                parts.append(f"{name} = {obj!r}\n")        # as on a GPU: Triton rejects non-constexpr globals
                done.add(name)
        src = textwrap.dedent(inspect.getsource(f))
        lines = src.splitlines()
        while lines and not lines[0].lstrip().startswith("def "):
            lines.pop(0)                 # drop decorators: the compiler wraps the kernel; helpers get a fresh @jit
        parts.append(("" if top else "@triton.jit\n") + "\n".join(lines) + "\n")

    add(fn)
    header = "import math\nimport triton\nimport triton.language as tl\nfrom triton.language import constexpr\n\n"
    return header + "\n\n".join(parts)


_CHILD = r"""
import importlib.util, json, sys, base64
def load(name, path):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
tpa = load("_lab03_tpa", sys.argv[1])
user = load("_lab03_user_kernel", sys.argv[2])
job = json.loads(sys.argv[3])
tpa._KERNEL_PY_FN = getattr(user, job.pop("name"))
asm = tpa._aot_compile_here(**job)
out = {k: asm[k] for k in ("ttir", "ttgir", "ptx") if k in asm}
out["cubin_bytes"] = len(asm.get("cubin", b""))
with open(sys.argv[4], "w") as f:
    json.dump(out, f)
"""


def compile_kernel_for_gpu(kernel, arch: int = 80, dtype: str = "fp16", head_dim: int = 64, block_size: int = 16,
                           group: int = 3, num_warps: int = 4, timeout: float = 300) -> dict:
    """Ahead-of-time compile a notebook kernel for NVIDIA sm`arch` without a GPU (SmolLM2's decode shapes by
    default). Returns {"ttir", "ttgir", "ptx": str, "cubin_bytes": int}; raises KernelCompileError.

    Runs in a child process without TRITON_INTERPRET (an interpreting process cannot compile), with the kernel's
    source written to a temp module; the compile step itself is minillm's (kernels/triton_paged_attention.py),
    so the kernel must keep the statement's signature."""
    from minillm.kernels import triton_paged_attention as tpa
    fn = getattr(kernel, "fn", kernel)
    src = _kernel_source(kernel)
    job = dict(name=fn.__name__, arch=int(arch), dtype=dtype, head_dim=int(head_dim), block_size=int(block_size),
               group=int(group), num_warps=int(num_warps))
    key = hashlib.sha256((src + json.dumps(job, sort_keys=True)).encode()).hexdigest()
    if key in _COMPILED:
        return _COMPILED[key]
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    with tempfile.TemporaryDirectory() as tmp:
        user_path, out_path = os.path.join(tmp, "user_kernel.py"), os.path.join(tmp, "out.json")
        with open(user_path, "w") as f:
            f.write(src)
        try:
            proc = subprocess.run([sys.executable, "-c", _CHILD, os.path.abspath(tpa.__file__), user_path,
                                   json.dumps(job), out_path], env=env, cwd=tmp, capture_output=True, text=True,
                                  timeout=timeout)
        except subprocess.TimeoutExpired:
            raise KernelCompileError(f"the compile took more than {timeout:.0f} s", "") from None
        if proc.returncode != 0:
            err = proc.stderr.strip()
            lines = [ln for ln in err.splitlines() if ln.strip()]
            summary = lines[-1].strip() if lines else "unknown error"
            caret = next((i for i in range(len(lines) - 1, 0, -1) if lines[i].strip() == "^"), None)
            if caret is not None:                   # triton points at the offending line of the kernel
                summary += f" — in `{lines[caret - 1].strip()}`"
            raise KernelCompileError(summary[:400], err[-3000:])
        with open(out_path) as f:
            asm = json.load(f)
    _COMPILED[key] = asm
    return asm


__all__ += ["KernelCompileError"]
