# ---
# jupyter:
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Lab 07 — Speculative decoding
#
# **The question.** *"A model has to run one forward pass per generated token. How can it produce several
# tokens per pass without changing what it would have written? What is speculative decoding, why is it
# lossless, and when does it make decoding slower instead of faster?"*
#
# At batch 1 a decode step reads every weight of the model to produce a single token (lab00): the hardware
# could process several tokens for nearly the same price. Speculative decoding spends that slack. A cheap
# **proposer** guesses the next `k` tokens; the **target** model runs them all in one forward pass, which gives
# its distribution at each of the `k + 1` positions; a **rejection rule** keeps a prefix of the guesses and adds
# one token of the target's own. One step therefore emits between 1 and `k + 1` tokens, and — with the right
# rule — the text is distributed *exactly* as if the target had sampled it alone.
#
# **What you will build.** The two pieces of minillm's speculative decoding: the **rejection rule** that
# verifies one request's drafts (the part that makes it lossless), and the **n-gram proposer**'s lookup
# ("prompt lookup decoding": no draft model at all, just copy what followed the same words earlier). Then
# you plug both into the engine running SmolLM2.
#
# **What you will measure.** Acceptance rate, tokens per target step and decode speed with and without
# speculation, on a task whose output copies its input (repeat a passage) and on open-ended chat, next to the
# speedup the textbook formula predicts; and a histogram showing that your rule's output follows the target's
# distribution while a plausible wrong rule's does not.
#
# Answer cells say `raise NotImplementedError()` until you fill them in; the graded cell after each one
# (don't edit it) prints nothing when you are right, and the smallest counter-example with a hint when not.

# %% nbgrader="readonly"
import os

os.environ.setdefault("TRITON_INTERPRET", "1")   # before anything imports minillm.kernels

import time

import torch

from minillm import plots
from minillm.bench.spec import CHAT, TimedProposer
from minillm.engine.llm_engine import LLMEngine
from minillm.engine.prompt import build_prompt_ids
from minillm.engine.simple import SimpleGenerator
from minillm.loading.loader import load_model
from minillm.spec_decode.ngram import NgramProposer
from minillm.sampling.params import SamplingParams
from minillm.spec_decode.rejection_sampler import RejectionSampler
from minillm.spec_decode.expected import expected_speedup, expected_tokens_per_step
from minillm.testing import chi_square

loaded = load_model("default", "float32")
model, tok = loaded.model, loaded.tokenizer
K = 4                                                   # tokens drafted per step (vLLM's usual 3-5)
SPEC = {"method": "ngram", "num_speculative_tokens": K}
engine_plain = LLMEngine.from_model(model, tok, kv_cache_memory="64MiB")
engine_spec = LLMEngine.from_model(model, tok, kv_cache_memory="64MiB", speculative_config=SPEC)
print(f"speculative engine: proposer {type(engine_spec.spec.proposer).__name__}, k = {K}, rejection sampler "
      f"{type(engine_spec.spec.rejection_sampler).__name__}")

# %% [markdown]
# ## One speculative step, in the engine
#
# With speculation on, every engine step does, for each decoding sequence:
#
# 1. **propose** — the proposer guesses up to `k` next tokens `x_1..x_k` (for the n-gram proposer: it finds the
#    sequence's last few tokens earlier in the prompt or output, and proposes what followed them there);
# 2. **verify** — the scheduler reserves KV slots for `k + 1` positions and the model runs the last real token
#    *and* the `k` guesses in one forward pass, like a tiny prefill. Position `j` of that pass gives the target's
#    distribution `p_j` for the token after `x_1..x_{j-1}`: `k + 1` distributions for the price of one pass;
# 3. **accept** — the rejection rule walks the guesses in order and keeps them while they pass its test; at the
#    first failure it emits a token of the target's own instead and stops. If all `k` pass, `p_{k+1}` is
#    already there: a **bonus** token, free. The KV of rejected positions is rolled back (the block tables just
#    shrink).
#
# **The picture, from the real engine.** minillm's own speculative engine (its n-gram proposer and its
# rejection sampler) is asked to repeat a short passage. Each row is one engine step: the guesses it verified
# — green if kept, red for the first one refused, grey for those after it (never looked at) — then, in blue,
# the token the target added itself. A step with no guess (no n-gram match) is a plain decode step.

