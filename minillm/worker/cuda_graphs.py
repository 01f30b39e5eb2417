"""CUDA graphs for decode steps: capture the model's forward once per batch size, then replay it.

A 135M-parameter model decodes a token in far less GPU time than the CPU needs to launch its ~400 kernels one by one,
so batch-1 decode is launch-bound. A CUDA graph records the launches of one step once and replays them with one call.
A graph replays exactly what it recorded: the same shapes, the same buffers, no host decisions. So:

* Graphs are captured for a few batch sizes (1, 2, 4, then multiples of 8 up to max_num_seqs: vLLM's ladder); a
  decode step of n sequences replays the smallest captured size >= n (`padded_size`), its rows n.. being padding:
  token 0 at position 0, one token of context, its K/V written to a spare block of the pool that no sequence owns.
* The step's inputs live in static device buffers (ids, positions, slots, context lengths, block tables [B, W] with
  W the blocks of max_model_len), filled by one host-to-device copy of a pinned staging buffer per step.
* Everything inside reads those buffers on the device: RoPE's cos/sin are gathered from a fixed table, the Triton
  PagedAttention kernel reads lengths and tables from the device (its grid is (batch, KV heads): fixed per size).
* Prefill, mixed and verification steps, and batches past the largest size, run eagerly (the runner's other path).

Only on CUDA, one rank, minillm's own Triton backend and a RoPE with a fixed table (`graphs_apply`); EngineConfig's
`enforce_eager` turns them off. The logits (the LM head) are computed outside the graph, on the real rows only.
"""
from __future__ import annotations

import bisect

import torch

from minillm.kv.cache import KVCache
from minillm.kv.metadata import AttentionMetadata
from minillm.layers.attention import TritonAttentionBackend
from minillm.models.llama import ForwardContext, LlamaModel

MAX_CAPTURED_BATCH = 512


