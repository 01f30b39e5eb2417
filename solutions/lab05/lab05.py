# ---
# jupyter:
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Lab 05 — Prefix caching
#
# **The question.** *"Every request to a chat model starts with the same system prompt, and every turn of a
# conversation sends the whole history again. Does the server really recompute all of that? What is prefix
# (prompt) caching, when does it save money, and why does it change how you route requests across
# replicas?"*
#
# The K and V of a token depend only on the tokens **up to it**. Two prompts that start with the same tokens
# therefore have the same KV for that common prefix: an engine that kept the first prompt's KV blocks can hand
# them to the second one and run the forward pass on the new suffix only. That is **prefix caching**
# (vLLM's *automatic prefix caching*, SGLang's *RadixAttention*, the "cached input tokens" on API price
# lists). In a paged engine (lab02) it costs almost nothing: a block is already a unit that several block
# tables can share, with a ref count.
#
# **What you will build.** The three pieces of minillm's prefix cache: the chained **block hash** that names
# a block by its content *and everything before it*, the **lookup** that finds the longest reusable prefix
# (safely, even when hashes collide), and the **LRU evictor** that decides which idle cached block to give up
# when memory runs out. Then you plug them into the engine running SmolLM2.
#
# **What you will measure.** Time to first token (TTFT) with the cache off and on, for chats that share the
# default system prompt, chats that share a long system prompt, and a multi-turn conversation.
#
# Answer cells say `raise NotImplementedError()` until you fill them in; the graded cell after each one
# (don't edit it) prints nothing when you are right, and the smallest counter-example with a hint when not.

# %% nbgrader="readonly"
import os

os.environ.setdefault("TRITON_INTERPRET", "1")   # before anything imports minillm.kernels

import hashlib
import statistics
import time
from collections import OrderedDict


from minillm import plots
from minillm.bench.prefix import QUESTIONS, REPLY, TURNS
from minillm.engine.llm_engine import LLMEngine
from minillm.engine.prompt import build_prompt_ids
from minillm.loading.loader import load_model
from minillm.sampling.params import SamplingParams

loaded = load_model("default", "float32")
model, tok = loaded.model, loaded.tokenizer
BLOCK_SIZE = 8          # tokens per KV block (vLLM uses 16; 8 gives the pictures some resolution)
engine = LLMEngine.from_model(model, tok, block_size=BLOCK_SIZE, kv_cache_memory="64MiB")
print(f"KV pool: {engine.block_manager.num_blocks} blocks of {BLOCK_SIZE} tokens; prefix caching "
      f"{'on' if engine.block_manager.enable_prefix_caching else 'off'}")

# %% [markdown]
# ## How a paged engine finds reusable KV
#
# The KV pool is cut into blocks of `BLOCK_SIZE` tokens (lab02). Whenever a block of a sequence becomes
# **full** and its KV has been computed, the block manager registers it in a dictionary
# `hash → physical block`. The key must identify the block's KV, and a token's KV depends on the token, its
# position and every token before it — so the key is **chained**:
#
# ```
# h0 = hash_block(None, tokens[0:8])      h1 = hash_block(h0, tokens[8:16])      h2 = hash_block(h1, tokens[16:24]) ...
# ```
#
# Equal keys then mean equal whole prefixes. When a new prompt arrives, the manager walks its full blocks in
# order, computes the same chain and looks each key up: every hit is a block whose KV can simply be added to
# the new sequence's block table (ref count + 1) instead of being recomputed. The walk stops at the first
# miss; only the remaining tokens go through the model. Two details:
#
# * a hash hit is only a *candidate*: hashes can collide, so the manager also compares the tokens the block
#   holds and the block it was computed after — serving another prefix's KV would be a silent wrong answer
#   (and, across users, a data leak);
# * at least one prompt token is always computed, even when the whole prompt is cached: its logits are the
#   first output token. So at most `(len(prompt) - 1) // BLOCK_SIZE` blocks come from the cache.
#
# When a request finishes, its blocks are not wiped: full blocks stay in the cache with ref count 0,
# **evictable**. They are revived for free by the next prompt that hits them, and given up — least recently
# used first — only when the engine needs blocks and no never-used block is left.
#
# **The picture, from the real engine.** Below, minillm's own engine answers *A* (a first question), then
# *B* (another question: same default system prompt), then *A's second turn* (A's history, A's real reply,
# and a follow-up). Each row is the block table of one prompt as the engine admitted it: the physical block
# id and the first hex digits of its chained hash. Green blocks came from the cache, orange ones were
# computed (and are now cached), grey is the partial last block (not cacheable yet).

