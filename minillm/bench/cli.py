"""The runners of `minillm bench BENCH` (the flags and their checks: bench/registry.py), imported by the CLI only
when a bench runs."""
from __future__ import annotations

import argparse
import json
import sys

import torch

from minillm.bench import decode, llama_server, parallel, quality, serving
from minillm.bench.kv import concurrency_cap_warning, kv_bench, pool_tokens_per_gib
from minillm.bench.prefix import format_prefix, prefix_bench
from minillm.bench.spec import SpecBenchConfig, format_spec_bench, run_spec_bench, spec_plot
from minillm.bench.structured import format_structured, structured_bench as run_bench
from minillm.bench.throughput import EngineRun, load_hf_peer, run_minillm, run_transformers_static, throughput_plot
from minillm.bench.registry import QUALITY_DEFAULT, bench_actions
from minillm.bench.spread import warn_if_repeats_disagree
from minillm.bench.workload import WorkloadSpec, make_workload
from minillm.cli_args import engine_config, progress_line, status
from minillm.config import EngineConfig
from minillm.kernels import cpu_qgemm, cpu_w8a8
from minillm.loading import loader
from minillm.quant.policy import describe


def load_with_status(args: argparse.Namespace, config: EngineConfig):
    """The model `--model` names, in the config's dtype, with `--threads` applied and a status line meanwhile."""
    if getattr(args, "threads", None):
        torch.set_num_threads(args.threads)
    with status(f"loading {args.model} model"):
        return loader.load_model(args.model, config.dtype, quantization=config.quantization,
                          group_size=config.quantization_group_size, device=config.device)


def run(args) -> int:
    """Run the bench `args.what` (its flags were checked by registry.check_args before torch was imported)."""
    if args.threads:
        torch.set_num_threads(args.threads)
    return RUNNERS[args.what](args)


def _workload(args) -> WorkloadSpec:
    return WorkloadSpec(num_requests=args.num_requests, seed=args.seed, min_prompt=args.prompt_range[0],
                        max_prompt=args.prompt_range[1], min_output=args.output_range[0],
                        max_output=args.output_range[1])


def _quantizations(args) -> list[str]:
    """--quantization of the benches that compare several: the list, with the first as the engine's setting."""
    quantizations = list(args.quantizations or [EngineConfig().quantization])
    args.quantization = quantizations[0]
    return quantizations


def _progress(args):
    return None if args.json else (lambda msg: print(f"[{msg}]", file=sys.stderr, flush=True))


def decode_bench(args) -> int:
    quantizations = _quantizations(args)
    loads = []
    for q in quantizations:
        args.quantization = q
        config = engine_config(args)
        loads.append((load_with_status(args, config), config))
    peer_args = (args.llama_bench, args.threads or torch.get_num_threads()) if args.llama_bench else None

    def progress(done, total):
        if total > 1 and not args.json:
            print(f"[round {done}/{total}]", file=sys.stderr, flush=True)
    results, peer = decode.run_decode_benches(loads, tuple(args.prompt_lens), args.steps, args.repeat, peer_args,
                                              progress, args.background_load)
    series = {}
    for b in results:
        name = b.quantization.split(":")[0]
        series[f"decode ms/token, {name}"] = b.decode_ms_rounds
        series.update({f"prefill {n} tokens, {name}": ts for n, ts in b.prefill_s_repeats.items()})
        if b.loaded_ms_rounds:
            series[f"decode ms/token under load, {name}"] = b.loaded_ms_rounds
    if peer:
        series["llama.cpp decode tok/s"] = peer["tg_tok_s_rounds"]
    warn_if_repeats_disagree("decode", series)
    if args.json:
        print(json.dumps({"runs": [decode.as_dict(b) for b in results], "llama_cpp": peer}))
    else:
        print("\n".join([decode.format_decode_benches(results, peer), *decode.format_background(results, peer)]))
    return 0


