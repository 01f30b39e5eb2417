"""What the engine hands back: per-step deltas (streaming) and finished RequestOutputs."""
from __future__ import annotations

from dataclasses import dataclass, field

from minillm.engine.sequence import RequestMetrics


@dataclass(frozen=True)
class Logprob:
    """A token's log-probability under the model (raw logits, before any sampling transform), its rank among all
    tokens (1 = most likely), and its text."""
    logprob: float
    rank: int
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    # With SamplingParams(logprobs=N), per output token as vLLM returns them: {token id: Logprob} holding the
    # sampled token and the N most likely ones (N + 1 entries, or N when the sampled token is among them).
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None
    # What ended a "stop": the stop string or stop token id (as vLLM); None for EOS and for a structured output
    # whose pattern completed. So finish_reason == "stop" and stop_reason is None means a complete output.
    stop_reason: int | str | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    # Streaming: what this step added (for n = 1, the first completion's).
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids


@dataclass(frozen=True)
class SeqSnapshot:
    """One queued sequence as it stood when a step began."""
    seq: object                 # the Sequence (it has moved on since: read the numbers below instead)
    num_computed_tokens: int
    num_tokens: int

    @property
    def request_id(self) -> str:
        return self.seq.request_id


@dataclass
class StepInfo:
    """What a step observer receives at the end of every engine step (engine.add_step_observer)."""
    step: int                               # 1, 2, ... (LLMEngine.num_steps after this step)
    scheduler_output: object                # the step's SchedulerOutput: scheduled (seq, n), preempted, ...
    running_before: list[SeqSnapshot]       # the queues when the step began: running oldest first,
    waiting_before: list[SeqSnapshot]       # waiting head first
    num_free_blocks_before: int
    seconds: float                          # wall time of the whole step (schedule, forward, sample, detokenize)
    outputs: list[RequestOutput]            # what step() returned
