"""Speculative decoding inside the engine's step (not a side path).

Before scheduling, the proposer guesses up to k next tokens for every running sequence that is decoding; the
guesses ride along in seq.spec (a SpecState), so the scheduler budgets and reserves KV slots for k + 1 positions.
The model runner computes all of them in the step's one forward pass and hands back k + 1 rows of logits; here
the sampler turns those rows into the target's distributions p (penalties, temperature, top-k / top-p, min-p),
and the rejection sampler keeps a prefix of the guesses plus one token of the target's own. The engine then
commits only the kept positions (the scheduler rolls the KV back and gives empty blocks back).

k per sequence is capped so that a step never emits past max_tokens and never writes past the context window. With
num_speculative_tokens="auto" an AdaptiveK policy (adaptive.py) picks each sequence's k in 0..k_max every step from
its acceptance so far and the engine's measured step costs; this decoder times the steps and reports the outcomes.
"""
from __future__ import annotations

import time
from typing import Any, Collection, Mapping, Optional

import torch

from minillm import interfaces
from minillm.config import SpeculativeConfig
from minillm.sampling.sampler import Sampler, SamplingBatch, TokenLogprobs, row_argmax, token_logprobs
from minillm.spec_decode.adaptive import AdaptiveK
from minillm.spec_decode.draft import SpecStats
from minillm.spec_decode.rejection_sampler import RejectionSampler

# The engine's Sequence (engine/sequence.py, a floor above): this module reads its token lists, params, generator,
# `spec` (a SpecState) and `matcher`, and never imports it.
Sequence = Any


class NoSpeculation:
    """The engine's speculator when speculative decoding is off: no guesses, nothing to verify or forget."""
    proposer = None
    stats = None

    def propose(self, running: list[Sequence], max_model_len: int) -> None:
        pass

    def drop(self, seq: Sequence) -> None:
        pass

    def verify(self, items: list, logits: torch.Tensor, sampler: interfaces.Sampler) -> dict:
        if items:
            raise ValueError("rows to verify but speculative decoding is off")
        return {}

    def after_step(self, appended: Mapping[Sequence, list[int]], verified: Collection[Sequence],
                   scheduled: list[tuple[Sequence, int]]) -> None:
        pass