# %%
PASSAGES = [
    "The lighthouse on the northern cape was built in 1874 from granite quarried on the island itself. For more "
    "than a century a keeper lived in the small house at its foot, climbing the ninety-two steps every evening to "
    "light the lamp and every morning to put it out. Since 1981 the light has been automatic, and the keeper's "
    "house is now a museum about the ships that were saved, and the ones that were not.",
    "To make the bread, mix the flour, the salt and the yeast in a large bowl, then add the warm water slowly while "
    "stirring. Knead the dough for ten minutes until it is smooth and elastic, cover it with a damp towel and let "
    "it rise for one hour. Shape it into a loaf, let it rise again for thirty minutes, and bake it at 220 degrees "
    "for about forty minutes.",
]
REWRITE = "Repeat the following passage exactly, word for word:\n\n"


class Recorder:
    """A rejection sampler that lets another one decide, and remembers what it was shown and what it kept."""

    def __init__(self, inner):
        self.inner, self.last = inner, None

    def __call__(self, target_probs, draft_token_ids, draft_probs, generators):
        kept = self.inner(target_probs, draft_token_ids, draft_probs, generators)
        self.last = (list(draft_token_ids[0]), list(kept[0]))
        return kept


def generate(eng, ids, max_tokens, observer=None):
    """Run one greedy request to the end; the finished output and how many engine steps it took."""
    if observer is not None:
        eng.add_step_observer(observer)
    s0 = eng.num_steps
    eng.add_request(ids, SamplingParams(temperature=0, max_tokens=max_tokens))
    while eng.has_unfinished_requests():
        outs = eng.step()
    if observer is not None:
        eng.remove_step_observer(observer)
    return outs[-1], eng.num_steps - s0


recorder = Recorder(RejectionSampler())                    # minillm's own rule, watched
engine_spec.plug(rejection_sampler=recorder)
steps_seen = []


def record_step(info):
    drafts, kept = recorder.last or ([], [])
    recorder.last = None
    steps_seen.append((drafts, kept, list(info.outputs[0].delta_token_ids) if info.outputs else []))


picture_ids = build_prompt_ids(tok, REWRITE + PASSAGES[0])
out, n_steps = generate(engine_spec, picture_ids, max_tokens=40, observer=record_step)
engine_spec.plug(rejection_sampler=RejectionSampler())
print(f"{len(out.token_ids)} tokens in {n_steps} engine steps (1 prefill + {n_steps - 1} decode steps): "
      f"{out.text!r}")


def piece(t):
    return tok.decode([t]).replace("\n", "\\n") or "∅"


plots.spec_steps(steps_seen, piece,
                 "minillm's engine repeating a passage: each row is one step (one forward pass of the target)")
print(engine_spec.spec.stats)

# %% [markdown]
# Read the rows: while the output copies the passage, its last tokens occur earlier in the prompt, the
# proposer's guess is the passage's next words, and the step emits 5 tokens (4 kept, plus the bonus) for one
# forward pass — even the digits of "1874" come four at a time. Where the model departs from the passage (in
# the run above, "For over a century" instead of "For more than a century"), the proposer has nothing to go
# on (no earlier "For over": a plain step) or latches onto the wrong occurrence of a short n-gram ("a" →
# "museum about the ships"), and the first wrong guess is refused: the step still emits the target's own token,
# never less than a plain step. Once the output is back on the passage's words, whole runs are kept again.
# `SpecStats` counts what was drafted and kept: the **acceptance rate** is accepted / drafted guesses, and the
# **mean accepted length** is the tokens emitted per verification step.

