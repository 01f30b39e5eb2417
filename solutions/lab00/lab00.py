# ---
# jupyter:
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Lab 00 — Anatomy of inference: two phases, two bottlenecks
#
# **The question.** *"An LLM reads a 500-token prompt in a fraction of a second, then writes its answer one
# token at a time, far more slowly per token. Why? And what would make each phase faster: a GPU with more
# FLOP/s, or one with more memory bandwidth?"*
#
# Generation has two phases:
#
# * **prefill** — the whole prompt goes through the model in one forward pass (T tokens at once). Its latency
#   is the *time to first token* (TTFT).
# * **decode** — then one forward pass per new token, each reading the whole model to produce a single token.
#   Its latency per step is the *time per output token* (TPOT).
#
# **What you will measure.** Prefill tokens/s and decode ms/token of SmolLM2-135M on this machine, next to
# the *roofline bound* you compute from first principles: how many FLOPs and how many bytes each phase needs,
# and how fast this CPU can compute and move bytes.
#
# Run the cells in order. Answer cells say `raise NotImplementedError()` until you fill them in; the cell
# after each answer is a graded check (don't edit it) that prints nothing when you are right, and the
# smallest counter-example with a hint when you are not.

# %% nbgrader="readonly"
import math
import time

import torch

from minillm import plots
from minillm.bench.decode import measure_bandwidth, time_decode, time_prefill
from minillm.engine.llm_engine import LLMEngine
from minillm.loading.loader import load_model

loaded = load_model("default", "float32")      # SmolLM2-135M-Instruct, dequantized to float32
model, cfg = loaded.model, loaded.config
engine = LLMEngine.from_model(model, loaded.tokenizer)   # the engine the measurements run, one request at a time
print(cfg)
print(f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f} M parameters, "
      f"{model.weight_bytes() / 1e6:.0f} MB of float32 weights read per forward pass")

# %% [markdown]
# ## Where a forward pass spends its bytes
#
# Almost all of a decoder's work is matrix multiplication: each layer projects the hidden state to queries,
# keys and values (`qkv_proj`), mixes the attention output back (`o_proj`), and runs the MLP
# (`gate_up_proj`, `down_proj`); at the end the LM head maps the last hidden state to one logit per
# vocabulary entry (SmolLM2 ties it to the embedding table). The plot below is drawn from the loaded model's
# own parameters: how many bytes of weights each kind of matrix holds. **In decode, every one of those bytes
# is read from memory to produce one token** — about 2 FLOPs per weight (a multiply and an add), so only
# ~0.5 FLOP per byte in float32. A CPU core can do far more arithmetic than that per byte it loads: decode
# waits on memory.

# %%
groups: dict[str, int] = {}
for name, p in model.named_parameters():
    kind = name.split(".")[-2] if name.startswith("layers.") else name.split(".")[0]
    kind = {"embed_tokens": "embedding = LM head (tied)", "input_layernorm": "norms",
            "post_attention_layernorm": "norms", "norm": "norms"}.get(kind, kind)
    groups[kind] = groups.get(kind, 0) + p.numel() * p.element_size()
plots.weight_bytes(groups)

# %% [markdown]
# ## Task 1 — FLOPs and bytes of one linear layer (2 points)
#
# A linear layer computes `Y = X @ W.T` with `X` of shape `[num_tokens, d_in]` and `W` of shape
# `[d_out, d_in]` (PyTorch's `nn.Linear` layout). Write `linear_flops_bytes(num_tokens, d_in, d_out,
# dtype_bytes)` returning the pair `(flops, bytes)`:
#
# * **flops** — each output element is a dot product of length `d_in`: one multiply and one add per term.
# * **bytes** — the memory traffic at `dtype_bytes` bytes per element, assuming every tensor crosses the
#   memory bus exactly once: the weights are read once (whatever the number of tokens), the input
#   activations are read, the output activations are written.
#
# The ratio `flops / bytes` is the layer's **arithmetic intensity**. Try it on `num_tokens = 1` and
# `num_tokens = 512` after you pass: that ratio is the whole story of this lab.