def throughput_bench(args) -> int:
    quantizations = _quantizations(args)
    result = throughput(_workload(args), args, quantizations)
    warn_if_repeats_disagree("throughput", result["repeats"])
    if args.plot:
        throughput_plot(result, args.plot)
    print(json.dumps(result) if args.json else format_throughput(result, args.plot))
    return 0


def kv_bench_cli(args) -> int:
    spec = _workload(args)
    config = engine_config(args)
    loaded = load_with_status(args, config)
    workload = make_workload(loaded.tokenizer, spec)
    result = kv_bench(workload, budget_tokens=args.kv_budget_tokens, block_size=config.cache.block_size,
                      max_model_len=args.reserve_len,
                      bytes_per_token=loaded.config.kv_bytes_per_token(loaded.model.dtype.itemsize))
    result["pool_tokens_per_gib"] = pool_tokens_per_gib(loaded.model.kv_cfg)
    result["workload"] = spec.as_dict()
    warning = concurrency_cap_warning(result)
    if warning:
        print(f"warning: bench kv: {warning}", file=sys.stderr, flush=True)
    print(json.dumps(result) if args.json else format_kv(result))
    return 0


def prefix_bench_cli(args) -> int:
    config = engine_config(args)
    loaded = load_with_status(args, config)
    result = prefix_bench(loaded.model, loaded.tokenizer, config, repeats=args.repeat, progress=not args.json)
    warn_if_repeats_disagree("prefix", result["repeats"])
    print(json.dumps(result) if args.json else format_prefix(result))
    return 0


def parallel_bench(args) -> int:
    config = engine_config(args)
    r = parallel.run_parallel_bench(args.model, config, tuple(args.layouts), tuple(args.batch_sizes), args.steps,
                                    progress=_progress(args))
    if args.plot:
        parallel.parallel_plot(r, args.plot)
    plotted = f"\nplot written to {args.plot}" if args.plot else ""
    print(json.dumps(r) if args.json else parallel.format_parallel(r) + plotted)
    return 0


def quality_bench(args) -> int:
    quantizations = list(args.quantizations or QUALITY_DEFAULT)
    config = engine_config(args)     # the engine settings quality reads (group size, KV cache dtype), validated
    progress = None if args.json else progress_line
    rows = quality.run_quality_bench(args.model, quantizations, config.quantization_group_size, args.windows, 256,
                                     progress=progress, kv_cache_dtype=config.cache.kv_cache_dtype)
    progress_line("")
    if args.plot:
        quality.quality_plot(rows, args.plot)
    print(json.dumps(quality.as_dicts(rows)) if args.json else quality.format_quality(rows, args.windows, 256)
          + (f"\nplot written to {args.plot}" if args.plot else ""))
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
    rounds: dict[str, list[float]] = {q: [] for q in models}
    for _ in range(args.repeat):
        for q, (lq, config) in models.items():
            run = run_minillm(lq.model, lq.tokenizer, workload, config=config, progress=progress)
            rounds[q].append(round(run.tok_s, 2))
            if q not in runs or run.tok_s > runs[q].tok_s:
                runs[q] = run
        if args.llama_server:
            run = llama_server.timed_round(args.llama_server, loaded.path, torch.get_num_threads(),
                                           models[quantizations[0]][1].scheduler.max_num_seqs, _slot_len(spec),
                                           workload)
            rounds.setdefault("llama-server", []).append(round(run.tok_s, 2))
            if "llama-server" not in runs or run.tok_s > runs["llama-server"].tok_s:
                runs["llama-server"] = run
    peer_run = runs.pop("llama-server", None)
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
        "repeat": args.repeat, "repeats": {f"{q if q == 'llama-server' else 'minillm ' + q} output tok/s": v
                                           for q, v in rounds.items()},
        "llama_server": None if peer_run is None else _peer_result(args, loaded, models[quantizations[0]][1], spec,
                                                                  peer_run, mini, rounds[quantizations[0]],
                                                                  rounds["llama-server"]),
    }