# %% [markdown]
# ## Task 1 — the rejection rule (4 points)
#
# Write `rule(target_probs, draft_token_ids, draft_probs, generator) -> list[int]`, speculative sampling's
# verification for **one** request:
#
# * `target_probs`: a `[k + 1, V]` tensor, the target's distributions `p_1 … p_{k+1}` (row `j` is the
#   distribution of the token at draft position `j`; the last row is for the token after all `k` drafts). They
#   are what the target would sample from — temperature, top-k and top-p already applied; a greedy request has
#   one-hot rows on the argmax.
# * `draft_token_ids`: the `k` guesses `x_1 … x_k` (a list of ints; `k` may be 0).
# * `draft_probs`: a `[k, V]` tensor, the distributions `q_j` the guesses were drawn from. The n-gram proposer
#   is deterministic, so there `q_j` is one-hot on its guess; a draft *model* gives a dense `q_j`.
# * `generator`: a `torch.Generator`, or `None` for torch's global one. Draw **every** random number from it
#   (`generator=generator` in each `torch.rand` / `torch.multinomial` call): a seeded request must reproduce
#   whatever else the engine is running.
#
# Walk the guesses in order. Keep `x_j` with probability `min(1, p_j(x_j) / q_j(x_j))`. At the first guess
# you refuse, emit one token drawn from the **residual** `normalize(max(p_j − q_j, 0))` and stop. If you kept
# all `k`, emit a **bonus** token drawn from `p_{k+1}`. Return the kept guesses followed by that one token
# (1 to `k + 1` ints). Leave the input tensors unchanged (in the engine they are shared).
#
# Why this rule, and not "keep a guess if the target likes it"? Because the emitted token must have
# distribution exactly `p_j` — the checker measures that with a chi-square test on thousands of requests, and
# the histogram below shows what goes wrong otherwise. Exactly means exactly: for the usual ways of drawing
# (`torch.rand` then `torch.multinomial` or an inverse CDF), the checker also picks generator states whose random
# numbers land on rare tokens (1e-6 next to 0.9996) or exactly on 0, where a draft of target probability 0 must
# still be rejected (`u < min(1, p/q)`, strictly).
#
# <details><summary>Hint: the two random draws</summary>
#
# `u = torch.rand((), generator=generator, dtype=torch.float64)` is one uniform number in [0, 1); keeping `x`
# when `u < p/q` keeps it with probability `min(1, p/q)` (write it as `u * q < p` and `q = 0` needs no special
# case). `torch.multinomial(weights, 1, generator=generator)` draws an index with probability proportional to
# non-negative `weights` — it normalizes for you. `float(t)` and `int(t)` turn one-element tensors into numbers.
# </details>
#
# <details><summary>Hint: why the residual is max(p − q, 0)</summary>
#
# Add up the ways token `y` can come out at position `j`: the guess was `y` and was kept,
# `q(y) · min(1, p(y)/q(y)) = min(p(y), q(y))`; or the guess was refused (probability `1 − Σ min(p, q)`) and
# the replacement is `y`. For the total to be `p(y)`, the replacement must supply exactly what is missing,
# `p(y) − min(p(y), q(y)) = max(p(y) − q(y), 0)`, and that mass sums to `1 − Σ min(p, q)`: the residual,
# normalized. Drawing the replacement from `p` instead gives the tokens the draft likes a second chance.
# </details>

# %% nbgrader="answer"
def rule(target_probs, draft_token_ids, draft_probs, generator):
    """Speculative sampling for one request: the kept drafts, then one token of the target's (1 to k + 1 ints)."""
    ### BEGIN SOLUTION
    emitted = []
    for j, x in enumerate(draft_token_ids):
        p_x, q_x = float(target_probs[j, x]), float(draft_probs[j, x])
        u = float(torch.rand((), generator=generator, dtype=torch.float64))
        if u * q_x < p_x:                                  # u < p/q: kept with probability min(1, p/q)
            emitted.append(x)
            continue
        residual = (target_probs[j].double() - draft_probs[j].double()).clamp(min=0)   # a new tensor
        if float(residual.sum()) <= 0:                     # only rounding can get here (p == q): p itself
            residual = target_probs[j].double()
        emitted.append(int(torch.multinomial(residual, 1, generator=generator)))
        return emitted
    k = len(draft_token_ids)
    emitted.append(int(torch.multinomial(target_probs[k].double(), 1, generator=generator)))   # the bonus token
    return emitted
    ### END SOLUTION


# %% nbgrader="graded" points=4
from minillm.grading.lab07 import check_lab07_1; check_lab07_1(rule)

