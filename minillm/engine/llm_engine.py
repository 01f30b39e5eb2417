"""LLMEngine: the step loop. add_request -> step() ... -> outputs; abort at any time.

One step = schedule -> run -> sample -> commit -> finish:
  the speculator drafts guesses for the decoding sequences (NoSpeculation: none) -> the scheduler picks the step's
  tokens and reserves their KV slots -> the model runner runs one forward pass over them (copy-on-write block
  copies first) -> the sampler draws for the sequences whose computed tokens reached their end (structured outputs
  mask their rows first; rows of guesses are verified by the speculator's rejection sampler) -> tokens are appended,
  detokenized and checked for stops -> the scheduler commits what became real tokens and frees the finished ->
  the step observers hear about it.
Features compose through objects that are always there (a speculator, a per-sequence matcher or None handled in
the helpers), so the step itself reads the same with every feature on or off.
"""
from __future__ import annotations

import dataclasses
import itertools
import operator
import time
from collections.abc import Mapping
from typing import Callable, Sequence as Seq

import torch

from minillm import interfaces
from minillm.config import EngineConfig, use_kernels
from minillm.distributed.device import engine_device, module_device
from minillm.engine.inputs import prepare_inputs
from minillm.engine.outputs import CompletionOutput, Logprob, RequestOutput, SeqSnapshot, StepInfo
from minillm.engine.scheduler import Scheduler, SchedulerOutput
from minillm.engine.sequence import Sequence
from minillm.engine.simple import eos_token_ids
from minillm.engine.stream import TextStream
from minillm.kernels import cpu_qgemm
from minillm.kv.block_manager import BlockManager
from minillm.kv.cache import KVCache, pool_dtype
from minillm.layers.attention import get_attention_backend
from minillm.models.llama import LlamaModel
from minillm.sampling.params import SamplingParams
from minillm.sampling.sampler import Sampler, SamplingBatch, TokenLogprobs, make_generator
from minillm.spec_decode.decoder import NoSpeculation, SpecDecoder
from minillm.spec_decode.proposers import ProposerContext, build_proposer
from minillm.structured.matcher import StructuredOutputManager
from minillm.worker.model_runner import build_runner

# The seams that live inside the block manager: plug(**{name: piece}) builds a BlockManager with them.
# Past TILES_MAX_ROWS rows the batched quantized kernels leave their tiles for the int16 path: a prompt step this
# long takes it, and builds its packed copy.
WARM_UP_PROMPT_LEN = 2 * cpu_qgemm.TILES_MAX_ROWS
BLOCK_MANAGER_SEAMS = ("allocator_cls", "slot_mapping_fn", "hash_fn", "prefix_lookup", "evictor_cls")


def _token_id(t, position: int) -> int:
    """An int, a numpy integer or a one-element integer tensor as an int; anything else (1.5, '12', True, nan) is a
    ValueError rather than silently rounded or parsed."""
    try:
        if isinstance(t, bool):
            raise TypeError
        return operator.index(t)
    except (TypeError, ValueError, RuntimeError):
        raise ValueError(f"token ids must be integers, got {t!r} ({type(t).__name__}) at position {position} of the "
                         "prompt") from None


