# ---
# jupyter:
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Lab 08 — Quantization
#
# **The question.** *"Decoding one token reads every weight of the model once. Store each weight in 8 or 4 bits
# instead of 32 and there is 4–8× less to read — how do you choose those few bits, what do they cost in quality,
# and does the model really get faster?"*
#
# In lab00 you measured that batch-1 decode is bound by memory bandwidth: time per token ≈ weight bytes ÷ bandwidth.
# **Weight-only quantization** attacks the numerator. Each weight matrix is stored as small integers (**codes**)
# plus a few float16 numbers per row or per group of inputs that map the codes back to real values; the matmul
# kernel rebuilds the weights on the fly, next to the arithmetic, so fewer bytes cross the memory bus. Activations
# stay in float. The two formats every engine ships:
#
# * **int8, symmetric, per output channel**: `w ≈ scale[n] · q`, `q ∈ [-127, 127]`, one scale per row `n`;
# * **int4, asymmetric, group-wise** (GGUF's Q4_1, AWQ/GPTQ's layout): `w ≈ scale[n, g] · q + min[n, g]`,
#   `q ∈ 0..15`, one scale and one minimum per group `g` of 32–128 consecutive inputs, two codes per byte.
#
# **What you will build.** Both quantizers, the dequantization, and a quantized linear layer. Then you plug your
# quantizer into SmolLM2 through the engine's `Quantizer` seam — `model.quantize_(..., quantizer=my_quantizer)` —
# and minillm's own C kernels run *your* codes.
#
# **What you will measure.** Bytes of weights per token, decode milliseconds per token, and perplexity on held-out
# text, for float32, int8, int4 in groups of 32 and int4 in coarse groups of 192: memory against quality.
#
# Answer cells say `raise NotImplementedError()` until you fill them in; the graded cell after each one (don't edit
# it) prints nothing when you are right, and the smallest counter-example with a hint when not.

# %% nbgrader="readonly"
import copy
import time

import torch
import torch.nn.functional as F

from minillm import plots
from minillm.bench.decode import time_decode
from minillm.bench.quality import eval_windows, sequence_logits
from minillm.engine.llm_engine import LLMEngine
from minillm.loading.loader import load_model
from minillm.quant.formats import QuantizedWeight, QuantSpec, pack_int4, quantize

torch.manual_seed(0)
loaded = load_model("default", "float32")          # SmolLM2-135M, every weight dequantized to float32
model, tok = loaded.model, loaded.tokenizer
layers = dict(model.quantizable())                 # name -> layer; each has .weight [out_features, in_features]
# The cells below quantize copies of `model` (copy.deepcopy(model)) and run those; `model` itself never runs, so it
# stays a plain float32 model that copies well (a model that has run caches a packed LM head that cannot be copied).
print(f"{len(layers)} weight matrices, {model.weight_bytes() / 1e6:.0f} MB of float32 weights read per token")

# %% [markdown]
# ## What a group of weights looks like
#
# Below: two groups of 32 weights (dots), the 16 values an int4 group can represent (lines), as minillm's own
# round-to-nearest quantizer places them: evenly spaced from the group's minimum to its maximum, and where the
# round trip puts each weight (crosses; the red bar is its error). Every weight is replaced by the nearest line.
# Left, a typical group; right, the group with the largest outlier: the outlier stretches the range, and every
# other weight of the group pays for it with coarser steps — which is why groups are small, and why an
# outlier-heavy row is where a per-row (int8) or per-tensor scale hurts most.
#
# Why the embedding's weights? SmolLM2's default checkpoint stores its linear layers in GGUF's Q4_1 (int4, groups
# of 32, a scale and a minimum each): the "float32" weights you loaded are their dequantization, so every weight
# of a linear layer already sits on its group's int4 grid and requantizing it to int4 g32 is exact (the last line
# below prints that error: 0). The token embedding is stored in Q8_0 (8 bits, 256 levels per group), so its
# weights show what int4 really does to weights it was not made from. The same reason keeps int4 g32 close to
# float32 in the measurement at the end of this lab; coarser groups are where the loss shows there.

