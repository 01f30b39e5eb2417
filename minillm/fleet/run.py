"""The runners of `minillm fleet calibrate | validate | simulate | plan` (the parsers and flag checks are in
fleet/cli.py)."""
from __future__ import annotations

import json
import math
import sys
from collections.abc import Callable
from pathlib import Path

import matplotlib

from minillm import plots
from minillm.fleet import validate, workloads
from minillm.fleet.aggregate import from_requests, simulate_aggregate, streams
from minillm.fleet.aggregate.state import check_supported
from minillm.fleet.calibrate import build_engine, calibrate, default_path
from minillm.fleet.cli import AUTO_FAST_REQUESTS, exact_only_flags
from minillm.fleet.offload import HostTier
from minillm.fleet.planner import Demand, plan, report
from minillm.fleet.policies import KVLink
from minillm.fleet.replica import Replica, ReplicaConfig
from minillm.fleet.routers import make_router
from minillm.fleet.simulator import FleetResult, simulate
from minillm.fleet.step_model import StepModel, from_roofline


def _log(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def run_calibrate(args) -> int:
    sm = calibrate(args.model, quick=args.quick, seed=args.seed, out=args.out, log=_log)
    e = sm.fit_error
    print(f"step model: {sm.source}")
    sets = [c for c in (sm.coeffs, sm.short_prefill_coeffs, sm.prefill_coeffs) if c]
    for k in sm.coeffs:
        print(f"  {k:8s} " + "   ".join(f"{c[k]:.3e} s" for c in sets))
    if sm.short_prefill_coeffs:
        print(f"  (columns: decode-only steps; steps with prefill tokens, <= {sm.short_prefill_tokens} tokens in all;"
              " longer ones)")
    elif sm.prefill_coeffs:
        print("  (left: decode-only steps; right: steps with prefill tokens)")
    print(f"held-out error ({e['steps']} steps): median {100 * e['median']:.1f} %, p90 {100 * e['p90']:.1f} %")
    return 0


def run_validate(args) -> int:
    engine = build_engine(args.model)
    if args.calibrate:
        sm = calibrate(args.model, engine=engine, quick=args.quick, seed=args.seed, log=_log,
                       progress=not args.no_progress)
        where = "the fresh calibration"
    else:
        path = Path(args.step_model) if args.step_model else default_path(args.model)
        if not path.exists():
            raise ValueError(f"no step model for --model {args.model}: run `minillm fleet calibrate --model "
                             f"{args.model}` first (it saves {path}), or pass --calibrate or --step-model FILE")
        sm, where = StepModel.load(path), str(path)
    validate.check_model(sm, engine, where)
    n = args.requests or (16 if args.quick else 100)
    loads = validate.LOADS[::2] if args.quick else validate.LOADS
    longest_output = max(m.output_range[1] for m in validate.MIXES)
    workloads = validate.held_out_workloads(sm, engine.model.cfg.vocab_size, n, loads, seed=args.seed,
                                            max_prompt=engine.max_model_len - longest_output)
    v, _ = validate.validate(engine, sm, workloads, progress=not args.no_progress, repeat=args.repeat,
                             correct_drift=not args.no_drift_correction)
    print(f"step model: {sm.source}; {n} requests per workload, Poisson arrivals, seed {args.seed}")
    print(validate.table(v))
    if args.json:
        Path(args.json).write_text(json.dumps(v.to_dict(), indent=2))
        print(f"json: {args.json}")
    return 0


def step_model_of(args) -> StepModel:
    if args.step_model:
        return StepModel.load(args.step_model)
    if args.model:
        return from_roofline(args.model, args.gpu, args.weights, args.tp)
    path = default_path("default")
    if not path.exists():
        raise ValueError(f"no step model: run `minillm fleet calibrate` first (it saves {path}), or pass "
                         "--step-model FILE, or --model NAME --gpu NAME for a roofline")
    return StepModel.load(path)


def requests_of(args, vocab: int):
    if args.trace:
        return workloads.read_trace(args.trace, seed=args.seed, vocab=vocab)
    return workloads.make(args.workload, args.rate, args.duration, seed=args.seed, cv=args.cv, vocab=vocab)


COLUMNS = [("router", "router", "{}"), ("finished", "done", "{}"), ("failed", "failed", "{}"),
           ("ttft_p50_ms", "TTFT p50", "{:.0f}"), ("ttft_p99_ms", "TTFT p99", "{:.0f}"),
           ("tpot_p50_ms", "TPOT p50", "{:.1f}"), ("tpot_p99_ms", "TPOT p99", "{:.1f}"),
           ("e2e_p99_s", "e2e p99 s", "{:.2f}"), ("out_tok_s", "out tok/s", "{:.0f}"),
           ("prefix_hit", "prefix hit", "{:.0%}"), ("kv_peak", "KV peak", "{:.0%}"),
           ("preemptions", "preempt", "{}"), ("sim_req_per_wall_s", "sim req/wall s", "{:.0f}")]


# Columns a fleet feature adds when a run uses it.
DISAGG_COLUMNS = [("layout", "layout", "{}"), ("kv_transfer_p99_ms", "KV xfer p99", "{:.1f}"),
                  ("decode_pool_prefill_tokens", "decode-pool prefill", "{}")]
FAILURE_COLUMNS = [("replica_failures", "repl fails", "{}"), ("retried", "retried", "{}"),
                   ("lost_tokens", "lost tok", "{}")]
SLO_COLUMNS = [("slo_attainment", "SLO met", "{:.1%}")]
SCALE_COLUMNS = [("peak_replicas", "peak repl", "{}"), ("replica_seconds", "replica-s", "{:.0f}"),
                 ("replica_hours_per_m_tokens", "repl-h/M tok", "{:.2f}")]
OFFLOAD_COLUMNS = [("host_hit_tokens", "host hit tok", "{}"), ("host_seconds", "PCIe s", "{:.3f}")]


def columns_for(results: list[FleetResult]) -> list[tuple[str, str, str]]:
    cols = list(COLUMNS)
    r = results[0] if results else None
    if r is None:
        return cols
    if "P:" in r.layout:
        cols += DISAGG_COLUMNS
    if any(x.replica_failures for x in results):
        cols += FAILURE_COLUMNS
    if r.slo is not None:
        cols += SLO_COLUMNS
    if any(x.dynamic for x in results):
        cols += SCALE_COLUMNS
    if any(x.host_stored_blocks for x in results):
        cols += OFFLOAD_COLUMNS
    return cols


def _cell(value, fmt: str) -> str:
    return "-" if isinstance(value, float) and math.isnan(value) else fmt.format(value)


def table(results: list[FleetResult]) -> str:
    cols = columns_for(results)
    rows = [[_cell(r.row()[key], fmt) for key, _, fmt in cols] for r in results]
    heads = [h for _, h, _ in cols]
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(heads)]
    lines = ["  ".join(h.rjust(w) for h, w in zip(heads, widths)), "  ".join("-" * w for w in widths)]
    lines += ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in rows]
    return "\n".join(lines) + "\n(latencies in ms unless marked; TPOT excludes one-token outputs)"


