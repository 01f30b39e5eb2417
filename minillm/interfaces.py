"""The seams: the interfaces a lab piece implements, declared once.

Each Protocol below is a box of the request path (../DESIGN.md) that the engine takes from outside: through a
constructor argument or class attribute of the component that owns it, or `LLMEngine.plug(...)`. minillm's own
implementation of each is one concrete class or function in the engine; a learner's implementation of the same
Protocol plugs in the same way and the engine never looks past the Protocol's names.

    seam                  engine's implementation                          plugged with
    BlockAllocator        kv.block_allocator.BlockAllocator                BlockManager(allocator_cls=...)   lab02
    SlotMapping           kv.block_manager.slot_mapping                    BlockManager(slot_mapping_fn=...)  lab02
    BlockManager          kv.block_manager.BlockManager                    engine.plug(block_manager=...)     lab02
    HashFn                kv.prefix_cache.default_hash_fn                  BlockManager(hash_fn=...)          lab05
    PrefixLookup          kv.prefix_cache.find_cached_prefix               BlockManager(prefix_lookup=...)    lab05
    Evictor               kv.prefix_cache.LRUEvictor                       BlockManager(evictor_cls=...)      lab05
    AttendFn              layers.attention.causal_attend                   TorchAttentionBackend(attend_fn=)  lab01
    PagedDecodeFn         kernels.triton_paged_attention.paged_attention_decode_triton
                                                                           TritonAttentionBackend(decode_fn=) lab03
    AttentionBackend      layers.attention.{Torch,Cpu,Triton}AttentionBackend  engine.plug(backend=...)
    SchedulerPolicy       engine.scheduler.Scheduler                       engine.plug(scheduler=...)         lab04
    ProcessFn             sampling.processors.process_logits               Sampler(process_fn=...)            lab06
    DrawFn                sampling.sampler.draw                            Sampler(draw_fn=...)               lab06
    Sampler               sampling.sampler.Sampler                         engine.plug(sampler=...)
    RejectionSampler      spec_decode.rejection_sampler.RejectionSampler   engine.plug(rejection_sampler=...) lab07
    RejectionRule         (per request; the engine's is vectorized)        RejectionSampler(rule=...)         lab07
    NgramLookup           spec_decode.ngram.find_ngram_draft               NgramProposer(lookup=...)          lab07
    Proposer              spec_decode.ngram.NgramProposer, spec_decode.draft_model.ModelDraftProposer
                                                                           engine.plug(proposer=...)          lab07
    RegexCompiler         structured.automata.compile_regex                engine.plug(regex_compiler=...)    lab10
    TokenIndexBuilder     structured.token_index.build_token_index         engine.plug(token_index_builder=)  lab10
    TensorParallelRules   layers.linear.MegatronRules (MEGATRON)           LlamaModel(rules=), LLM(tp_rules=) lab09
    PercentileFn          bench.serving_metrics.percentile                 summarize(percentile=)             lab11
    RequestMetricsFn      bench.serving_metrics.request_metrics            summarize(request_metrics=)        lab11
    GoodputFn             bench.serving_metrics.goodput                    summarize(goodput=)                lab11
    AdmissionPolicy       serve.app.TokenBudgetAdmission                   build_app(admission=)              lab11
    Quantizer             quant.formats.quantize                           LlamaModel.quantize_(quantizer=)   lab08
    StepDriver            executor.workers.Workers                         LLMEngine(workers=...)
    StepObserver          (anything callable)                              engine.add_step_observer(fn)
    Router                fleet.routers.{RoundRobin,LeastTokens,PrefixAware}  fleet.simulator.simulate(router=) lab12

(A test checks that this table names every Protocol below.)

This module imports nothing from minillm: every other module may import it.
"""
from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple, Optional, Protocol, runtime_checkable

if TYPE_CHECKING:  # annotations only: importing torch here would make this module heavy
    import torch


class CachedBlock(NamedTuple):
    """One entry of a prefix cache, as the PrefixLookup seam sees it: physical block `block_id` holds the KV of
    `tokens` (a tuple of block_size token ids) computed right after the block `parent` (a block id; None at
    position 0). A parent whose block has since been reused for other content reads as a value equal to no id."""
    block_id: int
    parent: Any
    tokens: tuple


# --------------------------------------------------------------------------- KV memory (labs 02 and 05)

