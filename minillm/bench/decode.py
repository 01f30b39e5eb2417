"""`minillm bench decode`: prefill speed, batch-1 decode speed, and the memory-bandwidth roofline.

At batch 1 every decode step must stream all weights from memory once, so
    decode time per token >= weight bytes per token / memory bandwidth.
We measure the bandwidth with a large tensor copy and print the measured time (through the engine, one
request at a time) next to that bound."""
from __future__ import annotations

import contextlib
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Iterator

import torch

from minillm.bench.registry import check_llama_bench
from minillm.config import EngineConfig
from minillm.engine.llm_engine import LLMEngine
from minillm.kernels import cpu_decode, cpu_qgemm
from minillm.quant.policy import describe
from minillm.sampling.params import SamplingParams


@dataclass
class DecodeBench:
    model: str
    path: str
    quantization: str         # the setting, and the formats it gave (quant.policy.describe)
    dtype: str
    threads: int
    prefill_tok_s: dict[int, float]
    decode_ms_per_token: float
    bandwidth_gb_s: float
    weight_bytes_per_token: int
    bound_ms_per_token: float
    ratio: float  # measured / bound: 1.0 would be perfectly bandwidth-bound
    decode_step: str = "layers"   # "fused C" when the decode steps ran as one C call (kernels/cpu_decode.py)
    decode_ms_rounds: list[float] = field(default_factory=list)   # one per --repeat round; decode_ms_per_token: best
    prefill_s_repeats: dict[int, list[float]] = field(default_factory=dict)   # each prefill's timed repeats
    loaded_ms_rounds: list[float] = field(default_factory=list)   # --background-load: each round's ms/token under it
    background_load: int = 0
    device: str = "cpu"           # where the engine ran (the bandwidth is that device's memory's)

    @property
    def slowdowns(self) -> list[float]:
        """Per round: ms/token with the background load over ms/token without it, measured back to back."""
        return [loaded / quiet for quiet, loaded in zip(self.decode_ms_rounds, self.loaded_ms_rounds)]


def measure_bandwidth(nbytes: int = 512 * 2**20, repeats: int = 5, device: str | torch.device = "cpu") -> float:
    """Bytes moved per second by a large copy (read + write) on `device` (a GPU: its HBM) — the ceiling a decode step
    streams weights at."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    cuda = src.device.type == "cuda"
    dst.copy_(src)  # warm up: fault the pages in
    best = float("inf")
    for _ in range(repeats):
        if cuda:
            torch.cuda.synchronize(src.device)
        t = time.perf_counter()
        dst.copy_(src)
        if cuda:
            torch.cuda.synchronize(src.device)
        best = min(best, time.perf_counter() - t)
    return 2 * nbytes / best


def _prompt(engine: LLMEngine, n: int) -> list[int]:
    vocab = engine.model.cfg.vocab_size
    return torch.randint(100, vocab, (n,), generator=torch.Generator().manual_seed(n)).tolist()


def _run(engine: LLMEngine, ids: list[int], max_tokens: int) -> list[float]:
    """One request alone; the duration of each of its steps (the first is the prefill)."""
    engine.add_request(ids, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    times = []
    while engine.has_unfinished_requests():
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
    return times


def time_prefill(engine: LLMEngine, n: int, repeats: int = 3, record: list | None = None) -> float:
    """Prompt tokens per second for an n-token prompt (one step computes it whole; prefix cache bypassed), the
    median of `repeats` runs; `record` receives each run's seconds."""
    if engine.config.scheduler.max_num_batched_tokens < n:
        raise ValueError(f"a {n}-token prefill needs max_num_batched_tokens >= {n}")
    warm = _prompt(engine, n)
    warm[0] = 99                # a first block none of the timed prompts share (theirs start at 100 + r)
    _run(engine, warm, 1)       # untimed: what a prefill this long builds once (the int16 copy past 64 rows, ~250 ms)
    times = []
    for r in range(repeats):
        ids = _prompt(engine, n)
        ids[0] = 100 + r          # a new first block: nothing of it is in the prefix cache
        times.append(_run(engine, ids, 1)[0])
    if record is not None:
        record.extend(round(t, 6) for t in times)
    return n / statistics.median(times)


