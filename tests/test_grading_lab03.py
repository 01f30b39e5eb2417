"""lab03 checkers, graded both ways: minillm's own pieces (paged_attention_ref.gather_kv, its Triton kernel) pass
the property suites; handed in as answers they are refused, as are copies of them, the grader's references and
plausible wrong answers. Every kernel check runs the kernel in a child process (a torch + triton import, a few
seconds) and compiles it for sm80 meanwhile, so the kernels below are few and tiny."""
import functools
import importlib.util
import inspect
import os
import re
import sys
import textwrap

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from minillm.grading.lab03 import (TASKS, check_lab03_1, check_lab03_2, check_lab03_3, dense_decode_ref,  # noqa: E402
                                   launch_paged_attention, softmax_state_ref)
from minillm.kernels import paged_attention_ref  # noqa: E402
from grading_helpers import rejected  # noqa: E402
from minillm.kernels import triton_paged_attention as tpa  # noqa: E402
from minillm.kernels.paged_attention_ref import paged_attention_decode_ref  # noqa: E402
from minillm.testing import make_paged_case  # noqa: E402


# ---------------------------------------------------------------- lab03_1 gather through the block table

def test_lab03_1_minillm_passes():
    TASKS["lab03_1"].verify(paged_attention_ref.gather_kv)


def test_lab03_1_rejects_minillm_and_wrappers():
    rejected(check_lab03_1, paged_attention_ref.gather_kv, "itself")
    rejected(check_lab03_1, lambda c, t, n: paged_attention_ref.gather_kv(c, t, n), "runs minillm's own")
    rejected(check_lab03_1, functools.partial(paged_attention_ref.gather_kv), "itself")


