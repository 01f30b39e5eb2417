"""A first-order serving cost model: from a model's shapes and an accelerator's datasheet to TTFT, TPOT,
tokens/s per replica and $ per million output tokens.

It counts what a step must do and divides by what the hardware offers, nothing more:

* FLOPs: 2 per weight per token through the matmuls, plus attention's QK^T and PV (4 x layers x query
  width per (query, key) pair; causal, so a P-token prompt has P(P+1)/2 pairs). Prefill computes logits
  for the last prompt token only.
* Bytes: a decode step streams the weights once (not the input embedding table, which is a row gather)
  plus every running sequence's KV at its current context; the new tokens' K and V are written.
* Tensor-parallel communication: two all-reduces per layer (after attention and after the MLP) of
  tokens x hidden x 2 bytes, moved as a ring (2(N-1)/N of the message per device) over one direction of
  the scale-up link, plus a fixed latency per all-reduce. Not overlapped with compute.
* Time of a forward pass = max(FLOPs / (peak x mfu), bytes / (HBM bandwidth x mbu)) + communication.
* Chunked prefill (Sarathi-Serve, as minillm's scheduler runs it): prompts are cut into chunks that share
  a forward pass with the running decodes. In steady state, with `batch` streams each finishing after
  `output` tokens, batch / output new prompts arrive per step, so the average step carries `batch` decode
  tokens plus that many prompts' uncached tokens, and is priced as one pass (max of compute and memory):
  the weights are read once, and prompt FLOPs fill the compute a memory-bound decode leaves idle.
  TPOT = that mixed step; a request's GPU time = its share of the steps it decodes in. Disaggregated
  prefill (prefill_devices) cannot share passes and pays each prompt's own pass.
  These are means; p95/p99 need headroom that only a load test or the fleet simulator can size.
* Memory: weights shard evenly over tp devices (K/V projections replicated past tp = KV heads are not
  counted); each device keeps memory_utilization x HBM minus runtime_gb, the rest is the KV pool.
  Decode streams sit at the mean context prompt + output / 2; max_streams reserves the full
  prompt + output per stream (the no-preemption ceiling).

Efficiencies are assumptions to calibrate with a load test (`Efficiency`); specs are datasheet peaks
(minillm.catalog.KNOWN_HARDWARE). No queueing: TTFT is an idle replica's prefill time (`minillm fleet simulate`
adds the queue).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

from minillm.catalog import Hardware, hardware_spec, model_shape, param_groups
from minillm.config import ModelConfig
from minillm.quant.memory import WeightFormat, checkpoint_bytes, weight_format

GB = 1e9
ACT_BYTES = 2     # activations cross the TP link in bf16, whatever the weight format


@dataclass(frozen=True)
class Efficiency:
    """Fractions of datasheet peak a tuned engine reaches; defaults are typical first guesses, not measured."""
    mfu: float = 0.5                      # of dense tensor FLOP/s in GEMMs and attention
    mbu: float = 0.7                      # of HBM bandwidth in weight and KV streaming
    link: float = 0.7                     # of one-direction link bandwidth in a ring all-reduce
    allreduce_latency_s: float = 10e-6    # fixed cost per all-reduce (launch, sync): dominates decode messages

    def __post_init__(self) -> None:
        for name in ("mfu", "mbu", "link"):
            v = getattr(self, name)
            if not 0 < v <= 1:
                raise ValueError(f"Efficiency.{name}={v} must be in (0, 1]: it is a fraction of the peak")


@dataclass(frozen=True)
class Deployment:
    """One replica: a model sharded over `tp` devices of one kind."""
    model: str | ModelConfig
    hardware: str | Hardware
    tp: int = 1
    weights: str | WeightFormat = "bf16"   # minillm.quant.memory.WEIGHT_FORMATS
    kv_bytes: float = 2                    # per KV element: 2 for bf16, 1 for an FP8 KV cache
    memory_utilization: float = 0.9        # share of HBM the engine may use (vLLM's gpu_memory_utilization)
    runtime_gb: float = 5.0                # per device, inside that share: activation peak, CUDA graphs, NCCL

    def __post_init__(self) -> None:
        cfg = model_shape(self.model)
        hardware_spec(self.hardware)
        weight_format(self.weights)
        if not isinstance(self.tp, int) or self.tp < 1 or cfg.num_heads % self.tp:
            raise ValueError(f"tp={self.tp!r} must be a positive divisor of {cfg.name}'s {cfg.num_heads} "
                             "query heads (each device takes whole heads)")
        if self.kv_bytes <= 0 or not 0 < self.memory_utilization <= 1 or self.runtime_gb < 0:
            raise ValueError("kv_bytes must be > 0, memory_utilization in (0, 1] and runtime_gb >= 0")

    @property
    def config(self) -> ModelConfig:
        return model_shape(self.model)

    @property
    def gpu(self) -> Hardware:
        return hardware_spec(self.hardware)

    @property
    def format(self) -> WeightFormat:
        return weight_format(self.weights)


@dataclass(frozen=True)
class Scenario:
    """The traffic one request brings, and what a device-hour costs."""
    prompt_tokens: int
    output_tokens: int
    cached_tokens: int = 0            # prompt tokens found in the prefix cache (not recomputed)
    batch: int | None = None          # concurrent decode streams; None = as many as the KV pool holds
    usd_per_gpu_hour: float = 3.0

    def __post_init__(self) -> None:
        if self.prompt_tokens < 1 or self.output_tokens < 1:
            raise ValueError("prompt_tokens and output_tokens must be >= 1")
        if not 0 <= self.cached_tokens < self.prompt_tokens:
            raise ValueError(f"cached_tokens={self.cached_tokens} must be in [0, prompt_tokens): at least the "
                             "last prompt token is computed to get the first output token")
        if self.batch is not None and self.batch < 1:
            raise ValueError(f"batch={self.batch} must be >= 1 (or None for as many as fit)")


@dataclass(frozen=True)
class StepTime:
    """One forward pass on one replica: its three lower bounds and the time they add up to."""
    compute_s: float
    memory_s: float
    comm_s: float

    @property
    def total_s(self) -> float:
        return max(self.compute_s, self.memory_s) + self.comm_s

    @property
    def bound(self) -> str:
        return "compute" if self.compute_s >= self.memory_s else "memory"


@dataclass(frozen=True)
class MemoryPlan:
    """Where one replica's HBM goes (GB are 1e9 bytes)."""
    weights_gb: float              # the whole checkpoint
    weights_gb_per_gpu: float
    usable_gb_per_gpu: float       # memory_utilization x HBM - runtime_gb
    kv_gb: float                   # what is left for the KV pool, whole replica (<= 0: the weights don't fit)
    kv_bytes_per_token: float      # whole replica, every layer, K and V (replicated KV heads counted)
    kv_tokens: int                 # tokens of KV the pool holds, all sequences together

    @property
    def offloaded_gb(self) -> float:
        """Weights that do not fit in the usable HBM and would have to live in host memory (0 when they fit):
        each decode step would stream them over the host link."""
        return max(0.0, -self.kv_gb)


