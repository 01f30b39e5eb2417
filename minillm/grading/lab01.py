"""Checkers for lab01 — the KV cache.

Tasks (the notebook documents the same signatures):
  lab01_1  attend(q, k, v, scale) -> out: attention of the last n positions over L cached keys,
           q [n, H, D], k/v [L, KVH, D] -> [n, H, D]; causal; GQA: query head h reads kv head h // (H // KVH)
           (MHA when KVH == H, MQA when KVH == 1). Same contract as minillm.layers.attention.causal_attend.
  lab01_2  kv_cache_bytes(cfg, batch_size, seq_len, dtype_bytes) -> int
  lab01_3  max_num_seqs(cfg, memory_bytes, weight_bytes, seq_len, dtype_bytes) -> int

lab01_1 is checked against a dense float64 reference written here (it does not call minillm's attention,
so the checker is independent of the code it also grades in tests/).
"""
from __future__ import annotations

import math
from types import SimpleNamespace

import torch
from hypothesis import example, given, strategies as st

from minillm.grading.core import diagnose, reject_reference, run_property

__all__ = ["check_lab01_1", "check_lab01_2", "check_lab01_3"]

SMOLLM2 = dict(hidden_size=576, num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64)


# --------------------------------------------------------------------------- reference attention (float64)