class SpecDecoder:
    """The engine's speculative-decoding state: proposer, rejection sampler, k, and the engine-wide statistics."""

    def __init__(self, config: SpeculativeConfig, proposer: interfaces.Proposer, vocab_size: int,
                 rejection_sampler: Optional[interfaces.RejectionSampler] = None) -> None:
        self.config, self.proposer, self.vocab_size = config, proposer, vocab_size
        self.rejection_sampler = rejection_sampler or RejectionSampler()
        self.stats = SpecStats()
        self.policy: Optional[AdaptiveK] = AdaptiveK(config.k_max) if config.adaptive else None
        # the step in flight (auto only): when it began, its decoding sequences, the seconds spent drafting, and
        # the sequences holding an unverified shadow guess
        self._step_start, self._decoding, self._draft_seconds = 0.0, set(), 0.0
        self._shadowed: dict[int, Sequence] = {}

    @property
    def num_speculative_tokens(self) -> int:
        """The most tokens drafted for one sequence in a step (k, or auto's k_max)."""
        return self.config.k_max

    # ------------------------------------------------------------------ before scheduling
    def propose(self, running: list[Sequence], max_model_len: int) -> None:
        """Draft for every running sequence that is decoding (it has sampled a token, and all its tokens but the
        newest are in the KV cache) and holds no drafts yet. A prompt one token short of done is not decoding:
        its next token comes from the plain sampler, which also forks its n > 1 samples."""
        self._step_start = time.perf_counter()
        decoding, caps = [], []
        for seq in running:
            if seq.spec.token_ids or seq.is_finished or seq.num_computed_tokens != seq.num_tokens - 1 \
                    or seq.num_tokens == seq.num_prompt_tokens or seq.pending_forks:
                continue
            decoding.append(seq)
            caps.append(max(0, min(self.num_speculative_tokens,
                                   seq.params.max_tokens - len(seq.output_token_ids) - 1,  # a step emits up to k + 1
                                   max_model_len - seq.num_tokens - 1)))     # positions up to num_tokens - 1 + k
        ks = caps if self.policy is None else self._choose(decoding, caps)
        seqs = [s for s, k in zip(decoding, ks) if k >= 1]
        ks = [k for k in ks if k >= 1]
        if not seqs:
            return
        t = time.perf_counter()
        drafts = self.proposer.propose(seqs, ks)
        if self.policy is not None:
            self._draft_seconds = time.perf_counter() - t
            self.policy.costs.record_draft(len(seqs), max(ks), self._draft_seconds)
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
            if seq.seq_id in self._shadowed:     # not verified: only compared with the token the step emits
                self.policy.state(seq.seq_id).shadow = tokens[0] if tokens else None
                continue
            seq.spec.token_ids, seq.spec.probs = tokens, (probs if tokens else None)

    def _choose(self, decoding: list[Sequence], caps: list[int]) -> list[int]:
        """auto: the policy's k per decoding sequence; where drafting is about free, a sequence left at k = 0 gets
        one shadow guess (drafted, never verified) so its acceptance keeps being measured."""
        self._decoding, self._draft_seconds, self._shadowed = {s.seq_id for s in decoding}, 0.0, {}
        if not decoding:
            return []
        ks = self.policy.choose([s.seq_id for s in decoding], caps)
        if self.policy.drafting_is_cheap(len(decoding)):
            for i, (seq, k, cap) in enumerate(zip(decoding, ks, caps)):
                if k == 0 and cap >= 1:
                    ks[i] = 1
                    self._shadowed[seq.seq_id] = seq
        return ks

    def drop(self, seq: Sequence) -> None:
        """seq was preempted, finished or aborted: its guesses and the proposer's state for it are gone."""
        seq.spec.clear()
        self.proposer.free(seq)
        if self.policy is not None:
            self.policy.forget(seq.seq_id)

    def after_step(self, appended: Mapping[Sequence, list[int]], verified: Collection[Sequence],
                   scheduled: list[tuple[Sequence, int]]) -> None:
        """After the engine appended this step's tokens: a finished sequence is forgotten; a verified one tells the
        proposer how many guesses became real (the rest of its KV is stale); guesses a short budget left unverified
        are dropped (a one-token budget: none kept)."""
        if self.policy is not None:
            self._observe_step(appended, scheduled)
        for seq, tokens in appended.items():
            if seq.text.finished:
                self.drop(seq)
            elif seq in verified or seq.spec.token_ids or seq.seq_id in self._shadowed:
                self.proposer.verified(seq, len(tokens) - 1)
        for seq, _ in scheduled:
            seq.spec.clear()

    def _observe_step(self, appended: Mapping[Sequence, list[int]], scheduled: list[tuple[Sequence, int]]) -> None:
        """auto: shadow guesses against the emitted tokens; the step's time (drafting excluded) into the cost table
        when every row in it was a decoding sequence's (a prefill chunk would make it another kind of step)."""
        for seq, tokens in appended.items():
            if seq.seq_id in self._shadowed:
                self.policy.observe_shadow(seq.seq_id, tokens[0])
        for seq in self._shadowed.values():
            if seq not in appended and seq.seq_id in self.policy.seqs:   # not scheduled: the guess is void (a
                self.policy.seqs[seq.seq_id].shadow = None                 # model draft rolls its KV back)
                self.proposer.verified(seq, 0)
        if scheduled and all(seq.seq_id in self._decoding for seq, _ in scheduled):
            seconds = time.perf_counter() - self._step_start - self._draft_seconds
            self.policy.costs.record_step(len(scheduled), sum(n for _, n in scheduled), seconds)

    # ------------------------------------------------------------------ after the forward pass
    def _argmax_decides(self, sampler: interfaces.Sampler, params: list) -> bool:
        """Every row greedy, minillm's own sampler and rejection rule: p is one-hot on each row's argmax, so the
        rule keeps the drafts that equal it (RejectionSampler.accept_argmax). Skipping the [rows, V] one-hot and its
        reductions saves ~0.5 ms of a batch-1 step verifying 8 guesses. A plugged sampler or rule sees p as ever."""
        rs = self.rejection_sampler
        return (type(sampler) is Sampler and type(rs) is RejectionSampler and rs.rule is None
                and all(p.greedy for p in params))

    def verify(self, items: list[tuple[Sequence, list[int]]], logits: torch.Tensor, sampler: interfaces.Sampler
               ) -> dict[Sequence, tuple[list[int], list[Optional[TokenLogprobs]], int]]:
        """items: (seq, its rows of logits: the last real token's, then one per verified guess). Returns per seq
        the tokens to append (accepted guesses + one), their logprobs, and how many guesses were verified."""
        if not items:          # no row verifies guesses this step: the rejection sampler is not called
            return {}
        rows, params, prompts, outputs = [], [], [], []
        drafts, qs, gens = [], [], []
        for seq, rs in items:
            m = len(rs) - 1                      # the scheduler may have budgeted fewer than all the guesses
            d = seq.spec.token_ids[:m]
            out = seq.output_token_ids
            for j in range(m + 1):               # row j's penalties see the guesses before it as output
                rows.append(rs[j])
                params.append(seq.params)
                prompts.append(seq.prompt_token_ids)
                outputs.append(out + d[:j])
            drafts.append(d)
            qs.append(None if seq.spec.probs is None else seq.spec.probs[:m])
            gens.append(seq.generator)
        # a list index copies through torch's slow path (~0.2 ms for 9 rows of 49,152); a batch-1 verification's
        # rows are all the step's rows, in order
        picked = (logits if rows == list(range(logits.shape[0]))
                  else logits.index_select(0, torch.tensor(rows, device=logits.device)))
        batch = SamplingBatch(params, [None] * len(rows), prompts, outputs)
        if self._argmax_decides(sampler, params):
            kept = self.rejection_sampler.accept_argmax(row_argmax(sampler.penalized(picked, batch)), drafts, gens)
        else:
            kept = self.rejection_sampler(sampler.probs(picked, batch), drafts, qs, gens)
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
            lps = (token_logprobs(logits[rs[:len(toks)]], torch.tensor(toks, device=logits.device), [n] * len(toks)) if n is not None
                   else [None] * len(toks))
            seq.metrics.spec.record(len(d), len(toks) - 1)
            if self.policy is not None:
                self.policy.observe(seq.seq_id, len(d), len(toks) - 1)
            self.stats.record(len(d), len(toks) - 1)
            result[seq] = (toks, lps, len(d))
        return result

