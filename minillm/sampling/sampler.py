"""Turn logits into tokens: temperature, top-k, top-p, then a draw from each request's own generator.

Each row may carry different parameters. Seeded requests own a torch.Generator, so their tokens do not depend
on what else is in the batch."""
from __future__ import annotations

import torch

from minillm.sampling.params import SamplingParams


def apply_top_k(logits: torch.Tensor, k: int) -> torch.Tensor:
    if k <= 0 or k >= logits.shape[-1]:
        return logits
    kth = torch.topk(logits, k, dim=-1).values[..., -1:]
    return logits.masked_fill(logits < kth, float("-inf"))


def apply_top_p(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Keep the smallest set of most-likely tokens whose total probability reaches p (at least one token)."""
    if p >= 1.0:
        return logits
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    probs = sorted_logits.softmax(-1)
    mass_before = probs.cumsum(-1) - probs   # probability of the tokens strictly ahead of each one
    drop_sorted = mass_before >= p
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def probs_from_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution a (non-greedy) request samples from, for one row [V] or a batch [B, V]."""
    logits = logits.float() / params.temperature
    logits = apply_top_p(apply_top_k(logits, params.top_k), params.top_p)
    return logits.softmax(-1)


def make_generator(seed: int | None) -> torch.Generator | None:
    if seed is None:
        return None
    return torch.Generator().manual_seed(seed)


class Sampler:
    def __call__(self, logits: torch.Tensor, params: list[SamplingParams],
                 generators: list[torch.Generator | None]) -> list[int]:
        """logits [B, V] fp32 -> one token id per row."""
        greedy = logits.argmax(-1).tolist()
        out = []
        for i, p in enumerate(params):
            if p.greedy:
                out.append(greedy[i])
                continue
            probs = probs_from_logits(logits[i], p)
            out.append(int(torch.multinomial(probs, 1, generator=generators[i])))
        return out
