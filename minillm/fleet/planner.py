"""`minillm fleet plan`: the cheapest layout (TP per replica x replicas) that serves a load within a latency SLO,
sized with the roofline step model and checked by simulation.

1. Layouts: TP 1, 2, 4, 8 of the catalog model on the catalog GPU; a TP whose weights leave no KV pool is rejected
   (the constraint says by how much).
2. Sizing (per layout, closed form on the step model): a replica serving lam requests/s of L prompt and O output
   tokens reaches a steady step time t with B = lam x O x t sequences decoding and p = lam x L x t prompt tokens
   chunked into each step (Little's law), t = step_model(p prefill, B decodes, their context). The fixed point is
   found by iteration; the replica's capacity is the largest lam whose steady step keeps TPOT (= t) and the TTFT
   estimate (the prompt's chunks, one step each) within the SLO scaled by `headroom` (room for the p99's queueing),
   B within max_num_seqs and the KV pool, and p + B within the token budget. Replicas = ceil(rps / capacity).
   With `disaggregate`, each TP also gets a prefill:decode split: a prefill replica sized the same way with no
   decodes (TTFT bound), a decode replica with no prefill (TPOT, KV and max_num_seqs bound), P and D each from
   its own capacity; the KV crosses a `link_gbps` link (policies.KVLink).
3. Verification: the cheapest few layouts are simulated (the engine's scheduler on the step model, Poisson
   arrivals). A fleet behind a least-tokens router is symmetric, so a slice of up to `slice_replicas` replicas at
   its share of the load stands for the whole; if its p99s miss the SLO the layout gets more replicas (10 % at a
   time) until they hold, or it is rejected after `max_bumps` tries.
The answer: the cheapest verified layout, each runner-up and what rejected or out-priced it, $/hour and $/M output
tokens at the stated price per GPU-hour.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import numpy as np

from minillm.fleet.replica import Replica, ReplicaConfig
from minillm.fleet.routers import LeastTokens
from minillm.fleet.policies import KVLink
from minillm.fleet.simulator import FleetResult, simulate
from minillm.fleet.step_model import StepFeatures, StepModel, from_roofline
from minillm.fleet.workloads import VOCAB, SimRequest, arrival_times

TPS = (1, 2, 4, 8)
UNIFIED, PREFILL, DECODE = "unified", "prefill", "decode"      # what a sized replica runs


@dataclass(frozen=True)
class Demand:
    rps: float
    prompt_len: int
    output_len: int
    ttft_p99_s: float
    tpot_p99_s: float
    usd_per_gpu_hour: float = 3.0
    prefix_len: int = 0                # leading prompt tokens every request shares (a system prompt)

    def __post_init__(self) -> None:
        if not (self.rps > 0 and self.prompt_len >= 1 and self.output_len >= 1 and self.ttft_p99_s > 0
                and self.tpot_p99_s > 0 and self.usd_per_gpu_hour >= 0):
            raise ValueError("plan needs rps > 0, prompt and output lengths >= 1, SLO targets > 0, a price >= 0")
        if not 0 <= self.prefix_len < self.prompt_len:
            raise ValueError(f"prefix_len={self.prefix_len} must be in [0, prompt_len={self.prompt_len}): the "
                             "shared prefix is part of the prompt, and at least one prompt token is computed")

    @property
    def new_prompt_len(self) -> float:
        """Prompt tokens a replica computes per request in steady state: its prefix cache holds the shared
        prefix's full blocks (the planner's replicas all see every prefix, so none is cold for long)."""
        return self.prompt_len - self.prefix_len

    @property
    def output_tokens_per_hour(self) -> float:
        return self.rps * self.output_len * 3600


@dataclass
class Layout:
    tp: int
    replicas: int = 0                  # all of them (prefill + decode when disaggregated)
    split: tuple[int, int] | None = None   # disaggregated: (prefill, decode) replicas
    capacity_rps: float = 0.0          # per replica, from the sizing (the prefill replica's when disaggregated)
    step_s: float = math.nan           # the steady step at that load (= TPOT)
    ttft_est_s: float = math.nan
    kv_gb: float = 0.0                 # per replica
    rejected: str = ""                 # why it cannot serve the demand ("" = it can)
    verified: FleetResult | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def gpus(self) -> int:
        return self.tp * self.replicas

    @property
    def label(self) -> str:
        return f"TP={self.tp}" + (f" {self.split[0]}P:{self.split[1]}D" if self.split else "")

    @property
    def shape(self) -> str:
        return f"{self.split[0]} prefill + {self.split[1]} decode replicas" if self.split else \
            f"{self.replicas} replicas"

    def usd_per_hour(self, d: Demand) -> float:
        return self.gpus * d.usd_per_gpu_hour

    def usd_per_m_tokens(self, d: Demand) -> float:
        return self.usd_per_hour(d) / (d.output_tokens_per_hour / 1e6)


# ---------------------------------------------------------------------- sizing

def load(lam: float, t: float, d: Demand, role: str = UNIFIED) -> tuple[float, float]:
    """(B decoding sequences, p prompt tokens) in a steady step of t seconds at lam requests/s (Little's law)."""
    B = 0.0 if role == PREFILL else lam * (d.output_len - (role == DECODE)) * t
    p = 0.0 if role == DECODE else lam * d.new_prompt_len * t
    return B, p


def steady_features(lam: float, t: float, d: Demand, role: str = UNIFIED) -> StepFeatures:
    """One steady step at lam requests/s with step time t: B decodes at the mean decode context, p prompt tokens
    at the mean prefill context (a chunk reads the shared prefix and half of the rest before it)."""
    L, O = d.prompt_len, d.output_len
    B, p = load(lam, t, d, role)
    ctx = L + O / 2
    before = d.prefix_len + d.new_prompt_len / 2
    return StepFeatures(prefill_tokens=round(p), decode_tokens=round(B),
                        kv_tokens=round(B * (ctx + 1) + p + before),
                        attn_pairs=round(B * (ctx + 1) + p * (before + p / 2)), num_seqs=math.ceil(B + min(p, 1)))


def steady_step(sm: StepModel, lam: float, d: Demand, role: str = UNIFIED, iters: int = 200) -> float:
    """The fixed point t = step_model(steady step at lam, t); inf when there is none (overload)."""
    t = sm.seconds(steady_features(0, 0, d, role))
    for _ in range(iters):
        new = sm.seconds(steady_features(lam, t, d, role))
        if new > 1e3:
            return math.inf
        if abs(new - t) <= 1e-9 + 1e-6 * t:
            return new
        t = new
    return math.inf


def check(sm: StepModel, cfg: ReplicaConfig, lam: float, d: Demand, headroom: float,
          role: str = UNIFIED) -> tuple[str, float, float]:
    """(the first constraint lam breaks or "", the steady step, the TTFT estimate). A prefill replica answers to
    the TTFT target only, a decode replica to the TPOT target only."""
    t = steady_step(sm, lam, d, role)
    if not math.isfinite(t):
        return "no steady state (overloaded)", t, math.inf
    B, p = load(lam, t, d, role)
    chunk = max(1.0, cfg.max_num_batched_tokens - B)
    ttft = t * (math.ceil(d.new_prompt_len / chunk) + 1)   # its chunks, plus the step it waits to join
    if B + p > cfg.max_num_batched_tokens:
        return f"needs {B + p:.0f} tokens a step, budget {cfg.max_num_batched_tokens}", t, ttft
    if B > cfg.max_num_seqs:
        return f"needs {B:.0f} sequences decoding, max_num_seqs {cfg.max_num_seqs}", t, ttft
    if (B + 1) * (d.prompt_len + d.output_len) > cfg.num_blocks * cfg.block_size:
        return f"needs KV for {B:.0f} x {d.prompt_len + d.output_len} tokens, the pool holds " \
               f"{cfg.num_blocks * cfg.block_size}", t, ttft
    if t > headroom * d.tpot_p99_s and role != PREFILL:
        return f"TPOT {1e3 * t:.1f} ms > {headroom:.0%} of {1e3 * d.tpot_p99_s:g} ms", t, ttft
    if ttft > headroom * d.ttft_p99_s and role != DECODE:
        return f"TTFT ~{1e3 * ttft:.0f} ms > {headroom:.0%} of {1e3 * d.ttft_p99_s:g} ms", t, ttft
    return "", t, ttft


def capacity(sm: StepModel, cfg: ReplicaConfig, d: Demand, headroom: float = 0.8,
             role: str = UNIFIED) -> tuple[float, str]:
    """(the most requests/s one replica in `role` serves within every constraint, "") by bisection, or (0, why
    even one request at a time breaks one)."""
    why = check(sm, cfg, 1e-9, d, headroom, role)[0]
    if why:
        return 0.0, f"even one request at a time: {why}"
    lo, hi = 1e-9, 1.0
    while not check(sm, cfg, hi, d, headroom, role)[0] and hi < 1e7:
        lo, hi = hi, hi * 2
    for _ in range(50):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if not check(sm, cfg, mid, d, headroom, role)[0] else (lo, mid)
    return lo, ""


def size(sm: StepModel, cfg: ReplicaConfig, d: Demand, tp: int, headroom: float = 0.8,
         disaggregate: bool = False) -> Layout:
    """A layout's per-replica capacity and the replicas the demand needs (a prefill:decode split, each pool from
    its own capacity, when disaggregated)."""
    lay = Layout(tp, kv_gb=cfg.num_blocks * cfg.block_size * sm.replica.get("kv_bytes_per_token", 0) / 1e9)
    roles = (PREFILL, DECODE) if disaggregate else (UNIFIED,)
    counts = []
    for role in roles:
        cap, why = capacity(sm, cfg, d, headroom, role)
        if why:
            lay.rejected = f"{role} replica, {why}" if disaggregate else why
            return lay
        counts.append(math.ceil(d.rps / cap))
        if role != DECODE:
            lay.capacity_rps = cap
            _, lay.step_s, lay.ttft_est_s = check(sm, cfg, cap, d, headroom, role)
        if role == DECODE:
            lay.step_s = check(sm, cfg, cap, d, headroom, role)[1]
    lay.replicas = sum(counts)
    if disaggregate:
        lay.split = (counts[0], counts[1])
    return lay


# ---------------------------------------------------------------------- verification

def fixed_lengths(rate: float, duration: float, prompt_len: int, output_len: int, seed: int = 0,
                  prefix_len: int = 0) -> Iterator[SimRequest]:
    """Poisson arrivals of requests with these lengths: `prefix_len` leading tokens the same in every prompt,
    the rest fresh random tokens."""
    rng = np.random.default_rng(seed)
    prefix = rng.integers(3, VOCAB, prefix_len).tolist()
    for i, t in enumerate(arrival_times(rng, rate, duration)):
        yield SimRequest(i, t, prefix + rng.integers(3, VOCAB, prompt_len - prefix_len).tolist(), output_len)


def simulate_slice(sm: StepModel, cfg: ReplicaConfig, d: Demand, replicas: int, duration: float,
                   slice_replicas: int = 4, seed: int = 0, split: tuple[int, int] | None = None,
                   link_gbps: float = 400.0) -> FleetResult:
    """`slice_replicas` of the fleet's replicas at their share of the load (the fleet is symmetric). A split fleet
    keeps both pools in the slice, in the ratio closest to P:D, and each pool gets at least its share of the load
    (the larger of the two shares sets the rate: conservative)."""
    if split is None:
        k = min(replicas, slice_replicas)
        reqs = fixed_lengths(d.rps * k / replicas, duration, d.prompt_len, d.output_len, seed, d.prefix_len)
        return simulate(reqs, [Replica(sm, cfg) for _ in range(k)], LeastTokens(), f"{k} of {replicas}")
    P, D = split
    pairs = [(max(1, min(P, round(P * kd / D))), kd) for kd in range(1, min(D, slice_replicas) + 1)]
    pairs += [(kp, max(1, min(D, round(D * kp / P)))) for kp in range(1, min(P, slice_replicas) + 1)]
    pairs = [k for k in pairs if sum(k) <= 2 * slice_replicas] or [(1, 1)]        # a slice stays cheap
    kp, kd = min(pairs, key=lambda k: (max(k[0] / P, k[1] / D) / min(k[0] / P, k[1] / D), k[0] + k[1]))
    reqs = fixed_lengths(d.rps * max(kp / P, kd / D), duration, d.prompt_len, d.output_len, seed, d.prefix_len)
    link = KVLink(sm.replica["kv_bytes_per_token"], link_gbps)
    return simulate(reqs, [Replica(sm, cfg) for _ in range(kp)], LeastTokens(), f"{kp}P:{kd}D of {P}P:{D}D",
                    decode_replicas=[Replica(sm, cfg) for _ in range(kd)], kv_link=link)


def misses(res: FleetResult, d: Demand) -> str:
    """The SLO the simulated p99s break, by how much ("" = met)."""
    out = []
    if res.failed:
        out.append(f"{res.failed} requests failed")
    ttft, tpot = res.ttft.quantile(0.99), res.tpot.quantile(0.99)
    if not ttft <= d.ttft_p99_s:
        out.append(f"TTFT p99 {1e3 * ttft:.0f} ms > {1e3 * d.ttft_p99_s:g} ms")
    if d.output_len > 1 and not tpot <= d.tpot_p99_s:
        out.append(f"TPOT p99 {1e3 * tpot:.1f} ms > {1e3 * d.tpot_p99_s:g} ms")
    return "; ".join(out)


@dataclass
class Plan:
    demand: Demand
    layouts: list[Layout]              # every TP considered, cheapest first, rejected ones last

    @property
    def best(self) -> Layout | None:
        ok = [lay for lay in self.layouts if not lay.rejected]
        return ok[0] if ok else None


def _bump(n: int) -> int:
    return math.ceil(n * 1.1) if n >= 10 else n + 1


def plan(model: str, gpu: str, d: Demand, weights: str = "bf16", verify: int = 2, duration: float = 20.0,
         headroom: float = 0.8, max_bumps: int = 6, slice_replicas: int = 4, seed: int = 0,
         disaggregate: bool = False, link_gbps: float = 400.0, log: Callable[[str], None] | None = None) -> Plan:
    layouts = []
    for tp in TPS:
        try:
            sm = from_roofline(model, gpu, weights, tp)
        except ValueError as e:
            layouts.append(Layout(tp, rejected=str(e).split(":")[0]))
            continue
        cfg = ReplicaConfig.of(sm)
        for split in (False, True) if disaggregate else (False,):
            lay = size(sm, cfg, d, tp, headroom, split)
            if not lay.rejected:
                lay.notes.append(f"sized: {lay.capacity_rps:.2f} req/s per replica at a {1e3 * lay.step_s:.1f} ms "
                                 "step")
            layouts.append(lay)
            lay._sim = (sm, cfg)     # type: ignore[attr-defined]   # kept for verification
    checked = 0
    while checked < verify:      # the cheapest layout not yet simulated, while it could beat the best verified one
        live = [lay for lay in layouts if not lay.rejected]
        best = min((lay.gpus for lay in live if lay.verified), default=math.inf)
        todo = sorted((lay for lay in live if lay.verified is None and lay.gpus < best),
                      key=lambda x: (x.gpus, x.tp, x.split is not None))
        if not todo:
            break
        lay = todo[0]
        sm, cfg = lay._sim       # type: ignore[attr-defined]
        for bump in range(max_bumps + 1):
            res = simulate_slice(sm, cfg, d, lay.replicas, duration, slice_replicas, seed, lay.split, link_gbps)
            why = misses(res, d)
            if log:
                log(f"[{lay.label}, {lay.shape}: {'meets the SLO' if not why else why} "
                    f"({res.finished} requests simulated in {res.wall_s:.1f} s)]")
            if not why:
                lay.verified = res
                break
            lay.notes.append(f"{lay.shape} simulated: {why}")
            if bump == max_bumps:
                lay.rejected = f"still misses the SLO with {lay.shape} (simulated): {why}"
            elif lay.split is None:
                lay.replicas = _bump(lay.replicas)
            else:       # grow the pool whose target was missed (both when requests failed)
                P, D = lay.split
                P = _bump(P) if "TTFT" in why or "failed" in why else P
                D = _bump(D) if "TPOT" in why or "failed" in why else D
                lay.split, lay.replicas = (P, D), P + D
        checked += 1
    order = [lay for lay in layouts if not lay.rejected]
    for lay in layouts:
        lay.__dict__.pop("_sim", None)
    unverified = [lay for lay in order if not lay.rejected and lay.verified is None]
    for lay in unverified:
        lay.notes.append("not simulated (a cheaper layout was checked first)")
    layouts.sort(key=lambda lay: (bool(lay.rejected), lay.verified is None, lay.gpus, lay.tp, lay.split is not None))
    return Plan(d, layouts)


def report(p: Plan) -> str:
    d = p.demand
    lines = [f"demand: {d.rps:g} req/s of {d.prompt_len} prompt + {d.output_len} output tokens; SLO TTFT p99 <= "
             f"{1e3 * d.ttft_p99_s:g} ms, TPOT p99 <= {1e3 * d.tpot_p99_s:g} ms; ${d.usd_per_gpu_hour:g}/GPU-hour"]
    best = p.best
    if best is None or best.verified is None:
        lines.append("no layout verified: " + "; ".join(f"{lay.label}: {lay.rejected or 'not verified'}"
                                                          for lay in p.layouts))
        return "\n".join(lines)
    r = best.verified
    lines += [f"recommended: {best.shape} x TP={best.tp} = {best.gpus} GPUs, "
              f"{best.kv_gb:.0f} GB of KV per replica",
              f"  ${best.usd_per_hour(d):,.2f}/hour, ${best.usd_per_m_tokens(d):.3f} per million output tokens",
              f"  sized: {best.capacity_rps:.2f} req/s per replica (steady step {1e3 * best.step_s:.1f} ms, TTFT "
              f"estimate {1e3 * best.ttft_est_s:.0f} ms)",
              f"  simulated ({r.router} replicas, {r.finished} requests): TTFT p99 "
              f"{1e3 * r.ttft.quantile(.99):.0f} ms, TPOT p99 {1e3 * r.tpot.quantile(.99):.1f} ms, KV peak "
              f"{r.kv_usage_peak:.0%}",
              "runner-ups:"]
    for lay in p.layouts:
        if lay is best:
            continue
        if lay.rejected:
            lines.append(f"  {lay.label}: rejected: {lay.rejected}")
        else:
            state = "verified" if lay.verified else "sized only, not simulated: raise --verify to check it"
            lines.append(f"  {lay.label}: {lay.shape} = {lay.gpus} GPUs (${lay.usd_per_hour(d):,.2f}/hour, {state}): "
                         f"{lay.gpus - best.gpus:+d} GPUs against the recommendation")
    return "\n".join(lines)
