"""Checkers for lab03 — the PagedAttention kernel.

Tasks (the notebook documents the same signatures):
  lab03_1  gather_kv(cache, block_table, seq_len) -> [seq_len, KVH, D] in the cache's dtype: positions 0..seq_len-1
           of one sequence read through its block table from a paged cache [num_blocks, block_size, KVH, D] (maybe
           a strided view, like KVCache.layer(i)). minillm's own: minillm.kernels.paged_attention_ref.gather_kv.
  lab03_2  online_softmax_update(m, l, acc, scores, values) -> (m, l, acc): fold a block of scores [G, T] / values
           [T, D] into the running max m [G], sum l [G] and accumulator acc [G, D] (the engine does this inside its
           kernels: no engine function to forbid).
  lab03_3  paged_attention_kernel: a @triton.jit decode kernel with the signature of minillm's
           paged_attention_decode_kernel, launched like `launch_paged_attention` (grid (S, KVH)). It runs in
           Triton's interpreter in a child process (a load or store far out of bounds can crash the interpreter),
           then the engine's compile_for_gpu_target compiles it for sm80.

Oracles: the contiguous K/V a case was scattered from (lab03_1); the state of all the scores so far, at once, in
float64 (lab03_2); dense decode attention in float64 on the contiguous K/V (lab03_3).
"""
from __future__ import annotations

import functools
import json
import os
import signal
import subprocess
import sys
import tempfile
from typing import Any, Callable

import torch
from hypothesis import example, given, strategies as st

from minillm import config
from minillm.grading.core import (NOT_IMPLEMENTED, GradingError, Hint, Task, Watch, as_tensor, check, diagnose, fail,
                                  minillm_objects, reject_delegation, run_property)
from minillm.kernels.triton_paged_attention import (KernelCompileError, compile_for_gpu_target, kernel_source,
                                                    launch_decode)
from minillm.testing import PagedCase, make_paged_case

__all__ = ["check_lab03_1", "check_lab03_2", "check_lab03_3", "TASKS", "launch_paged_attention", "dense_decode_ref",
           "softmax_state_ref", "run_kernel_check"]


