"""Decode steps of a quantized model in one C call (csrc/decode_step.c), instead of ~12 Python ops per layer.

`try_forward(model, input_ids, positions, ctx)` returns the final hidden states, or None when the fused step does
not apply and the layers must run — it applies only where it computes exactly what they would:

- every row is a decode token (query length 1). Below cpu_qgemm.BATCHED_MIN_ROWS rows the matmuls run the integer
  kernel on the packed weights (csrc/qgemm.c), as the layers' qlinear does; from there on the int16 GEMM
  (csrc/int16_gemm.c) on the same packed copies the layers' batched path makes (cpu_qgemm.int16_copy), when that
  is the batched path (cpu_qgemm.batched_path() == "int16") — otherwise the layers run;
- the whole model on one rank, float32, on the CPU; every decoder module of minillm's own classes with no forward
  hooks (a lab that swaps a module or hooks one gets the layers that run its code), and every linear quantized
  weight-only (W8A8 layers quantize activations per token: cpu_w8a8.py);
- the attention backend is the C CPU backend without a learner's attend function, the C kernel takes the head
  shape, and the KV pool is a contiguous float32 pool.

MINILLM_DECODE_STEP=layers switches it off (A/B runs; the layers are the reference the tests compare against), as
do MINILLM_QGEMM=torch|scalar (the layers then run another matmul than the step's).

Why batched decode steps too: at 48 rows a step's ~12 torch ops per layer (norms, RoPE, SiLU, KV writes, each
60-160 us at that size between the int16 matmuls' parallel regions) and the Python around them cost ~60 of its
~195 ms on SmolLM2 (cProfile, 2 threads); the matmuls and the attention are the same kernels either way.
"""
from __future__ import annotations

import ctypes
import functools
import os
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch

from minillm.kernels import cpu_native, cpu_qgemm
from minillm.quant.formats import QuantizedWeight

CSRC = Path(__file__).with_name("csrc")
SOURCES = (CSRC / "decode_step.c", CSRC / "qgemm.c", CSRC / "paged_decode.c", CSRC / "int16_gemm.c")
_P, _I = ctypes.c_void_p, ctypes.c_int64
FUSED_STEPS = 0          # decode steps run fused, for the benchmarks to say which path they timed ...
FUSED_INT16_STEPS = 0    # ... and those of them whose matmuls ran the int16 GEMM


class _QLinear(ctypes.Structure):
    _fields_ = [("kind", _I), ("group", _I), ("n", _I), ("k", _I), ("w", _P), ("scales", _P), ("mins", _P)]


class _Layer(ctypes.Structure):
    _fields_ = [("input_norm", _P), ("post_norm", _P), ("qkv", _QLinear), ("o", _QLinear), ("gate_up", _QLinear),
                ("down", _QLinear)]


class _I16(ctypes.Structure):
    _fields_ = [("tiles", _P), ("scales", _P), ("n_pad", _I)]


class _Layer16(ctypes.Structure):
    _fields_ = [("qkv", _I16), ("o", _I16), ("gate_up", _I16), ("down", _I16)]


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
    lib = cpu_native.open_library(SOURCES, "fused C decode step", "running the layers")
    if lib is None:
        return None
    lib.minillm_decode_step.argtypes = [_P, _I, _P, _P, _P, _P, _I, _P, _P, _P, _P, _P, _P, _I, _P, _P, _I, _P,
                                        _I, ctypes.c_int]
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
    """The C view of a model's layers, and what it was built from: `valid()` says, cheaply, whether the model still
    holds exactly that (the same module objects, no hooks, the same quantized weights and norm storage)."""
    layers: ctypes.Array
    dims: _Dims
    final_norm: torch.Tensor
    embed: _QLinear | None        # the quantized embedding the step looks tokens up in (None: torch does it)
    embed_ref: object             # the QuantizedWeight behind `embed` (or None)
    children: list                # (module dict, key, module) the plan was built from
    hook_dicts: list              # the forward (pre-)hook dicts of those modules: all empty
    quants: list                  # (layer, QuantizedWeight) pairs: qkv, o, gate_up, down of each layer in turn
    norms: list                   # (Parameter, data_ptr, dtype) of the norms
    packed16: ctypes.Array | None = None   # the int16 copies' C view, made on the first batched step
    packs: list | None = None              # the PackedInt16 objects behind it (kept alive with the plan)

    def valid(self, model) -> bool:
        # ~270 modules checked every step: plain dict lookups and identity tests, no nn.Module.__getattr__ (the
        # step runs with caches cold from streaming the weights, where the first version of this took ~0.5 ms)
        return (all(d.get(k) is m for d, k, m in self.children) and not any(self.hook_dicts)
                and all(layer.__dict__.get("quant") is q for layer, q in self.quants)
                and all(p.data_ptr() == ptr and p.dtype == dt for p, ptr, dt in self.norms)
                and _embed_quant(model) is self.embed_ref)


