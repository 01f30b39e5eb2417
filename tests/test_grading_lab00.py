"""lab00 checkers, graded both ways: minillm's own functions (minillm/bench/roofline.py) pass the property suites;
handed in as answers they are refused, as are the grader's references and plausible wrong answers."""
import pytest

from minillm.bench import roofline
from minillm.grading import lab00
from minillm.grading.lab00 import (TASKS, check_lab00_1, check_lab00_2, check_lab00_3, linear_flops_bytes_ref,
                                   model_flops_bytes_ref, roofline_time_ref)
from grading_helpers import rejected


# ---------------------------------------------------------------- lab00_1 linear layer

def test_lab00_1_minillm_passes():
    TASKS["lab00_1"].verify(roofline.linear_flops_bytes)


def test_lab00_1_rejects_minillm_and_the_reference():
    rejected(check_lab00_1, roofline.linear_flops_bytes, "minillm's own answer")
    rejected(check_lab00_1, linear_flops_bytes_ref, "minillm's own answer")
    rejected(check_lab00_1, lambda t, i, o, b: linear_flops_bytes_ref(t, i, o, b), "grader's reference answer")


def test_lab00_1_correct_learner_code_passes():
    check_lab00_1(lambda t, i, o, b: (t * i * o * 2, (i * o + (i + o) * t) * b))


def test_lab00_1_blank_starter_fails():
    def linear_flops_bytes(num_tokens, d_in, d_out, dtype_bytes):
        raise NotImplementedError()
    rejected(check_lab00_1, linear_flops_bytes, "not implemented yet")


LINEAR_WRONG = {
    "macs_not_flops": (lambda t, i, o, b: (t * i * o, b * (i * o + t * i + t * o)), "multiply-adds"),
    "elements_not_bytes": (lambda t, i, o, b: (2 * t * i * o, i * o + t * i + t * o), "elements, not bytes"),
    "weights_only": (lambda t, i, o, b: (2 * t * i * o, b * i * o), "only the weights"),
    "weights_per_token": (lambda t, i, o, b: (2 * t * i * o, b * (t * i * o + t * i + t * o)), "once per forward"),
    "flops_ignore_tokens": (lambda t, i, o, b: (2 * i * o, b * (i * o + t * i + t * o)), "don't grow"),
}


@pytest.mark.parametrize("name", LINEAR_WRONG)
def test_lab00_1_wrong_implementations_fail(name):
    fn, diagnosis = LINEAR_WRONG[name]
    rejected(check_lab00_1, fn, diagnosis, "Smallest failing example", "Hint")


# ---------------------------------------------------------------- lab00_2 whole model

def test_lab00_2_minillm_passes():
    TASKS["lab00_2"].verify(roofline.model_flops_bytes)


def test_lab00_2_correct_learner_code_passes():
    check_lab00_2(_model)


def test_lab00_2_reference_agrees_with_the_model_config():
    from minillm.config import ModelConfig
    cfg = ModelConfig(**lab00.SMOLLM2)
    flops, nbytes = model_flops_bytes_ref(cfg, 1, 1, 4)
    # decode at batch 1 reads every weight once (norms aside): the bytes are the parameter bytes, plus
    # activations (a fraction of a percent at one token)
    params_read = cfg.num_params() - cfg.hidden_size * (2 * cfg.num_layers + 1)
    assert 0 < nbytes - 4 * params_read < 0.005 * nbytes
    assert flops == 2 * params_read


def test_lab00_2_rejects_minillm_and_the_reference():
    rejected(check_lab00_2, model_flops_bytes_ref, "itself")
    rejected(check_lab00_2, lambda *a: roofline.model_flops_bytes(*a), "runs minillm's own implementation")


def _model(cfg, T, logits, b, *, layers=None, kv=None, mlp=2, head_tokens=None, fused=True):
    """A learner's model_flops_bytes, with knobs for the classic mistakes."""
    h, i = cfg.hidden_size, cfg.intermediate_size
    q = cfg.num_heads * cfg.head_dim
    kvd = (cfg.num_kv_heads if kv is None else kv) * cfg.head_dim
    qkv = [(T, h, q + 2 * kvd)] if fused else [(T, h, q), (T, h, kvd), (T, h, kvd)]
    layer = qkv + [(T, q, h), (T, h, mlp * i), (T, i, h)]
    mm = layer * (cfg.num_layers if layers is None else layers) + [(head_tokens or logits, h, cfg.vocab_size)]
    f = sum(2 * t * a * o for t, a, o in mm)
    by = sum(b * (a * o + t * a + t * o) for t, a, o in mm)
    return f, by


MODEL_WRONG = {
    "one_layer": (lambda c, T, n, b: _model(c, T, n, b, layers=1), "num_layers"),
    "kv_like_q": (lambda c, T, n, b: _model(c, T, n, b, kv=c.num_heads), "sized K and V like Q"),
    "lm_head_all_tokens": (lambda c, T, n, b: _model(c, T, n, b, head_tokens=T), "num_logits tokens only"),
    "two_matrix_mlp": (lambda c, T, n, b: _model(c, T, n, b, mlp=1), "three matrices"),
    "unfused_qkv": (lambda c, T, n, b: _model(c, T, n, b, fused=False), "fused"),
}


@pytest.mark.parametrize("name", MODEL_WRONG)
def test_lab00_2_wrong_implementations_fail(name):
    fn, diagnosis = MODEL_WRONG[name]
    rejected(check_lab00_2, fn, diagnosis, "Smallest failing example")


def test_lab00_2_swapped_pair_is_diagnosed():
    rejected(check_lab00_2, lambda *a: _model(*a)[::-1], "(bytes, flops)")


# ---------------------------------------------------------------- lab00_3 roofline

def test_lab00_3_minillm_passes():
    TASKS["lab00_3"].verify(roofline.roofline_time)


def test_lab00_3_rejects_minillm_and_the_reference():
    rejected(check_lab00_3, roofline_time_ref, "itself")
    rejected(check_lab00_3, roofline.roofline_time, "itself")


def test_lab00_3_correct_learner_code_passes():
    check_lab00_3(lambda f, b, p, w: max(b / w, f / p))


ROOF_WRONG = {
    "min_not_max": (lambda f, b, p, w: min(f / p, b / w), "smaller of"),
    "sum": (lambda f, b, p, w: f / p + b / w, "added the two"),
    "memory_only": (lambda f, b, p, w: b / w, "ignored the compute roof"),
    "compute_only": (lambda f, b, p, w: f / p, "ignored the memory roof"),
    "attainable_flops_not_time": (lambda f, b, p, w: min(p, f / b * w), "expected"),
}


@pytest.mark.parametrize("name", ROOF_WRONG)
def test_lab00_3_wrong_implementations_fail(name):
    fn, diagnosis = ROOF_WRONG[name]
    rejected(check_lab00_3, fn, diagnosis, "Smallest failing example")
