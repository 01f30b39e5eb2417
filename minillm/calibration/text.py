"""Calibration text and the one-sequence forward calibration and bench quality both run.

Text: the Python reference topics that ship with CPython (`pydoc_data.topics`, ~465k characters of English, no
download). The first CALIBRATION_CHARS characters are the calibration slice (SmoothQuant, GPTQ); the evaluation
windows (bench quality) are cut from the held-out rest, so the two never overlap.
"""
from __future__ import annotations

import pydoc_data.topics as topics

import torch

from minillm.kv.cache import pool_dtype
from minillm.kv.contiguous import ContiguousKVCache
from minillm.layers.attention import TorchAttentionBackend
from minillm.models.llama import ForwardContext

CALIBRATION_CHARS = 200_000


def corpus() -> str:
    return "".join(topics.topics[k] for k in sorted(topics.topics))


def calibration_text() -> str:
    return corpus()[:CALIBRATION_CHARS]


def eval_windows(tokenizer, num_windows: int, window: int, calibration: bool = False) -> list[list[int]]:
    """`num_windows` token windows of `window` tokens from the held-out part of the corpus (or, with `calibration`,
    from the calibration slice: the two never overlap)."""
    text = corpus()
    ids = tokenizer.encode(text[:CALIBRATION_CHARS] if calibration else text[CALIBRATION_CHARS:])
    stride = max(window, (len(ids) - window) // max(1, num_windows))
    out = [ids[i:i + window] for i in range(0, len(ids) - window + 1, stride)][:num_windows]
    if len(out) < num_windows:
        raise ValueError(f"the held-out text has room for {len(out)} windows of {window} tokens")
    return out


def sequence_logits(model, ids: list[int], kv_cache_dtype: str = "auto") -> torch.Tensor:
    """[n, V] logits of every position of one sequence (one prefill through a contiguous cache that stores
    kv_cache_dtype: "auto", the model's dtype, or "int8")."""
    cache = ContiguousKVCache(model.cfg, 1, len(ids), dtype=pool_dtype(kv_cache_dtype, model.dtype))
    meta = cache.metadata([0], [0], [len(ids)])
    h = model(torch.tensor(ids), torch.arange(len(ids)), ForwardContext(meta, cache, TorchAttentionBackend()))
    return model.compute_logits(h)