class LLMEngine:
    """`model` is the whole model, or rank 0's shard when `workers` (executor/workers.py) run the other ranks: then
    this engine schedules and samples for all of them and every step is broadcast to them first. The KV budget is
    per rank (each holds its KV heads' or its layers' slice of every block)."""

    def __init__(self, model: LlamaModel, tokenizer, config: EngineConfig | None = None, workers=None) -> None:
        self.config = config if config is not None else EngineConfig()
        use_kernels(self.config.kernels)       # the CPU kernels are process-wide
        self.model, self.tokenizer, self.workers = model, tokenizer, workers
        # a parallel engine's ranks loaded their shards onto their own devices (executor/workers.py)
        self.device = module_device(model) if workers is not None else engine_device(self.config.device, model)
        cfg, cc = model.cfg, self.config.cache
        kv_dtype = pool_dtype(cc.kv_cache_dtype, model.dtype)
        per_block = KVCache.bytes_per_block(model.kv_cfg, cc.block_size, kv_dtype)
        num_blocks = cc.num_blocks or cc.kv_cache_memory_bytes // per_block
        if num_blocks < 1:
            raise ValueError(f"the KV budget {cc.kv_cache_memory} holds no block of {per_block} bytes: "
                             "raise kv_cache_memory")
        self.runner = build_runner(model, self.config, num_blocks, workers.comm if workers is not None else None,
                                   driver=workers, device=self.device)
        self.kv_cache = self.runner.kv_cache
        if workers is not None:
            workers.init(num_blocks)              # every rank sizes its slice of the pool alike
        self.scheduler: interfaces.SchedulerPolicy = Scheduler(
            self.config.scheduler, BlockManager(num_blocks, cc.block_size, cc.enable_prefix_caching))
        self.sampler: interfaces.Sampler = Sampler()
        # A sequence may never outgrow the context window, nor the whole pool (else it could not run even alone).
        self.max_model_len = min(self.config.max_model_len or cfg.max_position_embeddings,
                                 num_blocks * cc.block_size)
        if self.device.type == "cuda" and not self.config.enforce_eager:   # decode steps replay CUDA graphs
            self.runner.capture_cuda_graphs(self.max_model_len, self.config.scheduler.max_num_seqs)
        self.eos_ids = eos_token_ids(tokenizer, cfg)
        self.structured = StructuredOutputManager(tokenizer)
        self.requests: dict[str, list[Sequence]] = {}
        self._ids = itertools.count()
        self._observers: list[interfaces.StepObserver] = []
        self.num_steps = 0
        self.spec: SpecDecoder | NoSpeculation = self._speculator(num_blocks)

    def _speculator(self, num_blocks: int) -> SpecDecoder | NoSpeculation:
        spec = self.config.speculative
        if spec is None:
            return NoSpeculation()
        if spec.k_max + 1 > self.config.scheduler.max_num_batched_tokens:
            raise ValueError(f"num_speculative_tokens={spec.num_speculative_tokens} needs a step budget of at "
                             f"least {spec.k_max + 1} tokens (max_num_batched_tokens="
                             f"{self.config.scheduler.max_num_batched_tokens}): raise it or draft fewer tokens")
        ctx = ProposerContext(self.model, self.tokenizer, num_blocks, self.config.cache.block_size,
                              get_attention_backend(self.config.attention_backend, self.device,
                                                    self.config.cache.block_size))
        return SpecDecoder(spec, build_proposer(spec, ctx), self.model.cfg.vocab_size)

    @classmethod
    def from_model(cls, model: LlamaModel, tokenizer=None, **settings) -> "LLMEngine":
        """An engine for an already loaded model; `settings` are EngineConfig's flat names (block_size=...,
        num_blocks=..., max_num_seqs=...), anything omitted keeps EngineConfig's default."""
        return cls(model, tokenizer, EngineConfig.from_kwargs(**settings))

    def close(self) -> None:
        """Stop the worker ranks of a parallel engine (nothing to do for a single-process one)."""
        if self.workers is not None:
            self.workers.close()

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
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams (or None for the defaults), got {type(params).__name__}")
        params.validate()
        request_id = str(next(self._ids)) if request_id is None else str(request_id)
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        ids = self._encode(prompt)
        self._check_prompt(ids)
        bad = [t for t in params.stop_token_ids if t >= self.model.cfg.vocab_size]
        if bad:
            raise ValueError(f"stop_token_ids {bad[:5]} are outside the vocabulary [0, {self.model.cfg.vocab_size})")
        # the automaton and its token index are built (or found in the cache) now: a bad pattern fails here
        matcher = self.structured.matcher(params.structured_outputs) if params.structured_outputs else None
        seq = Sequence(request_id, ids, params, TextStream(self.tokenizer, params, self.eos_ids),
                       make_generator(params.seed, self.device), arrival_time)
        seq.matcher = matcher
        self.requests[request_id] = [seq]
        self.scheduler.add(seq)
        return request_id

    def _encode(self, prompt: str | Seq[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this engine has no tokenizer: pass token ids instead of text")
            return self.tokenizer.encode(prompt)
        if isinstance(prompt, (bytes, bytearray, Mapping)) or not hasattr(prompt, "__iter__"):
            raise TypeError(f"a prompt is text (str) or a list of token ids, got {type(prompt).__name__}"
                            + (": decode the bytes to str first" if isinstance(prompt, (bytes, bytearray)) else ""))
        ids = [_token_id(t, i) for i, t in enumerate(prompt)]
        bad = [t for t in ids if not 0 <= t < self.model.cfg.vocab_size]
        if bad:
            raise ValueError(f"token ids {bad[:5]} are outside the vocabulary [0, {self.model.cfg.vocab_size})")
        return ids

    def _check_prompt(self, ids: list[int]) -> None:
        n, pool = len(ids), self.block_manager.num_blocks * self.block_manager.block_size
        if n == 0:
            raise ValueError("the prompt is empty: give at least one token")
        if n >= self.max_model_len:
            context = self.model.cfg.max_position_embeddings
            if self.max_model_len == pool:
                limit, fix = "KV pool", ("give the engine a larger KV budget (kv_cache_memory / --kv-cache-memory, "
                                         "or num_blocks)")
            elif self.max_model_len < context:
                limit, fix = "max_model_len", f"raise max_model_len (--max-model-len; the model allows {context})"
            else:
                limit, fix = "model's context window", "this model cannot take it"
            raise ValueError(f"the prompt has {n} tokens and needs room for at least one generated token, but the "
                             f"{limit} holds {self.max_model_len} (model context {context}, KV pool {pool} tokens): "
                             f"shorten the prompt, or {fix}")
        sc = self.config.scheduler
        if not sc.enable_chunked_prefill and n > sc.max_num_batched_tokens:
            raise ValueError(f"the prompt has {n} tokens, more than max_num_batched_tokens="
                             f"{sc.max_num_batched_tokens}, and chunked prefill is off: enable it or raise the budget")

    def abort(self, request_id: str) -> None:
        """Stop a request and free all its blocks at once. Unknown ids are ignored."""
        for seq in self.scheduler.abort(str(request_id)):
            self.spec.drop(seq)
        self.requests.pop(str(request_id), None)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def warm_up(self, prompt_len: int = WARM_UP_PROMPT_LEN) -> None:
        """Pay for lazy initialization before anything is served or timed: the kernels' thread team, the allocator,
        and the quantized weights' packed copies, which the first prompt step past the tiles' 64 rows and the first
        batched decode step build (SmolLM2's int16 copy: ~250 ms, once). One request of `prompt_len` prompt tokens,
        then three short ones decoding together, run to the end; the prefix cache and the step count are reset
        after. On an idle engine only."""
        if self.has_unfinished_requests():
            raise RuntimeError("warm_up() needs an idle engine: call it before adding requests")
        vocab = self.model.cfg.vocab_size
        longest = max(1, min(prompt_len, self.max_model_len - 5))
        for wave in ([longest], [min(24, longest)] * 3):
            for k, n in enumerate(wave):
                self.add_request([3 + (k * 7 + j) % (vocab - 3) for j in range(n)],
                                 SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
            while self.has_unfinished_requests():
                self.step()
        self.block_manager.reset_prefix_cache()
        self.num_steps = 0

    # ------------------------------------------------------------------ the loop
    def step(self) -> list[RequestOutput]:
        t0 = time.perf_counter()
        self.spec.propose(self.scheduler.running, self.max_model_len)
        before = self._queue_snapshot() if self._observers else None
        sched = self.scheduler.schedule()
        self._resume_preempted(sched.preempted)
        if sched.is_empty:
            if self.has_unfinished_requests():
                raise RuntimeError("scheduler made no progress: the KV pool cannot hold the next request")
            return []
        self.num_steps += 1
        inputs, rows, seqs = prepare_inputs(sched)
        logits = self.runner.execute(inputs)
        now = time.perf_counter()
        self._mark_scheduled(sched, now)
        emitted, children, verified = self._sample(seqs, rows, logits)
        appended, deltas = self._commit(sched, emitted, children, verified, now)
        outputs = [self._output(rid, deltas) for rid in dict.fromkeys(s.request_id for s in appended)]
        if before is not None:
            self._notify(StepInfo(self.num_steps, sched, *before, time.perf_counter() - t0, outputs))
        return outputs

    def _resume_preempted(self, preempted: list[Sequence]) -> None:
        """A preempted sequence's KV is gone: it comes back as a prompt, guesses redrawn, and its automaton state is
        re-derived from the output it keeps."""
        for seq in preempted:
            self.spec.drop(seq)
            if seq.matcher is not None:
                seq.matcher.replay(seq.output_token_ids)

    def _commit(self, sched: SchedulerOutput, emitted: dict[Sequence, tuple[list[int], list]],
                children: list[tuple[Sequence, Sequence]], verified: set[Sequence], now: float
                ) -> tuple[dict[Sequence, list[int]], dict[int, tuple[str, list[int]]]]:
        """Append the step's tokens, commit what became real to the scheduler, fork n > 1 children, finish."""
        sch = self.scheduler
        appended: dict[Sequence, list[int]] = {}
        deltas: dict[int, tuple[str, list[int]]] = {}
        for seq, (toks, lps) in emitted.items():
            text, appended[seq] = self._append_tokens(seq, toks, lps, now)
            deltas[seq.seq_id] = (text, appended[seq])
        # The KV of every scheduled position was written; keep only what became real tokens: for a sequence with
        # guesses, its last token and the accepted guesses (the scheduler rolls the rest back).
        sch.commit(dataclasses.replace(sched, scheduled=[(s, len(appended[s]) if s in verified else n)
                                                         for s, n in sched.scheduled]))
        for parent, child in children:           # n > 1: children share the prompt's blocks
            child.num_computed_tokens = parent.num_computed_tokens
            sch.fork(parent, child)
        for seq in appended:
            if seq.text.finished:
                sch.finish(seq)
        self.spec.after_step(appended, verified, sched.scheduled)
        return appended, deltas

    @staticmethod
    def _mark_scheduled(sched: SchedulerOutput, now: float) -> None:
        for seq, _ in sched.scheduled:
            if seq.metrics.first_scheduled_time is None:
                seq.metrics.first_scheduled_time = now

    def _notify(self, info: StepInfo) -> None:
        for fn in list(self._observers):
            fn(info)

    def _sample(self, seqs: list[Sequence], rows: list[list[int]], logits: torch.Tensor):
        """Tokens for every sequence that reached its end this step: {seq: (tokens, logprobs)}, the n > 1 children
        made from parents whose prompt just finished, and the sequences whose guesses were verified."""
        plain_rows, plain = [], []
        children: list[tuple[Sequence, Sequence]] = []
        spec_items = []
        for seq, rs in zip(seqs, rows):
            if len(rs) > 1:
                spec_items.append((seq, rs))
                continue
            plain_rows.append(rs[0])
            plain.append(seq)
            for k in range(1, seq.pending_forks + 1):
                child = self._new_child(seq, k)
                children.append((seq, child))
                plain_rows.append(rs[0])
                plain.append(child)
            seq.pending_forks = 0
        self._mask_constrained(plain, plain_rows, spec_items, logits)
        emitted: dict[Sequence, tuple[list[int], list]] = {}
        if plain:
            batch = SamplingBatch([s.params for s in plain], [s.generator for s in plain],
                                  [s.prompt_token_ids for s in plain], [s.output_token_ids for s in plain])
            out = self.sampler(logits[plain_rows], batch)
            if len(out.token_ids) != len(plain):
                raise ValueError(f"the sampler returned {len(out.token_ids)} tokens for {len(plain)} rows")
            for s, t, lp in zip(plain, out.token_ids, out.logprobs):
                emitted[s] = ([int(t)], [lp])
        verified = set()
        for seq, (toks, lps, _) in self.spec.verify(spec_items, logits, self.sampler).items():
            emitted[seq] = (toks, lps)
            verified.add(seq)
        return emitted, children, verified

    def _mask_constrained(self, plain: list[Sequence], plain_rows: list[int],
                          spec_items: list[tuple[Sequence, list[int]]], logits: torch.Tensor) -> None:
        """Structured outputs: -inf on every token a constrained row's automaton state does not allow, for all
        constrained rows of the step at once. A row verifying guesses sees the state after the guesses before it;
        rows after a forbidden guess stay unmasked: that guess is rejected for certain and they are never read."""
        rows, items = [], []
        for seq, r in zip(plain, plain_rows):
            if seq.matcher is not None:
                rows.append(r)
                items.append((seq.matcher.index, seq.matcher.state))
        for seq, rs in spec_items:
            if seq.matcher is not None:
                states = seq.matcher.walk(seq.spec.token_ids[:len(rs) - 1])
                rows += rs[:len(states)]
                items += [(seq.matcher.index, s) for s in states]
        self.structured.apply_masks(logits, rows, items)

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

    def _new_child(self, parent: Sequence, k: int) -> Sequence:
        """The k-th extra sample of an n > 1 request (joins the scheduler once its parent's prompt is committed)."""
        p = parent.params
        child = Sequence(parent.request_id, parent.prompt_token_ids, p, TextStream(self.tokenizer, p, self.eos_ids),
                         make_generator(None if p.seed is None else p.seed + k, self.device), parent.metrics.arrival_time,
                         index=k)
        child.token_ids = list(parent.token_ids)
        child.matcher = parent.matcher.copy() if parent.matcher is not None else None
        child.metrics.first_scheduled_time = parent.metrics.first_scheduled_time
        child.metrics.num_cached_tokens = parent.metrics.num_cached_tokens
        self.requests[parent.request_id].append(child)
        return child

    def _append_tokens(self, seq: Sequence, tokens: list[int], logprobs: list, now: float) -> tuple[str, list[int]]:
        """Append tokens one at a time until the sequence finishes (eos, stop string, max_tokens, context full):
        what comes after a finishing token is dropped. Returns the text delta and the tokens appended."""
        m, delta, done = seq.metrics, "", []
        for tok, lp in zip(tokens, logprobs):
            if seq.matcher is not None:
                seq.matcher.advance(tok)
            seq.token_ids.append(tok)
            done.append(tok)
            if seq.params.logprobs is not None:
                self._record_logprobs(seq, tok, lp)
            if m.first_token_time is None:
                m.first_token_time = now
            m.token_times.append(now)
            delta += seq.text.add(tok)
            if not seq.text.finished and seq.matcher is not None and seq.matcher.is_terminated:
                delta += seq.text.finish("stop")     # a full match nothing can extend: EOS is all that is left
            if not seq.text.finished and seq.num_tokens >= self.max_model_len:
                delta += seq.text.finish("length")
            if seq.text.finished:
                m.finished_time = now
                break
        return delta, done

    def _record_logprobs(self, seq: Sequence, tok: int, lp: TokenLogprobs | None) -> None:
        if lp is None:
            raise ValueError(f"request {seq.request_id!r} asked for logprobs but the sampler gave none")
        decode = (lambda t: self.tokenizer.decode([t], skip_special_tokens=False)) if self.tokenizer else (lambda t: None)
        entry = {tok: Logprob(lp.logprob, lp.rank, decode(tok))}
        for rank, (t, v) in enumerate(lp.top, start=1):
            entry.setdefault(t, Logprob(v, rank, decode(t)))
        seq.logprobs.append(entry)
        seq.cumulative_logprob += lp.logprob

    def _output(self, request_id: str, deltas: dict[int, tuple[str, list[int]]]) -> RequestOutput:
        seqs = sorted(self.requests[request_id], key=lambda s: s.index)
        outs = [CompletionOutput(s.index, s.text.visible_text, s.output_token_ids, s.text.finish_reason,
                                 *((list(s.logprobs), s.cumulative_logprob) if s.params.logprobs is not None
                                   else (None, None)), stop_reason=s.text.stop_reason)
                for s in seqs]
        finished = all(s.is_finished for s in seqs) and len(seqs) == seqs[0].params.n
        if finished:
            del self.requests[request_id]
        first = seqs[0]
        delta_text, toks = deltas.get(first.seq_id, ("", []))
        return RequestOutput(request_id, first.prompt_token_ids, outs, finished, first.metrics,
                             delta_text=delta_text, delta_token_ids=list(toks))

    # ------------------------------------------------------------------ swapping parts (labs, experiments)
    def plug(self, *, block_manager: interfaces.BlockManager | None = None,
             scheduler: interfaces.SchedulerPolicy | None = None, backend: interfaces.AttentionBackend | None = None,
             sampler: interfaces.Sampler | None = None, rejection_sampler: interfaces.RejectionSampler | None = None,
             proposer: interfaces.Proposer | None = None, regex_compiler: interfaces.RegexCompiler | None = None,
             token_index_builder: interfaces.TokenIndexBuilder | None = None, **block_manager_seams) -> None:
        """Replace a component with another implementation of the same interface (e.g. a learner's).

        block_manager / scheduler / backend / sampler / rejection_sampler / proposer: the component itself (the last
        two need an engine built with speculative_config). allocator_cls, slot_mapping_fn, hash_fn, prefix_lookup,
        evictor_cls: a fresh BlockManager for this pool built with those pieces. regex_compiler /
        token_index_builder: structured outputs' regex -> DFA and DFA x vocabulary -> token index functions.
        Only while idle: the KV pool's contents are owned by the block manager that wrote them."""
        unknown = set(block_manager_seams) - set(BLOCK_MANAGER_SEAMS)
        if unknown:
            raise TypeError(f"plug() got unknown seam(s) {sorted(unknown)}; it takes block_manager, scheduler, "
                            f"backend, sampler, rejection_sampler, proposer, regex_compiler, token_index_builder "
                            f"and the block manager's "
                            f"{', '.join(BLOCK_MANAGER_SEAMS)}")
        if self.has_unfinished_requests():
            raise RuntimeError("plug() needs an idle engine: finish or abort the running requests first")
        for obj, protocol, what in ((block_manager, interfaces.BlockManager, "block_manager"),
                                    (scheduler, interfaces.SchedulerPolicy, "scheduler"),
                                    (backend, interfaces.AttentionBackend, "backend"),
                                    (sampler, interfaces.Sampler, "sampler"),
                                    (rejection_sampler, interfaces.RejectionSampler, "rejection_sampler"),
                                    (proposer, interfaces.Proposer, "proposer")):
            if obj is not None and not isinstance(obj, protocol):
                raise TypeError(f"plug({what}=...): a {type(obj).__name__} lacks "
                                f"{', '.join(interfaces.missing_members(obj, protocol))} of minillm.interfaces."
                                f"{protocol.__name__}")
        for fn, what in ((regex_compiler, "regex_compiler"), (token_index_builder, "token_index_builder")):
            if fn is not None and not callable(fn):
                raise TypeError(f"plug({what}=...) must be a function, got {type(fn).__name__}")
        if (rejection_sampler is not None or proposer is not None) and not isinstance(self.spec, SpecDecoder):
            raise ValueError("plug(rejection_sampler=/proposer=) needs an engine with speculative decoding on: build "
                             "it with speculative_config={'method': 'ngram', 'num_speculative_tokens': 4} (the k "
                             "to draft), then plug your piece")
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
            if self.workers is not None:
                raise ValueError("plug(backend=...) swaps rank 0's attention only; a parallel engine's ranks must "
                                 "agree: choose attention_backend when creating the engine")
            self.runner.backend = backend
        if sampler is not None:
            self.sampler = sampler
        if rejection_sampler is not None:
            self.spec.rejection_sampler = rejection_sampler
        if proposer is not None:
            self.spec.proposer = proposer
        if regex_compiler is not None or token_index_builder is not None:
            self.structured = StructuredOutputManager(self.tokenizer, regex_compiler or self.structured.compile_fn,
                                                      token_index_builder or self.structured.index_fn)

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
