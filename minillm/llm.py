"""The offline API: `LLM(...).generate(prompts, SamplingParams(...))`, continuous batching underneath."""
from __future__ import annotations

import os
import time
import warnings
from typing import Sequence as Seq

from tqdm.auto import tqdm

from minillm.config import EngineConfig
from minillm.engine.outputs import RequestOutput
from minillm.engine.prompt import build_prompt_ids
from minillm.executor import launch
from minillm.interfaces import TensorParallelRules, missing_members
from minillm.sampling.params import SamplingParams


class LLM:
    """Load a model and serve batches of prompts from one paged KV pool.

    Every keyword is an engine setting (minillm.config.EngineConfig, where each default lives), e.g.
    `LLM("default", dtype="bfloat16", max_num_seqs=32, block_size=16, kv_cache_memory="1GiB")`; the pool holds
    as many blocks as fit in kv_cache_memory.

    `tensor_parallel_size=N` / `pipeline_parallel_size=N` run the model over N ranks (local processes by default;
    see ParallelConfig); the API is the same, and `close()` (or a `with` block, or the end of the program) stops
    them. `tp_rules` (interfaces.TensorParallelRules) replaces how the model is sharded (lab09).
    """

    def __init__(self, model: str = "default", *, tp_rules=None, **settings) -> None:
        if not isinstance(model, (str, os.PathLike)):
            raise TypeError(f"model must be 'default', a .gguf file or a Hugging Face directory (a str or path), "
                            f"got {type(model).__name__} {model!r:.60}")
        config = EngineConfig.from_kwargs(**settings)   # validate before the (slow) load
        if tp_rules is not None:
            if not isinstance(tp_rules, TensorParallelRules):
                raise TypeError(f"tp_rules: a {type(tp_rules).__name__} lacks "
                                f"{', '.join(missing_members(tp_rules, TensorParallelRules))} of "
                                "minillm.interfaces.TensorParallelRules")
        self.loaded, self.engine = launch.start_engine(model, config, rules=tp_rules)

    def close(self) -> None:
        """Stop the worker ranks of a parallel engine (a no-op for one process)."""
        self.engine.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What `sampling_params=None` means: the checkpoint's recommended settings (a GGUF file's
        general.sampling.*, a Hugging Face generation_config.json; SmolLM2's model card for the default model) over
        SamplingParams' own defaults."""
        return SamplingParams(**self.loaded.sampling_defaults)

    def generate(self, prompts: str | Seq[str] | Seq[Seq[int]], sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                 use_tqdm: bool = True, chat: bool = False) -> list[RequestOutput]:
        """Raw text (or token ids) in, RequestOutputs out, in the prompts' order. chat=True applies the chat template."""
        if isinstance(prompts, str):
            prompts = [prompts]
        _check_prompts(prompts)
        if chat and not all(isinstance(p, str) for p in prompts):
            raise TypeError("chat=True applies the chat template to text: give str prompts (token ids are sent as "
                            "they are, with chat=False)")
        if chat:
            prompts = [build_prompt_ids(self.tokenizer, p, chat=True) for p in prompts]
        outputs = self._run(list(prompts), sampling_params, use_tqdm)
        if not chat:
            _warn_if_ended_at_once(outputs)
        return outputs

    def chat(self, conversations: Seq[list[dict]] | list[dict], sampling_params=None,
             use_tqdm: bool = True) -> list[RequestOutput]:
        """Each conversation is a list of {"role", "content"} messages; the model's chat template is applied."""
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]
        prompts = [build_prompt_ids(self.tokenizer, list(c)) for c in conversations]
        return self._run(prompts, sampling_params, use_tqdm)

    def _run(self, prompts: list, sampling_params, use_tqdm: bool) -> list[RequestOutput]:
        params = _params_per_prompt(sampling_params, len(prompts), self.get_default_sampling_params)
        for p in params:
            p.validate()
        engine = self.engine
        ids = []
        try:
            for prompt, p in zip(prompts, params):
                ids.append(engine.add_request(prompt, p))
            return self._drain(ids, use_tqdm)
        except BaseException:
            for rid in ids:  # all or nothing: a bad prompt (or Ctrl-C) leaves no work queued and no KV held
                engine.abort(rid)
            raise

    def _drain(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        """Step the engine until every request of `ids` has finished; their outputs in that order."""
        engine = self.engine
        results: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="generating", unit="req", disable=not use_tqdm, dynamic_ncols=True)
        t0, out_tokens = time.perf_counter(), 0
        while engine.has_unfinished_requests():
            done = 0
            for out in engine.step():
                out_tokens += len(out.delta_token_ids)
                if out.finished:
                    results[out.request_id] = out
                    done += 1
            # the rate first, then the count: a bar redraws on update, and must show this step's rate, not 0
            bar.set_postfix(out_tok_s=rate(out_tokens, time.perf_counter() - t0),
                            running=len(engine.scheduler.running), waiting=len(engine.scheduler.waiting), refresh=False)
            bar.update(done)
        bar.close()
        return [results[rid] for rid in ids]