def capture_sizes(max_num_seqs: int) -> list[int]:
    """The batch sizes a graph is captured for: 1, 2, 4, then multiples of 8 up to max_num_seqs rounded up to 8
    (at most MAX_CAPTURED_BATCH)."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    top = min(-(-max_num_seqs // 8) * 8 if max_num_seqs > 4 else max_num_seqs, MAX_CAPTURED_BATCH)
    sizes = [s for s in (1, 2, 4) if s <= top] + list(range(8, top + 1, 8))
    if top not in sizes:        # max_num_seqs = 3: capture 1, 2 and 3
        sizes.append(top)
    return sorted(set(sizes))


def padded_size(n: int, sizes: list[int]) -> int | None:
    """The captured size a decode batch of n sequences replays: the smallest size >= n; None past the largest (the
    step runs eagerly)."""
    if n < 1:
        return None
    i = bisect.bisect_left(sizes, n)
    return sizes[i] if i < len(sizes) else None


def graphs_apply(model, kv_cache: KVCache, backend, world_size: int, pipeline: bool) -> bool:
    """Whether a runner's decode steps can be captured: CUDA, one rank, a pool with a spare block, minillm's own
    Triton backend (a learner's decode_fn may read the host), a LlamaModel whose RoPE has a fixed table."""
    return (kv_cache.k.device.type == "cuda" and world_size == 1 and not pipeline and kv_cache.spare_blocks >= 1
            and type(backend) is TritonAttentionBackend and backend.decode_fn is None
            and isinstance(model, LlamaModel) and model.rotary.rope_type != "dynamic")


class CudaGraphs:
    """A runner's captured decode steps, one per size of `sizes`, over shared static input buffers."""

    def __init__(self, model: LlamaModel, kv_cache: KVCache, backend, sizes: list[int], max_model_len: int,
                 emulate: bool = False) -> None:
        """`emulate`: run() runs the padded step eagerly instead of replaying (no capture): the same buffers,
        padding and spare block, on any device (tests on a CPU)."""
        if kv_cache.spare_blocks < 1:
            raise ValueError("CUDA graphs need a KV pool with a spare block for their padding rows (spare_blocks=1)")
        self.model, self.kv_cache, self.backend, self.sizes = model, kv_cache, backend, sorted(sizes)
        self.emulate = emulate
        dev = kv_cache.k.device
        bs = kv_cache.block_size
        B = self.max_batch = self.sizes[-1]
        self.W = W = -(-max_model_len // bs)
        self.pad_slot = kv_cache.num_blocks * bs       # the first slot of the spare block
        n = 4 * B + B * W
        self.host = torch.zeros(n, dtype=torch.int64, pin_memory=dev.type == "cuda")
        self.buf = torch.zeros(n, dtype=torch.int64, device=dev)
        self.ids, self.pos, self.slots, self.lens = (self.buf[i * B:(i + 1) * B] for i in range(4))
        self.tables = self.buf[4 * B:].view(B, W)
        h = self.host
        self.h_ids, self.h_pos, self.h_slots, self.h_lens = (h[i * B:(i + 1) * B] for i in range(4))
        self.h_tables = h[4 * B:].view(B, W)
        self.h_slots.fill_(self.pad_slot)
        self.h_lens.fill_(1)
        self.cos, self.sin = model.rotary.tables(max_model_len, dev)
        self.rows = torch.arange(B, device=dev)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.copied = None          # the event of the last staging copy (the host buffer is reused after it)

    def _forward(self, b: int) -> torch.Tensor:
        meta = AttentionMetadata([1] * b, [1] * b, self.slots[:b], self.tables[:b], self.kv_cache.block_size)
        meta.memo("decode_rows", lambda: (list(range(b)), self.tables[:b], self.lens[:b]))
        meta.memo("decode_row_index", lambda: self.rows[:b])
        pos = self.pos[:b]
        ctx = ForwardContext(meta, self.kv_cache, self.backend, self.cos[pos], self.sin[pos])
        return self.model(self.ids[:b], pos, ctx)

    def capture(self) -> None:
        """Record one graph per size, largest first, sharing one memory pool. Every row is padding while they are
        recorded (so the warm-up runs and the captures write only the spare block)."""
        self.buf.copy_(self.host)
        torch.cuda.synchronize(self.buf.device)
        pool = None
        for b in reversed(self.sizes):
            self._forward(b)                 # warm-up: Triton compiles, the allocator sizes its blocks
            torch.cuda.synchronize(self.buf.device)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=pool):
                out = self._forward(b)
            pool = g.pool()
            self.graphs[b] = (g, out)
        torch.cuda.synchronize(self.buf.device)

    def run(self, inputs) -> torch.Tensor | None:
        """The final hidden states [n, hidden] of a decode step (StepInputs: every sequence one token, every row
        sampled) by replaying a graph; None where no graph covers the step (the caller runs it eagerly)."""
        n = len(inputs.query_lens)
        b = padded_size(n, self.sizes) if len(inputs.input_ids) == n else None
        if b is None or (b not in self.graphs and not self.emulate) or len(inputs.sample_rows) != n:
            return None
        w = max(len(t) for t in inputs.block_tables)
        if w > self.W:
            return None
        if self.copied is not None:
            self.copied.synchronize()
        self.h_ids[:n] = inputs.input_ids
        self.h_pos[:n] = inputs.positions
        self.h_slots[:n] = inputs.slot_mapping
        self.h_lens[:n] = torch.tensor(inputs.seq_lens, dtype=torch.int64)
        self.h_ids[n:b] = 0
        self.h_pos[n:b] = 0
        self.h_slots[n:b] = self.pad_slot
        self.h_lens[n:b] = 1
        self.h_tables[:n, :w] = torch.tensor([t + [0] * (w - len(t)) for t in inputs.block_tables], dtype=torch.int64)
        m = 4 * self.max_batch + b * self.W       # rows past b of the tables are never read
        self.buf[:m].copy_(self.host[:m], non_blocking=True)
        if b not in self.graphs:         # emulate
            return self._forward(b)[:n]
        self.copied = torch.cuda.Event()
        self.copied.record()
        g, out = self.graphs[b]
        g.replay()
        return out[:n]
