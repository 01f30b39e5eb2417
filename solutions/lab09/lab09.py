# ---
# jupyter:
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Lab 09 — Tensor parallelism
#
# **The question.** *"The model does not fit on one GPU — or it fits, but one GPU decodes it too slowly. How do you
# serve one model from several GPUs? What exactly is cut, where does it go back together, and what has to travel
# between the GPUs at every layer?"*
#
# There are two ways to spread one model over N GPUs. **Pipeline parallelism** gives each GPU a contiguous slice of
# the layers: the hidden state of a token walks from GPU to GPU. **Tensor parallelism** gives each GPU a slice of
# *every* weight matrix: all N GPUs work on every layer of every token at once. Decoding is bound by reading
# weights (lab00), so when each GPU reads only 1/N of every matrix, a decode step can get close to N times faster —
# provided the GPUs can combine their partial results quickly. The recipe every serving engine uses comes from
# Megatron-LM: cut each pair of matrices so that a layer needs **one all-reduce** to put its output back together,
# two per transformer layer, and nothing else. Weights never move.
#
# **What you will build.** The four rules that say where minillm cuts a model and how it puts it back together —
# the `TensorParallelRules` seam of `minillm.interfaces`, which every tensor-parallel linear layer asks:
# which rows of a column-parallel matrix a rank keeps (including the grouped KV heads), which input columns of a
# row-parallel matrix, what a column-parallel layer computes (and sends: nothing), what a row-parallel layer
# computes (one all-reduce). Then `LLM("default", tensor_parallel_size=3, tp_rules=MyRules())` runs SmolLM2 cut
# three ways by your rules, and must produce the same greedy tokens as a single rank.
#
# **What you will measure.** How many bytes a rank hands to its collectives per token, counted by minillm's
# communicator, against the formula you write; and what tensor parallelism costs in communication next to pipeline
# parallelism, for models from SmolLM2 to Llama-3.1-405B.
#
# Answer cells say `raise NotImplementedError()` until you fill them in; the graded cell after each one (don't edit
# it) prints nothing when you are right, and the smallest counter-example with a hint when not.

# %% nbgrader="readonly"
import os

os.environ.setdefault("TRITON_INTERPRET", "1")   # before anything imports minillm.kernels

import time

import torch

from minillm import LLM, SamplingParams, plots
from minillm.worker.model_runner import ModelRunner, StepInputs
from minillm.kv.cache import KVCache
from minillm.layers.attention import get_attention_backend
from minillm.loading.loader import build_model
from minillm.distributed.comm import run_on_ranks
from minillm.loading.export import hf_state
from minillm.testing import random_model

# A tiny random Llama for quick experiments: 8 query heads, 2 KV heads (grouped-query attention), head_dim 8.
full = random_model(0, heads=8, kv_heads=2, head_dim=8, layers=4, vocab=256, tie=True)
cfg = full.cfg
print(f"tiny model: hidden {cfg.hidden_size}, {cfg.num_heads} query heads, {cfg.num_kv_heads} KV heads of "
      f"{cfg.head_dim}, MLP {cfg.intermediate_size}, {cfg.num_layers} layers")

