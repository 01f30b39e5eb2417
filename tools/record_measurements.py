#!/usr/bin/env python
"""Write the measurement records that the question bank cites: results/<key>.json.

    python tools/record_measurements.py --list          # the recipes: what each runs and measures
    python tools/record_measurements.py bench-kv        # run one and write results/bench-kv.json
    python tools/record_measurements.py --check         # which records are stale (the code they measure changed)

Each recipe runs a real command (a `minillm bench` subcommand with --json, or a lab's solution script) and keeps
a handful of named values. The record also keeps the date, the machine (CPU, cores, load average at the start:
on a shared machine absolute times vary, ratios measured side by side hold better), the exact command line, and
a sha256 over the source files the measurement exercises (minillm.quiz.records.code_hash), so
tests/test_questions.py fails when an entry's figure and its record disagree and when the record is older than
the code it measured. After re-recording, update the figures the test names.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import io
import json
import os
import platform
import runpy
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from minillm.quiz.records import RESULTS_DIR, code_hash, stale, load_records  # noqa: E402


@dataclass(frozen=True)
class Recipe:
    key: str
    what: str
    argv: tuple[str, ...]                       # shown in the record; a `minillm` command or a script
    paths: tuple[str, ...]                      # the code the measurement exercises
    run: Callable[["Recipe"], dict[str, Any]]   # returns the values


def _bench_json(recipe: Recipe) -> dict[str, Any]:
    exe = Path(sys.executable).with_name("minillm")
    cmd = [str(exe) if exe.exists() else "minillm", *recipe.argv[1:]]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, check=False)
    if r.returncode != 0:
        raise SystemExit(f"{' '.join(recipe.argv)} failed ({r.returncode}):\n{r.stderr[-2000:]}")
    if r.stderr.strip():
        print(r.stderr.strip(), file=sys.stderr)
    return json.loads(r.stdout)


def _kv(recipe: Recipe) -> dict[str, Any]:
    d = _bench_json(recipe)
    return {"budget_tokens": d["budget_tokens"], "block_size": d["block_size"], "reserve_len": d["max_model_len"],
            "paged_waste_pct": round(100 * d["paged_waste_frac"], 2),
            "contiguous_waste_pct": round(100 * d["contiguous_waste_frac"], 2),
            "paged_max_sequences": d["paged_max_concurrency"],
            "contiguous_max_sequences": d["contiguous_max_concurrency"],
            "concurrency_ratio": d["concurrency_ratio"], "num_requests": d["num_requests"]}


def _decode(recipe: Recipe) -> dict[str, Any]:
    runs = {r["quantization"].split(":")[0]: r for r in _bench_json(recipe)["runs"]}
    out: dict[str, Any] = {}
    for name, r in runs.items():
        longest = max(r["prefill_tok_s"], key=int)
        out |= {f"{name}_decode_ms_per_token": round(r["decode_ms_per_token"], 2),
                f"{name}_bound_ms_per_token": round(r["bound_ms_per_token"], 2),
                f"{name}_measured_over_bound": round(r["ratio"], 2),
                f"{name}_weight_mb_per_token": round(r["weight_bytes_per_token"] / 1e6, 1),
                f"{name}_prefill_tok_s": round(r["prefill_tok_s"][longest], 1),
                f"{name}_prefill_len": int(longest),
                f"{name}_decode_tok_s": round(1000 / r["decode_ms_per_token"], 1),
                f"{name}_prefill_over_decode_tok_s": round(r["prefill_tok_s"][longest] * r["decode_ms_per_token"]
                                                           / 1000, 1),
                f"{name}_decode_step": r["decode_step"]}
    if {"auto", "none"} <= runs.keys():
        out["auto_decode_speedup_over_none"] = round(runs["none"]["decode_ms_per_token"]
                                                     / runs["auto"]["decode_ms_per_token"], 2)
        out["none_over_auto_weight_bytes"] = round(runs["none"]["weight_bytes_per_token"]
                                                   / runs["auto"]["weight_bytes_per_token"], 2)
    out["bandwidth_gb_s"] = round(next(iter(runs.values()))["bandwidth_gb_s"], 1)
    return out


def _prefix(recipe: Recipe) -> dict[str, Any]:
    d = _bench_json(recipe)
    out: dict[str, Any] = {}
    for name in ("system_prompt", "long_system_prompt", "multi_turn"):
        out[f"{name}_ttft_speedup"] = round(d[f"{name}_ttft_ratio"], 2)          # side by side: off / on
        out[f"{name}_hit_rate_pct"] = round(100 * d[f"{name}_hit_rate"], 1)      # deterministic
        out[f"{name}_prompt_tokens_mean"] = d[f"{name}_prompt_tokens_mean"]
    return out


def _lab04(recipe: Recipe) -> dict[str, Any]:
    """Run the lab04 solution as a learner would (figures to a non-interactive backend) and read its measurement
    cell's results: the same 8 requests under continuous and static admission."""
    import matplotlib
    matplotlib.use("Agg")        # figures go nowhere: only the measurement cell's results are read
    with contextlib.redirect_stdout(io.StringIO()):
        ns = runpy.run_path(str(REPO / recipe.argv[-1]), run_name="__main__")
    res, workload = ns["results"], ns["workload"]
    cont, stat = res["continuous"], res["static"]
    return {"requests": len(workload), "max_num_seqs": ns["bench"].scheduler.config.max_num_seqs,
            "continuous_steps": len(cont["steps"]), "static_steps": len(stat["steps"]),
            "steps_saved_pct": round(100 * (1 - len(cont["steps"]) / len(stat["steps"])), 1),
            "continuous_tok_s": round(cont["tok_s"], 1), "static_tok_s": round(stat["tok_s"], 1),
            "throughput_ratio": round(cont["tok_s"] / stat["tok_s"], 2)}


