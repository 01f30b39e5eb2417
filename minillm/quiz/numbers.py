"""Numbers in the question bank, recomputed by the engine's own helpers.

A bank entry may carry `checks`: each names a function below, its arguments, and the `claim` — the
exact text of the figure as it appears in the answer ("2 GiB", "2.8x", "35 GB", "327,680 bytes").
`verify_check` parses the claim, calls the function and compares, so the prose and the code cannot drift.
"""
from __future__ import annotations

import argparse
import functools
import math
import re
import shlex
from typing import Any, Callable

from minillm.catalog import hardware_spec, model_shape, param_groups
from minillm.fleet import estimator as est
from minillm.fleet import run as fleet_run
from minillm.fleet.cli import add_fleet_parser, check_args
from minillm.fleet.planner import Demand, Layout, Plan, plan
from minillm.fleet.policies import parse_p99_slo
from minillm.kv.sizing import kv_cache_bytes, kv_tokens_that_fit, max_seqs_that_fit
from minillm.quant.memory import checkpoint_bytes, weight_bytes
from minillm.spec_decode.expected import expected_speedup, expected_tokens_per_step


def _num_params(model: str) -> int:
    return model_shape(model).num_params()


def _params(model: str, group: str = "total") -> int:
    """Parameters of a catalog model: total, linear (the per-layer matmuls), or embeddings (input table + LM head)."""
    g = param_groups(model)
    counts = {"total": g.total, "linear": g.linear, "embeddings": g.embedding + g.lm_head}
    if group not in counts:
        raise KeyError(f"unknown parameter group {group!r}; known: {', '.join(counts)}")
    return counts[group]


def _kv_bytes_per_token(model: str, dtype_bytes: float = 2) -> float:
    return kv_cache_bytes(model, 1, dtype_bytes)


def _ratio(a: dict, b: dict, fn: str) -> float:
    """fn(**a) / fn(**b): for claims like "8x smaller"."""
    return FUNCTIONS[fn](**a) / FUNCTIONS[fn](**b)


_DEPLOYMENT_ARGS = ("tp", "weights", "kv_bytes", "memory_utilization", "runtime_gb")
_EFFICIENCY_ARGS = ("mfu", "mbu", "link", "allreduce_latency_s")

# Named numbers of the serving estimator, each in base units (bytes, seconds, FLOPs, $) so a claim's unit
# ("39.5 GB", "125 ms", "5.4 PFLOP/s") scales it. Memory fields need no traffic; the rest need prompt/output.
_MEMORY_FIELDS: dict[str, Callable[[est.MemoryPlan, int], float]] = {   # (plan, tp)
    "weights_bytes": lambda m, tp: m.weights_gb * est.GB,
    "weights_bytes_per_gpu": lambda m, tp: m.weights_gb_per_gpu * est.GB,
    "usable_bytes": lambda m, tp: m.usable_gb_per_gpu * est.GB * tp,
    "kv_pool_bytes": lambda m, tp: m.kv_gb * est.GB,
    "kv_pool_bytes_per_gpu": lambda m, tp: m.kv_gb * est.GB / tp,
    "kv_tokens": lambda m, tp: m.kv_tokens,
    "kv_bytes_per_token_per_gpu": lambda m, tp: m.kv_bytes_per_token / tp,
    "offloaded_weight_bytes": lambda m, tp: m.offloaded_gb * est.GB,
}
_ESTIMATE_FIELDS: dict[str, Callable[[est.Estimate], float]] = {
    "max_streams": lambda e: e.max_streams,
    "batch": lambda e: e.batch,
    "ttft_s": lambda e: e.ttft_s,
    "tpot_s": lambda e: e.tpot_s,
    "decode_step_s": lambda e: e.decode_step.total_s,
    "decode_memory_s": lambda e: e.decode_step.memory_s,
    "decode_compute_s": lambda e: e.decode_step.compute_s,
    "decode_comm_s": lambda e: e.decode_step.comm_s,
    "output_tokens_per_s": lambda e: e.output_tokens_per_s,
    "output_tokens_per_s_per_gpu": lambda e: e.output_tokens_per_s / e.devices,
    "gpu_seconds_per_request": lambda e: e.gpu_seconds_per_request,
    "prefill_share": lambda e: e.prefill_share,
    "usd_per_m_output_tokens": lambda e: e.usd_per_m_output_tokens,
    "prefill_flops": lambda e: e.prefill_flops,
    "achieved_flops": lambda e: e.achieved_flops,
    "peak_flops": lambda e: e.peak_flops,
}