@dataclass(frozen=True)
class Estimate:
    """What one replica does with a Scenario. Times in seconds, FLOPs and bytes unscaled."""
    memory: MemoryPlan
    devices: int                   # in the replica (= tp)
    max_streams: int               # sequences that fit at full length (prompt + output) with no preemption
    batch: int                     # concurrent decode streams used below
    prefill_flops: float           # one request's uncached prompt
    decode_flops_per_token: float  # at the mean decode context
    decode_step: StepTime          # one decode step of `batch` sequences at the mean context
    prefill: StepTime              # one request's prefill on an idle replica
    ttft_s: float                  # = prefill.total_s (no queueing)
    tpot_s: float                  # the mixed step: decodes + the prompt chunks arriving per step, one pass
    output_tokens_per_s: float     # replica, steady state
    gpu_seconds_per_request: float
    prefill_share: float           # of a request's GPU time: 1 - decode-only step / mixed step
    usd_per_m_output_tokens: float
    achieved_flops: float          # replica FLOP/s this throughput needs (prefill + decode)
    peak_flops: float              # replica dense peak in the format's compute dtype


def _kv_bytes_per_token_per_gpu(dep: Deployment) -> float:
    """KV heads split across devices; with tp > kv_heads each device keeps a replica of one head."""
    c = dep.config
    heads = math.ceil(c.num_kv_heads / dep.tp)
    return 2 * c.num_layers * heads * c.head_dim * dep.kv_bytes