def _kv_bytes_per_token(sm: StepModel, needed_by: str) -> float:
    b = sm.replica.get("kv_bytes_per_token")
    if not b:
        raise ValueError(f"{needed_by} needs the KV bytes per token, which this step model ({sm.source}) does not "
                         "carry: recalibrate with `minillm fleet calibrate`, or use --model/--gpu")
    return float(b)


def host_tier_factory(args, sm: StepModel, cfg: ReplicaConfig):
    """A fresh host tier per replica (None without --kv-offload-gib)."""
    if not args.kv_offload_gib:
        return lambda: None
    block_bytes = _kv_bytes_per_token(sm, "--kv-offload-gib") * cfg.block_size
    blocks = int(args.kv_offload_gib * 2**30 // block_bytes)
    return lambda: HostTier(blocks, block_bytes, args.pcie_gbps * 1e9 / 8)


def simulate_one(args, sm: StepModel, cfg: ReplicaConfig, router_name: str) -> FleetResult:
    """One run of the fleet the flags describe, with router `router_name`."""
    host = host_tier_factory(args, sm, cfg)

    def new_replica() -> Replica:
        return Replica(sm, cfg, host=host())
    kw = {}
    if args.disaggregate:
        prefill, decode = args.disaggregate
        kw = {"decode_replicas": [new_replica() for _ in range(decode)],
              "kv_link": KVLink(_kv_bytes_per_token(sm, "--disaggregate"), args.kv_link_gbps)}
    else:
        prefill = args.replicas
    most = args.autoscale.max_replicas if args.autoscale else prefill
    router = make_router(router_name, max(prefill, most), cfg.block_size, args.prefix_blocks, args.epsilon)
    return simulate(requests_of(args, workloads.VOCAB), [new_replica() for _ in range(prefill)], router,
                    router_name, progress=not args.no_progress and sys.stderr.isatty(), horizon=args.duration,
                    autoscaler=args.autoscale, new_replica=new_replica, failures=args.failures,
                    retries=args.retries, slo=args.slo, **kw)


def simulate_fast(args, sm: StepModel, cfg: ReplicaConfig, router_name: str) -> FleetResult:
    """One run on the aggregate replicas (minillm.fleet.aggregate): the named workload drawn in columns, or the
    trace's requests turned into columns."""
    if args.trace:
        reqs = from_requests(workloads.read_trace(args.trace, seed=args.seed, vocab=workloads.VOCAB), cfg.block_size,
                             args.prefix_blocks)
    else:
        reqs = streams.batches(args.workload, args.rate, args.duration, seed=args.seed, cv=args.cv,
                               block_size=cfg.block_size, prefix_blocks=args.prefix_blocks)
    return simulate_aggregate(reqs, sm, cfg, args.replicas, router_name, prefix_blocks=args.prefix_blocks,
                              epsilon=args.epsilon, slo=args.slo, horizon=args.duration,
                              progress=not args.no_progress and sys.stderr.isatty())


def expected_requests(args) -> int:
    """How many requests the run will simulate, about: the trace's lines, or rate x duration."""
    if args.trace:
        with open(args.trace, "rb") as fh:
            return sum(1 for line in fh if line.strip())
    return int(args.rate * args.duration)


def engine_of(args, cfg: ReplicaConfig) -> tuple[str, str]:
    """("exact" | "fast", why). --engine fast that cannot run says so (naming the flag or setting and the fix)."""
    try:
        check_supported(cfg)
        unsupported = ""
    except ValueError as e:
        unsupported = str(e)
    if args.engine == "fast":
        if unsupported:
            raise ValueError(unsupported)
        return "fast", "--engine fast"
    if args.engine == "exact":
        return "exact", "--engine exact"
    n = expected_requests(args)
    if n < AUTO_FAST_REQUESTS:
        return "exact", f"auto: ~{n:,} requests, under {AUTO_FAST_REQUESTS:,}"
    blocked = exact_only_flags(args)
    if blocked or unsupported:
        why = f"{', '.join(blocked)} needs it" if blocked else unsupported.split(": use")[0]
        return "exact", f"auto: ~{n:,} requests, but {why} (slow: minutes per 10^5 requests)"
    return "fast", f"auto: ~{n:,} requests, {AUTO_FAST_REQUESTS:,} or more"


def to_json(results: list[FleetResult]) -> str:
    """Every run's row (NaN as null) and its replica timeline."""
    def clean(v):
        return None if isinstance(v, float) and not math.isfinite(v) else v
    return json.dumps([{k: clean(v) for k, v in r.row().items()} | {"timeline": r.timeline} for r in results],
                      indent=2)


def replica_of(args) -> tuple[StepModel, ReplicaConfig]:
    """The step model and the replica the simulate flags describe."""
    sm = step_model_of(args)
    return sm, ReplicaConfig.of(sm, max_num_seqs=args.max_num_seqs,
                                max_num_batched_tokens=args.max_num_batched_tokens, num_blocks=args.num_blocks)


def simulator_for(engine: str) -> Callable[..., FleetResult]:
    return simulate_fast if engine == "fast" else simulate_one


def run_simulate(args) -> int:
    sm, cfg = replica_of(args)
    print(f"step model: {sm.source}; per replica {cfg.num_blocks} KV blocks of {cfg.block_size}, max_num_seqs "
          f"{cfg.max_num_seqs}, token budget {cfg.max_num_batched_tokens}")
    engine, why = engine_of(args, cfg)
    print(f"engine: {engine} ({why})")
    results = []
    for name in args.router:
        res = simulator_for(engine)(args, sm, cfg, name)
        results.append(res)
        n = res.finished + res.failed
        print(f"[{name}, {engine} engine: {n:,} requests, {res.steps:,} replica steps in {res.wall_s:.1f} s wall = "
              f"{res.requests_per_wall_s:,.0f} simulated requests per wall second]")
    print(table(results))
    if args.slo is not None:
        print(f"SLO: {args.slo}")
    if args.json:
        Path(args.json).write_text(to_json(results))
        print(f"json: {args.json}")
    if args.plot:
        matplotlib.use("Agg")
        fig = plots.latency_cdfs({r.router: {"ttft": r.ttft.cdf(), "tpot": r.tpot.cdf()} for r in results},
                                 show=False)
        fig.savefig(args.plot, dpi=120)
        print(f"plot: {args.plot}")
        if any(r.dynamic for r in results):
            path = Path(args.plot)
            path = path.with_name(f"{path.stem}-replicas{path.suffix or '.png'}")
            plots.replica_timeline({r.router: r.timeline for r in results}, show=False).savefig(path, dpi=120)
            print(f"plot: {path}")
    return 0


def run_plan(args) -> int:
    d = Demand(args.rps, args.prompt_len, args.output_len, *args.slo, usd_per_gpu_hour=args.price_per_gpu_hour,
               prefix_len=args.prefix_len)
    p = plan(args.model, args.gpu, d, args.weights, verify=args.verify, duration=args.duration, seed=args.seed,
             disaggregate=args.disaggregate, link_gbps=args.kv_link_gbps, log=_log)
    print(report(p))
    return 0 if p.best is not None and p.best.verified is not None else 1


def run(args) -> int:
    return {"calibrate": run_calibrate, "validate": run_validate, "simulate": run_simulate,
            "plan": run_plan}[args.fleet_command](args)
