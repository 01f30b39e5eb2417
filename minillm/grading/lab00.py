"""Checkers for lab00 — anatomy of inference: FLOPs, bytes, arithmetic intensity and the roofline.

Tasks (the notebook documents the same signatures; minillm's own versions are in minillm/bench/roofline.py):
  lab00_1  linear_flops_bytes(num_tokens, d_in, d_out, dtype_bytes) -> (flops, bytes)
  lab00_2  model_flops_bytes(cfg, num_tokens, num_logits, dtype_bytes) -> (flops, bytes)
  lab00_3  roofline_time(flops, nbytes, peak_flops, bandwidth) -> seconds (a lower bound)

Oracles: the matmul formula, stated once (lab00_1); for a whole model, the shapes of the linear layers of a real
minillm LlamaModel built on the meta device (no memory) from the config (lab00_2), so the count follows the
model's code, not a second description of it; max(compute time, memory time) (lab00_3). When the learner's
answer disagrees, the usual mistakes are recognised to give a precise hint.
"""
from __future__ import annotations

import math
from typing import Any, Callable

import torch
from hypothesis import example, given, strategies as st

from minillm.config import ModelConfig
from minillm.grading.core import Hint, Task, as_float, diagnose, fail, function_answer, minillm_objects, run_property
from minillm.models.llama import LlamaModel

__all__ = ["check_lab00_1", "check_lab00_2", "check_lab00_3", "TASKS"]

# SmolLM2-135M's shape, used for hand-picked examples.
SMOLLM2 = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
               num_kv_heads=3, head_dim=64, tie_word_embeddings=True)


# --------------------------------------------------------------------------- oracles

def linear_flops_bytes_ref(num_tokens: int, d_in: int, d_out: int, dtype_bytes: int) -> tuple[int, int]:
    """Y[T, d_out] = X[T, d_in] @ W[d_out, d_in]^T: one multiply + one add per weight per token;
    bytes = read W once + read X + write Y."""
    return 2 * num_tokens * d_in * d_out, dtype_bytes * (d_in * d_out + num_tokens * d_in + num_tokens * d_out)


def model_flops_bytes_ref(cfg: ModelConfig, num_tokens: int, num_logits: int, dtype_bytes: int) -> tuple[int, int]:
    """Sum over the linear layers of a minillm model built from cfg: every decoder matmul sees num_tokens rows,
    the LM head (the embedding matrix when tied) num_logits rows."""
    with torch.device("meta"):
        model = LlamaModel(cfg)
    flops = nbytes = 0
    for layer in model.layers:
        for m in layer.modules():
            w = dict(m.named_parameters(recurse=False)).get("weight")
            if w is not None and w.dim() == 2:     # the matrices (norm weights are vectors)
                f, b = linear_flops_bytes_ref(num_tokens, w.shape[1], w.shape[0], dtype_bytes)
                flops, nbytes = flops + f, nbytes + b
    head = model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight
    f, b = linear_flops_bytes_ref(num_logits, head.shape[1], head.shape[0], dtype_bytes)
    return flops + f, nbytes + b


def roofline_time_ref(flops: float, nbytes: float, peak_flops: float, bandwidth: float) -> float:
    """It can't compute faster than peak, nor move bytes faster than the bandwidth; at best both overlap."""
    return max(flops / peak_flops, nbytes / bandwidth)


# --------------------------------------------------------------------------- reading answers

def _close(a: float, b: float, rel: float = 1e-9) -> bool:
    return math.isclose(a, b, rel_tol=rel, abs_tol=1e-12)


def _pair(result: Any, fn_name: str) -> tuple[float, float]:
    __tracebackhide__ = True
    if type(result) not in (tuple, list) or len(result) != 2:
        fail(f"{fn_name} must return a pair (flops, bytes); it returned {type(result).__name__} {result!r:.80}",
             "end the function with `return flops, nbytes`.")
    return as_float(result[0], f"{fn_name}'s flops"), as_float(result[1], f"{fn_name}'s bytes")


def _same_pair(a: Any, b: tuple[float, float]) -> bool:
    try:
        return type(a) in (tuple, list) and len(a) == 2 and _close(float(a[0]), b[0]) and _close(float(a[1]), b[1])
    except (TypeError, ValueError):
        return False


# --------------------------------------------------------------------------- lab00_1

_tokens = st.integers(1, 4096)
_dims = st.integers(1, 8192)
_dtype_bytes = st.sampled_from([4, 2, 1])

