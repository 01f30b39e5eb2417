"""Expected gains of speculative decoding from the acceptance rate (lab07).

Model: each drafted token is accepted independently with probability `alpha` (the acceptance rate);
the target verifies `k` drafted tokens in one forward pass and always adds one token of its own
(the resampled token at the first rejection, or the bonus token when all k are accepted).
"""
from __future__ import annotations


def _check(alpha: float, k: int) -> None:
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"acceptance rate must be in [0, 1], got {alpha}")
    if k < 0:
        raise ValueError(f"k (drafted tokens per step) must be >= 0, got {k}")


def expected_tokens_per_step(alpha: float, k: int) -> float:
    """Tokens produced per target forward pass: 1 + alpha + ... + alpha^k = (1 - alpha^(k+1)) / (1 - alpha)."""
    _check(alpha, k)
    if alpha == 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def expected_speedup(alpha: float, k: int, draft_cost: float) -> float:
    """Wall-time speedup over plain decoding.

    `draft_cost` is the draft model's forward time as a fraction of the target's (0.05 = 20x faster).
    One step costs k draft passes plus one target pass (verifying k+1 positions costs about one decode
    step while decode is bandwidth-bound) and yields expected_tokens_per_step tokens.
    """
    if draft_cost < 0:
        raise ValueError(f"draft_cost must be >= 0, got {draft_cost}")
    return expected_tokens_per_step(alpha, k) / (k * draft_cost + 1.0)
