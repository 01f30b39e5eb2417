"""lab08 checkers, graded both ways: minillm's own quantization (formats.quantize, QuantizedWeight.dequantize,
cpu_qgemm.dequantize / qlinear) passes the property suites; plausible wrong versions of each piece are rejected with
the diagnosis a learner needs; correct learner versions written differently from minillm's pass."""
import pytest
import torch
import torch.nn.functional as F

from minillm.grading.lab08 import (TASKS, check_lab08_1, check_lab08_2, check_lab08_3, check_lab08_4,
                                   dequantize_ref, int8_codes_ref, unpack_ref)
from minillm.kernels import cpu_qgemm
from minillm.quant.formats import QuantizedWeight, QuantSpec, pack_int4, quantize, unpack_int4
from grading_helpers import rejected


# ---------------------------------------------------------------- the oracles agree with the engine

def test_the_oracles_agree_with_minillm():
    g = torch.Generator().manual_seed(0)
    for k, group in ((64, 32), (128, 64), (96, 96)):
        w = torch.randn(5, k, generator=g) * torch.rand(5, 1, generator=g)
        q8 = quantize(w, QuantSpec("int8"))
        scale, exact = int8_codes_ref(w)
        assert torch.equal(q8.scales[:, 0].double(), scale)
        assert (q8.qweight.double() - exact.round().clamp(-127, 127)).abs().max() <= 1
        assert torch.allclose(q8.dequantize().double(), dequantize_ref(q8), atol=1e-6)
        q4 = quantize(w, QuantSpec("int4", group if group % 32 == 0 and k % group == 0 else 32))
        assert torch.equal(unpack_ref(q4.qweight), unpack_int4(q4.qweight).long())
        assert torch.allclose(q4.dequantize().double(), dequantize_ref(q4), atol=1e-6)


# ---------------------------------------------------------------- minillm's own pieces pass, and are refused

def _int8(w):
    return quantize(w, QuantSpec("int8"))


def _int4(w, group_size):
    return quantize(w, QuantSpec("int4", group_size))


def test_minillm_passes_every_task():
    TASKS["lab08_1"].verify(_int8)
    TASKS["lab08_2"].verify(_int4)
    TASKS["lab08_3"].verify(cpu_qgemm.dequantize)
    TASKS["lab08_4"].verify(cpu_qgemm.reference)


def test_minillm_itself_is_refused():
    rejected(check_lab08_1, lambda w: quantize(w, QuantSpec("int8")), "runs minillm's own implementation")
    rejected(check_lab08_2, lambda w, g: quantize(w, QuantSpec("int4", g)), "runs minillm's own implementation")
    rejected(check_lab08_3, cpu_qgemm.dequantize, "minillm's own answer")
    rejected(check_lab08_3, lambda qw: qw.dequantize(), "runs minillm's own implementation")
    rejected(check_lab08_4, cpu_qgemm.qlinear, "minillm's own answer")
    rejected(check_lab08_4, lambda x, qw: x @ cpu_qgemm.dequantize(qw).to(x.dtype).T, "runs minillm's own")


# ---------------------------------------------------------------- lab08_1 quantize_int8

def quantize_int8(w, *, scope="row", rounding="nearest", clamp=True, scale_f16_first=True, low=-127):
    """A learner's int8 quantizer (a loop over rows, unlike minillm's), with switches for the classic mistakes."""
    n, k = w.shape
    q = torch.empty(n, k, dtype=torch.int8)
    scales = torch.empty(n, 1, dtype=torch.float16)
    whole = w.abs().max()
    for r in range(n):
        top = whole if scope == "tensor" else w[r].abs().max()
        s32 = top / 127
        s16 = s32.to(torch.float16)
        s = (s16.float() if scale_f16_first else s32) if s16 > 0 else torch.tensor(1.0)
        x = w[r] / s
        x = torch.trunc(x) if rounding == "trunc" else torch.floor(x + 0.5)     # ties away from zero: accepted
        if clamp:
            x = x.clamp(low, 127)
        q[r] = x.to(torch.int8)
        scales[r, 0] = s16
    return QuantizedWeight("int8", q, scales, None, k)


def test_lab08_1_a_correct_learner_version_passes():
    check_lab08_1(lambda w: quantize_int8(w))


def test_lab08_1_a_scale_not_rounded_before_dividing_is_tolerated():
    """Decision (see minillm/grading/lab08.py): codes chosen against the float32 scale, float16 stored, pass."""
    check_lab08_1(lambda w: quantize_int8(w, scale_f16_first=False))


