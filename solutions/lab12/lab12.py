# ---
# jupyter:
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Lab 12 — From one engine to a fleet
#
# **The question.** *"Design the serving tier for a chat product: 10,000 requests per second at peak, p99 time to
# first token under half a second. How many GPUs, in what layout, behind what load balancer — and what happens when
# one of them dies?"*
#
# Nobody answers that by buying GPUs and trying. You answer it with a **model of one engine step**, measured on the
# real engine, and a **simulation of many engines** that runs that model instead of the GPU: thousands of simulated
# requests per second of wall time, every scheduling decision made by the engine's own scheduler (`minillm fleet`,
# docs/fleet.md). Two pieces carry the answer, and you write both:
#
# * **the step-time model**: how long one engine step takes, from what it computes. You fit it to steps the real
#   engine recorded. Get its shape wrong and every number downstream — capacity, latency, GPU count — is wrong;
# * **the router**: which replica a new request goes to. Each replica has its own prefix cache (lab05); a router
#   that ignores it throws away the cached system prompts and conversation histories, one that follows it blindly
#   buries one replica under a popular prefix.
#
# **What you will measure.** Your fitted model against held-out steps of the real engine; your router against
# round-robin and least-loaded routing in a simulated fleet (prefix hit rate, p99 TTFT), with and without its load
# bound; then the fleet a design prompt needs, replicas against tensor parallelism, checked by simulation.
#
# Answer cells say `raise NotImplementedError()` until you fill them in; the graded cell after each one (don't edit
# it) prints nothing when you are right, and the smallest counter-example with a hint when not.

# %% nbgrader="readonly"
import math

import numpy as np

from minillm import plots
from minillm.fleet import calibrate, workloads
from minillm.fleet.planner import Demand, plan, report, simulate_slice, size
from minillm.fleet.policies import Autoscaler
from minillm.fleet.replica import Replica, ReplicaConfig
from minillm.fleet.routers import LeastTokens, RoundRobin
from minillm.fleet.simulator import simulate
from minillm.fleet.step_model import COEFFS, StepFeatures, StepModel, fit, from_roofline

# %% [markdown]
# ## One step: a maximum, not a sum
#
# With continuous batching and chunked prefill (lab04), one engine step runs the decodes of every running sequence
# *and* chunks of new prompts in a single forward pass. What does that pass cost? Two things bound it:
#
# * **memory**: the weights are read once per step, whatever the batch, plus every sequence's KV context;
# * **compute**: FLOPs per token (the matmuls) plus the attention's (query, key) pairs.
#
# They overlap: while the GPU streams the weights, the matmul units work on what has arrived. So a step takes the
# **larger** of the two, not their sum — the reason a decode batch can take prompt tokens "for free" until compute
# catches up with the weight reads (Sarathi-Serve builds its scheduler on exactly this). Add a serial overhead
# (Python, sampling, launches) and you have minillm's step model:
#
# $$t = o_{step} + o_{seq}\cdot\text{seqs} + \max\big(c_{token}\cdot\text{tokens} + c_{pair}\cdot\text{pairs},\;
# m_{step} + m_{kv}\cdot\text{kv\_tokens}\big)$$
#
# Here is that model for Llama-3.1-8B on an H100, its coefficients read off the datasheet roofline
# (`from_roofline`): 32 sequences decoding at 2,000 tokens of context each, and a prompt chunk of growing size
# joining their step.

# %%
h100 = from_roofline("llama-3.1-8b", "h100-sxm")
chunk_sizes = list(range(0, 1025, 32))
decoding = [(2000, 1, 1000)] * 32                     # (computed before, new tokens, prompt length) per sequence
steps = [StepFeatures.of(decoding + ([(0, p, p)] if p else [])) for p in chunk_sizes]
plots.step_time_curve(chunk_sizes, {"max(compute, memory): one pass": [h100.seconds(f) for f in steps],
                                    "compute + memory: as if one after the other":
                                        [StepModel(h100.coeffs, "sum").seconds(f) for f in steps]},
                      "Llama-3.1-8B on an H100: 32 decodes + one prompt chunk")

# %% [markdown]
# Flat, then rising: up to a few hundred prompt tokens the step is memory bound and the chunk rides along for free;
# past the knee it is compute bound and every token costs. The sum has no flat part: it would tell a planner that
# chunked prefill slows every decode, which is wrong, and it would size the fleet for costs that overlap.
#
# We have no H100 here, so the traces you fit come from the real engine on this machine: a 2-layer random model
# (`calibrate.tiny_engine`), run over a spread of batch sizes, prompt lengths and mid-run arrivals, every step
# recorded through the engine's public step observer (`minillm fleet calibrate` does the same on SmolLM2). Each
# scenario's steps are a list of `StepTrace(features, seconds)`:

# %%
engine = calibrate.tiny_engine()
recorded = calibrate.record(engine, calibrate.default_scenarios(quick=True), progress=False)
train = [t for i, steps in enumerate(recorded) if i % 4 != 3 for t in steps]      # 3 scenarios of 4 to fit
held_out = [t for i, steps in enumerate(recorded) if i % 4 == 3 for t in steps]   # the 4th: never seen by a fit
print(f"{len(train)} steps to fit, {len(held_out)} held out; for example")
for t in train[:3] + train[-2:]:
    print(f"  {t.seconds * 1e3:6.2f} ms  {t.features}")

# %% [markdown]
# ## Task 1 — fit the step model (3 points)
#
# Write `fit_step_model(traces)`: given a list of `StepTrace`s (`t.seconds`, and `t.features` with
# `prefill_tokens`, `decode_tokens`, `tokens` = their sum, `kv_tokens`, `attn_pairs`, `num_seqs`), return the six
# coefficients of the model above as a dict of floats, seconds per unit:
# `{"o_step", "o_seq", "c_token", "c_pair", "m_step", "m_kv"}`.
#
# The maximum makes this more than one least-squares solve: each step sits on one side of it, and which side
# depends on the coefficients you are looking for. But if you knew the sides, the rest would be linear. Error in
# *relative* terms is what matters (a 1 ms step and a 100 ms step should count alike). And no cost is negative: a
# coefficient below zero, which noisy steps can pull out of a plain least-squares solve, predicts negative time
# for some batch the traces never had, and the simulator refuses a model that does.
#
# Your fit is judged by what it predicts: on steps drawn from known coefficients with a little noise (decodes over
# long and short contexts, prompt chunks, mixes of both), your coefficients, run as minillm's `StepModel` — what the
# simulator and the planner run — must predict fresh steps within 5 % (90th percentile). `numpy` is all you need.

# %% nbgrader="answer"
def fit_step_model(traces):
    """The six coefficients (seconds per unit) of the max-form step model that best explain `traces`."""
    ### BEGIN SOLUTION
    y = np.array([t.seconds for t in traces])
    tokens = np.array([t.features.tokens for t in traces], float)
    pairs = np.array([t.features.attn_pairs for t in traces], float)
    kv = np.array([t.features.kv_tokens for t in traces], float)
    seqs = np.array([t.features.num_seqs for t in traces], float)
    ones = np.ones_like(y)

    def solve(compute_bound):
        c, m = compute_bound.astype(float), 1.0 - compute_bound
        rows = np.stack([ones, seqs, c * tokens, c * pairs, m, m * kv], axis=1) / y[:, None]   # relative error
        x, free = np.zeros(6), np.ones(6, bool)
        while True:                     # a coefficient the solve makes negative is held at 0, the rest refitted
            x[:] = 0.0
            x[free] = np.linalg.lstsq(rows[:, free], ones, rcond=None)[0]
            if (x >= 0).all():
                break
            free &= x > 0
        compute, memory = x[2] * tokens + x[3] * pairs, x[4] + x[5] * kv
        error = np.sum(((x[0] + x[1] * seqs + np.maximum(compute, memory)) / y - 1) ** 2)
        return x, error, compute >= memory

    best, best_error = None, math.inf
    for guess in (tokens / np.maximum(kv, 1) > r for r in (0.01, 0.1, 0.5)):   # a few first guesses of the sides
        for _ in range(30):
            x, error, sides = solve(guess)
            if error < best_error:
                best, best_error = x, error
            if (sides == guess).all():
                break
            guess = sides
    return dict(zip(("o_step", "o_seq", "c_token", "c_pair", "m_step", "m_kv"), map(float, best)))
    ### END SOLUTION


# %% nbgrader="graded" points=3
from minillm.grading.lab12 import check_lab12_1; check_lab12_1(fit_step_model)

# %% [markdown]
# ## Plug in: your model of this machine
#
# On a CPU the engine runs a decode-only step as one fused C call and any step with prompt tokens through the
# model's layers (lab00): two code paths, each with its own fixed costs. So, like `minillm fleet calibrate`, fit
# each kind of step on its own — your function, twice — and give the simulator a `StepModel` with both sets of
# coefficients. Then predict the held-out scenarios' steps, next to minillm's own fit and to the sum form.

# %%
def as_model(decode_coeffs, prefill_coeffs):
    zero = dict.fromkeys(COEFFS, 0.0)
    return StepModel(zero | decode_coeffs, prefill_coeffs=zero | prefill_coeffs, source="your fit")