# %% [markdown]
# ## Two ways to cut a matrix
#
# A linear layer computes `y = x · Wᵀ`, with `W` of shape `[out_features, in_features]`. Cut `W` by its **rows**
# (output features) and each rank computes some columns of `y` from the whole `x`: a **column-parallel** layer (the
# name counts columns of `y`, or of `Wᵀ`). Cut `W` by its **columns** (input features) and each rank, holding
# only the matching columns of `x`, computes `x_r · W_rᵀ`: a full-size `y` that is only a *partial sum*; adding
# the ranks' partial sums gives `y`. That is a **row-parallel** layer, and the addition is an **all-reduce**.
#
# Put the two back to back and the split output of the first is exactly the split input of the second — no
# communication in between. A transformer layer is two such pairs:
#
# ```
#                every rank: the whole x [tokens, hidden]
#   attention:  qkv_proj (column: my query heads, and the KV heads they read) → attention over my heads
#               → o_proj (row: my heads' columns) → ALL-REDUCE → + x
#   MLP:        gate_up_proj (column: my columns of gate AND of up) → silu(gate) · up, on my columns
#               → down_proj (row: my columns) → ALL-REDUCE → + x
# ```
#
# Everything between a column layer and its row layer is local: attention needs only a head's own q, k and v, and
# `silu(gate) · up` is element by element. Norms and residuals run on the whole hidden vector, which every rank has
# again after each all-reduce. So: **two all-reduces of a `[tokens, hidden]` tensor per layer**.
#
# **Grouped-query attention** adds a wrinkle. SmolLM2 has 9 query heads but only 3 KV heads; query head `h` reads KV
# head `h // 3`. Split the query heads in contiguous blocks and every rank must hold the KV heads its own query
# heads read. With more ranks than KV heads (8 query heads, 2 KV heads, 4 ranks), a KV head is **replicated** on
# the ranks that need it: production engines do exactly this (each copy also keeps its own copy of that head's KV
# cache).
#
# **The picture, from the real engine.** minillm's own rules shard the tiny model over 2 and over 4 ranks (each rank
# a thread, see Task 3); the grid shows which heads each rank's `qkv_proj` actually loaded, read off the sharded
# layers (`part_rows`: the rows of q, k and v it holds).

# %%
def on_ranks(world, fn):
    """Run fn(comm) on `world` ranks at once — one thread per rank, each with its own Communicator (real gloo over
    loopback TCP) — and return the results in rank order (minillm.distributed.comm.run_on_ranks)."""
    return run_on_ranks(world, fn)


def held_heads(world, rules=None):
    """For each rank: the query heads and KV heads its first layer's qkv_proj holds."""
    def build(comm):
        rank_model = build_model(cfg, hf_state(full), torch.float32, comm, None, rules)
        rows = rank_model.layers[0].self_attn.qkv_proj.part_rows
        d = cfg.head_dim
        return ([h for h in range(cfg.num_heads) if h * d in rows["q"]],
                [g for g in range(cfg.num_kv_heads) if g * d in rows["k"]])
    return on_ranks(world, build)


heads = {world: held_heads(world) for world in (2, 4)}
for world, held in heads.items():
    for rank, (q, kv) in enumerate(held):
        print(f"TP={world} rank {rank}: query heads {q}, KV heads {kv}")
plots.heads_per_rank(heads, cfg.num_heads, cfg.num_kv_heads)

# %% [markdown]
# At TP=2 each rank holds four query heads and the one KV head they share. At TP=4 each rank holds two query heads,
# and each KV head appears **twice**, on the two consecutive ranks whose query heads read it: rank 1 holds `kv0`
# because its heads `q2`, `q3` read it — not `kv1`, as dealing the KV heads out round-robin would give. This is the
# layout your rules must reproduce.

# %% [markdown]
# ## Task 1 — the rows of a column-parallel matrix (2 points)
#
# Every column-parallel matrix of minillm is made of **units**: `q_proj` is `num_heads` units of `head_dim` rows
# (one query head each), `k_proj` and `v_proj` are `num_kv_heads` units of `head_dim` rows, and `gate_proj` and
# `up_proj` are `intermediate_size` units of one row (one MLP column each). The engine asks your rule once per part
# and per rank (so a fused gate/up holds its slice of gate *and* its slice of up).
#
# Write `column_rows(num_units, unit_size, rank, world_size) -> range`, the rows of the part that `rank` keeps:
#
# * when the units split evenly (`num_units % world_size == 0`): rank `r` keeps the `r`-th of `world_size` equal
#   contiguous blocks of whole units, rank 0 the first;
# * when there are fewer units than ranks and they replicate evenly (`world_size % num_units == 0`): each unit is
#   kept by `world_size // num_units` **consecutive** ranks, unit 0 by the first of them — the ranks whose query
#   heads read it;
# * otherwise the part cannot be sharded: raise `ValueError`, with a message that says why;
# * return a plain `range` of row indices (step 1): the engine slices the checkpoint tensor with it.
#
# For example, `column_rows(8, 16, 1, 2)` is `range(64, 128)` (query heads 4–7), and `column_rows(2, 16, 1, 4)` is
# `range(0, 16)` (KV head 0, which rank 1's query heads 2 and 3 read).