@runtime_checkable
class BlockAllocator(Protocol):
    """A pool of `num_blocks` block ids with one reference count per block."""

    @property
    def num_free_blocks(self) -> int: ...

    def allocate(self) -> int:
        """A free block with ref count 1; NoFreeBlocksError (and no change) when none is free."""

    def share(self, block: int) -> None:
        """One more holder: ref count + 1 (ValueError for a free block)."""

    def free(self, block: int) -> None:
        """One holder fewer: ref count - 1, back to the pool at 0 (ValueError for a free block)."""

    def ref_count(self, block: int) -> int: ...


class SlotMapping(Protocol):
    def __call__(self, block_table: Sequence[int], start: int, end: int, block_size: int) -> list[int]:
        """The flat KV-pool slot of every position in [start, end) of a sequence with this block table."""


class HashFn(Protocol):
    def __call__(self, parent_hash: Optional[int], token_ids: tuple) -> int:
        """The chained key of one full block: deterministic across processes, >= 128 bits."""


class PrefixLookup(Protocol):
    def __call__(self, token_ids: Sequence[int], block_size: int, cache: Mapping[int, CachedBlock],
                 hash_fn: HashFn) -> list[int]:
        """Physical block ids of the longest verified chain of cached full blocks that starts the prompt, at most
        (len(token_ids) - 1) // block_size of them."""


@runtime_checkable
class Evictor(Protocol):
    """The cached blocks nobody references, in eviction order (the next victim first)."""

    def add(self, block: int) -> None: ...

    def remove(self, block: int) -> None: ...

    def pop_lru(self) -> int: ...

    def clear(self) -> list[int]: ...

    def __len__(self) -> int: ...

    def __iter__(self) -> Iterator[int]: ...


@runtime_checkable
class BlockManager(Protocol):
    """Block tables, ref counts, copy-on-write and (optionally) prefix caching: what the scheduler calls."""
    num_blocks: int
    block_size: int

    @property
    def num_free_blocks(self) -> int: ...

    def has_seq(self, seq_id: int) -> bool: ...

    def block_table(self, seq_id: int) -> list[int]: ...

    def num_computed_tokens(self, seq_id: int) -> int: ...

    def ref_count(self, block_id: int) -> int: ...

    def peek_prefix(self, token_ids: Sequence[int]) -> int: ...

    def blocks_to_admit(self, token_ids: Sequence[int], num_tokens: Optional[int] = None) -> int: ...

    def allocate_prompt(self, seq_id: int, token_ids: Sequence[int]) -> int: ...

    def num_blocks_needed(self, seq_id: int, num_tokens: int) -> int: ...

    def append_slots(self, seq_id: int, num_tokens: int) -> list[tuple[int, int]]: ...

    def slot_mapping(self, seq_id: int, start: int, end: int) -> list[int]: ...

    def commit_computed(self, seq_id: int, token_ids: Sequence[int], num_computed_tokens: int) -> None: ...

    def fork(self, parent_seq_id: int, child_seq_id: int) -> None: ...

    def trim(self, seq_id: int, num_tokens: int) -> None:
        """Give back the blocks past the first ceil(num_tokens / block_size) (after rolled-back speculation)."""

    def free(self, seq_id: int) -> None: ...

    def reset_prefix_cache(self) -> None: ...

    def usage(self) -> dict: ...


# --------------------------------------------------------------------------- attention (labs 01 and 03)

class AttendFn(Protocol):
    def __call__(self, q: "torch.Tensor", k: "torch.Tensor", v: "torch.Tensor", scale: float) -> "torch.Tensor":
        """q [n, H, D] (the last n of L positions), k/v [L, KVH, D] -> [n, H, D]; causal; GQA."""


class PagedDecodeFn(Protocol):
    def __call__(self, q: "torch.Tensor", k_cache: "torch.Tensor", v_cache: "torch.Tensor",
                 block_tables: "torch.Tensor", seq_lens: "torch.Tensor", scale: float) -> "torch.Tensor":
        """One query token per sequence: q [S, H, D], caches [num_blocks, block_size, KVH, D] -> [S, H, D]."""


@runtime_checkable
class AttentionBackend(Protocol):
    name: str

    def forward(self, layer: int, q: "torch.Tensor", k: "torch.Tensor", v: "torch.Tensor", meta: Any,
                cache: Any, scale: float) -> "torch.Tensor":
        """Write this step's K/V into the paged pool, then attend; rows as in meta (AttentionMetadata)."""


# --------------------------------------------------------------------------- scheduling and sampling (lab04, lab06)

