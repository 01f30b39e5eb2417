"""Rotary position embedding (rotate-half layout, as Hugging Face Llama) and the common rope scalings.

Scalings follow the checkpoint's `rope_scaling` dict: linear (position interpolation), dynamic (NTK-aware,
base grows with the sequence), llama3 (per-frequency smoothing) and yarn (ramped interpolation + attention factor).
"""
from __future__ import annotations

import math
from typing import Any, Sequence

import torch
from torch import nn


def _default_inv_freq(dim: int, base: float) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def _llama3_inv_freq(inv_freq: torch.Tensor, s: dict[str, Any]) -> torch.Tensor:
    factor = s["factor"]
    low, high = s.get("low_freq_factor", 1.0), s.get("high_freq_factor", 4.0)
    old_len = s["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_inv_freq(dim: int, base: float, s: dict[str, Any], max_pos: int) -> tuple[torch.Tensor, float]:
    factor = s["factor"]
    old_len = s.get("original_max_position_embeddings") or max_pos
    attn_factor = s.get("attention_factor")
    if attn_factor is None:
        if s.get("mscale") and s.get("mscale_all_dim"):
            attn_factor = _yarn_mscale(factor, s["mscale"]) / _yarn_mscale(factor, s["mscale_all_dim"])
        else:
            attn_factor = _yarn_mscale(factor)
    beta_fast, beta_slow = s.get("beta_fast") or 32, s.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

    lo, hi = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.get("truncate", True):
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, dim - 1)
    if lo == hi:
        hi += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - lo) / (hi - lo)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    keep = 1 - ramp  # share of the original (extrapolated) frequency per dimension
    return interpolation * (1 - keep) + extrapolation * keep, float(attn_factor)


SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")


def rope_type_of(scaling: dict[str, Any] | None) -> str:
    if not scaling:
        return "default"
    return scaling.get("rope_type") or scaling.get("type") or "default"


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, base: float, max_position: int,
                 scaling: dict[str, Any] | None = None) -> None:
        super().__init__()
        self.head_dim, self.base, self.max_position = head_dim, base, max_position
        self.scaling = dict(scaling or {})
        self.rope_type = rope_type_of(scaling)
        if self.rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(f"unsupported rope scaling type {self.rope_type!r}; "
                             f"minillm supports {', '.join(SUPPORTED_ROPE_TYPES)}")
        self.attention_factor = 1.0
        # on the CPU even inside a meta-device build (the loader's): a meta tensor's arithmetic runs torch's Python
        # reference ops, whose first use imports torch._dynamo (~2 s of every model load)
        with torch.device("cpu"):
            inv_freq = _default_inv_freq(head_dim, base)
            if self.rope_type == "linear":
                inv_freq = inv_freq / self.scaling["factor"]
            elif self.rope_type == "llama3":
                inv_freq = _llama3_inv_freq(inv_freq, self.scaling)
            elif self.rope_type == "yarn":
                inv_freq, self.attention_factor = _yarn_inv_freq(head_dim, base, self.scaling, max_position)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self._cache: tuple[int, torch.Tensor, torch.Tensor] | None = None

    def _dynamic_inv_freq(self, seq_len: int) -> torch.Tensor:
        # NTK-aware: past the trained length, grow the base so the lowest frequency still fits.
        if seq_len <= self.max_position:
            return self.inv_freq
        factor = self.scaling["factor"]
        base = self.base * ((factor * seq_len / self.max_position) - (factor - 1)) ** (
            self.head_dim / (self.head_dim - 2))
        return _default_inv_freq(self.head_dim, base)

    def cos_sin(self, positions: torch.Tensor, query_lens: Sequence[int] | None = None,
                seq_lens: Sequence[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin of shape [T, head_dim] in fp32 for the given positions: the tokens of sequence i are the next
        query_lens[i] positions, and it holds seq_lens[i] tokens after this step (None: the batch is one sequence
        as long as its furthest position). Dynamic scaling takes each sequence's own length, as Hugging Face does for
        a batch of one: a sequence's numbers never depend on what else is in the batch. Cached keys keep the scaling
        of the step that wrote them (as in transformers' generate), so past the trained length a prompt prefilled in
        chunks, or recomputed after a preemption, gets other numbers than one pass would give it."""
        need = int(positions.max()) + 1 if positions.numel() else 1
        if self.rope_type == "dynamic":
            if query_lens is None or seq_lens is None:
                query_lens, seq_lens = [positions.numel()], [need]
            inv_freq = torch.cat([self._dynamic_inv_freq(int(s)).expand(int(q), -1)
                                  for q, s in zip(query_lens, seq_lens)]).to(positions.device)
            freqs = positions.float()[:, None] * inv_freq
            emb = torch.cat((freqs, freqs), dim=-1)
            return emb.cos(), emb.sin()
        _, cos, sin = self._table(need, positions.device)
        return cos[positions], sin[positions]

    def tables(self, n: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin of positions 0..n-1 (at least) on `device`, [>= n, head_dim] fp32: what cos_sin indexes, for a
        caller that indexes them itself without reading the positions on the host (a CUDA graph). Not for dynamic
        scaling, whose numbers depend on each sequence's length."""
        if self.rope_type == "dynamic":
            raise ValueError("dynamic RoPE scaling depends on each sequence's length: it has no fixed table")
        _, cos, sin = self._table(n, device)
        return cos, sin

    def _table(self, need: int, device: torch.device) -> tuple[int, torch.Tensor, torch.Tensor]:
        if self._cache is None or self._cache[0] < need or self._cache[1].device != device:
            n = max(need, min(self.max_position, 4096))
            inv_freq = self.inv_freq.to(device)
            freqs = torch.arange(n, dtype=torch.float32, device=device)[:, None] * inv_freq[None, :]
            emb = torch.cat((freqs, freqs), dim=-1)
            self._cache = (n, emb.cos() * self.attention_factor, emb.sin() * self.attention_factor)
        return self._cache


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, head_dim]; cos/sin: [T, head_dim] (fp32, cast to x's dtype like Hugging Face)."""
    cos = cos.to(x.dtype)[:, None, :]
    sin = sin.to(x.dtype)[:, None, :]
    return x * cos + _rotate_half(x) * sin
