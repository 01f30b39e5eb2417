"""A Sequence is one stream of tokens the scheduler moves through WAITING -> RUNNING -> FINISHED.

A request with n > 1 owns n sequences (forked from the first after its prompt is computed)."""
from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field

import torch

from minillm.engine.stream import TextStream
from minillm.sampling.params import SamplingParams
from minillm.spec_decode.draft import SpecState, SpecStats
from minillm.structured.matcher import Matcher

_seq_ids = itertools.count()


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    token_times: list[float] = field(default_factory=list)
    finished_time: float | None = None
    num_preemptions: int = 0
    num_cached_tokens: int = 0   # prompt tokens served from the prefix cache
    spec: SpecStats = field(default_factory=SpecStats)   # speculative decoding: drafted / accepted tokens

    @property
    def spec_acceptance_rate(self) -> float | None:
        """Accepted drafts / drafted tokens (None without speculation)."""
        return self.spec.acceptance_rate

    @property
    def ttft(self) -> float | None:
        """Time to first token: arrival -> first output token (queueing + prefill)."""
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def itl(self) -> list[float]:
        """Inter-token latencies: gaps between consecutive output tokens."""
        return [b - a for a, b in zip(self.token_times, self.token_times[1:])]

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first: (finish - first token) / (tokens - 1)."""
        n = len(self.token_times)
        if n < 2:
            return None
        return (self.token_times[-1] - self.token_times[0]) / (n - 1)

    @property
    def e2e(self) -> float | None:
        return None if self.finished_time is None else self.finished_time - self.arrival_time


class Sequence:
    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 text: TextStream, generator: torch.Generator | None, arrival_time: float | None = None,
                 index: int = 0) -> None:
        self.seq_id = next(_seq_ids)
        self.request_id, self.index = request_id, index
        self.prompt_token_ids = list(prompt_token_ids)
        self.token_ids = list(prompt_token_ids)   # prompt + output; what the KV cache must hold
        self.params, self.text, self.generator = params, text, generator
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0
        self.metrics = RequestMetrics(arrival_time if arrival_time is not None else time.perf_counter())
        self.pending_forks = params.n - 1 if index == 0 else 0
        self.spec = SpecState()            # speculative decoding: the guesses verified in the next step
        self.logprobs: list[dict] = []     # per output token {token id: Logprob}, when params.logprobs is set
        self.cumulative_logprob = 0.0
        self.matcher: Matcher | None = None   # structured outputs: the automaton state (None: unconstrained)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def num_uncomputed(self) -> int:
        """Positions still to compute: the tokens not in the KV cache yet, plus any speculative guesses after them."""
        return self.num_tokens - self.num_computed_tokens + len(self.spec.token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        """The tokens a forward pass reads: token_ids, then the speculative guesses."""
        return self.token_ids + self.spec.token_ids if self.spec.token_ids else self.token_ids

    def __repr__(self) -> str:
        return (f"Sequence(id={self.seq_id}, req={self.request_id!r}, {self.status.value}, "
                f"tokens={self.num_tokens}, computed={self.num_computed_tokens})")