_plans: "weakref.WeakKeyDictionary[torch.nn.Module, _Plan]" = weakref.WeakKeyDictionary()

_NAMES = ("self_attn", "mlp", "input_layernorm", "post_attention_layernorm")


def _modules(model) -> list | None:
    """The modules the fused step replaces, or None if any is not exactly minillm's own class, or hooked."""
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


def _embed_quant(model):
    e = model._modules.get("embed_tokens")
    return None if e is None else e.__dict__.get("quant")


def _build(model) -> _Plan | None:
    from minillm.layers.norm import RMSNorm
    mods = _modules(model)
    norm = model._modules.get("norm")
    if mods is None or type(norm) is not RMSNorm:
        return None
    layers = (_Layer * len(mods))()
    for i, (_, attn, _, n1, qkv, o, n2, gu, d) in enumerate(mods):
        ql = [_qlinear(x) for x in (qkv, o, gu, d)]
        norms = (n1.weight, n2.weight)
        if any(q is None for q in ql) or any(w.dtype != torch.float32 or not w.is_contiguous() for w in norms):
            return None
        layers[i] = _Layer(n1.weight.data_ptr(), n2.weight.data_ptr(), *ql)
    if norm.weight.dtype != torch.float32 or any(n.eps != norm.eps for (_, _, _, n1, _, _, n2, _, _) in mods
                                                 for n in (n1, n2)):
        return None
    cfg, a0 = model.cfg, mods[0][1]
    dims = _Dims(cfg.hidden_size, cfg.intermediate_size, a0.num_heads, a0.num_kv_heads, a0.head_dim, norm.eps,
                 a0.scale)
    embed_ref = _embed_quant(model)
    embed = _qlinear(model.embed_tokens) if embed_ref is not None and model.embed_tokens.tp_size == 1 else None
    children = [(model._modules, "layers", model.layers), (model._modules, "norm", norm),
                (model._modules, "embed_tokens", model.embed_tokens)]
    children += [(model.layers._modules, k, v) for k, v in model.layers._modules.items()]
    for mod in mods:
        layer, attn, mlp = mod[:3]
        children += [(layer._modules, k, layer._modules[k]) for k in _NAMES]
        children += [(attn._modules, k, attn._modules[k]) for k in ("qkv_proj", "o_proj")]
        children += [(mlp._modules, k, mlp._modules[k]) for k in ("gate_up_proj", "down_proj")]
    hooked = [m for mod in mods for m in mod] + [norm]
    hook_dicts = [d for m in hooked for d in (m._forward_hooks, m._forward_pre_hooks)]
    quants = [(m, m.quant) for mod in mods for m in (mod[4], mod[5], mod[7], mod[8])]
    norms = [(p, p.data_ptr(), p.dtype) for mod in mods for p in (mod[3].weight, mod[6].weight)]
    norms.append((norm.weight, norm.weight.data_ptr(), norm.weight.dtype))
    return _Plan(layers, dims, norm.weight, embed, embed_ref if embed is not None else None, children, hook_dicts,
                 quants, norms)


