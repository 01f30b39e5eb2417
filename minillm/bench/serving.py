"""`minillm bench serve`: drive any OpenAI-compatible server with realistic arrivals and measure what its users see.

Requests arrive as a Poisson process at each `--request-rate` (or a gamma process: `--burstiness` < 1 is burstier,
> 1 more regular; `inf` sends them all at once), optionally capped at `--max-concurrency` in flight. Each is one
streamed completion whose chunks are timed on arrival; serving_metrics turns the traces into TTFT / TPOT / ITL /
E2EL percentiles, throughput and goodput under the objectives of `--goodput`. The same seeded workload runs at every
rate, so the rows differ only by load; `--plot` draws latency against throughput with the knee marked (the last
rate whose p99 TTFT stays within KNEE_FACTOR x the lightest load's).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import math
import random
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import httpx
import matplotlib.pyplot as plt
from tqdm import tqdm

from minillm import config, plots
from minillm.cli_args import engine_config
from minillm.config import EngineConfig
from minillm.llm import LLM
from minillm.loading.loader import peek_tokenizer
from minillm.bench.registry import parse_goodput, parse_rates  # noqa: F401 (checked flags, re-exported)
from minillm.bench.serving_metrics import Trace, summarize
from minillm.bench.workload import Request, WorkloadSpec, chat_prompt_of_length, make_workload
from minillm.sampling.params import SamplingParams

KNEE_FACTOR = 2.0


@dataclass
class Prompt:
    """One request of the workload: a text prompt (completions) or messages (chat), and its output length."""
    max_tokens: int
    text: str | None = None
    messages: list[dict] | None = None
    prompt_tokens: int = 0
    token_ids: list[int] | None = None      # sent as the completions prompt when known: every engine reads the same


# --------------------------------------------------------------------------- the workload

def chat_workload(tokenizer, num_prompts: int, prompt_range: tuple[int, int], output_range: tuple[int, int],
                  seed: int, variant: int = 0) -> list[Prompt]:
    """bench throughput's seeded chat workload (token ids, and their text): prompt and output lengths drawn from
    `seed`. Another `variant` keeps every length but draws other text, so a sweep's load levels do not hit each
    other's prompts in the server's prefix cache (the shared chat template still does, as in real traffic)."""
    spec = WorkloadSpec(num_prompts, *prompt_range, *output_range, seed)
    reqs = make_workload(tokenizer, spec)
    if variant:
        rng = random.Random(f"{seed}/{variant}")
        reqs = [Request(chat_prompt_of_length(tokenizer, len(r.prompt_token_ids), rng), r.max_tokens) for r in reqs]
    return [Prompt(r.max_tokens, text=tokenizer.decode(r.prompt_token_ids, skip_special_tokens=False),
                   prompt_tokens=len(r.prompt_token_ids), token_ids=list(r.prompt_token_ids)) for r in reqs]


def jsonl_workload(path: str | Path, num_prompts: int, default_max_tokens: int) -> list[Prompt]:
    """One JSON object a line: {"prompt": "..."} or {"messages": [...]}, optionally "max_tokens"."""
    out = []
    for i, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{i} is not JSON ({e.msg})") from None
        if not isinstance(row, dict) or ("prompt" in row) == ("messages" in row):
            raise ValueError(f"{path}:{i}: each line is an object with \"prompt\" (text) or \"messages\" (a chat)")
        out.append(Prompt(int(row.get("max_tokens", default_max_tokens)), text=row.get("prompt"),
                          messages=row.get("messages")))
        if len(out) == num_prompts:
            break
    if not out:
        raise ValueError(f"{path} holds no prompts")
    return out


def arrival_offsets(n: int, rate: float, burstiness: float, rng: random.Random) -> list[float]:
    """When each request is sent (seconds from the start): gamma inter-arrival times of mean 1/rate (shape
    `burstiness`; 1 is Poisson); all at 0 for an infinite rate."""
    if math.isinf(rate):
        return [0.0] * n
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.gammavariate(burstiness, 1.0 / (rate * burstiness))
    return out


# --------------------------------------------------------------------------- one request, one rate, a sweep

async def send(http: httpx.AsyncClient, base_url: str, model: str, p: Prompt) -> Trace:
    chat = p.messages is not None
    body: dict[str, Any] = {"model": model, "max_tokens": p.max_tokens, "stream": True, "temperature": 0,
                            "ignore_eos": True, "stream_options": {"include_usage": True}}
    body.update({"messages": p.messages} if chat else {"prompt": p.token_ids if p.token_ids else p.text})
    sent, times, usage, error = time.perf_counter(), [], {}, None
    try:
        async with http.stream("POST", f"{base_url}/{'chat/completions' if chat else 'completions'}",
                               json=body) as r:
            if r.status_code != 200:
                error = f"HTTP {r.status_code}: {(await r.aread())[:200].decode(errors='replace')}"
            else:
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    event = json.loads(line[6:])
                    usage = event.get("usage") or usage
                    for choice in event.get("choices") or []:
                        text = (choice.get("delta") or {}).get("content") if chat else choice.get("text")
                        if text:
                            times.append(time.perf_counter())
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        error = f"{type(e).__name__}: {e}"
    # a server that sends no usage: one token per chunk
    return Trace(sent, times, usage.get("completion_tokens", len(times)),
                 usage.get("prompt_tokens", p.prompt_tokens), error)


async def run_rate(base_url: str, model: str, prompts: list[Prompt], rate: float, burstiness: float, seed: int,
                   max_concurrency: int | None, done: Callable[[], None] = lambda: None) -> tuple[list[Trace], float]:
    offsets = arrival_offsets(len(prompts), rate, burstiness, random.Random(seed))
    gate = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    async with httpx.AsyncClient(timeout=httpx.Timeout(None, connect=30), limits=limits) as http:
        start = time.perf_counter()

        async def one(p: Prompt, at: float) -> Trace:
            await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
            if gate is None:
                trace = await send(http, base_url, model, p)
            else:
                async with gate:
                    trace = await send(http, base_url, model, p)
            done()
            return trace
        traces = await asyncio.gather(*(one(p, at) for p, at in zip(prompts, offsets)))
    return list(traces), time.perf_counter() - start


@dataclass
class Run:
    """One load level: the traces of every request sent at `rate` requests/s, over `duration` seconds."""
    rate: float
    traces: list[Trace]
    duration: float


def measure(base_url: str, model: str, prompts: list[Prompt] | Callable[[int], list[Prompt]], rates: list[float],
            *, burstiness: float = 1.0, seed: int = 0, max_concurrency: int | None = None,
            progress: Callable[[int], None] = lambda n: None) -> list[Run]:
    """The workload at each rate in turn (never two rates at once): the same prompts, or prompts(i) for the i-th
    rate (chat_workload's variants: the same lengths, text the prefix cache has not seen)."""
    runs = []
    for i, rate in enumerate(rates):
        batch = prompts(i) if callable(prompts) else prompts
        traces, duration = _run(run_rate(base_url, model, batch, rate, burstiness, seed, max_concurrency,
                                         lambda: progress(1)))
        runs.append(Run(rate, traces, duration))
    return runs


def run_workload(base_url: str, model: str, prompts: list[Prompt]) -> tuple[list[Trace], float]:
    """Every prompt sent at once (no arrival process): the traces and the seconds until the last token."""
    return _run(run_rate(base_url, model, prompts, math.inf, 1.0, 0, None))


def _run(coro):
    """asyncio.run, also from a thread whose event loop is already running (a Jupyter kernel's): there, on a
    thread of its own."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()


def rows_of(runs: list[Run], slos: dict[str, float] | None = None, **metric_fns: Callable) -> list[dict]:
    """A table row per run, the knee's marked ("knee": True); metric_fns (percentile=, request_metrics=,
    goodput=) replace serving_metrics' own."""
    rows = [{"request_rate": r.rate, **summarize(r.traces, r.duration, slos, **metric_fns),
             "errors": sorted({t.error for t in r.traces if t.error})[:3]} for r in runs]
    k = knee(rows)
    for i, row in enumerate(rows):
        row["knee"] = i == k and k != len(rows) - 1         # the last rate is no knee: the curve may go on
    return rows


