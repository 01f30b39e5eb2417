"""Configuration dataclasses. They flow one way: loader -> ModelConfig; user -> EngineConfig."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # Hugging Face style: {"rope_type": "linear"|"dynamic"|"llama3"|"yarn", "factor": ..., ...} or None.
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    name: str = "llama"

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def kv_bytes_per_token(self, dtype_bytes: float) -> float:
        """K and V, every layer: 2 * layers * kv_heads * head_dim * bytes."""
        return 2 * self.num_layers * self.kv_size * dtype_bytes

    def num_params(self) -> int:
        h, i, L = self.hidden_size, self.intermediate_size, self.num_layers
        per_layer = h * (self.q_size + 2 * self.kv_size) + self.q_size * h + 3 * h * i + 2 * h
        emb = self.vocab_size * h
        return L * per_layer + emb * (1 if self.tie_word_embeddings else 2) + h


@dataclass
class CacheConfig:
    block_size: int = 16
    # Either a fixed number of blocks or a memory budget the pool is sized from.
    num_blocks: int | None = None
    kv_cache_memory_bytes: int = 512 * 2**20
    enable_prefix_caching: bool = True


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True


@dataclass
class EngineConfig:
    model: str = "default"
    dtype: str = "float32"
    max_model_len: int | None = None
    attention_backend: str = "auto"  # "torch" | "cpu" | "triton" | "auto"
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    seed: int = 0
