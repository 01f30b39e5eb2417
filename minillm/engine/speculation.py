"""Speculative decoding inside the engine's step (not a side path).

Before scheduling, the proposer guesses up to k next tokens for every running sequence that is decoding; the
guesses ride along in seq.spec_token_ids, so the scheduler budgets and reserves KV slots for k + 1 positions.
The model runner computes all of them in the step's one forward pass and hands back k + 1 rows of logits; here
the sampler turns those rows into the target's distributions p (penalties, temperature, top-k / top-p, min-p),
and the rejection sampler keeps a prefix of the guesses plus one token of the target's own. The engine then
commits only the kept positions (the scheduler rolls the KV back and gives empty blocks back).

k per sequence is capped so that a step never emits past max_tokens and never writes past the context window.
"""
from __future__ import annotations

from typing import Optional

import torch

from minillm import interfaces
from minillm.config import SpeculativeConfig
from minillm.engine.sequence import Sequence
from minillm.sampling.rejection_sampler import RejectionSampler
from minillm.sampling.sampler import SamplingBatch, TokenLogprobs, token_logprobs
from minillm.sampling.speculative import SpecStats


def build_proposer(spec: SpeculativeConfig, model, tokenizer, num_blocks: int, block_size: int,
                   attention_backend: str) -> interfaces.Proposer:
    """The proposer a SpeculativeConfig names. A model-based one gets its own KV pool of num_blocks blocks (as many
    tokens as the target's pool)."""
    from minillm.layers.attention import get_attention_backend
    from minillm.sampling.draft_model import LayerSkipModel, ModelDraftProposer
    from minillm.sampling.ngram import NgramProposer
    if spec.method == "ngram":
        return NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max)
    if spec.method == "layer_skip":
        draft = LayerSkipModel(model, spec.draft_layers)
    else:
        from minillm.loading.loader import load_model
        loaded = load_model(spec.model, model.dtype)
        check_same_vocabulary(model.cfg.vocab_size, tokenizer, loaded.config.vocab_size, loaded.tokenizer,
                              str(loaded.path))
        draft = loaded.model
    return ModelDraftProposer(draft, num_blocks, block_size, get_attention_backend(attention_backend))


def check_same_vocabulary(target_vocab_size: int, target_tokenizer, draft_vocab_size: int, draft_tokenizer,
                          draft_name: str) -> None:
    """A draft must number tokens exactly as the target does: its guesses are token ids the target verifies."""
    hint = "pick a draft model of the target's family (same tokenizer), or use method 'ngram' or 'layer_skip'"
    if target_vocab_size != draft_vocab_size:
        raise ValueError(f"the draft model {draft_name} has a vocabulary of {draft_vocab_size} tokens, the target "
                         f"{target_vocab_size}: {hint}")
    if target_tokenizer is not None and draft_tokenizer is not None:
        a, b = target_tokenizer.get_vocab(), draft_tokenizer.get_vocab()
        if a != b:
            diff = sorted(set(a.items()) ^ set(b.items()))[:3]
            raise ValueError(f"the draft model {draft_name} numbers its tokens differently from the target "
                             f"(e.g. {diff}): {hint}")


