# ---
# jupyter:
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Lab 01 — The KV cache
#
# **The question.** *"What is the KV cache, why does every inference engine have one, and how much memory does
# it take? Why do servers run out of memory on long contexts or many concurrent users?"*
#
# A decoder layer turns every token into a query, a key and a value. A new token attends to the keys and
# values of **all** the tokens before it — and those never change once computed (a token's K and V depend only
# on the tokens up to it). So an engine computes each token's K and V once, stores them, and at each decode
# step computes K/V for the one new token only. That store is the **KV cache**: it turns each decode step from
# "re-run the whole sequence" into "run one token, read the cache".
#
# **What you will measure.** Decoding SmolLM2 with the cache vs recomputing the whole sequence every step:
# the same tokens, but per-step time flat vs growing with the length (O(n) vs O(n²) total work). And the
# cache's size: the formula every capacity plan starts from.
#
# Answer cells say `raise NotImplementedError()` until you fill them in; the graded cell after each one
# (don't edit it) prints nothing when you are right, and the smallest counter-example with a hint when not.

# %% nbgrader="readonly"
import time

import torch

from minillm import plots
from minillm.engine.prompt import build_prompt_ids
from minillm.engine.simple import SimpleGenerator
from minillm.kv.contiguous import ContiguousKVCache
from minillm.layers.attention import TorchAttentionBackend
from minillm.loading.loader import load_model
from minillm.sampling.params import SamplingParams

loaded = load_model("default", "float32")
model, cfg, tok = loaded.model, loaded.config, loaded.tokenizer
gen = SimpleGenerator(model, tok)
print(f"{cfg.num_layers} layers, {cfg.num_heads} query heads, {cfg.num_kv_heads} kv heads, head_dim {cfg.head_dim}")

# %% [markdown]
# ## What is in the cache (real engine state)
#
# minillm's reference engine keeps one K and one V tensor per layer, shaped
# `[max_len, num_kv_heads, head_dim]` per sequence (`minillm/kv/contiguous.py`). Below, the engine prefills a
# short chat prompt into a cache that reserved 96 slots, then we look at layer 0's keys: one row per
# position, one column per (kv head, dimension). The rows after the prompt are reserved but still empty —
# they fill up, one per decode step, as the answer is generated. Note the **3** kv heads for **9** query
# heads: SmolLM2 uses grouped-query attention (GQA), so its cache is 3× smaller than with one K/V per query
# head.

# %%
prompt_ids = build_prompt_ids(tok, "Explain in one paragraph why the sky is blue.")
cache = ContiguousKVCache(cfg, max_batch=1, max_len=96)
gen.forward_logits(cache, prompt_ids, 0)
k0 = cache.layer(0)[0][0].reshape(96, -1)              # layer 0 K, row 0: [positions, kv_heads * head_dim]
plots.kv_cache_keys(k0, len(prompt_ids), cfg.num_kv_heads, cfg.head_dim, cache.nbytes / 2**20)

# %% [markdown]
# ## Task 1 — attention over a KV cache (3 points)
#
# Write `attend(q, k, v, scale)`, the function the engine calls for every layer:
#
# * `q`: `[n, H, D]` — queries of the **last n** positions of a sequence (prefill: n = L; decode: n = 1;
#   a chunk of a prompt after a cached prefix: anything in between);
# * `k`, `v`: `[L, KVH, D]` — keys and values of **all** L positions (the first L − n come from the cache);
# * returns `[n, H, D]`, same dtype as `q`.
#
# Rules: query i sits at absolute position `L - n + i` and may attend to keys `0 .. L - n + i` (causal);
# scores are `scale · q·k`; softmax over the keys; output is the weighted sum of values. **Grouped-query
# attention:** with `KVH` kv heads for `H` query heads (`H` a multiple of `KVH`), query head `h` uses kv head
# `h // (H // KVH)` — consecutive query heads share one kv head. That one rule covers multi-head (KVH = H),
# grouped-query (1 < KVH < H) and multi-query attention (KVH = 1). The scores of a real model can be large:
# keep the softmax finite. A key a query may not see gets no weight at all, whatever the scores: mask it with
# `-inf` (setting or adding `torch.finfo(dtype).min` is fine too) — a finite constant such as -1e9 is not below
# every real score. Don't modify `k` or `v` (in the engine they are the cache).
#
# Use plain torch ops (`einsum`, `softmax`, masks...). The checker compares your function with a float64
# dense reference on random shapes, including huge logits (scores up to about ±1e10), a single token, and MQA.

