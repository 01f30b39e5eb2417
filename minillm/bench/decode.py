"""`minillm bench decode`: prefill speed, batch-1 decode speed, and the memory-bandwidth roofline.

At batch 1 every decode step must stream all weights from memory once, so
    decode time per token >= weight bytes per token / memory bandwidth.
We measure the bandwidth with a large tensor copy and print the measured time next to that bound."""
from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass

import torch

from minillm.engine.simple import SimpleGenerator
from minillm.sampling.params import SamplingParams


@dataclass
class DecodeBench:
    model: str
    dtype: str
    threads: int
    prefill_tok_s: dict[int, float]
    decode_ms_per_token: float
    bandwidth_gb_s: float
    weight_bytes_per_token: int
    bound_ms_per_token: float
    ratio: float  # measured / bound: 1.0 would be perfectly bandwidth-bound


def measure_bandwidth(nbytes: int = 512 * 2**20, repeats: int = 5) -> float:
    """Bytes moved per second by a large copy (read + write) — the ceiling a decode step streams weights at."""
    src = torch.empty(nbytes // 4, dtype=torch.float32).fill_(1.0)
    dst = torch.empty_like(src)
    dst.copy_(src)  # warm up: fault the pages in
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t)
    return 2 * nbytes / best


def time_prefill(gen: SimpleGenerator, n: int, repeats: int = 3) -> float:
    vocab = gen.model.cfg.vocab_size
    ids = torch.randint(100, vocab, (n,), generator=torch.Generator().manual_seed(n)).tolist()
    gen.forward_logits(gen.new_cache(n), ids[:16], 0)  # warm-up
    times = []
    for _ in range(repeats):
        cache = gen.new_cache(n)
        t = time.perf_counter()
        gen.forward_logits(cache, ids, 0)
        times.append(time.perf_counter() - t)
    return n / statistics.median(times)


def time_decode(gen: SimpleGenerator, steps: int = 64) -> float:
    params = SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True)
    prompt = gen.tokenizer.encode("The history of the printing press")
    for _ in gen.stream_ids(prompt, SamplingParams(temperature=0, max_tokens=4)):
        pass  # warm-up
    for _ in gen.stream_ids(prompt, params):
        pass
    t = gen.last_timing
    return 1000 * t["decode_s"] / t["decode_steps"]


def run_decode_bench(loaded, prompt_lens=(128, 512), decode_steps: int = 64) -> DecodeBench:
    gen = SimpleGenerator(loaded.model, loaded.tokenizer)
    prefill = {n: time_prefill(gen, n) for n in prompt_lens}
    decode_ms = time_decode(gen, decode_steps)
    bw = measure_bandwidth()
    wbytes = loaded.model.weight_bytes()
    bound_ms = 1000 * wbytes / bw
    return DecodeBench(model=str(loaded.path.name), dtype=str(loaded.model.dtype).removeprefix("torch."),
                       threads=torch.get_num_threads(), prefill_tok_s=prefill, decode_ms_per_token=decode_ms,
                       bandwidth_gb_s=bw / 1e9, weight_bytes_per_token=wbytes, bound_ms_per_token=bound_ms,
                       ratio=decode_ms / bound_ms)


def format_decode_bench(b: DecodeBench) -> str:
    lines = [f"model {b.model}  dtype {b.dtype}  threads {b.threads}"]
    for n, v in b.prefill_tok_s.items():
        lines.append(f"prefill  {n:4d}-token prompt : {v:8.1f} tok/s")
    lines += [
        f"decode   batch 1           : {b.decode_ms_per_token:8.2f} ms/token ({1000 / b.decode_ms_per_token:.1f} tok/s)",
        f"memory bandwidth (copy)    : {b.bandwidth_gb_s:8.2f} GB/s",
        f"weight bytes per token     : {b.weight_bytes_per_token / 1e6:8.1f} MB",
        f"roofline bound             : {b.bound_ms_per_token:8.2f} ms/token  (weight bytes / bandwidth)",
        f"measured / bound           : {b.ratio:8.2f}x",
    ]
    return "\n".join(lines)


def as_dict(b: DecodeBench) -> dict:
    return asdict(b)
