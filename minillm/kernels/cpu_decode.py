"""Decode steps of a quantized model in one C call (csrc/decode_step.c), instead of ~12 Python ops per layer.

`try_forward(model, input_ids, positions, ctx)` returns the final hidden states, or None when the fused step does
not apply and the layers must run — it applies only where it computes exactly what they would:

- every row is a decode token (query length 1), and at most cpu_qgemm.BATCHED_MIN_ROWS - 1 of them (the rows for
  which the layers' qlinear also runs the integer kernel);
- the whole model on one rank, float32, on the CPU; every decoder module of minillm's own classes with no forward
  hooks (a lab that swaps a module or hooks one gets the layers that run its code), and every linear quantized
  weight-only (W8A8 layers quantize activations per token: cpu_w8a8.py);
- the attention backend is the C CPU backend without a learner's attend function, the C kernel takes the head
  shape, and the KV pool is a contiguous float32 pool.

MINILLM_DECODE_STEP=layers switches it off (A/B runs; the layers are the reference the tests compare against).
"""
from __future__ import annotations

import ctypes
import functools
import os
import warnings
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch

from minillm.kernels import cpu_native, cpu_qgemm
from minillm.quant.formats import QuantizedWeight

CSRC = Path(__file__).with_name("csrc")
SOURCES = (CSRC / "decode_step.c", CSRC / "qgemm.c", CSRC / "paged_decode.c")
_P, _I = ctypes.c_void_p, ctypes.c_int64
FUSED_STEPS = 0   # decode steps run fused, for the benchmarks to say which path they timed


class _QLinear(ctypes.Structure):
    _fields_ = [("kind", _I), ("group", _I), ("n", _I), ("k", _I), ("w", _P), ("scales", _P), ("mins", _P)]


class _Layer(ctypes.Structure):
    _fields_ = [("input_norm", _P), ("post_norm", _P), ("qkv", _QLinear), ("o", _QLinear), ("gate_up", _QLinear),
                ("down", _QLinear)]


class _Dims(ctypes.Structure):
    _fields_ = [("hidden", _I), ("intermediate", _I), ("num_heads", _I), ("num_kv_heads", _I), ("head_dim", _I),
                ("eps", ctypes.c_float), ("scale", ctypes.c_float)]


def enabled() -> bool:
    m = os.environ.get("MINILLM_DECODE_STEP", "fused").lower()
    if m not in ("fused", "layers"):
        raise ValueError(f"MINILLM_DECODE_STEP={m!r}: use fused (one C call per decode step) or layers")
    return m == "fused"


@functools.cache
def load() -> ctypes.CDLL | None:
    """The compiled step (decode_step.c linked with the matmul and attention kernels), or None without a compiler."""
    try:
        lib = ctypes.CDLL(str(cpu_native.build(source=SOURCES)))
    except (RuntimeError, OSError) as e:
        warnings.warn(f"fused C decode step unavailable, running the layers: {e}", RuntimeWarning)
        return None
    lib.minillm_decode_step.argtypes = [_P, _I, _P, _I, _P, _P, _P, _P, _P, _P, _I, _P, _P, _I, _P, _I, ctypes.c_int]
    lib.minillm_decode_step.restype = ctypes.c_int
    return lib


_DTYPES = {"int8": (torch.int8, 0), "int4": (torch.uint8, 1)}


def _qlinear(module) -> _QLinear | None:
    qw = getattr(module, "quant", None)
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
    """The C view of a model's layers, valid while `refs` (the quantized weights and norms it points into) are the
    ones the modules hold."""
    refs: list
    layers: ctypes.Array
    dims: _Dims
    final_norm: torch.Tensor


_plans: "weakref.WeakKeyDictionary[torch.nn.Module, _Plan]" = weakref.WeakKeyDictionary()


def _modules(model) -> list | None:
    """The modules the fused step replaces, or None if any is not exactly minillm's own class, or hooked. Runs every
    step, so it reads the module dicts directly (nn.Module.__getattr__ costs ~1 us a lookup: ~1 ms a step here)."""
    from minillm.layers.norm import RMSNorm
    from minillm.models.llama import MLP, Attention, DecoderLayer
    from minillm.parallel.layers import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
    out = []
    for layer in model.layers._modules.values():
        sub = layer._modules
        a, m = sub["self_attn"], sub["mlp"]
        mods = (layer, a, m, sub["input_layernorm"], a._modules["qkv_proj"], a._modules["o_proj"],
                sub["post_attention_layernorm"], m._modules["gate_up_proj"], m._modules["down_proj"])
        kinds = (DecoderLayer, Attention, MLP, RMSNorm, QKVParallelLinear, RowParallelLinear, RMSNorm,
                 MergedColumnParallelLinear, RowParallelLinear)
        for x, t in zip(mods, kinds):
            if type(x) is not t or x._forward_hooks or x._forward_pre_hooks:
                return None
        out.append(mods)
    return out


