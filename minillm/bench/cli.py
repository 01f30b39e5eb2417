"""`minillm bench throughput | kv | prefix` (decode lives in cli.py next to the loader)."""
from __future__ import annotations

import argparse
import json

import torch

from minillm.bench.kv import kv_bench, pool_tokens_per_gib
from minillm.bench.prefix import format_prefix, prefix_bench
from minillm.bench.spec import SpecBenchConfig, format_spec_bench, run_spec_bench, spec_plot
from minillm.bench.structured import format_structured, structured_bench as run_bench
from minillm.bench.throughput import load_hf_peer, run_minillm, run_transformers_static, throughput_plot
from minillm.bench.workload import WorkloadSpec, make_workload
from minillm.cli_args import engine_config, status
from minillm.config import EngineConfig
from minillm.kernels import cpu_qgemm, cpu_w8a8
from minillm.loading.loader import load_model
from minillm.quant.policy import describe


def load_with_status(args: argparse.Namespace, config: EngineConfig):
    """The model `--model` names, in the config's dtype, with `--threads` applied and a status line meanwhile."""
    import torch
    if getattr(args, "threads", None):
        torch.set_num_threads(args.threads)
    with status(f"loading {args.model} model"):
        return load_model(args.model, config.dtype, quantization=config.quantization,
                          group_size=config.quantization_group_size)


def run(args) -> int:
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.what == "spec":
        return spec_bench(args)
    if args.what == "structured":
        return structured_bench(args)
    config = engine_config(args)
    spec = WorkloadSpec(num_requests=args.num_requests, seed=args.seed, min_prompt=args.prompt_range[0],
                        max_prompt=args.prompt_range[1], min_output=args.output_range[0], max_output=args.output_range[1])
    if not (0 < spec.min_prompt <= spec.max_prompt and 0 < spec.min_output <= spec.max_output):   # before the load
        raise ValueError("--prompt-lens and --output-lens take MIN MAX with 0 < MIN <= MAX")
    if args.what == "throughput":
        result = throughput(spec, args, getattr(args, "quantizations", None) or [config.quantization])
        if args.plot:
            throughput_plot(result, args.plot)
        print(json.dumps(result) if args.json else format_throughput(result, args.plot))
        return 0
    loaded = load_with_status(args, config)
    if args.what == "kv":
        workload = make_workload(loaded.tokenizer, spec)
        result = kv_bench(workload, budget_tokens=args.kv_budget_tokens, block_size=config.cache.block_size,
                          max_model_len=args.reserve_len,
                          bytes_per_token=loaded.config.kv_bytes_per_token(loaded.model.dtype.itemsize))
        result["pool_tokens_per_gib"] = pool_tokens_per_gib(loaded.model.kv_cfg)
        result["workload"] = spec.as_dict()
        print(json.dumps(result) if args.json else format_kv(result))
    else:
        result = prefix_bench(loaded.model, loaded.tokenizer, config, repeats=args.repeat or 2,
                              progress=not args.json)
        print(json.dumps(result) if args.json else format_prefix(result))
    return 0


def throughput(spec: WorkloadSpec, args, quantizations: list[str]) -> dict:
    """The workload through minillm once per --quantization (rounds interleaved, --repeat of them, each keeping
    its fastest run), then transformers' static batches; the first quantization's run is the headline."""
    progress = not args.json
    models, runs = {}, {}
    for q in quantizations:
        args.quantization = q
        config = engine_config(args)
        models[q] = (load_with_status(args, config), config)
    loaded = models[quantizations[0]][0]
    workload = make_workload(loaded.tokenizer, spec)
    for _ in range(args.repeat or 1):
        for q, (lq, config) in models.items():
            run = run_minillm(lq.model, lq.tokenizer, workload, config=config, progress=progress)
            if q not in runs or run.tok_s > runs[q].tok_s:
                runs[q] = run
    mini = runs[quantizations[0]]
    by_bs = {}
    if not args.no_baseline:
        hf = load_hf_peer(models["none"][0] if "none" in models else loaded)   # a float load: no reload
        pad = loaded.tokenizer.eos_token_id or 0
        for bs in args.baseline_batch_sizes:
            by_bs[bs] = round(run_transformers_static(hf, workload, bs, pad, progress=progress).tok_s, 2)
    best_bs = max(by_bs, key=by_bs.get) if by_bs else None
    ref = runs.get("none")
    per_q = {q: {"tok_s": round(r.tok_s, 2), "formats": describe(models[q][0].model),
                 "vs_none": round(r.tok_s / ref.tok_s, 3) if ref else None,
                 "paths": matmul_paths(q, models[q][0].model),
                 "minillm": r.summary()} for q, r in runs.items()}
    return {
        "minillm_tok_s": round(mini.tok_s, 2), "baseline_tok_s": by_bs.get(best_bs),
        "ratio": round(mini.tok_s / by_bs[best_bs], 3) if by_bs else None, "baseline_best_batch_size": best_bs,
        "baseline_by_batch_size": by_bs, "minillm": mini.summary(), "by_quantization": per_q,
        "dtype": str(loaded.model.dtype).removeprefix("torch."), "quantization": quantizations[0],
        "threads": torch.get_num_threads(), "model": loaded.path.name, "workload": spec.as_dict(),
        "settings": {**models[quantizations[0]][1].as_kwargs(), "greedy": True, "ignore_eos": True},
        "repeat": args.repeat or 1,
    }


