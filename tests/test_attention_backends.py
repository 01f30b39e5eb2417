"""Paged attention (torch backend and the Triton kernel, interpreted) = dense attention.

Random block tables, ragged lengths, prefill chunks mixed with decodes, GQA ratios, fp32 and bf16."""
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st

from minillm.config import ModelConfig
from minillm.kv.cache import KVCache
from minillm.layers.attention import (AttentionMetadata, CpuAttentionBackend, TorchAttentionBackend,
                                     TritonAttentionBackend, get_attention_backend)

TOL = {torch.float32: 2e-5, torch.bfloat16: 3e-2}


def dense(q, k, v, scale):
    """q [n, H, D] = the last n of L positions; k, v [L, KVH, D]; plain causal attention with repeated kv heads."""
    n, h, _ = q.shape
    L, kvh, _ = k.shape
    k = k.repeat_interleave(h // kvh, dim=1).float()
    v = v.repeat_interleave(h // kvh, dim=1).float()
    s = torch.einsum("nhd,lhd->hnl", q.float(), k) * scale
    allowed = torch.arange(L)[None, :] <= (L - n + torch.arange(n))[:, None]
    s = s.masked_fill(~allowed[None], float("-inf"))
    return torch.einsum("hnl,lhd->nhd", s.softmax(-1), v)


@st.composite
def batches(draw):
    heads, kv_heads = draw(st.sampled_from([(4, 4), (4, 2), (6, 2), (4, 1)]))
    d = draw(st.sampled_from([8, 16]))
    bs = draw(st.sampled_from([1, 2, 4, 8]))
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16]))
    seqs = draw(st.lists(st.tuples(st.integers(0, 30), st.integers(1, 12)), min_size=1, max_size=5))
    decode_only = draw(st.booleans())
    if decode_only:
        seqs = [(c + n - 1, 1) for c, n in seqs]        # context, then exactly one new token
    return heads, kv_heads, d, bs, dtype, seqs, draw(st.integers(0, 2**16))