def sweep(base_url: str, model: str, prompts: list[Prompt] | Callable[[int], list[Prompt]], rates: list[float], *,
          burstiness: float = 1.0,
          seed: int = 0, max_concurrency: int | None = None, slos: dict[str, float] | None = None,
          progress: Callable[[int], None] = lambda n: None) -> list[dict]:
    return rows_of(measure(base_url, model, prompts, rates, burstiness=burstiness, seed=seed,
                           max_concurrency=max_concurrency, progress=progress), slos)


def knee(rows: list[dict], metric: str = "p99_ttft_ms") -> int | None:
    """Index of the last row (rows in rate order) whose `metric` stays within KNEE_FACTOR x the first row's."""
    if not rows or not math.isfinite(rows[0][metric]):
        return None
    base, last = rows[0][metric], 0
    for i, row in enumerate(rows):
        if math.isfinite(row[metric]) and row[metric] <= KNEE_FACTOR * base:
            last = i
        else:
            break
    return last


def check_server(base_url: str, model: str | None) -> str:
    """The model name to send (the server's first when not given), or an error that says what is wrong."""
    try:
        r = httpx.get(f"{base_url}/models", timeout=10)
    except httpx.HTTPError as e:
        raise ValueError(f"no OpenAI-compatible server at {base_url} ({type(e).__name__}: {e}): start one, e.g. "
                         "`minillm serve`, and pass its /v1 URL as --base-url") from None
    if r.status_code != 200:
        raise ValueError(f"{base_url}/models answered HTTP {r.status_code}: is --base-url the server's /v1 URL?")
    names = [m.get("id") for m in r.json().get("data", [])]
    if model is None:
        if not names:
            raise ValueError(f"{base_url} serves no model")
        return names[0]
    return model


