"""Checkers for lab01 — the KV cache.

Tasks (the notebook documents the same signatures):
  lab01_1  attend(q, k, v, scale) -> out: attention of the last n positions over L cached keys,
           q [n, H, D], k/v [L, KVH, D] -> [n, H, D] in q's dtype; causal; GQA: query head h reads kv head
           h // (H // KVH). The AttendFn seam: TorchAttentionBackend(attend_fn=attend). minillm's own:
           minillm.layers.attention.causal_attend.
  lab01_2  kv_cache_bytes(cfg, batch_size, seq_len, dtype_bytes) -> bytes   (minillm: kv.sizing.kv_cache_bytes)
  lab01_3  max_num_seqs(cfg, memory_bytes, weight_bytes, seq_len, dtype_bytes) -> int
           (minillm: kv.sizing.max_seqs_that_fit)

Oracles: dense causal attention in float64 (reference_attend); the bytes a KV cache for the shape really
allocates (a minillm KVCache built on the meta device, so nothing is allocated); integer division of the free
memory by one sequence's cache.
"""
from __future__ import annotations

import math
from typing import Any, Callable

import torch
from hypothesis import example, given, strategies as st

from minillm.config import ModelConfig
from minillm.grading.core import Hint, Task, as_int, as_tensor, diagnose, fail, minillm_objects, run_property
from minillm.kv.cache import KVCache

__all__ = ["check_lab01_1", "check_lab01_2", "check_lab01_3", "TASKS", "reference_attend"]


def _cfg(layers: int, heads: int, kv_heads: int, head_dim: int, hidden: int | None = None) -> ModelConfig:
    return ModelConfig(vocab_size=1000, hidden_size=hidden or heads * head_dim, intermediate_size=64,
                       num_layers=layers, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim)


SMOLLM2, LLAMA3_8B, LLAMA2_70B = _cfg(30, 9, 3, 64), _cfg(32, 32, 8, 128), _cfg(80, 64, 8, 128)


# --------------------------------------------------------------------------- lab01_1: attention over a cache

def reference_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, *, strict: bool = False,
                     kv_head_of: Callable[..., int] | None = None, query_offset: int | None = None) -> torch.Tensor:
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
    s = s.masked_fill(~((kpos < qpos) if strict else (kpos <= qpos)), float("-inf"))
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)  # a fully masked row (only in broken variants) -> zeros
    return torch.einsum("hnl,lhd->nhd", p, vh)


# |error| allowed against the float64 reference computed from the same (rounded) inputs
_TOL = {torch.float64: 1e-9, torch.float32: 1e-4, torch.bfloat16: 5e-2, torch.float16: 1e-2}


def _make_inputs(n: int, L: int, kv_heads: int, group: int, head_dim: int, seed: int, magnitude: float,
                 dtype: torch.dtype = torch.float32, negative: bool = False) -> tuple[torch.Tensor, ...]:
    """Random q, k, v. negative=True: every score of every row is around -magnitude^2 (keys point away from the
    queries), which underflows exp() unless each row's maximum is subtracted first."""
    g = torch.Generator().manual_seed(seed)
    H = kv_heads * group
    q = torch.randn(n, H, head_dim, generator=g) * magnitude
    k = torch.randn(L, kv_heads, head_dim, generator=g) * magnitude
    v = torch.randn(L, kv_heads, head_dim, generator=g)
    if negative:
        direction = torch.randn(head_dim, generator=g)
        direction = direction / direction.norm()
        q = direction.expand(n, H, head_dim) * magnitude + 0.01 * q / max(magnitude, 1.0)
        k = -direction.expand(L, kv_heads, head_dim) * magnitude + 0.3 * torch.randn(L, kv_heads, head_dim,
                                                                                      generator=g)
    return q.to(dtype), k.to(dtype), v.to(dtype)


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
# q and k of this size give scores of about ±1e10 (well apart, so float32 rounding cannot reorder them): a masked key
# must get no weight even when every key the query may see scores below -1e9, and when a key it may not see scores
# +1e10 (an additive mask of -1e9 leaves it on top)
_HUGE = 1e5
_HUGE_WHY = ("the scores here are about ±1e10: a key a query may not see must get no weight at all, whatever the "
             "scores — a finite 'very negative' constant (-1e9, -1e4, -65504 set or added) is not below every real "
             "score; give masked scores -inf (masked_fill with float('-inf')) or the dtype's lowest value")
