"""Runs one forward pass over a step's StepInputs: flat input_ids, positions, slot_mapping, block_tables.

Everything it needs about KV placement comes in the StepInputs (the engine built them from what the scheduler asked
the block manager); the runner only copies blocks, builds tensors, chooses how to run the model and runs it. In a
tensor- or pipeline-parallel engine rank 0 broadcasts the StepInputs (one message per step) and every rank runs
`forward` on it with its own shard of the model and of the KV pool. A draft model (spec_decode/draft_model.py) runs
through a ModelRunner of its own, over its own pool.

How the model runs is chosen here, from the batch: a decode step (every row one token) of a quantized model on one
CPU rank runs as one fused C call (kernels/cpu_decode.py) where it computes exactly what the layers would;
everything else runs the model's layers."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from minillm import interfaces
from minillm.config import EngineConfig
from minillm.distributed.comm import Communicator
from minillm.kernels import cpu_decode
from minillm.kv.cache import KVCache, pool_dtype
from minillm.kv.metadata import AttentionMetadata, build_metadata
from minillm.layers.attention import CpuAttentionBackend, get_attention_backend
from minillm.layers.rotary import RotaryEmbedding
from minillm.models.llama import ForwardContext, LlamaModel
from minillm.worker.cuda_graphs import CudaGraphs, capture_sizes, graphs_apply


@dataclass
class StepInputs:
    """What every rank needs to run one step: the flat batch, its KV placement and which rows get logits."""
    input_ids: torch.Tensor        # [T] int64
    positions: torch.Tensor        # [T] int64
    query_lens: list[int]
    seq_lens: list[int]
    slot_mapping: torch.Tensor     # [T] int64
    block_tables: list[list[int]]
    block_copies: list[tuple[int, int]]
    sample_rows: list[int]         # rows of the batch whose logits are wanted, in order

    def metadata(self, block_size: int, seqs: slice = slice(None)) -> AttentionMetadata:
        qs = self.query_lens[seqs]
        start = sum(self.query_lens[:seqs.start or 0])
        return build_metadata(qs, self.seq_lens[seqs], self.slot_mapping[start:start + sum(qs)],
                              self.block_tables[seqs], block_size, device=self.slot_mapping.device)

    def to_device(self, device: torch.device, block_size: int) -> tuple["StepInputs", AttentionMetadata, torch.Tensor]:
        """This step on `device` in one host-to-device copy: ids, positions, slots, the padded block tables, the
        sequence lengths, the sample rows and the decode rows' indices are packed into one pinned int64 buffer on
        the host and moved with one non-blocking copy; everything the step reads on the device is a view of it.
        Returns (the inputs with device tensors, their AttentionMetadata, the sample rows as a device index). The
        metadata's decode rows are filled in (AttentionMetadata.memo) so that no layer copies an index over."""
        T, S, R = len(self.input_ids), len(self.query_lens), len(self.sample_rows)
        W = max((len(t) for t in self.block_tables), default=0)
        starts = [0]
        for q in self.query_lens:
            starts.append(starts[-1] + q)
        dec = [i for i, q in enumerate(self.query_lens) if q == 1]
        D = len(dec)
        rest = ([b for t in self.block_tables for b in (*t, *[0] * (W - len(t)))] + list(self.seq_lens)
                + list(self.sample_rows) + dec + [starts[i] for i in dec])
        host = torch.empty(3 * T + len(rest), dtype=torch.int64, pin_memory=device.type == "cuda")
        torch.cat([self.input_ids, self.positions, self.slot_mapping, torch.tensor(rest, dtype=torch.int64)],
                  out=host)
        buf = host.to(device, non_blocking=True)
        ids, pos, slots = buf[:T], buf[T:2 * T], buf[2 * T:3 * T]
        at = 3 * T
        tables = buf[at:at + S * W].view(S, W)
        at += S * W
        slens, rows = buf[at:at + S], buf[at + S:at + S + R]
        at += S + R
        dec_idx, dec_rows = buf[at:at + D], buf[at + D:at + 2 * D]
        meta = AttentionMetadata(list(self.query_lens), list(self.seq_lens), slots, tables, block_size)
        if D:
            every = D == S
            meta.memo("decode_rows", lambda: ([starts[i] for i in dec], tables if every else tables[dec_idx],
                                              slens if every else slens[dec_idx]))
            meta.memo("decode_row_index", lambda: dec_rows)
        moved = StepInputs(ids, pos, self.query_lens, self.seq_lens, slots, self.block_tables, self.block_copies,
                           self.sample_rows)
        return moved, meta, rows

    def pack(self) -> torch.Tensor:
        """One int64 tensor: [T, S, copies, rows, ids, positions, slots, qlens, slens, table lengths, tables,
        copies, rows]."""
        T, S = len(self.input_ids), len(self.query_lens)
        head = torch.tensor([T, S, len(self.block_copies), len(self.sample_rows)], dtype=torch.int64)
        flat_tables = [b for t in self.block_tables for b in t]
        rest = torch.tensor(self.query_lens + self.seq_lens + [len(t) for t in self.block_tables] + flat_tables
                            + [x for pair in self.block_copies for x in pair] + self.sample_rows, dtype=torch.int64)
        return torch.cat([head, self.input_ids, self.positions, self.slot_mapping, rest])

    @staticmethod
    def unpack(buf: torch.Tensor) -> "StepInputs":
        T, S, C, R = (int(x) for x in buf[:4])
        at = 4
        ids, pos, slots = buf[at:at + T], buf[at + T:at + 2 * T], buf[at + 2 * T:at + 3 * T]
        at += 3 * T
        rest = buf[at:].tolist()
        qlens, slens, tlens = rest[:S], rest[S:2 * S], rest[2 * S:3 * S]
        at = 3 * S
        tables = []
        for n in tlens:
            tables.append(rest[at:at + n])
            at += n
        copies = [(rest[at + 2 * i], rest[at + 2 * i + 1]) for i in range(C)]
        at += 2 * C
        return StepInputs(ids.clone(), pos.clone(), qlens, slens, slots.clone(), tables, copies, rest[at:at + R])