_LINEAR_PROBES = [(1, 576, 1536, 2), (512, 576, 1536, 4), (7, 300, 11, 1)]
_LINEAR_MISTAKES = [
    ("you counted multiply-adds (MACs), not FLOPs: each weight costs one multiply AND one add per token",
     lambda t, i, o, b: (t * i * o, b * (i * o + t * i + t * o))),
    ("the FLOPs don't grow with the number of tokens: every token is multiplied by the whole weight matrix",
     lambda t, i, o, b: (2 * i * o, b * (i * o + t * i + t * o))),
    ("you counted elements, not bytes: multiply by dtype_bytes",
     lambda t, i, o, b: (2 * t * i * o, i * o + t * i + t * o)),
    ("you counted only the weights: the input activations are read and the outputs written too",
     lambda t, i, o, b: (2 * t * i * o, b * i * o)),
    ("the outputs Y [num_tokens, d_out] are written to memory too",
     lambda t, i, o, b: (2 * t * i * o, b * (i * o + t * i))),
    ("the inputs X [num_tokens, d_in] are read from memory too",
     lambda t, i, o, b: (2 * t * i * o, b * (i * o + t * o))),
    ("the weights are read once per forward pass, not once per token",
     lambda t, i, o, b: (2 * t * i * o, b * (t * i * o + t * i + t * o))),
    ("you returned (bytes, flops): return (flops, bytes)",
     lambda t, i, o, b: linear_flops_bytes_ref(t, i, o, b)[::-1]),
]


def verify_lab00_1(linear_flops_bytes: Callable[..., Any]) -> None:
    @given(num_tokens=_tokens, d_in=_dims, d_out=_dims, dtype_bytes=_dtype_bytes)
    @example(num_tokens=1, d_in=576, d_out=1536, dtype_bytes=2)
    @example(num_tokens=512, d_in=576, d_out=1536, dtype_bytes=4)
    def prop(num_tokens: int, d_in: int, d_out: int, dtype_bytes: int) -> None:
        args = (num_tokens, d_in, d_out, dtype_bytes)
        got = _pair(linear_flops_bytes(*args), "linear_flops_bytes")
        ref = linear_flops_bytes_ref(*args)
        if _same_pair(got, ref):
            return
        why = diagnose(linear_flops_bytes, _LINEAR_MISTAKES, [args] + _LINEAR_PROBES, _same_pair)
        fail(f"got (flops, bytes) = ({got[0]:g}, {got[1]:g}), expected ({ref[0]:g}, {ref[1]:g})"
             + (f" — {why}" if why else ""))

    run_property(prop, max_examples=60, hint=Hint(
        "count the work of Y = X @ Wᵀ per weight and per token, and the bytes of every tensor the matmul reads or "
        "writes, not only the weights.",
        "each weight meets every token once, and a multiply plus an add is 2 FLOPs; the memory traffic is W read "
        "once, X read and Y written, at dtype_bytes per element.",
        "FLOPs = 2·T·d_in·d_out; bytes = dtype_bytes·(d_in·d_out + T·d_in + T·d_out)."))


# --------------------------------------------------------------------------- lab00_2

@st.composite
def _configs(draw: st.DrawFn) -> ModelConfig:
    kv_heads = draw(st.integers(1, 8))
    heads = kv_heads * draw(st.integers(1, 4))
    head_dim = draw(st.sampled_from([8, 16, 32, 64, 128]))
    # hidden need not be heads x head_dim (Gemma-style and some GQA models): wrong answers that assume it, show
    hidden = draw(st.sampled_from([heads * head_dim, 64, 256, 576]))
    return ModelConfig(vocab_size=draw(st.integers(100, 60000)), hidden_size=hidden,
                       intermediate_size=draw(st.integers(16, 4096)), num_layers=draw(st.integers(1, 40)),
                       num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
                       tie_word_embeddings=draw(st.booleans()))


def _matmuls(cfg: ModelConfig, T: int, n: int, *, kv_heads: int | None = None, mlp_mats: int = 2,
             head_tokens: int | None = None, fused_qkv: bool = True, layers: int | None = None,
             q_width: int | None = None, with_o_proj: bool = True, with_head: bool = True) -> list[tuple[int, ...]]:
    """A forward pass's matmuls with one knob turned to a classic mistake (for diagnosis only)."""
    h, i = cfg.hidden_size, cfg.intermediate_size
    q = cfg.num_heads * cfg.head_dim if q_width is None else q_width
    kv = (cfg.num_kv_heads if kv_heads is None else kv_heads) * cfg.head_dim
    qkv = [(T, h, q + 2 * kv)] if fused_qkv else [(T, h, q), (T, h, kv), (T, h, kv)]
    layer = qkv + ([(T, q, h)] if with_o_proj else []) + [(T, h, mlp_mats * i), (T, i, h)]
    head = [(n if head_tokens is None else head_tokens, h, cfg.vocab_size)] if with_head else []
    return layer * (cfg.num_layers if layers is None else layers) + head