# %% [markdown]
# <details><summary>Hint: work in units, then convert</summary>
#
# First decide which units the rank keeps (a first unit and how many), then multiply by `unit_size` to get rows.
# In the even case each rank gets `num_units // world_size` units. In the replicated case every unit is shared by a
# group of `world_size // num_units` ranks: which group is rank `r` in?
# </details>
#
# <details><summary>Hint: the replicated case</summary>
#
# With 2 KV heads and 4 ranks, the groups are ranks {0, 1} and {2, 3}: rank `r` keeps unit `r // 2`, that is
# `rank // (world_size // num_units)`. `rank % num_units` gives rank 1 the wrong head.
# </details>

# %% nbgrader="answer"
def column_rows(num_units, unit_size, rank, world_size):
    """The rows of one column-parallel part (num_units units of unit_size rows) that `rank` keeps."""
    ### BEGIN SOLUTION
    if num_units % world_size == 0:                  # a block of whole units per rank
        count = num_units // world_size
        first = rank * count
    elif world_size % num_units == 0:                # fewer units than ranks: each on a group of consecutive ranks
        count = 1
        first = rank // (world_size // num_units)
    else:
        raise ValueError(f"{num_units} units cannot be sharded over {world_size} ranks: the world size must "
                         f"divide the number of units, or the number of units the world size")
    return range(first * unit_size, (first + count) * unit_size)
    ### END SOLUTION


# %% nbgrader="graded" points=2
from minillm.grading.lab09 import check_lab09_1; check_lab09_1(column_rows)

# %% [markdown]
# Your rule on SmolLM2's shapes (9 query heads and 3 KV heads of 64 rows, MLP parts of 1536 columns), for the first
# three ranks. TP=3 splits everything evenly. TP=9 would give each rank one query head and replicate each KV head
# on three ranks, but 1536 MLP columns do not split nine ways; TP=2 does not even split the query heads. So
# SmolLM2 runs at TP=1 or 3 only, and `LLM(..., tensor_parallel_size=2)` says so before loading anything.

# %%
for world in (3, 9, 2):
    print(f"TP={world}:")
    for name, n, size in (("q_proj", 9, 64), ("k_proj", 3, 64), ("gate_proj", 1536, 1)):
        try:
            held = [column_rows(n, size, rank, world) for rank in range(min(world, 3))]
            print(f"  {name:9s} " + "; ".join(f"rank {rank}: rows {r.start}..{r.stop - 1}"
                                            for rank, r in enumerate(held)))
        except ValueError as e:
            print(f"  {name:9s} ValueError: {e}")


# %% [markdown]
# ## Task 2 — the input columns of a row-parallel matrix (1 point)
#
# `o_proj` and `down_proj` are row-parallel: their **input** arrives split. The input of `o_proj` on rank `r` is
# the attention output of rank `r`'s query heads, concatenated in head order; the input of `down_proj` is
# `silu(gate) · up` on rank `r`'s MLP columns. So the columns of the weight a rank keeps must be exactly those: the
# `r`-th of `world_size` equal contiguous blocks.
#
# Write `row_cols(input_size, rank, world_size) -> range`, the input columns rank `rank` keeps, and raise
# `ValueError` when `input_size` does not split evenly. (There is no replicated case: a replicated input column
# would be counted twice by the all-reduce.)

# %% [markdown]
# <details><summary>Hint</summary>
#
# It is Task 1's even case with units of one column. Check that the columns of `o_proj` on rank `r` are the rows of
# `q_proj` on rank `r`: `row_cols(9 * 64, r, 3) == column_rows(9, 64, r, 3)`.
# </details>

# %% nbgrader="answer"
def row_cols(input_size, rank, world_size):
    """The input columns of a row-parallel matrix that `rank` keeps."""
    ### BEGIN SOLUTION
    if input_size % world_size != 0:
        raise ValueError(f"{input_size} input features do not split evenly over {world_size} ranks")
    width = input_size // world_size
    start = rank * width
    return range(start, start + width)
    ### END SOLUTION