class ModelRunner:
    """Runs steps on one rank. `comm` spans the ranks of a parallel engine: with `pipeline` set they are pipeline
    stages (this rank's model holds its stage's layers); otherwise they are tensor-parallel ranks (the model was
    built with the same communicator). `driver` is rank 0's link to the other ranks (executor/workers.py)."""

    def __init__(self, model: LlamaModel, kv_cache: KVCache, backend: interfaces.AttentionBackend,
                 comm: Communicator | None = None, pipeline: bool = False, micro_batches: int = 1,
                 driver: "interfaces.StepDriver | None" = None) -> None:
        self.model, self.kv_cache, self.backend = model, kv_cache, backend
        self.comm = comm or Communicator()
        self.pipeline, self.micro_batches, self.driver = pipeline, max(1, micro_batches), driver
        self.device = kv_cache.k.device          # where the pool is, the step runs
        self.cuda_graphs: CudaGraphs | None = None

    def capture_cuda_graphs(self, max_model_len: int, max_num_seqs: int) -> bool:
        """Capture decode steps as CUDA graphs (worker/cuda_graphs.py) where they apply: a CUDA pool with a spare
        block for padding rows, one rank, minillm's Triton backend, a RoPE with a fixed table. Returns whether it
        did; steps it does not cover (prefill, mixed, verification, larger batches) run eagerly."""
        if not graphs_apply(self.model, self.kv_cache, self.backend, self.comm.world_size, self.pipeline):
            return False
        self.cuda_graphs = CudaGraphs(self.model, self.kv_cache, self.backend, capture_sizes(max_num_seqs),
                                      max_model_len)
        self.cuda_graphs.capture()
        return True

    def execute(self, inputs: StepInputs) -> torch.Tensor:
        """Run the step on every rank; the logits of inputs.sample_rows [rows, V] (fp32)."""
        if self.driver is not None:
            self.driver.send_step(inputs)       # the other ranks start the same step
        try:
            return self.forward(inputs)
        except BaseException as e:
            # the other ranks are somewhere inside this step and can never line up with the next one: stop them all
            if self.driver is not None:
                raise self.driver.failure(e) from e
            raise

    def forward(self, inputs: StepInputs) -> torch.Tensor | None:
        """Run one step on this rank; the logits of inputs.sample_rows on rank 0 (None on the others)."""
        self.kv_cache.copy_blocks(inputs.block_copies)
        if self.device.type != "cpu" or self.cuda_graphs is not None:   # graphs: CUDA only, or a test's emulation
            return self._device_forward(inputs)
        if self.pipeline and self.comm.world_size > 1:
            return self._pipeline_forward(inputs)
        meta = inputs.metadata(self.kv_cache.block_size)
        ctx = ForwardContext(meta, self.kv_cache, self.backend)
        hidden = fused_decode(self.model, inputs.input_ids, inputs.positions, ctx)
        if hidden is None:
            hidden = self.model(inputs.input_ids, inputs.positions, ctx)
        if not inputs.sample_rows:
            return hidden.new_empty((0, self.model.cfg.vocab_size), dtype=torch.float32)
        if inputs.sample_rows != list(range(hidden.shape[0])):     # a verification's rows are all of them
            hidden = hidden.index_select(0, torch.tensor(inputs.sample_rows))
        return self.model.compute_logits(hidden)

    def _device_forward(self, inputs: StepInputs) -> torch.Tensor | None:
        """forward() off the CPU: a decode step a captured CUDA graph covers replays it; any other step moves its
        inputs in one copy (StepInputs.to_device) and runs the layers."""
        if self.pipeline and self.comm.world_size > 1:
            moved, _, _ = inputs.to_device(self.device, self.kv_cache.block_size)
            return self._pipeline_forward(moved)
        graphs = self.cuda_graphs
        hidden = graphs.run(inputs) if graphs is not None and graphs.backend is self.backend else None
        if hidden is not None:
            return self.model.compute_logits(hidden)
        moved, meta, rows = inputs.to_device(self.device, self.kv_cache.block_size)
        ctx = ForwardContext(meta, self.kv_cache, self.backend)
        rotary = getattr(self.model, "rotary", None)
        if isinstance(rotary, RotaryEmbedding) and rotary.rope_type != "dynamic":
            # RoPE from a table sized on the host (the furthest position is known here): the layers need not read
            # the positions back from the device to size it
            cos, sin = rotary.tables(max(inputs.seq_lens), self.device)
            ctx.cos, ctx.sin = cos[moved.positions], sin[moved.positions]
        hidden = self.model(moved.input_ids, moved.positions, ctx)
        if not inputs.sample_rows:
            return hidden.new_empty((0, self.model.cfg.vocab_size), dtype=torch.float32)
        if inputs.sample_rows != list(range(hidden.shape[0])):
            hidden = hidden.index_select(0, rows)
        return self.model.compute_logits(hidden)

    def _pipeline_forward(self, inputs: StepInputs) -> torch.Tensor | None:
        """GPipe-style within one step: the batch is cut into micro-batches (whole sequences); stage s runs
        micro-batch m while stage s+1 runs m-1. Activations go stage to stage, the last stage's logits to rank 0."""
        comm, stage, last = self.comm, self.comm.rank, self.comm.world_size - 1
        H, V = self.model.cfg.hidden_size, self.model.cfg.vocab_size
        pending, counts = [], []
        for seqs, t0, t1, rows in micro_batches(inputs, self.micro_batches):
            meta = inputs.metadata(self.kv_cache.block_size, seqs)
            ctx = ForwardContext(meta, self.kv_cache, self.backend)
            hidden = None
            if stage > 0:
                hidden = comm.recv(torch.empty(t1 - t0, H, dtype=self.model.dtype, device=self.device), stage - 1)
            x = self.model(inputs.input_ids[t0:t1], inputs.positions[t0:t1], ctx, hidden)
            if stage < last:
                x = x.contiguous()
                pending.append((comm.send(x, stage + 1), x))   # x stays referenced until the send is done
            elif rows:
                lg = self.model.compute_logits(x[torch.tensor([r - t0 for r in rows], device=x.device)]).contiguous()
                pending.append((comm.send(lg, 0), lg))
            counts.append(len(rows))
        for work, _ in pending:
            work.wait()
        if stage != 0:
            return None
        out = [comm.recv(torch.empty(n, V, dtype=torch.float32, device=self.device), last) for n in counts if n]
        return torch.cat(out) if out else torch.empty(0, V, device=self.device)


