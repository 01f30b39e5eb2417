# ---
# jupyter:
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Lab 06 — Sampling
#
# **The question.** *"We send the same prompt twice and get two different answers. What do temperature, top-k
# and top-p actually do to the model's output, which one would you use when, and how do you make a sampled
# answer reproducible, even when the server batches your request with other people's?"*
#
# A language model does not pick words: for the next position it returns one **logit** per vocabulary token
# (49 152 of them for SmolLM2). Everything after that is the engine's choice. **Greedy** decoding takes the
# largest logit. **Sampling** turns the logits into a probability distribution and draws from it, after
# reshaping that distribution: **temperature** sharpens or flattens it, and **min-p**, **top-k** and **top-p**
# cut off its long tail of unlikely tokens. A server applies all of this to a whole batch in one pass, and
# every request in the batch brings its own settings and, optionally, its own **seed**.
#
# **What you will build.** The two halves of minillm's sampler: `process_logits`, which applies each row's
# temperature, min-p, top-k and top-p to a batch of logits, and `draw`, which picks one token per row, each
# row with its request's own random generator. Then you plug both into the engine running SmolLM2.
#
# **What you will measure.** How much of SmolLM2's next-token distribution each setting keeps, on a prompt
# where the model is sure of itself and on one where it is not; whether your draws really follow the
# distribution you computed (a chi-square test); and whether a seeded request gets the same tokens alone and
# inside batches of other requests.
#
# Answer cells say `raise NotImplementedError()` until you fill them in; the graded cell after each one
# (don't edit it) prints nothing when you are right, and the smallest counter-example with a hint when not.

# %% nbgrader="readonly"
import os

os.environ.setdefault("TRITON_INTERPRET", "1")   # before anything imports minillm.kernels

import time

import torch

from minillm import plots
from minillm.engine.llm_engine import LLMEngine
from minillm.loading.loader import load_model
from minillm.sampling.params import SamplingParams
from minillm.sampling.sampler import Sampler
from minillm.testing import chi_square

loaded = load_model("default", "float32")
model, tok = loaded.model, loaded.tokenizer
engine = LLMEngine.from_model(model, tok, kv_cache_memory="64MiB")
V = model.cfg.vocab_size
print(f"SmolLM2: a vocabulary of {V} tokens; KV pool {engine.block_manager.num_blocks} blocks")

# %% [markdown]
# ## What the model hands the sampler
#
# To look at real next-token distributions we plug a sampler that keeps a copy of the logits it receives (it
# is minillm's own `Sampler` otherwise) and run one greedy step for two prompts:
#
# * `"The capital of France is"`: the model is fairly sure what comes next;
# * `"Once upon a time, there was a"`: many continuations are fine.
#
# The bars are the 30 most likely tokens at temperature 1 (the distribution as the model was trained to
# produce it), the line is their cumulative probability.

# %%
class LogitsTap(Sampler):
    """minillm's Sampler, keeping a copy of the last logits it was given: [B, V], one row per sequence."""

    def __call__(self, logits, batch):
        self.logits = logits.clone()
        return super().__call__(logits, batch)


def next_token_logits(prompt):
    """The model's logits for the token after `prompt` (raw text, no chat template): one greedy step."""
    tap = LogitsTap()
    engine.plug(sampler=tap)
    engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=1))
    while engine.has_unfinished_requests():
        engine.step()
    engine.plug(sampler=Sampler())
    return tap.logits[0]


PROMPTS = {"peaked": "The capital of France is", "flat": "Once upon a time, there was a"}
LOGITS = {name: next_token_logits(p) for name, p in PROMPTS.items()}


def show_token(t):
    return repr(tok.decode([int(t)]))[1:-1]


plots.next_token_distributions(LOGITS, PROMPTS, show_token)

