"""`minillm fleet calibrate | validate | simulate | plan`: the parsers and the checks that run before anything
heavy loads.

Torch-free on purpose: minillm.cli builds these parsers for every command (`--help` must stay quick); the runners
live in minillm.fleet.run and are imported only when a fleet command runs."""
from __future__ import annotations

import argparse
import math
from pathlib import Path

from minillm.catalog import KNOWN_HARDWARE, KNOWN_MODELS, model_shape
from minillm.fleet.policies import SIGNALS, Autoscaler, FailurePlan, Slo, parse_p99_slo, parse_split
from minillm.quant.memory import WEIGHT_FORMATS

ROUTER_NAMES = ("round-robin", "least-tokens", "prefix-aware")     # = routers.ROUTERS (a test keeps them equal)
WORKLOAD_NAMES = ("chat", "rag", "multi-turn", "bursty")            # = workloads.WORKLOADS
ENGINES = ("auto", "exact", "fast")
AUTO_FAST_REQUESTS = 20_000   # auto runs the fast engine from this many requests (the exact one: ~1 min of wall)

FLEET_EPILOG = """examples:
  minillm fleet calibrate                      # the default model on this machine; saves the step model
  minillm fleet calibrate --model tiny-random --quick
  minillm fleet validate                       # the simulator vs the real engine on held-out workloads
  minillm fleet simulate --replicas 4 --router prefix-aware --rate 20 --duration 600 --workload chat --plot out.png
  minillm fleet simulate --model llama-3.1-70b --gpu h100 --tp 4 --replicas 16 --rate 300 --workload rag
  minillm fleet simulate --model llama-3.1-70b --gpu h100 --tp 4 --replicas 1035 --rate 10000 --duration 600 \\
                         --engine fast            # 6M requests in well under a minute
  minillm fleet simulate --router round-robin least-tokens prefix-aware --workload multi-turn --rate 5
  minillm fleet simulate --model llama-3.1-8b --gpu h100 --disaggregate 2:2 --kv-link-gbps 400 --workload rag
  minillm fleet simulate --model llama-3.1-8b --gpu h100 --autoscale queue:1:8 --min-replicas 1 --max-replicas 8 \\
                         --cold-start 30 --workload bursty --rate 40 --duration 300 --plot out.png
  minillm fleet simulate --model llama-3.1-8b --gpu h100 --fail-at 20:0 --retries 2 --slo ttft=500ms,tpot=50ms
  minillm fleet simulate --model llama-3.1-8b --gpu h100 --kv-offload-gib 64 --pcie-gbps 256 --workload multi-turn
  minillm fleet plan --model llama-3.1-70b --gpu h100 --rps 200 --slo ttft_p99=200ms,tpot_p99=50ms \\
                     --prompt-len 1000 --output-len 200 --price-per-gpu-hour 3
"""


def resolve_gpu(name: str) -> str:
    """A catalog accelerator by its name or an unambiguous start of it ("h100" -> "h100-sxm")."""
    if name in KNOWN_HARDWARE:
        return name
    matches = [k for k in KNOWN_HARDWARE if k.startswith(name.lower())]
    if len(matches) == 1:
        return matches[0]
    raise ValueError(f"unknown GPU {name!r}{' (ambiguous: ' + ', '.join(matches) + ')' if matches else ''}; "
                     f"known: {', '.join(sorted(KNOWN_HARDWARE))}")


