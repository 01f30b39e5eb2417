"""SamplingParams: what the caller asks for, validated before any KV block is touched."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from minillm.structured.params import StructuredOutputsParams

MAX_LOGPROBS = 20   # like vLLM's default max_logprobs: the top-N list costs a top-k over the vocabulary per token
# The sampler divides fp32 logits by the temperature and the repetition penalty: below 0.01 (vLLM clamps there too)
# or above 100 a row's logits overflow to inf or lose every difference, and the draw is garbage instead of an error.
MIN_TEMPERATURE, MAX_TEMPERATURE = 0.01, 100.0
MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY = 0.01, 100.0
MAX_TOP_K = 2**31 - 1   # any k at or past the vocabulary keeps every token; the sampler holds k in an int64 tensor
MAX_SEED = 2**64 - 1    # torch.Generator.manual_seed's range
MAX_N = 1024            # samples per prompt: each is a sequence of its own (pass@k evaluations use up to a few hundred)


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
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the first bad field and its valid range. Called again before a request runs (the
        fields may have been changed since); normalizes `stop` given as one string or a tuple to a list."""
        def bad(msg: str) -> None:
            raise ValueError(f"invalid SamplingParams: {msg}")

        def is_int(v) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        def number(name: str, lo: float, hi: float, lo_open: bool = False, hint: str = "") -> None:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) \
                    or v < lo or v > hi or (lo_open and v == lo):
                bad(f"{name} must be a finite number in {'(' if lo_open else '['}{lo:g}, {hi:g}], got {v!r}"
                    + (f" ({hint})" if hint else ""))

        def integer(name: str, lo: int, hi: int | None = None, hint: str = "") -> None:
            v = getattr(self, name)
            if not is_int(v) or v < lo or (hi is not None and v > hi):
                span = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
                bad(f"{name} must be an integer {span}, got {v!r}" + (f" ({hint})" if hint else ""))

        def flag(name: str) -> None:
            v = getattr(self, name)
            if not isinstance(v, bool):
                bad(f"{name} must be True or False, got {v!r}")

        integer("max_tokens", 1)
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or \
                not (t == 0 or MIN_TEMPERATURE <= t <= MAX_TEMPERATURE):
            bad(f"temperature must be 0 (greedy) or a finite number in [{MIN_TEMPERATURE:g}, {MAX_TEMPERATURE:g}], "
                f"got {t!r}")
        number("top_p", 0.0, 1.0, lo_open=True, hint="1 disables nucleus sampling")
        number("min_p", 0.0, 1.0, hint="0 disables it")
        if not (is_int(self.top_k) and self.top_k == -1):
            integer("top_k", 0, MAX_TOP_K, "0 or -1 disables it")
        number("repetition_penalty", MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY, hint="1 disables it")
        number("presence_penalty", -2.0, 2.0, hint="0 disables it")
        number("frequency_penalty", -2.0, 2.0, hint="0 disables it")
        integer("n", 1, MAX_N)
        if self.seed is not None:
            integer("seed", 0, MAX_SEED, "or None for an unseeded request")
        if self.logprobs is not None:
            integer("logprobs", 0, MAX_LOGPROBS, "or None for no logprobs")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not isinstance(self.stop, (list, tuple)) or any(not isinstance(s, str) or not s for s in self.stop):
            bad(f"stop must be a string or a list of non-empty strings, got {self.stop!r}")
        self.stop = list(self.stop)
        if not isinstance(self.stop_token_ids, (list, tuple)) or \
                any(not is_int(t) or t < 0 for t in self.stop_token_ids):
            bad(f"stop_token_ids must be a list of token ids (integers >= 0), got {self.stop_token_ids!r}")
        self.stop_token_ids = list(self.stop_token_ids)
        flag("ignore_eos")
        flag("skip_special_tokens")
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