# %% [markdown]
# Two shapes, two problems. On the peaked prompt, `" Paris"` has most of the probability, but the tail is
# not empty: the 49 000-odd tokens outside the top 30 still hold about 6% together, so at T = 1 about one
# sample in sixteen comes from there. On the flat prompt, the 30 most likely tokens hold only about half the
# probability; the other half is spread over thousands of tokens, each unlikely on its own — and *together*
# they get picked about half the time. One bad token is enough to
# derail a generation (the following tokens are conditioned on it). The transforms below exist to control
# that tail, and the two shapes show why a single fixed rule (keep 20 tokens) cannot suit both.

# %% [markdown]
# ## Task 1 — `process_logits`: one batch, one setting per row (4 points)
#
# Write `process_logits(logits, temperature, top_k, top_p, min_p) -> Tensor [B, V]`:
#
# * `logits`: float32 `[B, V]`, one row per sequence in the batch; `temperature`, `top_p`, `min_p`: float32
#   `[B]`; `top_k`: int64 `[B]`. Row `i` uses **its own** `temperature[i]`, `top_k[i]`, `top_p[i]`,
#   `min_p[i]` (in a server, every request in the batch has its own settings).
# * Return the logits row `i` samples from: same shape, float32, with **`-inf`** for every dropped token (the
#   sampler then takes a softmax, and `exp(-inf) = 0`). Don't return probabilities.
#
# Per row, in this order (vLLM's):
#
# 1. **temperature** — divide the logits by `T` (> 0 here: greedy rows, `T = 0`, never reach this function).
#    Every step below looks at the distribution of `logits / T`.
# 2. **min-p** — drop token `j` when `p_j < min_p · p_max`, with `p = softmax(logits / T)` (`min_p = 0`: off).
#    The cut is relative to how sure the model is.
# 3. **top-k** — keep the tokens whose logit is at least the `k`-th largest of the row; tokens *tied* with the
#    k-th value stay too (`top_k <= 0` or `top_k >= V`: off; note that the engine sends `-1` as well as `0`).
# 4. **top-p** (nucleus) — over what is left, **renormalized**, keep the smallest set of most likely tokens
#    whose probability **reaches** `top_p`: going from the most likely token down, keep a token while the
#    mass of the tokens *strictly ahead of it* is still below `top_p`. So the token that crosses `top_p`
#    stays, and the most likely token always stays. `top_p = 1`: off.
#
# Hints, if you want them: a row's setting becomes a column with `temperature[:, None]`, which then
# broadcasts against `[B, V]`, so no Python loop over rows is needed (a loop is accepted, though). For min-p,
# `p_j < min_p · p_max` can be compared in log space (`log_softmax`), which never overflows. For the k-th
# largest value, `torch.topk` or `torch.sort` along the last dimension, then `gather` with a column of indices.
# For top-p, sort the probabilities, `cumsum`, and bring the decisions back to vocabulary order with `scatter`
# (or index with the sort's indices). The checker tries logits around ±1000, ties, `k` of 0, -1, 1 and beyond
# `V`, and rows whose settings differ.

# %% nbgrader="answer"
def process_logits(logits, temperature, top_k, top_p, min_p):
    """Each row with its own settings: temperature -> min-p -> top-k -> top-p. Dropped tokens get -inf."""
    ### BEGIN SOLUTION
    B, V = logits.shape
    x = logits / temperature[:, None]                              # 1. temperature, one per row
    # 2. min-p: keep log p_j >= log p_max + log(min_p); log(0) = -inf keeps everything when min_p = 0
    logp = torch.log_softmax(x, dim=-1)
    floor = logp.max(dim=-1, keepdim=True).values + torch.log(min_p)[:, None]
    x = x.masked_fill(logp < floor, float("-inf"))
    # 3. top-k: keep what is at least the k-th largest value (k <= 0 or k >= V: every token)
    k = torch.where((top_k > 0) & (top_k < V), top_k, torch.full_like(top_k, V))
    kth = x.topk(int(k.max()), dim=-1).values.gather(-1, (k - 1)[:, None])
    x = x.masked_fill(x < kth, float("-inf"))
    # 4. top-p over what is left (softmax renormalizes): keep a token while the mass strictly ahead of it < top_p
    p_sorted, order = torch.softmax(x, dim=-1).sort(dim=-1, descending=True)
    ahead = p_sorted.cumsum(dim=-1) - p_sorted
    drop_sorted = (ahead >= top_p[:, None]) & (top_p[:, None] < 1)
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)    # back to vocabulary order
    return x.masked_fill(drop, float("-inf"))
    ### END SOLUTION