def run_backend(backend, heads, kv_heads, d, bs, dtype, seqs, seed, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    cfg = ModelConfig(vocab_size=8, hidden_size=heads * d, intermediate_size=8, num_layers=1, num_heads=heads,
                      num_kv_heads=kv_heads, head_dim=d)
    need = sum(-(-(c + n) // bs) for c, n in seqs)
    cache = KVCache(cfg, need + 3, bs, dtype=dtype, device=device)
    cache.k.copy_(torch.randn(cache.k.shape, generator=g))     # garbage everywhere a sequence must not read
    cache.v.copy_(torch.randn(cache.v.shape, generator=g))
    phys = torch.randperm(need + 3, generator=g).tolist()
    tables, slots, full_k, full_v, qs, ks, vs = [], [], [], [], [], [], []
    for c, n in seqs:
        L = c + n
        table = [phys.pop() for _ in range(-(-L // bs))]
        tables.append(table)
        k = torch.randn(L, kv_heads, d, generator=g).to(dtype)
        v = torch.randn(L, kv_heads, d, generator=g).to(dtype)
        for p in range(c):                               # cached context goes into the pool beforehand
            cache.k[0, :, table[p // bs] * bs + p % bs] = k[p]
            cache.v[0, :, table[p // bs] * bs + p % bs] = v[p]
        slots += [table[p // bs] * bs + p % bs for p in range(c, L)]
        qs.append(torch.randn(n, heads, d, generator=g).to(dtype))
        ks.append(k[c:])
        vs.append(v[c:])
        full_k.append(k)
        full_v.append(v)
    width = max(len(t) for t in tables)
    meta = AttentionMetadata(query_lens=[n for _, n in seqs], seq_lens=[c + n for c, n in seqs],
                             slot_mapping=torch.tensor(slots, device=device), block_size=bs,
                             block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], device=device))
    scale = d ** -0.5
    out = backend.forward(0, *(torch.cat(x).to(device) for x in (qs, ks, vs)), meta, cache, scale)
    ref = torch.cat([dense(q, k, v, scale) for q, k, v in zip(qs, full_k, full_v)])
    return out.float().cpu(), ref


@settings(max_examples=40, deadline=None, derandomize=True)
@given(batches(), st.sampled_from([1, 2, 3, 4]))
def test_torch_backend_equals_dense(b, group_size):
    """group_size 1 = the per-sequence loop; larger = length-sorted padded groups of decodes."""
    out, ref = run_backend(TorchAttentionBackend(decode_group_size=group_size), *b)
    assert (out - ref).abs().max().item() <= TOL[b[4]]


@settings(max_examples=8, deadline=None, derandomize=True)
@given(batches())
def test_triton_backend_equals_dense(b):
    """In Triton's interpreter on CPU; on a real GPU when there is one and TRITON_INTERPRET is 0."""
    import os
    gpu = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"
    out, ref = run_backend(TritonAttentionBackend(), *b, device="cuda" if gpu else "cpu")
    assert (out - ref).abs().max().item() <= TOL[b[4]]



@settings(max_examples=40, deadline=None, derandomize=True)
@given(batches())
def test_cpu_kernel_backend_equals_dense(b):
    """The compiled CPU kernel (fp32) and its torch fallback (bf16) read the pool through the block tables."""
    out, ref = run_backend(CpuAttentionBackend(), *b)
    assert (out - ref).abs().max().item() <= TOL[b[4]]


def test_auto_backend_on_cpu_is_the_compiled_kernel():
    assert get_attention_backend("auto", "cpu").name == "cpu"
    assert get_attention_backend("torch").name == "torch"


def test_cpu_kernel_addresses_rows_in_place():
    """With rows, the kernel reads each sequence's query from the step's q and writes only that row of out:
    the prefill rows around it keep what the torch path put there."""
    from minillm.kernels.cpu_paged_attention import paged_attention_decode_cpu
    g = torch.Generator().manual_seed(3)
    kvh, h, d, bs = 2, 6, 16, 4
    k_slots, v_slots = torch.randn(kvh, 40, d, generator=g), torch.randn(kvh, 40, d, generator=g)
    tables = torch.tensor([[3, 1, 0], [9, 2, 5]])
    lens = torch.tensor([11, 6])
    q = torch.randn(7, h, d, generator=g)
    rows = torch.tensor([5, 2])
    out = torch.full_like(q, 7.0)
    paged_attention_decode_cpu(q, k_slots, v_slots, tables, lens, bs, 0.25, rows=rows, out=out)
    alone = paged_attention_decode_cpu(q[rows], k_slots, v_slots, tables, lens, bs, 0.25)
    torch.testing.assert_close(out[rows], alone)
    untouched = [r for r in range(7) if r not in rows.tolist()]
    assert (out[untouched] == 7.0).all()
    with pytest.raises(ValueError, match="out must be"):
        paged_attention_decode_cpu(q, k_slots, v_slots, tables, lens, bs, 0.25, rows=rows, out=out[:, :3])


@pytest.mark.parametrize("seqs", [[(0, 40), (7, 5), (12, 1)], [(0, 530), (3, 1)], [(20, 515), (0, 9)],
                                  [(600, 50), (300, 100), (500, 100), (2, 510)], [(700, 300), (0, 1)]])
def test_cpu_backend_sends_every_prefill_chunk_through_the_kernel(seqs, monkeypatch):
    """Over a float pool every chunk, fresh or after cached context, short or long, is a kernel row per token (the
    kernel attends a sequence's rows in pieces: csrc/paged_decode.c); torch's flash attention never runs. Equal to
    dense attention."""
    import minillm.layers.attention as attention
    calls = []
    real = attention.F.scaled_dot_product_attention
    monkeypatch.setattr(attention.F, "scaled_dot_product_attention",
                        lambda q, *a, **k: calls.append(q.shape[-2]) or real(q, *a, **k))
    out, ref = run_backend(CpuAttentionBackend(), 4, 2, 16, 4, torch.float32, seqs, 0)
    assert (out - ref).abs().max().item() <= TOL[torch.float32]
    assert calls == []


def test_cpu_backend_leaves_prefill_to_a_learners_attend_fn():
    """The lab01 seam: an attend_fn given to the CPU backend sees every prefill chunk, as the torch backend's does."""
    from minillm.layers.attention import causal_attend
    seen = []

    def attend(q, k, v, scale):
        seen.append(q.shape[0])
        return causal_attend(q, k, v, scale)
    out, ref = run_backend(CpuAttentionBackend(attend_fn=attend), 4, 2, 16, 4, torch.float32,
                           [(0, 6), (5, 3), (9, 1)], 1)
    assert (out - ref).abs().max().item() <= TOL[torch.float32]
    assert seen == [6, 3]
