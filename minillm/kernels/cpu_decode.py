"""Decode steps of a quantized model in one C call (csrc/decode_step.c), instead of ~12 Python ops per layer.

The model runner (worker/model_runner.py) chooses it from the batch; the model hands over its weights as a typed
DecodeWeights (LlamaModel.decode_step_weights). `run(...)` returns the final hidden states, or None when the fused
step does not apply and the layers must run — it applies only where it computes exactly what they would:

- every row is a decode token (query length 1). The matmuls run the C kernel's tiles (csrc/qgemm.c on
  cpu_qgemm.tiles_copy), as the layers' qlinear does up to cpu_qgemm.TILES_MAX_ROWS rows. Past that the layers
  switch to their batched path and the fused step keeps the tiles: a decode or verification step gets one
  arithmetic at every batch size (plain and speculative decoding agree), at the price of differing from the layers'
  there by the batched path's rounding. Built without AVX2 (no tiles), steps below cpu_qgemm.BATCHED_MIN_ROWS rows
  run the row kernel on the packed weights, as qlinear then does, and larger ones the layers;
- the whole model on one rank, float32, on the CPU; every decoder module of minillm's own classes with no forward
  hooks (a lab that swaps a module or hooks one gets the layers that run its code), and every linear quantized
  weight-only (W8A8 layers quantize activations per token: cpu_w8a8.py);
- the attention backend is the C CPU backend without a learner's attend function, the C kernel takes the head
  shape, and the KV pool is a contiguous float32 pool.

decode_step="layers" (config.KernelConfig; MINILLM_DECODE_STEP) switches it off (A/B runs; the layers are the
reference the tests compare against), as do qgemm="torch"|"scalar" (the layers then run another matmul than the
step's).

Why batched decode steps too: at 48 rows a step's ~12 torch ops per layer (norms, RoPE, SiLU, KV writes, each
60-160 us at that size between the matmuls' parallel regions) and the Python around them cost ~60 of its
~195 ms on SmolLM2 (cProfile, 2 threads); the matmuls and the attention are the same kernels either way.
"""
from __future__ import annotations

import ctypes
import functools
import time
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from minillm import config
from minillm.kernels import cpu_native, cpu_qgemm, cpu_threads
from minillm.quant.formats import QuantizedWeight

CSRC = Path(__file__).with_name("csrc")
SOURCES = (CSRC / "decode_step.c", CSRC / "qgemm.c", CSRC / "paged_decode.c")
_P, _I = ctypes.c_void_p, ctypes.c_int64
FUSED_STEPS = 0          # decode steps run fused, for the benchmarks to say which path they timed


class _QLinear(ctypes.Structure):
    _fields_ = [("kind", _I), ("group", _I), ("n", _I), ("k", _I), ("w", _P), ("scales", _P), ("mins", _P)]


class _Layer(ctypes.Structure):
    _fields_ = [("input_norm", _P), ("post_norm", _P)]


class _Tiles(ctypes.Structure):
    _fields_ = [("kind", _I), ("group", _I), ("n_pad", _I), ("tiles", _P), ("scales", _P), ("mins", _P)]


class _LayerTiles(ctypes.Structure):
    _fields_ = [("qkv", _Tiles), ("o", _Tiles), ("gate_up", _Tiles), ("down", _Tiles)]


class _Dims(ctypes.Structure):
    _fields_ = [("hidden", _I), ("intermediate", _I), ("num_heads", _I), ("num_kv_heads", _I), ("head_dim", _I),
                ("eps", ctypes.c_float), ("scale", ctypes.c_float)]


def enabled() -> bool:
    return config.kernels().decode_step == "fused"


@functools.cache
def load() -> ctypes.CDLL | None:
    """The compiled step (decode_step.c linked with the matmul and attention kernels), or None without a compiler."""
    lib = cpu_native.open_library(SOURCES, "fused C decode step", "running the layers")
    if lib is None:
        return None
    lib.minillm_decode_step.argtypes = [_P, _I, _P, _P, _P, _P, _I, _P, _P, _P, _P, _P, _P, _I, _P, _P, _I, _P,
                                        _I, ctypes.c_int, ctypes.c_int]
    lib.minillm_decode_step.restype = ctypes.c_int
    return lib


_DTYPES = {"int8": (torch.int8, 0), "int4": (torch.uint8, 1)}