def _describe_case(c: PagedCase) -> str:
    bs = c.k_cache.shape[1]
    rows = [c.block_tables[s, :-(-int(n) // bs)].tolist() for s, n in enumerate(c.seq_lens.tolist())]
    return f"seq_lens={c.seq_lens.tolist()}, block_size={bs}, block_tables={rows}, {str(c.q.dtype)[6:]}"


def _same_bits(a: Any, b: torch.Tensor) -> bool:
    """Exactly a torch.Tensor equal to b: same shape and dtype, NaN where b has NaN, equal elsewhere."""
    return (type(a) is torch.Tensor and a.shape == b.shape and a.dtype == b.dtype
            and torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(0.0), b.nan_to_num(0.0)))


# --------------------------------------------------------------------------- lab03_1: gather through the table

def _gather_wrong(cache: torch.Tensor, table: list[int] | torch.Tensor, n: int, *, kind: str) -> torch.Tensor:
    """A gather with a classic mistake, to name the learner's (grader code: the task's oracles)."""
    bs, t, pos = cache.shape[1], torch.as_tensor(table).long(), torch.arange(n)
    rows = cache.reshape(-1, *cache.shape[2:])
    if kind == "contiguous":
        return rows[:n]
    if kind == "untrimmed":
        return cache[t[:-(-n // bs)]].reshape(-1, *cache.shape[2:])
    if kind == "whole_table":
        return cache[t].reshape(-1, *cache.shape[2:])[:n]
    if kind == "swapped":
        return cache[t[(pos % bs).clamp(max=len(t) - 1)], (pos // bs).clamp(max=bs - 1)]
    return cache[t.to(torch.uint8).long()[pos // bs], pos % bs]                     # "byte_ids"


_GATHER_MISTAKES = [(why, functools.partial(_gather_wrong, kind=kind)) for why, kind in [
    ("the cache is paged: position p lives in physical block block_table[p // block_size] at row p % block_size — "
     "follow the block table instead of reading the cache as one contiguous array", "contiguous"),
    ("keep only seq_len rows: the last block is usually only partly filled (its tail holds garbage)", "untrimmed"),
    ("keep only seq_len rows: the block table may have padding entries past the sequence's last block",
     "whole_table"),
    ("block index is p // block_size and the row inside the block is p % block_size (not the other way round)",
     "swapped"),
    ("block ids go above 255 in a big pool: keep them as int64 (a uint8/int8 table wraps them around)", "byte_ids"),
]]


def verify_lab03_1(gather_kv: Callable[..., Any]) -> None:
    @given(seq_lens=st.lists(st.integers(1, 20), min_size=1, max_size=3), block_size=st.sampled_from([1, 2, 4, 8]),
           kv_heads=st.integers(1, 3), head_dim=st.sampled_from([1, 2, 4]),
           layout=st.sampled_from(["engine", "blocks"]), as_list=st.booleans(),
           dtype=st.sampled_from([torch.float32, torch.float32, torch.float16, torch.bfloat16]),
           extra_blocks=st.sampled_from([2, 2, 2, 300]), seed=st.integers(0, 2**16))
    @example([6, 3], 4, 1, 2, "blocks", False, torch.float32, 2, 1)
    @example([9, 4, 13], 4, 2, 2, "engine", False, torch.float32, 2, 2)
    @example([5], 8, 3, 4, "engine", True, torch.float32, 2, 3)
    @example([7, 12], 4, 2, 2, "engine", False, torch.float16, 2, 4)          # the cache's dtype is kept
    @example([10], 2, 1, 2, "blocks", True, torch.bfloat16, 2, 5)
    @example([20, 9], 2, 1, 1, "engine", False, torch.float32, 300, 6)        # block ids above 255
    def prop(seq_lens: list[int], block_size: int, kv_heads: int, head_dim: int, layout: str, as_list: bool,
             dtype: torch.dtype, extra_blocks: int, seed: int) -> None:
        c = make_paged_case(seq_lens, kv_heads, kv_heads, head_dim, block_size, seed, layout=layout, dtype=dtype,
                            extra_blocks=extra_blocks)
        cache_before = c.k_cache.clone()
        for s, n in enumerate(seq_lens):
            table = c.block_tables[s].tolist() if as_list else c.block_tables[s].clone()
            got = as_tensor(gather_kv(c.k_cache, table, n), "gather_kv's result")
            want = c.dense_k[s]
            if _same_bits(got, want):
                continue
            where = (f"sequence {s} (seq_len={n}, block_size={block_size}, block_table={c.block_tables[s].tolist()}, "
                     f"the last entry is padding, {str(dtype)[6:]} cache)")
            fresh = (c.k_cache, c.block_tables[s].tolist() if as_list else c.block_tables[s].clone(), n)
            why = diagnose(gather_kv, _GATHER_MISTAKES, [fresh], _same_bits)
            if why is None and got.shape != want.shape:
                why = f"expected shape {tuple(want.shape)} = [seq_len, KVH, D], got {tuple(got.shape)}"
            if why is None and got.dtype != want.dtype:
                fail(f"gather_kv returned {got.dtype} for a {want.dtype} cache ({where}): return the cache's rows "
                     "as they are, in the cache's dtype (index the cache, don't convert it)")
            if why is None and torch.isnan(got).any():
                why = ("your result holds NaN: every slot that is not one of this sequence's positions is poisoned "
                       "with NaN, so you read a slot outside 0..seq_len-1")
            fail(f"wrong rows for {where}" + (f" — {why}" if why else ""))
        check(_same_bits(c.k_cache, cache_before), "gather_kv modified the cache: it must only read it")

    run_property(prop, max_examples=40, hint=Hint(
        "read the cache through the block table: where does position p of the sequence live in the paged cache?",
        "position p is in physical block block_table[p // block_size], at row p % block_size; keep exactly seq_len "
        "rows, in the cache's dtype; the engine's cache is a strided view, and block ids can exceed 255.",
        "index the cache with the first cdiv(seq_len, bs) table entries (as int64), reshape the [n_blocks, bs, KVH, "
        "D] result to [n_blocks*bs, KVH, D] (.reshape, not .view) and keep the first seq_len rows."))


# --------------------------------------------------------------------------- lab03_2: online softmax

def softmax_state_ref(scores: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The state after all of `scores` [G, T] / `values` [T, D] at once, in float64: m = the max of each row,
    l = sum exp(score - m), acc = sum exp(score - m) * value."""
    s, v = scores.double(), values.double()
    m = s.amax(-1)
    p = torch.exp(s - m[:, None])
    return m, p.sum(-1), p @ v


def _os_variant(m: torch.Tensor, l: torch.Tensor, acc: torch.Tensor, scores: torch.Tensor, values: torch.Tensor, *,
                kind: str) -> tuple[torch.Tensor, ...]:
    """One update with a classic mistake (float64), to name the learner's (grader code: the task's oracles)."""
    m, l, acc, s, v = (x.double() for x in (m, l, acc, scores, values))
    if kind == "zero_start":
        m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    m_new = s.amax(-1) if kind == "block_max" else torch.maximum(m, s.amax(-1))
    alpha = torch.exp(m_new - m).nan_to_num(0.0, posinf=float("inf")) if kind == "inverted" else torch.exp(m - m_new)
    p = torch.exp(s) if kind in ("no_max", "no_max_rescaled") else torch.exp(s - m_new[:, None])
    alpha = torch.ones_like(alpha) if kind == "no_max" else alpha
    return (m_new, l * (1.0 if kind == "l" else alpha) + p.sum(-1),
            acc * (1.0 if kind == "acc" else alpha[:, None]) + p @ v)


_OS_MISTAKES = [(why, functools.partial(_os_variant, kind=kind)) for why, kind in [
    ("when the running max grows, rescale the accumulator too: acc = acc * exp(m_old - m_new) + p @ values", "acc"),
    ("when the running max grows, rescale the running sum too: l = l * exp(m_old - m_new) + sum(p)", "l"),
    ("the correction factor is exp(m_old - m_new) (<= 1), not exp(m_new - m_old)", "inverted"),
    ("m is the running max over ALL blocks so far: m_new = max(m_old, max of this block)", "block_max"),
    ("m starts at -inf, not 0: don't replace the initial -inf by 0 (or clamp m at 0) — when every score of a row "
     "is negative the running max is negative too, and for very negative scores (about -1e4) exp(score - 0) "
     "underflows to 0, so l = 0; alpha = exp(-inf - m_new) = 0 already handles the first block", "zero_start"),
    ("subtract the running max before exp(): exp(score) overflows for large scores (and l, acc are defined "
     "relative to m)", "no_max"),
    ("subtract the running max before exp(): p = exp(scores - m_new), not exp(scores) (exp overflows for large "
     "scores, and l, acc are defined relative to m)", "no_max_rescaled"),
]]


def _os_probes():
    g = torch.Generator().manual_seed(5)
    rand = functools.partial(torch.randn, generator=g, dtype=torch.float64)
    init = (torch.full((2,), float("-inf"), dtype=torch.float64), torch.zeros(2, dtype=torch.float64),
            torch.zeros(2, 3, dtype=torch.float64))
    a, va = rand(2, 3), rand(3, 3)
    after_a = softmax_state_ref(a, va)
    return [(*init, a, va),
            (*after_a, rand(2, 2) + 3.0, rand(2, 3)),         # this block raises the max
            (*after_a, rand(2, 4) - 3.0, rand(4, 3)),         # this one does not
            (*init, rand(2, 3) - 1e4, va)]                    # every score very negative


def _same_state(a: Any, b: tuple[torch.Tensor, ...]) -> bool:
    return (type(a) in (tuple, list) and len(a) == 3 and all(type(x) is torch.Tensor for x in a)
            and all(x.shape == y.shape and torch.allclose(x.double(), y, rtol=1e-6, atol=1e-9, equal_nan=True)
                    for x, y in zip(a, b)))


@st.composite
def _softmax_cases(draw: st.DrawFn) -> tuple:
    return (draw(st.integers(1, 4)), draw(st.integers(1, 5)),                  # G, D
            draw(st.lists(st.integers(1, 6), min_size=1, max_size=5)),         # the block sizes of one score row
            draw(st.sampled_from([1.0, 1.0, 5.0, 300.0])), draw(st.floats(0.0, 0.6)),       # magnitude, masked
            draw(st.sampled_from(["none", "up", "down"])), draw(st.sampled_from([0.0, 0.0, 0.0, -1e4])),  # shift
            draw(st.integers(0, 2**16)))


def _softmax_case(G: int, D: int, sizes: list[int], magnitude: float, masked: float, trend: str, shift: float,
                  seed: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    T = sum(sizes)
    scores = torch.randn(G, T, generator=g, dtype=torch.float64) * magnitude
    if trend != "none":     # blocks whose scores rise (or fall) one after the other: the max moves every block
        ramp = torch.arange(T, dtype=torch.float64) * (3.0 * max(magnitude, 1.0) / max(T, 1))
        scores = scores + (ramp if trend == "up" else -ramp)
    drop = torch.rand(G, T, generator=g) < masked
    for start in torch.tensor([0] + sizes[:-1]).cumsum(0).tolist():       # every block keeps a real score per row
        drop[:, start] = False
    scores = (scores + shift).masked_fill(drop, float("-inf"))              # shift -1e4: every score very negative
    return scores.to(dtype), torch.randn(T, D, generator=g, dtype=torch.float64).to(dtype)


def _state(got: Any, dtype: torch.dtype, G: int, D: int, where: str) -> list[torch.Tensor]:
    __tracebackhide__ = True
    check(type(got) in (tuple, list) and len(got) == 3,
          f"online_softmax_update must return a tuple (m, l, acc), got {type(got).__name__} {where}")
    state = [as_tensor(x, f"online_softmax_update's {name}") for x, name in zip(got, ("m", "l", "acc"))]
    for x, name, shape in zip(state, ("m", "l", "acc"), [(G,), (G,), (G, D)]):
        check(tuple(x.shape) == shape, f"{name} has shape {tuple(x.shape)}, expected {shape} {where}")
        check(x.dtype == dtype, f"{name} is {x.dtype}, expected {dtype} (the inputs' dtype) {where}")
    return state


def verify_lab03_2(online_softmax_update: Callable[..., Any]) -> None:
    @given(case=_softmax_cases(), dtype=st.sampled_from([torch.float64, torch.float64, torch.float32]))
    @example(case=(1, 1, [2, 2], 1.0, 0.0, "up", 0.0, 0), dtype=torch.float64)           # the max moves up
    @example(case=(2, 3, [3, 1, 4], 1.0, 0.3, "down", 0.0, 1), dtype=torch.float64)      # masked -inf scores
    @example(case=(2, 2, [4, 4], 300.0, 0.0, "up", 0.0, 2), dtype=torch.float32)         # huge scores
    @example(case=(3, 2, [1, 5, 2], 800.0, 0.2, "none", 0.0, 3), dtype=torch.float64)    # overflow even in float64
    @example(case=(2, 3, [3, 2, 4], 1.0, 0.2, "up", -1e4, 4), dtype=torch.float32)       # every score ~ -1e4
    @example(case=(1, 2, [2, 3], 2.0, 0.0, "none", -1e4, 5), dtype=torch.float64)
    def prop(case: tuple, dtype: torch.dtype) -> None:
        G, D, sizes, magnitude, masked, trend, shift, seed = case
        scores, values = _softmax_case(*case, dtype)
        tol = dict(rtol=1e-9, atol=1e-12) if dtype == torch.float64 else dict(rtol=2e-5, atol=1e-6)
        m, l, acc = torch.full((G,), float("-inf"), dtype=dtype), torch.zeros(G, dtype=dtype), \
            torch.zeros(G, D, dtype=dtype)
        start = 0
        for i, n in enumerate(sizes):
            state_in = (m, l, acc, scores[:, start:start + n], values[start:start + n])
            where = (f"after block {i} of sizes {sizes} (G={G}, D={D}, |scores| ~ {magnitude:g}"
                     f"{f' around {shift:g}' if shift else ''}, {str(dtype)[6:]})")
            got = _state(online_softmax_update(*(x.clone() for x in state_in)), dtype, G, D, where)
            start += n
            want = softmax_state_ref(scores[:, :start], values[:start])
            bad = [name for name, x, y in zip("m l acc".split(), got, want) if not torch.allclose(x.double(), y, **tol)]
            if not bad:
                m, l, acc = got
                continue
            why = diagnose(lambda *a: online_softmax_update(*(x.clone() for x in a)), _OS_MISTAKES,
                           [tuple(x.double() for x in state_in)] + _os_probes(), _same_state)
            if why is None and not all(torch.isfinite(x).all() for x in got[1:]):
                why = "your state holds inf/NaN: subtract the running max before exp()"
            fail(f"the running {'/'.join(bad)} {'is' if len(bad) == 1 else 'are'} wrong {where}: expected "
                 f"m = max of the scores so far, l = sum exp(score - m), acc = sum exp(score - m) * value"
                 + (f" — {why}" if why else ""))
        want_out = torch.softmax(scores.double(), -1) @ values.double()
        check(torch.allclose(acc.double() / l.double()[:, None], want_out, rtol=1e-5, atol=1e-6),
              "acc / l after the last block differs from softmax(scores) @ values")

    run_property(prop, max_examples=60, hint=Hint(
        "online softmax keeps a running max m, a running sum l and an accumulator acc: when a block raises the max, "
        "what happens to what l and acc already hold?",
        "they were computed against the old max: rescale them by exp(m_old − m_new) before adding the block's "
        "exp(score − m_new) terms (times the values, for acc); on the first block m = −inf, so that factor is 0, "
        "not NaN; keep the inputs' dtype.",
        "m_new = max(m, scores.max(-1)); alpha = exp(m - m_new); p = exp(scores - m_new[:, None]); l_new = l * "
        "alpha + p.sum(-1); acc_new = acc * alpha[:, None] + p @ values."))


# --------------------------------------------------------------------------- lab03_3: the Triton kernel

def launch_paged_attention(kernel: Any, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                           out: torch.Tensor | None = None) -> torch.Tensor:
    """Launch a paged decode kernel exactly like the notebook's `paged_attention_decode` wrapper does:
    grid (S, KVH), one program per (sequence, kv head), strides in elements, head dim contiguous."""
    out = torch.empty(q.shape, dtype=q.dtype) if out is None else out
    launch_decode(kernel, out, q, k_cache, v_cache, block_tables.to(torch.int32).contiguous(),
                  seq_lens.to(torch.int32).contiguous(), scale)
    return out


def dense_decode_ref(q: torch.Tensor, dense_k: list[torch.Tensor], dense_v: list[torch.Tensor],
                     scale: float) -> torch.Tensor:
    """Decode attention on the contiguous K/V, float64: out[s, h] = softmax(scale q[s,h]·K_s[:, h // G]) @ V_s."""
    S, H, D = q.shape
    out = torch.zeros(S, H, D, dtype=torch.float64)
    for s in range(S):
        k, v = dense_k[s].double(), dense_v[s].double()
        heads = torch.arange(H) // (H // k.shape[1])
        scores = torch.einsum("hd,nhd->hn", q[s].double(), k[:, heads]) * scale
        out[s] = torch.einsum("hn,nhd->hd", torch.softmax(scores, -1), v[:, heads])
    return out


def _kernel_variant(c: PagedCase, *, kv_map: str = "div", rescale: bool = True, tail: str = "mask", row: str = "stride",
                    scale_mul: float = 1.0, m_init: float = float("-inf")) -> torch.Tensor:
    """The kernel's algorithm in float64 with one knob turned to a known mistake (for diagnosis only)."""
    q, kc, vc, bt = c.q.double(), c.k_cache.double(), c.v_cache.double(), c.block_tables.long()
    S, H, D = q.shape
    _, bs, KVH, _ = kc.shape
    out = torch.zeros(S, H, D, dtype=torch.float64)
    for s, n in enumerate(c.seq_lens.tolist()):
        for h in range(H):
            kvh = h // (H // KVH) if kv_map == "div" else h % KVH
            m, l, acc = torch.tensor(m_init).double(), torch.tensor(0.0).double(), torch.zeros(D).double()
            for b in range(-(-n // bs)):
                phys = {"stride": bt[s, b], "flat": bt.flatten()[s + b], "row0": bt[0, b]}[row]
                valid = torch.arange(bs) < n - b * bs
                k = torch.where(valid[:, None], kc[phys, :, kvh], 0.0)
                v = torch.where(valid[:, None], vc[phys, :, kvh], 0.0)
                x = (k @ q[s, h]) * c.scale * scale_mul
                x = x.masked_fill(~valid, float("-inf")) if tail == "mask" else x
                m_new = torch.maximum(m, x.max())
                alpha, p = torch.exp(m - m_new), torch.exp(x - m_new)
                l, acc, m = l * alpha + p.sum(), (acc * alpha if rescale else acc) + p @ v, m_new
            out[s, h] = acc / l
    return out


_KERNEL_MISTAKES = [
    ("query head h reads kv head h // GROUP (this program's heads are kv_head * GROUP + 0..GROUP-1), "
     "not h % KVH", dict(kv_map="mod")),
    ("rescale the accumulator when the running max grows: acc = acc * alpha[:, None] + p @ V with "
     "alpha = exp(m_old - m_new)", dict(rescale=False)),
    ("positions past seq_len in the last block must get score -inf (a masked load with other=0 still gives "
     "score 0, which takes a share of the softmax)", dict(tail="zeros")),
    ("read the block ids from this sequence's row of the block table: block_tables_ptr + seq * stride_bt + b",
     dict(row="flat")),
    ("read the block ids from this sequence's row of the block table (row `seq`, not row 0)", dict(row="row0")),
    ("multiply q·k by `scale`", dict(scale_mul=None)),
    ("apply `scale` once (it looks applied twice)", dict(scale_mul="twice")),
    ("the running max must start at -inf (tl.full([GROUP_PAD], float(\"-inf\"), tl.float32)), not 0: when every "
     "score is very negative (about -1e4) a max that starts at 0 stays 0, exp(score - 0) underflows to 0 and "
     "the output is 0 / 0", dict(m_init=0.0)),
]


def _variant_output(c: PagedCase, kw: dict) -> torch.Tensor:
    if "scale_mul" in kw:
        kw = dict(kw, scale_mul=1.0 / c.scale if kw["scale_mul"] is None else c.scale)
    return _kernel_variant(c, **kw)


def _very_negative(c: PagedCase, level: float = 1e4) -> PagedCase:
    """Make every score scale·q·k of the case about -level, with a spread of a few units: keys get a large common
    component a·e (e = ones/√D), queries point the other way along e (and are orthogonal to it otherwise)."""
    D, dt = c.q.shape[-1], c.q.dtype
    e, a = torch.ones(D) / D ** 0.5, level / 2
    c.k_cache.add_((a * e).to(dt))                     # in place: the engine layout is a view; NaN slots stay NaN
    for k in c.dense_k:
        k.add_((a * e).to(dt))
    qr = c.q.float() - (c.q.float() @ e)[..., None] * e
    c.q = (0.5 * qr - (level / (a * c.scale)) * e).to(dt)
    return c


def _restride_v(c: PagedCase) -> PagedCase:
    """The same V values in a layout of their own: head-major blocks with padded rows ([num_blocks, KVH, block_size,
    D + 3] storage seen as [num_blocks, block_size, KVH, D], the padding NaN), so stride_vb, stride_vt and stride_vh
    all differ from K's. A kernel that loads V with K's strides reads the wrong (or poisoned) elements."""
    nb, bs, kvh, d = c.v_cache.shape
    buf = torch.full((nb, kvh, bs, d + 3), float("nan"), dtype=c.v_cache.dtype)
    view = buf.permute(0, 2, 1, 3)[..., :d]
    view.copy_(c.v_cache)
    c.v_cache = view
    return c


def _make_case(case: dict) -> PagedCase:
    H, KVH = case["heads"]
    c = make_paged_case(case["seq_lens"], H, KVH, case["head_dim"], case["block_size"], case["seed"],
                        layout=case["layout"], share_prefix=case["share_prefix"], magnitude=case["magnitude"],
                        dtype=case["dtype"])
    c = _restride_v(c) if case.get("v_own_strides") else c
    return _very_negative(c) if case["low"] else c


_NAN, _SENTINEL = float("nan"), -4096.0      # the sentinel is exact in every float dtype


def _guarded(t: torch.Tensor, fill: float):
    """A copy of t (same shape and strides) in the middle of a larger buffer filled with `fill`:
    (buffer, view, size of each guard zone, span of the view)."""
    span = 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
    guard = max(256, span)
    buf = torch.full((span + 2 * guard,), fill, dtype=t.dtype)
    view = buf.as_strided(t.shape, t.stride(), guard)
    view.copy_(t)
    return buf, view, guard, span


def _explain_kernel_error(exc: BaseException):
    """The interpreter wraps errors raised inside a kernel in InterpreterError: surface NotImplementedError,
    explain a NameError (the kernel runs from its source in a fresh process), re-raise the rest."""
    seen = exc
    while seen is not None:
        if isinstance(seen, NotImplementedError):
            raise NotImplementedError() from None
        if isinstance(seen, NameError):
            fail(f"your kernel raised NameError: {seen}. The checker runs your kernel from its source in a fresh "
                 "process, where a kernel sees only triton, tl, math, the @triton.jit helpers it calls and plain "
                 "constants (numbers or tl.constexpr) of the notebook: pass everything else as an argument.")
        seen = seen.__cause__ or seen.__context__
    raise exc


def _run_kernel(kernel: Any, c: PagedCase, progress: str | None = None) -> tuple[torch.Tensor, int, int]:
    """Launch the kernel on copies of the case's tensors that sit between guard zones (NaN around the inputs, a
    sentinel around out); returns (out as float64, elements written before out, elements written after out)."""
    if progress:
        with open(progress, "w") as f:
            f.write(_describe_case(c))
    q, k, v = (_guarded(t, _NAN)[1] for t in (c.q, c.k_cache, c.v_cache))
    buf, out, guard, span = _guarded(torch.full(c.q.shape, _NAN, dtype=c.q.dtype), _SENTINEL)  # unstored: NaN
    try:
        launch_paged_attention(kernel, q, k, v, c.block_tables.clone(), c.seq_lens.clone(), c.scale, out=out)
    except Exception as exc:  # noqa: BLE001 - the learner's kernel may raise anything
        _explain_kernel_error(exc)
    sentinel = torch.tensor(_SENTINEL, dtype=buf.dtype)
    return out.double(), int((buf[:guard] != sentinel).sum()), int((buf[guard + span:] != sentinel).sum())


_PROBES: list = []


def _diagnose_kernel(kernel: Any, c: PagedCase) -> str | None:
    """The known mistake the kernel agrees with on the failing case and on fixed probes (GQA with KVH > 1, ragged
    tails, several sequences, a moving max; their mistakes' outputs are computed once per process)."""
    if not _PROBES:
        for p in (make_paged_case([7, 10], 4, 2, 4, 4, seed=21, magnitude=1.5),
                  make_paged_case([6, 3, 9], 6, 2, 4, 4, seed=22, layout="blocks", magnitude=1.5)):
            _PROBES.append((p, [_variant_output(p, kw) for _, kw in _KERNEL_MISTAKES]))
    try:
        outs = [_run_kernel(kernel, x)[0] for x in [c] + [p for p, _ in _PROBES]]
    except Exception:  # noqa: BLE001
        return None
    for i, (why, kw) in enumerate(_KERNEL_MISTAKES):
        wants = [_variant_output(c, kw)] + [alts[i] for _, alts in _PROBES]
        if all(a.shape == b.shape and torch.allclose(a.nan_to_num(0.0), b.nan_to_num(0.0), rtol=1e-3, atol=1e-3)
               for a, b in zip(outs, wants)):
            return why
    return None


@st.composite
def _kernel_cases(draw: st.DrawFn) -> dict[str, Any]:
    block_size = draw(st.sampled_from([4, 8]))
    return dict(seq_lens=draw(st.lists(st.integers(1, 4 * block_size), min_size=1, max_size=3)),
                heads=draw(st.sampled_from([(1, 1), (2, 1), (3, 1), (4, 2), (6, 2), (2, 2)])),
                head_dim=draw(st.sampled_from([4, 8, 16])), block_size=block_size,
                layout=draw(st.sampled_from(["engine", "blocks"])), share_prefix=draw(st.booleans()),
                magnitude=draw(st.sampled_from([1.0, 1.0, 2.0, 20.0])),
                dtype=draw(st.sampled_from([torch.float32, torch.float32, torch.float16, torch.bfloat16])),
                low=draw(st.sampled_from([False, False, False, True])), seed=draw(st.integers(0, 2**16)),
                v_own_strides=draw(st.sampled_from([False, False, True])))


def _kcase(seq_lens: list[int], heads: tuple[int, int], head_dim: int, block_size: int, layout: str,
           share_prefix: bool = False, magnitude: float = 1.0, dtype: torch.dtype = torch.float32, low: bool = False,
           seed: int = 0, v_own_strides: bool = False) -> dict[str, Any]:
    return dict(seq_lens=seq_lens, heads=heads, head_dim=head_dim, block_size=block_size, layout=layout,
                share_prefix=share_prefix, magnitude=magnitude, dtype=dtype, low=low, seed=seed,
                v_own_strides=v_own_strides)


_STORE_MASK = ("mask the store with the program's real heads and lanes: mask=(offs_g < GROUP)[:, None] & "
               "(offs_d < HEAD_DIM)[None, :]")
_KERNEL_HINT_SHOW = ("program (seq, kv_head) handles query heads kv_head*GROUP + [0, GROUP); loop b over "
                     "cdiv(seq_len, BLOCK_SIZE) blocks, phys = load(block_tables_ptr + seq*stride_bt + b), load a "
                     "[BLOCK_SIZE, D_PAD] K/V tile at phys*stride_kb + t*stride_kt + kv_head*stride_kh + d with mask "
                     "t < seq_len - b*BLOCK_SIZE; scores -inf on masked t; online softmax in fp32 (m = -inf, l, acc "
                     "with alpha = exp(m - m_new)); store acc / l in out's dtype, masked.")
_KERNEL_HINT = Hint(
    "each program handles one (sequence, kv head): walk the sequence's blocks through its row of the block table "
    "and fold every block into an online softmax, as in task 2.",
    "per block: load its physical id, then [BLOCK_SIZE, D_PAD] tiles of K and V masked to the valid tokens and the "
    "real lanes; masked tokens get score -inf; the running max starts at -inf, in fp32; the program's query heads "
    "are kv_head * GROUP + [0, GROUP); store acc / l in out's dtype, masked.",
    _KERNEL_HINT_SHOW)


def _kernel_property(kernel: Any, progress: str | None = None) -> Callable[..., None]:
    """The property behind lab03_3, run in the child process (usable on any interpreted Triton kernel)."""
    @given(case=_kernel_cases())
    @example(case=_kcase([1], (1, 1), 4, 4, "blocks"))                       # the smallest case there is
    # several blocks per sequence, ragged tails, 3 sequences, GQA 6/2 (group 3, padded to 4), the engine layout
    @example(case=_kcase([7, 16, 2], (6, 2), 8, 4, "engine", magnitude=1.5, seed=1))
    # SmolLM2-like group of 3 query heads per kv head, a shared prefix block, a non-power-of-two head dim
    @example(case=_kcase([8, 13], (3, 1), 12, 8, "blocks", share_prefix=True, seed=2))
    @example(case=_kcase([9, 4], (3, 1), 8, 4, "engine", low=True, seed=4))         # every score about -1e4
    @example(case=_kcase([11, 5], (4, 2), 8, 4, "engine", magnitude=20.0, seed=3))  # large scores stay finite
    @example(case=_kcase([6, 10], (6, 2), 8, 4, "engine", dtype=torch.float16, seed=5))  # out in q's dtype
    @example(case=_kcase([5, 12], (2, 1), 4, 8, "blocks", dtype=torch.bfloat16, seed=6))
    @example(case=_kcase([6, 9], (4, 2), 8, 4, "engine", seed=7, v_own_strides=True))  # V laid out unlike K
    def prop(case: dict[str, Any]) -> None:
        c = _make_case(case)
        S, H, D = c.q.shape
        inputs = (c.q.clone(), [k.clone() for k in c.dense_k], [v.clone() for v in c.dense_v])
        got, before, after = _run_kernel(kernel, c, progress)
        want = dense_decode_ref(*inputs, c.scale)
        where = f"{_describe_case(c)}, H={H}, KVH={c.k_cache.shape[2]}, D={D}"
        if case.get("v_own_strides"):
            where += (f", V cache strides {tuple(c.v_cache.stride()[:3])} unlike K's "
                      f"{tuple(c.k_cache.stride()[:3])}")
        check(before + after == 0,
              f"your kernel wrote {before + after} elements outside out ({before} before its start, {after} past its "
              f"end) on {where}: {_STORE_MASK}, at the addresses of this program's heads kv_head * GROUP + offs_g "
              "(strides stride_os, stride_oh)")
        tol = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 3e-2}[c.q.dtype]
        tol = max(tol, 1e-2) if case["low"] else tol      # fp32 rounds scores of about -1e4 by ~1e-3
        if torch.allclose(got, want, rtol=tol, atol=tol):
            return
        err = (got - want).abs().nan_to_num(float("inf"))
        s, h = divmod(int(err.flatten(0, 1).amax(-1).argmax()), H)
        why = _diagnose_kernel(kernel, c)
        if why is None and case.get("v_own_strides"):
            try:
                same = _make_case(dict(case, v_own_strides=False))
                right = torch.allclose(_run_kernel(kernel, same)[0], want, rtol=tol, atol=tol)
            except Exception:  # noqa: BLE001
                right = False
            if right:
                why = ("V has strides of its own (stride_vb, stride_vt, stride_vh): here the V cache is laid out "
                       "unlike K, and your kernel is right when they match — load V with V's strides")
        if why is None and torch.isnan(got).any():
            why = ("your output holds NaN: either a (sequence, head) row was never stored (store all GROUP heads of "
                   "the program, mask only the GROUP_PAD padding rows) or the kernel read a slot it must not: every "
                   "slot past seq_len in the last block, and every block not in the sequence's table, holds NaN — "
                   "mask the K/V loads with `offs_t < seq_len - b * BLOCK_SIZE` (and other=0.0)")
        error = "it holds NaN" if got[s, h].isnan().any() else f"max abs error {err.max().item():.3g}"
        fail(f"{where}{', every score about -1e4' if case['low'] else ''}: out[{s}, {h}] is wrong ({error})"
             + (f" — {why}" if why else ""))

    return prop


_BIG_POOL = "a big pool of 2**25 + 8 blocks (block_size 4, K and V interleaved, float16, block ids above 33 million)"
_INT64_WHY = ("the offset phys * stride_kb of a block in a big pool is past 2**31 elements (4 GiB of float16: a real "
              "GPU's pool is bigger) and overflows int32 — compute block offsets in int64: "
              "phys = tl.load(block_tables_ptr + ...).to(tl.int64)")


_INT64_HINT = Hint("block offsets must not overflow: which product in your K/V addresses can exceed 2**31 elements "
                   "in a big pool?",
                   "the block id loaded from the table is int32, and so is the product with the block stride — widen "
                   "the id before multiplying.",
                   "phys = tl.load(block_tables_ptr + seq * stride_bt + b).to(tl.int64)")


def _big_pool_check(kernel: Any, progress: str | None = None) -> None:
    """A decode on a pool whose used blocks lie past 2**31 elements. The buffer is 4 GiB of address space but only
    the pages of the blocks written are ever touched (torch.empty does not, nor does the interpreter): cheap. Where
    the operating system refuses that much address space the check is skipped (a limit of the machine, not a fault
    of the kernel)."""
    __tracebackhide__ = True
    bs, kvh, heads, d, extra = 4, 1, 2, 8, 8
    nb = 2**25 + extra
    try:
        buf = torch.empty((nb, 2, bs, kvh, d), dtype=torch.float16)
    except (RuntimeError, MemoryError):
        return
    if progress:
        with open(progress, "w") as f:
            f.write(_BIG_POOL)
    kc, vc = buf[:, 0], buf[:, 1]                       # stride_kb = stride_vb = 64: block 2**25 is at 2**31
    g = torch.Generator().manual_seed(31)
    seq_lens = torch.tensor([7, 5, 3], dtype=torch.int32)
    tables = torch.tensor([[nb - 1, nb - 4], [nb - 2, 3], [nb - 7, 0]], dtype=torch.int32)
    dense_k, dense_v = [], []
    for s_, n in enumerate(seq_lens.tolist()):
        k = torch.randn(n, kvh, d, generator=g).half()
        v = torch.randn(n, kvh, d, generator=g).half()
        for p in range(n):
            kc[int(tables[s_, p // bs]), p % bs] = k[p]
            vc[int(tables[s_, p // bs]), p % bs] = v[p]
        dense_k.append(k)
        dense_v.append(v)
    q = torch.randn(3, heads, d, generator=g).half()
    out = torch.full(q.shape, float("nan"), dtype=torch.float16)
    try:
        launch_paged_attention(kernel, q, kc, vc, tables.clone(), seq_lens.clone(), 0.35, out=out)
    except Exception as exc:  # noqa: BLE001
        _explain_kernel_error(exc)
    want = dense_decode_ref(q, dense_k, dense_v, 0.35)
    if not torch.allclose(out.double(), want, rtol=5e-3, atol=5e-3):
        err = (out.double() - want).abs().nan_to_num(float("inf"))
        fail(f"on {_BIG_POOL} (seq_lens=[7, 5, 3], block_tables={tables.tolist()}, H=2, KVH=1, D=8): the output is "
             f"wrong ({'it holds NaN' if out.isnan().any() else f'max abs error {err.max().item():.3g}'}) — "
             + _INT64_WHY, _INT64_HINT)


def _kernel_form(kernel: Any) -> Any:
    __tracebackhide__ = True
    if hasattr(kernel, "kernel_source"):           # trusted grading's stand-in for a kernel: it carries the source
        return kernel
    import triton
    from triton.runtime.interpreter import InterpretedFunction
    if isinstance(kernel, triton.runtime.jit.JITFunction):
        fail("your kernel was compiled for a GPU (TRITON_INTERPRET was not set when @triton.jit ran), and there "
             "is no GPU here.",
             "run the notebook's first cell (it sets TRITON_INTERPRET=1) before the kernel's cell; restart the "
             "kernel if TRITON_INTERPRET was set too late.")
    if not isinstance(kernel, InterpretedFunction):
        fail(f"pass the @triton.jit kernel itself (got {type(kernel).__name__}): the checker launches it on grid "
             "(S, KVH) with the arguments of the signature in the statement.",
             "check_lab03_3(paged_attention_kernel), where paged_attention_kernel is decorated with @triton.jit.")
    return kernel


# The child process: this module imported afresh under TRITON_INTERPRET=1, the kernel loaded from its source.
_CHILD = "import sys\nfrom minillm.grading.lab03 import run_kernel_check\nsys.exit(run_kernel_check(*sys.argv[1:]))\n"
_CHILD_TIMEOUT = 300


def run_kernel_check(src_path: str, name: str, result_path: str, progress_path: str) -> int:
    """The child's side of lab03_3: load the shipped kernel, refuse helpers copied from minillm, run the property
    under a Watch of minillm's kernel, and write the verdict (null when the kernel passes) as JSON."""
    import importlib.util
    import triton
    from triton.runtime.interpreter import InterpretedFunction
    verdict = None
    try:
        spec = importlib.util.spec_from_file_location("_lab03_learner_kernel", src_path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        kernel = triton.jit(getattr(module, name))
        task = TASKS["lab03_3"]
        engine, oracles = task.engine_objects(), [dense_decode_ref, _kernel_variant]
        for helper in vars(module).values():          # the kernel itself was checked before it was shipped
            if isinstance(helper, InterpretedFunction) and helper.fn is not kernel.fn:
                reject_delegation(helper, engine, oracles)
        # what the interpreter executes for minillm's kernel is a rewritten copy of its function: watch both
        codes = [o.rewrite().__code__ for o in engine if isinstance(o, InterpretedFunction)]
        watch = Watch(codes + [getattr(o, "fn", o).__code__ for o in engine], [o.__code__ for o in oracles])
        with watch:
            try:
                run_property(_kernel_property(kernel, progress_path), max_examples=10, hint=_KERNEL_HINT,
                             example=False)       # the message describes the case (the kernel's args are pointers)
                _big_pool_check(kernel, progress_path)
            except GradingError as e:
                verdict = _verdict_json(e)
            except BaseException:             # the Watch stops the check at the first call of minillm's code
                if watch.seen is None:
                    raise
        if watch.seen is not None:
            whose = "minillm's own implementation" if watch.seen_engine else "the grader's reference answer"
            verdict = {"message": f"your {task.what} runs {whose} ({watch.seen.co_name} in "
                                  f"{os.path.basename(watch.seen.co_filename)}) instead of your code.",
                       "hint": "write the kernel in the answer cell with your own code, instead of calling or "
                               "copying minillm's."}
    except GradingError as e:
        verdict = _verdict_json(e)
    compile_error = None
    if verdict is None:          # right in the interpreter: does it also compile for a real GPU?
        try:
            compile_for_gpu_target(80, "fp16", head_dim=64, block_size=16, group=3, kernel=kernel)
        except KernelCompileError as e:
            compile_error = e.summary
        except Exception as e:  # noqa: BLE001
            compile_error = f"{type(e).__name__}: {e}"
    with open(result_path, "w") as f:
        json.dump({"verdict": verdict, "compile_error": compile_error}, f)
    return 0


def _verdict_json(e: GradingError) -> dict:
    """A verdict's parts, to send from the child process (its hint's stages too: the parent knows the stage)."""
    hint = e.hint
    return {"message": e.message, "example": e.example,
            "hint": [hint.nudge, hint.more, hint.show] if isinstance(hint, Hint) else hint}


def _verdict_from_json(v: dict) -> GradingError:
    hint = v.get("hint")
    return GradingError(v["message"], v.get("example"), Hint(*hint) if isinstance(hint, list) else hint)


def _child_verdict(proc: subprocess.Popen, tmp: str) -> GradingError | None:
    result_path, progress_path = os.path.join(tmp, "result.json"), os.path.join(tmp, "case")
    try:
        proc.wait(timeout=_CHILD_TIMEOUT)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        return GradingError(f"timed out after {_CHILD_TIMEOUT} s: your kernel did not finish in the interpreter on "
                            "tiny caches — an endless loop?", None,
                            "does its loop stop after cdiv(seq_len, BLOCK_SIZE) blocks?")
    if os.path.exists(result_path):
        with open(result_path) as f:
            result = json.load(f)
        if result["verdict"] is not None:
            return _verdict_from_json(result["verdict"])
        if result.get("compile_error"):
            return GradingError(
                "your kernel is right in the interpreter but does not compile for a real GPU (sm80, fp16, head_dim "
                f"64, block_size 16, group 3): {result['compile_error']}", None,
                "the interpreter runs your kernel as plain Python and accepts things compiled Triton does not: "
                "int()/float()/.item() on tensor values, numpy/torch/math calls on tensors, shapes in tl.arange/"
                "tl.full that are not tl.constexpr, global constants not wrapped in tl.constexpr(...). Keep to tl.* "
                "operations.")
        return None
    case = ""
    if os.path.exists(progress_path):
        with open(progress_path) as f:
            case = f" on {f.read()}"
    if proc.returncode < 0:
        try:
            name = signal.Signals(-proc.returncode).name
        except ValueError:
            name = "unknown signal"
        if _BIG_POOL in case:
            return GradingError(f"your kernel crashed the Triton interpreter (signal {-proc.returncode}, {name}) "
                                f"on {_BIG_POOL}: {_INT64_WHY}", None, _INT64_HINT)
        return GradingError(
            f"your kernel crashed the Triton interpreter (signal {-proc.returncode}, {name}){case}: it reads or "
            "writes memory outside the tensors — mask every load and store.", None,
            Hint("which loads and stores can reach past the data? The last block of a sequence is only partly "
                 "filled, the head dimension may be padded to a power of two, and the block table has padding.",
                 "mask the K/V loads by the valid tokens of the block and the real lanes of the head; mask the "
                 "store by the program's real heads and lanes; read only the block ids the sequence uses.",
                 f"K/V loads with the token mask offs_t < seq_len - b * BLOCK_SIZE (and the lane mask); "
                 f"{_STORE_MASK}; read block ids only from the first cdiv(seq_len, BLOCK_SIZE) entries of this "
                 "sequence's row."))
    with open(os.path.join(tmp, "stderr"), errors="replace") as f:
        lines = [ln for ln in f.read().splitlines() if ln.strip()]
    return GradingError(f"the kernel check could not run (its process exited with {proc.returncode}): "
                        + (lines[-1] if lines else "no message"))


def _untouched(src: str, name: str) -> bool:
    """The starter's body: nothing but `raise NotImplementedError(...)` (after a docstring)."""
    import ast
    try:
        tree = ast.parse(src)
    except SyntaxError:
        return False
    fn = next((n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name), None)
    if fn is None:
        return False
    body = fn.body[1:] if fn.body and isinstance(fn.body[0], ast.Expr) and \
        isinstance(fn.body[0].value, ast.Constant) and isinstance(fn.body[0].value.value, str) else fn.body
    if len(body) != 1 or not isinstance(body[0], ast.Raise) or body[0].exc is None:
        return False
    exc = body[0].exc.func if isinstance(body[0].exc, ast.Call) else body[0].exc
    return isinstance(exc, ast.Name) and exc.id == "NotImplementedError"


def verify_lab03_3(kernel: Any) -> None:
    """The kernel's property in the interpreter and its AOT compile for sm80 with the engine's compile_for_gpu_target,
    both in a child process that runs the kernel from its source text; the property's verdict comes first. (Under
    trusted grading the kernel is a stand-in that carries its source: the same child checks it.)"""
    __tracebackhide__ = True
    try:
        src = kernel.kernel_source() if hasattr(kernel, "kernel_source") else kernel_source(kernel.fn)
        name = kernel.__name__ if hasattr(kernel, "kernel_source") else kernel.fn.__name__
        if src is None:
            raise OSError("no source")
    except Exception as e:  # noqa: BLE001
        fail(f"the checker could not read your kernel's source ({type(e).__name__}: {e}); it runs the kernel from "
             "its source in a separate process.",
             "define the kernel with @triton.jit in a notebook cell (or a .py file), not through exec().")
    if _untouched(src, name):      # the child would only say so, ~3 s later
        raise GradingError(NOT_IMPLEMENTED)
    with tempfile.TemporaryDirectory(prefix="minillm-lab03-") as tmp:
        src_path, result_path, progress_path = (os.path.join(tmp, f) for f in ("kernel.py", "result.json", "case"))
        with open(src_path, "w") as f:
            f.write(src)
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env = config.child_env(TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join([root] + config.python_path()))
        with open(os.path.join(tmp, "stderr"), "w") as err:     # a file: a chatty child never blocks on a pipe
            proc = subprocess.Popen([sys.executable, "-c", _CHILD, src_path, name, result_path,
                                     progress_path], env=env, cwd=tmp, stdin=subprocess.DEVNULL,
                                    stdout=subprocess.DEVNULL, stderr=err)
        try:
            verdict = _child_verdict(proc, tmp)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    if verdict is not None:
        raise verdict


# --------------------------------------------------------------------------- the tasks

TASKS = {t.id: t for t in (
    Task("lab03_1", what="gather_kv", verify=verify_lab03_1,
         engine=minillm_objects("minillm.kernels.paged_attention_ref:gather_kv"), oracles=lambda: [_gather_wrong]),
    Task("lab03_2", what="online_softmax_update", verify=verify_lab03_2, engine=list,
         oracles=lambda: [softmax_state_ref, _os_variant]),
    Task("lab03_3", what="paged_attention_kernel", verify=verify_lab03_3,
         engine=minillm_objects("minillm.kernels.triton_paged_attention:paged_attention_decode_kernel",
                                "minillm.kernels.triton_paged_attention:paged_attention_decode_triton"),
         oracles=lambda: [dense_decode_ref, _kernel_variant], form=_kernel_form,
         time_limit=_CHILD_TIMEOUT + 120),       # the child's own limit speaks first
)}

check_lab03_1 = TASKS["lab03_1"].checker(
    'gather_kv(cache [num_blocks, block_size, KVH, D], block_table, seq_len) -> [seq_len, KVH, D].')
check_lab03_2 = TASKS["lab03_2"].checker(
    'online_softmax_update(m [G], l [G], acc [G, D], scores [G, T], values [T, D]) -> (m, l, acc).')
check_lab03_3 = TASKS["lab03_3"].checker(
    "A @triton.jit PagedAttention decode kernel with the statement's signature (grid (S, KVH)).")
