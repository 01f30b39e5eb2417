# ---
# jupyter:
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Lab 02 — The paged KV cache
#
# **The question.** *"What problem does PagedAttention solve? How is it like virtual memory in an operating
# system? Where does KV-cache memory get wasted, and what limits how many requests a server can run at once?"*
#
# Lab01 gave every sequence one contiguous KV tensor of `max_len` slots. A server doesn't know how long an
# answer will be, so it must reserve the worst case (the context window) for every request — and most of that
# reservation is never used. It also can't grow a sequence in place once its neighbour sits right after it,
# and two sequences that share a prompt (n > 1 sampling, beam search) each hold their own copy of it.
#
# **Paging** fixes all three, exactly as an OS does for RAM: cut the KV pool into fixed-size **blocks** of
# `block_size` token slots; give every sequence a **block table** that maps its logical blocks (positions
# 0–15, 16–31, ... for block_size 16) to physical blocks anywhere in the pool; allocate a block only when the
# sequence's last one is full; let several tables point at one block and count the references
# (**ref counts**); and copy a shared block only when somebody is about to write into it (**copy-on-write**).
#
# **What you will build:** the slot mapping, a ref-counted block allocator, and the block manager the engine
# schedules with — then run SmolLM2 on your block manager. **What you will measure:** how much reserved KV
# memory holds real tokens and how many sequences fit, paged vs contiguous, as a function of the block size.
#
# Answer cells say `raise NotImplementedError()` until you fill them in; the graded cell after each one
# (don't edit it) prints nothing when you are right, and the smallest counter-example with a hint when not.

# %% nbgrader="readonly"
import os

os.environ.setdefault("TRITON_INTERPRET", "1")     # before anything imports minillm.kernels

from collections import deque

import torch

from minillm import plots
from minillm.bench.kv import kv_bench
from minillm.bench.workload import WorkloadSpec, make_workload
from minillm.engine.llm_engine import LLMEngine
from minillm.engine.prompt import build_prompt_ids
from minillm.kv.block_manager import BlockManager, NoFreeBlocksError
from minillm.loading.loader import load_model
from minillm.sampling.params import SamplingParams

torch.set_num_threads(1)      # this lab measures memory, not speed: one thread runs best on a shared 2-core machine
loaded = load_model("default", "float32")
model, cfg, tok = loaded.model, loaded.config, loaded.tokenizer
print(f"SmolLM2: {cfg.num_layers} layers × {cfg.num_kv_heads} kv heads × head_dim {cfg.head_dim} → "
      f"{cfg.kv_bytes_per_token(4) / 1024:.0f} KiB of K/V per token in fp32")

# %% [markdown]
# ## Block tables in a real engine
#
# minillm's engine keeps one KV pool per layer, shaped `[num_blocks × block_size slots, kv_heads, head_dim]`
# (`minillm/kv/cache.py`), and a `BlockManager` (`minillm/kv/block_manager.py`) that only does bookkeeping:
# block tables, ref counts, copy-on-write. Below, the engine runs four chat requests for a few steps on a
# 40-block pool (block_size 16); request `r1` asks for **n = 2** samples. Then we draw what the block manager
# holds:
#
# * **top:** one row per running sequence, one cell per logical block; the number is the physical block id.
#   Orange cells are **shared** (ref count 2): after the prompt of `r1` was computed the engine *forked* the
#   sequence, so both samples point at the same prompt blocks — the prompt's K/V is stored once. Their last
#   blocks differ: the first sample to write its next token into the shared, partly filled last block got a
#   private copy of it (**copy-on-write**); the other then held the original alone and wrote in place.
# * **bottom:** the physical pool. A sequence's blocks are neighbours here only because they were allocated in
#   order (the copied block of `r1` already isn't); they don't need to be, and after some sequences finish and
#   others grow they won't be — the block table is the only thing that says where a sequence's K/V lives.

