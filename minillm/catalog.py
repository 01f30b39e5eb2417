"""Shapes of well-known public models and specs of well-known accelerators, for sizing arithmetic
(KV bytes, weight bytes, the serving estimator in minillm.fleet).

Only the numbers that sizing needs; none of these models is loadable from here.
Model figures are from each model's published config.json (max_position_embeddings is the context window).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from minillm.config import ModelConfig


def _cfg(name: str, vocab: int, hidden: int, inter: int, layers: int, heads: int, kv_heads: int,
         context: int, head_dim: int | None = None, tied: bool = False) -> ModelConfig:
    return ModelConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_layers=layers,
                       num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim or hidden // heads,
                       max_position_embeddings=context, tie_word_embeddings=tied, name=name)


KNOWN_MODELS: dict[str, ModelConfig] = {c.name: c for c in [
    _cfg("smollm2-135m", 49152, 576, 1536, 30, 9, 3, 8192, tied=True),
    _cfg("smollm2-360m", 49152, 960, 2560, 32, 15, 5, 8192, tied=True),
    _cfg("llama-2-7b", 32000, 4096, 11008, 32, 32, 32, 4096),
    _cfg("llama-2-13b", 32000, 5120, 13824, 40, 40, 40, 4096),
    _cfg("llama-2-70b", 32000, 8192, 28672, 80, 64, 8, 4096),
    # Llama-3 has an 8K window; Llama-3.1 has the same shapes with a 128K window (rope_scaling "llama3").
    _cfg("llama-3-8b", 128256, 4096, 14336, 32, 32, 8, 8192),
    _cfg("llama-3-70b", 128256, 8192, 28672, 80, 64, 8, 8192),
    _cfg("llama-3.1-8b", 128256, 4096, 14336, 32, 32, 8, 131072),
    _cfg("llama-3.1-70b", 128256, 8192, 28672, 80, 64, 8, 131072),
    _cfg("llama-3.1-405b", 128256, 16384, 53248, 126, 128, 8, 131072),
    _cfg("mistral-7b", 32000, 4096, 14336, 32, 32, 8, 32768),
]}


def lookup(value, table: dict, cls: type, what: str):
    """`value` itself when it already is a `cls`, else the catalog entry of that name; an unknown name raises a
    KeyError listing the known ones."""
    if isinstance(value, cls):
        return value
    try:
        return table[value]
    except KeyError:
        raise KeyError(f"unknown {what} {value!r}; known: {', '.join(sorted(table))}") from None


def model_shape(name: str | ModelConfig) -> ModelConfig:
    """A ModelConfig by catalog name (or pass one through)."""
    return lookup(name, KNOWN_MODELS, ModelConfig, "model")


@dataclass(frozen=True)
class Hardware:
    """One accelerator, as the serving estimator sees it. Every figure is the vendor's datasheet peak:
    tensor-core FLOP/s are *dense* (no 2:4 sparsity), bytes are decimal (1 GB = 1e9 bytes)."""
    name: str
    memory_gb: float                 # HBM per device
    hbm_gb_s: float                  # HBM bandwidth per device
    tflops: dict[str, float] = field(default_factory=dict)  # dense tensor TFLOP/s by compute dtype
    link_gb_s: float = 0.0           # scale-up link (NVLink/ICI) bandwidth per device, one direction
    domain: int = 8                  # devices in one scale-up (NVLink/ICI) domain of the usual system

    def peak_flops(self, dtype: str) -> float:
        """Dense FLOP/s for `dtype`; a clear error where the hardware has no such tensor-core path."""
        if dtype not in self.tflops:
            raise ValueError(f"{self.name} has no {dtype} tensor cores (it has {', '.join(self.tflops)}); "
                             f"pick a weight format whose compute dtype it supports")
        return self.tflops[dtype] * 1e12


# Sources: NVIDIA A100/H100/H200 datasheets (SXM parts), the HGX B200 (1,000 W) and GB200 NVL72 datasheets,
# Google Cloud's TPU v6e page. NVLink figures are per direction (half the "bidirectional" datasheet number).
# FP4 is Blackwell's NVFP4/MXFP4 tensor-core rate; Hopper and Ampere have none.
KNOWN_HARDWARE: dict[str, Hardware] = {h.name: h for h in [
    Hardware("a100-sxm-80gb", 80, 2039, {"bf16": 312}, link_gb_s=300),
    Hardware("h100-sxm", 80, 3350, {"bf16": 989, "fp8": 1979}, link_gb_s=450),
    Hardware("h200-sxm", 141, 4800, {"bf16": 989, "fp8": 1979}, link_gb_s=450),
    Hardware("b200", 180, 8000, {"bf16": 2250, "fp8": 4500, "fp4": 9000}, link_gb_s=900),
    Hardware("gb200", 186, 8000, {"bf16": 2500, "fp8": 5000, "fp4": 10000}, link_gb_s=900, domain=72),
    # TPU v6e (Trillium): 918 TFLOP/s bf16, 32 GB at 1,638 GB/s, 800 GB/s bidirectional ICI per chip.
    Hardware("tpu-v6e", 32, 1638, {"bf16": 918}, link_gb_s=400, domain=256),
]}


def hardware_spec(name: str | Hardware) -> Hardware:
    """A Hardware by catalog name (or pass one through)."""
    return lookup(name, KNOWN_HARDWARE, Hardware, "hardware")


@dataclass(frozen=True)
class ParamGroups:
    """A decoder's parameters by how serving treats them: `linear` are the per-layer matmul weights (what
    INT4/FP8/FP4 checkpoints quantize), `embedding` the input table (a row gather, never a matmul),
    `lm_head` the output projection (0 when tied to the embedding), `norms` the RMSNorm gains."""
    linear: int
    embedding: int
    lm_head: int
    norms: int

    @property
    def total(self) -> int:
        return self.linear + self.embedding + self.lm_head + self.norms


def param_groups(name: str | ModelConfig) -> ParamGroups:
    """Split ModelConfig.num_params() into linear / embedding / lm_head / norms (they sum to it)."""
    c = model_shape(name)
    h, L = c.hidden_size, c.num_layers
    linear = L * (h * (c.q_size + 2 * c.kv_size) + c.q_size * h + 3 * h * c.intermediate_size)
    emb = c.vocab_size * h
    return ParamGroups(linear=linear, embedding=emb, lm_head=0 if c.tie_word_embeddings else emb,
                       norms=L * 2 * h + h)
