# ---
# jupyter:
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Lab 11 — Serving: what users wait for, and keeping it bounded under load
#
# **The question.** *"Your model serves fine in a notebook. What does a server like vLLM add on top of
# `generate()`, how do you tell whether it is fast enough — and what happens to your p99 when traffic doubles?"*
#
# `generate()` takes a batch you already have and returns when all of it is done. A server takes requests one at
# a time, from many users, at moments it does not choose, and each user watches their own answer stream in. So a
# server adds: an **HTTP front end** (the OpenAI API here, so every client library works), **streaming** (each
# step's tokens leave as soon as they exist), **continuous batching across requests that arrive at different
# times** (the engine loop of lab04, fed from a queue), **metrics** about what users experience, and **admission
# control** (what to do when more arrives than the engine can start).
#
# What users experience is not one number:
#
# * **TTFT** — time to first token: from sending the request to the first streamed text (queueing + prefill).
# * **TPOT** — time per output token after the first, per request: how fast the answer reads.
# * **ITL** — inter-token latency: every gap between consecutive chunks; its tail shows stalls that an average
#   per request hides (a long prefill of someone else's prompt pausing everyone's decode).
# * **E2EL** — end-to-end latency: from sending to the last token.
# * **goodput** — requests per second that met *every* service-level objective (e.g. TTFT ≤ 500 ms and TPOT ≤
#   100 ms): the throughput that counts.
#
# **What you will build.** The metric functions the benchmark reports with (they plug into `minillm bench serve`'s
# summary), then an admission policy the server runs; you will drive a real server with Poisson arrivals, draw
# its latency–throughput curve, find the knee, and watch your policy hold p99 TTFT past it.
#
# Answer cells say `raise NotImplementedError()` until you fill them in; the cell after each is a graded check
# (don't edit it) that prints nothing when you are right.

# %% nbgrader="readonly"
import math

import openai

from minillm import LLM, plots
from minillm.bench import serving
from minillm.bench.serving_metrics import Trace, TraceMetrics
from minillm.serve.server import BackgroundServer

llm = LLM("default", max_num_seqs=16, kv_cache_memory="256MiB")          # SmolLM2-135M-Instruct
server = BackgroundServer(llm.engine, name="smollm2", sampling_defaults=llm.loaded.sampling_defaults)
client = openai.OpenAI(base_url=server.url, api_key="unused")
print(f"an OpenAI-compatible server at {server.url} (the page with the engine's live view: {server.base}/)")

# %% [markdown]
# The official `openai` client talks to it unmodified. With `stream=True` each engine step that produced text
# sends one chunk; watch them arrive:

# %% nbgrader="readonly"
import time

t0 = time.perf_counter()
stream = client.chat.completions.create(model="smollm2", stream=True, max_tokens=24,
                                        messages=[{"role": "user", "content": "Name three rivers in Europe."}])
for chunk in stream:
    if chunk.choices and chunk.choices[0].delta.content:
        print(f"{1000 * (time.perf_counter() - t0):7.1f} ms  {chunk.choices[0].delta.content!r}")

# %% [markdown]
# The first line's time is the TTFT; the gaps between lines are the ITLs. A benchmark client records exactly
# that for every request: a **trace** — when it was sent, when each chunk arrived, how many tokens the answer
# held (the server's `usage`). A chunk may carry more than one token (a server streaming to a slow reader sends
# what accumulated), so tokens ≥ chunks.

# %% nbgrader="readonly"
example = Trace(sent=0.0, chunk_times=[0.5, 0.6, 0.7, 1.5], output_tokens=4, prompt_tokens=30)
print(example)

# %% [markdown]
# ## Task 1 — percentiles (2 points)
#
# Latency is reported as percentiles: p50 is the typical user, p99 the unlucky one in a hundred. Write
# `percentile(values, q)`: the `q`-th percentile (`q` from 0 to 100) of a list of numbers, **interpolating
# linearly between the two closest ranks of the sorted values** (numpy's default, and what vLLM's benchmark
# reports). With `n` sorted values, the q-th percentile sits at fractional position `(n − 1)·q/100`: p0 is the
# smallest value, p100 the largest. An empty list has no percentile: return `math.nan`. Don't reorder the
# caller's list.

# %% nbgrader="answer"
def percentile(values, q):
    """The q-th percentile (0..100) of values, linearly interpolated; nan for an empty list."""
    ### BEGIN SOLUTION
    if not values:
        return math.nan
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)
    ### END SOLUTION


# %% nbgrader="graded" points=2
from minillm.grading.lab11 import check_lab11_1; check_lab11_1(percentile)

# %% [markdown]
# ## Task 2 — one request's metrics (3 points)
#
# Write `request_metrics(trace)` returning `TraceMetrics(ttft, tpot, itl, e2el)` for a trace with at least one
# chunk:
#
# * `ttft` = first chunk − sent; `e2el` = last chunk − sent (seconds);
# * `tpot` = the time after the first chunk spread over the tokens after the first: `(e2el − ttft) /
#   (output_tokens − 1)`, and `None` for an answer of fewer than two tokens;
# * `itl` = the list of gaps between consecutive chunk times (one per gap, not an average).

