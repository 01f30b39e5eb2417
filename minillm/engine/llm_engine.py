"""LLMEngine: the step loop. add_request -> step() ... -> outputs; abort at any time.

One step = schedule (the scheduler reserves KV slots) -> one forward pass over every scheduled token (copy-on-write
block copies first) -> the scheduler commits what was computed -> sample the sequences whose computed tokens reached
their end -> detokenize, check stops, free the finished -> tell the step observers.
"""
from __future__ import annotations

import itertools
import time
from typing import Callable, Sequence as Seq

from minillm import interfaces
from minillm.config import EngineConfig
from minillm.engine.model_runner import ModelRunner
from minillm.engine.outputs import CompletionOutput, RequestOutput, SeqSnapshot, StepInfo
from minillm.engine.scheduler import Scheduler
from minillm.engine.sequence import Sequence
from minillm.engine.simple import eos_token_ids
from minillm.engine.stream import TextStream
from minillm.kv.block_manager import BlockManager
from minillm.kv.cache import KVCache
from minillm.layers.attention import get_attention_backend
from minillm.models.llama import LlamaModel
from minillm.sampling.params import SamplingParams
from minillm.sampling.sampler import Sampler, make_generator

# The seams that live inside the block manager: plug(**{name: piece}) builds a BlockManager with them.
BLOCK_MANAGER_SEAMS = ("allocator_cls", "slot_mapping_fn", "hash_fn", "prefix_lookup", "evictor_cls")