def _refs(mods: list) -> list:
    return [r for (_, _, _, n1, qkv, o, n2, gu, d) in mods for r in (n1._parameters["weight"], n2._parameters["weight"],
                                                                      qkv.quant, o.quant, gu.quant, d.quant)]


def _plan(model) -> _Plan | None:
    mods = _modules(model)
    if mods is None or model.norm is None or type(model.norm).__name__ != "RMSNorm":
        return None
    refs = _refs(mods)
    cached = _plans.get(model)
    if cached is not None and len(cached.refs) == len(refs) and all(a is b for a, b in zip(cached.refs, refs)):
        return cached
    layers = (_Layer * len(mods))()
    for i, (_, attn, _, n1, qkv, o, n2, gu, d) in enumerate(mods):
        ql = [_qlinear(x) for x in (qkv, o, gu, d)]
        norms = (n1.weight, n2.weight)
        if any(q is None for q in ql) or any(w.dtype != torch.float32 or not w.is_contiguous() for w in norms):
            return None
        layers[i] = _Layer(n1.weight.data_ptr(), n2.weight.data_ptr(), *ql)
    cfg, a0 = model.cfg, mods[0][1]
    dims = _Dims(cfg.hidden_size, cfg.intermediate_size, a0.num_heads, a0.num_kv_heads, a0.head_dim,
                 model.norm.eps, a0.scale)
    if any(n.eps != model.norm.eps for (_, _, _, n1, _, _, n2, _, _) in mods for n in (n1, n2)):
        return None
    plan = _Plan(refs, layers, dims, model.norm.weight)
    _plans[model] = plan
    return plan


def _applies(model, input_ids: torch.Tensor, ctx) -> bool:
    from minillm.layers.attention import CpuAttentionBackend
    meta, cache = ctx.meta, ctx.cache
    n = input_ids.numel()
    if not (0 < n < cpu_qgemm.BATCHED_MIN_ROWS and meta.num_seqs == n and all(q == 1 for q in meta.query_lens)
            and model.comm.world_size == 1 and model.is_first and model.is_last and model.dtype == torch.float32
            and type(ctx.backend) is CpuAttentionBackend and ctx.backend.attend_fn is None
            and cache.k.dtype == torch.float32 and cache.v.dtype == torch.float32 and cache.k.device.type == "cpu"
            and cache.k.is_contiguous() and cache.v.is_contiguous() and cache.k.shape[0] == len(model.layers)):
        return False
    attn = cpu_native.load()
    a0 = model.layers[0].self_attn
    return attn is not None and bool(attn.minillm_paged_decode_supports(a0.num_heads // a0.num_kv_heads, a0.head_dim))


def try_forward(model, input_ids: torch.Tensor, positions: torch.Tensor, ctx) -> torch.Tensor | None:
    """The normed final hidden states [T, hidden] of a decode step, or None (run the layers) where it does not
    apply. Also fills ctx.cos / ctx.sin as the layers would."""
    if not enabled() or input_ids.device.type != "cpu" or not _applies(model, input_ids, ctx):
        return None
    lib = load()
    plan = _plan(model) if lib is not None else None
    if plan is None:
        return None
    from minillm.kernels.cpu_paged_attention import check_tables
    meta, cache = ctx.meta, ctx.cache
    num_slots = cache.k.shape[2]
    lens = torch.tensor(meta.seq_lens, dtype=torch.int64)
    tables = meta.block_tables.to(torch.int64).contiguous()
    slots = meta.slot_mapping.to(torch.int64).contiguous()
    check_tables(tables, lens, meta.block_size, num_slots)
    if int(slots.min()) < 0 or int(slots.max()) >= num_slots:
        raise IndexError(f"slot_mapping {slots.tolist()} outside the KV pool's {num_slots} slots")
    ctx.cos, ctx.sin = model.rotary.cos_sin(positions, meta.query_lens, meta.seq_lens)
    cos, sin = ctx.cos.float().contiguous(), ctx.sin.float().contiguous()
    x = model.embed_tokens(input_ids).float().contiguous().clone()
    rc = lib.minillm_decode_step(x.data_ptr(), x.shape[0], ctypes.addressof(plan.layers), len(plan.layers),
                                 ctypes.byref(plan.dims), plan.final_norm.data_ptr(), cos.data_ptr(), sin.data_ptr(),
                                 cache.k.data_ptr(), cache.v.data_ptr(), num_slots, slots.data_ptr(),
                                 tables.data_ptr(), tables.shape[1], lens.data_ptr(), meta.block_size,
                                 torch.get_num_threads())
    if rc != 0:
        raise MemoryError("the fused decode step could not allocate its scratch buffers")
    global FUSED_STEPS
    FUSED_STEPS += 1
    return x