# %% [markdown]
# ## Task 2 — the n-gram lookup (3 points)
#
# The n-gram proposer ("prompt lookup decoding") needs no model: it bets that what followed the sequence's
# last few tokens the last time they occurred will follow again. Write
# `find_ngram_draft(token_ids, k, min_n, max_n) -> list[int]`:
#
# * `token_ids`: the whole sequence so far (prompt and output), a list of ints — don't modify it;
# * for `n = max_n` down to `min_n` (longest first: a longer match is more specific), take the last `n` tokens
#   and look for their **latest** earlier occurrence: a start `s` with `token_ids[s:s + n]` equal to them and
#   `s + n <= len(token_ids) - 1` (it must end before the last token — the suffix itself does not count, and
#   occurrences may overlap it);
# * at the first `n` that has one, return the up to `k` tokens that followed it,
#   `token_ids[s + n : s + n + k]`; return `[]` when no suffix of `min_n … max_n` tokens reappears.
#
# Example: in `[1, 2, 5, 1, 2, 6, 1, 2]` with `k = 2`, `max_n = 2`, the suffix `1, 2` occurred at starts 0 and
# 3; the latest is 3, so the draft is `[6, 1]`.
#
# The engine calls this for every decoding sequence at every step, so it must be quick — but plain Python
# loops over a few hundred tokens are fine here (minillm's own version searches the tokens as bytes; you need
# not).

# %% nbgrader="answer"
def find_ngram_draft(token_ids, k, min_n, max_n):
    """Up to k tokens that followed the latest earlier occurrence of the last n tokens (n = max_n .. min_n)."""
    ### BEGIN SOLUTION
    tokens = list(token_ids)
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = tokens[length - n:]
        for start in range(length - n - 1, -1, -1):        # latest first; ends at start + n <= length - 1
            if tokens[start:start + n] == suffix:
                return tokens[start + n:start + n + k]
    return []
    ### END SOLUTION


# %% nbgrader="graded" points=3
from minillm.grading.lab07 import check_lab07_2; check_lab07_2(find_ngram_draft)

# %% [markdown]
# ## Plug in: your speculative decoding inside the engine
#
# The engine's `RejectionSampler` verifies a whole batch at once; given `rule=`, it calls your function once per
# request instead (with one-hot `draft_probs` for the n-gram proposer). `NgramProposer(lookup=...)` drafts with
# your lookup (its defaults `min_n=1, max_n=3` are vLLM's). `engine.plug(...)` swaps both into the speculative
# engine. Under greedy decoding speculation must not change a single token: we compare with the engine
# without speculation on a passage to repeat and on an open-ended chat request.

# %%
engine_spec.plug(proposer=NgramProposer(lookup=find_ngram_draft), rejection_sampler=RejectionSampler(rule=rule))
checks = [("repeat a passage", build_prompt_ids(tok, REWRITE + PASSAGES[1])),
          ("chat", build_prompt_ids(tok, CHAT[0]))]
for name, ids in checks:
    ref, ref_steps = generate(engine_plain, ids, max_tokens=32)
    out, steps = generate(engine_spec, ids, max_tokens=32)
    s = out.metrics.spec
    print(f"{name:17s} same tokens as without speculation: {out.token_ids == ref.token_ids};  "
          f"{len(out.token_ids)} tokens in {steps} steps (without: {ref_steps}); drafted {s.num_draft_tokens}, "
          f"accepted {s.num_accepted_tokens}\n    {out.text!r}")

# %% [markdown]
# ## Why it is lossless: the output distribution, measured
#
# Greedy equality only shows that the rule keeps the argmax. The real claim is about **sampling**: each
# emitted token is an exact sample from the target's `p`. Here is a test on SmolLM2's real distributions. The
# target is SmolLM2 continuing *"Once upon a time, in a small village by the sea, there lived a"* at
# temperature 1 with top-k 8 (its 8 likeliest next words). The draft is a cheap, worse model: SmolLM2 again,
# but seeing only the last two tokens, *"lived a"*, with the same top-k — it prefers "young" and "man" where the
# target prefers "wise". (Sampling settings apply to both sides: a rule compares `p` and `q` *as sampled*.)
#
# We draw the guess `x ~ q` many times, run your rule with `k = 1`, and count the first token it emits. Next to
# it, the same experiment with a plausible wrong rule that, after a refusal, resamples from `p` itself instead
# of the residual. A chi-square goodness-of-fit test against `p` gives a p-value: a correct rule gives a number
# that looks like any uniform draw in (0, 1); the wrong rule gives essentially 0.