# --------------------------------------------------------------------------- the table and the picture

def table(rows: list[dict], label: str) -> str:
    head = (f"{'rate req/s':>10} {'done':>5} {'fail':>4} {'req/s':>6} {'out tok/s':>9} {'TTFT p50':>9} "
            f"{'p99':>8} {'TPOT p50':>9} {'p99':>7} {'ITL p99':>8} {'E2EL p99':>9}"
            + (f" {'goodput':>8}" if "goodput" in rows[0] else ""))
    lines = [f"{label}: latencies in ms", head]
    for r in rows:
        lines.append(f"{r['request_rate']:>10g} {r['completed']:>5} {r['failed']:>4} {r['request_throughput']:>6.2f} "
                     f"{r['output_throughput']:>9.1f} {r['p50_ttft_ms']:>9.0f} {r['p99_ttft_ms']:>8.0f} "
                     f"{r['p50_tpot_ms']:>9.1f} {r['p99_tpot_ms']:>7.1f} {r['p99_itl_ms']:>8.1f} "
                     f"{r['p99_e2el_ms']:>9.0f}" + (f" {r['goodput']:>8.2f}" if "goodput" in r else "")
                     + ("  <- knee" if r.get("knee") else ""))
    return "\n".join(lines)


def plot_curves(runs: dict[str, list[dict]], path: str) -> None:
    """plots.latency_throughput of every run, written to `path` (PNG)."""
    fig = plots.latency_throughput(runs, show=False)
    fig.savefig(path, dpi=120)
    plt.close(fig)


# --------------------------------------------------------------------------- minillm's own server, and offline

@contextlib.contextmanager
def server_process(model: str, engine_flags: list[str], name: str = "minillm") -> Iterator[str]:
    """`minillm serve` in a process of its own (so the benchmark's client never shares its interpreter), on a free
    port; yields its /v1 URL and stops it on exit."""
    cmd = [sys.executable, "-m", "minillm", "serve", "--model", model, "--port", "0", "--served-model-name", name,
           *engine_flags]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env=config.child_env(PYTHONUNBUFFERED="1"))
    try:
        url, seen = None, []
        for line in proc.stderr:
            seen.append(line)
            m = re.search(r"ready on (http://[\d.]+:\d+/v1)", line)
            if m:
                url = m.group(1)
                break
        if url is None:
            raise ValueError("minillm serve did not start: " + "".join(seen[-5:]).strip())
        threading.Thread(target=lambda: [None for _ in proc.stderr], daemon=True).start()   # keep the pipe drained
        yield url
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()