def _packed16(plan: _Plan) -> ctypes.Array:
    """The int16 copies of the plan's matmuls (made now where the layers have not made them yet). Every input width
    is even, as the int16 kernel needs: _qlinear took only widths that are a multiple of the group (of 32)."""
    if plan.packed16 is None:
        packs = [cpu_qgemm.int16_copy(q) for _, q in plan.quants]
        arr = (_Layer16 * (len(packs) // 4))()
        for i in range(len(arr)):
            arr[i] = _Layer16(*(_I16(p.tiles.data_ptr(), p.scales.data_ptr(), p.scales.shape[1])
                                for p in packs[4 * i:4 * i + 4]))
        plan.packed16, plan.packs = arr, packs
    return plan.packed16


def _plan(model) -> _Plan | None:
    cached = _plans.get(model)
    if cached is not None and cached.valid(model):
        return cached
    plan = _build(model)
    if plan is not None:
        _plans[model] = plan
    else:
        _plans.pop(model, None)
    return plan


def _mode(model, input_ids: torch.Tensor, ctx) -> str | None:
    """The matmul kernel the step would run, the one the layers would ("qgemm" or "int16"), or None: not this step."""
    from minillm.layers.attention import CpuAttentionBackend
    meta, cache = ctx.meta, ctx.cache
    n = input_ids.numel()
    k, v = cache.k, cache.v
    if not (0 < n and meta.num_seqs == n and all(q == 1 for q in meta.query_lens)
            and model.comm.world_size == 1 and model.is_first and model.is_last
            and type(ctx.backend) is CpuAttentionBackend and ctx.backend.attend_fn is None
            and k.dtype == torch.float32 and v.dtype == torch.float32 and k.device.type == "cpu"
            and k.is_contiguous() and v.is_contiguous() and k.shape[0] == len(model.layers._modules)
            and cpu_qgemm.mode() == "c"):
        return None
    attn = cpu_native.load()
    a0 = model.layers._modules["0"]._modules["self_attn"]
    if attn is None or not _supports(attn, a0.num_heads // a0.num_kv_heads, a0.head_dim):
        return None
    if n < cpu_qgemm.BATCHED_MIN_ROWS:
        return "qgemm"
    return "int16" if cpu_qgemm.batched_path() == "int16" else None


@functools.lru_cache(maxsize=None)
def _supports(attn, group: int, head_dim: int) -> bool:
    return bool(attn.minillm_paged_decode_supports(group, head_dim))


_ERRORS = {-2: (IndexError, "slot_mapping has a slot outside the KV pool's {slots} slots"),
           -3: (ValueError, "seq_lens must be in 1..{width} (block table width x block_size), got {lens}"),
           -4: (ValueError, "a block table entry is outside the pool's {blocks} blocks"),
           -5: (IndexError, "a token id is outside the vocabulary (0..{vocab})")}


def try_forward(model, input_ids: torch.Tensor, positions: torch.Tensor, ctx) -> torch.Tensor | None:
    """The normed final hidden states [T, hidden] of a decode step, or None (run the layers) where it does not
    apply. Also fills ctx.cos / ctx.sin as the layers would."""
    mode = _mode(model, input_ids, ctx) if enabled() and input_ids.device.type == "cpu" else None
    if mode is None:
        return None
    lib = load()
    plan = _plan(model) if lib is not None else None
    if plan is None:
        return None
    packed = _packed16(plan) if mode == "int16" else None
    meta, cache = ctx.meta, ctx.cache
    num_slots = cache.k.shape[2]
    lens = torch.tensor(meta.seq_lens, dtype=torch.int64)
    tables = meta.block_tables.to(torch.int64).contiguous()
    slots = meta.slot_mapping.to(torch.int64).contiguous()
    ids = input_ids.to(torch.int64).contiguous()
    ctx.cos, ctx.sin = model.rotary.cos_sin(positions, meta.query_lens, meta.seq_lens)
    cos, sin = ctx.cos.float().contiguous(), ctx.sin.float().contiguous()
    if plan.embed is not None:    # the step dequantizes the token rows itself
        x = torch.empty(ids.numel(), plan.dims.hidden)
    else:
        x = model.embed_tokens(input_ids).float().contiguous().clone()
    rc = lib.minillm_decode_step(x.data_ptr(), x.shape[0], ids.data_ptr(),
                                 ctypes.byref(plan.embed) if plan.embed is not None else None,
                                 ctypes.addressof(plan.layers), None if packed is None else ctypes.addressof(packed),
                                 len(plan.layers), ctypes.byref(plan.dims),
                                 plan.final_norm.data_ptr(), cos.data_ptr(), sin.data_ptr(),
                                 cache.k.data_ptr(), cache.v.data_ptr(), num_slots, slots.data_ptr(),
                                 tables.data_ptr(), tables.shape[1], lens.data_ptr(), meta.block_size,
                                 torch.get_num_threads())
    if rc == -1:
        raise MemoryError("the fused decode step could not allocate its scratch buffers")
    if rc == -6:    # NaN or inf reached an int16 matmul's input: the layers' float fallback propagates it
        return None
    if rc in _ERRORS:
        err, text = _ERRORS[rc]
        raise err(text.format(slots=num_slots, width=tables.shape[1] * meta.block_size, lens=meta.seq_lens,
                              blocks=num_slots // meta.block_size, vocab=model.cfg.vocab_size - 1)
                  + f" (slot_mapping {slots.tolist()}, block_tables {tables.tolist()})")
    global FUSED_STEPS, FUSED_INT16_STEPS
    FUSED_STEPS += 1
    FUSED_INT16_STEPS += packed is not None
    return x
