"""KV-cache sizing: the arithmetic behind "how many tokens fit" (lab01)."""
from __future__ import annotations

from minillm.catalog import model_shape
from minillm.config import ModelConfig


def kv_cache_bytes(config: ModelConfig | str, tokens: int, dtype_bytes: float = 2) -> float:
    """Bytes of K and V for `tokens` cached tokens (summed over sequences):
    2 (K and V) x layers x kv_heads x head_dim x dtype_bytes x tokens."""
    return model_shape(config).kv_bytes_per_token(dtype_bytes) * tokens


def kv_tokens_that_fit(config: ModelConfig | str, budget_bytes: float, dtype_bytes: float = 2) -> int:
    """How many tokens of KV a memory budget holds (all sequences together)."""
    return int(budget_bytes // kv_cache_bytes(config, 1, dtype_bytes))


def max_seqs_that_fit(config: ModelConfig | str, memory_bytes: float, weight_bytes: float, seq_len: int,
                      dtype_bytes: float = 2) -> int:
    """Sequences that can each hold a full seq_len-token KV cache at once in what the weights leave free: the
    concurrency ceiling of a server that reserves the whole context per request (0 when the weights don't fit)."""
    free = memory_bytes - weight_bytes
    return int(free // kv_cache_bytes(config, seq_len, dtype_bytes)) if free > 0 else 0