@dataclass(frozen=True, eq=False)   # identity: a plan is cached per object
class LayerWeights:
    """One decoder layer as the fused step reads it: two RMSNorm weights and four weight-only quantized matrices."""
    input_norm: torch.Tensor
    post_norm: torch.Tensor
    qkv: QuantizedWeight
    o: QuantizedWeight
    gate_up: QuantizedWeight
    down: QuantizedWeight


@dataclass(frozen=True, eq=False)
class DecodeWeights:
    """Everything the fused step needs from a model (LlamaModel.decode_step_weights builds it): its layers, the final
    norm, the shapes, and the quantized embedding when the step should look tokens up itself (None: torch does)."""
    layers: tuple[LayerWeights, ...]
    final_norm: torch.Tensor
    eps: float
    hidden: int
    intermediate: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float
    embed: QuantizedWeight | None


def _qlinear(qw: object) -> _QLinear | None:
    if not isinstance(qw, QuantizedWeight) or qw.kind not in _DTYPES or qw.act is not None:
        return None     # W8A8 layers quantize activations per token: not the weight-only kernel's math
    dtype, kind = _DTYPES[qw.kind]
    tensors = qw.tensors()
    if (qw.qweight.dtype != dtype or qw.scales.dtype != torch.float16
            or (qw.mins is not None and qw.mins.dtype != torch.float16) or (qw.mins is None) != (kind == 0)
            or any(t.device.type != "cpu" or not t.is_contiguous() for t in tensors)):
        return None
    n, k = qw.shape
    if qw.group_size % 32 or k % qw.group_size or qw.scales.shape != (n, k // qw.group_size):
        return None
    return _QLinear(kind, qw.group_size, n, k, qw.qweight.data_ptr(), qw.scales.data_ptr(),
                    qw.mins.data_ptr() if qw.mins is not None else None)


@dataclass
class _Plan:
    """The C view of a DecodeWeights (kept as long as the weights object lives)."""
    layers: ctypes.Array
    dims: _Dims
    embed: _QLinear | None
    tiles: ctypes.Array | None = None      # the layers' tiles' C view, made on the first step ...
    packs: list | None = None              # ... and the cpu_qgemm.PackedTiles behind it (kept alive with the plan)


_plans: "weakref.WeakKeyDictionary[DecodeWeights, _Plan | None]" = weakref.WeakKeyDictionary()


def _build(w: DecodeWeights) -> _Plan | None:
    layers = (_Layer * len(w.layers))()
    for i, lw in enumerate(w.layers):
        norms = (lw.input_norm, lw.post_norm)
        if any(_qlinear(x) is None for x in (lw.qkv, lw.o, lw.gate_up, lw.down)) \
                or any(t.dtype != torch.float32 or not t.is_contiguous() for t in norms):
            return None     # the tiles are made from these weights: the formats the kernel reads, contiguous
        layers[i] = _Layer(lw.input_norm.data_ptr(), lw.post_norm.data_ptr())
    if w.final_norm.dtype != torch.float32:
        return None
    dims = _Dims(w.hidden, w.intermediate, w.num_heads, w.num_kv_heads, w.head_dim, w.eps, w.scale)
    return _Plan(layers, dims, _qlinear(w.embed) if w.embed is not None else None)


def _plan(w: DecodeWeights) -> _Plan | None:
    if w not in _plans:
        _plans[w] = _build(w)
    return _plans[w]


def _tiles(w: DecodeWeights, plan: _Plan) -> ctypes.Array:
    """The tiles of the plan's matmuls (cpu_qgemm.tiles_copy: the layers' own, made now where the layers have not
    made them yet). Every input width is a multiple of the group (of 32), as the tiles need (_qlinear took no
    other)."""
    if plan.tiles is None:
        packs = [cpu_qgemm.tiles_copy(q) for lw in w.layers for q in (lw.qkv, lw.o, lw.gate_up, lw.down)]
        arr = (_LayerTiles * (len(packs) // 4))()
        for i in range(len(arr)):
            arr[i] = _LayerTiles(*(_Tiles(cpu_qgemm.KIND[p.kind], p.group, p.n_pad,
                                          p.tiles.data_ptr(), p.scales.data_ptr(),
                                          p.mins.data_ptr() if p.mins is not None else None)
                                   for p in packs[4 * i:4 * i + 4]))
        plan.tiles, plan.packs = arr, packs
    return plan.tiles


def applies(w: DecodeWeights) -> bool:
    """Whether the fused step runs for these weights at all (it is on, qgemm is "c", the kernels are built with
    their tiles, the attention kernel takes the head shape); False: the layers run."""
    if not enabled() or cpu_qgemm.mode() != "c" or load() is None:
        return False
    if not cpu_qgemm.load().minillm_qgemm_tiles_available():
        return False        # built without AVX2: the layers' qlinear runs the row kernel, which the step no longer has
    attn = cpu_native.load()
    return attn is not None and _supports(attn, w.num_heads // w.num_kv_heads, w.head_dim)


@functools.lru_cache(maxsize=None)
def _supports(attn: ctypes.CDLL, group: int, head_dim: int) -> bool:
    return bool(attn.minillm_paged_decode_supports(group, head_dim))


_ERRORS = {-2: (IndexError, "slot_mapping has a slot outside the KV pool's {slots} slots"),
           -3: (ValueError, "seq_lens must be in 1..{width} (block table width x block_size), got {lens}"),
           -4: (ValueError, "a block table entry is outside the pool's {blocks} blocks"),
           -5: (IndexError, "a token id is outside the vocabulary (0..{vocab})")}


def run(w: DecodeWeights, embed_tokens: Callable[[torch.Tensor], torch.Tensor], input_ids: torch.Tensor,
        cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
        seq_lens: list[int] | torch.Tensor, block_tables: torch.Tensor, slot_mapping: torch.Tensor, block_size: int,
        vocab_size: int, rows_share: bool = False) -> torch.Tensor | None:
    """The normed final hidden states [T, hidden] of a decode step, or None where the step does not apply (the
    caller runs the layers). Row t is one token: it writes its K/V at slot_mapping[t] and attends over seq_lens[t]
    positions through block_tables[t] (one row per token: rows_share when some rows are one sequence's, as a
    verification step's k + 1 tokens are, each attending over the ones before it). `embed_tokens` embeds the ids
    where the step cannot look them up itself (w.embed None or not in a format it reads). k_cache / v_cache: the
    float32 contiguous pool."""
    plan = _plan(w) if applies(w) else None
    if plan is None:
        return None
    lib = load()
    tiles = _tiles(w, plan)
    num_slots = k_cache.shape[2]
    lens = torch.as_tensor(seq_lens, dtype=torch.int64).contiguous()
    tables = block_tables.to(torch.int64).contiguous()
    slots = slot_mapping.to(torch.int64).contiguous()
    ids = input_ids.to(torch.int64).contiguous()
    cos, sin = cos.float().contiguous(), sin.float().contiguous()
    x = (torch.empty(ids.numel(), w.hidden) if plan.embed is not None
         else embed_tokens(input_ids).float().contiguous().clone())
    team, started = cpu_threads.step_team(ids.numel()), time.perf_counter()
    rc = lib.minillm_decode_step(x.data_ptr(), x.shape[0], ids.data_ptr(),
                                 ctypes.byref(plan.embed) if plan.embed is not None else None,
                                 ctypes.addressof(plan.layers), ctypes.addressof(tiles),
                                 len(plan.layers), ctypes.byref(plan.dims),
                                 w.final_norm.data_ptr(), cos.data_ptr(), sin.data_ptr(),
                                 k_cache.data_ptr(), v_cache.data_ptr(), num_slots, slots.data_ptr(),
                                 tables.data_ptr(), tables.shape[1], lens.data_ptr(), block_size,
                                 team, int(rows_share))
    cpu_threads.record(team, ids.numel(), time.perf_counter() - started)
    if rc == -1:
        raise MemoryError("the fused decode step could not allocate its scratch buffers")
    if rc == -6:    # NaN or inf reached a tiles matmul's input: the layers' float fallback propagates it
        return None
    if rc in _ERRORS:
        err, text = _ERRORS[rc]
        raise err(text.format(slots=num_slots, width=tables.shape[1] * block_size, lens=lens.tolist(),
                              blocks=num_slots // block_size, vocab=vocab_size - 1)
                  + f" (slot_mapping {slots.tolist()}, block_tables {tables.tolist()})")
    global FUSED_STEPS
    FUSED_STEPS += 1
    return x
