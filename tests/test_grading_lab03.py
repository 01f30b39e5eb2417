"""lab03 checkers, graded both ways: minillm's own pieces pass (wrapped), the very objects and plausible wrong
implementations fail. The wrong kernels run in Triton's interpreter too, so they are kept few and tiny."""
import functools
import importlib.util
import inspect
import os
import sys
import textwrap

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from minillm.grading import lab03  # noqa: E402
from minillm.grading.lab03 import (check_lab03_1, check_lab03_2, check_lab03_3, dense_decode_ref,  # noqa: E402
                                   gather_kv_ref, launch_paged_attention, make_paged_case, online_softmax_ref)
from minillm.kernels import triton_paged_attention as tpa  # noqa: E402
from minillm.kernels.paged_attention_ref import paged_attention_decode_ref  # noqa: E402


def rejected(checker, fn, *needles):
    with pytest.raises(AssertionError) as e:
        checker(fn)
    msg = str(e.value)
    for needle in needles:
        assert needle in msg, msg
    assert len(msg.splitlines()) < 12, msg
    return msg


# ---------------------------------------------------------------- lab03_1 gather through the block table

def test_lab03_1_minillm_gather_passes():
    """The engine's own read path (AttentionMetadata.context_slots over the physical layout), wrapped."""
    from minillm.layers.attention import AttentionMetadata

    def via_engine(cache, table, n):
        nb, bs, kvh, d = cache.shape
        table = torch.as_tensor(table, dtype=torch.int64)[None]
        meta = AttentionMetadata(query_lens=[1], seq_lens=[n], slot_mapping=torch.zeros(1, dtype=torch.int64),
                                 block_tables=table, block_size=bs)
        return cache.reshape(nb * bs, kvh, d)[meta.context_slots(0)]
    check_lab03_1(via_engine)


def test_lab03_1_rejects_the_references_themselves():
    from minillm.layers.attention import AttentionMetadata
    rejected(check_lab03_1, gather_kv_ref, "minillm's own implementation")
    rejected(check_lab03_1, AttentionMetadata.context_slots, "minillm's own implementation")


