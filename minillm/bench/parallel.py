"""`minillm bench parallel`: the same decode workload under each layout (TP 1/2/3, PP 2, ...): step time at batch 1
and 16, bytes rank 0 sent per token next to the formula, and the share of the step rank 0 spent inside
collectives. Plus a bandwidth model of what the same traffic costs on an NVLink GPU node.

Why TP is slower here: on a 2-core CPU the ranks share the same two cores and the same memory bus (so no extra
compute or bandwidth is gained by splitting), and every all-reduce is a round trip through gloo's TCP loopback
(tens of microseconds to milliseconds). On GPUs each rank has its own compute and HBM, and NVLink moves the
all-reduce in microseconds, which is why TP cuts decode latency inside one node.
"""
from __future__ import annotations

import random
import statistics
import time
from dataclasses import dataclass

from minillm.bench.registry import parse_layout
from minillm.distributed.sharding import tp_problems
from minillm.executor.launch import start_engine
from minillm.loading.loader import peek_config
from minillm.sampling.params import SamplingParams


# H100 SXM: NVLink 4 at 450 GB/s each way; NCCL's small-message all-reduce latency inside a node is ~5-10 us.
NVLINK_GBPS, NVLINK_LATENCY_S = 450.0, 8e-6


@dataclass
class Measured:
    step_ms: float
    tokens_per_step: float
    bytes_per_token: float
    messages_per_token: float
    comm_share: float
    comm_ms_per_step: float


def formula_bytes_per_token(cfg, tp: int, pp: int, dtype_bytes: int) -> dict:
    """Payload bytes per token: TP all-reduces the hidden vector twice per layer (after attention's o_proj and
    after the MLP's down_proj) plus once after the vocab-parallel embedding; PP sends one hidden vector across each
    stage boundary."""
    h = cfg.hidden_size * dtype_bytes
    if tp > 1:
        return {"layers": 2 * cfg.num_layers * h, "embedding": h, "total": (2 * cfg.num_layers + 1) * h,
                "collectives": 2 * cfg.num_layers + 1, "text": f"2 x {cfg.num_layers} layers x {h} B + {h} B"}
    if pp > 1:
        return {"layers": (pp - 1) * h, "embedding": 0, "total": (pp - 1) * h, "collectives": pp - 1,
                "text": f"{pp - 1} boundaries x {h} B"}
    return {"layers": 0, "embedding": 0, "total": 0, "collectives": 0, "text": "nothing"}


def nvlink_ms_per_token(formula: dict, tp: int) -> float:
    """The same collectives on NVLink: each costs latency + ring traffic 2(N-1)/N x bytes / bandwidth."""
    n = formula["collectives"]
    if n == 0:
        return 0.0
    per = formula["total"] / n
    ring = 2 * (tp - 1) / tp if tp > 1 else 1.0
    return 1000 * n * (NVLINK_LATENCY_S + ring * per / (NVLINK_GBPS * 1e9))


def measure(engine, batch: int, steps: int, prompt_len: int, vocab: int, seed: int = 0) -> Measured:
    rng = random.Random(seed)
    comm = engine.runner.comm
    # the prefill emits the first token and the first decode step is not timed (its stats began mid-prefill), so
    # `steps` timed decode steps need steps + 2 tokens (with steps + 1, --steps 1 timed nothing)
    params = SamplingParams(temperature=0, max_tokens=steps + 2, ignore_eos=True)
    times, tokens, started = [], [], []

    def observe(info):
        if all(n == 1 for _, n in info.scheduler_output.scheduled):    # decode-only steps
            if not started:
                started.append(True)
                comm.stats.reset()
                return                                               # the first one's stats began mid-prefill
            times.append(info.seconds)
            tokens.append(len(info.scheduler_output.scheduled))
        else:
            comm.stats.reset()
    engine.add_step_observer(observe)
    try:
        for i in range(batch):
            engine.add_request([rng.randrange(3, vocab) for _ in range(prompt_len)], params)
        while engine.has_unfinished_requests():
            engine.step()
    finally:
        engine.remove_step_observer(observe)
    st = comm.stats
    sent = st.total("bytes", exclude=("broadcast", "gather", "recv"))
    msgs = st.total("messages", exclude=("broadcast", "gather", "recv"))
    n_tok = max(1, sum(tokens))
    total = max(sum(times), 1e-9)
    comm_s = st.total("seconds")
    return Measured(1000 * statistics.median(times), statistics.mean(tokens), sent / n_tok, msgs / n_tok,
                    min(1.0, comm_s / total), 1000 * comm_s / max(1, len(times)))


