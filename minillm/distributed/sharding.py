"""Which tensor-parallel sizes a model allows, and which heads each rank owns.

Tensor parallelism splits attention by heads and the MLP by its intermediate columns, so:
  * the query heads must divide evenly: num_heads % tp == 0;
  * a rank's query heads must find their KV heads on the same rank: either the KV heads divide evenly too
    (kv_heads % tp == 0: each rank owns kv_heads / tp of them with their query groups) or there are fewer KV heads
    than ranks and each is replicated on tp / kv_heads ranks (tp % kv_heads == 0), as production engines do;
  * the MLP's intermediate size must divide evenly: intermediate_size % tp == 0.
The vocabulary need not divide: each rank holds ceil(vocab / tp) rows and the last one is padded.
"""
from __future__ import annotations

from minillm.config import ModelConfig


def tp_problems(cfg: ModelConfig, tp: int) -> list[str]:
    """Why `tp` cannot shard `cfg` (empty when it can)."""
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        return [f"tensor_parallel_size must be a positive integer, got {tp!r}"]
    problems = []
    if cfg.num_heads % tp:
        problems.append(f"{cfg.num_heads} query heads do not split into {tp} equal parts")
    if cfg.num_kv_heads % tp and tp % cfg.num_kv_heads:
        problems.append(f"{cfg.num_kv_heads} KV heads neither split into {tp} equal parts nor replicate evenly "
                        f"over {tp} ranks")
    if cfg.intermediate_size % tp:
        problems.append(f"the MLP's {cfg.intermediate_size} intermediate columns do not split into {tp} equal parts")
    return problems


def valid_tp_sizes(cfg: ModelConfig, up_to: int = 16) -> list[int]:
    return [n for n in range(1, up_to + 1) if not tp_problems(cfg, n)]


def check_tp_size(cfg: ModelConfig, tp: int) -> None:
    """Raise before any process starts if `tp` cannot shard the model, listing the sizes that can."""
    problems = tp_problems(cfg, tp)
    if problems:
        raise ValueError(f"tensor_parallel_size={tp} cannot shard {cfg.name} ({cfg.num_heads} heads, "
                         f"{cfg.num_kv_heads} KV heads, intermediate {cfg.intermediate_size}): "
                         f"{'; '.join(problems)}. Valid sizes: {', '.join(map(str, valid_tp_sizes(cfg)))}")


def check_pp_size(cfg: ModelConfig, pp: int) -> None:
    if isinstance(pp, bool) or not isinstance(pp, int) or pp < 1:
        raise ValueError(f"pipeline_parallel_size must be a positive integer, got {pp!r}")
    if pp > cfg.num_layers:
        raise ValueError(f"pipeline_parallel_size={pp} is more stages than {cfg.name}'s {cfg.num_layers} layers: "
                         f"use at most {cfg.num_layers}")


def local_heads(cfg: ModelConfig, tp: int) -> tuple[int, int]:
    """(query heads, KV heads) one rank holds."""
    return cfg.num_heads // tp, max(1, cfg.num_kv_heads // tp)


def stage_layers(num_layers: int, pp: int, stage: int) -> range:
    """Layers of pipeline stage `stage`: contiguous, the first stages take one more when they do not divide."""
    base, extra = divmod(num_layers, pp)
    start = stage * base + min(stage, extra)
    return range(start, start + base + (1 if stage < extra else 0))


def shard_config(cfg: ModelConfig, tp: int, num_layers: int | None = None) -> ModelConfig:
    """The per-rank view the attention backend and the KV pool see: local heads (and a stage's layer count)."""
    import dataclasses
    heads, kv_heads = local_heads(cfg, tp)
    return dataclasses.replace(cfg, num_heads=heads, num_kv_heads=kv_heads,
                               intermediate_size=cfg.intermediate_size // tp,
                               num_layers=cfg.num_layers if num_layers is None else num_layers)
