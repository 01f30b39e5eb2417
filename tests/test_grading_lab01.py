"""lab01 checkers, graded both ways: minillm's own attention and sizing functions pass the property suites
(TASKS[...].verify); handed in as answers (as they are, copied or wrapped) they are refused, and plausible wrong
implementations fail with their diagnosis."""
import functools
import types

import pytest
import torch

from minillm.config import ModelConfig
from minillm.grading.lab01 import (TASKS, check_lab01_1, check_lab01_2, check_lab01_3, kv_cache_bytes_ref,
                                   max_num_seqs_ref, reference_attend)
from minillm.kv.sizing import kv_cache_bytes, max_seqs_that_fit
from minillm.layers.attention import causal_attend
from grading_helpers import rejected


# ---------------------------------------------------------------- lab01_1 attention with a KV cache

def test_lab01_1_minillm_attention_passes():
    TASKS["lab01_1"].verify(causal_attend)


def test_lab01_1_rejects_minillm_attention_itself():
    rejected(check_lab01_1, causal_attend, "minillm's own answer", "causal_attend")
    rejected(check_lab01_1, functools.partial(causal_attend), "minillm's own answer")
    copy = types.FunctionType(causal_attend.__code__, {"F": torch.nn.functional, "torch": torch})
    rejected(check_lab01_1, copy, "minillm's own answer")
    rejected(check_lab01_1, lambda q, k, v, s: causal_attend(q, k, v, s), "runs minillm's own implementation")
    rejected(check_lab01_1, lambda q, k, v, s: reference_attend(q, k, v, s).to(q.dtype),
             "runs the grader's reference answer")


def test_reference_attend_matches_minillm():
    """The checker's independent reference agrees with the engine's attention (so the spec is the engine's)."""
    g = torch.Generator().manual_seed(0)
    for n, L, KVH, group in [(1, 1, 1, 1), (3, 7, 2, 3), (5, 5, 1, 4), (1, 9, 3, 3)]:
        q = torch.randn(n, KVH * group, 8, generator=g)
        k, v = torch.randn(L, KVH, 8, generator=g), torch.randn(L, KVH, 8, generator=g)
        torch.testing.assert_close(causal_attend(q, k, v, 0.3).double(), reference_attend(q, k, v, 0.3),
                                   atol=1e-5, rtol=1e-5)