decode_steps = [t for t in train if not t.features.prefill_tokens]
prompt_steps = [t for t in train if t.features.prefill_tokens]
yours = as_model(fit_step_model(decode_steps), fit_step_model(prompt_steps))
models = {"your fit": yours, "minillm fleet calibrate's fit": fit(train, split=True),
          "sum form (compute + memory)": fit(train, form="sum", split=True)}
for name, m in models.items():
    e = m.relative_errors(held_out)
    print(f"{name:>30}: held-out error median {np.median(e):6.1%}, p90 {np.quantile(e, 0.9):6.1%}")
plots.step_fit([t.seconds for t in held_out],
               {name: [m.seconds(t.features) for t in held_out] for name, m in models.items()})

# %% [markdown]
# The points should hug the diagonal from a fraction of a millisecond (small decode batches: overhead) to tens of
# milliseconds (long prompt chunks: compute). Your fit and minillm's solve the same problem, so they land close
# together. A tiny model on a CPU barely reads any weights, so here the max and the sum differ little — the H100
# curve above is where they part; what this machine adds is noise: a busy machine's steps scatter, and so does any
# fit of them (calibrate on a quiet one).
#
# ## Task 2 — a prefix-aware router (4 points)
#
# A fleet is replicas behind a router. `minillm.fleet.simulator.simulate(requests, replicas, router)` asks the
# router where each arriving request goes: `router.route(request, replicas)` returns an index into `replicas`,
# the replicas that take requests *now* (fewer after a failure, more after a scale-up), each showing
# `num_requests` (requests it holds) and `outstanding_tokens`; `request.prompt` is the list of prompt token ids.
#
# Write `PrefixRouter(num_replicas, block_size, prefix_blocks, epsilon)` — consistent hashing with bounded loads
# (Mirrokni, Thorup and Zadimoghaddam, 2018), keyed by the prompt's prefix:
#
# * **the key** is the prompt's first `min(prefix_blocks, len(prompt) // block_size)` *full* blocks: a prefix
#   cache keeps whole blocks only, and the leading blocks are what a conversation's turns, or a document's
#   readers, have in common. A prompt shorter than one block has no key: send it to the replica with the fewest
#   `outstanding_tokens` (the lowest index on a tie);
# * **a ring**: hash points for every replica (many per replica — virtual nodes — so each owns a fair share)
#   and the key onto one circle; the key belongs to the first replica clockwise. `num_replicas` is the most
#   replicas there can be: skip points of replicas that are not there now (index ≥ `len(replicas)`), so a
#   smaller fleet moves only the keys of the replicas that left;
# * **a load bound**: walking clockwise, skip any replica already holding `ceil((1 + epsilon) × (total + 1) / n)`
#   requests or more (`total` over the `n` replicas, the new request counted);
# * the same request and loads always give the same answer (no turn counter, no randomness).
#
# Any stable hash does: `hashlib` over the token ids, or the prefix cache's own chained block hash
# (`minillm.kv.prefix_cache.default_hash_fn(parent, block_tokens)`, lab05).

