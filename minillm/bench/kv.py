"""`minillm bench kv`: how much reserved KV memory holds real tokens, paged vs contiguous reservation.

Memory accounting does not depend on token values, so this replays the workload through the real Scheduler
and BlockManager with a stub in place of the forward pass (every step "computes" what was scheduled and
samples token 0). Contiguous serving reserves max_model_len slots per running sequence up front."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from minillm.bench.workload import Request
from minillm.config import ModelConfig, SchedulerConfig
from minillm.engine.scheduler import Scheduler
from minillm.engine.sequence import Sequence
from minillm.engine.stream import TextStream
from minillm.kv.cache import KVCache
from minillm.kv.block_manager import BlockManager
from minillm.sampling.params import SamplingParams


@dataclass
class KVReplay:
    peak_running: int
    reserved_slot_steps: int     # sum over steps of slots held by block tables
    used_slot_steps: int         # sum over steps of slots holding computed KV
    running_steps: int           # sum over steps of running sequences
    steps: int

    @property
    def waste_frac(self) -> float:
        return 1 - self.used_slot_steps / max(self.reserved_slot_steps, 1)


def replay(workload: list[Request], num_blocks: int, block_size: int, max_num_seqs: int = 1024,
           max_num_batched_tokens: int = 4096) -> KVReplay:
    longest = max(len(r.prompt_token_ids) + r.max_tokens for r in workload)
    if longest > num_blocks * block_size:
        raise ValueError(f"a KV pool of {num_blocks * block_size} tokens cannot hold the workload's longest request "
                         f"({longest} tokens): raise the budget")
    bm = BlockManager(num_blocks, block_size, enable_prefix_caching=False)
    sched = Scheduler(SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens), bm)
    for i, r in enumerate(workload):
        p = SamplingParams(temperature=0, max_tokens=r.max_tokens, ignore_eos=True)
        sched.add(Sequence(str(i), r.prompt_token_ids, p, TextStream(None, p, set()), None, 0.0))
    out = KVReplay(0, 0, 0, 0, 0)
    while sched.has_unfinished():
        step = sched.schedule()
        if step.is_empty:
            raise RuntimeError("KV pool too small for the longest request in the workload")
        for seq, n in step.scheduled:
            seq.num_computed_tokens += n
            if seq.num_computed_tokens == seq.num_tokens:
                seq.token_ids.append(0)
                if len(seq.output_token_ids) >= seq.params.max_tokens:
                    sched.finish(seq)
        out.steps += 1
        out.peak_running = max(out.peak_running, len(sched.running))
        out.running_steps += len(sched.running)
        out.reserved_slot_steps += sum(len(bm.block_table(s.seq_id)) for s in sched.running) * block_size
        out.used_slot_steps += sum(s.num_computed_tokens for s in sched.running)
    return out


POOL_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "int8": torch.int8}


def pool_tokens_per_gib(cfg: ModelConfig) -> dict[str, int]:
    """Tokens one GiB of KV pool holds per stored dtype, from the pool's own accounting (int8 counts its scales)."""
    return {name: 2**30 // KVCache.bytes_per_token(cfg, dtype) for name, dtype in POOL_DTYPES.items()}


def kv_bench(workload: list[Request], *, budget_tokens: int, block_size: int, max_model_len: int,
             bytes_per_token: int) -> dict:
    paged = replay(workload, budget_tokens // block_size, block_size)
    contiguous_concurrency = budget_tokens // max_model_len
    # Same trajectory, contiguous reservation: each running sequence holds max_model_len slots.
    contiguous_reserved = paged.running_steps * max_model_len
    contiguous_waste = 1 - paged.used_slot_steps / max(contiguous_reserved, 1)
    return {
        "budget_tokens": budget_tokens, "budget_bytes": budget_tokens * bytes_per_token,
        "block_size": block_size, "max_model_len": max_model_len,
        "paged_waste_frac": round(paged.waste_frac, 4),
        "contiguous_waste_frac": round(contiguous_waste, 4),
        "paged_max_concurrency": paged.peak_running,
        "contiguous_max_concurrency": contiguous_concurrency,
        "concurrency_ratio": round(paged.peak_running / max(contiguous_concurrency, 1), 2),
        "num_requests": len(workload),
        # every request ran at once: the pool may hold more, so the paged count (and the ratio) is a lower bound
        "capped_by_num_requests": paged.peak_running >= len(workload),
        "paged_wasted_bytes_avg": int((paged.reserved_slot_steps - paged.used_slot_steps) / max(paged.steps, 1)
                                      * bytes_per_token),
        "contiguous_wasted_bytes_avg": int((contiguous_reserved - paged.used_slot_steps) / max(paged.steps, 1)
                                           * bytes_per_token),
    }


def concurrency_cap_warning(result: dict) -> str | None:
    """One line when the paged concurrency (and so the ratio) was capped by the workload's size, not by the budget:
    all --num-requests requests ran at once, so the pool's real limit was never reached."""
    if not result.get("capped_by_num_requests"):
        return None
    n = result["num_requests"]
    return (f"the concurrency ratio {result['concurrency_ratio']:.1f}x is capped by --num-requests {n}: the paged "
            f"pool ran all {n} requests at once, so its limit under the {result['budget_tokens']}-token budget was "
            f"never reached (a lower bound); raise --num-requests (e.g. {2 * n}) to measure it")