def _mistake(**kw: Any) -> Callable[..., tuple[int, int]]:
    def wrong(cfg: ModelConfig, T: int, n: int, b: int) -> tuple[int, int]:
        parts = [linear_flops_bytes_ref(t, i, o, b) for t, i, o in _matmuls(cfg, T, n, **kw)]
        return sum(f for f, _ in parts), sum(x for _, x in parts)
    return wrong


_MODEL_PROBES = [(ModelConfig(**SMOLLM2), 1, 1, 4), (ModelConfig(**SMOLLM2), 64, 2, 2),
                 (ModelConfig(vocab_size=1000, hidden_size=96, intermediate_size=200, num_layers=3, num_heads=8,
                              num_kv_heads=2, head_dim=16), 5, 3, 1)]
_MODEL_MISTAKES = [
    ("you sized K and V like Q (multi-head attention): with GQA the k/v projections have only "
     "num_kv_heads·head_dim outputs each", lambda cfg, T, n, b: _mistake(kv_heads=cfg.num_heads)(cfg, T, n, b)),
    ("you counted one decoder layer: multiply by cfg.num_layers", _mistake(layers=1)),
    ("the LM head runs on num_logits tokens only (the engine computes logits for the last prompt token), "
     "not on all num_tokens", lambda cfg, T, n, b: _mistake(head_tokens=T)(cfg, T, n, b)),
    ("you left out the LM head (hidden_size -> vocab_size on num_logits tokens)", _mistake(with_head=False)),
    ("the MLP has three matrices (gate and up: hidden -> intermediate; down: intermediate -> hidden)",
     _mistake(mlp_mats=1)),
    ("you left out the attention output projection o_proj [num_heads·head_dim -> hidden]",
     _mistake(with_o_proj=False)),
    ("q, k and v are one fused matmul in minillm: its input activations are read once, not three times",
     _mistake(fused_qkv=False)),
    ("Q has num_heads·head_dim outputs, which need not equal hidden_size",
     lambda cfg, T, n, b: _mistake(q_width=cfg.hidden_size)(cfg, T, n, b)),
    ("you returned (bytes, flops): return (flops, bytes)", lambda cfg, T, n, b: _mistake()(cfg, T, n, b)[::-1]),
]


def verify_lab00_2(model_flops_bytes: Callable[..., Any]) -> None:
    @given(cfg=_configs(), num_tokens=st.integers(1, 2048), num_logits=st.integers(1, 8),
           dtype_bytes=_dtype_bytes)
    @example(cfg=ModelConfig(**SMOLLM2), num_tokens=1, num_logits=1, dtype_bytes=4)
    @example(cfg=ModelConfig(**SMOLLM2), num_tokens=256, num_logits=1, dtype_bytes=2)
    @example(cfg=ModelConfig(vocab_size=1000, hidden_size=256, intermediate_size=300, num_layers=2, num_heads=4,
                             num_kv_heads=2, head_dim=128), num_tokens=3, num_logits=2, dtype_bytes=2)
    def prop(cfg: ModelConfig, num_tokens: int, num_logits: int, dtype_bytes: int) -> None:
        args = (cfg, num_tokens, min(num_logits, num_tokens), dtype_bytes)
        got = _pair(model_flops_bytes(*args), "model_flops_bytes")
        ref = model_flops_bytes_ref(*args)
        if _same_pair(got, ref):
            return
        why = diagnose(model_flops_bytes, _MODEL_MISTAKES, [args] + _MODEL_PROBES, _same_pair)
        fail(f"got (flops, bytes) = ({got[0]:g}, {got[1]:g}), expected ({ref[0]:g}, {ref[1]:g}) for num_tokens="
             f"{args[1]}, num_logits={args[2]}, hidden_size={cfg.hidden_size}, heads {cfg.num_heads} x head_dim "
             f"{cfg.head_dim}" + (f" — {why}" if why else ""))

    run_property(prop, max_examples=60, hint=Hint(
        "a forward pass is a sum of matmuls: list every linear layer of a decoder layer and at the model's end, "
        "with its input and output widths and how many tokens go through it.",
        "per layer: the fused q/k/v projection (K and V have only the kv heads), o_proj, the MLP's gate/up and "
        "down, times num_layers; the LM head runs on num_logits tokens only. linear_flops_bytes gives each one.",
        "sum linear_flops_bytes over: qkv_proj [hidden -> (H + 2·KVH)·D], o_proj [H·D -> hidden], gate_up_proj "
        "[hidden -> 2·intermediate], down_proj [intermediate -> hidden], times num_layers; plus the LM head "
        "[hidden -> vocab] on num_logits tokens."))