# %%
STORY = "Once upon a time, in a small village by the sea, there lived a"
story_ids = tok.encode(STORY)
gen = SimpleGenerator(model, tok)


def next_logits(ids):
    cache = gen.new_cache(len(ids) + 1)
    with torch.inference_mode():
        return gen.forward_logits(cache, ids, 0).double()


full, short = next_logits(story_ids), next_logits(story_ids[-2:])
top = full.topk(8).indices                                   # top-k 8 of the target, applied to both
p = full[top].softmax(-1)
q = short[top].softmax(-1)
words = [tok.decode([int(t)]) for t in top]
target_rows = torch.stack([p, p]).float()                   # p_1, and (unused here) the bonus row
draft_rows = q[None].float()


N = 6000
g = torch.Generator().manual_seed(0)
guesses = torch.multinomial(q, N, replacement=True, generator=g)          # x ~ q, one per request
t0 = time.perf_counter()
yours = [rule(target_rows, [x], draft_rows, g) for x in guesses.tolist()]
elapsed = time.perf_counter() - t0
# The wrong rule, simulated for all N requests at once: the same test (keep x when u < p(x) / q(x)), but a
# refused guess is replaced by a draw from p instead of the residual.
u = torch.rand(N, generator=g, dtype=torch.float64)
wrong = torch.where(u * q[guesses] < p[guesses], guesses, torch.multinomial(p, N, replacement=True, generator=g))
freq = {}
for name, first in (("your rule", torch.tensor([f[0] for f in yours])), ("resample from p", wrong)):
    counts = torch.bincount(first, minlength=len(top))
    freq[name] = (counts / N, chi_square(counts, p).p_value)
alpha = float(torch.minimum(p, q).sum())
print(f"{N} calls of your rule in {elapsed:.1f} s. Guesses kept: {sum(len(f) == 2 for f in yours) / N:.1%}, "
      f"theory sum(min(p, q)) = {alpha:.1%}")
for name, (f, pv) in freq.items():
    print(f"{name:16s} chi-square p-value against p: {pv:.3g}")

plots.rejection_frequencies(p, q, freq, words, N, f"next token after '…{STORY[-30:]}': what the rule emits "
                            f"(k = 1, acceptance {alpha:.0%})")

# %% [markdown]
# Your rule's bars sit on the target's: the guesses are biased towards "young" and "man", but the test refuses
# just enough of them (`1 − p/q` of each), and the residual hands the missing mass to "wise" and the other
# words the draft undervalues. The wrong rule keeps the same guesses but its replacements come from `p`, so the
# words the draft over-proposes come out too often, and the chi-square test sees it at once. Its output would
# *look* fine to a human — which is why losslessness has to be tested statistically, like this.

# %% [markdown]
# ## Measurement: acceptance and speedup, predictable vs open-ended text
#
# Two tasks, two prompts each, 32 greedy tokens, with and without speculation (your pieces, `k = 4`):
#
# 1. **repeat a passage** — the output copies the prompt, so n-gram guesses are mostly right;
# 2. **chat** — open-ended writing: few n-grams of the output appeared before, and guesses are rarely right.
#
# For each request we time the decode phase only (first token to last: prefill costs the same either way) and
# read, from a step observer, how many tokens each step fed the model and how long it took. The formula of
# `minillm.spec_decode.expected` predicts tokens per target step, `(1 − α^{k+1}) / (1 − α)` for an
# acceptance rate `α`, and a speedup `expected_speedup(α, k, draft_cost)` that assumes a step verifying `k + 1`
# tokens costs the same as a plain one-token step — true at batch 1 on a GPU, where a step is bound by reading
# the weights. **Expected shape:** the passage gets most guesses accepted, 3-4 tokens per step and a clear
# speedup, but less than the formula says; chat accepts few guesses and runs *slower* than without
# speculation.

# %%
WORKLOADS = {"repeat a passage": [build_prompt_ids(tok, REWRITE + text) for text in PASSAGES],
         "chat": [build_prompt_ids(tok, prompt) for prompt in CHAT[:2]]}
MAX_TOKENS = 32
timed = TimedProposer(NgramProposer(lookup=find_ngram_draft))
engine_spec.plug(proposer=timed, rejection_sampler=RejectionSampler(rule=rule))
step_log = []


