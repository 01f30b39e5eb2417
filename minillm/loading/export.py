"""A loaded model's weights back under the checkpoint's names (q/k/v and gate/up split apart), so a whole model
can be re-sharded for tensor or pipeline parallelism (tests, the lab, the bench)."""
from __future__ import annotations

from typing import Any, Iterator

import torch

from minillm.config import ModelConfig
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


def hf_config(cfg: ModelConfig, eos_token_id: int | list[int] | None = None) -> dict[str, Any]:
    """The config.json of a Hugging Face Llama directory holding this model."""
    out = {
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim, "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta, "max_position_embeddings": cfg.max_position_embeddings,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "eos_token_id": cfg.eos_token_id if eos_token_id is None else eos_token_id,
        "bos_token_id": cfg.bos_token_id}
    if cfg.rope_scaling is not None:
        out["rope_scaling"] = dict(cfg.rope_scaling)
    return out