INT8_WRONG = {
    "per-tensor scale": (dict(scope="tensor"), "one scale for the whole matrix"),
    "round toward zero": (dict(rounding="trunc"), "rounded toward zero"),
    "no clamp": (dict(clamp=False), "clamp before the cast"),
    # symmetric int8 is [-127, 127]; -128 shows only where a subnormal float16 scale pushes |w| / scale past 127.5
    "clamp to -128": (dict(low=-128), "clamped to [-127, 127] = -127"),
}


@pytest.mark.parametrize("name", sorted(INT8_WRONG))
def test_lab08_1_wrong_versions_fail_with_their_diagnosis(name):
    kw, needle = INT8_WRONG[name]
    rejected(check_lab08_1, lambda w: quantize_int8(w, **kw), needle, "Hint")


def test_lab08_1_types_are_exact():
    rejected(check_lab08_1, lambda w: quantize_int8(w).qweight, "must return a minillm.quant.formats.QuantizedWeight")
    rejected(check_lab08_1, lambda w: QuantizedWeight("int8", quantize_int8(w).qweight.long(),
                                                      quantize_int8(w).scales, None, w.shape[1]), "expected int8")
    rejected(check_lab08_1, lambda w: QuantizedWeight("int8", quantize_int8(w).qweight,
                                                      quantize_int8(w).scales.float(), None, w.shape[1]),
             "expected float16")


# ---------------------------------------------------------------- lab08_2 quantize_int4