# %%
def admit_and_inspect(eng, ids, max_tokens):
    """Run one request; return its block table right after prefill, the hash of each block, the number of
    prompt tokens served from the cache, and the finished output."""
    bm = eng.block_manager
    rid = eng.add_request(ids, SamplingParams(temperature=0, max_tokens=max_tokens))
    seq = eng.requests[rid][0]
    outs = eng.step()                                          # admission + prefill (+ first token)
    table = bm.block_table(seq.seq_id) if bm.has_seq(seq.seq_id) else []
    hash_of = {entry.block_id: h for h, entry in bm.cached_blocks.items()}   # the prefix cache, read-only
    hashes = [hash_of.get(b) for b in table]
    cached = seq.metrics.num_cached_tokens
    while eng.has_unfinished_requests():
        outs = eng.step()
    return table, hashes, cached, outs[-1] if outs else None


QA, QB, FOLLOW_UP = "What is the capital of France?", "Name three primary colors.", "And of Italy?"
prompt_a = build_prompt_ids(tok, QA)
row_a = admit_and_inspect(engine, prompt_a, max_tokens=12)
reply_a = row_a[3].outputs[0].text
prompt_b = build_prompt_ids(tok, QB)
row_b = admit_and_inspect(engine, prompt_b, max_tokens=2)
prompt_a2 = build_prompt_ids(tok, [{"role": "user", "content": QA}, {"role": "assistant", "content": reply_a},
                                   {"role": "user", "content": FOLLOW_UP}])
row_a2 = admit_and_inspect(engine, prompt_a2, max_tokens=2)
own_stats = engine.block_manager.stats
print(f"A's reply: {reply_a!r}")
print(f"cached prompt tokens: A {row_a[2]}/{len(prompt_a)}, B {row_b[2]}/{len(prompt_b)}, "
      f"A turn 2 {row_a2[2]}/{len(prompt_a2)};  {own_stats}")


plots.prefix_chains([(f"A: {QA!r}", prompt_a, row_a), (f"B: {QB!r}", prompt_b, row_b),
                     (f"A, turn 2: + reply + {FOLLOW_UP!r}", prompt_a2, row_a2)], BLOCK_SIZE,
                    "block tables at admission: physical block #id and chained hash (hex)")

# %% [markdown]
# Read the grid: B's first blocks are the *same physical blocks* as A's (the default system prompt
# `<|im_start|>system You are a helpful AI assistant named SmolLM…`), with the same hashes; its blocks
# diverge where the question starts, and from there every hash differs — even a block whose tokens happened to
# match would get a new hash, because its parent differs. A's second turn reuses everything A left behind,
# including the blocks holding **the model's own reply**: A's last prompt block was still partial at admission
# (grey), filled up with generated tokens while decoding, got registered, and is a hit for turn 2. Only the
# follow-up question is computed.

# %% [markdown]
# ## Task 1 — the chained block hash (3 points)
#
# Write `hash_block(parent_hash, token_ids) -> int`, the key of one full block:
#
# * `parent_hash` is `None` for the first block of a sequence, otherwise the int `hash_block` returned for the
#   block before it; `token_ids` is a tuple of token ids (non-negative ints, possibly large: Llama 3 has a
#   128k-token vocabulary, and the checker uses ids up to 200 000).
# * Equal inputs give equal hashes — **in every process**: several workers (or a restarted server, or a
#   router in front of replicas) must agree on a prefix's key. Python's built-in `hash()` is no good here:
#   for `str` and `bytes` it is salted per process (`PYTHONHASHSEED`), for ints it is `x mod (2**61 - 1)`
#   (so `hash(2**61) == hash(1)`), and it has only 64 bits.
# * Different inputs must give different hashes (up to astronomically unlikely collisions): a different
#   parent, a different token, the same tokens in a different order. Return a non-negative int of **at least
#   128 bits**: at 64 bits, a fleet caching billions of blocks would see collisions (birthday bound ≈ 2³²).
#
# Use `hashlib` (`blake2b` with `digest_size=16`, or `sha256`) over bytes that you encode yourself from the
# parent and the tokens — unambiguously (think of `(1, 23)` and `(12, 3)`) — and turn the digest into an int
# with `int.from_bytes(digest, "little")`. The checker also runs your function in two fresh Python processes
# with different hash seeds and compares.

