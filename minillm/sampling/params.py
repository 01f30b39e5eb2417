"""SamplingParams: what the caller asks for, validated before any KV block is touched."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from minillm.structured.params import StructuredOutputsParams

MAX_LOGPROBS = 20   # like vLLM's default max_logprobs: the top-N list costs a top-k over the vocabulary per token


@dataclass
class SamplingParams:
    temperature: float = 1.0          # 0 = greedy
    top_k: int = 0                    # 0 or -1 = off
    top_p: float = 1.0                # nucleus: keep the smallest set of tokens whose probability reaches top_p
    min_p: float = 0.0                # drop tokens less likely than min_p x the most likely one (0 = off)
    repetition_penalty: float = 1.0   # > 1 discourages tokens of the prompt and the output (1 = off)
    presence_penalty: float = 0.0     # subtracted once from every token the output already holds (0 = off)
    frequency_penalty: float = 0.0    # subtracted per occurrence in the output (0 = off)
    seed: int | None = None           # per-request generator: the same seed reproduces the same tokens
    max_tokens: int = 64
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    n: int = 1                        # parallel samples sharing the prompt's KV blocks
    logprobs: int | None = None       # return the sampled token's logprob and the top-N (0: the sampled one only)
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None   # constrain the output to a regex / JSON Schema / choice

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.validate()

    def validate(self) -> None:
        def bad(msg: str) -> None:
            raise ValueError(f"invalid SamplingParams: {msg}")

        def number(name: str, lo: float, hi: float, lo_open: bool = False, hint: str = "") -> None:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) \
                    or v < lo or v > hi or (lo_open and v == lo):
                span = f"{'(' if lo_open else '['}{lo:g}, {hi:g}]" if math.isfinite(hi) else \
                    f"{'>' if lo_open else '>='} {lo:g}"
                bad(f"{name} must be a finite number {'in ' if math.isfinite(hi) else ''}{span}, got {v!r}"
                    + (f" ({hint})" if hint else ""))

        def integer(name: str, lo: int, hint: str = "") -> None:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                bad(f"{name} must be an integer >= {lo}, got {v!r}" + (f" ({hint})" if hint else ""))

        integer("max_tokens", 1)
        number("temperature", 0.0, math.inf, hint="0 means greedy")
        number("top_p", 0.0, 1.0, lo_open=True, hint="1 disables nucleus sampling")
        number("min_p", 0.0, 1.0, hint="0 disables it")
        if self.top_k != -1:
            integer("top_k", 0, "0 or -1 disables it")
        number("repetition_penalty", 0.0, math.inf, lo_open=True, hint="1 disables it")
        number("presence_penalty", -2.0, 2.0, hint="0 disables it")
        number("frequency_penalty", -2.0, 2.0, hint="0 disables it")
        integer("n", 1)
        if self.seed is not None:
            integer("seed", 0)
        if self.logprobs is not None:
            integer("logprobs", 0)
            if self.logprobs > MAX_LOGPROBS:
                bad(f"logprobs must be at most {MAX_LOGPROBS}, got {self.logprobs}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            bad(f"stop must be a list of non-empty strings, got {self.stop!r}")
        if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            bad(f"stop_token_ids must be non-negative token ids, got {self.stop_token_ids!r}")
        if self.structured_outputs is not None:
            if not isinstance(self.structured_outputs, StructuredOutputsParams):
                bad("structured_outputs must be a StructuredOutputsParams (e.g. StructuredOutputsParams(regex=...)),"
                    f" got {type(self.structured_outputs).__name__}")
            self.structured_outputs.validate()
            if self.ignore_eos:
                bad("ignore_eos cannot be combined with structured_outputs: the pattern decides where the output "
                    "ends (EOS is allowed once it is a full match)")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