# %% nbgrader="answer"
class PrefixRouter:
    """Consistent hashing of the prompt's leading full blocks, with bounded load."""

    def __init__(self, num_replicas, block_size, prefix_blocks, epsilon):
        ### BEGIN SOLUTION
        import hashlib

        def point(text):
            return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")
        self.point = point
        self.block_size, self.prefix_blocks, self.epsilon = block_size, prefix_blocks, epsilon
        ring = sorted((point(f"replica {r} point {v}"), r) for r in range(num_replicas) for v in range(64))
        self.points = [p for p, _ in ring]
        self.owners = [r for _, r in ring]
        ### END SOLUTION

    def route(self, request, replicas):
        ### BEGIN SOLUTION
        import bisect
        n = len(replicas)
        blocks = min(self.prefix_blocks, len(request.prompt) // self.block_size)
        if blocks == 0:
            return min(range(n), key=lambda i: (replicas[i].outstanding_tokens, i))
        key = self.point(" ".join(map(str, request.prompt[:blocks * self.block_size])))
        cap = math.ceil((1 + self.epsilon) * (sum(r.num_requests for r in replicas) + 1) / n)
        start = bisect.bisect(self.points, key)
        for j in range(len(self.points)):
            r = self.owners[(start + j) % len(self.points)]
            if r < n and replicas[r].num_requests < cap:
                return r
        ### END SOLUTION


# %% nbgrader="graded" points=4
from minillm.grading.lab12 import check_lab12_2; check_lab12_2(PrefixRouter)

# %% [markdown]
# ## Plug in: your router and your model in a simulated fleet
#
# Four replicas, each this machine's engine as your step model describes it, with the engine's own scheduler and a
# KV pool of 2,000 blocks; multi-turn chat sessions arriving at 150 requests per second, every turn resending the
# conversation so far after a shared 150-token system prompt. Five routers take the same requests: round-robin,
# least outstanding tokens, yours keyed by 16 blocks (past the system prompt: one key per conversation), yours keyed
# by 4 blocks (inside the system prompt: one key for everybody), and that last one without a load bound.

# %%
cfg = ReplicaConfig(num_blocks=2000, block_size=16, max_num_seqs=engine.config.scheduler.max_num_seqs,
                    max_num_batched_tokens=engine.config.scheduler.max_num_batched_tokens)
routers = {"round-robin": RoundRobin(), "least tokens": LeastTokens(),
           "yours, 16 blocks": PrefixRouter(4, 16, 16, 0.25), "yours, 4 blocks": PrefixRouter(4, 16, 4, 0.25),
           "yours, 4 blocks, no bound": PrefixRouter(4, 16, 4, 1e9)}
runs = {}
for name, router in routers.items():
    requests = workloads.multi_turn(150.0, 6.0, seed=0, think_s=2.0)
    runs[name] = simulate(requests, [Replica(yours, cfg) for _ in range(4)], router, name)
    r = runs[name].row()
    print(f"{name:>26}: prefix hit {r['prefix_hit']:4.0%}  TTFT p50 {r['ttft_p50_ms']:6.1f} ms  p99 "
          f"{r['ttft_p99_ms']:7.1f} ms  TPOT p99 {r['tpot_p99_ms']:5.2f} ms  ({r['finished']} requests)")
plots.latency_cdfs({name: {"ttft": res.ttft.cdf(), "tpot": res.tpot.cdf()} for name, res in runs.items()})

# %% [markdown]
# Round-robin and least-tokens find a conversation's history only when they happen to pick the replica that served
# its last turn again (one time in four, with four replicas); every other turn re-prefills it. Keyed past the system
# prompt, your router sends every turn where the history is: the hit rate jumps, and with it the p99 TTFT falls —
# the tail is made of long histories recomputed.
# Keyed inside the system prompt, every request has the same key: the bound spreads them over the ring, and the
# stickiness is gone. Without the bound, that one key sends *everything* to one replica: the hit rate is fine, the
# latency is not — a queue on one replica while three idle. (On another machine the milliseconds differ; the order
# does not.)
#
# A fleet that changes size is why `num_replicas` is the *most* replicas there can be. Here the same router behind
# an autoscaler that watches the queue (bursty arrivals, replicas routable two seconds after they are started,
# drained when idle):

# %%
scaler = Autoscaler("queue", low=0.5, high=4.0, min_replicas=1, max_replicas=8, cold_start_s=2.0, interval_s=0.5)
bursty = workloads.multi_turn(100.0, 8.0, seed=1, think_s=2.0, cv=3.0)
scaled = simulate(bursty, [Replica(yours, cfg)], PrefixRouter(8, 16, 16, 0.25), "yours, autoscaled",
                  autoscaler=scaler, new_replica=lambda: Replica(yours, cfg))
print(f"{scaled.finished} requests, up to {scaled.row()['peak_replicas']} replicas, {scaled.replica_seconds:.0f} "
      f"replica-seconds billed; TTFT p99 {scaled.ttft.quantile(0.99) * 1e3:.0f} ms, prefix hit "
      f"{scaled.prefix_hit_rate:.0%}")
plots.replica_timeline({"yours, autoscaled": scaled.timeline})

# %% [markdown]
# The solid line is what takes requests, the dashed line what is billed: the gap is the cold start (a real replica
# loads tens of GB of weights: minutes, not two seconds) and the drain. A queue signal reacts to bursts that GPU
# utilisation would miss (a decode-bound GPU looks busy at any load); the cold start is why fleets keep headroom.
#
# ## Measurement: sizing a fleet for the design prompt
#
# Back to the question: Llama-3.1-8B, 10,000 requests per second of 1,000-token prompts and 200-token answers, p99
# TTFT ≤ 500 ms and p99 TPOT ≤ 50 ms, H100s at $3 an hour. `plan` does what you would do by hand: for each tensor
# parallel size (and a prefill/decode split), the step model says how many requests per second one replica sustains
# within the SLO (Little's law: the decodes in flight and the prompt tokens per step at that rate, solved for the
# step time), the demand divides into replicas, and the cheapest layouts are *simulated* — a slice of the fleet at
# its share of the load — because a p99 is a queueing question no closed form answers well.

# %%
design = Demand(rps=10_000, prompt_len=1000, output_len=200, ttft_p99_s=0.5, tpot_p99_s=0.05, usd_per_gpu_hour=3.0)
print(report(plan("llama-3.1-8b", "h100-sxm", design, verify=2, duration=10.0, disaggregate=True)))

# %% [markdown]
# Read it as an interview answer: the weights (16 GB) fit one GPU with room for KV, so TP=1 replicas are the
# cheapest way to buy throughput — each TP step up splits the weight reads (lower TPOT) but buys fewer requests per
# GPU; disaggregating prefill from decode pays when long prompts stall decodes past the TPOT target, not here.
# Then add what the plan leaves out: N+k replicas for failures and rollouts, headroom for bursts the autoscaler
# cannot start in time, and a router that keeps each conversation's KV where it is.
#
# The same sizing runs on *your* model of this machine: how many replicas of the tiny engine would 2,000 requests
# per second of 128 + 32 tokens need, within 200 ms TTFT and 20 ms TPOT at p99?

# %%
small = Demand(rps=2000, prompt_len=128, output_len=32, ttft_p99_s=0.2, tpot_p99_s=0.02)
layout = size(yours, cfg, small, tp=1)
print(f"sized: {layout.replicas} replicas of {layout.capacity_rps:.0f} req/s each"
      if not layout.rejected else f"rejected: {layout.rejected}")
if not layout.rejected:
    checked = simulate_slice(yours, cfg, small, layout.replicas, 4.0)
    print(f"simulated {checked.router}: TTFT p99 {checked.ttft.quantile(0.99) * 1e3:.1f} ms, TPOT p99 "
          f"{checked.tpot.quantile(0.99) * 1e3:.2f} ms over {checked.finished} requests")

# %% [markdown]
# ## Questions
#
# <details><summary><b>Design a serving tier for 10,000 requests per second. Where do you start?</b></summary>
#
# From the workload and the SLO, not the hardware: request rate at peak, prompt and output length distributions,
# how much prompt is shared, p99 TTFT and TPOT targets. Measure (or take from a roofline) one replica's step time
# as a function of its batch, turn it into a per-replica capacity within the SLO, and divide the peak by it. Pick
# the smallest tensor-parallel size that fits the weights with enough KV, unless latency needs more. Then check the
# tail by simulation or a load test, because queueing sets p99. Add replicas for failures and rollouts, route by
# prefix with a load bound, autoscale on queue depth, and cap admission so overload becomes fast refusals.
# </details>
#
# <details><summary><b>Why route by prefix, and why bound the load?</b></summary>
#
# Each replica's prefix cache holds the KV of the prompts it served. Sending a request where its leading blocks
# already are skips their prefill: shorter TTFT, less compute, for conversations, shared documents and long system
# prompts alike. Hashing the prefix (not the whole prompt, which always differs somewhere) onto a consistent-hash
# ring keeps that mapping when replicas come and go. But popularity is skewed: one hot prefix would put all its
# traffic on one replica. The bound — at most (1 + ε) times the mean load — sends the overflow to the next replica
# on the ring, trading a little cache locality for a balanced fleet.
# </details>
#
# <details><summary><b>When does disaggregating prefill and decode pay off?</b></summary>
#
# When long prompts interfere with decoding: a big prefill in a mixed step stretches every running sequence's TPOT,
# and chunked prefill only spreads that cost. Separate prefill replicas (sized for TTFT) and decode replicas (sized
# for TPOT and KV capacity) remove the interference and let each pool use its own parallelism and batch size. The
# price is moving the prompt's KV between them (hundreds of MB for long prompts over a link of tens to hundreds of
# GB/s) and two pools to balance. With short prompts, or a loose TPOT target, one unified pool is cheaper.
# </details>
#
# <details><summary><b>A replica dies. What happens to its requests, and what does it cost?</b></summary>
#
# Its requests lose their KV. The router stops sending to it, and the requests in flight are retried elsewhere,
# resuming after the tokens already streamed: the new replica recomputes the prompt plus those tokens (the lost
# work), so their TTFT-like stall is one long prefill. Consistent hashing moves only the dead replica's keys, so the
# other replicas' prefix caches stay warm; its keys go cold until its successor has served them once. Capacity drops
# by one replica until the repair or a replacement warms up, which is why fleets keep N+k headroom.
# </details>

# %% [markdown]
# ### More from the question bank
#
# Every interview question this lab answers, with the project's answer and key points (the same bank
# `minillm quiz --lab lab12` rehearses in a terminal):

# %%
from minillm.quiz import show
show(lab="lab12")