# %% nbgrader="answer"
def hash_block(parent_hash, token_ids):
    """128-bit chained hash of one block: (hash of the block before it or None, tuple of token ids) -> int."""
    ### BEGIN SOLUTION
    h = hashlib.blake2b(digest_size=16)
    if parent_hash is None:
        h.update(b"\x00")                                          # first block of a sequence
    else:
        h.update(b"\x01" + parent_hash.to_bytes(16, "little"))     # all 128 bits of the parent
    h.update(b"".join(int(t).to_bytes(4, "little") for t in token_ids))   # fixed width: unambiguous
    return int.from_bytes(h.digest(), "little")
    ### END SOLUTION


# %% nbgrader="graded" points=3
from minillm.grading.lab05 import check_lab05_1; check_lab05_1(hash_block)

# %% [markdown]
# ## Task 2 — the lookup: longest verified cached prefix (3 points)
#
# Write `find_cached_prefix(token_ids, block_size, cache, hash_fn) -> list[int]`:
#
# * `token_ids`: the prompt (a list of ints); `hash_fn(parent_hash, tokens_tuple)`: the hash to use (the one
#   the cache was built with — in the engine, your Task 1 function);
# * `cache`: a read-only mapping `hash -> CachedBlock(block_id, parent, tokens)`: physical block `block_id`
#   holds the KV of `tokens` (a tuple of `block_size` ids) computed right after block `parent` (a block id,
#   or `None` for the first block of a sequence). Use `cache.get(h)`.
# * Return the physical block ids of the **longest cached prefix**: walk the full blocks `0, 1, 2, …` of the
#   prompt, chaining hashes as in Task 1; block `i` is reused if `cache.get(h_i)` exists **and** holds exactly
#   this block's tokens **and** its `parent` is the block you reused for block `i - 1` (`None` for block 0).
#   Stop at the first block that fails. Never return more than `(len(token_ids) - 1) // block_size` blocks.
#
# The checker builds caches with a good hash, with a hash that ignores the parent, with `sum(tokens) % 3`,
# and with a constant: with weak hashes most hits are collisions that only your verification can refuse.