def build_runner(model: LlamaModel, config: EngineConfig, num_blocks: int, comm: Communicator | None = None,
                 driver: "interfaces.StepDriver | None" = None, device: torch.device | None = None) -> ModelRunner:
    """A rank's runner over a fresh KV pool of num_blocks blocks on `device` (default: the CPU), as `config`
    describes it: every rank of an engine (rank 0 in LLMEngine, the others in executor/workers.py) is built here.
    A CUDA pool that may take CUDA graphs keeps one spare block past num_blocks for the padding rows of a graph's
    batch to write into (the block manager never hands it out)."""
    cc, par = config.cache, config.parallel
    kv_dtype = pool_dtype(cc.kv_cache_dtype, model.dtype)
    device = torch.device("cpu") if device is None else device
    spare = int(device.type == "cuda" and not config.enforce_eager and par.world_size == 1)
    try:
        kv_cache = KVCache(model.kv_cfg, num_blocks, cc.block_size, dtype=kv_dtype, device=device,
                           spare_blocks=spare)
    except (MemoryError, ValueError, RuntimeError) as e:   # numpy/torch refuse a size past memory or index range
        per_block = KVCache.bytes_per_block(model.kv_cfg, cc.block_size, kv_dtype)
        raise ValueError(f"cannot reserve a KV pool of {num_blocks} blocks x {per_block} bytes "
                         f"({num_blocks * per_block / 2**30:.4g} GiB): {e}; lower kv_cache_memory "
                         "(--kv-cache-memory) or num_blocks") from None
    return ModelRunner(model, kv_cache, get_attention_backend(config.attention_backend, device, cc.block_size), comm,
                       pipeline=par.pipeline_parallel_size > 1,
                       micro_batches=par.pipeline_micro_batches or par.pipeline_parallel_size, driver=driver)