def _split(args: dict[str, Any], names: tuple[str, ...]) -> dict[str, Any]:
    return {k: args.pop(k) for k in names if k in args}


def serving(field: str, model: str, gpu: str, prompt: int | None = None, output: int | None = None,
            cached: int = 0, batch: int | None = None, tpot_ms: float | None = None,
            usd_per_gpu_hour: float = 3.0, **knobs: Any) -> float:
    """One named number of minillm.fleet.estimator for a deployment (model, gpu, tp, weights, kv_bytes, ...)
    and, for the non-memory fields, a request shape. tpot_ms instead of batch: the largest batch meeting it."""
    eff = est.Efficiency(**_split(knobs, _EFFICIENCY_ARGS))
    dep = est.Deployment(model, gpu, **_split(knobs, _DEPLOYMENT_ARGS))
    if knobs:
        raise TypeError(f"serving() got unknown arguments {sorted(knobs)}; deployment: {_DEPLOYMENT_ARGS}, "
                        f"efficiency: {_EFFICIENCY_ARGS}")
    if field in _MEMORY_FIELDS:
        return _MEMORY_FIELDS[field](est.memory_plan(dep), dep.tp)
    if field not in _ESTIMATE_FIELDS:
        raise KeyError(f"unknown serving field {field!r}; known: {', '.join([*_MEMORY_FIELDS, *_ESTIMATE_FIELDS])}")
    if prompt is None or output is None:
        raise TypeError(f"serving field {field!r} needs prompt and output (tokens per request)")
    sc = est.Scenario(prompt, output, cached, batch, usd_per_gpu_hour)
    if tpot_ms is not None:
        if batch is not None:
            raise TypeError("give batch or tpot_ms, not both")
        sc = est.Scenario(prompt, output, cached, est.batch_for_tpot(dep, sc, tpot_ms / 1e3, eff), usd_per_gpu_hour)
    return _ESTIMATE_FIELDS[field](est.estimate(dep, sc, eff))


def _decode_step(field: str, model: str, gpu: str, batch: int, context: float, **knobs: Any) -> float:
    """A pure decode step (no prefill): field total_s | compute_s | memory_s | comm_s."""
    eff = est.Efficiency(**_split(knobs, _EFFICIENCY_ARGS))
    step = est.decode_step(est.Deployment(model, gpu, **knobs), batch, context, eff)
    return getattr(step, field)


def _batching_speedup(model: str, gpu: str, batch: int, context: float, **knobs: Any) -> float:
    """Decode tokens/s at `batch` over tokens/s at batch 1, every sequence at `context` tokens."""
    one = _decode_step("total_s", model, gpu, 1, context, **dict(knobs))
    return batch * one / _decode_step("total_s", model, gpu, batch, context, **knobs)


def _prefill_flops_per_s(model: str, prompt: int, output: int, output_tokens_per_s: float, cached: int = 0) -> float:
    """FLOP/s of prefill that a claimed output rate implies: each request brings prompt - cached new tokens
    per output tokens. Compare with peak_flops to see whether the claim is possible at all."""
    flops = est.forward_flops(model, prompt - cached, est._prefill_pairs(est.Scenario(prompt, output, cached)), 1)
    return output_tokens_per_s / output * flops