# %% nbgrader="answer"
def request_metrics(trace):
    """TraceMetrics(ttft, tpot, itl, e2el) of one request's trace."""
    ### BEGIN SOLUTION
    chunks = trace.chunk_times
    ttft, e2el = chunks[0] - trace.sent, chunks[-1] - trace.sent
    tpot = (e2el - ttft) / (trace.output_tokens - 1) if trace.output_tokens >= 2 else None
    return TraceMetrics(ttft, tpot, [b - a for a, b in zip(chunks, chunks[1:])], e2el)
    ### END SOLUTION


# %% nbgrader="graded" points=3
from minillm.grading.lab11 import check_lab11_2; check_lab11_2(request_metrics)

# %% [markdown]
# ## Task 3 — goodput (2 points)
#
# Write `goodput(traces, slos, duration)`: the number of requests per second (over `duration` seconds) that met
# **every** objective in `slos`, a dict like `{"ttft": 0.5, "tpot": 0.1}` (seconds; keys among `ttft`, `tpot`,
# `e2el`). A value at its limit meets it; an undefined TPOT (a one-token answer) meets its objective; a failed
# request (`trace.error` set, or no chunk: `trace.ok` is False) never counts.

# %% nbgrader="answer"
def goodput(traces, slos, duration):
    """Requests per second that met every service-level objective."""
    ### BEGIN SOLUTION
    good = 0
    for t in traces:
        if not t.ok:
            continue
        m = request_metrics(t)
        values = {"ttft": m.ttft, "tpot": m.tpot, "e2el": m.e2el}
        good += all(values[k] is None or values[k] <= limit for k, limit in slos.items())
    return good / duration
    ### END SOLUTION


# %% nbgrader="graded" points=2
from minillm.grading.lab11 import check_lab11_3; check_lab11_3(goodput)

# %% [markdown]
# ## Plug in: the latency–throughput curve
#
# `serving.measure` sends the same seeded chat workload (bench throughput's, with fixed output lengths) to the
# server at each request rate — Poisson arrivals — and keeps every trace; your three functions turn them into
# the benchmark's rows (the same summary `minillm bench serve` prints, with your functions plugged in). `inf`
# sends everything at once: the saturated throughput.

# %%
def workload(i):       # the same lengths at every rate; other text, so no rate reuses another's cached prompts
    return serving.chat_workload(llm.tokenizer, 16, prompt_range=(32, 256), output_range=(16, 40), seed=0, variant=i)


rates = [2.0, 4.0, 8.0, math.inf]
SLOS = {"ttft": 2.0, "tpot": 0.2}
warm = serving.measure(server.url, "smollm2", workload(99)[:2], [math.inf])   # warm-up, not measured
# your three functions on the warm-up's two requests first: one not written yet stops here, not after the sweep
serving.rows_of(warm, SLOS, percentile=percentile, request_metrics=request_metrics, goodput=goodput)
runs = serving.measure(server.url, "smollm2", workload, rates, seed=0)
rows = serving.rows_of(runs, SLOS, percentile=percentile, request_metrics=request_metrics, goodput=goodput)
print(serving.table(rows, "smollm2 on this machine, your metrics"))
plots.latency_throughput({"minillm": rows})

# %% [markdown]
# Read the curve from left to right. At low rates the server is mostly idle: TTFT is about one prefill, TPOT one
# decode step for a small batch. As the rate grows, batches grow: throughput rises almost for free (decode is
# memory-bound: reading the weights once serves the whole batch), and TPOT creeps up. Past the **knee** the
# engine cannot start requests as fast as they arrive; they queue, and **p99 TTFT explodes** while TPOT barely
# moves — the classic "TTFT high but TPOT fine" symptom means queueing, not slow decoding. Goodput at the SLOs
# above peaks near the knee and falls beyond it, even as raw throughput keeps rising. (On a shared machine the
# numbers move from run to run; the shape does not. `minillm bench serve` repeats a sweep the same way.)
#
# ## Task 4 — admission control (3 points)
#
# An unbounded queue turns overload into latency for everyone. The server instead keeps the requests that were
# accepted but have not started (no token yet) within limits, and answers the rest `429 Too Many Requests` with a
# `Retry-After` header at once — a client (or a load balancer) can retry or go elsewhere.
#
# Write a class `Admission(max_waiting_requests, max_waiting_tokens)` with `admit(waiting_requests,
# waiting_tokens, prompt_tokens) -> bool`: may a new request with `prompt_tokens` prompt tokens join the
# `waiting_requests` requests (holding `waiting_tokens` prompt tokens) already waiting? Admit it when, with it,
# no more than `max_waiting_requests` requests and no more than `max_waiting_tokens` prompt tokens would be
# waiting — and always when nothing waits at all (a prompt larger than the whole budget would otherwise be
# refused forever; whether it fits the KV cache is the engine's question).