def memory_plan(dep: Deployment) -> MemoryPlan:
    """Weights sharded evenly over tp devices, runtime reserve per device, the rest is KV pool."""
    weights = checkpoint_bytes(dep.config, dep.format)
    usable = dep.gpu.memory_gb * dep.memory_utilization - dep.runtime_gb
    free_per_gpu = usable - weights / GB / dep.tp
    per_token_gpu = _kv_bytes_per_token_per_gpu(dep)
    tokens = int(free_per_gpu * GB // per_token_gpu) if free_per_gpu > 0 else 0
    return MemoryPlan(weights_gb=weights / GB, weights_gb_per_gpu=weights / GB / dep.tp, usable_gb_per_gpu=usable,
                      kv_gb=free_per_gpu * dep.tp, kv_bytes_per_token=per_token_gpu * dep.tp, kv_tokens=tokens)


def _streamed_weight_bytes(dep: Deployment) -> float:
    """Bytes a decode step reads: every weight but the untied input embedding (a gather of a few rows)."""
    c = dep.config
    skipped = 0 if c.tie_word_embeddings else param_groups(c).embedding * 2
    return checkpoint_bytes(c, dep.format) - skipped


def forward_flops(model: str | ModelConfig, new_tokens: float, attn_pairs: float, logit_tokens: float) -> float:
    """2 FLOPs per weight per token through the layers' matmuls, 2 per LM-head weight per logit row, and
    4 x layers x query width per attention (query, key) pair (QK^T and PV)."""
    c = model_shape(model)
    p = param_groups(c)
    return (2 * p.linear * new_tokens + 2 * (p.lm_head or p.embedding) * logit_tokens
            + 4 * c.num_layers * c.q_size * attn_pairs)


def _prefill_pairs(sc: Scenario) -> float:
    new = sc.prompt_tokens - sc.cached_tokens
    return new * sc.cached_tokens + new * (new + 1) / 2


def forward_time(dep: Deployment, new_tokens: float, kv_tokens_read: float, attn_pairs: float,
                 logit_tokens: float, eff: Efficiency = Efficiency()) -> StepTime:
    """One forward pass: `new_tokens` through the matmuls, `attn_pairs` (query, key) pairs of attention,
    `kv_tokens_read` cached tokens' K and V streamed from HBM, logits for `logit_tokens` rows."""
    flops = forward_flops(dep.config, new_tokens, attn_pairs, logit_tokens)
    compute = flops / (dep.tp * dep.gpu.peak_flops(dep.format.compute) * eff.mfu)
    kv_gpu = _kv_bytes_per_token_per_gpu(dep)
    bytes_gpu = _streamed_weight_bytes(dep) / dep.tp + (kv_tokens_read + new_tokens) * kv_gpu
    memory = bytes_gpu / (dep.gpu.hbm_gb_s * GB * eff.mbu)
    return StepTime(compute, memory, tp_comm_seconds(dep, new_tokens, eff))


def tp_comm_bytes_per_gpu(model: str | ModelConfig, tp: int, tokens: int) -> float:
    """Bytes each device sends for one forward pass of `tokens` tokens at tensor parallelism `tp`:
    2 all-reduces per layer of tokens x hidden x 2 bytes, times the ring factor 2(N-1)/N (0 at TP=1)."""
    c = model_shape(model)
    return 2 * c.num_layers * tokens * c.hidden_size * ACT_BYTES * 2 * (tp - 1) / tp


def tp_comm_seconds(dep: Deployment, tokens: int, eff: Efficiency = Efficiency()) -> float:
    """The all-reduces of one forward pass: ring bytes over the link at eff.link, plus a fixed latency each
    (at small decode batches the latency, not the bytes, is most of it)."""
    if dep.tp == 1:
        return 0.0
    link = dep.gpu.link_gb_s * GB * eff.link
    if link <= 0:
        raise ValueError(f"{dep.gpu.name} has no scale-up link in the catalog; use tp=1")
    latency = 2 * dep.config.num_layers * eff.allreduce_latency_s
    return tp_comm_bytes_per_gpu(dep.config, dep.tp, tokens) / link + latency


def prefill_time(dep: Deployment, sc: Scenario, eff: Efficiency = Efficiency()) -> StepTime:
    """The uncached part of one prompt in one pass, attending to the cached prefix too."""
    return forward_time(dep, sc.prompt_tokens - sc.cached_tokens, sc.cached_tokens, _prefill_pairs(sc),
                        logit_tokens=1, eff=eff)


def decode_step(dep: Deployment, batch: int, context: float, eff: Efficiency = Efficiency()) -> StepTime:
    """One decode step of `batch` sequences each holding `context` tokens of KV."""
    return forward_time(dep, batch, batch * context, batch * (context + 1), logit_tokens=batch, eff=eff)


def mixed_step(dep: Deployment, sc: Scenario, batch: int, eff: Efficiency = Efficiency()) -> StepTime:
    """The steady state's average step under chunked prefill: `batch` decodes at the mean context plus the
    prompt chunks that arrive per step (batch / output prompts), in one forward pass. The weights are read
    once for all of them, and the chunks' FLOPs fill the compute a memory-bound decode leaves idle."""
    rate = batch / sc.output_tokens
    new = sc.prompt_tokens - sc.cached_tokens
    ctx = _mean_context(sc)
    # a chunk reads the cached prefix and the chunks before it: on average the prefix plus half the prompt
    return forward_time(dep, batch + rate * new, batch * ctx + rate * (sc.cached_tokens + new / 2),
                        batch * (ctx + 1) + rate * _prefill_pairs(sc), logit_tokens=batch + rate, eff=eff)


def _mean_context(sc: Scenario) -> float:
    return sc.prompt_tokens + (sc.output_tokens - 1) / 2


def estimate(dep: Deployment, sc: Scenario, eff: Efficiency = Efficiency()) -> Estimate:
    """The replica's steady state at sc.batch concurrent streams (default: as many as its KV pool holds)."""
    mem = memory_plan(dep)
    full = sc.prompt_tokens + sc.output_tokens
    streams = mem.kv_tokens // full
    if streams < 1:
        raise ValueError(f"{dep.config.name} in {dep.format.name} on {dep.tp} x {dep.gpu.name} leaves "
                         f"{max(mem.kv_gb, 0):.1f} GB for KV, not enough for one {full}-token request; "
                         "raise tp, quantize the weights or the KV, or shorten the request")
    batch = sc.batch or streams
    if batch > streams:
        raise ValueError(f"batch={batch} needs {batch * full:,} tokens of KV but the pool holds "
                         f"{mem.kv_tokens:,} ({streams} streams); lower the batch or add memory")
    ctx = _mean_context(sc)
    step = decode_step(dep, batch, ctx, eff)
    pre = prefill_time(dep, sc, eff)
    tpot = mixed_step(dep, sc, batch, eff).total_s
    gpu_s = sc.output_tokens * tpot / batch * dep.tp
    prefill_flops = forward_flops(dep.config, sc.prompt_tokens - sc.cached_tokens, _prefill_pairs(sc), 1)
    decode_flops = forward_flops(dep.config, 1, ctx + 1, 1)
    throughput = batch / tpot
    requests_per_s = throughput / sc.output_tokens
    return Estimate(
        memory=mem, devices=dep.tp, max_streams=streams, batch=batch, prefill_flops=prefill_flops,
        decode_flops_per_token=decode_flops, decode_step=step, prefill=pre, ttft_s=pre.total_s, tpot_s=tpot,
        output_tokens_per_s=throughput, gpu_seconds_per_request=gpu_s, prefill_share=1 - step.total_s / tpot,
        usd_per_m_output_tokens=gpu_s / sc.output_tokens * 1e6 * sc.usd_per_gpu_hour / 3600,
        achieved_flops=requests_per_s * (prefill_flops + sc.output_tokens * decode_flops),
        peak_flops=dep.tp * dep.gpu.peak_flops(dep.format.compute))


def prefill_devices(dep: Deployment, sc: Scenario, requests_per_s: float, eff: Efficiency = Efficiency()) -> float:
    """Devices kept busy by prefill alone at `requests_per_s`: the size of a disaggregated prefill pool
    before headroom (its ratio to the decode pool is the P:D ratio)."""
    return requests_per_s * prefill_time(dep, sc, eff).total_s * dep.tp


def batch_for_tpot(dep: Deployment, sc: Scenario, tpot_s: float, eff: Efficiency = Efficiency()) -> int:
    """The largest batch whose TPOT (the mixed step: decodes + prompt chunks) stays within `tpot_s`, capped by
    what the KV pool holds; 0 when even one stream misses it. TPOT grows with the batch, so bisect."""
    top = estimate(dep, replace(sc, batch=None), eff).max_streams
    ok = lambda b: estimate(dep, replace(sc, batch=b), eff).tpot_s <= tpot_s  # noqa: E731
    if not ok(1):
        return 0
    lo, hi = 1, top
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid - 1)
    return lo


__all__ = ["Deployment", "Efficiency", "Estimate", "MemoryPlan", "Scenario", "StepTime", "batch_for_tpot",
           "decode_step", "estimate", "forward_flops", "forward_time", "memory_plan", "mixed_step",
           "prefill_devices", "prefill_time", "tp_comm_bytes_per_gpu", "tp_comm_seconds"]
