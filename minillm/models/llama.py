"""A Llama-family decoder in plain PyTorch: embedding, RMSNorm, RoPE, GQA attention, SwiGLU MLP.

Tokens arrive flat ([T]) with their positions: prefill chunks and decode tokens of many sequences share one
batch, and the AttentionMetadata says which rows belong to which sequence. Q/K/V and gate/up are fused into
one matmul each (fewer, larger GEMMs); the loader concatenates the checkpoint's separate matrices.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from minillm.config import ModelConfig
from minillm.kv.cache import KVCache
from minillm.layers.attention import AttentionMetadata, TorchAttentionBackend
from minillm.layers.norm import RMSNorm
from minillm.layers.rotary import RotaryEmbedding, apply_rotary


@dataclass
class ForwardContext:
    meta: AttentionMetadata
    cache: KVCache
    backend: object  # anything with .forward(layer, q, k, v, meta, cache, scale)
    cos: torch.Tensor | None = None
    sin: torch.Tensor | None = None


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer, self.cfg = layer, cfg
        self.qkv_proj = nn.Linear(cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size, bias=False)
        self.o_proj = nn.Linear(cfg.q_size, cfg.hidden_size, bias=False)
        self.scale = cfg.head_dim ** -0.5

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        c = self.cfg
        qk, v = self.qkv_proj(x).split([c.q_size + c.kv_size, c.kv_size], dim=-1)
        # Q and K heads side by side take one rotation (half the small ops of rotating them apart).
        qk = apply_rotary(qk.view(-1, c.num_heads + c.num_kv_heads, c.head_dim), ctx.cos, ctx.sin)
        q, k = qk[:, :c.num_heads], qk[:, c.num_heads:]
        v = v.view(-1, c.num_kv_heads, c.head_dim)
        o = ctx.backend.forward(self.layer, q, k, v, ctx.meta, ctx.cache, self.scale)
        return self.o_proj(o.reshape(-1, c.q_size))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), ctx)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.max_position_embeddings, cfg.rope_scaling)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """input_ids, positions: [T]. Returns final hidden states [T, hidden] (normed)."""
        ctx.cos, ctx.sin = self.rotary.cos_sin(positions)
        x = self.embed_tokens(input_ids)
        for layer in self.layers:
            x = layer(x, ctx)
        return self.norm(x)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        packed = self._packed_lm_head(weight)
        if packed is not None:
            return torch.ops.mkldnn._linear_pointwise(hidden.contiguous(), packed, None, "none", [], "")
        return F.linear(hidden, weight).float()

    def _packed_lm_head(self, weight: torch.Tensor):
        """The LM head (vocab x hidden, the largest matrix) pre-packed for oneDNN, on CPU in fp32.

        With few rows per step a plain matmul re-packs this matrix on every call; oneDNN's pre-packed copy
        makes the head 1.5-2x faster (it costs one extra copy of the matrix). Rebuilt if the weight changes."""
        if (weight.device.type != "cpu" or weight.dtype != torch.float32 or not torch.backends.mkldnn.is_available()
                or not hasattr(torch.ops.mkldnn, "_linear_pointwise")):
            return None
        key = (weight.data_ptr(), weight._version)
        cached = getattr(self, "_lm_head_packed", None)
        if cached is None or cached[0] != key:
            cached = (key, weight.detach().to_mkldnn())
            self._lm_head_packed = cached
        return cached[1]

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    def weight_bytes(self, per_token: bool = True) -> int:
        """Bytes of weights read per forward pass (the embedding table is gathered, not read whole, unless tied)."""
        total = sum(p.numel() * p.element_size() for p in self.parameters())
        if per_token and self.lm_head is not None:
            total -= self.embed_tokens.weight.numel() * self.embed_tokens.weight.element_size()
        return total