# %% nbgrader="answer"
def find_cached_prefix(token_ids, block_size, cache, hash_fn):
    """Physical blocks of the longest verified cached prefix of token_ids (at most (len - 1) // block_size)."""
    ### BEGIN SOLUTION
    blocks, parent_hash, parent = [], None, None
    for i in range((len(token_ids) - 1) // block_size):
        tokens = tuple(token_ids[i * block_size:(i + 1) * block_size])
        h = hash_fn(parent_hash, tokens)
        entry = cache.get(h)
        if entry is None or entry.tokens != tokens or entry.parent != parent:
            break                                      # a miss, or a collision: nothing after it can be reused
        blocks.append(entry.block_id)
        parent_hash, parent = h, entry.block_id
    return blocks
    ### END SOLUTION


# %% nbgrader="graded" points=3
from minillm.grading.lab05 import check_lab05_2; check_lab05_2(find_cached_prefix)

# %% [markdown]
# ## Task 3 — the LRU evictor (2 points)
#
# Cached blocks whose ref count dropped to 0 are *evictable*: free memory that still holds useful KV. The
# block manager keeps them in an evictor and, when it needs a block and no never-used block is left, evicts
# the **least recently used** one (it loses its hash; its memory gets new KV). Write a class `LRU` with the
# interface of minillm's `LRUEvictor`, the exact calls `BlockManager` makes:
#
# | call | meaning |
# |---|---|
# | `add(block)` | `block` became evictable: it is now the **most** recently used (adding a block that is already there moves it to that end) |
# | `remove(block)` | `block` is in use again (a prefix hit revived it): take it out |
# | `pop_lru()` | remove and return the least recently used block |
# | `clear()` | remove every block and return them (a list) |
# | `len(ev)`, `iter(ev)` | how many; the blocks in eviction order, next victim first |
#
# All of them should be O(1) (iteration aside): `collections.OrderedDict` (or a plain `dict`, which keeps
# insertion order) does it. The evictor holds every block it is given, however many (no fixed capacity: any
# of a big pool's blocks can be evictable at once), and block ids are compared by value (`==`, as a dict does;
# never `is`). The checker runs random operation sequences against a model of LRU, then puts
# your class inside a real `BlockManager` (its `evictor_cls`) and checks which prompts still hit after
# evictions.

# %% nbgrader="answer"
class LRU:
    """Evictable cached blocks in LRU order."""

    def __init__(self):
        ### BEGIN SOLUTION
        self._order = OrderedDict()          # least recently used first
        ### END SOLUTION

    def add(self, block):
        ### BEGIN SOLUTION
        self._order.pop(block, None)         # re-adding refreshes
        self._order[block] = None
        ### END SOLUTION

    def remove(self, block):
        ### BEGIN SOLUTION
        del self._order[block]
        ### END SOLUTION

    def pop_lru(self):
        ### BEGIN SOLUTION
        return self._order.popitem(last=False)[0]
        ### END SOLUTION

    def clear(self):
        ### BEGIN SOLUTION
        blocks = list(self._order)
        self._order.clear()
        return blocks
        ### END SOLUTION

    def __len__(self):
        ### BEGIN SOLUTION
        return len(self._order)
        ### END SOLUTION

    def __iter__(self):
        ### BEGIN SOLUTION
        return iter(list(self._order))
        ### END SOLUTION


# %% nbgrader="graded" points=2
from minillm.grading.lab05 import check_lab05_3; check_lab05_3(LRU)

# %% [markdown]
# ## Plug in: your prefix cache inside the engine
#
# minillm's `BlockManager` takes all three pieces as seams: `hash_fn` (your `hash_block`), `prefix_lookup`
# (your `find_cached_prefix`, called over a read-only view of its cache, `cached_blocks`) and `evictor_cls` (your
# `LRU`). `engine.plug(hash_fn=..., prefix_lookup=..., evictor_cls=...)` gives the engine a fresh block manager
# built with them. We replay the three prompts of the picture and
# compare with an engine that has prefix caching **off**: greedy decoding must produce exactly the same
# tokens (a wrong hit would change them), and your cache should serve exactly as many tokens as minillm's.

# %%
def plug_yours():
    """A fresh block manager (an empty prefix cache) built with your three pieces."""
    engine.plug(hash_fn=hash_block, prefix_lookup=find_cached_prefix, evictor_cls=LRU)


plug_yours()
engine_off = LLMEngine.from_model(model, tok, block_size=BLOCK_SIZE, kv_cache_memory="64MiB",
                                  enable_prefix_caching=False)
for name, ids, own in (("A", prompt_a, row_a), ("B", prompt_b, row_b), ("A turn 2", prompt_a2, row_a2)):
    _, _, cached, out = admit_and_inspect(engine, ids, max_tokens=8)
    _, _, _, ref = admit_and_inspect(engine_off, ids, max_tokens=8)
    same = out.outputs[0].token_ids == ref.outputs[0].token_ids
    print(f"{name:9s} cached {cached:3d}/{len(ids)} tokens (minillm's cache: {own[2]:3d});  "
          f"same tokens as caching off: {same}  {out.outputs[0].text!r}")
print("your block manager:", engine.block_manager.stats)

# %% [markdown]
# ## Measurement: TTFT with the cache off and on
#
# Three workloads, each run request by request (so TTFT is the prefill itself, no queueing):
#
# 1. **default system prompt** — five different first questions; all share SmolLM2's short default system
#    prompt (24 tokens = 3 blocks of ~36);
# 2. **long system prompt** — the same questions behind a ~200-token system prompt, like a real product's
#    instructions (tool descriptions, policies, few-shot examples);
# 3. **multi-turn** — one conversation of five turns, each resending the whole history.
#
# The "on" engine uses your block manager; each workload starts from an empty cache, and the time is the best
# of two runs. **Expected shape:** with the default prompt the gain is small — only ~2/3 of a short prompt is
# cached, and on this CPU a short forward pass costs mostly the fixed price of reading the weights once. With
# the long system prompt, TTFT drops several-fold (only the question is computed). In the conversation,
# TTFT without the cache grows with the history; with it, it stays roughly flat, because each turn only
# computes its new message (the previous turns, replies included, are cached).

# %%
LONG_SYSTEM = (
    "You are Ada, the support assistant of Lisbon Bikes, a bicycle rental shop in Lisbon, Portugal. "
    "Answer in a friendly, concise way, in the language of the customer. Opening hours: every day from 9:00 to "
    "19:00, closed on December 25 and January 1. Prices: city bike 12 euros per day, e-bike 30 euros per day, "
    "children's bike 8 euros per day, weekly rentals get a 20 percent discount. Helmets and locks are included "
    "for free. Guided tours leave at 10:00 and 15:00 from the shop in Cais do Sodre and last three hours; they "
    "cost 35 euros including the bike. Never promise discounts that are not listed here. If you do not know an "
    "answer, say so and suggest calling the shop. Do not discuss topics unrelated to cycling, the shop, or "
    "visiting Lisbon.")

workloads = {
    "default system prompt": [build_prompt_ids(tok, q) for q in QUESTIONS[:5]],
    "long system prompt": [build_prompt_ids(tok, q, system=LONG_SYSTEM) for q in QUESTIONS[:5]],
}
history, conversation = [], []
for turn in TURNS[:5]:
    history.append({"role": "user", "content": turn})
    conversation.append(build_prompt_ids(tok, list(history)))
    history.append({"role": "assistant", "content": REPLY})
workloads["multi-turn"] = conversation


def ttft(eng, ids):
    t = time.perf_counter()
    eng.add_request(ids, SamplingParams(temperature=0, max_tokens=1))
    while eng.has_unfinished_requests():
        outs = eng.step()
    return time.perf_counter() - t, outs[-1].metrics.num_cached_tokens


ttft(engine_off, [5] * 32)                                     # warm-up
results = {}
t_start = time.perf_counter()
for name, prompts in workloads.items():
    best_off, best_on = [float("inf")] * len(prompts), [float("inf")] * len(prompts)
    for _ in range(2):
        plug_yours()                                            # an empty cache for each run
        cached = []
        for i, ids in enumerate(prompts):                       # off and on interleaved: same machine load
            best_off[i] = min(best_off[i], ttft(engine_off, ids)[0])
            t_on, c = ttft(engine, ids)
            best_on[i] = min(best_on[i], t_on)
            cached.append(c)
    stats = engine.block_manager.stats
    results[name] = dict(off=best_off, on=best_on, lens=[len(p) for p in prompts], cached=cached,
                         hit_rate=stats.hit_rate)
    r = results[name]
    print(f"{name:22s} prompts {min(r['lens'])}-{max(r['lens'])} tokens; cached {sum(cached)}/{sum(r['lens'])} "
          f"prompt tokens, block hit rate {stats.hit_rate:.0%}; mean TTFT from the 2nd request on: "
          f"off {1000 * statistics.mean(best_off[1:]):.0f} ms, on {1000 * statistics.mean(best_on[1:]):.0f} ms")
print(f"measured in {time.perf_counter() - t_start:.0f} s")

plots.prefix_cache_ttft(results)

# %% [markdown]
# ## Interview questions
#
# <details><summary><b>What is prefix (prompt) caching, and how does an engine implement it?</b></summary>
#
# It keeps the KV cache of prompts after their requests finish and reuses it for later prompts that start
# with the same tokens, so only the new suffix is prefilled. In a paged engine the unit is the KV block:
# each full block is registered under a chained hash of its tokens and its parent's hash (Task 1), a new
# prompt walks its blocks and reuses the longest chain of verified hits (Task 2), and reused blocks are
# simply shared between block tables with ref counts — no copy. Finished requests leave their blocks
# cached-but-evictable, and an LRU policy reclaims them only under memory pressure (Task 3). vLLM does exactly
# this ("automatic prefix caching"); SGLang keeps the same information in a radix tree of token sequences.
# Only the prefill is saved; decode speed is unchanged.
# </details>
#
# <details><summary><b>When does prompt caching save cost, and when does it not?</b></summary>
#
# It saves prefill compute and TTFT in proportion to the cached share of the prompt: long shared system
# prompts, tool definitions, few-shot examples, a document asked about repeatedly, multi-turn chats and agent
# loops that resend a growing history. In this lab a ~200-token shared system prompt cut TTFT several-fold and
# the conversation's TTFT stayed flat instead of growing with the history, while SmolLM2's short 24-token
# default prompt gained little (a short forward pass mostly pays the fixed cost of reading the weights). It
# does nothing when the shared part is short, when something varying comes *first* (a timestamp or user name
# at the top of the system prompt breaks every block after it: put static content first), when matching only
# partial blocks, or when the cache is evicted before the prefix comes back (low traffic for that prefix,
# memory pressure). API providers pass it on as cheaper "cached input tokens" (typically 50–90% off input
# price), sometimes with a surcharge for writing the cache.
# </details>
#
# <details><summary><b>How do you reuse the KV cache across turns of a conversation? What are the trade-offs?</b></summary>
#
# Each turn's prompt is the previous prompt + the model's reply + the new message, so with a block-level
# prefix cache the previous turn's blocks — including the reply, whose KV was computed during decoding — are
# hit automatically; in the picture from the run above, most of A's second turn came from the cache, and the
# measured multi-turn TTFT stayed roughly flat. The price is memory: idle conversations keep blocks that new requests
# might need, which is why they are evictable (free capacity that happens to hold useful data) and reclaimed
# LRU; keeping them longer means offloading KV to CPU memory or SSD (vLLM's KV offloading, LMCache) and paying
# the transfer. Consistency is by construction: keys are content hashes of the whole prefix, so there is
# nothing to invalidate, but everything that changes the KV must be in the key (model and LoRA adapter,
# multimodal inputs, a per-tenant salt), and the chat template must re-tokenize the reply to the same tokens,
# or the turn misses (slower, never wrong).
# </details>
#
# <details><summary><b>What is cache-aware routing, and why does it matter with many replicas?</b></summary>
#
# Every replica has its own KV cache, so with round-robin routing the next turn of a conversation lands on a
# replica that has never seen its prefix: with N replicas the hit rate falls to about 1/N of what one engine
# would get, and each replica wastes memory caching the same prefixes. A cache-aware router sends requests
# sharing a prefix to the replica that holds it: hash the first blocks of the prompt (or use a session id)
# with consistent hashing, or keep an approximate radix tree of what each replica caches and score replicas
# by expected cached tokens minus load (SGLang's router, llm-d, NVIDIA Dynamo). It must stay load-aware: a
# prefix everyone shares (the product's system prompt) should be cached on every replica, not pin all
# traffic to one. This only works because the block hash is deterministic across processes (Task 1): the
# router and the engines must compute the same keys.
# </details>
#
# <details><summary><b>Can prefix caching return a wrong answer or leak data?</b></summary>
#
# Wrong answers come from reusing KV that belongs to another prefix: a key without the parent (the same
# tokens at another position), a hash collision trusted without checking, or a weak hash (Python's 64-bit
# `hash()` can be collided on purpose). minillm chains 128-bit BLAKE2b hashes and still verifies each hit
# against the block's stored tokens and parent (Task 2), so a collision costs a miss, never a wrong token —
# the plug-in step checks that outputs equal the cache-off engine's. The leak is a timing side channel: a
# fast TTFT tells an attacker that someone else recently sent the same prefix, so multi-tenant services
# isolate caches per tenant (a salt mixed into the first block's hash) or disable sharing for sensitive
# prompts.
# </details>

# %% [markdown]
# ### More from the question bank
#
# Every interview question this lab answers, with the project's answer, key points and the code that backs it
# (the same bank `minillm quiz --lab lab05` rehearses in a terminal, with spaced repetition):

# %%
from minillm.quiz import show
show(lab="lab05")