def _littles_law(concurrency: float | None = None, rate: float | None = None, latency_s: float | None = None) -> float:
    """Little's law, L = rate x latency: give two of concurrency (requests in flight), rate (requests/s) and
    latency_s (seconds each spends in the system); returns the third."""
    given = [x is not None for x in (concurrency, rate, latency_s)]
    if sum(given) != 2:
        raise TypeError("littles_law takes exactly two of concurrency, rate, latency_s")
    if concurrency is None:
        return rate * latency_s
    return concurrency / latency_s if rate is None else concurrency / rate


def _prefill_devices(model: str, gpu: str, prompt: int, output: int, requests_per_s: float, cached: int = 0,
                     **knobs: Any) -> float:
    """Devices a disaggregated prefill pool keeps busy at requests_per_s (before headroom)."""
    eff = est.Efficiency(**_split(knobs, _EFFICIENCY_ARGS))
    return est.prefill_devices(est.Deployment(model, gpu, **knobs), est.Scenario(prompt, output, cached),
                               requests_per_s, eff)


def _units_needed(demand: float, fn: str, args: dict[str, Any]) -> float:
    """demand / fn(**args): e.g. 60K output tok/s over one replica's output_tokens_per_s = replicas needed."""
    return demand / FUNCTIONS[fn](**args)


def _scaled(factor: float, fn: str, args: dict[str, Any]) -> float:
    """fn(**args) x factor: bytes x (1 / link bandwidth) = seconds to move them, and the like."""
    return factor * FUNCTIONS[fn](**args)


def _mix(parts: list[list[Any]]) -> float:
    """A traffic-weighted blend: parts = [[share, fn, args], ...], shares summing to 1 (e.g. 70% of requests
    on one deployment and 30% on another: the blended $ per million tokens)."""
    total = sum(share for share, _, _ in parts)
    if not math.isclose(total, 1.0, rel_tol=1e-9):
        raise ValueError(f"mix shares sum to {total}, not 1: give each part's share of the traffic")
    return sum(share * FUNCTIONS[fn](**args) for share, fn, args in parts)


def _spec(gpu: str, field: str) -> float:
    """A datasheet figure of a catalog accelerator in base units: memory (bytes), hbm (bytes/s), link (bytes/s,
    one direction), domain (devices per scale-up domain)."""
    h = hardware_spec(gpu)
    specs = {"memory": h.memory_gb * 1e9, "hbm": h.hbm_gb_s * 1e9, "link": h.link_gb_s * 1e9, "domain": h.domain}
    if field not in specs:
        raise KeyError(f"unknown spec {field!r}; known: {', '.join(specs)}")
    return specs[field]


def _peak_flops(gpu: str, dtype: str = "bf16", n: int = 1) -> float:
    return n * hardware_spec(gpu).peak_flops(dtype)


@functools.lru_cache(maxsize=None)
def _planned(model: str, gpu: str, rps: float, slo: str, prompt_len: int, output_len: int, prefix_len: int,
             weights: str, verify: int, duration: float, seed: int) -> Plan:
    d = Demand(rps, prompt_len, output_len, *parse_p99_slo(slo), prefix_len=prefix_len)
    return plan(model, gpu, d, weights, verify=verify, duration=duration, seed=seed)


_PLAN_FIELDS: dict[str, Callable[[Layout, Demand], float]] = {
    "gpus": lambda lay, d: lay.gpus,
    "replicas": lambda lay, d: lay.replicas,
    "tp": lambda lay, d: lay.tp,
    "usd_per_hour": lambda lay, d: lay.usd_per_hour(d),
    "usd_per_m_output_tokens": lambda lay, d: lay.usd_per_m_tokens(d),
    "capacity_rps": lambda lay, d: lay.capacity_rps,
    "step_s": lambda lay, d: lay.step_s,
    "ttft_p99_s": lambda lay, d: lay.verified.ttft.quantile(0.99),
    "tpot_p99_s": lambda lay, d: lay.verified.tpot.quantile(0.99),
    "kv_usage_peak": lambda lay, d: lay.verified.kv_usage_peak,
}