FUSED_MAX_QUERY = 9      # tokens of one sequence a fused step takes: a decode, or a verification of up to 8 guesses


def fused_decode(model: LlamaModel, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext
                 ) -> torch.Tensor | None:
    """The step's final hidden states from one C call (kernels/cpu_decode.py) where the batch (decode tokens, and
    sequences verifying up to FUSED_MAX_QUERY - 1 guesses: each of their tokens a row attending over the ones
    before it), the backend (minillm's C CPU backend, no learner's attend function), the pool (float32, contiguous,
    on the CPU) and the model (LlamaModel.decode_step_weights) allow it; else None: run the layers. Fills ctx.cos /
    ctx.sin as the layers would."""
    cache, meta = ctx.cache, ctx.meta
    if not (input_ids.numel() and input_ids.device.type == "cpu" and max(meta.query_lens) <= FUSED_MAX_QUERY
            and type(ctx.backend) is CpuAttentionBackend and ctx.backend.attend_fn is None
            and cache.k.dtype == torch.float32 and cache.v.dtype == torch.float32 and cache.k.device.type == "cpu"
            and cache.k.is_contiguous() and cache.v.is_contiguous() and isinstance(model, LlamaModel)):
        return None
    weights = model.decode_step_weights()
    if weights is None or cache.k.shape[0] != len(weights.layers):
        return None
    ctx.cos, ctx.sin = model.rotary.cos_sin(positions, meta.query_lens, meta.seq_lens)
    _, _, tables, lens = meta.token_rows(FUSED_MAX_QUERY)      # every token a row (all sequences qualify here)
    return cpu_decode.run(weights, model.embed_tokens, input_ids, ctx.cos, ctx.sin, cache.k, cache.v, lens,
                          tables, meta.slot_mapping, meta.block_size, model.cfg.vocab_size,
                          rows_share=len(lens) > len(meta.query_lens))


def micro_batches(inputs: StepInputs, n: int):
    """Split a step into up to `n` groups of whole sequences with about equal token counts: (sequence slice, first
    token, end token, sample rows inside)."""
    T, S = len(inputs.input_ids), len(inputs.query_lens)
    n = max(1, min(n, S))
    bounds, start, acc = [], 0, 0
    for i, q in enumerate(inputs.query_lens):
        acc += q
        if len(bounds) < n - 1 and acc >= T * (len(bounds) + 1) / n and i + 1 < S:
            bounds.append(i + 1)
    edges = [0] + bounds + [S]
    tok = [0]
    for q in inputs.query_lens:
        tok.append(tok[-1] + q)
    for a, b in zip(edges, edges[1:]):
        t0, t1 = tok[a], tok[b]
        yield slice(a, b), t0, t1, [r for r in inputs.sample_rows if t0 <= r < t1]