# %% nbgrader="graded" points=1
from minillm.grading.lab09 import check_lab09_2; check_lab09_2(row_cols)

# %% [markdown]
# ## Task 3 — where the all-reduce goes (3 points)
#
# Now the forward passes. A layer hands your rule its own shard and this rank's communicator:
#
# * `column_forward(x, weight, bias, comm)`: `x` is the whole input `[tokens, in_features]` (every rank has it),
#   `weight` is this rank's rows `[rows, in_features]`, `bias` this rank's slice `[rows]` or `None`. Return this
#   rank's output columns `[tokens, rows]`. **Send nothing**: the next layer consumes them split.
# * `row_forward(x, weight, bias, comm)`: `x` is this rank's input columns `[tokens, cols]`, `weight` this rank's
#   columns `[out_features, cols]`, `bias` the **whole** bias `[out_features]` (the same on every rank) or `None`.
#   Return the whole output `[tokens, out_features]`, the same on every rank: the partial product, summed over the
#   ranks by **exactly one** `comm.all_reduce`, then the bias — **once**.
#
# `comm` is a `minillm.distributed.comm.Communicator`: `comm.rank`, `comm.world_size`, and
# `comm.all_reduce(t)`, which sums `t` over the ranks **in place** (every rank ends with the sum) and returns it.
# Every rank runs your function at the same time, and an all-reduce returns only when all ranks have called it.
# The communicator counts what it sends (`comm.stats.messages`, `comm.stats.bytes`): the checker reads them.
# Both rules compute in the input's dtype and return it: the checker also runs a bfloat16 layer, where a float32
# detour would double what the all-reduce sends.
#
# The answer is a class holding all four rules, the seam's shape; the first two are yours from Tasks 1 and 2.
#
# **Ranks as threads.** In production every rank is a process with its own GPU (`torchrun`, or minillm's default
# `distributed_executor_backend="mp"`, which spawns processes). A spawned process gets the rules object by
# pickling, and pickle stores a class as a reference to its module: a class defined in a notebook cell lives in
# the kernel's `__main__`, which the new process does not have, so it cannot be sent. In this lab every rank is
# a **thread** of the kernel instead (`distributed_executor_backend="thread"`, and `on_ranks` above): the threads
# share your class as it is, yet talk through real gloo process groups over loopback TCP, exactly as processes
# would; the collectives release the GIL while they wait, so the ranks really do block on each other.

# %% [markdown]
# <details><summary>Hint: the two shapes</summary>
#
# A column-parallel rank already has everything its output columns need: `x` whole, and whole rows of `W`. A
# row-parallel rank has only some terms of every output: `y[t, o] = Σ_i x[t, i] · W[o, i]` runs over all input
# columns `i`, and each rank holds some of them.
# </details>
#
# <details><summary>Hint: the bias</summary>
#
# The all-reduce adds whatever each rank gives it. If every rank adds the bias first, the sum holds it
# `world_size` times. Dividing the sum by `world_size` does not help either: the partial products must be added,
# not averaged.
# </details>

# %% nbgrader="answer"
class MyRules:
    """Your TensorParallelRules: the sharding of Tasks 1 and 2, and the forwards of this task."""

    column_rows = staticmethod(column_rows)        # Tasks 1 and 2 (run this cell again after changing them)
    row_cols = staticmethod(row_cols)

    @staticmethod
    def column_forward(x, weight, bias, comm):
        ### BEGIN SOLUTION
        y = torch.matmul(x, weight.t())            # my output columns, from the whole input: nothing to send
        if bias is not None:
            y = y + bias
        return y
        ### END SOLUTION

    @staticmethod
    def row_forward(x, weight, bias, comm):
        ### BEGIN SOLUTION
        partial = torch.matmul(x, weight.t())      # my input columns' share of every output
        comm.all_reduce(partial)                   # in place: now the sum over the ranks, on every rank
        return partial if bias is None else partial + bias
        ### END SOLUTION