# %% nbgrader="graded" points=4
from minillm.grading.lab06 import check_lab06_1; check_lab06_1(process_logits)

# %% [markdown]
# ## Task 2 — `draw`: one token per row, each row with its own generator (3 points)
#
# Write `draw(probs, generators) -> Tensor [B]`:
#
# * `probs`: float32 `[B, V]`, each row a distribution (already normalized: the softmax of your
#   `process_logits`; dropped tokens have probability exactly 0);
# * `generators`: a list of `B` entries, `generators[i]` a `torch.Generator` for a request that asked for a
#   seed (`SamplingParams(seed=...)`), or `None` (use torch's global generator);
# * return one token id per row, an int64 tensor of shape `[B]`: token `j` with probability `probs[i, j]`.
#
# The point of a per-request generator: a seeded request must get **the same tokens whatever else is in the
# batch** — alone, next to three other requests, at another position, after other requests already used
# torch's global generator. So row `i` may use `generators[i]` and nothing else, and must take from it only
# the random numbers row `i` needs. And a generator is a stream: calling `draw` again with the same generator
# must continue the stream, not restart it (the engine calls `draw` once per decode step).
#
# Hints: every random function of torch takes `generator=` (`torch.multinomial`, `torch.rand`,
# `Tensor.exponential_`); `torch.multinomial(p, 1)` returns a tensor of shape `[1]` for a vector `p` and
# `[B, 1]` for a matrix. The checker counts thousands of your draws against `probs` (chi-square tests), and
# moves seeded rows around batches. Exactly means exactly: a token of probability 1e-6 next to one of 0.9996 must
# come out too, and a uniform `u` that falls exactly on a cumulative sum belongs to the NEXT token (token `j` owns
# `u` in `[cdf[j-1], cdf[j])`). For the usual ways of drawing (`torch.multinomial`, an inverse CDF on one
# `torch.rand`), the checker picks generator states whose random numbers land on such rare tokens and edges.

# %% nbgrader="answer"
def draw(probs, generators):
    """One token id per row of probs [B, V]; row i drawn with generators[i] (None: torch's global generator)."""
    ### BEGIN SOLUTION
    tokens = torch.empty(probs.shape[0], dtype=torch.long)
    for i, gen in enumerate(generators):
        tokens[i] = torch.multinomial(probs[i], num_samples=1, generator=gen)[0]
    return tokens
    ### END SOLUTION


# %% nbgrader="graded" points=3
from minillm.grading.lab06 import check_lab06_2; check_lab06_2(draw)

# %% [markdown]
# ## Plug in: your sampler inside the engine
#
# minillm's `Sampler` takes both pieces as seams: `Sampler(process_fn=process_logits, draw_fn=draw)`. It
# handles what is around them — greedy rows (temperature 0) take the argmax and never reach your functions,
# the softmax between the two, logprobs — and `engine.plug(sampler=...)` puts it in the engine. Every token
# generated below went through your code. Same prompt, four ways:

# %%
mine = Sampler(process_fn=process_logits, draw_fn=draw)
engine.plug(sampler=mine)


def generate(requests):
    """requests: [(prompt, SamplingParams)] added in this order, run together -> their outputs, in order."""
    ids = [engine.add_request(p, sp) for p, sp in requests]
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return [done[i] for i in ids]