# %% nbgrader="answer"
def attend(q, k, v, scale):
    """Causal attention of the last n of L positions; q [n, H, D], k/v [L, KVH, D] -> [n, H, D]."""
    ### BEGIN SOLUTION
    n, H, D = q.shape
    L, KVH, _ = k.shape
    group = H // KVH
    k = k.repeat_interleave(group, dim=1)                          # [L, H, D]: head h reads kv head h // group
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("nhd,lhd->hnl", q, k) * scale            # [H, n, L]
    qpos = torch.arange(L - n, L, device=q.device)[:, None]        # absolute position of each query
    future = torch.arange(L, device=q.device)[None, :] > qpos      # keys a query may not see
    scores = scores.masked_fill(future, float("-inf"))
    scores = scores - scores.amax(dim=-1, keepdim=True)            # exp() of large scores would overflow
    p = scores.exp()
    p = p / p.sum(dim=-1, keepdim=True)
    return torch.einsum("hnl,lhd->nhd", p, v)
    ### END SOLUTION


# %% nbgrader="graded" points=3
from minillm.grading.lab01 import check_lab01_1; check_lab01_1(attend)

# %% [markdown]
# ## Task 2 — how big is the KV cache? (2 points)
#
# Write `kv_cache_bytes(cfg, batch_size, seq_len, dtype_bytes)`: the bytes needed to cache `seq_len` tokens
# for each of `batch_size` sequences, at `dtype_bytes` bytes per number. `cfg` has `num_layers`,
# `num_heads`, `num_kv_heads`, `head_dim` and `hidden_size` (not all of them matter). Think about what one
# token leaves behind in every layer.

# %% nbgrader="answer"
def kv_cache_bytes(cfg, batch_size, seq_len, dtype_bytes):
    """Bytes of K and V for batch_size sequences of seq_len tokens."""
    ### BEGIN SOLUTION
    return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * batch_size * seq_len * dtype_bytes
    ### END SOLUTION


# %% nbgrader="graded" points=2
from minillm.grading.lab01 import check_lab01_2; check_lab01_2(kv_cache_bytes)

# %% [markdown]
# ## Task 3 — sizing: how many sequences fit? (2 points)
#
# An accelerator has `memory_bytes` of memory; the model's weights take `weight_bytes`. Whatever is left holds
# KV caches. Write `max_num_seqs(cfg, memory_bytes, weight_bytes, seq_len, dtype_bytes)`: how many sequences
# can each hold a full `seq_len`-token KV cache at the same time (a whole number; 0 when nothing fits). This
# is the concurrency ceiling of a server that reserves the full context per request — lab02's paged cache
# raises it by reserving only what is used.