# --------------------------------------------------------------------------- lab00_3

_pos = st.floats(1e3, 1e16, allow_nan=False, allow_infinity=False)
_ROOF_PROBES = [(2.7e8, 5.4e8, 2e11, 2e10),      # SmolLM2 decode on a CPU: memory-bound
                (1.4e11, 5.4e8, 2e11, 2e10),     # a 512-token prefill: compute-bound
                (3e9, 7e8, 1e12, 3e11)]
_ROOF_MISTAKES = [
    ("you took the smaller of compute time and memory time: the work needs BOTH, so the bound is the larger "
     "(attainable FLOP/s is the min of the two roofs; time is the max)",
     lambda f, b, p, w: min(f / p, b / w)),
    ("you added the two times: that assumes no overlap at all — the roofline bound assumes perfect overlap, "
     "so it is the larger of the two", lambda f, b, p, w: f / p + b / w),
    ("you ignored the compute roof (flops / peak_flops)", lambda f, b, p, w: b / w),
    ("you ignored the memory roof (nbytes / bandwidth)", lambda f, b, p, w: f / p),
    ("that is the attainable FLOP/s, not a time: divide the work by it", lambda f, b, p, w: min(p, f / b * w)),
    ("check your units: time = work / rate", lambda f, b, p, w: max(f * p, b * w)),
]


def verify_lab00_3(roofline_time: Callable[..., Any]) -> None:
    @given(flops=_pos, nbytes=_pos, peak_flops=st.floats(1e9, 1e16), bandwidth=st.floats(1e9, 1e13))
    @example(*_ROOF_PROBES[0])
    @example(*_ROOF_PROBES[1])
    def prop(flops: float, nbytes: float, peak_flops: float, bandwidth: float) -> None:
        args = (flops, nbytes, peak_flops, bandwidth)
        got = as_float(roofline_time(*args), "roofline_time's result")
        ref = roofline_time_ref(*args)
        if _close(got, ref):
            return
        why = diagnose(roofline_time, _ROOF_MISTAKES, [args] + _ROOF_PROBES,
                       lambda a, b: type(a) in (int, float) and _close(a, b))
        fail(f"roofline_time = {got:.6g} s, expected {ref:.6g} s (compute {flops / peak_flops:.3g} s, memory "
             f"{nbytes / bandwidth:.3g} s)" + (f" — {why}" if why else ""))

    run_property(prop, max_examples=60, hint=Hint(
        "the roofline: the work can go no faster than the compute roof, nor than the memory roof, and at best the "
        "two overlap.",
        "work out the time each roof alone imposes (work / rate): the real time must respect both at once.",
        "max(flops / peak_flops, nbytes / bandwidth)."))


# --------------------------------------------------------------------------- the tasks

def _task(k: int, name: str, verify: Callable[[Any], None], oracle: Callable[..., Any]) -> Task:
    return Task(f"lab00_{k}", what=name, verify=verify, engine=minillm_objects(f"minillm.bench.roofline:{name}"),
                oracles=lambda: [oracle], form=function_answer(name))


TASKS = {t.id: t for t in (_task(1, "linear_flops_bytes", verify_lab00_1, linear_flops_bytes_ref),
                           _task(2, "model_flops_bytes", verify_lab00_2, model_flops_bytes_ref),
                           _task(3, "roofline_time", verify_lab00_3, roofline_time_ref))}

check_lab00_1 = TASKS["lab00_1"].checker(
    'linear_flops_bytes(num_tokens, d_in, d_out, dtype_bytes) -> (flops, bytes) for Y = X @ W.T.')
check_lab00_2 = TASKS["lab00_2"].checker(
    'model_flops_bytes(cfg, num_tokens, num_logits, dtype_bytes) -> (flops, bytes) of one forward pass.')
check_lab00_3 = TASKS["lab00_3"].checker(
    'roofline_time(flops, nbytes, peak_flops, bandwidth) -> the least time (s) the work can take.')
