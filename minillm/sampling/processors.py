"""From logits to a distribution, for a whole batch at once: every row has its own settings, one pass over the
batch (no Python loop per row). A dropped token gets logit -inf.

Order (as vLLM's): penalties on the raw logits -> temperature -> min-p -> top-k -> top-p -> softmax.
`process_logits` is the ProcessFn seam (lab06): temperature, min-p, top-k and top-p in one function.
"""
from __future__ import annotations

from typing import Sequence

import torch

NEG_INF = float("-inf")


def apply_penalties(logits: torch.Tensor, prompt_ids: Sequence[Sequence[int]], output_ids: Sequence[Sequence[int]],
                    repetition: torch.Tensor, presence: torch.Tensor, frequency: torch.Tensor) -> torch.Tensor:
    """vLLM's penalties, per row: repetition (> 1 discourages) divides positive / multiplies negative logits of every
    token seen in the prompt or the output; presence subtracts once for every token the output holds; frequency
    subtracts per occurrence in the output. Tokens never seen are untouched."""
    B, V = logits.shape
    counts = torch.zeros(B, V, dtype=logits.dtype, device=logits.device)
    seen = torch.zeros(B, V, dtype=torch.bool, device=logits.device)
    for i, (prompt, output) in enumerate(zip(prompt_ids, output_ids)):
        if output:
            counts[i].index_add_(0, torch.as_tensor(list(output), device=logits.device),
                                 torch.ones(len(output), dtype=logits.dtype, device=logits.device))
        if prompt:
            seen[i, torch.as_tensor(list(prompt), device=logits.device)] = True
    seen |= counts > 0
    rep = repetition[:, None].to(logits.dtype)
    penalized = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen, penalized, logits)
    return logits - frequency[:, None].to(logits.dtype) * counts - presence[:, None].to(logits.dtype) * (counts > 0)


def apply_temperature(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """Divide each row by its temperature (rows with temperature 0 are greedy: left as they are)."""
    t = torch.where(temperature > 0, temperature, torch.ones_like(temperature))
    return logits / t[:, None].to(logits.dtype)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below min_p x the row's highest probability (min_p 0: nothing dropped)."""
    probs = logits.softmax(-1)
    floor = min_p[:, None].to(probs.dtype) * probs.amax(-1, keepdim=True)
    return logits.masked_fill(probs < floor, NEG_INF)


def apply_top_k(logits: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """Keep each row's k most likely tokens (ties at the k-th value kept too); k <= 0 or >= V keeps everything."""
    V = logits.shape[-1]
    k = torch.where((top_k > 0) & (top_k < V), top_k, torch.full_like(top_k, V)).long()
    kth = logits.sort(-1, descending=True).values.gather(-1, (k - 1)[:, None])
    return logits.masked_fill(logits < kth, NEG_INF)


def apply_top_p(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keep each row's smallest set of most likely tokens whose total probability reaches top_p: a token stays if
    the tokens strictly ahead of it hold less than top_p (so the one crossing top_p stays). top_p 1 keeps all."""
    sorted_logits, order = logits.sort(-1, descending=True)
    probs = sorted_logits.softmax(-1)
    mass_before = probs.cumsum(-1) - probs
    drop_sorted = (mass_before >= top_p[:, None].to(probs.dtype)) & (top_p < 1)[:, None]   # 1: float error aside
    drop_sorted[:, 0] = False                      # the most likely token always stays
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, NEG_INF)


def process_logits(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                   min_p: torch.Tensor) -> torch.Tensor:
    """logits [B, V] fp32 and one setting per row -> the logits each row samples from (softmax gives its
    distribution)."""
    logits = apply_temperature(logits, temperature)
    if bool((min_p > 0).any()):
        logits = apply_min_p(logits, min_p)
    if bool(((top_k > 0) & (top_k < logits.shape[-1])).any()):
        logits = apply_top_k(logits, top_k)
    if bool((top_p < 1).any()):
        logits = apply_top_p(logits, top_p)
    return logits