story = PROMPTS["flat"]
ways = {
    "greedy (T = 0)": SamplingParams(temperature=0, max_tokens=20),
    "T = 0.7, top-p 0.9, seed 1": SamplingParams(temperature=0.7, top_p=0.9, seed=1, max_tokens=20),
    "T = 0.7, top-p 0.9, seed 2": SamplingParams(temperature=0.7, top_p=0.9, seed=2, max_tokens=20),
    "T = 1.5, no truncation, seed 1": SamplingParams(temperature=1.5, seed=1, max_tokens=20),
}
print(f"{story!r} + ...")
for (name, sp), out in zip(ways.items(), generate([(story, sp) for sp in ways.values()])):
    print(f"  {name:32s} {out.outputs[0].text!r}")

# %% [markdown]
# Greedy gives the one most likely continuation (and gives it every time). The two seeds at a moderate
# temperature give two different, plausible stories. At `T = 1.5` without truncation the tail takes over
# within a few tokens: each step has a fair chance of picking a rare token, and once one is in, the text
# goes off the rails.

# %% [markdown]
# ## Measurement 1: what each setting keeps
#
# Your `process_logits` on one batch: the two prompts' logits, each repeated under seven settings — 14 rows,
# each with its own temperature, top-k, top-p and min-p, in a single call. For each row we count the tokens
# it keeps and plot the probabilities of the model's 30 most likely tokens afterwards (log scale; a line
# stops where a token is dropped).
#
# **Expected shape.** Temperature never changes the order of the tokens, only how steep the curve is: `T =
# 0.5` squares the ratios between probabilities (the top token takes more), `T = 1.5` flattens them, and
# neither drops anything. `top-k = 20` keeps 20 tokens on both prompts — too many for the peaked one, where
# all but a couple are noise, and an arbitrary cut through the plausible ones on the flat one. `top-p = 0.9`
# adapts: around ten tokens on the peaked prompt, hundreds on the flat one. `min-p = 0.05` adapts too, but
# keeps far fewer on the flat prompt than top-p does: its cut is relative to the top token's probability,
# so it drops the long tail of tokens that each have a tiny share.

# %%
SETTINGS = {
    "T = 1 (the model)": SamplingParams(temperature=1.0),
    "T = 0.5": SamplingParams(temperature=0.5),
    "T = 1.5": SamplingParams(temperature=1.5),
    "top-k = 20": SamplingParams(top_k=20),
    "top-p = 0.9": SamplingParams(top_p=0.9),
    "min-p = 0.05": SamplingParams(min_p=0.05),
    "T = 0.7, top-p = 0.9": SamplingParams(temperature=0.7, top_p=0.9),
}
rows = [(name, setting) for name in LOGITS for setting in SETTINGS]
params = [SETTINGS[s] for _, s in rows]
batch_logits = torch.stack([LOGITS[name] for name, _ in rows])


def column(field, dtype=torch.float32):
    """One setting of every row: a [B] tensor (what minillm's Sampler builds from the requests' SamplingParams)."""
    return torch.tensor([getattr(p, field) for p in params], dtype=dtype)


processed = process_logits(batch_logits.clone(), column("temperature"), column("top_k", torch.int64),
                           column("top_p"), column("min_p"))
probs = processed.softmax(-1)
kept = torch.isfinite(processed).sum(-1)

print(f"{'setting':22s}" + "".join(f"{name + ': kept, top-1 p':>26s}" for name in LOGITS))
for j, setting in enumerate(SETTINGS):
    cells = []
    for i, name in enumerate(LOGITS):
        r = i * len(SETTINGS) + j
        cells.append(f"{int(kept[r]):>18d} {float(probs[r].max()):7.3f}")
    print(f"{setting:22s}" + "".join(cells))

plots.processed_distributions(LOGITS, PROMPTS, list(SETTINGS), probs, kept)