def add_fleet_parser(sub) -> argparse.ArgumentParser:
    f = sub.add_parser("fleet", help="a calibrated simulator of a serving fleet (calibrate | simulate | plan)",
                       description="From one engine to a fleet: calibrate a step-time model on the real engine, then "
                                   "simulate N replicas (the engine's own scheduler and block manager on a simulated "
                                   "clock) behind a router.",
                       epilog=FLEET_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    fs = f.add_subparsers(dest="fleet_command", required=True, metavar="SUBCOMMAND")

    c = fs.add_parser("calibrate", help="run the real engine on this machine, fit the step-time model, save it",
                      description="Runs the engine over a spread of batch sizes, prompt lengths and chunked-prefill "
                                  "mixes, records each step's features and wall time, fits t = overhead + "
                                  "max(compute, memory) and reports its error on held-out scenarios.",
                      epilog=FLEET_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    c.add_argument("--model", default="default",
                   help="'default' (SmolLM2-135M-Instruct), a .gguf file, a Hugging Face directory, or 'tiny-random'")
    c.add_argument("--quick", action="store_true", help="a third of the scenarios (a quick look)")
    c.add_argument("--out", metavar="FILE", default=None, help="where to save (default: the user cache dir)")
    c.add_argument("--seed", type=int, default=0)

    v = fs.add_parser("validate", help="the simulator against the real engine on held-out workloads (one table)",
                      description="Replays held-out workloads (Poisson arrivals at loads 0.5, 1, 2 of a mean "
                                  "request's service rate; two prompt/output length mixes calibration never ran) "
                                  "through the real engine on this machine and through one simulated replica on the "
                                  "saved step model; prints TTFT and TPOT p50/p99 and throughput, real vs simulated, "
                                  "with the relative errors.",
                      epilog=FLEET_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    v.add_argument("--model", default="default",
                   help="'default' (SmolLM2-135M-Instruct), a .gguf file, a Hugging Face directory, or 'tiny-random'")
    v.add_argument("--step-model", metavar="FILE", help="the step model to check (default: the one `minillm fleet "
                                                        "calibrate` saved for --model)")
    v.add_argument("--calibrate", action="store_true",
                   help="calibrate first (and save; with --quick a quick calibration), then validate")
    v.add_argument("--quick", action="store_true", help="fewer requests per workload, two loads (a quick look)")
    v.add_argument("--requests", type=int, default=None, help="requests per workload (default 100; --quick 16)")
    v.add_argument("--repeat", type=int, default=1,
                   help="real runs per workload (default 1): the error is against their mean, and the table shows "
                        "the real engine's own run-to-run spread next to it")
    v.add_argument("--no-drift-correction", action="store_true",
                   help="simulate on the step model as calibrated. By default a short fixed probe runs beside every "
                        "real run, and each workload is simulated on the step model scaled by the machine's speed "
                        "now over its speed at calibration (a shared machine drifts 10-20 %% in minutes); the table "
                        "shows the speed and the uncorrected median either way")
    v.add_argument("--json", metavar="FILE", help="write the table (and the median and worst errors) as JSON")
    v.add_argument("--seed", type=int, default=0)
    v.add_argument("--no-progress", action="store_true", help="no progress bar")

    s = fs.add_parser("simulate", help="simulate N replicas behind a router on a seeded workload",
                      description="A discrete-event simulation of a fleet. The replica step time comes from "
                                  "--step-model FILE, or a roofline of --model on --gpu (catalog names), or else "
                                  "the step model `minillm fleet calibrate` saved.",
                      epilog=FLEET_EPILOG + "\ncatalog models: " + ", ".join(sorted(KNOWN_MODELS)) +
                      "\ncatalog GPUs: " + ", ".join(sorted(KNOWN_HARDWARE)),
                      formatter_class=argparse.RawDescriptionHelpFormatter)
    s.add_argument("--replicas", type=int, default=4, help="replicas in the fleet (default 4)")
    s.add_argument("--router", nargs="+", default=["least-tokens"], metavar="ROUTER",
                   help=f"one or more of {', '.join(ROUTER_NAMES)} (each runs the same workload; default "
                        "least-tokens)")
    s.add_argument("--rate", type=float, default=10.0, help="requests per second (default 10)")
    s.add_argument("--duration", type=float, default=60.0, help="simulated seconds of arrivals (default 60)")
    s.add_argument("--workload", default="chat", choices=WORKLOAD_NAMES, help="the seeded request mix (default chat)")
    s.add_argument("--cv", type=float, default=3.0, help="bursty: coefficient of variation of the gaps (default 3)")
    s.add_argument("--trace", metavar="FILE", help="a JSONL trace instead of --workload: arrival_time, "
                                                   "prompt_token_ids or prompt_len, output_len per line")
    s.add_argument("--step-model", metavar="FILE", help="a step model saved by `minillm fleet calibrate`")
    s.add_argument("--model", help="a catalog model for a roofline step model (with --gpu)")
    s.add_argument("--gpu", help="a catalog accelerator (h100, h200, a100, b200, ...)")
    s.add_argument("--tp", type=int, default=1, help="tensor-parallel devices per replica (roofline; default 1)")
    s.add_argument("--weights", default="bf16", help=f"weight format for the roofline ({', '.join(WEIGHT_FORMATS)})")
    s.add_argument("--max-num-seqs", type=int, default=None, help="override the replica's max_num_seqs")
    s.add_argument("--max-num-batched-tokens", type=int, default=None, help="override the step token budget")
    s.add_argument("--num-blocks", type=int, default=None, help="override the replica's KV pool (blocks)")
    s.add_argument("--prefix-blocks", type=int, default=4,
                   help="prefix-aware: how many leading KV blocks of a prompt its ring key hashes (default 4)")
    s.add_argument("--epsilon", type=float, default=0.25,
                   help="prefix-aware: a replica over (1 + epsilon) x the mean load passes requests on (default 0.25)")
    s.add_argument("--plot", metavar="PNG", help="draw TTFT and TPOT CDFs per router into this file (and, with "
                                                 "--autoscale or failures, the replica count over time into "
                                                 "PNG's name + '-replicas')")
    s.add_argument("--json", metavar="FILE", help="write every run's metrics (and replica timeline) as JSON")
    d = s.add_argument_group("disaggregated prefill/decode")
    d.add_argument("--disaggregate", metavar="P:D",
                   help="P prefill replicas (the router places requests there; they compute the prompt and the "
                        "first token) and D decode replicas (least outstanding tokens), instead of --replicas")
    d.add_argument("--kv-link-gbps", type=float, default=400.0,
                   help="bandwidth of each prefill replica's KV link in gigabits/s (default 400, one 400G NIC; inf "
                        "= instant). Transfer = prompt tokens x KV bytes per token / bandwidth, one at a time")
    a = s.add_argument_group("autoscaling")
    a.add_argument("--autoscale", metavar="SIGNAL:LOW:HIGH",
                   help=f"scale on SIGNAL ({', '.join(SIGNALS)}: waiting requests per replica, KV pool share "
                        "0..1, arriving tokens/s per replica): above HIGH start replicas, below LOW drain one")
    a.add_argument("--min-replicas", type=int, default=1, help="autoscaling floor (default 1)")
    a.add_argument("--max-replicas", type=int, default=None, help="autoscaling ceiling (default 4 x --replicas)")
    a.add_argument("--cold-start", type=float, default=30.0,
                   help="seconds from starting a replica to it taking requests (billed meanwhile; default 30)")
    a.add_argument("--scale-interval", type=float, default=5.0, help="seconds between looks at the signal "
                                                                     "(default 5)")
    fg = s.add_argument_group("failures")
    fg.add_argument("--fail-at", action="append", default=[], metavar="T:REPLICA",
                   help="replica REPLICA (0-based) fails at T seconds (repeatable)")
    fg.add_argument("--mtbf", type=float, default=None, metavar="S",
                   help="each replica fails after an exponential time with this mean (seeded by --seed)")
    fg.add_argument("--repair", type=float, default=None, metavar="S",
                   help="a failed replica comes back (empty) after S seconds (default: it stays down)")
    fg.add_argument("--retries", type=int, default=2,
                   help="times a request is retried after its replica fails, then it counts failed (default 2)")
    fg.add_argument("--slo", metavar="ttft=200ms,tpot=50ms",
                   help="count the requests meeting these targets (failed ones miss): SLO attainment in the table")
    o = s.add_argument_group("KV offload")
    o.add_argument("--kv-offload-gib", type=float, default=0.0, metavar="G",
                   help="host memory per replica that evicted prefix-cache blocks move to; a later prefix hit "
                        "there costs a PCIe transfer instead of a recompute (default 0: off)")
    o.add_argument("--pcie-gbps", type=float, default=256.0,
                   help="host<->GPU bandwidth in gigabits/s (default 256: PCIe 4.0 x16, 32 GB/s)")
    s.add_argument("--engine", choices=ENGINES, default="auto",
                   help="exact: every replica runs the engine's own Scheduler and BlockManager (about 200-500 "
                        "simulated requests per wall second); fast: aggregate replicas in numpy (the same policy "
                        "on per-replica totals, ~10^5 requests per wall second, within a few %% of exact: "
                        "docs/fleet.md); auto (default): fast from "
                        f"{AUTO_FAST_REQUESTS:,} expected requests (--rate x --duration, or a trace's lines) up, "
                        "unless a flag only the exact engine models is given (--disaggregate, --autoscale, "
                        "--fail-at, --mtbf, --kv-offload-gib)")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--no-progress", action="store_true", help="no progress bar")

    p = fs.add_parser("plan", help="the cheapest layout (TP x replicas) that serves a load within a p99 SLO",
                      description="Sizes every tensor-parallel layout (1, 2, 4, 8 GPUs a replica) of a catalog model "
                                  "on a catalog GPU with the roofline step model, then simulates the cheapest to "
                                  "check its p99s (adding replicas until they hold), and prints the recommendation, "
                                  "its cost and the runner-ups with what rejected each.",
                      epilog=FLEET_EPILOG + "\ncatalog models: " + ", ".join(sorted(KNOWN_MODELS)) +
                      "\ncatalog GPUs: " + ", ".join(sorted(KNOWN_HARDWARE)),
                      formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="a catalog model")
    p.add_argument("--gpu", required=True, help="a catalog accelerator (h100, h200, a100, b200, ...)")
    p.add_argument("--rps", type=float, required=True, help="requests per second the fleet must serve")
    p.add_argument("--slo", required=True, metavar="ttft_p99=200ms,tpot_p99=50ms", help="the p99 latency targets")
    p.add_argument("--prompt-len", type=int, required=True, help="prompt tokens per request")
    p.add_argument("--output-len", type=int, required=True, help="output tokens per request")
    p.add_argument("--prefix-len", type=int, default=0,
                   help="leading prompt tokens every request shares, e.g. a system prompt (default 0): the prefix "
                        "cache holds them, so a replica computes only the rest")
    p.add_argument("--price-per-gpu-hour", type=float, default=3.0, help="$ per GPU-hour (default 3)")
    p.add_argument("--weights", default="bf16", help=f"weight format ({', '.join(WEIGHT_FORMATS)})")
    p.add_argument("--verify", type=int, default=2, help="layouts to check by simulation, cheapest first (default 2)")
    p.add_argument("--duration", type=float, default=30.0,
                   help="simulated seconds of each check (default 30; a slice of <= 4 replicas at their share)")
    p.add_argument("--disaggregate", action="store_true",
                   help="also consider prefill:decode splits for each TP (sized per pool, simulated with the link)")
    p.add_argument("--kv-link-gbps", type=float, default=400.0,
                   help="with --disaggregate: each prefill replica's KV link in gigabits/s (default 400)")
    p.add_argument("--seed", type=int, default=0)
    return f


def check_args(args) -> None:
    """Every fleet flag checked before numpy, torch or a model loads: one clear line per mistake."""
    if args.fleet_command == "plan":
        check_plan_args(args)
    if args.fleet_command == "validate":
        check_validate_args(args)
    if args.fleet_command != "simulate":
        return
    for name in ("replicas", "tp", "prefix_blocks", "max_num_seqs", "max_num_batched_tokens", "num_blocks",
                 "min_replicas", "max_replicas"):
        v = getattr(args, name)
        if v is not None and v < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be a positive integer, got {v}")
    for name in ("rate", "duration", "cv"):
        v = getattr(args, name)
        if not math.isfinite(v) or v <= 0:
            raise ValueError(f"--{name} must be a positive number, got {v}")
    check_fleet_features(args)
    check_engine(args)
    if not math.isfinite(args.epsilon) or args.epsilon < 0:
        raise ValueError(f"--epsilon must be a number >= 0, got {args.epsilon}")
    bad = [r for r in args.router if r not in ROUTER_NAMES]
    if bad:
        raise ValueError(f"unknown router {bad[0]!r}; known: {', '.join(ROUTER_NAMES)}")
    for flag, path in (("--trace", args.trace), ("--step-model", args.step_model)):
        if path is not None and not Path(path).is_file():
            raise ValueError(f"{flag} {path}: no such file")
    if args.step_model and (args.model or args.gpu):
        raise ValueError("give either --step-model FILE or --model/--gpu (a roofline), not both")
    if (args.model is None) != (args.gpu is None):
        raise ValueError("a roofline step model needs both --model (a catalog model) and --gpu (a catalog GPU)")
    if args.model is not None:
        _check_catalog(args)


def check_fleet_features(args) -> None:
    """Parse the disaggregation / autoscaling / failure / SLO / offload flags in place (into policy values)."""
    if args.disaggregate is not None:
        args.disaggregate = parse_split(args.disaggregate)
    if not args.kv_link_gbps > 0:
        raise ValueError(f"--kv-link-gbps must be > 0 (inf for an instant link), got {args.kv_link_gbps}")
    for name in ("kv_offload_gib", "pcie_gbps"):
        v = getattr(args, name)
        if not math.isfinite(v) or v < 0 or (name == "pcie_gbps" and v == 0):
            raise ValueError(f"--{name.replace('_', '-')} must be a number {'>' if name == 'pcie_gbps' else '>='} "
                             f"0, got {v}")
    if args.retries < 0:
        raise ValueError(f"--retries must be >= 0, got {args.retries}")
    if args.autoscale is not None:
        hi = args.max_replicas if args.max_replicas is not None else 4 * args.replicas
        args.autoscale = Autoscaler.parse(args.autoscale, min_replicas=args.min_replicas, max_replicas=hi,
                                          cold_start_s=args.cold_start, interval_s=args.scale_interval)
        if not args.min_replicas <= args.replicas <= hi:
            raise ValueError(f"--replicas {args.replicas} (the starting fleet) must lie within --min-replicas "
                             f"{args.min_replicas} and --max-replicas {hi}")
    args.failures = FailurePlan(tuple(FailurePlan.parse_at(x) for x in args.fail_at), args.mtbf, args.repair,
                                args.seed)
    if args.disaggregate is not None and (args.autoscale is not None or args.failures.active):
        raise ValueError("--disaggregate cannot be combined with --autoscale, --fail-at or --mtbf (yet)")
    n = sum(args.disaggregate) if args.disaggregate else args.replicas
    for t, i in args.failures.at:
        if i >= n:
            raise ValueError(f"--fail-at {t:g}:{i}: the fleet starts with replicas 0..{n - 1}")
    if args.slo is not None:
        args.slo = Slo.parse(args.slo)


def exact_only_flags(args) -> list[str]:
    """The flags given that only the exact engine simulates (the fast one models a fixed unified fleet)."""
    given = [("--disaggregate", args.disaggregate is not None), ("--autoscale", args.autoscale is not None),
             ("--fail-at", bool(args.fail_at)), ("--mtbf", args.mtbf is not None),
             ("--kv-offload-gib", bool(args.kv_offload_gib))]
    return [flag for flag, on in given if on]


def check_engine(args) -> None:
    """--engine fast with a flag it does not model stops here, naming the flag and the fix."""
    blocked = exact_only_flags(args)
    if args.engine == "fast" and blocked:
        raise ValueError(f"--engine fast does not simulate {', '.join(blocked)} (the fast engine models a fixed "
                         "fleet of unified replicas): use --engine exact (or auto)")


def check_validate_args(args) -> None:
    if args.repeat < 1:
        raise ValueError(f"--repeat must be a positive integer, got {args.repeat}")
    if args.requests is not None and args.requests < 2:
        raise ValueError(f"--requests must be an integer >= 2, got {args.requests}")
    if args.step_model is not None and not Path(args.step_model).is_file():
        raise ValueError(f"--step-model {args.step_model}: no such file")
    if args.step_model is not None and args.calibrate:
        raise ValueError("give either --step-model FILE or --calibrate (a fresh one), not both")


def _check_catalog(args) -> None:
    """--model names a catalog model, --gpu a catalog accelerator (resolved in place), --weights a known format."""
    try:
        model_shape(args.model)
    except KeyError as e:
        raise ValueError(e.args[0]) from None
    args.gpu = resolve_gpu(args.gpu)
    if args.weights not in WEIGHT_FORMATS:
        raise ValueError(f"unknown weight format {args.weights!r}; known: {', '.join(WEIGHT_FORMATS)}")


def check_plan_args(args) -> None:
    _check_catalog(args)
    for name in ("rps", "duration"):
        v = getattr(args, name)
        if not math.isfinite(v) or v <= 0:
            raise ValueError(f"--{name} must be a positive number, got {v}")
    for name in ("prompt_len", "output_len", "verify"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be a positive integer, got {getattr(args, name)}")
    if not math.isfinite(args.price_per_gpu_hour) or args.price_per_gpu_hour < 0:
        raise ValueError(f"--price-per-gpu-hour must be >= 0, got {args.price_per_gpu_hour}")
    if not 0 <= args.prefix_len < args.prompt_len:
        raise ValueError(f"--prefix-len must be in [0, --prompt-len), got {args.prefix_len}: the shared prefix is "
                         "part of the prompt, and at least one prompt token is computed")
    if not args.kv_link_gbps > 0:
        raise ValueError(f"--kv-link-gbps must be > 0 (inf for an instant link), got {args.kv_link_gbps}")
    args.slo = parse_p99_slo(args.slo)
