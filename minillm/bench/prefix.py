"""`minillm bench prefix`: time to first token with and without prefix caching.

Two chat patterns: (1) independent first turns that all carry the template's default system prompt,
(2) a multi-turn conversation whose every turn resends the whole history. Requests run one at a time, so
TTFT is the prefill itself; with caching on, the shared full blocks are not recomputed."""
from __future__ import annotations

import statistics
import time

from minillm.config import EngineConfig
from minillm.engine.llm_engine import LLMEngine
from minillm.engine.prompt import build_prompt_ids
from minillm.sampling.params import SamplingParams

QUESTIONS = ["What is the capital of France?", "How do plants make food?", "Name three primary colors.",
             "What is a prime number?", "Why is the sky blue?", "How many legs does a spider have?",
             "What does a thermometer measure?", "Give me a synonym for happy.", "What is 12 times 12?",
             "Who wrote Romeo and Juliet?", "What is the boiling point of water?", "Describe a cat in one line."]
TURNS = ["Hi! I am planning a trip to Lisbon.", "What should I see on the first day?",
         "And where can I eat good seafood?", "How do I get from the airport to the centre?",
         "Is it better to stay in Alfama or Baixa?", "Thanks! Any tips for a day trip?"]
REPLY = "Here is a short answer with a few practical suggestions for you to consider."


def _ttft(engine: LLMEngine, ids: list[int]) -> float:
    t = time.perf_counter()
    engine.add_request(ids, SamplingParams(temperature=0, max_tokens=1), arrival_time=t)
    while engine.has_unfinished_requests():
        engine.step()
    return time.perf_counter() - t


def _engine(model, tokenizer, config: EngineConfig, caching: bool) -> LLMEngine:
    e = LLMEngine(model, tokenizer, config.replace(enable_prefix_caching=caching))
    _ttft(e, [5] * 32)               # warm-up, then forget it
    e.block_manager.reset_prefix_cache()
    return e


def prefix_bench(model, tokenizer, config: EngineConfig | None = None, repeats: int = 2) -> dict:
    config = config if config is not None else EngineConfig()
    first_turns = [build_prompt_ids(tokenizer, q) for q in QUESTIONS]
    history, conversation = [], []
    for turn in TURNS:
        history.append({"role": "user", "content": turn})
        conversation.append(build_prompt_ids(tokenizer, list(history)))
        history.append({"role": "assistant", "content": REPLY})
    result = {"block_size": config.cache.block_size}
    for name, prompts in (("system_prompt", first_turns), ("multi_turn", conversation)):
        times = {}
        for caching in (False, True):
            best = None
            for _ in range(repeats):
                e = _engine(model, tokenizer, config, caching)
                ts = [_ttft(e, p) for p in prompts]
                best = ts if best is None else [min(a, b) for a, b in zip(best, ts)]
            times[caching] = best
            if caching:
                result[f"{name}_hit_rate"] = round(e.block_manager.stats.hit_rate, 3)
        # the first request can only miss: compare the ones that could hit
        off, on = statistics.mean(times[False][1:]), statistics.mean(times[True][1:])
        result[f"{name}_prompt_tokens_mean"] = round(statistics.mean(len(p) for p in prompts), 1)
        result[f"{name}_ttft_off_ms"] = round(1000 * off, 2)
        result[f"{name}_ttft_on_ms"] = round(1000 * on, 2)
        result[f"{name}_ttft_ratio"] = round(off / on, 2)
    return result