def offline_throughput(llm, prompts: list[Prompt]) -> float:
    """Output tokens per second of LLM.generate on the same workload, all at once (the upper bound a server's
    streaming, HTTP and scheduling of arrivals can approach)."""
    params = [SamplingParams(temperature=0, max_tokens=p.max_tokens, ignore_eos=True) for p in prompts]
    t0 = time.perf_counter()
    outs = llm.generate([p.token_ids for p in prompts], params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    return sum(len(o.outputs[0].token_ids) for o in outs) / seconds


# --------------------------------------------------------------------------- `minillm bench serve`

def engine_argv(args, parser_actions) -> list[str]:
    """The engine settings the user typed, as `minillm serve` flags (for the server bench serve starts)."""
    names = set(EngineConfig().as_kwargs()) | {a.dest for a in parser_actions if a.dest.startswith("spec_")}
    argv = []
    for a in parser_actions:
        value = getattr(args, a.dest, None)
        if a.dest not in names or value is None or not a.option_strings:
            continue
        if isinstance(value, bool):
            argv.append(a.option_strings[0] if value else a.option_strings[-1])
        else:
            argv += [a.option_strings[0], str(value)]
    return argv


def _workloads(args, tokenizer) -> Callable[[int], list[Prompt]]:
    if args.dataset:
        prompts = jsonl_workload(args.dataset, args.num_prompts, args.output_range[1])
        return lambda i: prompts
    return lambda i: chat_workload(tokenizer, args.num_prompts, tuple(args.prompt_range), tuple(args.output_range),
                                   args.seed, variant=i)


def run_cli(args, parser_actions) -> dict:
    """The sweep `minillm bench serve` asked for: {"label", "base_url", "rows", ...} (rows as in `table`)."""
    slos, rates = parse_goodput(args.goodput), parse_rates(args.request_rates)
    tokenizer = None if args.dataset else peek_tokenizer(args.model)[1]
    workload = _workloads(args, tokenizer)
    with contextlib.ExitStack() as stack:
        url = args.base_url.rstrip("/") if args.base_url else \
            stack.enter_context(server_process(args.model, engine_argv(args, parser_actions)))
        label = args.label or ("minillm" if not args.base_url else url.split("//")[-1].split("/")[0])
        name = args.served_model or check_server(url, None)
        warmup = workload(10_000)[:4]                                   # text no measured run sends
        measure(url, name, warmup, [math.inf])                          # warm-up, not measured
        bar = tqdm(total=len(rates) * args.num_prompts, desc=f"bench serve {label}", unit="req", disable=args.json)
        runs = measure(url, name, workload, rates, burstiness=args.burstiness, seed=args.seed,
                       max_concurrency=args.max_concurrency, progress=bar.update)
        bar.close()
    result = {"label": label, "base_url": url, "model": name, "slos_ms": {k: 1000 * v for k, v in slos.items()},
              "burstiness": args.burstiness, "rows": rows_of(runs, slos)}
    if args.offline_baseline:
        with LLM(args.model, **engine_config(args).as_kwargs()) as llm:
            offline_throughput(llm, warmup)                                 # the server's warm-up, no more
            result["offline_tok_s"] = offline_throughput(llm, workload(0))
        saturated = next(r for r in result["rows"] if math.isinf(r["request_rate"]))
        result["server_over_offline"] = saturated["output_throughput"] / result["offline_tok_s"]
    return result


def report(result: dict, compare: list[dict]) -> str:
    """The table of this run, the compared runs', and goodput ratios at the rates they share."""
    lines = [table(r["rows"], r["label"]) for r in [result, *compare]]
    if "offline_tok_s" in result:
        lines.append(f"offline LLM.generate on the same workload: {result['offline_tok_s']:.1f} tok/s; the server "
                     f"at rate inf reaches {result['server_over_offline']:.2f}x of it")
    for other in compare:
        theirs = {r["request_rate"]: r for r in other["rows"]}
        for row in result["rows"]:
            peer = theirs.get(row["request_rate"])
            if peer is not None and "goodput" in row and "goodput" in peer:
                ratio = row["goodput"] / peer["goodput"] if peer["goodput"] else math.inf
                lines.append(f"rate {row['request_rate']:g}: goodput {result['label']} {row['goodput']:.2f} vs "
                             f"{other['label']} {peer['goodput']:.2f} req/s ({ratio:.2f}x)")
    return "\n\n".join(lines)