# %% nbgrader="graded" points=3
from minillm.grading.lab09 import check_lab09_3; check_lab09_3(MyRules)

# %% [markdown]
# One row-parallel layer over two ranks, with your rules: each rank's partial product is nothing like the answer
# on its own; after the all-reduce both ranks hold the dense result, and each rank's communicator counted one
# all-reduce of the `[2, 4]` float32 output (32 bytes).

# %%
gen = torch.Generator().manual_seed(0)
x = torch.randn(2, 8, generator=gen)
W = torch.randn(4, 8, generator=gen)
b = torch.randn(4, generator=gen)


def one_row_layer(comm):
    cols = row_cols(8, comm.rank, comm.world_size)
    x_r, W_r = x[:, cols.start:cols.stop], W[:, cols.start:cols.stop]
    partial = torch.matmul(x_r, W_r.t())
    y = MyRules.row_forward(x_r, W_r, b, comm)
    return cols, partial, y, comm.stats.snapshot()


torch.set_printoptions(precision=3, sci_mode=False)
print("dense x·Wᵀ + b, token 0:", (torch.matmul(x, W.t()) + b)[0])
for rank, (cols, partial, y, sent) in enumerate(on_ranks(2, one_row_layer)):
    print(f"rank {rank}: columns {cols.start}..{cols.stop - 1}; partial {partial[0]}, after the all-reduce + b "
          f"{y[0]}; sent {sent}")

# %% [markdown]
# ## Task 4 — bytes per token (2 points)
#
# What crosses the links is what decides where each kind of parallelism can run. Count it per token, as **payload
# bytes**: the size of the tensor a rank hands to a collective (what `comm.stats.bytes` counts).
#
# * **Tensor parallelism.** Every decoder layer makes two all-reduces of a `[tokens, hidden_size]` tensor: per token,
#   two hidden vectors of `dtype_bytes` per value. Write `tp_bytes_per_token(hidden_size, num_layers,
#   dtype_bytes)`. It does not depend on the number of ranks.
# * **Pipeline parallelism.** `pp` stages hold contiguous slices of the layers; per token, each boundary between two
#   stages carries the hidden vector once, from one stage to the next. Write `pp_bytes_per_token(hidden_size, pp,
#   dtype_bytes)`.
#
# Two conventions to state whenever you quote such numbers:
#
# * *Payload, not wire traffic.* How an all-reduce moves its payload is the collective library's business: a ring
#   all-reduce over N GPUs sends (and receives) `2(N − 1)/N` times the payload per GPU — a reduce-scatter, then an
#   all-gather; NCCL may choose a tree; NVLink switches with SHARP add in the network. The payload is what does not
#   depend on N or on the algorithm.
# * *The decoder layers only.* minillm's embedding is split by vocabulary rows, so it adds one more all-reduce per
#   token (each rank looks up only the ids it owns), and the LM head gathers each rank's slice of the logits on
#   rank 0. Your formula counts the decoder layers, the part that grows with the model; the measurement below shows
#   the embedding's share separately.

# %% [markdown]
# <details><summary>Hint</summary>
#
# Only activations move, never weights: a hidden vector is `hidden_size × dtype_bytes` bytes. Count how many of
# them each scheme moves for one token: per layer for TP, per boundary for PP (a model in one stage sends nothing).
# </details>

# %% nbgrader="answer"
class CommBytes:
    """Payload bytes per token: what one rank hands to its collectives (TP) or sends to the next stage (PP)."""

    @staticmethod
    def tp_bytes_per_token(hidden_size, num_layers, dtype_bytes):
        ### BEGIN SOLUTION
        return 2 * num_layers * hidden_size * dtype_bytes
        ### END SOLUTION

    @staticmethod
    def pp_bytes_per_token(hidden_size, pp, dtype_bytes):
        ### BEGIN SOLUTION
        return (pp - 1) * hidden_size * dtype_bytes
        ### END SOLUTION


# %% nbgrader="graded" points=2
from minillm.grading.lab09 import check_lab09_4; check_lab09_4(CommBytes)