def _gather(cache, table, n, *, trim=True, follow_table=True, divmod_swapped=False, view=False):
    bs = cache.shape[1]
    table = torch.as_tensor(table, dtype=torch.long)
    if not follow_table:
        return cache.reshape(-1, *cache.shape[2:])[:n]
    if divmod_swapped:
        pos = torch.arange(n)
        return cache[table[(pos % bs).clamp(max=len(table) - 1)], (pos // bs).clamp(max=bs - 1)]
    blocks = cache[table[:-(-n // bs)]]
    rows = blocks.view(-1, *cache.shape[2:]) if view else blocks.reshape(-1, *cache.shape[2:])
    return rows[:n] if trim else rows


GATHER_WRONG = {
    "contiguous": (functools.partial(_gather, follow_table=False), "follow the block table"),
    "untrimmed": (functools.partial(_gather, trim=False), "partly filled"),
    "divmod_swapped": (functools.partial(_gather, divmod_swapped=True), "not the other way round"),
}


@pytest.mark.parametrize("name", GATHER_WRONG)
def test_lab03_1_wrong_implementations_fail(name):
    fn, diagnosis = GATHER_WRONG[name]
    rejected(check_lab03_1, fn, diagnosis, "Smallest failing example", "Hint")


def test_lab03_1_correct_learner_code_passes():
    check_lab03_1(functools.partial(_gather))


# ---------------------------------------------------------------- lab03_2 online softmax

def test_lab03_2_reference_passes_wrapped_and_is_rejected_itself():
    check_lab03_2(lambda *a: online_softmax_ref(*a))
    rejected(check_lab03_2, online_softmax_ref, "minillm's own implementation")


def _online(m, l, acc, s, v, *, rescale_acc=True, rescale_l=True, subtract_max=True, running_max=True):
    m_new = torch.maximum(m, s.amax(-1)) if running_max else s.amax(-1)
    alpha = torch.exp(m - m_new)
    p = torch.exp(s - m_new[:, None]) if subtract_max else torch.exp(s)
    l_new = (l * alpha if rescale_l else l) + p.sum(-1)
    acc_new = (acc * alpha[:, None] if rescale_acc else acc) + p @ v
    return m_new, l_new, acc_new


SOFTMAX_WRONG = {
    "no_acc_rescale": (functools.partial(_online, rescale_acc=False), "rescale the accumulator"),
    "no_l_rescale": (functools.partial(_online, rescale_l=False), "rescale the running sum"),
    "no_max_subtraction": (functools.partial(_online, subtract_max=False), "subtract the running max"),
    "block_max": (functools.partial(_online, running_max=False), "running max over ALL blocks"),
}


@pytest.mark.parametrize("name", SOFTMAX_WRONG)
def test_lab03_2_wrong_implementations_fail(name):
    fn, diagnosis = SOFTMAX_WRONG[name]
    rejected(check_lab03_2, fn, diagnosis, "Smallest failing example", "Hint")


def test_lab03_2_correct_learner_code_passes():
    check_lab03_2(functools.partial(_online))


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


def kernel_from_source(src, tmp_path, name="good_kernel", header=""):
    """A @triton.jit kernel from source text (the interpreter needs the source in a real file)."""
    path = tmp_path / f"kernel_{abs(hash(src)) % 10**8}.py"
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


def test_lab03_3_learner_kernel_passes_and_compiles(tmp_path):
    kernel = kernel_from_source(GOOD_SRC, tmp_path)
    check_lab03_3(kernel)                      # interpreter property + AOT compile for sm80
    asm = lab03.compile_kernel_for_gpu(kernel, arch=80)   # cached: same source, same job
    assert ".target sm_80" in asm["ptx"] and ".entry good_kernel(" in asm["ptx"] and asm["cubin_bytes"] > 0


def test_lab03_3_minillm_kernel_passes_wrapped(tmp_path):
    """minillm's own kernel, as source in a module of its own (a copy, not the object): passes."""
    header = ("_sum_combine = tl.standard._sum_combine\n"
              "_max_combine = tl.standard._elementwise_max\n")
    kernel = kernel_from_source(inspect.getsource(tpa._KERNEL_PY_FN), tmp_path, tpa.KERNEL_NAME, header)
    check_lab03_3(kernel)


def test_lab03_3_rejects_minillm_kernel_and_non_kernels():
    rejected(check_lab03_3, tpa.paged_attention_decode_kernel, "minillm's own implementation")
    rejected(check_lab03_3, triton.jit(tpa._KERNEL_PY_FN), "minillm's own implementation")
    rejected(check_lab03_3, tpa.paged_attention_decode_triton, "@triton.jit kernel itself")
    rejected(check_lab03_3, paged_attention_decode_ref, "@triton.jit kernel itself")


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
}


@pytest.mark.parametrize("name", KERNEL_WRONG)
def test_lab03_3_wrong_kernels_fail(name, tmp_path):
    edits, diagnosis = KERNEL_WRONG[name]
    rejected(check_lab03_3, variant(tmp_path, *edits), diagnosis, "Smallest failing example", "Hint")


def test_lab03_3_interpreter_only_kernel_fails_the_gpu_compile(tmp_path):
    """int() on a tensor works in the interpreter (plain Python on numpy values) but not in compiled Triton."""
    kernel = variant(tmp_path, ("for b in range(0, tl.cdiv(seq_len, BLOCK_SIZE)):",
                                "for b in range(0, int(tl.cdiv(seq_len, BLOCK_SIZE))):"))
    rejected(check_lab03_3, kernel, "does not compile for a real GPU", "int(tl.cdiv(seq_len, BLOCK_SIZE))", "Hint")