# %% nbgrader="answer"
def linear_flops_bytes(num_tokens, d_in, d_out, dtype_bytes):
    """(FLOPs, bytes moved) of Y[num_tokens, d_out] = X[num_tokens, d_in] @ W[d_out, d_in].T."""
    ### BEGIN SOLUTION
    flops = 2 * num_tokens * d_in * d_out
    nbytes = dtype_bytes * (d_in * d_out + num_tokens * d_in + num_tokens * d_out)
    return flops, nbytes
    ### END SOLUTION


# %% nbgrader="graded" points=2
from minillm.grading.lab00 import check_lab00_1; check_lab00_1(linear_flops_bytes)

# %% [markdown]
# ## Task 2 — FLOPs and bytes of a whole forward pass (3 points)
#
# Now add up every matmul of one forward pass of a Llama-family model, as minillm runs it
# (`minillm/models/llama.py`). For a config `cfg` (attributes `hidden_size`, `intermediate_size`,
# `num_layers`, `num_heads`, `num_kv_heads`, `head_dim`, `vocab_size`) and `num_tokens` tokens:
#
# | matmul (per layer, `num_layers` times) | `d_in` | `d_out` |
# |---|---|---|
# | `qkv_proj` (fused Q, K, V) | `hidden_size` | `(num_heads + 2·num_kv_heads)·head_dim` |
# | `o_proj` | `num_heads·head_dim` | `hidden_size` |
# | `gate_up_proj` (fused gate and up) | `hidden_size` | `2·intermediate_size` |
# | `down_proj` | `intermediate_size` | `hidden_size` |
#
# plus the **LM head** (`hidden_size → vocab_size`), which runs only on `num_logits` tokens: the engine
# computes logits for the last prompt token in prefill (`num_logits = 1`) and for every sequence's token in
# decode. Count each matmul with Task 1's rule. Leave out the attention scores themselves (q·k and the
# weighted sum of v: small for short contexts; lab01 is about them), the norms and the embedding lookup.
#
# Write `model_flops_bytes(cfg, num_tokens, num_logits, dtype_bytes) -> (flops, bytes)`.

# %% nbgrader="answer"
def model_flops_bytes(cfg, num_tokens, num_logits, dtype_bytes):
    """(FLOPs, bytes) of all the matmuls of one forward pass over num_tokens tokens."""
    ### BEGIN SOLUTION
    h, i = cfg.hidden_size, cfg.intermediate_size
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    matmuls = [(num_tokens, h, q + 2 * kv), (num_tokens, q, h), (num_tokens, h, 2 * i), (num_tokens, i, h)]
    flops = nbytes = 0
    for t, d_in, d_out in matmuls * cfg.num_layers + [(num_logits, h, cfg.vocab_size)]:
        f, b = linear_flops_bytes(t, d_in, d_out, dtype_bytes)
        flops, nbytes = flops + f, nbytes + b
    return flops, nbytes
    ### END SOLUTION


# %% nbgrader="graded" points=3
from minillm.grading.lab00 import check_lab00_2; check_lab00_2(model_flops_bytes)

# %% [markdown]
# ## Task 3 — the roofline bound (2 points)
#
# A processor has two ceilings: it cannot do more than `peak_flops` FLOP/s, and it cannot move more than
# `bandwidth` bytes/s between memory and its cores. A piece of work with `flops` FLOPs and `nbytes` bytes
# therefore takes at least `flops / peak_flops` seconds *and* at least `nbytes / bandwidth` seconds. In the
# best case the two overlap perfectly.
#
# Write `roofline_time(flops, nbytes, peak_flops, bandwidth)` returning that lower bound in seconds.
#
# (The same idea drawn as the classic *roofline plot*: attainable FLOP/s = min(peak_flops, intensity ×
# bandwidth). Low-intensity work sits under the slanted memory roof, high-intensity work under the flat
# compute roof; they meet at the *ridge point* `peak_flops / bandwidth` FLOP/byte.)