# %% [markdown]
# ## Plug in: SmolLM2 cut three ways by your rules
#
# `LLM(..., tensor_parallel_size=3, distributed_executor_backend="thread", tp_rules=MyRules())` loads SmolLM2 on
# three ranks: every rank reads only its own slices of the checkpoint, chosen by your `column_rows` and `row_cols`,
# and every linear layer of every rank runs your `column_forward` / `row_forward`. Rank 0 schedules, samples and
# broadcasts each step's batch to the others. Greedy decoding must give the same tokens as one rank — the
# all-reduces add the partial sums in a different order than one matmul does, so the logits differ in the last
# bits of float32, far too little to change an argmax here.
#
# The engine's communicator on rank 0 (`llm.engine.runner.comm`) counts what that rank handed to each kind of
# collective while the request ran.

# %%
PROMPT = "The three primary colors are"
MAX_TOKENS = 24
greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)

t0 = time.perf_counter()
with LLM("default", tensor_parallel_size=3, distributed_executor_backend="thread", tp_rules=MyRules()) as llm:
    load_s = time.perf_counter() - t0
    comm = llm.engine.runner.comm
    comm.stats.reset()
    t0 = time.perf_counter()
    tp3 = llm.generate(PROMPT, greedy, use_tqdm=False)[0]
    tp3_s = time.perf_counter() - t0
    sent = comm.stats.snapshot()
    smol = llm.loaded.model.cfg

single = LLM("default")
t0 = time.perf_counter()
tp1 = single.generate(PROMPT, greedy, use_tqdm=False)[0]
tp1_s = time.perf_counter() - t0

print(f"TP=3 (your rules; loaded in {load_s:.1f} s, {tp3_s:.1f} s for {len(tp3.outputs[0].token_ids)} tokens): "
      f"{tp3.outputs[0].text!r}")
print(f"TP=1 ({tp1_s:.1f} s): {tp1.outputs[0].text!r}")
print(f"same tokens: {tp3.outputs[0].token_ids == tp1.outputs[0].token_ids}\n")

fed = len(tp3.prompt_token_ids) + len(tp3.outputs[0].token_ids) - 1     # the last token is sampled, never fed
steps = len(tp3.outputs[0].token_ids)                                 # one prefill step, then one per token
print(f"rank 0 of 3 sent, over {steps} steps and {fed} tokens fed through the model:")
for kind, s in sent.items():
    print(f"  {kind:10s} {s['messages']:5d} messages {s['bytes']:>10,d} bytes  {1000 * s['seconds']:7.1f} ms waiting")
per_token = sent["all_reduce"]["bytes"] / fed
layers_only = CommBytes.tp_bytes_per_token(smol.hidden_size, smol.num_layers, 4)
print(f"all-reduces per step: {sent['all_reduce']['messages'] / steps:.0f} = 2 × {smol.num_layers} layers + 1 "
      f"(the embedding)")
print(f"all-reduce payload per token: {per_token:,.0f} bytes = your formula {layers_only:,} + the embedding's "
      f"{smol.hidden_size * 4:,}")

# %% [markdown]
# Every step makes 61 all-reduces: two per layer for SmolLM2's 30 layers, plus the embedding's. Per token that is
# 30 × 2 × 576 values × 4 bytes = 138,240 bytes of float32 for the layers, plus 2,304 for the embedding. The
# broadcasts carry each step's batch from rank 0 (token ids, positions, block tables); the gathers bring each
# rank's slice of the logits to rank 0 (16,384 of the 49,152: 65,536 bytes per sampled token). On this CPU the
# ranks are threads sharing two cores and gloo goes through loopback TCP, so TP=3 is *slower* than one rank here:
# the win needs hardware where each rank reads its own weights from its own memory in parallel, and links fast
# enough that 61 small all-reduces per step cost less than what the split saves.

# %% [markdown]
# ## Measurement: bytes per token, counted
#
# The tiny model, sharded with **your rules** over 2 and 4 ranks (4 ranks replicate its 2 KV heads), runs one
# forward pass over 6 tokens; rank 0's communicator counts the collectives. **Expected shape:** the logits match
# one rank's to float32 rounding; every forward pass makes `2 × layers + 1` all-reduces, whatever the number of
# ranks; the payload per token is your formula plus the embedding's one hidden vector, also independent of the
# number of ranks; only the ring's wire bytes grow with N, towards twice the payload.

