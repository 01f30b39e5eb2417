"""`minillm demo` (and `make demo`): streaming chat answers, a batch through the engine, the roofline."""
from __future__ import annotations

import random
import time

import torch
from tqdm.auto import tqdm

from minillm.bench.decode import format_decode_bench, run_decode_bench
from minillm.bench.throughput import percentile
from minillm.cli_args import engine_config
from minillm.engine.llm_engine import LLMEngine
from minillm.engine.prompt import build_prompt_ids
from minillm.loading import loader
from minillm.quant.policy import describe
from minillm.sampling.params import SamplingParams

STREAMED = ["What is the capital of France?", "Give me two tips for learning to cook."]
BATCH = ["What is the capital of France?", "Write a haiku about autumn leaves.", "What is a black hole?",
         "Explain photosynthesis to a child.", "Name three programming languages and what they are used for.",
         "How do I make a cup of tea?", "What are the benefits of regular exercise?", "Tell me a short joke.",
         "Why do cats purr?", "Summarize the plot of Cinderella in three sentences.", "What is machine learning?",
         "Translate 'good morning' into French and Spanish.", "How does a bicycle stay upright?",
         "Give me a recipe idea for dinner using rice and beans.", "What causes the seasons on Earth?",
         "Write a two-line poem about the sea.", "What is the difference between weather and climate?",
         "How many continents are there? Name them.", "What should I pack for a weekend hiking trip?",
         "Describe the water cycle.", "What is an API, in simple words?", "Suggest a name for a bakery.",
         "Why is sleep important?", "What is the tallest mountain in the world?"]


def _rule(title: str) -> None:
    print(f"\n=== {title} " + "=" * max(0, 66 - len(title)))


def run_demo(args) -> int:
    if getattr(args, "threads", None):
        torch.set_num_threads(args.threads)
    t = time.perf_counter()
    config = engine_config(args)
    loaded = loader.load_model(args.model, config.dtype, quantization=config.quantization,
                        group_size=config.quantization_group_size)
    cfg = loaded.config
    print(f"loaded {loaded.path.name}: {cfg.num_layers} layers, {cfg.num_heads} heads / {cfg.num_kv_heads} KV heads, "
          f"{cfg.num_params() / 1e6:.0f}M parameters, {config.dtype} activations, weights {describe(loaded.model)}, "
          f"in {time.perf_counter() - t:.1f} s")
    engine = LLMEngine(loaded.model, loaded.tokenizer, engine_config(args))

    _rule("streaming chat (continuous-batching engine, greedy)")
    for q in STREAMED:
        print(f"user> {q}\nassistant> ", end="", flush=True)
        engine.add_request(build_prompt_ids(loaded.tokenizer, q), SamplingParams(temperature=0, max_tokens=60))
        while engine.has_unfinished_requests():
            for out in engine.step():
                print(out.delta_text, end="", flush=True)
        print()

    _rule(f"a batch of {len(BATCH)} mixed chat prompts")
    rng = random.Random(0)
    t0 = time.perf_counter()
    for i, q in enumerate(BATCH):
        # the first one greedy: it is the sample shown below (a sampled answer from a 135M model can be nonsense)
        params = (SamplingParams(temperature=0, max_tokens=64) if i == 0 else
                  SamplingParams(temperature=0.7, top_p=0.95, seed=rng.randrange(2**31), max_tokens=rng.randint(24, 96)))
        engine.add_request(build_prompt_ids(loaded.tokenizer, q), params, request_id=f"batch-{i}", arrival_time=t0)
    outs, tokens, peak_blocks = [], 0, 0
    with tqdm(total=len(BATCH), unit="req", desc="batch", dynamic_ncols=True) as bar:
        while engine.has_unfinished_requests():
            for o in engine.step():
                tokens += len(o.delta_token_ids)
                if o.finished:
                    outs.append(o)
            peak_blocks = max(peak_blocks, engine.block_manager.num_used_blocks)
            bar.set_postfix(tok_s=f"{tokens / (time.perf_counter() - t0):.0f}", running=len(engine.scheduler.running),
                            refresh=False)
            bar.update(len(outs) - bar.n)           # after the rate: the redraw shows this step's
    elapsed = time.perf_counter() - t0
    ttft = [o.metrics.ttft for o in outs]
    tpot = [o.metrics.tpot for o in outs if o.metrics.tpot is not None]
    u = engine.kv_usage()
    sample = next(o for o in outs if o.request_id == "batch-0")
    print(f'sample answer (greedy) to "{BATCH[0]}": "{sample.text.strip()[:160]}"')
    print(f"throughput     {tokens / elapsed:.1f} output tok/s ({tokens} tokens in {elapsed:.1f} s)")
    together = percentile(ttft, 50) == percentile(ttft, 99)
    print("TTFT  p50/p90/p99  " + " / ".join(f"{percentile(ttft, q):.2f}" for q in (50, 90, 99)) + " s"
          + (f"   (all {len(outs)} arrived at once and were prefilled in the same step: one TTFT)" if together
             else ""))
    print("TPOT  p50/p90/p99  " + " / ".join(f"{1000 * percentile(tpot, q):.0f}" for q in (50, 90, 99)) + " ms")
    print(f"KV pool        {u['num_blocks']} blocks x {u['block_size']} tokens = {u['tokens_capacity']} tokens "
          f"({u['bytes_capacity'] / 2**20:.0f} MiB); peak use {peak_blocks} blocks "
          f"({100 * peak_blocks / u['num_blocks']:.1f}%)")
    s = u["prefix_cache"]
    print(f"prefix cache   {s.hits} block hits / {s.hits + s.misses} lookups (hit rate {100 * s.hit_rate:.0f}%: "
          "every chat shares the template's system prompt)")

    _rule("speed vs the memory-bandwidth roofline (batch 1)")
    print(format_decode_bench(run_decode_bench(loaded, prompt_lens=(128, 512), decode_steps=32)))
    print("\nnext: `minillm bench throughput`, `minillm chat`, `make lab`")
    return 0