def log_step(info):
    step_log.append((info.scheduler_output.num_batched_tokens, info.seconds))


def decode_run(eng, ids):
    """(decode tokens, decode seconds, decode steps, [(tokens fed, seconds)] per decode step, the output)."""
    step_log.clear()
    out, _ = generate(eng, ids, MAX_TOKENS, observer=log_step)
    steps = step_log[1:]                                    # the first step is the prefill
    return len(out.token_ids) - 1, sum(s for _, s in steps), len(steps), list(steps), out


generate(engine_plain, [5] * 16, 4)                          # warm-up
generate(engine_spec, [5] * 16, 4)
rows, by_size = {}, {}
t_start = time.perf_counter()
for task, prompts in WORKLOADS.items():
    acc = dict(plain_tok=0, plain_s=0.0, plain_steps=0, spec_tok=0, spec_s=0.0, spec_steps=0, drafted=0,
               accepted=0, verify_steps=0, draft_s=0.0)
    for ids in prompts:
        n, secs, steps, log, ref = decode_run(engine_plain, ids)
        acc.update(plain_tok=acc["plain_tok"] + n, plain_s=acc["plain_s"] + secs, plain_steps=acc["plain_steps"] + steps)
        by_size.setdefault(1, []).extend(s for _, s in log)
        d0 = timed.seconds
        n, secs, steps, log, out = decode_run(engine_spec, ids)
        acc["same"] = acc.get("same", True) and out.token_ids == ref.token_ids
        acc.update(spec_tok=acc["spec_tok"] + n, spec_s=acc["spec_s"] + secs, spec_steps=acc["spec_steps"] + steps,
                   drafted=acc["drafted"] + out.metrics.spec.num_draft_tokens,
                   accepted=acc["accepted"] + out.metrics.spec.num_accepted_tokens,
                   verify_steps=acc["verify_steps"] + out.metrics.spec.num_steps,
                   draft_s=acc["draft_s"] + timed.seconds - d0)
        for fed, s in log:
            by_size.setdefault(fed, []).append(s)
    rows[task] = acc
print(f"measured in {time.perf_counter() - t_start:.0f} s")

plain_step = sum(by_size[1]) / len(by_size[1])              # one plain decode step (1 token fed)
step_cost = {n: sum(v) / len(v) / plain_step for n, v in sorted(by_size.items())}
verify_cost = step_cost[K + 1]                              # a step that verifies k guesses, in plain steps
print(f"plain decode step: {1000 * plain_step:.0f} ms; a step feeding n tokens costs (in plain steps): "
      + ", ".join(f"n={n}: {c:.2f}" for n, c in step_cost.items()))


def break_even(cost, k):
    """The acceptance rate at which a step verifying k guesses emits as many tokens as it costs plain steps."""
    if expected_tokens_per_step(1.0, k) < cost:
        return None
    lo, hi = 0.0, 1.0
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if expected_tokens_per_step(mid, k) < cost else (lo, mid)
    return hi


print(f"\n{'task':17s} {'guessing steps':>14s} {'accept':>7s} {'tok/guessing step':>17s} {'formula':>7s} "
      f"{'plain':>8s} {'spec':>8s} {'speedup':>8s} {'formula':>8s}  same tokens")
for task, r in rows.items():
    a = r["accepted"] / r["drafted"] if r["drafted"] else 0.0
    draft_cost = r["draft_s"] / max(r["drafted"], 1) / plain_step   # one drafted token, in plain steps
    r.update(alpha=a, plain_tps=r["plain_tok"] / r["plain_s"], spec_tps=r["spec_tok"] / r["spec_s"],
             per_guessing_step=(r["accepted"] + r["verify_steps"]) / max(r["verify_steps"], 1),
             formula_tps=expected_tokens_per_step(a, K), formula=expected_speedup(a, K, draft_cost),
             draft_cost=draft_cost)
    r["speedup"] = r["spec_tps"] / r["plain_tps"]
    print(f"{task:17s} {r['verify_steps']:6d} of {r['spec_steps']:3d} {a:7.0%} {r['per_guessing_step']:17.2f} "
          f"{r['formula_tps']:7.2f} {r['plain_tps']:6.1f}/s {r['spec_tps']:6.1f}/s {r['speedup']:7.2f}x "
          f"{r['formula']:7.2f}x  {'yes' if r['same'] else 'NO'}")
