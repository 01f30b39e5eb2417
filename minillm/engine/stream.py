"""Token ids -> text for one request: incremental detokenization, stop strings, stop tokens, length limit.

Text that could still turn into a stop string is held back, so a stop string never reaches the caller."""
from __future__ import annotations

from minillm.loading.tokenizer import IncrementalDetokenizer, Tokenizer
from minillm.sampling.params import SamplingParams


class TextStream:
    def __init__(self, tokenizer: Tokenizer | None, params: SamplingParams, eos_token_ids: set[int]) -> None:
        self.params = params
        # Token-id-only engines (tests with tiny random models) have no tokenizer and produce no text.
        self.detok = (IncrementalDetokenizer(tokenizer, skip_special_tokens=params.skip_special_tokens)
                      if tokenizer is not None else None)
        self.stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_token_ids))
        self.holdback = max((len(s) for s in params.stop), default=1) - 1
        self.token_ids: list[int] = []
        self.text = ""            # final text (stop string removed once finished)
        self.emitted = 0          # characters already handed to the caller
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None   # the stop string or (non-EOS) stop token that ended the text
        self.eos_ids = set(eos_token_ids)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def add(self, token_id: int) -> str:
        """Feed one sampled token; return the text delta that is safe to show now."""
        self.token_ids.append(token_id)
        if token_id in self.stop_ids:
            self.finish_reason = "stop"
            if token_id in self.params.stop_token_ids and token_id not in self.eos_ids:
                self.stop_reason = token_id
            self._drain()
        elif self.detok is not None:
            self.detok.add(token_id)
            self.text = self.detok.text
            for s in self.params.stop:
                # search only where a new match can start: the tail that the latest delta could complete
                cut = self.text.find(s, max(0, self.emitted - len(s)))
                if cut != -1:
                    self.text, self.finish_reason, self.stop_reason = self.text[:cut], "stop", s
                    break
        if not self.finished and len(self.token_ids) >= self.params.max_tokens:
            self.finish_reason = "length"
            self._drain()
        return self._flush()

    def _drain(self) -> None:
        # The detokenizer holds back an incomplete trailing character; at the end it is all there is.
        if self.detok is not None:
            self.detok.finish()
            self.text = self.detok.text

    def finish(self, reason: str) -> str:
        """End the stream from outside (e.g. the context window is full); returns the held-back text."""
        if not self.finished:
            self.finish_reason = reason
            self._drain()
        return self._flush()

    @property
    def visible_text(self) -> str:
        return self.text[:self.emitted]

    def _flush(self) -> str:
        safe = len(self.text) if self.finished else max(self.emitted, len(self.text) - self.holdback)
        delta, self.emitted = self.text[self.emitted:safe], safe
        return delta