def run_parallel_bench(model: str, config, layouts=("tp1", "tp2", "tp3", "pp2", "pp2x1"), batch_sizes=(1, 16),
                       steps: int = 16, prompt_len: int = 32, progress=None) -> dict:
    cfg = peek_config(model)
    out = {"model": cfg.name, "hidden_size": cfg.hidden_size, "num_layers": cfg.num_layers, "layouts": {},
           "batch_sizes": list(batch_sizes), "decode_steps": steps, "prompt_len": prompt_len,
           "nvlink_model": {"GB_per_s": NVLINK_GBPS, "latency_us": NVLINK_LATENCY_S * 1e6}}
    for name in layouts:
        tp, pp, micro = parse_layout(name)
        problems = tp_problems(cfg, tp) if tp > 1 else ([] if pp <= cfg.num_layers else ["more stages than layers"])
        if problems:
            out["layouts"][name] = {"skipped": "; ".join(problems)}
            if progress:
                progress(f"{name}: skipped ({'; '.join(problems)})")
            continue
        if progress:
            progress(f"{name}: starting {tp * pp} rank(s)")
        t0 = time.perf_counter()
        loaded, engine = start_engine(model, config.replace(tensor_parallel_size=tp, pipeline_parallel_size=pp,
                                                            pipeline_micro_batches=micro))
        try:
            dtype_bytes = loaded.model.dtype.itemsize
            formula = formula_bytes_per_token(cfg, tp, pp, dtype_bytes)
            measure(engine, 1, 2, 8, cfg.vocab_size, seed=99)     # warm-up: first-call costs on every rank
            rows = {}
            for bs in batch_sizes:
                if progress:
                    progress(f"{name}: batch {bs}, {steps} decode steps")
                m = measure(engine, bs, steps, prompt_len, cfg.vocab_size)
                rows[bs] = {"step_ms": round(m.step_ms, 2), "ms_per_token": round(m.step_ms / m.tokens_per_step, 3),
                            "tok_s": round(1000 * m.tokens_per_step / m.step_ms, 1),
                            "bytes_per_token": round(m.bytes_per_token), "messages_per_token": round(m.messages_per_token, 2),
                            "comm_share": round(m.comm_share, 3), "comm_ms_per_step": round(m.comm_ms_per_step, 2)}
            out["layouts"][name] = {"tp": tp, "pp": pp, "ranks": tp * pp, "micro_batches": micro or pp, "startup_s": round(time.perf_counter() - t0, 1),
                                    "formula_bytes_per_token": formula["total"], "formula": formula["text"],
                                    "nvlink_comm_ms_per_token": round(nvlink_ms_per_token(formula, tp), 3),
                                    "by_batch": rows}
        finally:
            engine.close()
    return out


def format_parallel(r: dict) -> str:
    bs = r["batch_sizes"]
    head = (f"{r['model']}: hidden {r['hidden_size']}, {r['num_layers']} layers; {r['decode_steps']} decode steps "
            f"after {r['prompt_len']}-token prompts; bytes = payload rank 0 sent (all-reduce / point-to-point)")
    cols = "".join(f"  step ms @{b:<3d}" for b in bs)
    lines = [head, "'in collectives' is the share of rank 0's step spent inside communication calls, including "
                   "waiting there for slower ranks",
             f"{'layout':7s}{cols}  bytes/token (formula)          msgs/tok  in collectives @1  NVLink comm ms/tok"]
    base = r["layouts"].get("tp1", {}).get("by_batch")
    for name, L in r["layouts"].items():
        if "skipped" in L:
            lines.append(f"{name:7s}  skipped: {L['skipped']}")
            continue
        b1 = L["by_batch"][bs[0]]
        steps = "".join(f"  {L['by_batch'][b]['step_ms']:11.1f}" for b in bs)
        lines.append(f"{name:7s}{steps}  {b1['bytes_per_token']:>8d} ({L['formula_bytes_per_token']:>7d}: "
                     f"{L['formula']:<18s}) {b1['messages_per_token']:6.1f}  {100 * b1['comm_share']:13.0f}%  "
                     f"{L['nvlink_comm_ms_per_token']:10.3f}")
    if base:
        for name, L in r["layouts"].items():
            if name != "tp1" and "by_batch" in L:
                ratios = ", ".join(f"batch {b}: {L['by_batch'][b]['step_ms'] / base[b]['step_ms']:.2f}x "
                                   f"({L['by_batch'][b]['tok_s']:.0f} tok/s)" for b in bs)
                lines.append(f"{name} step time vs tp1: {ratios}")
    lines.append("Here the ranks share 2 cores and one memory bus, and each all-reduce is a gloo round trip over "
                 "TCP loopback, so splitting adds communication without adding compute or bandwidth: TP and PP are "
                 "slower than TP=1. On a GPU node each rank brings its own compute and HBM bandwidth and NVLink "
                 "moves these bytes in the last column's time, so TP divides the weight-read time of decode by N "
                 "for well under a millisecond of communication per token. PP sends ~60x fewer bytes but does not "
                 "cut latency (the stages of one token run one after another); micro-batches let the stages "
                 "overlap, which pays when each stage has its own device and enough rows per micro-batch — here "
                 "the halves are small, every hand-off is a loopback round trip and rank 0 also schedules and "
                 "samples, so compare ppN with ppNx1 rather than expect a gain.")
    return "\n".join(lines)


def parallel_plot(r: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    names = [n for n, L in r["layouts"].items() if "by_batch" in L]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    width = 0.8 / len(r["batch_sizes"])
    for i, b in enumerate(r["batch_sizes"]):
        axes[0].bar([k + i * width for k in range(len(names))],
                    [r["layouts"][n]["by_batch"][b]["step_ms"] for n in names], width, label=f"batch {b}")
    axes[0].set_xticks([k + width * (len(r["batch_sizes"]) - 1) / 2 for k in range(len(names))], names)
    axes[0].set_ylabel("decode step time (ms)")
    axes[0].legend()
    axes[0].set_title("step time by layout (this machine)")
    b0 = r["batch_sizes"][0]
    sharded = [n for n in names if r["layouts"][n]["ranks"] > 1]
    axes[1].bar(sharded, [r["layouts"][n]["by_batch"][b0]["bytes_per_token"] for n in sharded], label="measured")
    axes[1].scatter(sharded, [r["layouts"][n]["formula_bytes_per_token"] for n in sharded], color="k", zorder=3,
                    label="formula")
    axes[1].set_yscale("log")
    axes[1].set_ylabel("bytes rank 0 sent per token (log)")
    axes[1].legend()
    axes[1].set_title("communication per token")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
