"""Property: decoding token by token with the KV cache gives the logits of recomputing the whole sequence."""
import gc

import pytest
import torch
from hypothesis import example, given, settings, strategies as st

from minillm.kv.cache import zeros_lazily
from minillm.kv.contiguous import ContiguousKVCache
from minillm.layers.attention import TorchAttentionBackend
from minillm.models.llama import ForwardContext
from tests.tiny_models import minillm_logits, random_model

HEADS = st.sampled_from([(4, 4), (4, 2), (4, 1), (6, 3), (2, 1)])


@settings(max_examples=25, deadline=None, derandomize=True)
# one prompt token and one decode; a prompt of exactly one chunk; chunks of one token (every prefill step is a
# decode-sized query over cached context); the longest prompt in one chunk; MQA
@example(heads=(4, 2), prompt_len=1, decode_len=1, chunk=1, seed=0)
@example(heads=(4, 4), prompt_len=16, decode_len=3, chunk=16, seed=1)
@example(heads=(6, 3), prompt_len=9, decode_len=2, chunk=1, seed=2)
@example(heads=(4, 1), prompt_len=40, decode_len=12, chunk=16, seed=3)
@given(heads=HEADS, prompt_len=st.integers(1, 40), decode_len=st.integers(1, 12), chunk=st.integers(1, 16),
       seed=st.integers(0, 2**16))
def test_cached_decode_equals_recompute(heads, prompt_len, decode_len, chunk, seed):
    model = random_model(seed=seed % 7, heads=heads[0], kv_heads=heads[1])
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 128, (prompt_len + decode_len,), generator=g).tolist()
    full = minillm_logits(model, ids)                       # no cache reuse: one pass over everything

    cache = ContiguousKVCache(model.cfg, 1, len(ids))
    backend, got, pos = TorchAttentionBackend(), [], 0
    # Prefill in chunks (exercises attention over cached context), then one token at a time.
    steps = [min(chunk, prompt_len - s) for s in range(0, prompt_len, chunk)] + [1] * decode_len
    for n in steps:
        meta = cache.metadata([0], [pos], [n])
        h = model(torch.tensor(ids[pos:pos + n]), torch.arange(pos, pos + n), ForwardContext(meta, cache, backend))
        got.append(model.compute_logits(h))
        pos += n
    got = torch.cat(got)
    assert got.shape == full.shape
    assert (got - full).abs().max().item() <= 1e-4


def test_batched_rows_do_not_interfere():
    """Two sequences in different cache rows, decoded in one batch, match each decoded alone."""
    model = random_model(seed=1)
    a, b = list(range(3, 20)), list(range(40, 49))
    cache = ContiguousKVCache(model.cfg, 2, 32)
    backend = TorchAttentionBackend()
    meta = cache.metadata([0, 1], [0, 0], [len(a), len(b)])
    model(torch.tensor(a + b), torch.cat([torch.arange(len(a)), torch.arange(len(b))]),
          ForwardContext(meta, cache, backend))
    meta = cache.metadata([0, 1], [len(a), len(b)], [1, 1])
    h = model(torch.tensor([7, 8]), torch.tensor([len(a), len(b)]), ForwardContext(meta, cache, backend))
    got = model.compute_logits(h)
    ref_a = minillm_logits(model, a + [7])[-1]
    ref_b = minillm_logits(model, b + [8])[-1]
    assert (got[0] - ref_a).abs().max() <= 1e-4 and (got[1] - ref_b).abs().max() <= 1e-4


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.int8])
def test_lazily_zeroed_pool_reads_zero_and_keeps_its_writes(dtype):
    """The pool's memory (an anonymous mmap) starts as zeros, takes writes anywhere, and outlives the names that
    made it; an empty pool is a valid tensor too."""
    shape = (2, 3, 4099, 8)
    t = zeros_lazily(shape, dtype, "cpu")
    assert t.shape == shape and t.dtype == dtype and t.is_contiguous()
    assert not t.any()
    gc.collect()
    t[1, 2, 4098] = 5
    t[0, 0, 0] = -3
    assert t.sum().item() == 5 * 8 - 3 * 8
    assert zeros_lazily((0, 3, 8), dtype, "cpu").shape == (0, 3, 8)
