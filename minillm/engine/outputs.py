"""What the engine hands back: per-step deltas (streaming) and finished RequestOutputs."""
from __future__ import annotations

from dataclasses import dataclass, field

from minillm.engine.sequence import RequestMetrics


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None


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
