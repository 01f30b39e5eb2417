"""`minillm bench prefix`: time to first token with and without prefix caching.

Three chat patterns: (1) independent first turns that all carry the template's default system prompt,
(2) the same questions under a long (~200-token) system prompt, (3) a multi-turn conversation whose every turn
resends the whole history. Requests run one at a time, so TTFT is the prefill itself; with caching on, the shared
full blocks are not recomputed."""
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
LONG_SYSTEM = ("You are the support assistant of a small bookshop in Porto. Answer in one or two friendly sentences. "
               "The shop opens from ten in the morning to seven in the evening, Monday to Saturday, and is closed on "
               "Sundays and public holidays. It sells new and second-hand books in Portuguese, English, French and "
               "Spanish, with a children's corner and a shelf of local history. Orders can be collected in the shop "
               "or sent by post within Portugal in two to four working days; postage is free above thirty euros. "
               "Returns are accepted within fourteen days with the receipt. The café at the back serves coffee, tea "
               "and pastries until six. Readings by local authors take place on the first Thursday of each month at "
               "six thirty; places are free but limited, so customers should book by email. Never invent prices: "
               "say that staff will confirm them.")
PATTERNS = ("system_prompt", "long_system_prompt", "multi_turn")


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


def prefix_bench(model, tokenizer, config: EngineConfig | None = None, repeats: int = 2,
                 progress: bool = False) -> dict:
    from tqdm.auto import tqdm
    config = config if config is not None else EngineConfig()
    first_turns = [build_prompt_ids(tokenizer, q) for q in QUESTIONS]
    long_system = [build_prompt_ids(tokenizer, q, system=LONG_SYSTEM) for q in QUESTIONS]
    history, conversation = [], []
    for turn in TURNS:
        history.append({"role": "user", "content": turn})
        conversation.append(build_prompt_ids(tokenizer, list(history)))
        history.append({"role": "assistant", "content": REPLY})
    result = {"block_size": config.cache.block_size, "repeats": {}}
    cases = (("system_prompt", first_turns), ("long_system_prompt", long_system), ("multi_turn", conversation))
    bar = tqdm(total=len(cases) * 2 * repeats, desc="bench prefix", unit="run", disable=not progress,
               dynamic_ncols=True)
    for name, prompts in cases:
        times = {}
        for caching in (False, True):
            best, runs = None, []
            for _ in range(repeats):
                e = _engine(model, tokenizer, config, caching)
                ts = [_ttft(e, p) for p in prompts]
                runs.append(round(1000 * statistics.mean(ts[1:] or ts), 3))
                best = ts if best is None else [min(a, b) for a, b in zip(best, ts)]
                bar.update(1)
            times[caching] = best
            result["repeats"][f"{name} TTFT ms, caching {'on' if caching else 'off'}"] = runs
            if caching:
                result[f"{name}_hit_rate"] = round(e.block_manager.stats.hit_rate, 3)
        # the first request can only miss: compare the ones that could hit
        off, on = statistics.mean(times[False][1:]), statistics.mean(times[True][1:])
        result[f"{name}_prompt_tokens_mean"] = round(statistics.mean(len(p) for p in prompts), 1)
        result[f"{name}_ttft_off_ms"] = round(1000 * off, 2)
        result[f"{name}_ttft_on_ms"] = round(1000 * on, 2)
        result[f"{name}_ttft_ratio"] = round(off / on, 2)
    bar.close()
    return result


def format_prefix(r: dict) -> str:
    lines = [f"time to first token, requests one at a time, block size {r['block_size']} (mean over the requests "
             "that could hit; each configuration's best of its runs)",
             f"{'pattern':22s} {'prompt tokens':>13s} {'TTFT off ms':>12s} {'TTFT on ms':>11s} {'speedup':>8s} "
             f"{'hit rate':>9s}"]
    for name in PATTERNS:
        lines.append(f"{name.replace('_', ' '):22s} {r[f'{name}_prompt_tokens_mean']:13.1f} "
                     f"{r[f'{name}_ttft_off_ms']:12.1f} {r[f'{name}_ttft_on_ms']:11.1f} "
                     f"{r[f'{name}_ttft_ratio']:7.2f}x {100 * r[f'{name}_hit_rate']:8.0f}%")
    return "\n".join(lines)