def _attn(q, k, v, scale, *, stable=True, kv_map="div", offset="suffix", strict=False, own_scale=False,
          mask_value=float("-inf"), additive=False):
    n, H, D = q.shape
    L, KVH, _ = k.shape
    g = H // KVH
    heads = torch.tensor([h // g if kv_map == "div" else h % KVH for h in range(H)])
    kk, vv = k[:, heads], v[:, heads]
    s = torch.einsum("nhd,lhd->hnl", q, kk) * (D ** -0.5 if own_scale else scale)
    start = L - n if offset == "suffix" else 0
    qpos = torch.arange(start, start + n)[:, None]
    kpos = torch.arange(L)[None, :]
    masked = (kpos >= qpos) if strict else (kpos > qpos)
    if callable(mask_value):
        mask_value = mask_value(s.dtype)
    s = s + masked.to(s.dtype) * mask_value if additive else s.masked_fill(masked, mask_value)
    if stable:
        s = s - s.amax(-1, keepdim=True)
    p = s.exp()
    p = p / p.sum(-1, keepdim=True)
    return torch.einsum("hnl,lhd->nhd", p.nan_to_num(0.0), vv)


def _in_place(q, k, v, scale):
    k.mul_(1.0)  # harmless values, but a write into the cache
    k.add_(0.0)
    k[0, 0, 0] += 1.0
    return _attn(q, k, v, scale)


ATTN_WRONG = {
    "no_max_subtraction": (functools.partial(_attn, stable=False), "subtract each row's maximum"),
    "gqa_modulo": (functools.partial(_attn, kv_map="mod"), "h // (H // KVH)"),
    "mask_from_start": (functools.partial(_attn, offset="prefix"), "LAST n of L positions"),
    "mask_excludes_self": (functools.partial(_attn, strict=True), "its own key"),
    "hardcoded_scale": (functools.partial(_attn, own_scale=True), "hard-code"),
    "writes_into_cache": (_in_place, "modified its inputs"),
    "returns_float64": (lambda q, k, v, s: _attn(q.double(), k.double(), v.double(), s), "dtype"),
    "returns_float32": (lambda q, k, v, s: _attn(q.float(), k.float(), v.float(), s), "dtype"),
    # a finite "very negative" mask: right while the scores are small, wrong once they reach about ±1e10
    "mask_minus_1e9": (functools.partial(_attn, mask_value=-1e9), "finite 'very negative' constant"),
    "mask_minus_1e4": (functools.partial(_attn, mask_value=-1e4), "finite 'very negative' constant"),
    "mask_fp16_min": (functools.partial(_attn, mask_value=-65504.0), "finite 'very negative' constant"),
    "additive_minus_1e9": (functools.partial(_attn, mask_value=-1e9, additive=True), "finite 'very negative'"),
}


@pytest.mark.parametrize("name", ATTN_WRONG)
def test_lab01_1_wrong_implementations_fail(name):
    fn, diagnosis = ATTN_WRONG[name]
    rejected(check_lab01_1, fn, diagnosis, "Smallest failing example", "Hint")


def test_lab01_1_correct_learner_code_passes():
    check_lab01_1(functools.partial(_attn))  # a partial WITH bound defaults is the learner's own code path


@pytest.mark.parametrize("additive", [False, True], ids=["masked_fill", "added"])
def test_lab01_1_the_dtypes_lowest_value_as_the_mask_passes(additive):
    """torch.finfo(dtype).min (set, or added to the score) gives masked keys weight exactly 0 for any finite scores:
    a correct alternative to -inf (the lab text says so)."""
    check_lab01_1(functools.partial(_attn, mask_value=lambda dt: torch.finfo(dt).min, additive=additive))


# ---------------------------------------------------------------- lab01_2 KV-size formula

def test_lab01_2_minillm_formula_passes():
    TASKS["lab01_2"].verify(lambda cfg, batch, seq, dtype_bytes: int(kv_cache_bytes(cfg, batch * seq, dtype_bytes)))


def test_lab01_2_rejects_minillm_and_the_reference():
    rejected(check_lab01_2, kv_cache_bytes_ref, "minillm.grading.lab01.kv_cache_bytes_ref itself")
    rejected(check_lab01_2, ModelConfig.kv_bytes_per_token, "minillm's own answer")
    rejected(check_lab01_2, lambda c, b, s, d: c.kv_bytes_per_token(d) * b * s, "runs minillm's own implementation")


def test_lab01_2_correct_learner_code_passes():
    check_lab01_2(lambda c, b, s, d: b * s * d * c.num_layers * 2 * c.head_dim * c.num_kv_heads)


KV_WRONG = {
    "missing_factor_2": (lambda c, b, s, d: c.num_layers * c.num_kv_heads * c.head_dim * b * s * d, "multiply by 2"),
    "missing_layers": (lambda c, b, s, d: 2 * c.num_kv_heads * c.head_dim * b * s * d, "num_layers"),
    "query_heads": (lambda c, b, s, d: 2 * c.num_layers * c.num_heads * c.head_dim * b * s * d, "num_kv_heads"),
    "hidden_size": (lambda c, b, s, d: 2 * c.num_layers * c.hidden_size * b * s * d, "model's width"),
    "head_dim_from_hidden": (lambda c, b, s, d: 2 * c.num_layers * c.num_kv_heads * (c.hidden_size // c.num_heads)
                             * b * s * d, "head_dim is given"),
    "elements": (lambda c, b, s, d: 2 * c.num_layers * c.num_kv_heads * c.head_dim * b * s, "bytes, not elements"),
}


@pytest.mark.parametrize("name", KV_WRONG)
def test_lab01_2_wrong_implementations_fail(name):
    fn, diagnosis = KV_WRONG[name]
    rejected(check_lab01_2, fn, diagnosis, "Smallest failing example")


# ---------------------------------------------------------------- lab01_3 sizing

def test_lab01_3_minillm_passes():
    TASKS["lab01_3"].verify(max_seqs_that_fit)


def test_lab01_3_rejects_the_reference_itself():
    rejected(check_lab01_3, max_num_seqs_ref, "itself")
    rejected(check_lab01_3, lambda *a: max_seqs_that_fit(*a), "runs minillm's own implementation")


def test_lab01_3_correct_learner_code_passes():
    check_lab01_3(lambda c, m, w, s, d: max(0, (m - w) // _per_seq(c, s, d)))


def _per_seq(c, s, d):
    return 2 * c.num_layers * c.num_kv_heads * c.head_dim * s * d


SEQS_WRONG = {
    "ceil": (lambda c, m, w, s, d: -(-(m - w) // _per_seq(c, s, d)) if m > w else 0, "round down"),
    "ignores_weights": (lambda c, m, w, s, d: m // _per_seq(c, s, d), "weights take their share"),
    "negative": (lambda c, m, w, s, d: int((m - w) / _per_seq(c, s, d)), "return 0"),
    "kv_without_2": (lambda c, m, w, s, d: max(0, (m - w) // (_per_seq(c, s, d) // 2)), "multiply by 2"),
    "float_result": (lambda c, m, w, s, d: max(0, (m - w) / _per_seq(c, s, d)), "whole number"),
    # a boundary mistake: counts sequences while (k + 1) * per < free, so an exact fit loses one
    "exact_fit_excluded": (lambda c, m, w, s, d: max(0, (m - w - 1) // _per_seq(c, s, d)), "exactly fits"),
}


@pytest.mark.parametrize("name", SEQS_WRONG)
def test_lab01_3_wrong_implementations_fail(name):
    fn, diagnosis = SEQS_WRONG[name]
    rejected(check_lab01_3, fn, diagnosis, "Smallest failing example")


# ---------------------------------------------------------------- the plug-in contract

def test_checker_approved_attention_drives_the_engine():
    """What lab01_1 accepts is what the engine needs: plugged into the backend of a tiny random model (GQA),
    a function passing the checker reproduces minillm's logits through prefill, chunked prefill and decode."""
    from minillm.kv.contiguous import ContiguousKVCache
    from minillm.layers.attention import TorchAttentionBackend
    from minillm.models.llama import ForwardContext
    from minillm.testing import random_model
    from tiny_models import minillm_logits

    learner = functools.partial(_attn)
    check_lab01_1(learner)
    model = random_model(seed=3, heads=6, kv_heads=2, head_dim=8, layers=2, vocab=64)
    ids = [5, 9, 1, 33, 7, 2, 60, 11, 4, 19]
    expected = minillm_logits(model, ids)
    cache = ContiguousKVCache(model.cfg, 1, len(ids))
    backend = TorchAttentionBackend(attend_fn=learner)
    rows = []
    for start, end in [(0, 4), (4, 7), (7, 8), (8, 9), (9, 10)]:      # prefill, a chunk, then decode steps
        meta = cache.metadata([0], [start], [end - start])
        h = model(torch.tensor(ids[start:end]), torch.arange(start, end), ForwardContext(meta, cache, backend))
        rows.append(model.compute_logits(h))
    torch.testing.assert_close(torch.cat(rows), expected, atol=1e-4, rtol=1e-4)
