"""SamplingParams: what the caller asks for, validated before any KV block is touched."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SamplingParams:
    temperature: float = 1.0          # 0 = greedy
    top_k: int = 0                    # 0 or -1 = off
    top_p: float = 1.0                # nucleus: keep the smallest set of tokens whose probability reaches top_p
    seed: int | None = None           # per-request generator: the same seed reproduces the same tokens
    max_tokens: int = 64
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    n: int = 1                        # parallel samples sharing the prompt's KV blocks
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.validate()

    def validate(self) -> None:
        def bad(msg: str) -> None:
            raise ValueError(f"invalid SamplingParams: {msg}")
        if not isinstance(self.max_tokens, int) or self.max_tokens <= 0:
            bad(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if self.temperature < 0:
            bad(f"temperature must be >= 0 (0 means greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            bad(f"top_p must be in (0, 1], got {self.top_p} (1 disables nucleus sampling)")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            bad(f"top_k must be a non-negative integer (0 or -1 disables it), got {self.top_k!r}")
        if not isinstance(self.n, int) or self.n < 1:
            bad(f"n must be a positive integer, got {self.n!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            bad(f"stop must be a list of non-empty strings, got {self.stop!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
