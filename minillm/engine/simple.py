"""The reference path: one request at a time, a contiguous preallocated KV cache, prefill then decode.

Later engines (paged, batched, speculative) are checked against this one."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Iterator

import torch

from minillm.engine.stream import TextStream
from minillm.kv.contiguous import ContiguousKVCache
from minillm.layers.attention import TorchAttentionBackend
from minillm.models.llama import ForwardContext, LlamaModel
from minillm.sampling.params import SamplingParams
from minillm.sampling.sampler import Sampler, SamplingBatch, make_generator


def eos_token_ids(tokenizer, cfg) -> set[int]:
    """Tokens that end a sequence: the tokenizer's stop tokens, else the config's eos id(s)."""
    if tokenizer is not None:
        return set(tokenizer.stop_token_ids)
    eos = cfg.eos_token_id
    return {eos} if isinstance(eos, int) else set(eos or [])


@dataclass
class StreamEvent:
    token_id: int
    text: str                   # new text since the previous event (may be empty while a character is incomplete)
    finish_reason: str | None   # None while running, else "stop" | "length"


def check_prompt_fits(num_prompt: int, max_model_len: int) -> None:
    if num_prompt == 0:
        raise ValueError("the prompt is empty: give at least one token")
    if num_prompt >= max_model_len:
        raise ValueError(f"the prompt has {num_prompt} tokens but the model's context window is {max_model_len}: "
                         "shorten the prompt (or raise max_model_len if the model supports it)")


class SimpleGenerator:
    """Batch-of-one generation for a loaded model. `stream()` yields tokens as they are produced."""

    def __init__(self, model: LlamaModel, tokenizer, max_model_len: int | None = None, backend=None) -> None:
        """backend: the attention backend (default: the torch reference), e.g. one with a learner's attend_fn."""
        self.model, self.tokenizer = model, tokenizer
        self.max_model_len = max_model_len or model.cfg.max_position_embeddings
        self.backend = backend if backend is not None else TorchAttentionBackend()
        self.sampler = Sampler()
        self.eos_ids = eos_token_ids(tokenizer, model.cfg)
        self.last_timing: dict[str, float] = {}

    def forward_logits(self, cache: ContiguousKVCache, ids: list[int], start: int) -> torch.Tensor:
        """Run `ids` at positions start.. through the model (cache row 0); logits of the last token [V]."""
        meta = cache.metadata([0], [start], [len(ids)])
        x = torch.tensor(ids, dtype=torch.long)
        pos = torch.arange(start, start + len(ids))
        h = self.model(x, pos, ForwardContext(meta, cache, self.backend))
        return self.model.compute_logits(h[-1:])[0]

    def new_cache(self, num_tokens: int) -> ContiguousKVCache:
        return ContiguousKVCache(self.model.cfg, 1, num_tokens, dtype=self.model.dtype)

    def stream_ids(self, prompt_ids: list[int], params: SamplingParams) -> Iterator[int]:
        params.validate()
        check_prompt_fits(len(prompt_ids), self.max_model_len)
        budget = min(len(prompt_ids) + params.max_tokens, self.max_model_len)
        cache = self.new_cache(budget)
        gen = make_generator(params.seed)
        t0 = time.perf_counter()
        logits = self.forward_logits(cache, prompt_ids, 0)
        self.last_timing = {"prefill_s": time.perf_counter() - t0, "prompt_tokens": len(prompt_ids)}
        pos = len(prompt_ids)
        t1 = time.perf_counter()
        steps, out = 0, []
        while True:
            tok = self.sampler(logits[None], SamplingBatch([params], [gen], [prompt_ids], [out])).token_ids[0]
            out.append(tok)
            yield tok
            if pos >= budget:
                return  # context window full; the caller's stop logic ends the stream
            logits = self.forward_logits(cache, [tok], pos)
            pos += 1
            steps += 1
            self.last_timing["decode_s"] = time.perf_counter() - t1
            self.last_timing["decode_steps"] = steps

    def stream(self, prompt_ids: list[int], params: SamplingParams) -> Iterator[StreamEvent]:
        ts = TextStream(self.tokenizer, params, self.eos_ids)
        for tok in self.stream_ids(prompt_ids, params):
            delta = ts.add(tok)
            if len(prompt_ids) + len(ts.token_ids) >= self.max_model_len:
                delta += ts.finish("length")
            yield StreamEvent(tok, delta, ts.finish_reason)
            if ts.finished:
                return

    def generate(self, prompt_ids: list[int], params: SamplingParams) -> tuple[str, list[int]]:
        text, ids = [], []
        for ev in self.stream(prompt_ids, params):
            text.append(ev.text)
            ids.append(ev.token_id)
        return "".join(text), ids