# %%
def snapshot(engine):
    """(rows, ref_counts): [(label, block_table)] for every running sequence, and each block's ref count."""
    bm = engine.block_manager
    rows = [(rid + (f" #{k}" if len(tables) > 1 else ""), list(t))
            for rid, tables in engine.block_tables().items() for k, t in enumerate(tables)]
    return rows, [bm.ref_count(b) for b in range(bm.num_blocks)]


demo = LLMEngine.from_model(model, tok, block_size=16, num_blocks=40, enable_prefix_caching=False,
                            max_model_len=256)
questions = ["Why is the sky blue?", "Write a haiku about autumn leaves falling on a quiet pond.",
             "Explain in two sentences how a bicycle stays upright.", "List three uses of a paperclip."]
for i, q in enumerate(questions):
    demo.add_request(build_prompt_ids(tok, q), request_id=f"r{i}",
                     params=SamplingParams(temperature=0.8, seed=i, max_tokens=32, n=2 if i == 1 else 1))
for _ in range(4):                      # step 1: prefill all four prompts (+ fork r1); steps 2-4: decode
    demo.step()
rows, refs = snapshot(demo)
usage = demo.kv_usage()
plots.block_tables(rows, refs, f"minillm's BlockManager after 4 steps: {usage['num_used']} of "
                               f"{usage['num_blocks']} blocks in use")
for rid in list(demo.requests):
    demo.abort(rid)                     # frees every block
print({k: usage[k] for k in ("num_blocks", "block_size", "num_used", "num_free", "num_seqs", "tokens_capacity")})

# %% [markdown]
# ## Task 1 — slot mapping (2 points)
#
# The attention layer writes each new token's K and V into one **slot** of the pool. Slots are numbered
# `physical_block * block_size + offset`. Write `slot_mapping(block_table, start, end, block_size)`: the slot
# of every position `p` in `[start, end)` (end excluded) of a sequence whose block table is `block_table`
# (a list of physical block ids: logical block `i` of the sequence is physical block `block_table[i]`).
# Return a list of ints, one per position. Assume `0 <= start <= end <= len(block_table) * block_size`.
#
# Example: block_size 4, `block_table = [3, 0, 7]`: positions 0–3 live in block 3 (slots 12–15), 4–7 in block
# 0 (slots 0–3), 8–11 in block 7 (slots 28–31); `slot_mapping([3, 0, 7], 5, 9, 4) == [1, 2, 3, 28]`.
# The engine's model runner calls this for every sequence at every step (`start` = tokens already computed,
# `end` = start + tokens scheduled now) and hands the list to the attention layer.