def _gather(cache, table, n, *, trim=True, follow_table=True, divmod_swapped=False, as_float=False, ids=torch.long):
    """A learner's gather_kv, with knobs for the classic mistakes."""
    bs = cache.shape[1]
    table = torch.as_tensor(table).to(ids).long()
    if not follow_table:
        return cache.reshape(-1, *cache.shape[2:])[:n]
    if divmod_swapped:
        pos = torch.arange(n)
        return cache[table[(pos % bs).clamp(max=len(table) - 1)], (pos // bs).clamp(max=bs - 1)]
    rows = cache[table[:-(-n // bs)]].reshape(-1, *cache.shape[2:])
    rows = rows[:n] if trim else rows
    return rows.float() if as_float else rows


GATHER_WRONG = {
    "contiguous": (functools.partial(_gather, follow_table=False), "follow the block table"),
    "untrimmed": (functools.partial(_gather, trim=False), "partly filled"),
    "divmod_swapped": (functools.partial(_gather, divmod_swapped=True), "not the other way round"),
    "float32_for_fp16": (functools.partial(_gather, as_float=True), "torch.float32 for a torch.float16 cache"),
    "uint8_block_ids": (functools.partial(_gather, ids=torch.uint8), "above 255"),
}


@pytest.mark.parametrize("name", GATHER_WRONG)
def test_lab03_1_wrong_implementations_fail(name):
    fn, diagnosis = GATHER_WRONG[name]
    rejected(check_lab03_1, fn, diagnosis, "Smallest failing example")


def test_lab03_1_correct_learner_code_passes():
    check_lab03_1(functools.partial(_gather))

    def gather_kv(cache, block_table, seq_len):           # written differently: one position at a time
        bs = cache.shape[1]
        rows = [cache[int(block_table[p // bs]), p % bs] for p in range(seq_len)]
        return torch.stack(rows)
    check_lab03_1(gather_kv)


def test_lab03_1_blank_starter_fails():
    def gather_kv(cache, block_table, seq_len):
        raise NotImplementedError()
    rejected(check_lab03_1, gather_kv, "not implemented yet")


# ---------------------------------------------------------------- lab03_2 online softmax

def _online(m, l, acc, s, v, *, rescale_acc=True, rescale_l=True, subtract_max=True, running_max=True,
            zero_start=False, dtype=None):
    """A learner's online_softmax_update, with knobs for the classic mistakes."""
    if zero_start:                                       # "avoid -inf - -inf": the max then never goes below 0
        m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    m_new = torch.maximum(m, s.amax(-1)) if running_max else s.amax(-1)
    alpha = torch.exp(m - m_new)
    p = torch.exp(s - m_new[:, None]) if subtract_max else torch.exp(s)
    l_new = (l * alpha if rescale_l else l) + p.sum(-1)
    acc_new = (acc * alpha[:, None] if rescale_acc else acc) + p @ v
    out = m_new, l_new, acc_new
    return tuple(x.to(dtype) for x in out) if dtype is not None else out


def test_lab03_2_learner_update_passes_verify_and_check():
    TASKS["lab03_2"].verify(_online)
    check_lab03_2(functools.partial(_online))

    def online_softmax_update(m, l, acc, scores, values):    # written differently
        m_new = torch.cat([m[:, None], scores], dim=1).max(dim=1).values
        old = (m - m_new).exp()
        w = (scores - m_new[:, None]).exp()
        return m_new, old * l + w.sum(dim=1), old[:, None] * acc + w @ values
    check_lab03_2(online_softmax_update)


def test_lab03_2_rejects_the_reference():
    rejected(check_lab03_2, softmax_state_ref, "itself")


SOFTMAX_WRONG = {
    "no_acc_rescale": (functools.partial(_online, rescale_acc=False), "rescale the accumulator"),
    "no_l_rescale": (functools.partial(_online, rescale_l=False), "rescale the running sum"),
    "no_max_subtraction": (functools.partial(_online, subtract_max=False), "subtract the running max"),
    "block_max": (functools.partial(_online, running_max=False), "running max over ALL blocks"),
    "zero_start": (functools.partial(_online, zero_start=True), "m starts at -inf, not 0"),
    "float64_state": (functools.partial(_online, dtype=torch.float64), "expected torch.float32 (the inputs' dtype)"),
}


@pytest.mark.parametrize("name", SOFTMAX_WRONG)
def test_lab03_2_wrong_implementations_fail(name):
    fn, diagnosis = SOFTMAX_WRONG[name]
    rejected(check_lab03_2, fn, diagnosis, "Smallest failing example", "Hint")


def test_lab03_2_blank_starter_fails():
    def online_softmax_update(m, l, acc, scores, values):
        raise NotImplementedError()
    rejected(check_lab03_2, online_softmax_update, "not implemented yet")


# ---------------------------------------------------------------- lab03_3 the Triton kernel

def good_kernel(
    out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, scale,
    stride_qs, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
    stride_bt, stride_os, stride_oh,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + seq)
    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, D_PAD)
    offs_t = tl.arange(0, BLOCK_SIZE)
    g_ok = offs_g < GROUP
    d_ok = offs_d < HEAD_DIM
    heads = kv_head * GROUP + offs_g
    q = tl.load(q_ptr + seq * stride_qs + heads[:, None] * stride_qh + offs_d[None, :],
                mask=g_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
    m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, D_PAD], tl.float32)
    for b in range(0, tl.cdiv(seq_len, BLOCK_SIZE)):
        phys = tl.load(block_tables_ptr + seq * stride_bt + b).to(tl.int64)
        t_ok = offs_t < seq_len - b * BLOCK_SIZE
        td_ok = t_ok[:, None] & d_ok[None, :]
        k = tl.load(k_cache_ptr + phys * stride_kb + offs_t[:, None] * stride_kt + kv_head * stride_kh
                    + offs_d[None, :], mask=td_ok, other=0.0).to(tl.float32)
        v = tl.load(v_cache_ptr + phys * stride_vb + offs_t[:, None] * stride_vt + kv_head * stride_vh
                    + offs_d[None, :], mask=td_ok, other=0.0).to(tl.float32)
        s = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale
        s = tl.where(t_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        m = m_new
    out = acc / l[:, None]
    tl.store(out_ptr + seq * stride_os + heads[:, None] * stride_oh + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=g_ok[:, None] & d_ok[None, :])


GOOD_SRC = inspect.getsource(good_kernel)
MINILLM_HELPERS = "_sum_combine = tl.standard._sum_combine\n_max_combine = tl.standard._elementwise_max\n"


def kernel_from_source(src, tmp_path, name="good_kernel", header=""):
    """A @triton.jit kernel from source text (the interpreter needs the source in a real file)."""
    path = tmp_path / f"kernel_{abs(hash(src + header)) % 10**8}.py"
    path.write_text("import triton\nimport triton.language as tl\n" + header + "\n" + textwrap.dedent(src)
                    + f"\n{name} = triton.jit({name})\n")
    spec = importlib.util.spec_from_file_location(path.stem, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = mod
    spec.loader.exec_module(mod)
    return getattr(mod, name)


def variant(tmp_path, *edits):
    src = GOOD_SRC
    for old, new in edits:
        assert src.count(old) >= 1, old
        src = src.replace(old, new)
    return kernel_from_source(src, tmp_path)


@pytest.mark.slow    # ~4-7 s: the quick subset stays under 3 minutes
def test_minillm_kernel_passes_verify():
    """minillm's own kernel passes the property (shipped to the child as source) and compiles for sm80."""
    TASKS["lab03_3"].verify(tpa.paged_attention_decode_kernel)


@pytest.mark.slow      # seconds: the checker's full run on correct code; the wrong answers stay fast
def test_lab03_3_learner_kernel_passes_and_compiles(tmp_path):
    kernel = kernel_from_source(GOOD_SRC, tmp_path)
    check_lab03_3(kernel)                      # interpreter property (child process) + AOT compile for sm80
    ptx = tpa.compile_for_gpu_target(80, "fp16", head_dim=64, block_size=16, group=3, kernel=kernel)
    assert ".target sm_80" in ptx and ".entry good_kernel(" in ptx


def test_lab03_3_rejects_minillm_kernel_itself_and_non_kernels(tmp_path):
    rejected(check_lab03_3, tpa.paged_attention_decode_kernel, "itself")
    rejected(check_lab03_3, triton.jit(tpa.paged_attention_decode_kernel.fn), "itself")
    rejected(check_lab03_3, tpa.paged_attention_decode_triton, "itself")
    rejected(check_lab03_3, paged_attention_decode_ref, "minillm's own code")
    rejected(check_lab03_3, lambda *a: 0, "@triton.jit kernel itself")
    rejected(check_lab03_3, good_kernel, "@triton.jit kernel itself")
    compiled = triton.runtime.jit.JITFunction(kernel_from_source(GOOD_SRC, tmp_path).fn)
    rejected(check_lab03_3, compiled, "compiled for a GPU", "TRITON_INTERPRET")


def test_lab03_3_rejects_a_kernel_that_calls_minillms(tmp_path):
    """The kernel runs in a child process: the tracer that watches for minillm's code runs there too."""
    src = GOOD_SRC.split("    seq = tl.program_id(0)")[0] + textwrap.indent(textwrap.dedent("""\
        tpa.paged_attention_decode_kernel(out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr,
                                          scale, stride_qs, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb,
                                          stride_vt, stride_vh, stride_bt, stride_os, stride_oh, GROUP, GROUP_PAD,
                                          HEAD_DIM, D_PAD, BLOCK_SIZE)
        """), "    ")
    kernel = kernel_from_source(src, tmp_path, header="import minillm.kernels.triton_paged_attention as tpa\n")
    rejected(check_lab03_3, kernel, "runs minillm's own implementation", "paged_attention_decode_kernel")


@pytest.mark.slow      # the checker's full run on code that is correct
def test_lab03_3_code_like_minillms_is_graded_by_its_behaviour(tmp_path):
    """A kernel whose code is minillm's (verbatim, renamed, or inside a helper) is not failed for its form: the
    properties decide (the instructor gets a note for a long verbatim copy)."""
    copy = kernel_from_source(inspect.getsource(tpa.paged_attention_decode_kernel.fn), tmp_path, tpa.KERNEL_NAME,
                              MINILLM_HELPERS)
    check_lab03_3(copy)
    renamed = re.sub(r"\bm_i\b", "running_max", inspect.getsource(tpa.paged_attention_decode_kernel.fn)).replace(
        "def paged_attention_decode_kernel(", "def my_kernel(")
    check_lab03_3(kernel_from_source(renamed, tmp_path, "my_kernel", MINILLM_HELPERS))
    helper = "@triton.jit\n" + textwrap.dedent(inspect.getsource(tpa.paged_attention_decode_kernel.fn)).replace(
        "def paged_attention_decode_kernel(", "def helper(")
    src = GOOD_SRC.split("    seq = tl.program_id(0)")[0] + (
        "    helper(out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, scale, stride_qs,\n"
        "           stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, stride_bt,\n"
        "           stride_os, stride_oh, GROUP, GROUP_PAD, HEAD_DIM, D_PAD, BLOCK_SIZE)\n")
    kernel = kernel_from_source(src, tmp_path, header=MINILLM_HELPERS + helper)
    check_lab03_3(kernel)


def test_launcher_and_reference_agree_with_minillm():
    """The checker's launcher + float64 dense reference agree with minillm's kernel and torch reference."""
    c = make_paged_case([7, 16, 2], 6, 2, 8, 4, seed=1)
    ref = dense_decode_ref(c.q, c.dense_k, c.dense_v, c.scale)
    ours = launch_paged_attention(tpa.paged_attention_decode_kernel, c.q, c.k_cache, c.v_cache, c.block_tables,
                                  c.seq_lens, c.scale)
    torch.testing.assert_close(ours.double(), ref, atol=1e-5, rtol=1e-5)
    c2 = make_paged_case([7, 16, 2], 6, 2, 8, 4, seed=1, poison=0.0)
    torch.testing.assert_close(paged_attention_decode_ref(c2.q, c2.k_cache, c2.v_cache, c2.block_tables, c2.seq_lens,
                                                          c2.scale).double(), ref, atol=1e-5, rtol=1e-5)


KERNEL_WRONG = {
    # query head h -> kv head h % KVH instead of h // GROUP
    "gqa_modulo": ([("heads = kv_head * GROUP + offs_g", "heads = offs_g * tl.num_programs(1) + kv_head")],
                   "h % KVH"),
    # the last block's tail is loaded without the token mask: reads the NaN-poisoned slots
    "unmasked_tail": ([("mask=td_ok, other=0.0", "mask=d_ok[None, :], other=0.0")], "mask the K/V loads"),
    # the accumulator is not rescaled when the running max grows
    "no_alpha_rescale": ([("acc = acc * alpha[:, None] +", "acc = acc +")], "rescale the accumulator"),
    # block ids read from the flattened table at seq + b (stride of the table forgotten)
    "wrong_table_row": ([("block_tables_ptr + seq * stride_bt + b", "block_tables_ptr + seq + b")],
                        "this sequence's row"),
    # masked loads, but the masked tokens keep score 0 and take part in the softmax
    "scores_not_masked": ([('s = tl.where(t_ok[None, :], s, float("-inf"))', "s = s")], "score -inf"),
    # the running max starts at 0: rows whose scores are all very negative come out 0 / 0
    "max_starts_at_zero": ([('m = tl.full([GROUP_PAD], float("-inf"), tl.float32)',
                             "m = tl.zeros([GROUP_PAD], tl.float32)")], "must start at -inf"),
    # the store is not masked: the padding rows of group 3 (padded to 4) land past the end of out
    "unmasked_store": ([("out.to(out_ptr.dtype.element_ty), mask=g_ok[:, None] & d_ok[None, :])",
                         "out.to(out_ptr.dtype.element_ty))")], "elements outside out"),
    # V loaded with K's strides: right while both caches share one layout
    "v_with_k_strides": ([("phys * stride_vb + offs_t[:, None] * stride_vt + kv_head * stride_vh",
                           "phys * stride_kb + offs_t[:, None] * stride_kt + kv_head * stride_kh")],
                         "load V with V's strides"),
    # the int32 block id times the block stride in int32: overflows once a block sits past 2**31 elements
    "int32_block_offsets": ([(".to(tl.int64)", "")], "overflows int32"),
}


@pytest.mark.slow          # each runs the interpreter in a child process (~5 s)
@pytest.mark.parametrize("name", KERNEL_WRONG)
def test_lab03_3_wrong_kernels_fail(name, tmp_path):
    edits, diagnosis = KERNEL_WRONG[name]
    rejected(check_lab03_3, variant(tmp_path, *edits), diagnosis, "Hint")


def test_lab03_3_a_crashing_kernel_gets_a_verdict(tmp_path):
    """A store a terabyte past out segfaults the interpreter: the child dies, the checker still answers."""
    kernel = variant(tmp_path, ("tl.store(out_ptr + seq * stride_os", "tl.store(out_ptr + (1 << 40) + seq * stride_os"))
    rejected(check_lab03_3, kernel, "crashed the Triton interpreter (signal", "mask every load and store",
             "seq_lens=")


def test_lab03_3_blank_starter_and_unreadable_source(tmp_path):
    starter = GOOD_SRC.split("    seq = tl.program_id(0)")[0] + "    raise NotImplementedError()\n"
    rejected(check_lab03_3, kernel_from_source(starter, tmp_path), "not implemented yet")
    namespace = {"tl": tl}
    exec(GOOD_SRC, namespace)                  # no file behind it: its source cannot be shipped to the child
    rejected(check_lab03_3, triton.jit(namespace["good_kernel"]), "could not read your kernel's source")


@pytest.mark.slow      # seconds: the checker's full run on correct code; the wrong answers stay fast
def test_lab03_3_interpreter_only_kernel_fails_the_gpu_compile(tmp_path):
    """int() on a tensor works in the interpreter (plain Python on numpy values) but not in compiled Triton."""
    kernel = variant(tmp_path, ("for b in range(0, tl.cdiv(seq_len, BLOCK_SIZE)):",
                                "for b in range(0, int(tl.cdiv(seq_len, BLOCK_SIZE))):"))
    rejected(check_lab03_3, kernel, "does not compile for a real GPU", "int(tl.cdiv(seq_len, BLOCK_SIZE))", "Hint")