def _plan(field: str, model: str, gpu: str, rps: float, slo: str, prompt_len: int, output_len: int,
          prefix_len: int = 0, weights: str = "bf16", verify: int = 2, duration: float = 30.0, seed: int = 0,
          layout_tp: int | None = None) -> float:
    """A figure of `minillm fleet plan` with the same flags (--slo as written there): the recommended layout's, or
    with layout_tp the layout of that TP (a runner-up). Simulated fields (ttft_p99_s, tpot_p99_s, kv_usage_peak)
    need a verified layout. One plan per set of flags is computed and kept."""
    p = _planned(model, gpu, rps, slo, prompt_len, output_len, prefix_len, weights, verify, duration, seed)
    lay = p.best if layout_tp is None else next((x for x in p.layouts if x.tp == layout_tp), None)
    if lay is None or lay.rejected:
        raise ValueError(f"the plan has no usable layout{'' if layout_tp is None else f' at TP={layout_tp}'}: "
                         + "; ".join(f"TP={x.tp}: {x.rejected}" for x in p.layouts if x.rejected))
    if field not in _PLAN_FIELDS:
        raise KeyError(f"unknown plan field {field!r}; known: {', '.join(_PLAN_FIELDS)}")
    if field in ("ttft_p99_s", "tpot_p99_s", "kv_usage_peak") and lay.verified is None:
        raise ValueError(f"TP={lay.tp} was sized but not simulated: raise verify to check it")
    return float(_PLAN_FIELDS[field](lay, p.demand))


@functools.lru_cache(maxsize=None)
def _simulated(command: str) -> dict[str, dict[str, Any]]:
    """Each router's results row of `minillm fleet simulate ...` (the command as a reader would type it)."""
    parser = argparse.ArgumentParser(prog="minillm")
    add_fleet_parser(parser.add_subparsers(dest="command"))
    words = shlex.split(command)
    if words[:3] != ["minillm", "fleet", "simulate"]:
        raise ValueError(f"{command!r} is not a `minillm fleet simulate ...` command")
    args = parser.parse_args(words[1:])
    args.no_progress = True
    check_args(args)
    sm, cfg = fleet_run.replica_of(args)
    run = fleet_run.simulator_for(fleet_run.engine_of(args, cfg)[0])     # exact or fast, as the command picks
    return {name: run(args, sm, cfg, name).row() for name in args.router}


def _simulate(command: str, field: str, router: str | None = None) -> float:
    """A cell of `minillm fleet simulate`'s table for `command` (the first router's row unless `router` names
    one), in base units: fields ending in _ms are returned in seconds, shares (prefix_hit, kv_peak,
    slo_attainment) as fractions."""
    rows = _simulated(command)
    row = rows[router or next(iter(rows))]
    if field not in row or isinstance(row[field], str):
        raise KeyError(f"unknown simulate field {field!r}; known: "
                       + ", ".join(k for k, v in row.items() if not isinstance(v, str)))
    return float(row[field]) / (1e3 if field.endswith("_ms") else 1)