def _warn_if_ended_at_once(outputs: list[RequestOutput]) -> None:
    """An instruct model asked for a raw completion often ends it at once: say why the text is '' (not a bug)."""
    empty = sum(1 for o in outputs for c in o.outputs
                if c.text == "" and c.finish_reason == "stop" and c.stop_reason is None)
    if empty:
        warnings.warn(f"{empty} of the completions are empty: the model emitted its end-of-sequence token first "
                      "(a chat model continuing raw text often does). Ask it through its chat template: "
                      "llm.chat([{'role': 'user', 'content': ...}]) or llm.generate(..., chat=True)", stacklevel=3)


def rate(tokens: int, seconds: float) -> str:
    """Tokens per second for a progress bar: whole numbers from 10 up, two significant digits below, so a slow
    first step (a long prefill, a busy machine) reads 0.4, not 0."""
    r = tokens / max(seconds, 1e-9)
    return f"{r:.0f}" if r >= 10 else f"{r:.2g}"


def _check_prompts(prompts) -> None:
    """The batch's container, before any request is queued: a str, or a list of str / token-id lists."""
    if isinstance(prompts, (bytes, bytearray)):
        raise TypeError("prompts are text (str), not bytes: decode them first (e.g. data.decode('utf-8'))")
    if not isinstance(prompts, (list, tuple)):
        raise TypeError(f"prompts must be a str or a list of prompts (each a str or a list of token ids), got "
                        f"{type(prompts).__name__}")
    if prompts and all(isinstance(p, int) and not isinstance(p, bool) for p in prompts):
        raise TypeError(f"prompts is a list of ints: one prompt of token ids is [[...]], e.g. [{list(prompts)[:3]}]")


def _params_per_prompt(sampling_params, n: int, default=SamplingParams) -> list[SamplingParams]:
    """One SamplingParams per prompt: None (`default()`), one for all, or a list with one each."""
    if sampling_params is None or isinstance(sampling_params, SamplingParams):
        return [sampling_params or default()] * n
    hint = ": build one with SamplingParams(**settings)" if isinstance(sampling_params, dict) else ""
    if not isinstance(sampling_params, (list, tuple)):
        raise TypeError(f"sampling_params must be a SamplingParams or a list of them (one per prompt), got "
                        f"{type(sampling_params).__name__}{hint}")
    wrong = [type(p).__name__ for p in sampling_params if not isinstance(p, SamplingParams)]
    if wrong:
        raise TypeError(f"sampling_params holds {', '.join(sorted(set(wrong)))} items: each must be a SamplingParams")
    if len(sampling_params) != n:
        raise ValueError(f"got {len(sampling_params)} SamplingParams for {n} prompts: give one, or one per prompt")
    return list(sampling_params)
