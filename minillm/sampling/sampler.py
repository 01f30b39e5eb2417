"""Turn logits into tokens for a whole batch: penalties, then the rows' own temperature / min-p / top-k / top-p in
one vectorized pass (processors.py), then one draw per row from its distribution.

The draw is an exponential race: token = argmax(p / E) with E ~ Exp(1) per token, which picks token j with
probability p_j. Unseeded rows share one call to torch's global generator; a seeded row draws its noise from its
own torch.Generator, so its tokens do not depend on what else is in the batch. Greedy rows take the argmax of the
(penalized) logits. Logprobs come from the model's raw logits (log-softmax before any processing, as vLLM returns
them by default): the sampled token's logprob and rank, and the top-N.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from minillm import interfaces
from minillm.sampling.params import SamplingParams
from minillm.sampling.processors import apply_penalties, process_logits


def make_generator(seed: int | None, device: str | torch.device = "cpu") -> torch.Generator | None:
    """A seeded request's own generator, on the device its draws are made on (the engine's)."""
    if seed is None:
        return None
    return torch.Generator(device=device).manual_seed(seed)


@dataclass
class SamplingBatch:
    """What the sampler needs to know about each row: its settings, its generator, and (for penalties) the tokens
    the row's sequence holds: its prompt and its output so far."""
    params: list[SamplingParams]
    generators: list[Optional[torch.Generator]]
    prompt_ids: list[Sequence[int]] = field(default_factory=list)
    output_ids: list[Sequence[int]] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.params)

    def column(self, name: str, dtype: torch.dtype = torch.float32, device: torch.device | None = None) -> torch.Tensor:
        return torch.tensor([getattr(p, name) for p in self.params], dtype=dtype, device=device)


@dataclass
class TokenLogprobs:
    """One sampled token's logprob (from the raw logits), its rank among all tokens (1 = most likely) and the
    top-N tokens with theirs."""
    token_id: int
    logprob: float
    rank: int
    top: list[tuple[int, float]]


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[Optional[TokenLogprobs]]


_SLICE = 128


def row_argmax(x: torch.Tensor) -> torch.Tensor:
    """x.argmax(-1) for rows x [B, V]: each row's first maximum (its first NaN where it has one), as torch's. On the
    CPU, torch's argmax does not vectorize and its amax does (a [5, 49152] argmax took 125 us, an amax 10): the
    maxima of 128-wide slices pick each row's first slice holding its maximum, and argmax runs in that slice only
    (~30 us). Elsewhere, or for a width that is not a multiple of the slice, it is torch's argmax."""
    V = x.shape[-1]
    if x.device.type != "cpu" or x.dim() != 2 or V % _SLICE or V < 8 * _SLICE or not x.is_contiguous():
        return x.argmax(-1)
    slices = x.view(x.shape[0], V // _SLICE, _SLICE)
    which = slices.amax(-1).argmax(-1)
    return which * _SLICE + slices[torch.arange(x.shape[0]), which].argmax(-1)


def draw(probs: torch.Tensor, generators: Sequence[Optional[torch.Generator]]) -> torch.Tensor:
    """One token per row of probs [B, V], row i with generators[i] (None: torch's global one). The DrawFn seam."""
    noise = torch.empty_like(probs)
    seeded = [i for i, g in enumerate(generators) if g is not None]
    for i in seeded:
        noise[i].exponential_(generator=generators[i])
    if len(seeded) < len(generators):
        rest = [i for i, g in enumerate(generators) if g is None]
        noise[rest] = torch.empty(len(rest), probs.shape[1], dtype=probs.dtype, device=probs.device).exponential_()
    return (probs / noise).argmax(-1)


def _off_cpu(t: torch.Tensor) -> torch.device | None:
    """t's device when it is not the CPU (the per-row settings go there), else None: on the CPU they are built
    exactly as before devices existed."""
    return None if t.device.type == "cpu" else t.device


def token_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, num_top: Sequence[int]) -> list[TokenLogprobs]:
    """Logprobs of the sampled tokens and each row's top-N, from the raw logits [B, V]."""
    lp = logits.float().log_softmax(-1)
    chosen = lp.gather(-1, token_ids[:, None])[:, 0]
    ranks = (lp > chosen[:, None]).sum(-1) + 1
    k = max(num_top, default=0)
    top_v, top_i = lp.topk(k, dim=-1) if k else (lp[:, :0], lp[:, :0].long())
    return [TokenLogprobs(int(t), float(c), int(r), list(zip(top_i[i, :n].tolist(), top_v[i, :n].tolist())))
            for i, (t, c, r, n) in enumerate(zip(token_ids.tolist(), chosen.tolist(), ranks.tolist(), num_top))]