# %%
T = 6
ids = torch.randint(0, cfg.vocab_size, (T,), generator=torch.Generator().manual_seed(1))
step = StepInputs(input_ids=ids, positions=torch.arange(T), query_lens=[T], seq_lens=[T],
                  slot_mapping=torch.arange(T), block_tables=[[0]], block_copies=[], sample_rows=list(range(T)))


def forward(model):
    """One prefill of the 6 tokens; logits [6, vocab] on rank 0 (None on the others)."""
    runner = ModelRunner(model, KVCache(model.kv_cfg, 1, 8), get_attention_backend("torch"), model.comm)
    return runner.forward(step)


reference = forward(full)
rows = []
for world in (2, 4):
    def run_rank(comm):
        rank_model = build_model(cfg, hf_state(full), torch.float32, comm, None, MyRules())
        comm.stats.reset()
        return forward(rank_model), comm.stats.snapshot()
    logits, stats = on_ranks(world, run_rank)[0]
    reduce = stats["all_reduce"]
    rows.append((world, float((logits - reference).abs().max()), reduce["messages"], reduce["bytes"] / T,
                 CommBytes.tp_bytes_per_token(cfg.hidden_size, cfg.num_layers, 4),
                 2 * (world - 1) / world * reduce["bytes"] / T))

print(f"{'TP':>3s} {'max |logits - TP=1|':>20s} {'all-reduces':>12s} {'payload B/token':>16s} "
      f"{'your formula':>13s} {'+ embedding':>12s} {'ring wire B/token':>18s}")
for world, diff, messages, per_tok, formula, wire in rows:
    print(f"{world:3d} {diff:20.2e} {messages:12d} {per_tok:16,.0f} {formula:13,} "
          f"{formula + cfg.hidden_size * 4:12,} {wire:18,.0f}")

# %% [markdown]
# Now the same formulas at the scale where tensor parallelism is used. For four models in bf16, the bytes per token
# that tensor parallelism all-reduces (any number of ranks) and that pipeline parallelism sends across its stage
# boundaries; and, to put them in time, how long one **decode step with 64 sequences** would spend moving that
# payload at NVLink-class bandwidth (~450 GB/s per direction between two H100s) and at one 400 Gb/s InfiniBand NIC
# (~50 GB/s) — bandwidth alone, before the latency of each of the `2 × layers` collectives (several microseconds
# each), which dominates at small batches. **Expected shape:** TP moves `2 × layers / (pp − 1)` times more than
# PP — from 60 times (SmolLM2) to 252 times (Llama-3.1-405B) at PP=2 — which is why TP stays inside a node and PP
# is what crosses nodes.

# %%
MODELS = {"SmolLM2-135M": (576, 30), "Llama-3-8B": (4096, 32), "Llama-3-70B": (8192, 80),
          "Llama-3.1-405B": (16384, 126)}
BATCH, NVLINK, INFINIBAND = 64, 450e9, 50e9
schemes = {"TP (any size)": lambda h, n: CommBytes.tp_bytes_per_token(h, n, 2),
           "PP=2": lambda h, n: CommBytes.pp_bytes_per_token(h, 2, 2),
           "PP=4": lambda h, n: CommBytes.pp_bytes_per_token(h, 4, 2)}
table = {name: {s: f(h, n) for s, f in schemes.items()} for name, (h, n) in MODELS.items()}

print(f"{'model':15s} {'scheme':14s} {'bytes/token':>12s} {'step of 64 on NVLink':>21s} {'on InfiniBand':>14s}")
for name, by_scheme in table.items():
    for s, nbytes in by_scheme.items():
        print(f"{name:15s} {s:14s} {nbytes:12,} {1e6 * BATCH * nbytes / NVLINK:18.1f} µs "
              f"{1e6 * BATCH * nbytes / INFINIBAND:11.1f} µs")

plots.comm_bytes(table)