def reference_attend(q, k, v, scale, *, kv_head_of=None, query_offset=None, strict=False):
    """Dense causal attention in float64. Query i of n sits at absolute position L - n + i and sees keys
    0 .. L - n + i. The keyword arguments build the classic mistakes for diagnosis."""
    n, H, D = q.shape
    L, KVH, _ = k.shape
    group = H // KVH
    heads = torch.tensor([kv_head_of(h, H, KVH) if kv_head_of else h // group for h in range(H)])
    kh, vh = k.double()[:, heads], v.double()[:, heads]                     # [L, H, D]
    s = torch.einsum("nhd,lhd->hnl", q.double(), kh) * scale               # [H, n, L]
    offset = L - n if query_offset is None else query_offset
    qpos = offset + torch.arange(n)[:, None]
    kpos = torch.arange(L)[None, :]
    allowed = kpos < qpos if strict else kpos <= qpos
    s = s.masked_fill(~allowed, float("-inf"))
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)  # a fully masked row (only in broken variants) -> zeros
    return torch.einsum("hnl,lhd->nhd", p, vh)


def _make_inputs(n, L, kv_heads, group, head_dim, seed, magnitude):
    g = torch.Generator().manual_seed(seed)
    H = kv_heads * group
    q = torch.randn(n, H, head_dim, generator=g) * magnitude
    k = torch.randn(L, kv_heads, head_dim, generator=g) * magnitude
    v = torch.randn(L, kv_heads, head_dim, generator=g)
    return q, k, v


_ATTN_MISTAKES = [
    ("the causal mask is aligned to the start of the sequence: with a cache the n queries are the LAST n of L "
     "positions, so query i sits at position L - n + i and sees keys 0..L-n+i", dict(query_offset=0)),
    ("each query must also see its own key (mask j <= position, not j < position)", dict(strict=True)),
    ("no causal mask: a query may not look at later positions", dict(query_offset=10**6)),
    ("head h must read kv head h // (H // KVH) (consecutive query heads share a kv head), not h % KVH",
     dict(kv_head_of=lambda h, H, KVH: h % KVH)),
    ("use the `scale` argument; don't hard-code 1/sqrt(head_dim)", dict(scale=lambda D: D ** -0.5)),
    ("multiply the scores q·k by `scale` before the softmax", dict(scale=lambda D: 1.0)),
]
# fixed probes on which the mistakes above all differ: a GQA suffix chunk, a full MQA prefill, a decode step
_ATTN_PROBE_SHAPES = [(3, 7, 2, 3, 4, 11), (5, 5, 1, 4, 8, 12), (1, 6, 3, 2, 4, 13)]


def _variant(kw):
    def wrong(q, k, v, scale):
        opts = dict(kw)
        if "scale" in opts:
            scale = opts.pop("scale")(q.shape[-1])
        return reference_attend(q, k, v, scale, **opts)
    return wrong


def _diagnose_attend(attend, q, k, v, scale, tol):
    def same(out, alt):
        return (isinstance(out, torch.Tensor) and out.shape == alt.shape
                and torch.allclose(out.double(), alt.double(), atol=tol, rtol=tol))
    probes = [(q, k, v, scale)] + [(*_make_inputs(n, L, kvh, g, d, seed, 1.0), 0.7)
                                   for n, L, kvh, g, d, seed in _ATTN_PROBE_SHAPES]
    return diagnose(attend, [(why, _variant(kw)) for why, kw in _ATTN_MISTAKES], probes, same)


# --------------------------------------------------------------------------- lab01_1

def check_lab01_1(attend):
    """attend(q [n,H,D], k [L,KVH,D], v [L,KVH,D], scale) -> [n,H,D], causal over the last n positions, GQA."""
    __tracebackhide__ = True
    from minillm.layers.attention import causal_attend  # only to recognise it, never called here
    reject_reference(attend, causal_attend)

    @given(L=st.integers(1, 24), n_frac=st.floats(0.0, 1.0), kv_heads=st.integers(1, 4), group=st.integers(1, 4),
           head_dim=st.sampled_from([1, 2, 4, 8, 16]), scale=st.floats(0.05, 2.0),
           magnitude=st.sampled_from([1.0, 0.1, 30.0]), seed=st.integers(0, 2**16))
    @example(L=1, n_frac=1.0, kv_heads=1, group=1, head_dim=4, scale=0.5, magnitude=1.0, seed=0)      # one token
    @example(L=6, n_frac=0.0, kv_heads=2, group=2, head_dim=4, scale=0.5, magnitude=1.0, seed=1)      # decode
    @example(L=5, n_frac=1.0, kv_heads=1, group=3, head_dim=4, scale=0.5, magnitude=1.0, seed=2)      # MQA prefill
    @example(L=7, n_frac=0.5, kv_heads=2, group=3, head_dim=8, scale=0.35, magnitude=1.0, seed=3)     # suffix, GQA
    @example(L=4, n_frac=1.0, kv_heads=2, group=1, head_dim=8, scale=1.0, magnitude=30.0, seed=4)     # huge logits
    def prop(L, n_frac, kv_heads, group, head_dim, scale, magnitude, seed):
        n = max(1, round(n_frac * L))
        q, k, v = _make_inputs(n, L, kv_heads, group, head_dim, seed, magnitude)
        q0, k0, v0 = q.clone(), k.clone(), v.clone()
        shapes = f"q {tuple(q.shape)}, k/v {tuple(k.shape)}"
        out = attend(q, k, v, scale)
        if not isinstance(out, torch.Tensor):
            assert False, f"attend must return a torch.Tensor, got {type(out).__name__} ({shapes})"
        if not (torch.equal(q, q0) and torch.equal(k, k0) and torch.equal(v, v0)):
            assert False, (f"attend modified its inputs in place ({shapes}): in the engine k and v are the "
                           "KV cache itself — never write to them")
        if tuple(out.shape) != (n, kv_heads * group, head_dim):
            assert False, f"output shape {tuple(out.shape)}, expected {(n, kv_heads * group, head_dim)} ({shapes})"
        if out.dtype != q.dtype:
            assert False, f"output dtype {out.dtype}, expected {q.dtype} (same as q)"
        if not torch.isfinite(out).all():
            why = ("" if magnitude < 10 else " — the scores here are in the hundreds: exp() overflows float32 "
                   "unless you subtract each row's maximum score before exponentiating")
            assert False, f"output has inf/nan for {shapes}, scale={scale:g}{why}"
        ref = reference_attend(q, k, v, scale)
        tol = 1e-3 if magnitude > 10 else 1e-4
        err = (out.double() - ref).abs()
        if not torch.allclose(out.double(), ref, atol=tol, rtol=tol):
            i, h, _ = divmod_index(int(err.argmax()), out.shape)
            why = _diagnose_attend(attend, q, k, v, scale, tol)
            if why is None and magnitude > 10:
                why = ("the scores here are in the hundreds: exp() of them overflows float32 unless you subtract "
                       "each row's maximum score first")
            assert False, (f"wrong output for {shapes}, scale={scale:g}: max error {float(err.max()):.3g} at "
                           f"query {i} (position {L - n + i} of {L}), head {h}" + (f" — {why}" if why else ""))

    run_property(prop, max_examples=80,
                 hint="scores = scale · q·k for head h against kv head h // (H // KVH); mask keys after "
                      "position L - n + i for query i; softmax over keys (subtract the row max first); "
                      "weighted sum of v.")


def divmod_index(flat, shape):
    n, H, D = shape
    i, rest = divmod(flat, H * D)
    h, d = divmod(rest, D)
    return i, h, d


# --------------------------------------------------------------------------- lab01_2 and lab01_3

def kv_cache_bytes_ref(cfg, batch_size, seq_len, dtype_bytes):
    """K and V (2), for every layer, every kv head, every dimension, every token of every sequence."""
    return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * batch_size * seq_len * dtype_bytes


def max_num_seqs_ref(cfg, memory_bytes, weight_bytes, seq_len, dtype_bytes):
    """How many sequences of seq_len tokens fit in what the weights leave free (never negative)."""
    free = memory_bytes - weight_bytes
    per_seq = kv_cache_bytes_ref(cfg, 1, seq_len, dtype_bytes)
    return max(0, int(free // per_seq))


@st.composite
def _kv_configs(draw):
    kv_heads = draw(st.integers(1, 16))
    group = draw(st.integers(1, 8))
    head_dim = draw(st.sampled_from([32, 64, 80, 128, 256]))
    heads = kv_heads * group
    return SimpleNamespace(hidden_size=heads * head_dim, num_layers=draw(st.integers(1, 128)),
                           num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim)


_KV_MISTAKES = [
    ("K and V are both cached: multiply by 2",
     lambda c, b, s, d: c.num_layers * c.num_kv_heads * c.head_dim * b * s * d),
    ("every layer has its own K and V: multiply by num_layers",
     lambda c, b, s, d: 2 * c.num_kv_heads * c.head_dim * b * s * d),
    ("only the kv heads are cached (GQA/MQA): use num_kv_heads, not num_heads",
     lambda c, b, s, d: 2 * c.num_layers * c.num_heads * c.head_dim * b * s * d),
    ("hidden_size is the width of Q, not of K/V: use num_kv_heads · head_dim",
     lambda c, b, s, d: 2 * c.num_layers * c.hidden_size * b * s * d),
    ("count bytes, not elements: multiply by dtype_bytes",
     lambda c, b, s, d: 2 * c.num_layers * c.num_kv_heads * c.head_dim * b * s),
    ("every sequence of the batch has its own cache: multiply by batch_size",
     lambda c, b, s, d: 2 * c.num_layers * c.num_kv_heads * c.head_dim * s * d),
]
_KV_PROBES = [(SimpleNamespace(hidden_size=2048, num_layers=5, num_heads=8, num_kv_heads=2, head_dim=128), 3, 100, 4),
              (SimpleNamespace(hidden_size=576, num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64), 2, 7, 1)]


def _same_number(a, b):
    return _is_number(a) and float(a) == float(b)


def _is_number(x):
    return not isinstance(x, bool) and (isinstance(x, (int, float)) or hasattr(x, "__float__"))


def check_lab01_2(kv_cache_bytes):
    """kv_cache_bytes(cfg, batch_size, seq_len, dtype_bytes) -> bytes of the KV cache."""
    __tracebackhide__ = True
    from minillm.config import ModelConfig
    reject_reference(kv_cache_bytes, kv_cache_bytes_ref, ModelConfig.kv_bytes_per_token)

    @given(cfg=_kv_configs(), batch_size=st.integers(1, 256), seq_len=st.integers(1, 131072),
           dtype_bytes=st.sampled_from([2, 1, 4]))
    @example(cfg=SimpleNamespace(**SMOLLM2), batch_size=1, seq_len=8192, dtype_bytes=2)
    def prop(cfg, batch_size, seq_len, dtype_bytes):
        got = kv_cache_bytes(cfg, batch_size, seq_len, dtype_bytes)
        if not _is_number(got):
            assert False, f"kv_cache_bytes must return a number of bytes, got {got!r}"
        ref = kv_cache_bytes_ref(cfg, batch_size, seq_len, dtype_bytes)
        if float(got) == ref:
            return
        why = diagnose(kv_cache_bytes, _KV_MISTAKES, [(cfg, batch_size, seq_len, dtype_bytes)] + _KV_PROBES,
                       _same_number)
        assert False, (f"kv_cache_bytes = {float(got):.0f}, expected {ref} for num_layers={cfg.num_layers}, "
                       f"num_heads={cfg.num_heads}, num_kv_heads={cfg.num_kv_heads}, head_dim={cfg.head_dim}"
                       + (f" — {why}" if why else ""))

    run_property(prop, max_examples=60,
                 hint="bytes = 2 (K and V) · num_layers · num_kv_heads · head_dim · batch_size · seq_len · "
                      "dtype_bytes.")


def _per_seq(c, s, d):
    return kv_cache_bytes_ref(c, 1, s, d)


_SEQS_MISTAKES = [
    ("when the weights alone don't fit, no sequence fits: return 0, not a negative number",
     lambda c, m, w, s, d: int((m - w) / _per_seq(c, s, d))),
    ("when the weights alone don't fit, no sequence fits: return 0, not a negative number",
     lambda c, m, w, s, d: (m - w) // _per_seq(c, s, d)),
    ("round down: a sequence whose KV cache only partly fits does not fit",
     lambda c, m, w, s, d: max(0, math.ceil((m - w) / _per_seq(c, s, d)))),
    ("round down: a sequence whose KV cache only partly fits does not fit",
     lambda c, m, w, s, d: max(0, round((m - w) / _per_seq(c, s, d)))),
    ("the weights take their share first: divide only what is left after weight_bytes",
     lambda c, m, w, s, d: m // _per_seq(c, s, d)),
] + [("the per-sequence KV size is off: " + why,
      (lambda wrong: lambda c, m, w, s, d: max(0, int((m - w) // wrong(c, 1, s, d))))(wrong))
     for why, wrong in _KV_MISTAKES if "batch_size" not in why]
_SEQS_PROBES = [(SimpleNamespace(hidden_size=4096, num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128),
                 24 * 2**30, 15 * 2**30, 8192, 2),
                (SimpleNamespace(hidden_size=1024, num_layers=6, num_heads=8, num_kv_heads=2, head_dim=128),
                 10**9 + 12345, 3 * 10**8, 1000, 4),
                (SimpleNamespace(hidden_size=1024, num_layers=6, num_heads=8, num_kv_heads=2, head_dim=128),
                 10**9, 2 * 10**9, 1000, 4)]


def check_lab01_3(max_num_seqs):
    """max_num_seqs(cfg, memory_bytes, weight_bytes, seq_len, dtype_bytes) -> how many full-length sequences fit."""
    __tracebackhide__ = True
    reject_reference(max_num_seqs, max_num_seqs_ref)

    @given(cfg=_kv_configs(), memory_gib=st.integers(1, 320), weight_frac=st.floats(0.0, 1.3),
           seq_len=st.integers(1, 131072), dtype_bytes=st.sampled_from([2, 1, 4]))
    @example(cfg=SimpleNamespace(**SMOLLM2), memory_gib=1, weight_frac=0.5, seq_len=8192, dtype_bytes=2)
    @example(cfg=SimpleNamespace(hidden_size=8192, num_layers=80, num_heads=64, num_kv_heads=8, head_dim=128),
             memory_gib=80, weight_frac=1.75, seq_len=4096, dtype_bytes=2)              # 70B fp16 on one 80 GB GPU
    @example(cfg=SimpleNamespace(hidden_size=4096, num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128),
             memory_gib=24, weight_frac=0.625, seq_len=8192, dtype_bytes=2)             # 8B fp16 on 24 GB
    def prop(cfg, memory_gib, weight_frac, seq_len, dtype_bytes):
        memory = memory_gib * 2**30
        weights = int(weight_frac * memory)
        got = max_num_seqs(cfg, memory, weights, seq_len, dtype_bytes)
        if not _is_number(got) or float(got) != int(float(got)):
            assert False, f"max_num_seqs must return a whole number of sequences, got {got!r}"
        ref = max_num_seqs_ref(cfg, memory, weights, seq_len, dtype_bytes)
        if int(got) == ref:
            return
        free, per = memory - weights, kv_cache_bytes_ref(cfg, 1, seq_len, dtype_bytes)
        why = diagnose(max_num_seqs, _SEQS_MISTAKES, [(cfg, memory, weights, seq_len, dtype_bytes)] + _SEQS_PROBES,
                       _same_number)
        assert False, (f"max_num_seqs = {got}, expected {ref} (free memory {free / 2**30:.3g} GiB, KV per "
                       f"sequence {per / 2**30:.3g} GiB)" + (f" — {why}" if why else ""))

    run_property(prop, max_examples=60,
                 hint="free = memory_bytes - weight_bytes; each sequence needs kv_cache_bytes(cfg, 1, seq_len, "
                      "dtype_bytes); the answer is floor(free / per_sequence), and 0 if free < 0.")


__all__ += ["reference_attend", "kv_cache_bytes_ref", "max_num_seqs_ref"]