class Sampler:
    """The engine's sampler (the Sampler seam). process_fn and draw_fn are the pieces lab06 replaces."""
    process_fn: interfaces.ProcessFn = staticmethod(process_logits)
    draw_fn: interfaces.DrawFn = staticmethod(draw)

    def __init__(self, process_fn: interfaces.ProcessFn | None = None, draw_fn: interfaces.DrawFn | None = None):
        cls = type(self)    # read through the class: a plain function stored on it must not bind to self
        self.process_fn = process_fn or cls.process_fn
        self.draw_fn = draw_fn or cls.draw_fn

    def penalized(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """The raw logits [B, V] (fp32) with each row's penalties applied (rows without penalties untouched)."""
        logits = logits.float()
        rows = [i for i, p in enumerate(batch.params) if p.has_penalties]
        if not rows:
            return logits
        sub = SamplingBatch([batch.params[i] for i in rows], [], [batch.prompt_ids[i] for i in rows],
                            [batch.output_ids[i] for i in rows])
        logits, dev = logits.clone(), _off_cpu(logits)
        logits[rows] = apply_penalties(logits[rows], sub.prompt_ids, sub.output_ids,
                                       sub.column("repetition_penalty", device=dev),
                                       sub.column("presence_penalty", device=dev),
                                       sub.column("frequency_penalty", device=dev))
        return logits

    def probs(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """Each row's distribution [B, V]: what a random row samples from. A greedy row's is one-hot on its argmax."""
        logits = self.penalized(logits, batch)
        dev = _off_cpu(logits)
        # which rows are greedy is known on the host: no flag tensor to read back from a GPU
        g = [i for i, p in enumerate(batch.params) if p.greedy]
        r = [i for i, p in enumerate(batch.params) if not p.greedy]
        out = torch.zeros_like(logits)
        if g:
            gi = g if dev is None else torch.tensor(g, device=dev)
            out[gi, row_argmax(logits[gi])] = 1.0
        if r:
            sub = SamplingBatch([batch.params[i] for i in r], [])
            processed = self.process_fn(logits[r], sub.column("temperature", device=dev),
                                        sub.column("top_k", torch.int64, dev), sub.column("top_p", device=dev),
                                        sub.column("min_p", device=dev))
            out[r] = processed.softmax(-1)
        return out

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        """logits [B, V] -> one token per row (and logprobs for the rows that ask)."""
        if all(p.greedy for p in batch.params):
            # every row's distribution is one-hot on its argmax: take it without building [B, V] of probabilities
            # (a batch-1 decode step spent ~0.6 ms there, ~7 % of the step)
            tokens = row_argmax(self.penalized(logits, batch))
            return SamplerOutput(tokens.tolist(), self.logprobs(logits, tokens, batch))
        probs = self.probs(logits, batch)
        greedy = [p.greedy for p in batch.params]
        tokens = row_argmax(probs)
        random_rows = [i for i, g in enumerate(greedy) if not g]
        if random_rows:
            drawn = self.draw_fn(probs[random_rows], [batch.generators[i] for i in random_rows])
            if not isinstance(drawn, torch.Tensor) or drawn.shape != (len(random_rows),):
                raise ValueError(f"draw_fn must return a tensor of {len(random_rows)} token ids (one per row), got "
                                 f"{getattr(drawn, 'shape', type(drawn).__name__)}")
            tokens[random_rows] = drawn.long()
        return SamplerOutput(tokens.tolist(), self.logprobs(logits, tokens, batch))

    @staticmethod
    def logprobs(logits: torch.Tensor, tokens: torch.Tensor, batch: SamplingBatch) -> list[Optional[TokenLogprobs]]:
        rows = [i for i, p in enumerate(batch.params) if p.logprobs is not None]
        out: list[Optional[TokenLogprobs]] = [None] * len(batch)
        if rows:
            for i, lp in zip(rows, token_logprobs(logits[rows], tokens[rows],
                                                 [batch.params[i].logprobs for i in rows])):
                out[i] = lp
        return out
