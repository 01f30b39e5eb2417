"""A loaded model's weights back under the checkpoint's names (q/k/v and gate/up split apart), so a whole model
can be re-sharded for tensor or pipeline parallelism (tests, the lab, the bench)."""
from __future__ import annotations

from typing import Iterator

import torch

from minillm.models.llama import LlamaModel


def hf_state(model: LlamaModel) -> Iterator[tuple[str, torch.Tensor]]:
    """(Hugging Face name, tensor) for every weight of an unsharded model."""
    cfg = model.cfg
    for name, p in model.state_dict().items():
        if name.startswith("rotary"):
            continue
        if name.endswith("qkv_proj.weight"):
            q, k, v = p.split([cfg.q_size, cfg.kv_size, cfg.kv_size])
            for part, t in (("q", q), ("k", k), ("v", v)):
                yield "model." + name.replace("qkv_proj", f"{part}_proj"), t
        elif name.endswith("gate_up_proj.weight"):
            g, u = p.chunk(2)
            yield "model." + name.replace("gate_up_proj", "gate_proj"), g
            yield "model." + name.replace("gate_up_proj", "up_proj"), u
        elif name.startswith("lm_head"):
            yield name, p
        else:
            yield "model." + name, p
