"""The n-gram (prompt lookup) proposer: no model at all. If the sequence's last n tokens appeared earlier in its
prompt or output, guess that what followed then follows again. Cheap and strong when the output copies its input
(rewriting, summarizing, editing code, answering from a document); useless for open-ended text."""
from __future__ import annotations

from array import array
from typing import Sequence

from minillm import interfaces
from minillm.interfaces import NgramLookup  # noqa: F401 (the lookup lab07 replaces: its Protocol, declared once)
from minillm.spec_decode.draft import Draft


def find_ngram_draft(token_ids: Sequence[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Up to k tokens that followed the most recent earlier occurrence of the sequence's last n tokens, trying
    the longest n first (a longer match predicts better). [] when no suffix of min_n..max_n tokens reappears.

    The search runs over the tokens as 4-byte words with bytes.rfind (C speed: this runs for every sequence at
    every step), keeping only word-aligned matches."""
    tokens = array("l" if array("l").itemsize == 4 else "i", token_ids)
    L, w = len(tokens), tokens.itemsize
    earlier = tokens[:L - 1].tobytes()                   # an occurrence must end before the last token
    for n in range(min(max_n, L - 1), min_n - 1, -1):
        pattern = tokens[L - n:].tobytes()
        end = len(earlier)
        while True:
            at = earlier.rfind(pattern, 0, end)
            if at < 0:
                break
            if at % w == 0:
                start = at // w
                return tokens[start + n:start + n + k].tolist()
            end = at + len(pattern) - 1                  # a misaligned hit: look further left
    return []


class NgramProposer:
    """Proposes with a lookup function (the engine's find_ngram_draft, or a learner's)."""

    def __init__(self, min_n: int = 1, max_n: int = 3, lookup: interfaces.NgramLookup | None = None) -> None:
        self.min_n, self.max_n = min_n, max_n
        self.lookup = lookup or find_ngram_draft

    def propose(self, seqs, num_tokens: Sequence[int]) -> list[Draft]:
        drafts = []
        for seq, k in zip(seqs, num_tokens):
            tokens = [int(t) for t in self.lookup(seq.token_ids, k, self.min_n, self.max_n)][:k] if k > 0 else []
            drafts.append(Draft(tokens))
        return drafts

    def verified(self, seq, num_accepted: int) -> None:
        pass

    def free(self, seq) -> None:
        pass