class LLMEngine:
    def __init__(self, model: LlamaModel, tokenizer, config: EngineConfig | None = None) -> None:
        self.config = config if config is not None else EngineConfig()
        self.model, self.tokenizer = model, tokenizer
        cfg, cc = model.cfg, self.config.cache
        per_block = KVCache.bytes_per_block(cfg, cc.block_size, model.dtype)
        num_blocks = cc.num_blocks or cc.kv_cache_memory_bytes // per_block
        if num_blocks < 1:
            raise ValueError(f"the KV budget {cc.kv_cache_memory} holds no block of {per_block} bytes: "
                             "raise kv_cache_memory")
        self.kv_cache = KVCache(cfg, num_blocks, cc.block_size, dtype=model.dtype)
        self.runner = ModelRunner(model, self.kv_cache, get_attention_backend(self.config.attention_backend))
        self.scheduler: interfaces.SchedulerPolicy = Scheduler(
            self.config.scheduler, BlockManager(num_blocks, cc.block_size, cc.enable_prefix_caching))
        self.sampler: interfaces.Sampler = Sampler()
        # A sequence may never outgrow the context window, nor the whole pool (else it could not run even alone).
        self.max_model_len = min(self.config.max_model_len or cfg.max_position_embeddings,
                                 num_blocks * cc.block_size)
        self.eos_ids = eos_token_ids(tokenizer, cfg)
        self.requests: dict[str, list[Sequence]] = {}
        self._ids = itertools.count()
        self._observers: list[interfaces.StepObserver] = []
        self.num_steps = 0

    @classmethod
    def from_model(cls, model: LlamaModel, tokenizer=None, **settings) -> "LLMEngine":
        """An engine for an already loaded model; `settings` are EngineConfig's flat names (block_size=...,
        num_blocks=..., max_num_seqs=...), anything omitted keeps EngineConfig's default."""
        return cls(model, tokenizer, EngineConfig.from_kwargs(**settings))

    @property
    def block_manager(self) -> interfaces.BlockManager:
        """The scheduler's block manager (read-only here: the scheduler alone calls it during a step)."""
        return self.scheduler.block_manager

    @property
    def backend(self) -> interfaces.AttentionBackend:
        return self.runner.backend

    # ------------------------------------------------------------------ requests
    def add_request(self, prompt: str | Seq[int], params: SamplingParams | None = None,
                    request_id: str | None = None, arrival_time: float | None = None) -> str:
        """Queue a request. Everything is validated here, before any KV block is allocated."""
        params = params or SamplingParams()
        params.validate()
        request_id = str(next(self._ids)) if request_id is None else str(request_id)
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        ids = self._encode(prompt)
        self._check_prompt(ids)
        seq = Sequence(request_id, ids, params, TextStream(self.tokenizer, params, self.eos_ids),
                       make_generator(params.seed), arrival_time)
        self.requests[request_id] = [seq]
        self.scheduler.add(seq)
        return request_id

    def _encode(self, prompt: str | Seq[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this engine has no tokenizer: pass token ids instead of text")
            return self.tokenizer.encode(prompt)
        ids = [int(t) for t in prompt]
        bad = [t for t in ids if not 0 <= t < self.model.cfg.vocab_size]
        if bad:
            raise ValueError(f"token ids {bad[:5]} are outside the vocabulary [0, {self.model.cfg.vocab_size})")
        return ids

    def _check_prompt(self, ids: list[int]) -> None:
        n, pool = len(ids), self.block_manager.num_blocks * self.block_manager.block_size
        if n == 0:
            raise ValueError("the prompt is empty: give at least one token")
        if n >= self.max_model_len:
            limit = "KV pool" if self.max_model_len == pool else "context window"
            raise ValueError(f"the prompt has {n} tokens but the {limit} holds {self.max_model_len} "
                             f"(model context {self.model.cfg.max_position_embeddings}, KV pool {pool} tokens): "
                             "shorten the prompt or give the engine a larger KV budget")
        sc = self.config.scheduler
        if not sc.enable_chunked_prefill and n > sc.max_num_batched_tokens:
            raise ValueError(f"the prompt has {n} tokens, more than max_num_batched_tokens="
                             f"{sc.max_num_batched_tokens}, and chunked prefill is off: enable it or raise the budget")

    def abort(self, request_id: str) -> None:
        """Stop a request and free all its blocks at once. Unknown ids are ignored."""
        self.scheduler.abort(str(request_id))
        self.requests.pop(str(request_id), None)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # ------------------------------------------------------------------ the loop
    def step(self) -> list[RequestOutput]:
        t0 = time.perf_counter()
        sch = self.scheduler
        before = self._queue_snapshot() if self._observers else None
        sched = sch.schedule()
        if sched.is_empty:
            if sch.running or sch.waiting:
                raise RuntimeError("scheduler made no progress: the KV pool cannot hold the next request")
            return []
        self.num_steps += 1
        seqs, logits = self.runner.execute(sched)
        sch.commit(sched)
        now = time.perf_counter()
        for seq, _ in sched.scheduled:
            if seq.metrics.first_scheduled_time is None:
                seq.metrics.first_scheduled_time = now
        rows, row_seqs = [], []
        for i, seq in enumerate(seqs):
            rows.append(i)
            row_seqs.append(seq)
            for k in range(1, seq.pending_forks + 1):   # n > 1: children share the prompt's blocks
                rows.append(i)
                row_seqs.append(self._fork(seq, k))
            seq.pending_forks = 0
        tokens = self.sampler(logits[rows], [s.params for s in row_seqs], [s.generator for s in row_seqs])
        deltas: dict[int, tuple[str, int]] = {}
        for seq, tok in zip(row_seqs, tokens):
            deltas[seq.seq_id] = (self._append_token(seq, tok, now), tok)
        outputs = [self._output(rid, deltas) for rid in dict.fromkeys(s.request_id for s in row_seqs)]
        if before is not None:
            info = StepInfo(self.num_steps, sched, *before, time.perf_counter() - t0, outputs)
            for fn in list(self._observers):
                fn(info)
        return outputs

    def _queue_snapshot(self) -> tuple[list[SeqSnapshot], list[SeqSnapshot], int]:
        sch = self.scheduler
        snap = [[SeqSnapshot(s, s.num_computed_tokens, s.num_tokens) for s in q] for q in (sch.running, sch.waiting)]
        return snap[0], snap[1], self.block_manager.num_free_blocks

    def add_step_observer(self, fn: Callable[[StepInfo], None]) -> Callable[[StepInfo], None]:
        """Call fn(StepInfo) at the end of every step from now on (to watch the engine work without patching
        it). Returns fn, so it can be used as a decorator; remove_step_observer(fn) stops it."""
        if not callable(fn):
            raise TypeError(f"a step observer must be callable, got {type(fn).__name__}")
        self._observers.append(fn)
        return fn

    def remove_step_observer(self, fn: Callable[[StepInfo], None]) -> None:
        self._observers.remove(fn)

    def _fork(self, parent: Sequence, k: int) -> Sequence:
        p = parent.params
        child = Sequence(parent.request_id, parent.prompt_token_ids, p, TextStream(self.tokenizer, p, self.eos_ids),
                         make_generator(None if p.seed is None else p.seed + k), parent.metrics.arrival_time, index=k)
        child.token_ids = list(parent.token_ids)
        child.num_computed_tokens = parent.num_computed_tokens
        child.metrics.first_scheduled_time = parent.metrics.first_scheduled_time
        child.metrics.num_cached_tokens = parent.metrics.num_cached_tokens
        self.scheduler.fork(parent, child)
        self.requests[parent.request_id].append(child)
        return child

    def _append_token(self, seq: Sequence, tok: int, now: float) -> str:
        seq.token_ids.append(tok)
        m = seq.metrics
        if m.first_token_time is None:
            m.first_token_time = now
        m.token_times.append(now)
        delta = seq.text.add(tok)
        if not seq.text.finished and seq.num_tokens >= self.max_model_len:
            delta += seq.text.finish("length")
        if seq.text.finished:
            m.finished_time = now
            self.scheduler.finish(seq)
        return delta

    def _output(self, request_id: str, deltas: dict[int, tuple[str, int]]) -> RequestOutput:
        seqs = sorted(self.requests[request_id], key=lambda s: s.index)
        outs = [CompletionOutput(s.index, s.text.visible_text, s.output_token_ids, s.text.finish_reason)
                for s in seqs]
        finished = all(s.is_finished for s in seqs) and len(seqs) == seqs[0].params.n
        if finished:
            del self.requests[request_id]
        first = seqs[0]
        delta_text, tok = deltas.get(first.seq_id, ("", None))
        return RequestOutput(request_id, first.prompt_token_ids, outs, finished, first.metrics,
                             delta_text=delta_text, delta_token_ids=[] if tok is None else [tok])

    # ------------------------------------------------------------------ swapping parts (labs, experiments)
    def plug(self, *, block_manager: interfaces.BlockManager | None = None,
             scheduler: interfaces.SchedulerPolicy | None = None, backend: interfaces.AttentionBackend | None = None,
             sampler: interfaces.Sampler | None = None, **block_manager_seams) -> None:
        """Replace a component with another implementation of the same interface (e.g. a learner's).

        block_manager / scheduler / backend / sampler: the component itself. allocator_cls, slot_mapping_fn,
        hash_fn, prefix_lookup, evictor_cls: a fresh BlockManager for this pool built with those pieces.
        Only while idle: the KV pool's contents are owned by the block manager that wrote them."""
        unknown = set(block_manager_seams) - set(BLOCK_MANAGER_SEAMS)
        if unknown:
            raise TypeError(f"plug() got unknown seam(s) {sorted(unknown)}; it takes block_manager, scheduler, "
                            f"backend, sampler and the block manager's {', '.join(BLOCK_MANAGER_SEAMS)}")
        if self.has_unfinished_requests():
            raise RuntimeError("plug() needs an idle engine: finish or abort the running requests first")
        for obj, protocol, what in ((block_manager, interfaces.BlockManager, "block_manager"),
                                    (scheduler, interfaces.SchedulerPolicy, "scheduler"),
                                    (backend, interfaces.AttentionBackend, "backend"),
                                    (sampler, interfaces.Sampler, "sampler")):
            if obj is not None and not isinstance(obj, protocol):
                raise TypeError(f"plug({what}=...): a {type(obj).__name__} lacks "
                                f"{', '.join(interfaces.missing_members(obj, protocol))} of minillm.interfaces."
                                f"{protocol.__name__}")
        if block_manager_seams:
            if block_manager is not None:
                raise TypeError("plug() takes either a block_manager or block-manager seams, not both")
            cc = self.config.cache
            block_manager = BlockManager(self.kv_cache.num_blocks, cc.block_size, cc.enable_prefix_caching,
                                         **block_manager_seams)
        if block_manager is not None and (block_manager.num_blocks, block_manager.block_size) != \
                (self.kv_cache.num_blocks, self.kv_cache.block_size):
            raise ValueError(f"the block manager must manage the pool's {self.kv_cache.num_blocks} blocks of "
                             f"{self.kv_cache.block_size} tokens (got {block_manager.num_blocks} of "
                             f"{block_manager.block_size})")
        if scheduler is not None:
            scheduler.block_manager = block_manager or self.block_manager
            self.scheduler = scheduler
        elif block_manager is not None:
            self.scheduler.block_manager = block_manager
        if backend is not None:
            self.runner.backend = backend
        if sampler is not None:
            self.sampler = sampler

    # ------------------------------------------------------------------ introspection
    def kv_usage(self) -> dict:
        u = self.block_manager.usage()
        u["tokens_capacity"] = self.block_manager.num_blocks * self.block_manager.block_size
        u["bytes_capacity"] = self.kv_cache.nbytes
        u["prefix_cache"] = self.block_manager.stats
        return u

    def block_tables(self) -> dict[str, list[list[int]]]:
        """request id -> block table of each of its running sequences."""
        return {rid: [self.block_manager.block_table(s.seq_id) for s in seqs if self.block_manager.has_seq(s.seq_id)]
                for rid, seqs in self.requests.items()}