# %% nbgrader="answer"
def slot_mapping(block_table, start, end, block_size):
    """Flat KV-pool slot of each position in [start, end) of a sequence with this block table."""
    ### BEGIN SOLUTION
    return [block_table[p // block_size] * block_size + p % block_size for p in range(start, end)]
    ### END SOLUTION


# %% nbgrader="graded" points=2
from minillm.grading.lab02 import check_lab02_1; check_lab02_1(slot_mapping)

# %% [markdown]
# ## Task 2 — a block allocator with reference counts (3 points)
#
# The allocator owns the pool's `num_blocks` block ids and one **reference count** per block: how many block
# table entries point at it. Write the class `BlockAllocator(num_blocks)`:
#
# | member | does |
# |---|---|
# | `num_free_blocks` (a `@property`) | how many blocks have ref count 0 |
# | `allocate() -> int` | take a free block out of the pool and give it ref count 1; when no block is free raise `NoFreeBlocksError` (imported above) and change nothing |
# | `share(block)` | one more table holds `block`: ref count + 1; raise `ValueError` if the block is free |
# | `free(block)` | one table lets go: ref count − 1, and the block returns to the pool **only when its count reaches 0**; raise `ValueError` if the block is already free (a *double free* would put it in the pool twice, and two sequences would get it) |
# | `ref_count(block) -> int` | the current count (0 for a free block) |
#
# Any free block may be handed out (a `collections.deque` of free ids, taken from the front and returned at the
# back, is what minillm uses).

# %% nbgrader="answer"
class BlockAllocator:
    """A pool of block ids with one reference count per block."""

    def __init__(self, num_blocks):
        ### BEGIN SOLUTION
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self.free_pool = deque(range(num_blocks))
        ### END SOLUTION

    @property
    def num_free_blocks(self):
        ### BEGIN SOLUTION
        return len(self.free_pool)
        ### END SOLUTION

    def allocate(self):
        ### BEGIN SOLUTION
        if not self.free_pool:
            raise NoFreeBlocksError(f"all {self.num_blocks} blocks are in use")
        block = self.free_pool.popleft()
        self.ref_counts[block] = 1
        return block
        ### END SOLUTION

    def share(self, block):
        ### BEGIN SOLUTION
        if self.ref_counts[block] == 0:
            raise ValueError(f"block {block} is free: only a block in use can be shared")
        self.ref_counts[block] += 1
        ### END SOLUTION

    def free(self, block):
        ### BEGIN SOLUTION
        if self.ref_counts[block] == 0:
            raise ValueError(f"double free of block {block}")
        self.ref_counts[block] -= 1
        if self.ref_counts[block] == 0:
            self.free_pool.append(block)
        ### END SOLUTION

    def ref_count(self, block):
        ### BEGIN SOLUTION
        return self.ref_counts[block]
        ### END SOLUTION


# %% nbgrader="graded" points=3
from minillm.grading.lab02 import check_lab02_2; check_lab02_2(BlockAllocator)

# %% [markdown]
# ## Task 3 — the block manager: append, fork, copy-on-write, free (4 points)
#
# The scheduler talks to a block manager (`minillm/kv/block_manager.py`). Its *paging core* is four methods;
# everything else — admitting a prompt, the slot mapping, recording what was computed, prefix caching — is
# built around them. You write the core in a subclass of minillm's `BlockManager` (read it with
# `BlockManager??`); what the base class gives you:
#
# | you get | |
# |---|---|
# | `self.allocator` | an instance of the class attribute `allocator_cls` — set it to your `BlockAllocator` (task 2) |
# | `slot_mapping_fn` | a class attribute — set it to your `slot_mapping` (task 1); `self.slot_mapping(seq, start, end)` calls it |
# | `self.tables[seq_id]` | the sequence's block table (a list you may modify in place) |
# | `self.computed[seq_id]` | how many of its positions already hold computed K/V |
# | `self.table(seq_id, "op")` | the table, or a `KeyError` naming the unknown `seq_id` |
# | `self.cdiv(n)` | ⌈n / block_size⌉ |
# | `self.written_blocks(seq_id, num_tokens)` | indices *into the table* of the blocks the sequence already has that positions `[computed, num_tokens)` fall in |
# | `num_free_blocks`, `allocate_prompt`, `commit_computed`, `block_table`, `ref_count`, `usage`, ... | what the engine also calls |
#
# The engine's loop for one sequence is: `allocate_prompt(seq, prompt)` (an empty table) → every step
# `append_slots(seq, computed + new)` → the forward pass writes the new tokens' K/V into
# `slot_mapping(seq, computed, computed + new)` → `commit_computed(...)` sets `computed`. With n > 1 the
# engine calls `fork(parent, child)` once the prompt is computed, and `free(seq)` when a sequence finishes or
# is preempted. Write the four methods:
#
# * **`num_blocks_needed(seq_id, num_tokens) -> int`** — how many blocks `append_slots(seq_id, num_tokens)`
#   would take from the pool: new blocks to make the table cover `num_tokens` positions, **plus one per shared
#   block it would copy**. For an unknown `seq_id` (not admitted yet): `⌈num_tokens / block_size⌉`. The
#   scheduler preempts sequences until this fits in `num_free_blocks`, so it must be exact.
# * **`append_slots(seq_id, num_tokens) -> list[(src, dst)]`** — make the table cover positions
#   `[0, num_tokens)`. If that needs more blocks than are free, raise `NoFreeBlocksError` **without changing
#   anything**. Every existing block that the new positions `[computed, num_tokens)` fall in and whose ref
#   count is > 1 is shared with another sequence: writing into it would corrupt the other sequence's K/V. Replace
#   it in this table by a freshly allocated block, drop this table's reference to the old one, and return the
#   pair `(old, new)` so the engine copies the old block's K/V into the new one before the forward pass
#   (**copy-on-write**). Then append new blocks until the table covers `num_tokens`. Return the list of pairs
#   (`[]` when nothing was copied).
# * **`fork(parent_seq_id, child_seq_id)`** — the child gets a copy of the parent's block table (the same
#   physical blocks: one more reference to each) and the parent's computed count. No new blocks.
# * **`free(seq_id)`** — the sequence is done: drop one reference per block of its table, forget the
#   sequence. An unknown (or already freed) `seq_id` is a no-op.
#
# The checker drives your class like the engine does, with a simulated KV pool that records what every write
# stores, and after every call reads back every live sequence: a missing copy-on-write, a block freed while
# another sequence still uses it, or a leaked reference all show up. It runs your class with prefix caching off
# and with your allocator and slot mapping (if one of them does not pass its own task yet, minillm's stands in,
# so this task is graded on its own); the plug-in below uses all of your code.

# %% nbgrader="answer"
class MyBlockManager(BlockManager):
    allocator_cls = BlockAllocator                  # your task-2 allocator
    slot_mapping_fn = slot_mapping                  # your task-1 slot mapping

    def num_blocks_needed(self, seq_id, num_tokens):
        ### BEGIN SOLUTION
        if seq_id not in self.tables:
            return self.cdiv(num_tokens)
        table = self.tables[seq_id]
        new = max(0, self.cdiv(num_tokens) - len(table))
        shared = [i for i in self.written_blocks(seq_id, num_tokens) if self.allocator.ref_count(table[i]) > 1]
        return new + len(shared)
        ### END SOLUTION

    def append_slots(self, seq_id, num_tokens):
        ### BEGIN SOLUTION
        table = self.table(seq_id, "append_slots")
        needed = self.num_blocks_needed(seq_id, num_tokens)
        if needed > self.num_free_blocks:
            raise NoFreeBlocksError(f"seq {seq_id} needs {needed} blocks, {self.num_free_blocks} are free")
        copies = []
        for i in self.written_blocks(seq_id, num_tokens):
            if self.allocator.ref_count(table[i]) > 1:        # shared: copy before writing
                src, dst = table[i], self.allocator.allocate()
                table[i] = dst
                self.allocator.free(src)                       # the other holders keep it
                copies.append((src, dst))
        while len(table) * self.block_size < num_tokens:
            table.append(self.allocator.allocate())
        return copies
        ### END SOLUTION

    def fork(self, parent_seq_id, child_seq_id):
        ### BEGIN SOLUTION
        table = self.table(parent_seq_id, "fork")
        if child_seq_id in self.tables:
            raise ValueError(f"fork: seq {child_seq_id} already exists")
        for b in table:
            self.allocator.share(b)
        self.tables[child_seq_id] = list(table)
        self.computed[child_seq_id] = self.computed[parent_seq_id]
        ### END SOLUTION

    def free(self, seq_id):
        ### BEGIN SOLUTION
        table = self.tables.pop(seq_id, None)
        if table is None:
            return
        del self.computed[seq_id]
        for b in reversed(table):
            self.allocator.free(b)
        ### END SOLUTION


# %% nbgrader="graded" points=4
from minillm.grading.lab02 import check_lab02_3; check_lab02_3(MyBlockManager)

# %% [markdown]
# ## Plug in: your block manager runs SmolLM2
#
# `engine.plug(block_manager=...)` swaps the engine's block manager for yours: from then on the scheduler
# admits, grows and preempts sequences with your `num_blocks_needed` / `append_slots` / `free`, the runner
# writes K/V into the slots your `slot_mapping` returns, and n > 1 requests fork through your `fork`. The pool
# is deliberately tiny — 12 blocks of 16 tokens, 192 token slots for 7 sequences that grow to ~50 tokens
# each — so the scheduler has to **preempt** (free a sequence's blocks and recompute it later). Two requests
# sample n = 2 answers at temperature 0.8 (fork + copy-on-write), the others are greedy.
#
# The same requests run once on minillm's own `BlockManager` and once on yours. Physical block ids may differ,
# but every scheduling decision and every token must be identical. The picture shows your block tables at the
# step where they were most scattered: after preemptions and frees, a sequence's blocks sit anywhere in the
# pool, in any order — the block table is the only record of where its K/V lives.

# %%
POOL_BLOCKS, BLOCK_SIZE, MAX_MODEL_LEN = 12, 16, 128
engine = LLMEngine.from_model(model, tok, block_size=BLOCK_SIZE, num_blocks=POOL_BLOCKS,
                              enable_prefix_caching=False, max_model_len=MAX_MODEL_LEN)
asks = ["Name a planet.", "Give me a fun fact about octopuses.", "Name a fruit that is yellow.",
        "Suggest a name for a black cat.", "Say hello in French."]


def run(block_manager):
    engine.plug(block_manager=block_manager)
    for i, q in enumerate(asks):
        sampled = i in (1, 3)
        params = SamplingParams(temperature=0.8 if sampled else 0.0, seed=i, max_tokens=12, ignore_eos=True,
                                n=2 if sampled else 1)
        engine.add_request(build_prompt_ids(tok, q), params, request_id=f"q{i}")
    outputs, trace, snaps = {}, [], []
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out
        running = engine.scheduler.running
        trace.append(dict(running=len(running), used=engine.block_manager.num_used_blocks,
                          tokens=sum(s.num_computed_tokens for s in running)))
        if running:
            snaps.append((len(trace), *snapshot(engine)))
    return outputs, trace, snaps


ref_out, ref_trace, _ = run(BlockManager(POOL_BLOCKS, BLOCK_SIZE, enable_prefix_caching=False))
my_out, my_trace, my_snaps = run(MyBlockManager(POOL_BLOCKS, BLOCK_SIZE, enable_prefix_caching=False))

for rid in sorted(ref_out):
    theirs = [c.token_ids for c in ref_out[rid].outputs]
    mine = [c.token_ids for c in my_out[rid].outputs]
    print(f"{rid} ({len(mine)} sample{'s' if len(mine) > 1 else ''}, preempted "
          f"{my_out[rid].metrics.num_preemptions}×): same tokens as minillm: {mine == theirs} — "
          + " | ".join(repr(c.text) for c in my_out[rid].outputs))
print(f"identical scheduling (running sequences and used blocks at every step): {my_trace == ref_trace}; "
      f"{len(my_trace)} steps")
# draw the step where the block tables were the most scattered over the pool (after preemptions and frees)
def scatter(snap):
    return sum(b != a + 1 for _, table in snap[1] for a, b in zip(table, table[1:]))


step, rows, refs = max(my_snaps, key=lambda s: (scatter(s), sum(r > 1 for r in s[2])))
plots.block_tables(rows, refs, f"your block manager after step {step} ({POOL_BLOCKS}-block pool, "
                               f"block_size {BLOCK_SIZE})")

# %% [markdown]
# ## Measurement 1: the pool over time (your block manager, the run above)
#
# For every step of the run: the blocks in use; the blocks the running sequences' computed tokens would fill
# if packed perfectly with nothing shared (computed tokens / 16, every sequence counted in full); and what a
# contiguous engine would have to reserve for the same running sequences (`max_model_len` = 128 slots = 8
# blocks each). **Expected shape:** the blocks in use stay at or under the pool size and close to the packed
# count — below it while the n = 2 samples share their prompt blocks, at most one partly filled block per
# sequence above it otherwise. The contiguous reservation is several times the pool: with 128 slots per
# sequence this pool runs **one** sequence at a time, the paged one six. Dips are preemptions (the newest
# sequence gives its blocks back and is recomputed when blocks free up) and sequences finishing.

# %%
plots.kv_pool_trace(my_trace, POOL_BLOCKS, BLOCK_SIZE, MAX_MODEL_LEN)
peak = max(t["running"] for t in my_trace)
print(f"peak {peak} sequences running at once in {POOL_BLOCKS * BLOCK_SIZE} token slots; a contiguous engine "
      f"reserving {MAX_MODEL_LEN} slots each fits {POOL_BLOCKS * BLOCK_SIZE // MAX_MODEL_LEN}")

# %% [markdown]
# ## Measurement 2: paged vs contiguous, as a function of the block size
#
# A bigger replay, without the model: 64 chat requests (prompts of 32–512 tokens, answers of 16–256 tokens)
# go through minillm's real scheduler and block manager with a stub instead of the forward pass (memory
# accounting doesn't depend on the token values; `minillm/bench/kv.py`). The KV budget is 8192 token slots
# — SmolLM2 in bf16 keeps 22.5 KiB per token, so that is 180 MiB — and the context window is 2048 tokens.
# We count, over the whole run, the fraction of reserved slots that hold no computed token (**waste**) and
# the largest number of sequences running at once (**concurrency**); a contiguous engine reserves 2048 slots
# per sequence.
#
# **Expected shape:** contiguous waste is flat and huge (~80%: the average sequence uses a few hundred of its
# 2048 slots) and its concurrency is 8192 / 2048 = 4. Paged waste is only the partly filled last block of each
# sequence, about block_size / 2 slots out of a few hundred: ~0% at block_size 1, a few % at 16, growing
# roughly linearly with the block size; paged concurrency is 5–7× the contiguous one and falls slowly as blocks
# grow. Tiny blocks waste nothing but make block tables long and the attention kernel's reads scattered; that
# is why engines pick 16 or 32.

# %%
workload = make_workload(tok, WorkloadSpec(num_requests=64, seed=0))
block_sizes = [1, 2, 4, 8, 16, 32, 64, 128, 256]
rows_kv = [kv_bench(workload, budget_tokens=8192, block_size=bs, max_model_len=2048,
                    bytes_per_token=cfg.kv_bytes_per_token(2)) for bs in block_sizes]
print(f"{'block':>6} {'paged waste':>12} {'contig. waste':>14} {'paged conc.':>12} {'contig. conc.':>14} "
      f"{'paged MiB wasted':>17} {'contig. MiB wasted':>19}")
for r in rows_kv:
    print(f"{r['block_size']:>6} {r['paged_waste_frac']:>12.1%} {r['contiguous_waste_frac']:>14.1%} "
          f"{r['paged_max_concurrency']:>12} {r['contiguous_max_concurrency']:>14} "
          f"{r['paged_wasted_bytes_avg'] / 2**20:>17.1f} {r['contiguous_wasted_bytes_avg'] / 2**20:>19.1f}")
plots.block_size_sweep(rows_kv)

# %% [markdown]
# ## Interview questions
#
# <details><summary><b>What problem does PagedAttention solve?</b></summary>
#
# Memory waste in the KV cache, which caps batch size and therefore throughput. Engines before it gave each
# request one contiguous KV region sized for the maximum length, because the output length is unknown: the
# vLLM paper measured that only 20–40% of that memory held real tokens (the rest was reservation, internal and
# external fragmentation). PagedAttention stores K/V in fixed-size blocks allocated on demand and looks them up
# through a per-sequence block table, so waste drops to under one block per sequence (compare the two pools in
# the run above: most of each contiguous 2048-token reservation unused, a few percent paged) and the same memory
# runs several times more sequences at once. The kernel side is an attention kernel that gathers K/V through the block table
# (lab03). Blocks also make sharing cheap: parallel samples and beams share prompt blocks with ref counts and
# copy-on-write, and prefix caching (lab05) shares blocks across requests.
# </details>
#
# <details><summary><b>How is the paged KV cache like OS virtual memory, and how is it different?</b></summary>
#
# The mapping is one to one: a block is a page, a block table is a page table, a sequence is a process, logical
# token positions are virtual addresses and the slot mapping `table[p // B] * B + p % B` is address
# translation. Like pages, blocks are allocated on demand (when the last block fills), can be mapped into
# several "address spaces" (fork, prefix sharing) with reference counts, and are copied on write. Preemption by
# swapping blocks to CPU memory or recomputing them is the engine's version of paging out. The differences:
# translation is done in software by the attention kernel (no MMU, no TLB), the engine knows each sequence's
# access pattern exactly (append-only, read everything every step), blocks are much bigger than a token but
# much smaller than a process, and there is no demand paging mid-step — everything a step reads must be
# resident before it starts.
# </details>
#
# <details><summary><b>What fragmentation does a KV cache suffer, and how much is left with paging?</b></summary>
#
# Contiguous allocation has three kinds: reservation waste (slots reserved for tokens not generated yet —
# often most of it, as in the replay above with a 2048-token window), internal fragmentation (reserved slots
# that are never used because the answer was shorter than the maximum) and external fragmentation (free memory
# split into gaps too small for another max-length request). Paging removes external fragmentation (any free
# block fits anywhere) and reservation waste (blocks are allocated one at a time), leaving only internal
# fragmentation inside each sequence's last block: on average block_size / 2 slots per sequence — 8 tokens
# (≈180 KiB for SmolLM2 in bf16, 1 MiB for Llama-3-8B) at block_size 16. The replay shows the trade-off: waste
# grows roughly linearly with the block size (0% at 1, 2% at 16, 25% at 256), while tiny blocks make tables long
# and reads scattered.
# </details>
#
# <details><summary><b>What limits how many requests a server can run concurrently?</b></summary>
#
# Usually KV memory: concurrency ≈ (accelerator memory − weights − activations) / (KV bytes per token × tokens
# per sequence). The question is which "tokens per sequence" you pay for: with contiguous reservation it is the
# maximum length (an 8B model with 128 KiB/token and 50 GiB of KV fits 50 sequences of 8k), with paging it is
# the tokens actually held (the same 50 GiB holds ~400 sequences that average 1k tokens). Past that, the limit
# moves to configured caps (`max_num_seqs`, `max_num_batched_tokens`), to compute (a batch's decode step gets
# slower once it stops being bandwidth-bound, so TPOT targets cap the batch) and to the scheduler's preemption
# behaviour: admitting on blocks for the current length means sequences that grow may have to be preempted, as
# in the plug-in run above. Paging, prefix sharing, GQA and KV quantization all raise the ceiling by making
# each sequence cheaper.
# </details>
#
# <details><summary><b>How do n > 1 sampling and beam search share KV memory?</b></summary>
#
# All samples of a request share the prompt, so the engine computes its K/V once and then forks: each child's
# block table points at the same physical blocks, whose ref counts go up by one. Full shared blocks are only
# read, so they stay shared forever; the partly filled last block is copied the first time a sample writes into
# it (copy-on-write), after which each sample appends into its own blocks. With a 1,000-token prompt and n = 4,
# the prompt takes 1,000 token slots instead of 4,000 (4× less KV at the start), and a block is freed only when the
# last sample holding it finishes — exactly what Task 3's fork, append_slots and free implement. Beam search
# uses the same mechanism with more frequent forks and frees as beams are pruned.
# </details>

# %% [markdown]
# ### More from the question bank
#
# Every interview question this lab answers, with the project's answer, key points and the code that backs it
# (the same bank `minillm quiz --lab lab02` rehearses in a terminal, with spaced repetition):

# %%
from minillm.quiz import show
show(lab="lab02")
