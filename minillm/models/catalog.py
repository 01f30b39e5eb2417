"""Shapes of well-known public models, for sizing arithmetic (KV bytes, weight bytes).

Only the numbers that sizing needs; none of these models is loadable from here.
Figures are from each model's published config.json.
"""
from __future__ import annotations

from minillm.config import ModelConfig


def _cfg(name: str, vocab: int, hidden: int, inter: int, layers: int, heads: int, kv_heads: int,
         head_dim: int | None = None, tied: bool = False) -> ModelConfig:
    return ModelConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_layers=layers,
                       num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim or hidden // heads,
                       tie_word_embeddings=tied, name=name)


KNOWN_MODELS: dict[str, ModelConfig] = {c.name: c for c in [
    _cfg("smollm2-135m", 49152, 576, 1536, 30, 9, 3, tied=True),
    _cfg("smollm2-360m", 49152, 960, 2560, 32, 15, 5, tied=True),
    _cfg("llama-2-7b", 32000, 4096, 11008, 32, 32, 32),
    _cfg("llama-2-13b", 32000, 5120, 13824, 40, 40, 40),
    _cfg("llama-2-70b", 32000, 8192, 28672, 80, 64, 8),
    _cfg("llama-3-8b", 128256, 4096, 14336, 32, 32, 8),
    _cfg("llama-3-70b", 128256, 8192, 28672, 80, 64, 8),
    _cfg("mistral-7b", 32000, 4096, 14336, 32, 32, 8),
]}


def model_shape(name: str | ModelConfig) -> ModelConfig:
    """A ModelConfig by catalog name (or pass one through)."""
    if isinstance(name, ModelConfig):
        return name
    try:
        return KNOWN_MODELS[name]
    except KeyError:
        raise KeyError(f"unknown model {name!r}; known: {', '.join(sorted(KNOWN_MODELS))}") from None