@runtime_checkable
class SchedulerPolicy(Protocol):
    """The scheduler: queues, the per-step policy, and the only caller of the block manager during a step."""
    running: list
    waiting: Any
    block_manager: BlockManager

    def add(self, seq: Any) -> None: ...

    def has_unfinished(self) -> bool: ...

    def schedule(self) -> Any:
        """The step's SchedulerOutput (calls schedule_running, then admit_waiting unless it preempted)."""

    def schedule_running(self, out: Any, budget: int) -> None: ...

    def admit_waiting(self, out: Any, budget: int) -> None: ...

    def preempt(self, seq: Any) -> None: ...

    def commit(self, out: Any) -> None:
        """After the forward pass: the scheduled tokens' KV is written."""

    def fork(self, parent: Any, child: Any) -> None: ...

    def finish(self, seq: Any) -> None: ...

    def abort(self, request_id: str) -> list: ...


class ProcessFn(Protocol):
    def __call__(self, logits: "torch.Tensor", temperature: "torch.Tensor", top_k: "torch.Tensor",
                 top_p: "torch.Tensor", min_p: "torch.Tensor") -> "torch.Tensor":
        """logits [B, V] and one setting per row ([B] each) -> the logits each row samples from (-inf = dropped)."""


class DrawFn(Protocol):
    def __call__(self, probs: "torch.Tensor", generators: Sequence[Any]) -> "torch.Tensor":
        """probs [B, V] -> one token id per row [B]; row i draws with generators[i] (None: torch's global one)."""


@runtime_checkable
class Sampler(Protocol):
    def __call__(self, logits: "torch.Tensor", batch: Any) -> Any:
        """logits [B, V] and a SamplingBatch (each row's params, generator, prompt and output ids) -> a
        SamplerOutput: one token id per row, and logprobs for the rows that ask."""

    def probs(self, logits: "torch.Tensor", batch: Any) -> "torch.Tensor":
        """Each row's distribution [B, V] after penalties, temperature, min-p, top-k and top-p (one-hot for greedy
        rows): what the rejection sampler verifies drafts against."""


@runtime_checkable
class RejectionSampler(Protocol):
    def __call__(self, target_probs: "torch.Tensor", draft_token_ids: Sequence[Sequence[int]],
                 draft_probs: Sequence[Any], generators: Sequence[Any]) -> list[list[int]]:
        """target_probs [sum(k_r + 1), V] (request r's k_r + 1 rows in order), k_r drafts and their q ([k_r, V] or
        None for one-hot) per request -> per request the accepted drafts then one resampled or bonus token."""


class RejectionRule(Protocol):
    def __call__(self, target_probs: "torch.Tensor", draft_token_ids: list[int], draft_probs: "torch.Tensor",
                 generator: Any) -> list[int]:
        """One request: target_probs [k+1, V] (p at each drafted position, then the bonus position), its k drafts,
        draft_probs [k, V] (q; one-hot rows for a deterministic proposer), its generator (None: torch's global
        one) -> the accepted drafts followed by one more token (1 to k + 1 tokens)."""


class NgramLookup(Protocol):
    def __call__(self, token_ids: Sequence[int], k: int, min_n: int, max_n: int) -> list[int]:
        """Up to k tokens that followed the latest earlier occurrence of the sequence's last n tokens (longest n
        in max_n..min_n first); [] when no such suffix reappears."""


@runtime_checkable
class Proposer(Protocol):
    """Speculative decoding's drafter (minillm.sampling: NgramProposer, ModelDraftProposer)."""

    def propose(self, seqs: list, num_tokens: Sequence[int]) -> list:
        """Up to num_tokens[i] guessed next tokens for each running sequence: a Draft(token_ids, probs) each."""

    def verified(self, seq: Any, num_accepted: int) -> None:
        """The target kept the first num_accepted drafts of seq (now in seq.token_ids) and added one token."""

    def free(self, seq: Any) -> None:
        """seq finished, was preempted or aborted: drop whatever is kept for it."""


class RegexCompiler(Protocol):
    def __call__(self, pattern: str) -> Any:
        """A regex (full-match semantics) -> the byte-level DFA accepting exactly the UTF-8 encodings of the strings
        it matches: a minillm.structured.automata.DFA (minimal or not; after indexing, the engine drops the states
        from which no token sequence reaches an accepting one)."""


class TokenIndexBuilder(Protocol):
    def __call__(self, dfa: Any, vocab: Any, eos_token_ids: Sequence[int]) -> Any:
        """A DFA and the vocabulary (a VocabTrie: token_bytes[i] is token i's bytes, None for special tokens; the
        trie arrays to share work) -> a TokenIndex: per state the sorted token ids whose whole byte string keeps
        the DFA alive and the state each leads to (EOS is not among them: the TokenIndex holds eos_token_ids and
        allows them exactly in accepting states)."""