FUNCTIONS: dict[str, Callable[..., float]] = {
    "kv_cache_bytes": kv_cache_bytes,              # (config, tokens, dtype_bytes=2)
    "kv_bytes_per_token": _kv_bytes_per_token,     # (model, dtype_bytes=2)
    "kv_tokens_that_fit": kv_tokens_that_fit,      # (config, budget_bytes, dtype_bytes=2)
    "max_seqs_that_fit": max_seqs_that_fit,        # (config, memory_bytes, weight_bytes, seq_len, dtype_bytes=2)
    "weight_bytes": weight_bytes,                  # (num_params, bits, group_size=None, scale_bits=16)
    "num_params": _num_params,                     # (model)
    "params": _params,                             # (model, group='total'|'linear'|'embeddings')
    "expected_tokens_per_step": expected_tokens_per_step,  # (alpha, k)
    "expected_speedup": expected_speedup,          # (alpha, k, draft_cost)
    "ratio": _ratio,                               # (a, b, fn)
    "checkpoint_bytes": checkpoint_bytes,          # (model, format, embeddings_bits=16)
    "serving": serving,                            # (field, model, gpu, prompt, output, ...): minillm.fleet
    "decode_step": _decode_step,                   # (field, model, gpu, batch, context, tp=1, weights=...)
    "batching_speedup": _batching_speedup,         # (model, gpu, batch, context, ...)
    "prefill_flops_per_s": _prefill_flops_per_s,   # (model, prompt, output, output_tokens_per_s, cached=0)
    "peak_flops": _peak_flops,                     # (gpu, dtype='bf16', n=1)
    "spec": _spec,                                 # (gpu, field='memory'|'hbm'|'link'|'domain')
    "littles_law": _littles_law,                   # (two of concurrency, rate, latency_s)
    "prefill_devices": _prefill_devices,           # (model, gpu, prompt, output, requests_per_s, tp=...)
    "units_needed": _units_needed,                 # (demand, fn, args): demand / fn(**args)
    "scaled": _scaled,                             # (factor, fn, args): fn(**args) x factor
    "mix": _mix,                                   # (parts=[[share, fn, args], ...])
    "tp_comm_bytes": est.tp_comm_bytes_per_gpu,    # (model, tp, tokens): bytes each device sends
    "plan": _plan,                                 # (field, model, gpu, rps, slo, prompt_len, ...): fleet plan
    "simulate": _simulate,                         # (command, field, router=None): fleet simulate's table
}

_UNITS = {
    "": 1, "bytes": 1, "B": 1,
    "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12,
    "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40,
    "K": 1e3, "M": 1e6, "B params": 1e9, "billion": 1e9,
    "x": 1, "×": 1, "%": 0.01, "tokens": 1, "requests/s": 1, "requests": 1,
    "µs": 1e-6, "ms": 1e-3, "s": 1, "tok/s": 1, "output tok/s": 1, "K tok/s": 1e3, "tokens/s": 1,
    "TFLOP": 1e12, "PFLOP": 1e15, "TFLOP/s": 1e12, "PFLOP/s": 1e15, "GB/s": 1e9, "TB/s": 1e12,
    "streams": 1, "sequences": 1, "conversations": 1, "GPUs": 1, "replicas": 1,
}
_CLAIM = re.compile(r"^~?\s*\$?([0-9][0-9,]*(?:\.[0-9]+)?)\s*(.*?)\s*$")


def parse_claim(claim: str) -> float:
    """'2 GiB' -> 2147483648.0, '2.8x' -> 2.8, '35 GB' -> 3.5e10, '327,680 bytes' -> 327680.0, '125 ms' -> 0.125,
    '$2.48' -> 2.48."""
    m = _CLAIM.match(claim)
    if not m or m.group(2) not in _UNITS:
        raise ValueError(f"cannot read the figure {claim!r}: write a number and one of the units "
                         f"{', '.join(repr(u) for u in _UNITS if u)}")
    return float(m.group(1).replace(",", "")) * _UNITS[m.group(2)]


def verify_check(check: dict[str, Any]) -> tuple[float, float]:
    """Return (claimed, computed); raise AssertionError when they differ by more than rel_tol."""
    fn = check["fn"]
    if fn not in FUNCTIONS:
        raise KeyError(f"unknown check function {fn!r}; known: {', '.join(sorted(FUNCTIONS))}")
    computed = float(FUNCTIONS[fn](**check.get("args", {})))
    claimed = parse_claim(check["claim"])
    tol = float(check.get("rel_tol", 0.05))
    if not math.isclose(claimed, computed, rel_tol=tol):
        raise AssertionError(f"claim {check['claim']!r} = {claimed:g} but {fn}({check.get('args', {})}) = "
                             f"{computed:g} (rel_tol {tol})")
    return claimed, computed