def _peer_result(args, loaded, config: EngineConfig, spec: WorkloadSpec, peer: EngineRun, mini: EngineRun,
                 mini_rounds: list[float], peer_rounds: list[float]) -> dict:
    cmd = llama_server.command(args.llama_server, loaded.path, torch.get_num_threads(),
                               config.scheduler.max_num_seqs, _slot_len(spec), 0)
    return {**peer.summary(), "command": " ".join(cmd[:-2]),          # the port was a free one
            "minillm_over_llama_server": round(mini.tok_s / peer.tok_s, 3),
            "per_round_ratios": [round(a / b, 3) for a, b in zip(mini_rounds, peer_rounds)]}


def _slot_len(spec: WorkloadSpec) -> int:
    """Each llama-server slot holds one request's prompt and output, and a little room."""
    return spec.max_prompt + spec.max_output + 16


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
    return (f"C integer kernel's tiles up to {cpu_qgemm.TILES_MAX_ROWS} rows (decode steps: one fused C call at "
            f"any batch), {copy} from "
            f"{cpu_qgemm.TILES_MAX_ROWS + 1} rows (layers a float checkpoint left float: float GEMM)")


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
    peer = r.get("llama_server")
    if peer is not None:
        lines += [f"llama.cpp llama-server         : {peer['tok_s']:8.1f} output tok/s   ({peer['command']})",
                  f"ratio {r['quantization']} vs llama-server: {peer['minillm_over_llama_server']:8.2f}x"
                  + (f"   (per round: {', '.join(f'{x:.2f}' for x in peer['per_round_ratios'])})"
                     if len(peer["per_round_ratios"]) > 1 else ""),
                  f"llama-server: TTFT p50/p99 {peer['ttft_p50_s']:.2f}/{peer['ttft_p99_s']:.2f} s, "
                  f"TPOT p50/p99 {1000 * peer['tpot_p50_s']:.0f}/{1000 * peer['tpot_p99_s']:.0f} ms"]
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
    bc = SpecBenchConfig(tasks=tuple(args.tasks), proposers=tuple(args.proposers), ks=tuple(args.k),
                         batch_sizes=tuple(args.batch_sizes), batch1_requests=args.batch1_requests,
                         max_tokens=args.max_tokens, seed=args.seed, repeat=args.repeat,
                         draft_model=args.spec_model or SpecBenchConfig.draft_model,
                         draft_layers=args.spec_draft_layers or SpecBenchConfig.draft_layers)
    args.spec_model = args.spec_draft_layers = None      # the bench's own choices, not the engine's
    config = engine_config(args)
    loaded = load_with_status(args, config)
    result = run_spec_bench(loaded, config, bc, progress=not args.json)
    warn_if_repeats_disagree("spec", result["repeats"])
    if args.plot:
        spec_plot(result, args.plot)
    print(json.dumps(result) if args.json else format_spec_bench(result) +
          (f"\nplot written to {args.plot}" if args.plot else ""))
    return 0


def structured_bench(args) -> int:
    config = engine_config(args)
    loaded = load_with_status(args, config)
    r = run_bench(loaded, config, tuple(args.batch_sizes), args.max_tokens, args.repeat, _progress(args))
    warn_if_repeats_disagree("structured", r["repeats"])
    if args.json:
        for e in r["end_to_end"].values():
            e.pop("example", None)
    print(json.dumps(r) if args.json else format_structured(r))
    return 0


# Each bench's runner; registry.BENCHES describes them (a bench missing here fails tests/test_bench_cli.py).
def serve_bench(args) -> int:
    actions = bench_actions("serve")
    compare = [json.loads(open(path).read()) for path in args.compare or []]
    result = serving.run_cli(args, actions)
    if args.plot:
        serving.plot_curves({r["label"]: r["rows"] for r in [result, *compare]}, args.plot)
    print(json.dumps(result, indent=1, default=str) if args.json else serving.report(result, compare))
    return 0


RUNNERS = {"decode": decode_bench, "throughput": throughput_bench, "kv": kv_bench_cli, "prefix": prefix_bench_cli,
           "spec": spec_bench, "structured": structured_bench, "parallel": parallel_bench, "quality": quality_bench,
           "serve": serve_bench}
