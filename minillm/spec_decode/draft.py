"""What speculative decoding keeps: a proposer's Draft, a sequence's SpecState, and the drafting statistics.

A proposer guesses the next k tokens of each running sequence cheaply; the target model verifies all of them in
the step's one forward pass (k + 1 positions per sequence) and the rejection sampler keeps a prefix. Three
proposers share one interface (minillm.interfaces.Proposer):
  ngram        prompt lookup: find the last n tokens earlier in the prompt + output, propose what followed
  draft_model  a smaller model with the same vocabulary, its own paged KV pool
  layer_skip   the target itself cut after its first layers (plus its final norm and LM head), weights shared
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch


@dataclass
class Draft:
    """A proposal for one sequence: the guessed tokens, and the distributions they were drawn from ([k, V]);
    probs None means each token was chosen deterministically (q is one-hot on it)."""
    token_ids: list[int]
    probs: Optional[torch.Tensor] = None


@dataclass
class SpecState:
    """One sequence's guesses for its next positions (verified in the next step) and the distributions they were
    drawn from ([k, V]; None: chosen deterministically)."""
    token_ids: list[int] = field(default_factory=list)
    probs: Optional[torch.Tensor] = None

    def clear(self) -> None:
        self.token_ids, self.probs = [], None


@dataclass
class SpecStats:
    """Drafting statistics, per request and per engine."""
    num_steps: int = 0                     # verification steps (a step with k >= 1 drafts)
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)   # [j]: times the (j+1)-th draft was accepted
    drafted_per_position: list[int] = field(default_factory=list)

    def record(self, num_drafts: int, num_accepted: int) -> None:
        if num_drafts == 0:
            return
        self.num_steps += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        for lst, upto in ((self.drafted_per_position, num_drafts), (self.accepted_per_position, num_accepted)):
            lst.extend([0] * (upto - len(lst)))
            for j in range(upto):
                lst[j] += 1

    @property
    def acceptance_rate(self) -> Optional[float]:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None

    @property
    def acceptance_rate_per_position(self) -> list[float]:
        accepted = self.accepted_per_position + [0] * (len(self.drafted_per_position) - len(self.accepted_per_position))
        return [a / d for a, d in zip(accepted, self.drafted_per_position)]

    @property
    def mean_accepted_length(self) -> Optional[float]:
        """Tokens emitted per verification step: the accepted drafts plus the one the target adds."""
        return (self.num_accepted_tokens + self.num_steps) / self.num_steps if self.num_steps else None