# %% nbgrader="answer"
def roofline_time(flops, nbytes, peak_flops, bandwidth):
    """Least possible seconds for work of `flops` FLOPs moving `nbytes` bytes."""
    ### BEGIN SOLUTION
    return max(flops / peak_flops, nbytes / bandwidth)
    ### END SOLUTION


# %% nbgrader="graded" points=2
from minillm.grading.lab00 import check_lab00_3; check_lab00_3(roofline_time)

# %% [markdown]
# ## Plug in: your bound against the real engine
#
# Two numbers describe this machine: the memory bandwidth (a large tensor copy, `measure_bandwidth`) and the
# peak matmul FLOP/s (a large float32 matmul). With them, your functions predict the fastest possible
# decode step and prefill; the engine's `time_decode` / `time_prefill` measure the real ones on SmolLM2.

# %%
def measure_peak_flops(n=2048, repeats=3):
    """FLOP/s of the best of a few n×n float32 matmuls: the compute roof, as torch reaches it here."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b  # warm-up
    best = min(_timed(lambda: a @ b) for _ in range(repeats))
    return 2 * n**3 / best


def _timed(fn):
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


bandwidth = measure_bandwidth(nbytes=256 * 2**20, repeats=5)
peak_flops = measure_peak_flops()
print(f"threads {torch.get_num_threads()}: bandwidth {bandwidth / 1e9:.1f} GB/s, peak {peak_flops / 1e9:.0f} GFLOP/s, "
      f"ridge point {peak_flops / bandwidth:.1f} FLOP/byte")

decode_ms = time_decode(engine, steps=16)
f1, b1 = model_flops_bytes(cfg, 1, 1, 4)
bound_ms = 1000 * roofline_time(f1, b1, peak_flops, bandwidth)
print(f"decode: your bound {bound_ms:.1f} ms/token, measured {decode_ms:.1f} ms/token "
      f"({decode_ms / bound_ms:.2f}x the bound); intensity {f1 / b1:.2f} FLOP/byte")

# %% [markdown]
# The measured decode step should land within a small factor (typically 1–2×) of your bound, and the bound
# is set by *bytes*, not FLOPs: the memory time is far larger than the compute time at one token.

# %% [markdown]
# ## Measurement: prefill and decode on the roofline
#
# Prefill of T tokens is T tokens' worth of work for one read of the weights, so its intensity grows with T.
# Below, the engine prefills prompts of 16 to 256 tokens; each point is a real measurement placed at its
# intensity (from your Task 2 function) and its achieved FLOP/s. **Expected shape:** decode sits low on the
# slanted memory roof; prefill points climb it as T grows and flatten under the compute roof (this CPU
# reaches the compute roof at a few hundred tokens; a big GPU needs more, see the questions).

# %%
points = [("decode", 1, f1, b1, decode_ms / 1000)]
for T in (16, 64, 256):
    tok_s = time_prefill(engine, T, repeats=2)
    f, b = model_flops_bytes(cfg, T, 1, 4)
    points.append((f"prefill {T}", T, f, b, T / tok_s))

print(f"{'phase':<12} {'tokens':>6} {'GFLOP':>8} {'MB':>7} {'FLOP/B':>7} {'bound ms':>9} {'measured ms':>12} "
      f"{'tok/s':>8}")
for label, T, f, b, secs in points:
    bound = roofline_time(f, b, peak_flops, bandwidth)
    print(f"{label:<12} {T:>6} {f / 1e9:>8.2f} {b / 1e6:>7.0f} {f / b:>7.1f} {1000 * bound:>9.1f} "
          f"{1000 * secs:>12.1f} {T / secs:>8.0f}")

plots.roofline(points, peak_flops, bandwidth)

# %% [markdown]
# ## Interview questions
#
# <details><summary><b>What are the two phases of LLM inference, and how do they differ?</b></summary>
#
# **Prefill** runs the whole prompt through the model in one forward pass: all T prompt tokens are processed
# in parallel, the K and V of every prompt token are stored in the KV cache, and the logits of the last
# token give the first output token. **Decode** then generates one token per forward pass, each step
# attending to the cached K/V of everything before it. Prefill does T tokens of work per read of the weights
# (matrix–matrix products), decode does one (matrix–vector products). So prefill is judged by time to first
# token and grows with prompt length; decode is judged by time per output token and stays nearly flat per
# step. In this lab SmolLM2 prefills hundreds of tokens per second on two CPU cores but decodes only a few
# dozen.
# </details>
#
# <details><summary><b>Why is decode memory-bandwidth-bound and prefill compute-bound?</b></summary>
#
# Arithmetic intensity: a linear layer does 2 FLOPs per weight per token and reads each weight once per
# forward pass. With one token (decode, batch 1) that is ~1 FLOP per byte in bf16 (0.5 in fp32), while an
# H100 offers ~990 TFLOP/s dense bf16 against 3.35 TB/s of HBM: it needs ~300 FLOP per byte to keep its cores
# busy. So a decode step takes (weight bytes + KV bytes) / bandwidth — a 7B model in bf16 (14 GB) needs at
# least ~4 ms per step on an H100 — and the cores idle. Prefill multiplies the same weights by T tokens, so its
# intensity grows ~T-fold and above the ridge point (a few hundred tokens) the FLOPs dominate. Batching many
# sequences' decode steps together is what raises decode's intensity in a server.
# </details>
#
# <details><summary><b>What are TTFT, TPOT and TPS, and what drives each?</b></summary>
#
# **TTFT** (time to first token) = queueing + prefill of the prompt (+ the first decode step's sampling); it
# grows with prompt length and with waiting behind other requests. **TPOT** (time per output token, also
# inter-token latency) = the time of one decode step, set mostly by bytes read per step (weights + this
# sequence's KV) over bandwidth, and by how many sequences share the step. **TPS** (tokens per second) is
# throughput: per user it is ~1 / TPOT; per server it is the sum over all concurrent sequences, which batching
# raises while each user's TPOT grows slightly. End-to-end latency ≈ TTFT + TPOT × (output tokens − 1). Chat
# needs low TTFT and TPOT under ~50–100 ms (faster than reading speed); offline batch jobs care about TPS.
# </details>
#
# <details><summary><b>How would you choose hardware for serving a given model?</b></summary>
#
# First, capacity: weights + KV cache for the target concurrency and context must fit (e.g. a 70B model in
# bf16 is 140 GB: two 80 GB GPUs, or one with int4 weights). Then the workload's phase mix: decode-heavy
# traffic (long answers, small batches) is bound by memory bandwidth, so compare TB/s per dollar — an H100's
# 3.35 TB/s vs an A100's 2.0 TB/s is about the decode speedup you'll get at batch 1. Prefill-heavy traffic
# (RAG with long prompts, large batches) is bound by FLOP/s, where H100's ~3× the A100's bf16 throughput pays
# off. Finally interconnect: a model sharded with tensor parallelism needs NVLink-class bandwidth. A roofline
# calculation like this lab's tells you which ceiling you will hit before you buy anything.
# </details>
#
# <details><summary><b>What does a longer context window cost?</b></summary>
#
# Memory: the KV cache grows linearly with context — Llama-3-8B keeps 128 KiB per token in bf16, so one
# 128k-token sequence holds 16 GiB of KV, as much as the weights themselves. Decode time: every step reads the whole
# KV cache of its sequence, so time per token grows linearly with context once KV bytes rival weight bytes.
# Prefill compute: attention scores are quadratic in prompt length (the matmuls of this lab are linear), so
# very long prompts spend most of their FLOPs in attention and TTFT grows faster than linearly. And
# concurrency: a fixed KV budget divided by longer sequences means fewer of them in a batch, so throughput per
# GPU drops. Lab01 turns these into formulas.
# </details>

# %% [markdown]
# ### More from the question bank
#
# Every interview question this lab answers, with the project's answer, key points and the code that backs it
# (the same bank `minillm quiz --lab lab00` rehearses in a terminal, with spaced repetition):

# %%
from minillm.quiz import show
show(lab="lab00")