def quantize_int4(w, group_size, *, symmetric=False, shift=0, clamp=True, nibbles="gguf", own_pack=True,
                  check=True):
    """A learner's int4 quantizer, group by group, with switches for the classic mistakes."""
    n, k = w.shape
    if check and k % group_size:
        raise ValueError(f"group size {group_size} does not divide {k} columns")
    groups = k // group_size
    scales = torch.empty(n, groups, dtype=torch.float16)
    mins = torch.empty(n, groups, dtype=torch.float16)
    for j in range(groups):
        x = w[:, j * group_size:(j + 1) * group_size]
        if symmetric:
            s = x.abs().amax(1) / 7.5
            scales[:, j], mins[:, j] = s.half(), (-8 * s).half()
        else:
            lo, hi = x.amin(1), x.amax(1)
            scales[:, j], mins[:, j] = ((hi - lo) / 15).half(), lo.half()
    if shift:
        scales, mins = torch.roll(scales, -shift, 1), torch.roll(mins, -shift, 1)
    s = scales.float().repeat_interleave(group_size, 1)
    s = torch.where(s > 0, s, torch.ones(()))
    q = torch.round((w - mins.float().repeat_interleave(group_size, 1)) / s)
    if clamp:
        q = q.clamp(0, 15)
    q = q.to(torch.uint8)
    if nibbles == "pairs":
        packed = q[:, 0::2] | (q[:, 1::2] << 4)
    elif own_pack:
        blocks = q.view(n, k // 32, 32)
        packed = (blocks[:, :, :16] | (blocks[:, :, 16:] << 4)).reshape(n, k // 2)
    else:
        packed = pack_int4(q)
    return QuantizedWeight("int4", packed.contiguous(), scales, mins, group_size)


def test_lab08_2_correct_learner_versions_pass():
    check_lab08_2(lambda w, g: quantize_int4(w, g))
    check_lab08_2(lambda w, g: quantize_int4(w, g, own_pack=False))      # minillm's pack_int4 is allowed


INT4_WRONG = {
    "symmetric scale": (dict(symmetric=True), "a symmetric scale"),
    "group index off by one": (dict(shift=1), "group j got the scale and minimum of group j + 1"),
    "no clamp before the cast": (dict(clamp=False), "clamp to [0, 15] first"),
    "neighbouring nibbles": (dict(nibbles="pairs"), "packed as neighbours"),
    "no ValueError": (dict(check=False), "expected a ValueError"),
}


@pytest.mark.parametrize("name", sorted(INT4_WRONG))
def test_lab08_2_wrong_versions_fail_with_their_diagnosis(name):
    kw, needle = INT4_WRONG[name]
    rejected(check_lab08_2, lambda w, g: quantize_int4(w, g, **kw), needle, "Hint")


def q8_eps_for_zero_rows(w):
    """A stand-in scale for an all-zero row (1e-30): 1e-30 / 1e-30 = 1 leaks into the codes of a zero row."""
    s = (w.abs().amax(1, keepdim=True) / 127).half()
    q = torch.round((w + 1e-30) / s.float().clamp_min(1e-30)).clamp(-127, 127).to(torch.int8)
    return QuantizedWeight("int8", q, s, None, w.shape[1])


def q4_divides_by_zero(w, group_size):
    """No guard for a constant group: (w - float16(min)) / 0 is +-inf or nan, clamped to 15 or cast to 0."""
    n, k = w.shape
    if k % group_size:
        raise ValueError(f"group size {group_size} does not divide {k} columns")
    x = w.reshape(n, k // group_size, group_size)
    lo, hi = x.amin(-1), x.amax(-1)
    m, s = lo.half(), ((hi - lo) / 15).half()
    q = ((x - m.float()[..., None]) / s.float()[..., None]).round().clamp(0, 15)
    return QuantizedWeight("int4", pack_int4(q.reshape(n, k).to(torch.uint8)), s, m, group_size)


def q4_midpoint_for_constant_groups(w, group_size):
    """Code 8 (the middle of the grid) for a constant group: it dequantizes right, but the statement says 0."""
    qw = quantize_int4(w, group_size)
    n, k = w.shape
    codes = torch.cat([qw.qweight.view(n, k // 32, 16) & 15, qw.qweight.view(n, k // 32, 16) >> 4], -1).view(n, k)
    codes = codes.view(n, k // group_size, group_size)
    codes[qw.scales == 0] = 8
    return QuantizedWeight("int4", pack_int4(codes.reshape(n, k)), qw.scales, qw.mins, group_size)


def test_zero_rows_and_constant_groups_must_get_codes_0():
    """All-zero rows (int8) and constant groups (int4; drawn, of any value) have scale 0 and codes 0: a division
    by zero (or by an epsilon) must not leak into the codes."""
    rejected(check_lab08_1, q8_eps_for_zero_rows, "is all zeros: its scale is 0 and its codes must be 0")
    rejected(check_lab08_2, q4_divides_by_zero, "has all its weights equal to", "codes must be 0")
    rejected(check_lab08_2, q4_midpoint_for_constant_groups, "has all its weights equal to", "codes must be 0")


# ---------------------------------------------------------------- lab08_3 dequantize

def dequantize(qw, *, nibbles="gguf", mins=True, groups="interleave"):
    n, k = qw.shape
    if qw.kind == "int4":
        lo, hi = (qw.qweight & 15).long(), (qw.qweight >> 4).long()
        if nibbles == "pairs":
            q = torch.stack([lo, hi], -1).reshape(n, k)
        else:
            q = torch.cat([lo.view(n, -1, 16), hi.view(n, -1, 16)], 2).reshape(n, k)
    else:
        q = qw.qweight.long()
    g = qw.group_size
    idx = torch.arange(k) // g if groups == "interleave" else torch.arange(k) % (k // g)
    w = q.float() * qw.scales.float()[:, idx]
    if qw.mins is not None and mins:
        w = w + qw.mins.float()[:, idx]
    return w


def test_lab08_3_a_correct_learner_version_passes():
    check_lab08_3(lambda qw: dequantize(qw))


DEQ_WRONG = {
    "no minimums": (dict(mins=False), "the minimums are missing"),
    "neighbouring nibbles": (dict(nibbles="pairs"), "read as neighbours"),
    "scales tiled": (dict(groups="tile"), "k // group_size"),
}


@pytest.mark.parametrize("name", sorted(DEQ_WRONG))
def test_lab08_3_wrong_versions_fail_with_their_diagnosis(name):
    kw, needle = DEQ_WRONG[name]
    rejected(check_lab08_3, lambda qw: dequantize(qw, **kw), needle, "Hint")


def test_lab08_3_float64_is_refused():
    rejected(check_lab08_3, lambda qw: dequantize(qw).double(), "expected float32")


# ---------------------------------------------------------------- lab08_4 qlinear

def test_lab08_4_correct_learner_versions_pass():
    check_lab08_4(lambda x, qw: x @ dequantize(qw).to(x.dtype).T)
    check_lab08_4(lambda x, qw: F.linear(x.float(), dequantize(qw)).to(x.dtype))


QLINEAR_WRONG = {
    "float32 out for bf16 in": (lambda x, qw: x.float() @ dequantize(qw).T, "expected bfloat16"),
    "no minimums": (lambda x, qw: x @ dequantize(qw, mins=False).to(x.dtype).T, "the minimums are missing"),
    "flattened batch": (lambda x, qw: x.reshape(-1, x.shape[-1]) @ dequantize(qw).to(x.dtype).T,
                        "expected float32 of shape [2, 3, 3]"),
}


@pytest.mark.parametrize("name", sorted(QLINEAR_WRONG))
def test_lab08_4_wrong_versions_fail_with_their_diagnosis(name):
    fn, needle = QLINEAR_WRONG[name]
    rejected(check_lab08_4, fn, needle, "Hint")