alpha_even = break_even(verify_cost, K)
print(f"\ndrafting one token costs {max(r['draft_cost'] for r in rows.values()):.4f} plain steps; a step verifying "
      f"{K} guesses costs {verify_cost:.2f}: it pays for itself only from an acceptance rate of "
      + (f"{alpha_even:.0%}" if alpha_even is not None else "never (k + 1 tokens cost more than k + 1 plain steps)")
      + f" on this CPU (0% where verifying is free)")

plots.spec_speedup(rows, step_cost, K)

# %% [markdown]
# **Reading the numbers.** Speedup = (tokens per step) ÷ (cost of a step). On the passage most guesses are
# kept and a guessing step emits close to 4 tokens, so decoding gets faster even here. Chat is the failure mode:
# the output rarely repeats an earlier n-gram, so most steps draft nothing (they run as plain steps), and when
# the proposer does guess — after a common word like "the" or "a" — it is almost always wrong. Those steps
# emit about one token and still pay for `k + 1`: chat ends up slower than without speculation.
#
# **Why the measured speedup falls short of the formula.** `expected_speedup` assumes that a step verifying
# `k + 1` tokens costs one plain step. On a GPU at batch 1 that holds: the step is bound by reading the
# weights, and 5 tokens take about as long as 1. On this CPU, with one thread, it does not: the right plot
# shows a step that feeds 2 to 5 tokens costing close to twice a plain step. (A forward pass of one token runs
# its matrix products as lean matrix-vector routines; from two tokens on, the library takes its general
# matrix-matrix path, with packing overheads and real arithmetic to do on one core — beyond that jump the
# time grows slowly. The speculative step also turns `k + 1` rows of logits into distributions over 49 152
# tokens and runs your rule.) Whatever the cause, the measured ratio is what counts: a step verifying 4 guesses
# costs about 2 plain steps, so it pays for itself only when it emits more tokens than that — the break-even
# acceptance printed above — and chat's acceptance is far below it. The same inequality,
# `tokens per step > cost(k + 1 tokens) / cost(1 token)`, is why speculation stops paying on a GPU at large
# batch sizes, where the step is compute-bound too. (The formula also assumes each guess is kept
# independently with probability `α`; n-gram guesses come in runs — a copied stretch keeps all 4, elsewhere
# nothing is drafted — so measured tokens per guessing step differ from `(1 − α^{k+1}) / (1 − α)`.)