# %% [markdown]
# **Reading the numbers.** Llama-3-70B under tensor parallelism all-reduces 2.6 MB per token; a decode step of 64
# sequences hands 168 MB to the collectives, about 0.4 ms of NVLink bandwidth — a few percent of a ~20 ms step —
# but 3.4 ms over InfiniBand, and each of its 160 all-reduces would also pay the network's latency. A two-stage
# pipeline sends 16 KB per token across its one boundary: 1 MB per step, nothing for any network. So: tensor
# parallelism inside a node, where NVLink makes its many small collectives cheap and it cuts each token's latency;
# pipeline parallelism, if needed, between nodes — it adds capacity, not speed, since a token still visits the
# stages one after another.

# %% [markdown]
# ## Interview questions
#
# <details><summary><b>How does tensor parallelism split a transformer layer, and what is communicated?</b></summary>
#
# Megatron-style: in attention the fused QKV projection is column-parallel by whole heads (each GPU keeps some query
# heads and the KV heads they read), so attention runs locally on each GPU's heads, with each GPU's own share of
# the KV cache; the output projection is row-parallel, so each GPU produces a partial sum of the full hidden
# vector and one all-reduce adds them. The MLP is the same: gate and up column-parallel, the activation local,
# down row-parallel, one all-reduce. Two all-reduces of `[tokens, hidden]` per layer (Task 3, and the 61 per step
# counted on SmolLM2: 2 × 30 + the embedding's) — activations only, never weights. The bias of a row-parallel layer
# is added once, after the sum; biases of column-parallel layers are split with their rows.
# </details>
#
# <details><summary><b>What limits the tensor-parallel degree?</b></summary>
#
# Head counts first: query heads must divide evenly (SmolLM2's 9 heads allow TP = 1, 3 or 9, never 2; its 1536
# MLP columns then rule out 9), and the KV heads must either divide or be replicated (Task 1: 8 KV heads and TP=16 gives two copies of each, and two copies
# of its KV cache, which wastes memory). Then efficiency: each GPU's matmuls get smaller (lower arithmetic
# intensity, worse utilization), while the number of all-reduces per token stays `2 × layers` and their latency
# does not shrink — past some degree, communication dominates. And topology: the collectives are on the critical
# path of every layer, so TP wants NVLink-class links, i.e. one node (typically ≤ 8 GPUs).
# </details>
#
# <details><summary><b>Why does grouped-query attention complicate tensor parallelism, and how do engines handle it?</b></summary>
#
# Each query head must find the KV head it reads on its own GPU. With KV heads ≥ TP, split KV heads with their
# query groups (contiguous blocks of both). With fewer KV heads than GPUs, replicate: each KV head goes to the
# `TP / kv_heads` consecutive GPUs that hold its query group — not round-robin, which would pair query heads with
# the wrong KV head (the checker's attention oracle catches exactly that). The replicas compute the same K and V
# and keep the same KV cache entries, so KV memory per GPU stops shrinking beyond TP = kv_heads; that is one reason
# Llama-3-70B (8 KV heads) is usually served at TP ≤ 8.
# </details>
#
# <details><summary><b>Payload bytes vs wire bytes: how much does an all-reduce really send?</b></summary>
#
# The payload is the tensor each GPU contributes (Task 4 counts it). A ring all-reduce over N GPUs does a
# reduce-scatter and an all-gather, each moving `(N − 1)/N` of the payload through every GPU's link, so each GPU
# sends and receives `2(N − 1)/N` × payload: 1× at N = 2, 1.75× at N = 8. Latency is `2(N − 1)` hops, which is why
# small decode all-reduces are latency-bound and NCCL switches to tree or NVLS (in-switch reduction) algorithms.
# Quoting payload keeps numbers comparable across N; for link sizing use the wire figure.
# </details>

# %% [markdown]
# ### More from the question bank
#
# Every interview question this lab answers, with the project's answer, key points and the code that backs it
# (the same bank `minillm quiz --lab lab09` rehearses in a terminal, with spaced repetition):

# %%
from minillm.quiz import show
show(lab="lab09")