# %% [markdown]
# ## Measurement 2: do your draws follow the distribution?
#
# A sampler can look fine on a few generations and still be wrong: an off-by-one in an inverse CDF, a
# softmax applied twice, a draw that ignores the generator. So we test it the way the checker does, on
# SmolLM2's real distribution: the flat prompt processed with a typical chat setting (`T = 0.8`,
# `top-k = 40`, `top-p = 0.95`), then 4 000 draws with your `draw` (200 rows, each with its own seeded
# generator, 20 calls). Pearson's chi-square compares the token counts with `4 000 · p`: a p-value that is
# not tiny means the counts are what honest draws from `p` look like (a wrong sampler gets p-values like
# 1e-50).

# %%
setting = SamplingParams(temperature=0.8, top_k=40, top_p=0.95)
target = process_logits(LOGITS["flat"][None].clone(), torch.tensor([setting.temperature]),
                        torch.tensor([setting.top_k]), torch.tensor([setting.top_p]),
                        torch.tensor([setting.min_p])).softmax(-1)[0]
ROWS, CALLS = 200, 20
t0 = time.perf_counter()
gens = [torch.Generator().manual_seed(1000 + i) for i in range(ROWS)]
repeated = target[None].repeat(ROWS, 1)
counts = torch.zeros(V, dtype=torch.long)
for _ in range(CALLS):
    counts += torch.bincount(draw(repeated, gens), minlength=V)
n = ROWS * CALLS
test = chi_square(counts, target)
support = (target > 0).nonzero()[:, 0]
print(f"{n} draws in {time.perf_counter() - t0:.1f} s; the processed distribution keeps {len(support)} tokens; "
      f"draws outside it: {int(counts.sum() - counts[support].sum())}")
print(f"chi-square = {test.statistic:.1f} with {test.dof} degrees of freedom, p-value = {test.p_value:.3f}")

plots.draws_vs_expected(counts, target, show_token, f"{PROMPTS['flat']!r}, T = 0.8, top-k 40, top-p 0.95: {n} "
                        f"draws, chi-square p = {test.p_value:.2f}")

# %% [markdown]
# **Expected shape:** the red points scatter around the grey bars by about ±√(n·p) (±20 for a token expected
# 400 times), no token outside the kept set ever appears, and the p-value is an unremarkable number between 0
# and 1 (for a correct sampler it is uniformly distributed: 0.03 happens, 1e-9 does not).

# %% [markdown]
# ## Measurement 3: a seeded request, alone and inside batches
#
# One request, `T = 0.8, top-p = 0.95, seed = 1234`, generated five ways through the engine with your sampler:
# alone; alone again after reseeding torch's global generator; first of a batch of four (with two unseeded
# requests and one with another seed, all different prompts); last of that batch; and in a batch of two.
# With per-request generators, its tokens must be **identical** every time. We also compare the logprob the
# model gave each of its tokens (`SamplingParams(logprobs=0)`: computed from the raw logits) against the run
# alone, to see whether the logits themselves depend on the batch.
#
# For contrast, the classic mistake: one random stream for the whole batch. `one_stream_draw` draws all rows
# with torch's global generator, which we seed before each run — "we set the seed, so it is reproducible".

# %%
seeded = SamplingParams(temperature=0.8, top_p=0.95, seed=1234, max_tokens=12, ignore_eos=True, logprobs=0)
others = [("Name three primary colors.", SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True)),
          ("The best way to learn a language is", SamplingParams(temperature=0.9, max_tokens=12, ignore_eos=True)),
          ("def fibonacci(n):", SamplingParams(temperature=0.6, seed=7, max_tokens=8, ignore_eos=True))]
situations = {
    "alone": [(story, seeded)],
    "alone, global RNG reseeded": [(story, seeded)],
    "first of a batch of 4": [(story, seeded)] + others,
    "last of a batch of 4": others + [(story, seeded)],
    "second of a batch of 2": others[:1] + [(story, seeded)],
}