def time_decode(engine: LLMEngine, steps: int = 64) -> float:
    """Milliseconds per decode step of a single request (after a short prompt)."""
    prompt = _prompt(engine, 32)
    _run(engine, prompt, 4)  # warm-up
    return 1000 * statistics.mean(_run(engine, prompt, steps + 1)[1:])


@contextlib.contextmanager
def background_load(n: int) -> Iterator[None]:
    """n processes that each keep a core busy (a Python loop: CPU, next to no memory traffic) while the block
    runs: a laptop compiling, a shared CI machine. n = 0: nothing."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    try:
        if procs:
            time.sleep(0.5)                 # started and spinning before the timing starts
        yield
    finally:
        for p in procs:
            p.kill()
            p.wait()


def run_decode_bench(loaded, config: EngineConfig | None = None, prompt_lens=(128, 512),
                     decode_steps: int = 64) -> DecodeBench:
    return run_decode_benches([(loaded, config)], prompt_lens, decode_steps)[0][0]


def run_decode_benches(loads: list, prompt_lens=(128, 512), decode_steps: int = 64, rounds: int = 1,
                       llama_bench: tuple[str, int] | None = None,
                       progress=None, background: int = 0) -> tuple[list[DecodeBench], dict | None]:
    """One DecodeBench per (loaded model, config), and llama.cpp's decode speed when `llama_bench` = (binary,
    threads) is given. With rounds > 1 the decode timings of every model and llama-bench alternate round by round
    (a shared machine's speed drifts by tens of percent within minutes): each keeps its fastest round, and the
    per-round numbers are kept so a ratio can be taken within each round. With `background` > 0 every decode
    timing (llama-bench's too) is taken again right after it with that many busy processes beside it."""
    engines, results = [], []
    for loaded, config in loads:
        config = config if config is not None else EngineConfig()
        engine = LLMEngine(loaded.model, loaded.tokenizer, config)
        too_long = [n for n in prompt_lens if n >= engine.max_model_len]
        if too_long:
            raise ValueError(f"--prefill-lens {too_long} do not fit: a prompt must leave room for one generated token "
                             f"within {engine.max_model_len} positions (the model's context or the KV pool)")
        repeats = {n: [] for n in prompt_lens}
        engines.append((loaded, config, engine, {n: time_prefill(engine, n, record=repeats[n]) for n in prompt_lens},
                        repeats))
    rounds_ms: list[list[float]] = [[] for _ in engines]
    loaded_ms: list[list[float]] = [[] for _ in engines]
    steps_fused = [False] * len(engines)
    peer_rounds: list[dict] = []
    # the copy is timed before the rounds and after each one and the best kept: on a shared VM one copy's bandwidth
    # ranged 31-56 GB/s between runs minutes apart, which moved the ratio to the bound more than any change did
    device = engines[0][2].device if engines else "cpu"
    bw = measure_bandwidth(device=device)
    for r in range(rounds):
        for i, (_, _, engine, _, _) in enumerate(engines):
            fused_before = cpu_decode.FUSED_STEPS
            rounds_ms[i].append(time_decode(engine, decode_steps))
            if background:
                with background_load(background):
                    loaded_ms[i].append(time_decode(engine, decode_steps))
            steps_fused[i] = steps_fused[i] or cpu_decode.FUSED_STEPS > fused_before
        if llama_bench is not None:
            peer_rounds.append(run_llama_bench(llama_bench[0], loads[0][0].path, llama_bench[1], decode_steps))
            if background:
                with background_load(background):
                    peer_rounds[-1]["tg_tok_s_loaded"] = run_llama_bench(
                        llama_bench[0], loads[0][0].path, llama_bench[1], decode_steps)["tg_tok_s"]
        bw = max(bw, measure_bandwidth(device=device))
        if progress is not None:
            progress(r + 1, rounds)
    for (loaded, config, engine, prefill, prefill_repeats), ms, fused, lms in zip(engines, rounds_ms, steps_fused,
                                                                                 loaded_ms):
        wbytes = loaded.model.weight_bytes()
        bound_ms = 1000 * wbytes / bw
        best = min(ms)
        results.append(DecodeBench(model=str(loaded.path.name), path=str(loaded.path),
                                   quantization=f"{config.quantization}: {describe(loaded.model)}",
                                   dtype=str(loaded.model.dtype).removeprefix("torch."),
                                   threads=torch.get_num_threads(), prefill_tok_s=prefill, decode_ms_per_token=best,
                                   bandwidth_gb_s=bw / 1e9, weight_bytes_per_token=wbytes,
                                   bound_ms_per_token=bound_ms, ratio=best / bound_ms,
                                   decode_step="fused C" if fused else "layers", decode_ms_rounds=ms,
                                   prefill_s_repeats=prefill_repeats, loaded_ms_rounds=lms,
                                   background_load=background, device=str(engine.device)))
    peer = None
    if peer_rounds:
        peer = dict(peer_rounds[0])
        peer["tg_tok_s_rounds"] = [p["tg_tok_s"] for p in peer_rounds]
        peer["tg_tok_s"] = max(peer["tg_tok_s_rounds"])
        if background:
            peer["tg_tok_s_loaded_rounds"] = [p["tg_tok_s_loaded"] for p in peer_rounds]
            peer["slowdowns"] = [q / lo for q, lo in zip(peer["tg_tok_s_rounds"], peer["tg_tok_s_loaded_rounds"])]
        peer.pop("tg_tok_s_loaded", None)
    return results, peer


def speed_ratios(b: DecodeBench, peer: dict) -> tuple[float, float]:
    """minillm's decode tokens/s over llama.cpp's: (best round over best round, median of the per-round ratios)."""
    best = 1000 / b.decode_ms_per_token / peer["tg_tok_s"]
    per_round = [1000 / ms / tg for ms, tg in zip(b.decode_ms_rounds, peer.get("tg_tok_s_rounds", [peer["tg_tok_s"]]))]
    return best, statistics.median(per_round)


def format_background(runs: list[DecodeBench], llama_cpp: dict | None) -> list[str]:
    """The --background-load lines: each engine's slowdown (loaded / quiet time per token, median of the rounds)
    and minillm's over llama.cpp's."""
    if not runs or not runs[0].background_load:
        return []
    n = runs[0].background_load
    lines = [f"with {n} busy process{'es' if n > 1 else ''} beside it (--background-load {n}), ms/token loaded / "
             "quiet, back to back:"]
    for b in runs:
        lines.append(f"  minillm {b.quantization.split(':')[0]:10s}: {statistics.median(b.loaded_ms_rounds):8.2f} "
                     f"ms/token, {statistics.median(b.slowdowns):.2f}x its quiet time")
    if llama_cpp is not None and "slowdowns" in llama_cpp:
        peer = statistics.median(llama_cpp["slowdowns"])
        lines.append(f"  llama.cpp         : {1000 / statistics.median(llama_cpp['tg_tok_s_loaded_rounds']):8.2f} "
                     f"ms/token, {peer:.2f}x its quiet time")
        for b in runs:
            per_round = [m / p for m, p in zip(b.slowdowns, llama_cpp["slowdowns"])]
            lines.append(f"  minillm {b.quantization.split(':')[0]}'s slowdown / llama.cpp's: "
                         f"{statistics.median(per_round):.2f}x (median of {len(per_round)} round(s))")
    return lines


def format_decode_bench(b: DecodeBench) -> str:
    lines = [f"model {b.model}  dtype {b.dtype}  threads {b.threads}"]
    for n, v in b.prefill_tok_s.items():
        lines.append(f"prefill  {n:4d}-token prompt : {v:8.1f} tok/s")
    lines += [
        f"decode   batch 1           : {b.decode_ms_per_token:8.2f} ms/token ({1000 / b.decode_ms_per_token:.1f} tok/s)"
        f"  [{b.decode_step}]" + (f", best of {len(b.decode_ms_rounds)} rounds: "
                                  + ", ".join(f"{ms:.2f}" for ms in b.decode_ms_rounds)
                                  if len(b.decode_ms_rounds) > 1 else ""),
        f"memory bandwidth (copy)    : {b.bandwidth_gb_s:8.2f} GB/s",
        f"weight bytes per token     : {b.weight_bytes_per_token / 1e6:8.1f} MB",
        f"roofline bound             : {b.bound_ms_per_token:8.2f} ms/token  (weight bytes / bandwidth)",
        f"measured / bound           : {b.ratio:8.2f}x",
    ]
    return "\n".join(lines)


def format_decode_benches(runs: list[DecodeBench], llama_cpp: dict | None = None) -> str:
    """One run: its full report. Several (one per --quantization): a table, one row each, plus llama.cpp."""
    if len(runs) == 1 and llama_cpp is None:
        return format_decode_bench(runs[0])
    b0 = runs[0]
    lines = [f"model {b0.model}  threads {b0.threads}  memory bandwidth (copy) {b0.bandwidth_gb_s:.1f} GB/s",
             f"{'weights':34s} {'MB/token':>9s} {'bound ms':>9s} {'ms/token':>9s} {'tok/s':>7s} {'x bound':>8s}"
             f" {'step':>8s}"
             + "".join(f" {'prefill ' + str(n):>13s}" for n in b0.prefill_tok_s)]
    for b in runs:
        formats = b.quantization.split(" + ")[0]           # the kernel copies' memory gets a line of its own
        lines.append(f"{formats[:34]:34s} {b.weight_bytes_per_token / 1e6:9.1f} {b.bound_ms_per_token:9.2f} "
                     f"{b.decode_ms_per_token:9.2f} {1000 / b.decode_ms_per_token:7.1f} {b.ratio:8.2f}"
                     f" {b.decode_step:>8s}"
                     + "".join(f" {v:9.1f} tok/s" for v in b.prefill_tok_s.values()))
    lines += [f"{b.quantization.split(':')[0]}: memory beyond the weights: {b.quantization.split(' + ')[1]} (tiles for "
              f"steps of up to {cpu_qgemm.TILES_MAX_ROWS} rows, a copy for longer prefill steps)"
              for b in runs if " + " in b.quantization]
    if llama_cpp is not None:
        lines.append(f"{'llama.cpp (' + llama_cpp['name'] + ')':34s} {'':9s} {'':9s} "
                     f"{1000 / llama_cpp['tg_tok_s']:9.2f} {llama_cpp['tg_tok_s']:7.1f}")
        n = len(llama_cpp.get("tg_tok_s_rounds", [0]))
        for b in runs:
            best, median = speed_ratios(b, llama_cpp)
            lines.append(f"minillm {b.quantization.split(':')[0]} / llama.cpp decode tok/s: {best:.2f}x"
                         + (f" (best round of {n} each; median of the per-round ratios {median:.2f}x, rounds "
                            + ", ".join(f"{ms:.2f}/{1000 / tg:.2f}" for ms, tg in zip(b.decode_ms_rounds,
                                                                                  llama_cpp["tg_tok_s_rounds"]))
                            + " ms/token)" if n > 1 else ""))
    return "\n".join(lines)


def run_llama_bench(binary: str, gguf: str, threads: int, steps: int) -> dict:
    """llama.cpp's own decode speed on the same file and thread count (`llama-bench -p 0 -n steps`)."""
    import json
    import subprocess
    check_llama_bench(binary, gguf)
    done = subprocess.run([binary, "-m", str(gguf), "-t", str(threads), "-p", "0", "-n", str(steps), "-r", "3",
                           "-o", "json"], capture_output=True, text=True)
    if done.returncode != 0:
        raise ValueError(f"llama-bench failed (exit {done.returncode}): {done.stderr.strip()[-300:]}")
    rows = [r for r in json.loads(done.stdout) if r.get("n_gen", 0) > 0]
    if not rows:
        raise ValueError("llama-bench printed no decode (tg) result")
    return {"name": ", ".join(x for x in (f"tg{steps}", rows[0].get("model_type", "")) if x),
            "tg_tok_s": float(rows[0]["avg_ts"]), "threads": threads}


def as_dict(b: DecodeBench) -> dict:
    return asdict(b)