# %% nbgrader="answer"
class Admission:
    """Bounded waiting: a request count and a prompt-token budget."""

    def __init__(self, max_waiting_requests, max_waiting_tokens):
        ### BEGIN SOLUTION
        self.max_waiting_requests = max_waiting_requests
        self.max_waiting_tokens = max_waiting_tokens
        ### END SOLUTION

    def admit(self, waiting_requests, waiting_tokens, prompt_tokens):
        ### BEGIN SOLUTION
        if waiting_requests + 1 > self.max_waiting_requests:
            return False
        return waiting_requests == 0 or waiting_tokens + prompt_tokens <= self.max_waiting_tokens
        ### END SOLUTION


# %% nbgrader="graded" points=3
from minillm.grading.lab11 import check_lab11_4; check_lab11_4(Admission)

# %% [markdown]
# ## Plug in: your policy in front of the engine
#
# Two servers on the same engine, one after the other, take the same overload — 32 requests arriving at 12 per
# second, well past the knee: one with practically no limit, one with your policy (at most 4 requests
# waiting to start). Compare what the *admitted* requests waited, and how many were turned away.

# %%
def burst(i):
    return serving.chat_workload(llm.tokenizer, 32, prompt_range=(32, 256), output_range=(16, 40), seed=1,
                                 variant=10 + i)
server.close()
results = {}
for label, policy in [("no limit", Admission(10_000, 10**9)), ("your Admission(4, 2048)", Admission(4, 2048))]:
    with BackgroundServer(llm.engine, name="smollm2", admission=policy) as s:
        [run] = serving.measure(s.url, "smollm2", burst(len(results)), [12.0], seed=1)
    results[label] = serving.rows_of([run], SLOS, percentile=percentile, request_metrics=request_metrics,
                                     goodput=goodput)[0]
for label, r in results.items():
    print(f"{label:>24}: {r['completed']:2d} served, {r['failed']:2d} refused (429) — p99 TTFT of the served "
          f"{r['p99_ttft_ms']:6.0f} ms, p50 {r['p50_ttft_ms']:6.0f} ms; goodput {r['goodput']:.2f} req/s")

# %% [markdown]
# With no limit, every request is accepted and the last of the burst waits for all the others: p99 TTFT is the
# whole burst's drain time. With admission, the requests it lets in start almost at once, and the rest learn
# within milliseconds that they should retry (or be routed to another replica) instead of waiting in a queue
# whose length they cannot see. That is the trade a production server makes explicit: bounded latency for the
# admitted, a fast "no" for the rest — and autoscaling or load balancing (lab12) to turn the "no" into capacity.
#
# ## Questions
#
# <details><summary><b>What does a server like vLLM add over <code>generate()</code>?</b></summary>
#
# An API that many independent clients can use at once (OpenAI-compatible HTTP, streaming), an engine loop that
# admits requests as they arrive into the running batch (continuous batching with a scheduler that bounds the
# step's tokens and preempts when KV runs out), per-request sampling settings and structured outputs, prefix
# caching across users, metrics that describe users' experience (TTFT, ITL, E2EL histograms, queue and KV usage,
# under the names dashboards expect), admission control and graceful shutdown, and parallel execution behind the
# same API. `generate()` is the engine; the server is everything needed to share it.
# </details>
#
# <details><summary><b>TTFT is high but TPOT is fine. What is going on?</b></summary>
#
# Requests are waiting before they start, or their prefill is slow; decoding itself is healthy. Check the queue
# (`vllm:num_requests_waiting`, `vllm:request_queue_time_seconds`): if requests wait, the server is past its
# knee — add replicas, shed load with admission control, or raise `max_num_seqs` if KV allows. If they do not
# wait, prefill is the cost: long prompts (prefix caching, chunked prefill to interleave with decodes), a
# too-small `max_num_batched_tokens`, or preemptions recomputing prompts (`vllm:num_preemptions`).
# </details>
#
# <details><summary><b>p99 latency is bad under load but p50 is fine. Why, and what do you do?</b></summary>
#
# The tail is made of the requests that arrived behind a queue or a burst, or that shared steps with long
# prefills (ITL spikes), or that were preempted. Measure per-percentile under realistic arrivals (Poisson or
# burstier, not all at once), find the knee, and run below it; bound the queue (admission control with 429 +
# Retry-After) so overload becomes fast refusals, not slow answers; use chunked prefill so long prompts do not
# stall decodes; and scale out on queue time or KV usage rather than on CPU.
# </details>

# %% [markdown]
# ### More from the question bank
#
# Every interview question this lab answers, with the project's answer and key points (the same bank
# `minillm quiz --lab lab11` rehearses in a terminal):

# %%
from minillm.quiz import show
show(lab="lab11")

# %%
llm.close()