# %% [markdown]
# ## Interview questions
#
# <details><summary><b>What is speculative decoding, and how does it reduce latency?</b></summary>
#
# Decode at small batch is bound by memory bandwidth: each step reads all the weights to produce one token per
# sequence, leaving the arithmetic units mostly idle. Speculative decoding fills that idle capacity. A cheap
# proposer — a small draft model of the same family, extra heads (Medusa, EAGLE), or an n-gram lookup as in
# this lab — guesses the next k tokens; the target scores all k + 1 positions in one forward pass, which costs
# about one decode step because the weights are read once; a rejection rule keeps a prefix of the guesses and
# the target adds one token. Each expensive pass then yields 1 to k + 1 tokens — on average
# `(1 − α^{k+1}) / (1 − α)` for acceptance rate α (2.94 at α = 0.7, k = 5), and about 2.35× once five draft
# passes at 5% of the target each are paid for. Here, repeating a passage gave several tokens per step. The
# text does not change: the kept tokens follow the target's distribution exactly.
# </details>
#
# <details><summary><b>Explain speculative decoding and why it does not change the output distribution.</b></summary>
#
# The draft proposes x ~ q; the target gives p at the same position. Keep x with probability
# min(1, p(x)/q(x)); on the first refusal, drop the remaining guesses and draw a replacement from
# normalize(max(p − q, 0)); if all k are kept, draw a bonus token from p_{k+1}. The probability of emitting y
# is `q(y)·min(1, p(y)/q(y)) + P(refuse)·max(p(y) − q(y), 0) / Σ max(p − q, 0) = min(p(y), q(y)) +
# max(p(y) − q(y), 0) = p(y)`, because P(refuse) = 1 − Σ min(p, q) is exactly the residual's mass. Each token
# is an exact sample of the target given the prefix, so by induction the whole sequence is. For a
# deterministic proposer q is one-hot: the guess is kept with probability p(x), and a refusal samples from p
# without x; greedy reduces to "keep while the guess equals the argmax". Temperature, top-k and top-p must be
# applied to p and q alike. To test it, do what Task 1's checker and the histogram above do: thousands of
# seeded runs, chi-square against p (and against sum min(p, q) for the acceptance rate). Under greedy,
# speculative and plain outputs can still differ token-for-token in floating point, because a k + 1-token
# forward pass can round differently from a 1-token one and flip a near-tie argmax; with sampling, a seeded
# request uses its random numbers differently, so the same seed gives a different (equally distributed) text.
# </details>
#
# <details><summary><b>When would you NOT use speculative decoding, and what is the failure mode?</b></summary>
#
# When there is no spare compute or the guesses are mostly wrong. At large batch, decode is already
# compute-bound: verifying k + 1 positions per sequence multiplies the work and refused positions are waste,
# so throughput drops (engines shrink k or turn speculation off under load). With low acceptance — high
# temperature, open-ended text, a draft from another domain or language — each pass yields little: at α = 0.3
# and k = 4, 1.43 tokens per pass, 1.02× with a draft at 10% of the target's cost, 0.79× at 20%. This lab's
# chat run is that case, made worse by the CPU, where a step verifying 4 guesses costs clearly more than a
# plain step. A draft model also takes memory (weights and its own KV) from the target's KV budget, and must
# prefill long prompts too. The failure is silent — outputs stay correct, only slower — so watch acceptance
# rate, tokens per step and TPOT, and gate speculation on batch size and task. Copying tasks (code edits, RAG
# answers, rewriting, like the passage here) are the best case, not the worst.
# </details>
#
# <details><summary><b>Design speculative decoding into a latency-sensitive LLM service.</b></summary>
#
# Use it where per-user latency matters and replicas run at modest batch sizes: an interactive assistant. The
# target (say a 70B model on TP=4) stays the source of truth; a ~1B draft of the same family and tokenizer
# proposes k ≈ 4 tokens; the engine verifies them as k + 1 query positions per sequence in the normal batched
# step (like a small chunked prefill), with KV slots reserved up front and rolled back for refused positions —
# block tables make that a length change. The rejection sampler of Task 1 keeps each request's prefix, with
# identical sampling transforms applied to p and q and per-request generators for seeded requests. With
# α = 0.8 and a draft at 5% of the target's step, `expected_speedup` gives 3.36 tokens per pass and 2.8× lower
# time per token; at α = 0.6, 1.9×. Costs: a second model to deploy and version, its KV cache, wasted compute
# on misses. Controls: k per sequence from its running acceptance, speculation off above a load threshold
# (capacity planning assumes it off at peak), n-gram lookup for copy-heavy traffic. Roll out behind a flag,
# prove losslessness statistically offline, and monitor acceptance and tokens per step per route.
# </details>
#
# <details><summary><b>What is distillation, and why does a distilled draft speculate better?</b></summary>
#
# Distillation trains a small student to imitate a large teacher: it matches the teacher's full next-token
# distribution (a KL loss on temperature-softened probabilities, plus the usual cross-entropy), or is
# fine-tuned on text the teacher generated. The student is faster because it has fewer weights to stream
# per token. As a draft, what matters is exactly how close q is to p: the acceptance rate of a guess is
# Σ min(p, q) = 1 − TV(p, q), so a draft trained to match the target's distribution gets more guesses accepted
# than an off-the-shelf small model of similar size — at k = 4 and 5% draft cost, going from α = 0.6 to 0.8
# lifts the expected speedup from 1.9× to 2.8×. The histogram above shows the cost of a poor draft: SmolLM2
# seeing two tokens of context agrees with the full model on only about half of its guesses.
# </details>

# %% [markdown]
# ### More from the question bank
#
# Every interview question this lab answers, with the project's answer, key points and the code that backs it
# (the same bank `minillm quiz --lab lab07` rehearses in a terminal, with spaced repetition):

# %%
from minillm.quiz import show
show(lab="lab07")