def run_situations(sampler):
    """The seeded request's completion in every situation, with this sampler in the engine."""
    engine.plug(sampler=sampler)
    results = {}
    for where, requests in situations.items():
        torch.manual_seed(99 if where == "alone, global RNG reseeded" else 0)     # torch's global generator
        outs = generate(requests)
        results[where] = next(o for o, (p, sp) in zip(outs, requests) if sp is seeded).outputs[0]
    return results


t0 = time.perf_counter()
yours = run_situations(mine)
ref = yours["alone"]
ref_lp = [lp[t].logprob for t, lp in zip(ref.token_ids, ref.logprobs)]
for where, out in yours.items():
    lps = [lp[t].logprob for t, lp in zip(out.token_ids, out.logprobs)]
    same = out.token_ids == ref.token_ids
    dlp = max(abs(a - b) for a, b in zip(lps, ref_lp)) if same else float("nan")
    print(f"{where:28s} same tokens as alone: {str(same):5s}  max |Δ logprob| {dlp:.1e}   {out.text[:60]!r}")
print(f"({time.perf_counter() - t0:.0f} s)")


def one_stream_draw(probs, generators):
    """The mistake: ignore the per-request generators, draw every row from one shared stream."""
    return torch.multinomial(probs, num_samples=1)[:, 0]


shared = run_situations(Sampler(process_fn=process_logits, draw_fn=one_stream_draw))
print("\none stream for the whole batch (torch.manual_seed(0) before every run, 99 for the second):")
for where, out in shared.items():
    print(f"{where:28s} same tokens as alone: {str(out.token_ids == shared['alone'].token_ids):5s} "
          f"{out.text[:60]!r}")
engine.plug(sampler=mine)

# %% [markdown]
# **What to see.** With your sampler, the seeded request produces the same 12 tokens in every situation.
# Its generator lives with the request (the engine creates it from `seed` when the request arrives and keeps
# it with the sequence), so the random numbers row `i` consumes depend only on how many steps the request
# has taken — not on how many rows share the batch, where the row sits, or who else used torch's global
# generator. With one shared stream, seeding helps only if everything else is identical too: each token of
# the request is drawn from whatever random numbers the rows ahead of it left in the stream, so moving it in
# the batch, adding a neighbour or another seed before the run changes its text.
#
# The logprob column shows the other half of the story. Alone, twice, the logits are bit-identical (`Δ
# logprob` 0). Inside a batch they differ by rounding-level amounts (around 1e-5 on this CPU in float32): a
# batched matrix multiplication does not promise the same summation order for every batch shape. That did not
# change any token here: a rounding error matters only when the draw falls that close to the boundary between
# two tokens, or, for greedy decoding, when the two best tokens are that close. Over thousands of requests it
# does happen. Per-request seeds make the *randomness* independent of the batch, not the *arithmetic*;
# bit-identical output across batches also needs batch-invariant kernels (vLLM's `VLLM_BATCH_INVARIANT=1`), at
# some throughput cost.