# --------------------------------------------------------------------------- tensor parallelism (lab09)

@runtime_checkable
class TensorParallelRules(Protocol):
    """Where a tensor-parallel model is cut and where it is put back together. Every column-parallel matrix (q, k,
    v, gate, up: each a part of `num_units` units of `unit_size` rows) keeps `column_rows(...)` of its rows on a
    rank and computes `column_forward(x, weight, bias, comm)`; every row-parallel matrix (o_proj, down_proj) keeps
    `row_cols(...)` of its input columns and computes `row_forward(x, weight, bias, comm)`. comm is a
    minillm.distributed.comm.Communicator (all_reduce, all_gather, ...; it counts what it sends)."""

    def column_rows(self, num_units: int, unit_size: int, rank: int, world_size: int) -> range: ...

    def column_forward(self, x: "torch.Tensor", weight: "torch.Tensor", bias: Optional["torch.Tensor"],
                       comm: Any) -> "torch.Tensor": ...

    def row_cols(self, input_size: int, rank: int, world_size: int) -> range: ...

    def row_forward(self, x: "torch.Tensor", weight: "torch.Tensor", bias: Optional["torch.Tensor"],
                    comm: Any) -> "torch.Tensor": ...


class Quantizer(Protocol):
    """lab08: float weight [N, K] + spec -> minillm.quant.formats.QuantizedWeight (int8 codes with float16 scales
    per output channel or group, or int4 codes packed two per byte with float16 scales and minimums per group).
    Plugged with LlamaModel.quantize_(..., quantizer=); the engine's kernels then run the learner's weights."""

    def __call__(self, weight: "torch.Tensor", spec: Any) -> Any: ...


class PercentileFn(Protocol):
    """lab11: the q-th percentile (0..100) of `values`, interpolating linearly between the closest ranks of the
    sorted values (numpy's default); nan for no values. Plugged with bench.serving_metrics.summarize(percentile=)."""

    def __call__(self, values: list, q: float) -> float: ...


class RequestMetricsFn(Protocol):
    """lab11: one request's trace (bench.serving_metrics.Trace) -> its TraceMetrics (TTFT, TPOT, the gaps between
    chunks, E2EL). Plugged with summarize(request_metrics=)."""

    def __call__(self, trace: Any) -> Any: ...


class GoodputFn(Protocol):
    """lab11: requests per second (over `duration` s) that met every objective in `slos` ({"ttft"|"tpot"|"e2el":
    seconds}). Plugged with summarize(goodput=)."""

    def __call__(self, traces: list, slos: dict, duration: float) -> float: ...


class AdmissionPolicy(Protocol):
    """lab11: may a request of `prompt_tokens` join the requests already accepted and waiting to start
    (`waiting_requests` of them, `waiting_tokens` prompt tokens)? False answers the client 429 + Retry-After.
    Plugged with serve.app.build_app(admission=) / BackgroundServer(admission=)."""

    def admit(self, waiting_requests: int, waiting_tokens: int, prompt_tokens: int) -> bool: ...


class StepDriver(Protocol):
    """Rank 0's link to the other ranks of a parallel engine (executor/workers.py): every step is sent before it
    runs, and a step that fails on rank 0 stops them all."""

    def send_step(self, inputs: Any) -> None: ...

    def failure(self, error: BaseException) -> BaseException: ...


class StepObserver(Protocol):
    def __call__(self, info: Any) -> None:
        """Called at the end of every engine step with its StepInfo."""


@runtime_checkable
class Router(Protocol):
    """lab12: which replica of a fleet takes a new request. `request` is a fleet.workloads.SimRequest (its `prompt`
    token ids, `output_len`, ...); each of `replicas` shows `outstanding_tokens` and `num_requests`. Returns an index
    into `replicas`. Plugged with fleet.simulator.simulate(router=)."""

    def route(self, request: Any, replicas: Sequence[Any]) -> int: ...


def missing_members(obj: Any, protocol: type) -> list[str]:
    """The names `protocol` declares that `obj` lacks (for errors that say what to add)."""
    names: set[str] = set()
    for klass in protocol.__mro__:
        if klass.__module__ != __name__:         # typing's Protocol machinery, object
            continue
        names |= set(getattr(klass, "__annotations__", {}))
        names |= {n for n in vars(klass) if not n.startswith("_") or n in ("__len__", "__iter__", "__call__")}
    return sorted(n for n in names if not hasattr(obj, n))