RECIPES = {r.key: r for r in [
    Recipe("bench-kv", "paged vs contiguous KV: unused share of reserved memory, sequences that fit (no timing)",
           ("minillm", "bench", "kv", "--json"),
           ("minillm/bench/kv.py", "minillm/bench/workload.py", "minillm/kv/block_manager.py",
            "minillm/kv/block_allocator.py"), _kv),
    Recipe("bench-decode", "batch-1 decode ms/token against the bandwidth bound, quantized (default) and fp32",
           ("minillm", "bench", "decode", "--json", "--quantization", "auto", "none", "--prefill-lens", "512"),
           ("minillm/bench/decode.py", "minillm/kernels", "minillm/models", "minillm/layers", "minillm/quant",
            "minillm/worker"), _decode),
    Recipe("bench-prefix", "TTFT with prefix caching off vs on, three chat patterns",
           ("minillm", "bench", "prefix", "--json", "--repeat", "1"),
           ("minillm/bench/prefix.py", "minillm/kv/prefix_cache.py", "minillm/kv/block_manager.py",
            "minillm/engine/scheduler.py"), _prefix),
    Recipe("lab04-batching", "lab04's measurement: 8 requests under continuous vs static admission",
           ("python", "solutions/lab04/lab04.py"),
           ("solutions/lab04/lab04.py", "minillm/engine/scheduler.py", "minillm/kv/block_manager.py",
            "minillm/bench/workload.py"), _lab04),
]}


def machine(note: str = "") -> dict[str, Any]:
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    return {"cpu": cpu, "cores": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
            "load_avg_1min_at_start": round(load, 2) if load is not None else None,
            "note": note}


def record(key: str, results_dir: Path = RESULTS_DIR, note: str = "") -> Path:
    recipe = RECIPES[key]
    started = dt.datetime.now(dt.timezone.utc)
    where = machine(note)
    t0 = time.perf_counter()
    values = recipe.run(recipe)
    doc = {"key": key, "what": recipe.what,
           "command": f"python tools/record_measurements.py {key}",
           "runs": " ".join(recipe.argv), "date": started.strftime("%Y-%m-%d"),
           "started_utc": started.strftime("%Y-%m-%dT%H:%M:%SZ"), "seconds": round(time.perf_counter() - t0, 1),
           "machine": where, "code": {"paths": list(recipe.paths), "sha256": code_hash(recipe.paths)},
           "values": values}
    results_dir.mkdir(exist_ok=True)
    path = results_dir / f"{key}.json"
    path.write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("keys", nargs="*", metavar="KEY", help=f"records to write: {', '.join(RECIPES)}")
    p.add_argument("--list", action="store_true", help="list the recipes")
    p.add_argument("--check", action="store_true", help="report stale records (exit 1 if any)")
    p.add_argument("--note", default="", help="what the record should say about the machine's state "
                                              "(e.g. '2 shared cores, busy: compare ratios')")
    a = p.parse_args(argv)
    if a.list:
        for r in RECIPES.values():
            print(f"{r.key:16} {r.what}\n{'':16} runs: {' '.join(r.argv)}\n{'':16} measures: {', '.join(r.paths)}")
        return 0
    if a.check:
        problems = [why for rec in load_records().values() if (why := stale(rec))]
        print("\n".join(problems) or "every record matches the code it measured")
        return 1 if problems else 0
    unknown = [k for k in a.keys if k not in RECIPES]
    if unknown or not a.keys:
        p.error(f"name one or more of: {', '.join(RECIPES)}" + (f" (unknown: {', '.join(unknown)})" if unknown else ""))
    for key in a.keys:
        print(f"recording {key} ...", file=sys.stderr)
        print(record(key, note=a.note))
    return 0


if __name__ == "__main__":
    sys.exit(main())