# fixed probes on which the mistakes above all differ: a GQA suffix chunk, a full MQA prefill, a decode step
_ATTN_PROBE_SHAPES = [(3, 7, 2, 3, 4, 11), (5, 5, 1, 4, 8, 12), (1, 6, 3, 2, 4, 13)]


def _variant(kw: dict[str, Any]) -> Callable[..., torch.Tensor]:
    def wrong(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        opts = dict(kw)
        if "scale" in opts:
            scale = opts.pop("scale")(q.shape[-1])
        return reference_attend(q, k, v, scale, **opts)
    return wrong


def _diagnose_attend(attend: Callable[..., Any], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                     tol: float) -> str | None:
    def same(out: Any, alt: torch.Tensor) -> bool:
        return (type(out) is torch.Tensor and out.shape == alt.shape
                and torch.allclose(out.double(), alt.double(), atol=tol, rtol=tol))
    probes = [(q.float(), k.float(), v.float(), scale)] + [(*_make_inputs(n, L, kvh, g, d, seed, 1.0), 0.7)
                                                           for n, L, kvh, g, d, seed in _ATTN_PROBE_SHAPES]
    return diagnose(attend, [(why, _variant(kw)) for why, kw in _ATTN_MISTAKES], probes, same)


def verify_lab01_1(attend: Callable[..., Any]) -> None:
    @given(L=st.integers(1, 24), n_frac=st.floats(0.0, 1.0), kv_heads=st.integers(1, 4), group=st.integers(1, 4),
           head_dim=st.sampled_from([1, 2, 4, 8, 16]), scale=st.floats(0.05, 2.0),
           magnitude=st.sampled_from([1.0, 0.1, 30.0, _HUGE]), seed=st.integers(0, 2**16),
           dtype=st.sampled_from([torch.float32, torch.float32, torch.float64, torch.bfloat16, torch.float16]),
           negative=st.booleans())
    @example(L=1, n_frac=1.0, kv_heads=1, group=1, head_dim=4, scale=0.5, magnitude=1.0, seed=0,       # one token
             dtype=torch.float32, negative=False)
    @example(L=6, n_frac=0.0, kv_heads=2, group=2, head_dim=4, scale=0.5, magnitude=1.0, seed=1,       # decode
             dtype=torch.float32, negative=False)
    @example(L=5, n_frac=1.0, kv_heads=1, group=3, head_dim=4, scale=0.5, magnitude=1.0, seed=2,       # MQA prefill
             dtype=torch.float32, negative=False)
    @example(L=7, n_frac=0.5, kv_heads=2, group=3, head_dim=8, scale=0.35, magnitude=1.0, seed=3,      # suffix, GQA
             dtype=torch.float32, negative=False)
    @example(L=4, n_frac=1.0, kv_heads=2, group=1, head_dim=8, scale=1.0, magnitude=30.0, seed=4,      # huge logits
             dtype=torch.float32, negative=False)
    @example(L=9, n_frac=0.0, kv_heads=1, group=2, head_dim=16, scale=1.0, magnitude=40.0, seed=5,     # all scores
             dtype=torch.float32, negative=True)                                                        # ~ -1600
    @example(L=6, n_frac=0.5, kv_heads=2, group=2, head_dim=8, scale=0.5, magnitude=1.0, seed=6,       # bfloat16
             dtype=torch.bfloat16, negative=False)
    @example(L=6, n_frac=1.0, kv_heads=2, group=2, head_dim=8, scale=0.5, magnitude=_HUGE, seed=10,    # scores
             dtype=torch.float32, negative=False)                                                       # ~ ±1e10
    def prop(L: int, n_frac: float, kv_heads: int, group: int, head_dim: int, scale: float, magnitude: float, seed: int,
             dtype: torch.dtype, negative: bool) -> None:
        n = max(1, round(n_frac * L))
        if dtype in (torch.bfloat16, torch.float16):   # ~3 digits: large scores would not be comparable
            magnitude, negative = min(magnitude, 1.0), False
        huge = magnitude >= _HUGE
        negative = negative and not huge   # scores ~ -1e10 with a small spread: float32 rounding would decide
        q, k, v = _make_inputs(n, L, kv_heads, group, head_dim, seed, magnitude, dtype, negative)
        q0, k0, v0 = q.clone(), k.clone(), v.clone()
        shapes = f"q {tuple(q.shape)} {str(dtype).removeprefix('torch.')}, k/v {tuple(k.shape)}"
        out = as_tensor(attend(q, k, v, scale), f"attend's result ({shapes})")
        if not (torch.equal(q, q0) and torch.equal(k, k0) and torch.equal(v, v0)):
            fail(f"attend modified its inputs in place ({shapes}): in the engine k and v are the KV cache itself "
                 "— never write to them")
        if tuple(out.shape) != (n, kv_heads * group, head_dim):
            fail(f"output shape {tuple(out.shape)}, expected {(n, kv_heads * group, head_dim)} ({shapes})")
        if out.dtype != dtype:
            fail(f"output dtype {out.dtype}, expected {dtype} (the same as q): the engine's next layer runs in "
                 "the model's dtype")
        big = magnitude > 10
        if not torch.isfinite(out).all():
            fail(f"output has inf/nan for {shapes}, scale={scale:g}" +
                 (" — the scores here are far from 0: exp() overflows (or every exp underflows to 0 and you divide "
                  "0 by 0) unless you subtract each row's maximum score before exponentiating" if big else ""))
        ref = reference_attend(q0, k0, v0, scale)
        tol = _TOL[dtype] * (10 if big and dtype in (torch.float32, torch.float64) else 1)
        err = (out.double() - ref).abs()
        if torch.allclose(out.double(), ref, atol=tol, rtol=tol):
            return
        i, rest = divmod(int(err.argmax()), out.shape[1] * out.shape[2])
        why = _diagnose_attend(attend, q0, k0, v0, scale, max(tol, 1e-4))
        if why is None and huge:
            why = _HUGE_WHY
        if why is None and big:
            why = ("the scores here are far from 0: exp() of them overflows or underflows unless you subtract "
                   "each row's maximum score first")
        huge_note = ", scores up to about ±1e10" if huge else ""
        fail(f"wrong output for {shapes}, scale={scale:g}{huge_note}: max error {float(err.max()):.3g} at query {i} "
             f"(position {L - n + i} of {L}), head {rest // out.shape[2]}" + (f" — {why}" if why else ""))

    run_property(prop, max_examples=80, hint=Hint(
        "causal attention over a cache: which keys may query i of the last n positions see, and which kv head "
        "does each query head read?",
        "query i sits at absolute position L - n + i; consecutive query heads share one kv head (GQA); exp() of "
        "large scores overflows unless each row is shifted by its maximum first; return q's dtype.",
        "scores = scale · q·k for head h against kv head h // (H // KVH); mask keys after position L - n + i for "
        "query i; softmax over keys (subtract the row max first); weighted sum of v; return q's dtype."))


# --------------------------------------------------------------------------- lab01_2 and lab01_3: sizing

# 1 byte: fp8, one byte per number and nothing else (an int8 KVCache also keeps a float16 scale per row, kv/int8.py)
_DTYPE_OF_BYTES = {1: torch.float8_e4m3fn, 2: torch.bfloat16, 4: torch.float32}


def kv_cache_bytes_ref(cfg: ModelConfig, batch_size: int, seq_len: int, dtype_bytes: int) -> int:
    """What a KV cache of this shape allocates: minillm's KVCache built on the meta device (no memory)."""
    cache = KVCache(cfg, num_blocks=batch_size, block_size=seq_len, dtype=_DTYPE_OF_BYTES[dtype_bytes],
                    device="meta")
    return cache.nbytes


def max_num_seqs_ref(cfg: ModelConfig, memory_bytes: int, weight_bytes: int, seq_len: int, dtype_bytes: int) -> int:
    """Whole sequences that fit in what the weights leave free (never negative)."""
    return max(0, (memory_bytes - weight_bytes) // kv_cache_bytes_ref(cfg, 1, seq_len, dtype_bytes))


@st.composite
def _kv_configs(draw: st.DrawFn) -> ModelConfig:
    kv_heads = draw(st.integers(1, 16))
    heads = kv_heads * draw(st.integers(1, 8))
    head_dim = draw(st.sampled_from([32, 64, 80, 128, 256]))
    # hidden_size need not be heads x head_dim: an answer that derives head_dim = hidden // heads is wrong
    hidden = draw(st.sampled_from([heads * head_dim, 2048, 3072, 4096]))
    return _cfg(draw(st.integers(1, 128)), heads, kv_heads, head_dim, hidden)


_KV_MISTAKES = [
    ("K and V are both cached: multiply by 2",
     lambda c, b, s, d: c.num_layers * c.num_kv_heads * c.head_dim * b * s * d),
    ("every layer has its own K and V: multiply by num_layers",
     lambda c, b, s, d: 2 * c.num_kv_heads * c.head_dim * b * s * d),
    ("only the kv heads are cached (GQA/MQA): use num_kv_heads, not num_heads",
     lambda c, b, s, d: 2 * c.num_layers * c.num_heads * c.head_dim * b * s * d),
    ("hidden_size is the model's width, not the width of K/V: use num_kv_heads · head_dim",
     lambda c, b, s, d: 2 * c.num_layers * c.hidden_size * b * s * d),
    ("head_dim is given: hidden_size // num_heads need not equal it",
     lambda c, b, s, d: 2 * c.num_layers * c.num_kv_heads * (c.hidden_size // c.num_heads) * b * s * d),
    ("count bytes, not elements: multiply by dtype_bytes",
     lambda c, b, s, d: 2 * c.num_layers * c.num_kv_heads * c.head_dim * b * s),
    ("every sequence of the batch has its own cache: multiply by batch_size",
     lambda c, b, s, d: 2 * c.num_layers * c.num_kv_heads * c.head_dim * s * d),
]
_KV_PROBES = [(_cfg(5, 8, 2, 128, 2048), 3, 100, 4), (_cfg(30, 9, 3, 64), 2, 7, 1), (_cfg(4, 8, 4, 256, 1024), 1, 3, 2)]


def _same_number(a: Any, b: int) -> bool:
    return type(a) in (int, float) and a == b


def verify_lab01_2(kv_cache_bytes: Callable[..., Any]) -> None:
    @given(cfg=_kv_configs(), batch_size=st.integers(1, 256), seq_len=st.integers(1, 131072),
           dtype_bytes=st.sampled_from([2, 1, 4]))
    @example(cfg=SMOLLM2, batch_size=1, seq_len=8192, dtype_bytes=2)
    @example(cfg=_cfg(4, 8, 4, 256, 1024), batch_size=2, seq_len=10, dtype_bytes=2)     # head_dim != hidden / heads
    def prop(cfg: ModelConfig, batch_size: int, seq_len: int, dtype_bytes: int) -> None:
        got = kv_cache_bytes(cfg, batch_size, seq_len, dtype_bytes)
        got = int(got) if type(got) is float and got.is_integer() else got      # a whole float is a whole number
        got = as_int(got, "kv_cache_bytes's result (a whole number of bytes)")
        ref = kv_cache_bytes_ref(cfg, batch_size, seq_len, dtype_bytes)
        if got == ref:
            return
        why = diagnose(kv_cache_bytes, _KV_MISTAKES, [(cfg, batch_size, seq_len, dtype_bytes)] + _KV_PROBES,
                       _same_number)
        fail(f"kv_cache_bytes = {got}, expected {ref} for num_layers={cfg.num_layers}, num_heads={cfg.num_heads}, "
             f"num_kv_heads={cfg.num_kv_heads}, head_dim={cfg.head_dim}, hidden_size={cfg.hidden_size}"
             + (f" — {why}" if why else ""))

    run_property(prop, max_examples=60, hint=Hint(
        "count what one token leaves in the cache in every layer (which tensors, how many heads, how wide), then "
        "scale up.",
        "per layer and token the cache keeps a K and a V vector for every kv head (not every query head), "
        "head_dim numbers each, dtype_bytes per number; every sequence of the batch has its own.",
        "bytes = 2 (K and V) · num_layers · num_kv_heads · head_dim · batch_size · seq_len · dtype_bytes."))


def _per_seq(c: ModelConfig, s: int, d: int) -> int:
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
    ("a sequence that exactly fits, fits: free memory of exactly k sequences' caches holds k of them (<=, not <)",
     lambda c, m, w, s, d: max(0, (m - w - 1) // _per_seq(c, s, d))),
] + [("the per-sequence KV size is off: " + why,
      (lambda wrong: lambda c, m, w, s, d: max(0, int((m - w) // wrong(c, 1, s, d))))(wrong))
     for why, wrong in _KV_MISTAKES if "batch_size" not in why]
_SEQS_PROBES = [(LLAMA3_8B, 24 * 2**30, 15 * 2**30, 8192, 2),
                (_cfg(6, 8, 2, 128, 1024), 10**9 + 12345, 3 * 10**8, 1000, 4),
                (_cfg(6, 8, 2, 128, 1024), 10**9, 2 * 10**9, 1000, 4),
                (_cfg(4, 8, 4, 256, 1024), 10**8, 10**7, 100, 2)]


def verify_lab01_3(max_num_seqs: Callable[..., Any]) -> None:
    @given(cfg=_kv_configs(), memory_gib=st.integers(1, 320), weight_frac=st.floats(0.0, 1.3),
           seq_len=st.integers(1, 131072), dtype_bytes=st.sampled_from([2, 1, 4]))
    @example(cfg=SMOLLM2, memory_gib=1, weight_frac=0.5, seq_len=8192, dtype_bytes=2)
    @example(cfg=LLAMA2_70B, memory_gib=80, weight_frac=1.75, seq_len=4096, dtype_bytes=2)   # 70B fp16 on 80 GB
    @example(cfg=LLAMA3_8B, memory_gib=24, weight_frac=0.625, seq_len=8192, dtype_bytes=2)   # 8B fp16 on 24 GB
    def prop(cfg: ModelConfig, memory_gib: int, weight_frac: float, seq_len: int, dtype_bytes: int) -> None:
        memory = memory_gib * 2**30
        weights = int(weight_frac * memory)
        got = max_num_seqs(cfg, memory, weights, seq_len, dtype_bytes)
        got = int(got) if type(got) is float and got.is_integer() else got      # as lab01_2 takes it
        got = as_int(got, "max_num_seqs's result (a whole number of sequences)")
        ref = max_num_seqs_ref(cfg, memory, weights, seq_len, dtype_bytes)
        if got == ref:
            return
        free, per = memory - weights, _per_seq(cfg, seq_len, dtype_bytes)
        why = diagnose(max_num_seqs, _SEQS_MISTAKES, [(cfg, memory, weights, seq_len, dtype_bytes)] + _SEQS_PROBES,
                       _same_number)
        fail(f"max_num_seqs = {got}, expected {ref} (free memory {free / 2**30:.3g} GiB, KV per sequence "
             f"{per / 2**30:.3g} GiB)" + (f" — {why}" if why else ""))

    run_property(prop, max_examples=60, hint=Hint(
        "capacity planning: what memory is left once the weights are loaded, and how much does one full-length "
        "sequence need?",
        "a sequence fits only whole (round down), and none fits when the weights alone exceed the memory; one "
        "sequence's cache is your kv_cache_bytes with batch_size 1.",
        "free = memory_bytes - weight_bytes; each sequence needs kv_cache_bytes(cfg, 1, seq_len, dtype_bytes); the "
        "answer is floor(free / per_sequence), and 0 if free < 0."))


# --------------------------------------------------------------------------- the tasks

TASKS = {t.id: t for t in (
    Task("lab01_1", what="attend", verify=verify_lab01_1,
         engine=minillm_objects("minillm.layers.attention:causal_attend", "minillm.layers.attention:gqa_attend",
                                "minillm.layers.attention:paged_decode_attend"),
         oracles=lambda: [reference_attend]),
    Task("lab01_2", what="kv_cache_bytes", verify=verify_lab01_2,
         engine=minillm_objects("minillm.kv.sizing:kv_cache_bytes", "minillm.config:ModelConfig.kv_bytes_per_token",
                                "minillm.kv.cache:KVCache.bytes_per_block"),
         oracles=lambda: [kv_cache_bytes_ref]),
    Task("lab01_3", what="max_num_seqs", verify=verify_lab01_3,
         engine=minillm_objects("minillm.kv.sizing:max_seqs_that_fit", "minillm.kv.sizing:kv_tokens_that_fit"),
         oracles=lambda: [max_num_seqs_ref]),
)}

check_lab01_1 = TASKS["lab01_1"].checker(
    'attend(q [n,H,D], k [L,KVH,D], v [L,KVH,D], scale) -> [n,H,D], causal over the last n positions, GQA.')
check_lab01_2 = TASKS["lab01_2"].checker(
    'kv_cache_bytes(cfg, batch_size, seq_len, dtype_bytes) -> bytes of the KV cache.')
check_lab01_3 = TASKS["lab01_3"].checker(
    'max_num_seqs(cfg, memory_bytes, weight_bytes, seq_len, dtype_bytes) -> how many full-length sequences fit.')