class SpecDecoder:
    """The engine's speculative-decoding state: proposer, rejection sampler, k, and the engine-wide statistics."""

    def __init__(self, config: SpeculativeConfig, proposer: interfaces.Proposer, vocab_size: int,
                 rejection_sampler: Optional[interfaces.RejectionSampler] = None) -> None:
        self.config, self.proposer, self.vocab_size = config, proposer, vocab_size
        self.rejection_sampler = rejection_sampler or RejectionSampler()
        self.stats = SpecStats()

    @property
    def num_speculative_tokens(self) -> int:
        return self.config.num_speculative_tokens

    # ------------------------------------------------------------------ before scheduling
    def propose(self, running: list[Sequence], max_model_len: int) -> None:
        """Draft for every running sequence that is decoding (it has sampled a token, and all its tokens but the
        newest are in the KV cache) and holds no drafts yet. A prompt one token short of done is not decoding:
        its next token comes from the plain sampler, which also forks its n > 1 samples."""
        seqs, ks = [], []
        for seq in running:
            if seq.spec_token_ids or seq.is_finished or seq.num_computed_tokens != seq.num_tokens - 1 \
                    or seq.num_tokens == seq.num_prompt_tokens or seq.pending_forks:
                continue
            k = min(self.num_speculative_tokens,
                    seq.params.max_tokens - len(seq.output_token_ids) - 1,   # a step emits up to k + 1 tokens
                    max_model_len - seq.num_tokens - 1)                       # positions up to num_tokens - 1 + k
            if k >= 1:
                seqs.append(seq)
                ks.append(k)
        if not seqs:
            return
        drafts = self.proposer.propose(seqs, ks)
        if not isinstance(drafts, (list, tuple)) or len(drafts) != len(seqs):
            raise ValueError(f"{type(self.proposer).__name__}.propose must return one Draft per sequence "
                             f"({len(seqs)}), got {drafts!r:.200}")
        for seq, k, d in zip(seqs, ks, drafts):
            tokens = [int(t) for t in d.token_ids][:k]
            bad = [t for t in tokens if not 0 <= t < self.vocab_size]
            if bad:
                raise ValueError(f"{type(self.proposer).__name__} proposed token ids {bad[:5]} outside the "
                                 f"vocabulary [0, {self.vocab_size})")
            if seq.matcher is not None and d.probs is None:
                # structured outputs: a deterministic guess the automaton forbids would be rejected for certain and
                # the target's own token drawn from p in its place, so drop it (and what follows) now. A sampled
                # guess (probs given) stays: the rejection sampler rejects it against the masked p, which keeps
                # the output distributed as p (dropping it would not).
                tokens = tokens[:len(seq.matcher.walk(tokens)) - 1]
            probs = d.probs
            if probs is not None:
                if probs.dim() != 2 or probs.shape[0] < len(tokens) or probs.shape[1] != self.vocab_size:
                    raise ValueError(f"{type(self.proposer).__name__} gave draft probs of shape "
                                     f"{tuple(probs.shape)}; expected [{len(tokens)}, {self.vocab_size}]")
                probs = probs[:len(tokens)]
            seq.spec_token_ids, seq.spec_probs = tokens, (probs if tokens else None)

    def drop(self, seq: Sequence) -> None:
        """seq was preempted, finished or aborted: its guesses and the proposer's state for it are gone."""
        clear(seq)
        self.proposer.free(seq)

    # ------------------------------------------------------------------ after the forward pass
    def verify(self, items: list[tuple[Sequence, list[int]]], logits: torch.Tensor, sampler: interfaces.Sampler
               ) -> dict[Sequence, tuple[list[int], list[Optional[TokenLogprobs]], int]]:
        """items: (seq, its rows of logits: the last real token's, then one per verified guess). Returns per seq
        the tokens to append (accepted guesses + one), their logprobs, and how many guesses were verified."""
        rows, params, prompts, outputs = [], [], [], []
        drafts, qs, gens = [], [], []
        for seq, rs in items:
            m = len(rs) - 1                      # the scheduler may have budgeted fewer than all the guesses
            d = seq.spec_token_ids[:m]
            out = seq.output_token_ids
            for j in range(m + 1):               # row j's penalties see the guesses before it as output
                rows.append(rs[j])
                params.append(seq.params)
                prompts.append(seq.prompt_token_ids)
                outputs.append(out + d[:j])
            drafts.append(d)
            qs.append(None if seq.spec_probs is None else seq.spec_probs[:m])
            gens.append(seq.generator)
        p = sampler.probs(logits[rows], SamplingBatch(params, [None] * len(rows), prompts, outputs))
        kept = self.rejection_sampler(p, drafts, qs, gens)
        if not isinstance(kept, (list, tuple)) or len(kept) != len(items):
            raise ValueError(f"the rejection sampler must return one token list per request ({len(items)}), "
                             f"got {kept!r:.200}")
        result = {}
        for (seq, rs), d, toks in zip(items, drafts, kept):
            toks = [int(t) for t in toks]
            if not 1 <= len(toks) <= len(d) + 1 or toks[:-1] != d[:len(toks) - 1]:
                raise ValueError(f"the rejection sampler returned {toks} for drafts {d}: it must return the "
                                 "accepted drafts (a prefix) followed by one token")
            n = seq.params.logprobs
            lps = (token_logprobs(logits[rs[:len(toks)]], torch.tensor(toks), [n] * len(toks)) if n is not None
                   else [None] * len(toks))
            seq.metrics.spec.record(len(d), len(toks) - 1)
            self.stats.record(len(d), len(toks) - 1)
            result[seq] = (toks, lps, len(d))
        return result


def clear(seq: Sequence) -> None:
    seq.spec_token_ids, seq.spec_probs = [], None