# %% [markdown]
# ## Interview questions
#
# <details><summary><b>What is the difference between greedy decoding and sampling?</b></summary>
#
# Both start from the model's logits for the next token. Greedy takes the argmax every step: deterministic
# for a given input and numerics, cheap, right for tasks with one correct answer (extraction,
# classification, code, tool calls). Its weaknesses: it repeats and loops, especially with small models, and
# the locally best token at each step is not the most likely sequence (beam search looks further, at a cost).
# Sampling draws the next token from the softmax distribution, usually reshaped by temperature and truncated
# by top-k / top-p / min-p: varied, more natural text, the usual choice for chat and creative writing, and
# the way to get several different candidates (n > 1). In the plug-in cell, greedy gave the single most
# likely story; two seeds gave two different plausible ones. Sampling is random by design; a per-request
# seed makes it reproducible. In minillm, `temperature=0` means greedy: the Sampler takes the argmax and
# never calls `process_logits` or `draw` for that row.
# </details>
#
# <details><summary><b>What is temperature in sampling?</b></summary>
#
# A divisor of the logits before the softmax: `p_j ∝ exp(z_j / T)`. T = 1 is the distribution the model was
# trained to produce; T < 1 widens the gaps between logits, so the top tokens take more of the probability;
# T > 1 narrows them and moves probability into the tail. Two tokens whose logits differ by 2 have a
# probability ratio of e² ≈ 7.4 at T = 1, e⁴ ≈ 55 at T = 0.5 and e ≈ 2.7 at T = 2. It never changes the order
# of the tokens, only how strongly the top is preferred. As T → 0 the distribution collapses onto the argmax,
# so engines treat T = 0 as greedy rather than divide by zero. Because it is applied first, it changes what
# top-p and min-p keep: in measurement 1, `T = 0.7, top-p = 0.9` kept far fewer tokens than `top-p = 0.9`
# alone on the flat prompt. Typical values: 0–0.3 for factual answers and code, 0.7–1.0 for chat and
# creative text; at 1.5 without truncation SmolLM2 lost the thread within a few tokens.
# </details>
#
# <details><summary><b>What are top-k and top-p (nucleus) sampling?</b></summary>
#
# Two ways to cut the long tail before the draw — thousands of tokens that are each unlikely but together get
# picked often — and renormalize what is left. Top-k keeps the k most likely tokens, a fixed count whatever
# the distribution looks like: in measurement 1, k = 20 kept 20 tokens both where the model was sure (one
# token at about 0.77: most of the other 19 are noise) and where dozens of continuations were reasonable.
# Top-p keeps the smallest set of most likely tokens whose probability reaches p, so it adapts: about ten
# tokens on the peaked prompt, hundreds on the flat one, at p = 0.9. It is a cut on cumulative mass over the
# sorted distribution — not "tokens with probability above p"; the token that crosses p stays, and when the
# model is confident a single token can be the whole set. Min-p keeps tokens with at least min_p times the top token's
# probability: it adapts as well, and cuts the flat tail harder than top-p. They combine (vLLM's order:
# temperature, min-p, top-k, top-p); common values are p = 0.9–0.95, k = 40–50. For a batch with a
# different p per row, one sort, a cumsum and a comparison against a `[B, 1]` column do every row at once
# (Task 1).
# </details>
#
# <details><summary><b>Outputs differ across runs with the same input and QA complains. Why, and how do you fix it?</b></summary>
#
# First separate the randomness you asked for from numerical nondeterminism. With temperature > 0 and no
# seed, different outputs are the intended behaviour: use temperature 0 or a per-request seed. A seed only
# works if it is per request: minillm gives every seeded request its own `torch.Generator`, used for that row
# only, so its draws do not depend on which requests share the batch (measurement 3: same tokens alone, first
# or last of a batch of four, after reseeding the global RNG), while one shared stream — even seeded — changed
# the text as soon as the batch changed. If seeded or greedy runs still differ, the logits themselves are
# changing: kernels choose different tilings, split reductions and summation orders for different batch
# sizes, chunked-prefill boundaries or prefix-cache hits, and floating-point addition is not associative. The
# errors are rounding-sized (measurement 3 shows their size here), but where two tokens are nearly tied the
# choice flips and everything after it differs. Also rule out the obvious: model or engine version, dtype,
# GPU type, tensor-parallel degree. For strict reproducibility: batch-invariant kernels (vLLM's
# `VLLM_BATCH_INVARIANT=1`, at a throughput cost), or pin batch size and configuration for the tests;
# otherwise make the tests compare meaning, not exact strings.
# </details>

# %% [markdown]
# ### More from the question bank
#
# Every interview question this lab answers, with the project's answer, key points and the code that backs it
# (the same bank `minillm quiz --lab lab06` rehearses in a terminal, with spaced repetition):

# %%
from minillm.quiz import show
show(lab="lab06")