# %%
emb = model.embed_tokens.weight.detach()          # stored as Q8_0 in the checkpoint: a finer grid than int4's
per_row = emb.shape[1] // 32
groups = emb.reshape(-1, 32)                      # every row's groups of 32 consecutive inputs, row after row
outlier = groups.abs().amax(1) / groups.std(1)    # how far a group's largest weight sits from the rest
panels = {}
for name, g in (("a typical group", int(outlier.argsort()[len(outlier) // 2])),
                ("the group with the largest outlier", int(outlier.argmax()))):
    group = groups[g]
    q4 = quantize(group[None], QuantSpec("int4", 32))
    levels = q4.mins[0, 0].float() + q4.scales[0, 0].float() * torch.arange(16)
    row, col = divmod(g, per_row)
    panels[f"embedding row {row}, inputs {32 * col}–{32 * col + 31}: {name}"] = (group, levels, q4.dequantize()[0])
    err = (q4.dequantize()[0] - group).abs()
    print(f"{name}: min {group.min():.4f}, max {group.max():.4f}, step {q4.scales[0, 0].float():.5f}; largest "
          f"round-trip error {err.max():.5f} (at most half a step), mean {err.mean():.5f}")
plots.int4_round_trip(panels)
w = layers["layers.0.mlp.gate_up_proj"].weight.detach()          # stored as Q4_1: already on an int4 g32 grid
print(f"layer 0's gate/up projection, all of it through int4 g32: largest round-trip error "
      f"{(quantize(w, QuantSpec('int4', 32)).dequantize() - w).abs().max():.5f}")

# %% [markdown]
# ## The format: `QuantizedWeight`
#
# Everything you return is a `minillm.quant.formats.QuantizedWeight(kind, qweight, scales, mins, group_size)`, the
# object the engine's kernels read, for a matrix `w` of shape `[N, K]` (N output rows, K inputs):
#
# | field | int8 | int4 |
# |---|---|---|
# | `kind` | `"int8"` | `"int4"` |
# | `qweight` | `int8 [N, K]`, codes in `[-127, 127]` | `uint8 [N, K/2]`, two codes in `0..15` per byte |
# | `scales` | `float16 [N, K/G]` | `float16 [N, K/G]` |
# | `mins` | `None` | `float16 [N, K/G]` |
# | `group_size` | `G` (`K` for per-channel) | `G` |
#
# Column `k` of row `n` belongs to group `k // G`, so `w[n, k] ≈ scales[n, k // G] · q[n, k]` (`+ mins[n, k // G]`).
#
# **Scales are float16**, like GGUF's: half the bytes of float32. Round each scale (and minimum) to float16
# *before* you divide by it, so that the codes are chosen against the scale dequantization will actually use.

# %% [markdown]
# ## Task 1 — int8, per output channel (2 points)
#
# Write `quantize_int8(w) -> QuantizedWeight` for a float32 `w` of shape `[N, K]`:
#
# * one scale per row: `scale[n] = max_k |w[n, k]| / 127`, rounded to float16, stored as `scales` of shape `[N, 1]`;
# * `q[n, k] = round(w[n, k] / scale[n])` to the **nearest** integer, kept in `[-127, 127]`, stored as int8;
#   a row of zeros has scale 0: give it codes 0 (don't divide by zero);
# * return `QuantizedWeight("int8", q, scales, None, K)`; don't modify `w`.
#
# Why 127 and not 128: the range stays symmetric, so `-w` quantizes to `-q`.

# %% nbgrader="answer"
def quantize_int8(w):
    """Symmetric int8 with one float16 scale per output row: w ≈ scales[n] * q[n, k]."""
    ### BEGIN SOLUTION
    n, k = w.shape
    scales = (w.abs().amax(dim=1, keepdim=True) / 127).to(torch.float16)
    divide_by = scales.float()
    divide_by[divide_by == 0] = 1.0                 # an all-zero row: codes 0, whatever the scale
    q = torch.round(w / divide_by).clamp(-127, 127).to(torch.int8)
    return QuantizedWeight("int8", q, scales, None, k)
    ### END SOLUTION


# %% [markdown]
# <details><summary>Hint: the order of the steps</summary>
#
# Statistics first (a max over the input dimension, one per row), then the scale in float16, then the division
# by that float16 scale (as float32), then rounding, then the range, then the cast. The cast to int8 itself
# truncates toward zero and wraps around outside [-128, 127]: it must come last.
# </details>

# %% nbgrader="graded" points=2
from minillm.grading.lab08 import check_lab08_1; check_lab08_1(quantize_int8)

# %% [markdown]
# ## Task 2 — int4, asymmetric, in groups (3 points)
#
# Write `quantize_int4(w, group_size) -> QuantizedWeight` for a float32 `w` of shape `[N, K]`:
#
# * if `group_size` does not divide `K`, raise `ValueError` with a message that says so (`group_size` is a multiple
#   of 32);
# * for each row `n` and group `g` (columns `g·G … g·G + G − 1`): `mins[n, g]` = the group's minimum and
#   `scales[n, g] = (max − min) / 15`, both rounded to float16;
# * `q = round((w − min) / scale)` to the nearest integer, kept in `0..15` (a group whose values are all equal has
#   scale 0: give it codes 0);
# * pack two codes per byte the way GGUF does: in every block of 32 consecutive codes of a row, byte `j` holds code
#   `j` in its low 4 bits and code `j + 16` in its high 4 bits. `minillm.quant.formats.pack_int4(q)` (imported
#   above) does exactly that for a `[N, K]` tensor of codes, if you'd rather not write it yourself;
# * return `QuantizedWeight("int4", packed, scales, mins, group_size)`.
#
# Why asymmetric: a group whose weights are not centred on zero (say all in `[-0.1, 0.3]`) would waste most of a
# symmetric grid on values it never has; with a minimum, all 16 levels cover `[min, max]`.

# %% nbgrader="answer"
def quantize_int4(w, group_size):
    """Asymmetric int4 per group of `group_size` inputs: w ≈ scales[n, g] * q + mins[n, g], q packed two per byte."""
    ### BEGIN SOLUTION
    n, k = w.shape
    if k % group_size != 0:
        raise ValueError(f"group size {group_size} does not divide the {k} columns of the matrix")
    groups = w.reshape(n, k // group_size, group_size)
    lo, hi = groups.amin(dim=-1), groups.amax(dim=-1)
    mins = lo.to(torch.float16)
    scales = ((hi - lo) / 15).to(torch.float16)
    divide_by = scales.float()
    divide_by[divide_by == 0] = 1.0                 # a constant group: codes 0
    q = torch.round((groups - mins.float()[..., None]) / divide_by[..., None]).clamp(0, 15)
    return QuantizedWeight("int4", pack_int4(q.reshape(n, k).to(torch.uint8)), scales, mins, group_size)
    ### END SOLUTION


# %% [markdown]
# <details><summary>Hint: groups as a dimension</summary>
#
# `w.reshape(N, K // G, G)` makes the groups a dimension of their own: a min or max over the last dimension gives
# one value per (row, group), shape `[N, K // G]`, and `[..., None]` broadcasts it back over the group.
# </details>
#
# <details><summary>Hint: when is the clamp needed?</summary>
#
# The float16 minimum can round to slightly *above* the true minimum (weights far from zero), which makes
# `(w − min) / scale` slightly negative for the smallest weight: -1 would become 255 in uint8.
# </details>

# %% nbgrader="graded" points=3
from minillm.grading.lab08 import check_lab08_2; check_lab08_2(quantize_int4)

# %% [markdown]
# ## Task 3 — back to floats (2 points)
#
# Write `dequantize(qw) -> torch.Tensor`: the float32 `[N, K]` matrix a `QuantizedWeight` of either kind stands for,
# `w[n, k] = scales[n, k // G] · q[n, k]` (`+ mins[n, k // G]` for int4), unpacking the int4 codes in the order of
# Task 2. (`qw.shape` is `(N, K)`.) Don't use minillm's own `qw.dequantize()`: this is it.

# %% nbgrader="answer"
def dequantize(qw):
    """The float32 [N, K] matrix of a QuantizedWeight (int8 or int4)."""
    ### BEGIN SOLUTION
    n, k = qw.shape
    if qw.kind == "int4":
        blocks = qw.qweight.reshape(n, k // 32, 16)
        codes = torch.cat([blocks & 0x0F, blocks >> 4], dim=-1).reshape(n, k)   # low nibbles j, then high j + 16
    else:
        codes = qw.qweight
    group = torch.arange(k) // qw.group_size            # the group of every column
    w = codes.float() * qw.scales.float()[:, group]
    if qw.mins is not None:
        w = w + qw.mins.float()[:, group]
    return w
    ### END SOLUTION


# %% nbgrader="graded" points=2
from minillm.grading.lab08 import check_lab08_3; check_lab08_3(dequantize)

# %% [markdown]
# ## Task 4 — a quantized linear layer (1 point)
#
# Write `qlinear(x, qw) -> torch.Tensor`: what a linear layer with quantized weights computes, `x · Wᵀ` with
# `W = dequantize(qw)`, for `x` of shape `[..., K]` in float32 or bfloat16; the result has shape `[..., N]` and
# `x`'s dtype.
#
# This is the *reference* semantics of weight-only quantization. A fast kernel never builds `W`: minillm's C kernel
# reads the packed codes, multiplies them with the activations block by block, and applies each group's scale (and
# minimum, through the sum of the block's activations) once per block — which is where the bandwidth saving
# comes from.

# %% nbgrader="answer"
def qlinear(x, qw):
    """x [..., K] times the dequantized [N, K] matrix, transposed -> [..., N] in x's dtype."""
    ### BEGIN SOLUTION
    return F.linear(x, dequantize(qw).to(x.dtype))
    ### END SOLUTION


# %% nbgrader="graded" points=1
from minillm.grading.lab08 import check_lab08_4; check_lab08_4(qlinear)

# %% [markdown]
# ## Your quantizer inside SmolLM2
#
# The engine quantizes a loaded model in place with `model.quantize_(linear_spec, head_spec, quantizer=fn)`: every
# linear layer of the decoder blocks to `linear_spec`, the embedding / LM head (tied in SmolLM2) to `head_spec`, each
# by calling `fn(weight, spec)` — the engine's `Quantizer` seam. After that, every forward pass runs minillm's C
# kernel on *your* codes. One adapter turns your two functions into that seam:

# %%
def my_quantizer(weight, spec):
    """interfaces.Quantizer: float weight [N, K] + QuantSpec -> QuantizedWeight, with your functions."""
    if spec.kind == "int8":
        return quantize_int8(weight.detach().float())
    return quantize_int4(weight.detach().float(), spec.group_size)


# %% [markdown]
# SmolLM2's matrices have 576 or 1536 inputs. Groups of 128 do not divide 576 — your `quantize_int4` says so — so the
# coarse setting below uses groups of 192 (576 = 3 · 192, 1536 = 8 · 192).

# %%
try:
    my_quantizer(layers["layers.0.self_attn.o_proj"].weight, QuantSpec("int4", 128))
except ValueError as e:
    print("ValueError:", e)

# %% [markdown]
# First, does your quantizer give the model minillm's own round-to-nearest would? Both quantize a copy of SmolLM2 to
# int4 in groups of 32 (the LM head to int8); the logits of one sentence should agree to a fraction of a unit, and
# the greedy next tokens should be the same.

# %%
prompt = tok.encode("The capital of France is Paris, and the capital of Italy is")
mine = copy.deepcopy(model).quantize_(QuantSpec("int4", 32), QuantSpec("int8"), quantizer=my_quantizer)
theirs = copy.deepcopy(model).quantize_(QuantSpec("int4", 32), QuantSpec("int8"))
float_copy = copy.deepcopy(model)
with torch.no_grad():
    a, b, ref = sequence_logits(mine, prompt), sequence_logits(theirs, prompt), sequence_logits(float_copy, prompt)
print(f"largest logit difference, yours vs minillm's int4: {(a - b).abs().max():.4f}; vs float32: "
      f"{(a - ref).abs().max():.3f}")
print(f"greedy next tokens agree with minillm's int4 at {(a.argmax(-1) == b.argmax(-1)).float().mean():.0%} of the "
      f"positions, with float32 at {(a.argmax(-1) == ref.argmax(-1)).float().mean():.0%}")
print("next word, int4 (yours):", repr(tok.decode([int(a[-1].argmax())])))
del mine, theirs, float_copy

# %% [markdown]
# ## Measure: memory, speed, quality
#
# For each format: the weight bytes one decode step reads, decode milliseconds per token (one request, a few steps
# through the engine), and perplexity on two held-out windows of 128 tokens of `pydoc_data.topics` (the text
# `minillm bench quality` uses; lower is better, teacher-forced, every position scored). Eight decode steps on a
# shared CPU are noisy (other work on the machine can double a row): read the speed column for its trend, and
# `minillm bench decode --quantization none int8 int4` for numbers you would quote.

# %%
windows = eval_windows(tok, 2, 128)


def perplexity(m):
    nll, count = 0.0, 0
    with torch.no_grad():
        for ids in windows:
            logits = sequence_logits(m, ids)[:-1].float()
            nll += float(F.cross_entropy(logits, torch.tensor(ids[1:]), reduction="sum"))
            count += len(ids) - 1
    return float(torch.exp(torch.tensor(nll / count)))


def measure(name, linear_spec, head_spec):
    m = copy.deepcopy(model)
    if linear_spec is not None:
        m.quantize_(linear_spec, head_spec, quantizer=my_quantizer)
    engine = LLMEngine.from_model(m, tok, num_blocks=64)
    ms = time_decode(engine, steps=8)
    return dict(name=name, mb=m.weight_bytes() / 1e6, ms=ms, ppl=perplexity(m))


t0 = time.perf_counter()
rows = [measure("float32", None, None),
        measure("int8", QuantSpec("int8"), QuantSpec("int8")),
        measure("int4 g32", QuantSpec("int4", 32), QuantSpec("int8")),
        measure("int4 g192", QuantSpec("int4", 192), QuantSpec("int8"))]
base = rows[0]
print(f"{'format':10s} {'MB/token':>9s} {'B/weight':>9s} {'ms/token':>9s} {'perplexity':>11s} {'vs float32':>10s}")
for r in rows:
    r["bpw"] = 4 * r["mb"] / base["mb"]            # float32 reads 4 bytes per weight
    print(f"{r['name']:10s} {r['mb']:9.1f} {r['bpw']:9.2f} {r['ms']:9.1f} {r['ppl']:11.3f} "
          f"{100 * (r['ppl'] / base['ppl'] - 1):+9.2f}%")
print(f"({time.perf_counter() - t0:.0f} s)")

plots.quant_tradeoffs(rows)

# %% [markdown]
# **What to expect.** Bytes per weight fall from 4 to a little over 1 (int8: one code plus one float16 scale per
# row) and to about 0.6 (int4 g32: half a byte plus 4 bytes of scale and minimum per 32 weights; g192 is closer
# to 0.5). The LM head, kept int8, is a large share of what remains: SmolLM2's 49152 × 576 embedding is 28 M of its
# 135 M weights. Decode time follows the bytes, not in exact proportion (the kernel's work per weight and the
# non-matmul parts of a step do not shrink). Perplexity: int8 is within a fraction of a percent of float32; int4
# g32 costs little — SmolLM2's default checkpoint was *already* stored as Q4_1 (int4 in groups of 32), so
# requantizing lands on almost the same grid; the coarse g192 groups cost visibly more, because one outlier now
# sets the step for 192 weights. That loss is what calibration-based methods (GPTQ, AWQ) recover.

# %% [markdown]
# ## Interview questions
#
# <details><summary><b>Why does weight-only int4 speed up batch-1 decode, but not prefill?</b></summary>
#
# Decode at batch 1 reads every weight once per token and does two flops per weight: it is bound by memory
# bandwidth, so 8× fewer weight bytes (int4 vs float32) is up to 8× less time. Prefill multiplies each weight with
# hundreds of tokens at once: it is bound by compute, and the weights must still be dequantized to float (or the
# activations quantized) before the multiply — so fewer bytes buy prefill nothing. What can speed it up is cheaper
# arithmetic: from 3 rows on minillm runs a 16-bit integer GEMM (13-bit weight and activation codes per 64 inputs;
# `vpmaddwd` does 16 multiply-adds per instruction, twice a float32 FMA's — though a Zen 3 core issues it half as
# often, so there the gain is a kernel that runs closer to the peak than MKL's), at ~1e-4 of each output's size;
# `minillm bench decode --quantization auto none` measures the ratio on your machine.
# </details>
#
# <details><summary><b>Why per-channel or per-group scales, not one per tensor?</b></summary>
#
# The step is set by the largest magnitude the scale covers. Rows (output channels) of a weight matrix differ in
# size by 10× or more, and a few outliers are much larger still: with one scale per tensor, small rows get only a
# handful of the 255 levels. Per-channel scales cost one float16 per row; per-group scales (32–128 inputs) cost
# 0.5–0.125 bytes per weight more at int4 but keep the damage of an outlier inside its group.
# </details>
#
# <details><summary><b>Symmetric or asymmetric?</b></summary>
#
# Symmetric (`w = s·q`) needs no zero point and keeps the integer dot product simple, and weights of a whole row
# are roughly centred on zero: the usual choice for int8. At 4 bits each level matters, and a group of 32 weights
# is rarely centred: an asymmetric grid (`w = s·q + min`) spends all 16 levels on `[min, max]`. The minimum costs
# one sum of activations per block in the kernel (`Σ min·x = min·Σx`).
# </details>

# %% [markdown]
# ### More from the question bank
#
# Every interview question this lab answers, with the project's answer, key points and the code that backs it
# (the same bank `minillm quiz --lab lab08` rehearses in a terminal, with spaced repetition):

# %%
from minillm.quiz import show
show(lab="lab08")