def matmul_paths(quantization: str, model=None) -> str:
    """Which matmul runs the linear layers at which step size, in words (minillm/kernels/cpu_qgemm.py)."""
    if quantization == "none":
        return "float GEMM at every size"
    if quantization == "w8a8":
        return f"W8A8 ({cpu_w8a8.impl()}) at every size"
    smoothed = model is not None and any(m.w8a8_smooth is not None for _, m in model.quantizable())
    path = cpu_qgemm.batched_path()
    copy = ("a W8A8 copy with SmoothQuant factors" if path == "w8a8" and smoothed
            else "the int16 GEMM on a packed copy" if path == "int16" else f"a {path} copy")
    fused = " (decode steps: one fused C call either way)" if path == "int16" else ""
    return (f"C integer kernel below {cpu_qgemm.BATCHED_MIN_ROWS} rows (one fused C call per decode step), {copy} "
            f"from {cpu_qgemm.BATCHED_MIN_ROWS} rows{fused} (layers a float checkpoint left float: float GEMM)")


def format_throughput(r: dict, plot: str | None) -> str:
    m = r["minillm"]
    lines = [f"workload: {r['workload']['num_requests']} chat requests, seed {r['workload']['seed']}, "
             f"{r['dtype']}, {r['threads']} threads, best of {r.get('repeat', 1)} interleaved round(s)"]
    for q, v in r.get("by_quantization", {}).items():
        ratio = f"   {v['vs_none']:.2f}x none" if v["vs_none"] is not None else ""
        lines += [f"minillm --quantization {q:<5}: {v['tok_s']:8.1f} output tok/s{ratio}",
                  f"    weights: {v['formats']}", f"    matmuls: {v['paths']}"]
    lines += [f"transformers static bs={bs:<3d}  : {v:8.1f} output tok/s" for bs, v in r["baseline_by_batch_size"].items()]
    if r["ratio"] is not None:
        lines.append(f"ratio {r['quantization']} vs best static ({r['baseline_best_batch_size']}): {r['ratio']:8.2f}x")
    lines.append(f"minillm {r['quantization']}: TTFT p50/p99 {m['ttft_p50_s']:.2f}/{m['ttft_p99_s']:.2f} s, "
                 f"TPOT p50/p99 {1000 * m['tpot_p50_s']:.0f}/{1000 * m['tpot_p99_s']:.0f} ms, "
                 f"peak {m['peak_running']} running, {m['num_preemptions']} preemptions, "
                 f"attention: {m.get('attention') or '?'}")
    if plot:
        lines.append(f"plot written to {plot}")
    return "\n".join(lines)


def format_kv(r: dict) -> str:
    return "\n".join([
        f"KV budget {r['budget_tokens']} tokens ({r['budget_bytes'] / 2**20:.0f} MiB), block {r['block_size']}, "
        f"contiguous reservation {r['max_model_len']} tokens/sequence",
        f"reserved but unused: paged {100 * r['paged_waste_frac']:.1f}%   contiguous {100 * r['contiguous_waste_frac']:.1f}%",
        f"max concurrent sequences: paged {r['paged_max_concurrency']}   contiguous {r['contiguous_max_concurrency']}"
        f"   ratio {r['concurrency_ratio']:.1f}x",
        *([pool_line(r["pool_tokens_per_gib"])] if "pool_tokens_per_gib" in r else []),
    ])


def pool_line(per_gib: dict[str, int]) -> str:
    return ("tokens per GiB of KV pool (--kv-cache-dtype): " + "   ".join(f"{k} {v}" for k, v in per_gib.items())
            + f"   int8/fp16 {per_gib['int8'] / per_gib['fp16']:.2f}x")


def spec_bench(args) -> int:
    if getattr(args, "spec_method", None) or getattr(args, "spec_num_speculative_tokens", None):
        raise ValueError("bench spec runs every proposer itself: choose them with --proposers and k with --k "
                         "(not --speculative / --num-speculative-tokens)")
    bc = SpecBenchConfig(tasks=tuple(args.tasks), proposers=tuple(args.proposers), ks=tuple(args.k),
                         batch_sizes=tuple(args.batch_sizes), batch1_requests=args.batch1_requests,
                         max_tokens=args.max_tokens, seed=args.seed, repeat=args.repeat or 1,
                         draft_model=args.spec_model or SpecBenchConfig.draft_model,
                         draft_layers=args.spec_draft_layers or SpecBenchConfig.draft_layers)
    args.spec_model = args.spec_draft_layers = None      # the bench's own choices, not the engine's
    config = engine_config(args)
    loaded = load_with_status(args, config)
    result = run_spec_bench(loaded, config, bc, progress=not args.json)
    if args.plot:
        spec_plot(result, args.plot)
    print(json.dumps(result) if args.json else format_spec_bench(result) +
          (f"\nplot written to {args.plot}" if args.plot else ""))
    return 0


def structured_bench(args) -> int:
    import sys
    config = engine_config(args)
    loaded = load_with_status(args, config)
    progress = None if args.json else (lambda msg: print(f"[{msg}]", file=sys.stderr, flush=True))
    r = run_bench(loaded, config, tuple(args.batch_sizes), args.max_tokens, args.repeat or 1, progress)
    if args.json:
        for e in r["end_to_end"].values():
            e.pop("example", None)
    print(json.dumps(r) if args.json else format_structured(r))
    return 0
