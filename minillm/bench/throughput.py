"""`minillm bench throughput`: continuous batching (minillm) vs padded static batches (transformers.generate).

Same weights, same dtype, greedy, EOS ignored so every request produces exactly its drawn number of tokens.
Static batching pays twice: prompts are left-padded to the longest in the batch, and every row keeps
decoding until the longest output in its batch is done. Only the requested tokens count as output."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm

from minillm.bench.workload import Request
from minillm.config import EngineConfig
from minillm.engine.llm_engine import LLMEngine
from minillm.loading.export import hf_config, hf_state
from minillm.loading import loader
from minillm.sampling.params import SamplingParams


def percentile(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    k = (len(s) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


@dataclass
class EngineRun:
    output_tokens: int
    elapsed_s: float
    ttft_s: list[float] = field(default_factory=list)
    tpot_s: list[float] = field(default_factory=list)
    peak_running: int = 0
    peak_kv_blocks: int = 0
    num_preemptions: int = 0
    num_steps: int = 0
    attention: str = ""         # the attention backend (and CPU kernel build) that ran

    @property
    def tok_s(self) -> float:
        return self.output_tokens / self.elapsed_s

    def summary(self) -> dict:
        return {"output_tokens": self.output_tokens, "elapsed_s": round(self.elapsed_s, 3),
                "tok_s": round(self.tok_s, 2), "ttft_p50_s": percentile(self.ttft_s, 50),
                "ttft_p99_s": percentile(self.ttft_s, 99), "tpot_p50_s": percentile(self.tpot_s, 50),
                "tpot_p99_s": percentile(self.tpot_s, 99), "peak_running": self.peak_running,
                "peak_kv_blocks": self.peak_kv_blocks, "num_preemptions": self.num_preemptions,
                "num_steps": self.num_steps, "attention": self.attention}


def run_minillm(model, tokenizer, workload: list[Request], *, config: EngineConfig | None = None,
                progress: bool = True, **settings) -> EngineRun:
    """The workload through minillm's engine, all requests arriving at once. `config`, or engine settings."""
    engine = LLMEngine(model, tokenizer, config if config is not None else EngineConfig.from_kwargs(**settings))
    engine.warm_up()
    t0 = time.perf_counter()
    for r in workload:
        engine.add_request(r.prompt_token_ids, SamplingParams(temperature=0, max_tokens=r.max_tokens, ignore_eos=True),
                           arrival_time=t0)
    run = EngineRun(0, 0.0)
    bar = tqdm(total=len(workload), desc="minillm", unit="req", disable=not progress, leave=False)
    bm = engine.block_manager
    while engine.has_unfinished_requests():
        for out in engine.step():
            run.output_tokens += len(out.delta_token_ids)
            if out.finished:
                bar.update(1)
                run.ttft_s.append(out.metrics.ttft)
                if out.metrics.tpot is not None:
                    run.tpot_s.append(out.metrics.tpot)
                run.num_preemptions += out.metrics.num_preemptions
        run.peak_running = max(run.peak_running, len(engine.scheduler.running))
        run.peak_kv_blocks = max(run.peak_kv_blocks, bm.num_used_blocks)
    bar.close()
    run.elapsed_s = time.perf_counter() - t0
    run.num_steps = engine.num_steps
    kernel = getattr(engine.backend, "kernel", None)
    run.attention = engine.backend.name + (f" ({kernel} kernel)" if kernel else "")
    return run


def load_hf_peer(loaded) -> torch.nn.Module:
    """transformers' own Llama on the same weights as `loaded` (a LoadedModel), in its dtype.

    A Hugging Face directory loads as transformers loads it. A GGUF file's weights come from minillm's loader,
    dequantized to float (test_smollm checks they equal transformers' own GGUF import): transformers' GGUF path
    takes ~30 s for SmolLM2 here (it parses the vocabulary twice and maps names per tensor), minillm's ~1 s; the
    peer's speed is its model code's, wherever the numbers came from."""
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    dtype = loaded.model.dtype
    if loaded.path.is_dir():
        return AutoModelForCausalLM.from_pretrained(loaded.path, dtype=dtype).eval()
    model = loaded.model
    if any(m.quant is not None for _, m in model.quantizable()):
        model = loader.load_model(loaded.path, dtype, quantization="none").model
    hf = LlamaForCausalLM(LlamaConfig(**hf_config(model.cfg)))
    state = dict(hf_state(model))
    if model.cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    missing, unexpected = hf.load_state_dict(state, strict=False)
    if unexpected or set(missing) - {"lm_head.weight"}:
        raise RuntimeError(f"transformers' Llama and minillm's weights differ: missing {missing}, unexpected "
                           f"{unexpected}")
    hf.tie_weights()
    return hf.to(dtype).eval()


@torch.inference_mode()
def run_transformers_static(hf_model, workload: list[Request], batch_size: int, pad_token_id: int,
                            progress: bool = True) -> EngineRun:
    """Arrival-order static batches: left-pad prompts, decode until the batch's longest output is done."""
    hf_model.generate(torch.tensor([[5] * 8]), max_new_tokens=2, do_sample=False, pad_token_id=pad_token_id)  # warm-up
    run = EngineRun(0, 0.0)
    t0 = time.perf_counter()
    batches = [workload[i:i + batch_size] for i in range(0, len(workload), batch_size)]
    for batch in tqdm(batches, desc=f"transformers bs={batch_size}", disable=not progress, leave=False):
        width = max(len(r.prompt_token_ids) for r in batch)
        ids = torch.full((len(batch), width), pad_token_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, r in enumerate(batch):
            ids[i, width - len(r.prompt_token_ids):] = torch.tensor(r.prompt_token_ids)
            mask[i, width - len(r.prompt_token_ids):] = 1
        new = max(r.max_tokens for r in batch)
        hf_model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                          do_sample=False, pad_token_id=pad_token_id)
        run.output_tokens += sum(r.max_tokens for r in batch)   # only what was asked for counts
    run.elapsed_s = time.perf_counter() - t0
    return run


def throughput_plot(result: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    names = ["minillm\n(continuous)"] + [f"transformers\nstatic bs={b}" for b in result["baseline_by_batch_size"]]
    values = [result["minillm_tok_s"]] + list(result["baseline_by_batch_size"].values())
    fig, ax = plt.subplots(figsize=(7, 4))
    bars = ax.bar(names, values, color=["tab:green"] + ["tab:gray"] * (len(values) - 1))
    ax.bar_label(bars, fmt="%.0f")
    ax.set_ylabel("output tokens / s")
    w = result["workload"]
    ax.set_title(f"{w['num_requests']} requests, prompts {w['min_prompt']}-{w['max_prompt']}, "
                 f"outputs {w['min_output']}-{w['max_output']} ({result['dtype']}); ratio {result['ratio']:.2f}x")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