# %% nbgrader="answer"
def max_num_seqs(cfg, memory_bytes, weight_bytes, seq_len, dtype_bytes):
    """How many sequences of seq_len tokens fit in the memory the weights leave free."""
    ### BEGIN SOLUTION
    free = memory_bytes - weight_bytes
    if free <= 0:
        return 0
    return int(free // kv_cache_bytes(cfg, 1, seq_len, dtype_bytes))
    ### END SOLUTION


# %% nbgrader="graded" points=2
from minillm.grading.lab01 import check_lab01_3; check_lab01_3(max_num_seqs)

# %% [markdown]
# ## Plug in: your attention inside the engine
#
# The engine's attention backend accepts any function with `attend`'s signature. Swap yours in, generate
# greedily, and compare with minillm's own attention: the tokens should be identical and the logits equal
# to float32 rounding. Then check your size formula against the bytes the engine actually allocated.

# %%
params = SamplingParams(temperature=0, max_tokens=16)
reference = SimpleGenerator(model, tok)                            # minillm's own attention
text_ref, ids_ref = reference.generate(prompt_ids, params)

mine = SimpleGenerator(model, tok, backend=TorchAttentionBackend(attend_fn=attend))   # yours, every layer and step
text_mine, ids_mine = mine.generate(prompt_ids, params)

logits_ref = reference.forward_logits(reference.new_cache(len(prompt_ids)), prompt_ids, 0)
logits_mine = mine.forward_logits(mine.new_cache(len(prompt_ids)), prompt_ids, 0)
print("minillm :", repr(text_ref))
print("yours   :", repr(text_mine))
print(f"same {len(ids_ref)} tokens: {ids_mine == ids_ref};  max |logit difference| on the prompt: "
      f"{(logits_mine - logits_ref).abs().max().item():.2e}")

c = ContiguousKVCache(cfg, max_batch=2, max_len=512)
print(f"engine allocated {c.nbytes:,} bytes for 2 × 512 tokens; your formula says "
      f"{kv_cache_bytes(cfg, 2, 512, 4):,}")

# %% [markdown]
# ## Measurement: decode with the cache vs recomputing everything
#
# Without a cache, the step that produces token n+1 must run all n tokens through the model again (a fresh
# prefill); with the cache it runs one token and reads the n stored K/V. First, a short greedy run both ways
# (the tokens must be the same); then the cost of one step at growing lengths n, best of a few repeats.
# **Expected shape:** the cached step is nearly flat (at these lengths it is dominated by reading the
# weights once); the recompute step grows linearly with n — so generating n tokens costs O(n) steps of flat
# cost with the cache, but O(n²) work without it (right plot: the totals implied by the measured steps).

# %%
def decode(ids, steps, use_cache):
    seq, out = list(ids), []
    cache = gen.new_cache(len(ids) + steps)
    logits = gen.forward_logits(cache, seq, 0)
    for _ in range(steps):
        out.append(int(logits.argmax()))
        seq.append(out[-1])
        if use_cache:   # one new token; its K/V join the cache
            logits = gen.forward_logits(cache, [out[-1]], len(seq) - 1)
        else:           # no reuse: the whole sequence again, into a fresh cache
            logits = gen.forward_logits(gen.new_cache(len(seq)), seq, 0)
    return out


def best_of(fn, repeats):
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


ids = tok.encode("Once upon a time")
t0 = time.perf_counter()
toks_cached = decode(ids, 16, use_cache=True)
t1 = time.perf_counter()
toks_recomputed = decode(ids, 16, use_cache=False)
t2 = time.perf_counter()
print(f"16 greedy tokens: same with and without the cache: {toks_cached == toks_recomputed} "
      f"({t1 - t0:.2f} s vs {t2 - t1:.2f} s)")

lengths = [16, 64, 128, 192]
filler = torch.randint(100, cfg.vocab_size, (max(lengths),), generator=torch.Generator().manual_seed(0)).tolist()
cached_ms, recompute_ms = [], []
for n in lengths:
    cache = gen.new_cache(n)
    gen.forward_logits(cache, filler[:n - 1], 0)                              # the n-1 earlier tokens, cached
    cached_ms.append(1000 * best_of(lambda: gen.forward_logits(cache, filler[n - 1:n], n - 1), 2))
    recompute_ms.append(1000 * best_of(lambda: gen.forward_logits(gen.new_cache(n), filler[:n], 0), 2))
    print(f"n = {n:3d}: one step {cached_ms[-1]:6.1f} ms with the cache, {recompute_ms[-1]:7.1f} ms recomputing")

plots.cache_vs_recompute(lengths, cached_ms, recompute_ms)   # right: a line fitted to the steps, summed

# %% [markdown]
# ## What the cache costs at scale
#
# Your two formulas, applied to real model shapes (bf16 KV): bytes per token, one 8k-token sequence, and how
# many 8k-token sequences fit next to the weights on an 80 GB accelerator (0: the bf16 70B weights alone
# don't fit).

# %%
from types import SimpleNamespace as Shape

shapes = {
    "SmolLM2-135M (GQA 9/3)": (Shape(num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64, hidden_size=576), 0.27e9),
    "Llama-2-7B (MHA 32/32)": (Shape(num_layers=32, num_heads=32, num_kv_heads=32, head_dim=128, hidden_size=4096), 13.5e9),
    "Llama-3-8B (GQA 32/8)": (Shape(num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128, hidden_size=4096), 16.1e9),
    "Llama-3-70B (GQA 64/8)": (Shape(num_layers=80, num_heads=64, num_kv_heads=8, head_dim=128, hidden_size=8192), 141e9),
    "Llama-3-70B, int4 weights": (Shape(num_layers=80, num_heads=64, num_kv_heads=8, head_dim=128, hidden_size=8192), 38e9),
    "70B as MQA, int4 weights": (Shape(num_layers=80, num_heads=64, num_kv_heads=1, head_dim=128, hidden_size=8192), 38e9),
}
print(f"{'model':<26} {'KiB/token':>10} {'GiB per 8k seq':>15} {'8k seqs on 80 GB':>17}")
for name, (shape, wbytes) in shapes.items():
    per_tok = kv_cache_bytes(shape, 1, 1, 2)
    print(f"{name:<26} {per_tok / 2**10:>10.1f} {kv_cache_bytes(shape, 1, 8192, 2) / 2**30:>15.2f} "
          f"{max_num_seqs(shape, 80e9, wbytes, 8192, 2):>17}")

# %% [markdown]
# ## Interview questions
#
# <details><summary><b>What is the KV cache and why do we need it?</b></summary>
#
# In causal attention a token's key and value depend only on the tokens up to it, so once computed they never
# change. The KV cache stores, for every layer, the K and V vectors of every token processed so far; each
# decode step then computes Q, K, V for the single new token, appends its K/V, and attends over the cache.
# Without it, step t would re-run all t tokens through the model — O(n²) work to generate n tokens instead of
# O(n) — as the measurement above shows (flat vs growing step time, same tokens). The price is memory that
# grows with every token of every live sequence, which makes the cache, not the weights, the resource a
# serving engine schedules around (lab02–lab05).
# </details>
#
# <details><summary><b>How do you compute the size of the KV cache?</b></summary>
#
# bytes = 2 (K and V) × layers × kv_heads × head_dim × tokens × batch × bytes per element. Per token:
# Llama-3-8B (32 layers, 8 kv heads × 128) in bf16 keeps 2·32·8·128·2 = 128 KiB, so an 8k-token sequence
# needs 1 GiB and a 128k one 16 GiB; Llama-2-7B, with full multi-head attention (32 kv heads), needs 4× that
# (512 KiB/token). SmolLM2-135M needs 22.5 KiB/token in bf16. Note it depends on kv_heads, not on the number
# of query heads or hidden size, and that an fp8/int8 KV cache halves it.
# </details>
#
# <details><summary><b>MHA vs MQA vs GQA: what are they and what do they trade?</b></summary>
#
# Multi-head attention gives every query head its own K/V head; multi-query attention (MQA) shares one K/V
# head across all query heads; grouped-query attention (GQA) shares each K/V head among a group (Llama-3-8B:
# 32 query heads, 8 kv heads, groups of 4). The KV cache and the KV bytes read per decode step shrink by
# H / KVH (4× for Llama-3-8B, 32× for MQA), which raises batch size and decode speed. MQA can cost some
# quality and training stability; GQA recovers nearly all of MHA's quality and is the default in current
# open models (Llama 3, Mistral, Qwen, SmolLM2). In code the only change is the head mapping
# h → h // (H / KVH), as in Task 1.
# </details>
#
# <details><summary><b>How do you budget GPU memory for a deployment?</b></summary>
#
# Start from capacity: memory = weights + KV cache + activations/workspace (+ CUDA graphs, fragmentation).
# Weights are parameters × bytes (8B in bf16 ≈ 16 GB). Leave headroom (engines like vLLM use ~90% of memory)
# and give the rest to the KV cache: on an 80 GB GPU with an 8B bf16 model that is ~56 GB, i.e. ~430k tokens
# at 128 KiB/token — about 52 sequences at 8k context if each reserves its full length, many more with paged
# allocation that only holds what is used. Then check the target: concurrency × average (prompt + output)
# length × bytes/token must fit; if not, quantize weights or KV, use a GQA model, shard with tensor
# parallelism, or cap max_model_len / max_num_seqs.
# </details>
#
# <details><summary><b>Why do servers OOM on long contexts or high concurrency, and what do you do?</b></summary>
#
# The KV cache grows linearly in both context length and number of concurrent sequences, on top of fixed
# weights: a single 128k-token Llama-3-70B sequence needs 40 GiB of bf16 KV, and 100 users at 8k need
# 100 × 1 GiB for an 8B model. Naive engines also reserve max length per request, wasting most of it. Fixes:
# paged KV allocation (no reservation waste, lab02), admission control and preemption when blocks run out
# (lab04), limits on max_model_len and max_num_seqs, KV quantization (fp8/int8 halves it), prefix sharing
# (lab05), GQA/MQA models, offloading cold KV to CPU, or sharding heads across GPUs with tensor parallelism.
# </details>

# %% [markdown]
# ### More from the question bank
#
# Every interview question this lab answers, with the project's answer, key points and the code that backs it
# (the same bank `minillm quiz --lab lab01` rehearses in a terminal, with spaced repetition):

# %%
from minillm.quiz import show
show(lab="lab01")
