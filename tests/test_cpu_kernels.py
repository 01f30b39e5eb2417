"""The CPU PagedAttention decode kernels (C and numba builds) = dense attention, read through random block tables.

The backend test in test_attention_backends.py runs whichever build "auto" picks; here both builds are
checked directly, on shapes the engine's small test models never produce: head_dim 64/128, blocks longer
than the C kernel's 16-row chunk, scores large enough that the online softmax must rescale, and a query
that is a strided view (the engine's Q is a slice of the fused QK projection)."""
import pytest
import torch
from hypothesis import given, settings, strategies as st

from minillm.kernels import cpu_native
from minillm.kernels.cpu_paged_attention import check_tables, paged_attention_decode_cpu
from minillm.kernels.paged_attention_ref import paged_attention_decode_ref

IMPLS = ["c", "numba"]


def dense_decode(q, k_slots, v_slots, tables, lens, bs, scale):
    """The project's oracle (gather per sequence, softmax in fp32) on the pool's logical block view."""
    kvh, slots, d = k_slots.shape
    blocks = lambda x: x.view(kvh, slots // bs, bs, d).permute(1, 2, 0, 3)   # [num_blocks, bs, KVH, D]
    return paged_attention_decode_ref(q, blocks(k_slots), blocks(v_slots), tables, lens, scale)


@st.composite
def decode_batches(draw):
    kvh, group = draw(st.sampled_from([(1, 1), (2, 3), (3, 3), (1, 8), (4, 2)]))
    d = draw(st.sampled_from([8, 16, 24, 64, 128]))
    bs = draw(st.sampled_from([1, 4, 16, 48]))
    lens = draw(st.lists(st.integers(1, 150), min_size=1, max_size=6))
    return kvh, group, d, bs, lens, draw(st.sampled_from([0.1, 1.0, 30.0])), draw(st.integers(0, 2**16))


def make_batch(kvh, group, d, bs, lens, q_scale, seed, strided=False):
    g = torch.Generator().manual_seed(seed)
    width = max(-(-n // bs) for n in lens)
    num_blocks = len(lens) * width + 3
    k_slots = torch.randn(kvh, num_blocks * bs, d, generator=g)
    v_slots = torch.randn(kvh, num_blocks * bs, d, generator=g)
    tables = torch.randperm(num_blocks, generator=g)[:len(lens) * width].view(len(lens), width)
    q = torch.randn(len(lens), kvh * group + (kvh if strided else 0), d, generator=g) * q_scale
    if strided:
        q = q[:, :kvh * group]          # rows stride past the extra heads, like q inside the fused qk tensor
    return q, k_slots, v_slots, tables, torch.tensor(lens)


@pytest.mark.parametrize("impl", IMPLS)
@settings(max_examples=30, deadline=None, derandomize=True)
@given(b=decode_batches(), strided=st.booleans())
def test_kernel_equals_dense(impl, b, strided):
    if impl == "c" and cpu_native.load() is None:
        pytest.skip("no C compiler: the C kernel is not built here")
    q, k_slots, v_slots, tables, lens = make_batch(*b, strided=strided)
    bs, scale = b[3], b[2] ** -0.5
    out = paged_attention_decode_cpu(q, k_slots, v_slots, tables, lens, bs, scale, impl=impl)
    ref = dense_decode(q, k_slots, v_slots, tables, lens, bs, scale)
    torch.testing.assert_close(out, ref, atol=5e-5, rtol=1e-4)


@settings(max_examples=40, deadline=None, derandomize=True)
@given(shape=st.sampled_from([(3, 3, 64), (1, 8, 16), (2, 3, 24), (4, 2, 8)]), bs=st.sampled_from([1, 4, 16, 32]),
       context=st.integers(0, 90), rows=st.integers(2, 9), seed=st.integers(0, 2**16))
def test_rows_of_one_sequence_together_give_each_rows_own_bits(shape, bs, context, rows, seed):
    """A verification's k + 1 rows read one block table, each over its own length (context + 1 .. context + R), and
    the C kernel attends them together in pieces. Every row must get exactly the bits it gets alone: speculative
    greedy decoding equals plain greedy only while a guessed row scores its keys as the plain step scores them (a
    piece's shorter row once took its last partial chunk's tail keys through the four-key path: another order of
    additions, and chat at batch 16 parted from plain at a near-tie)."""
    if cpu_native.load() is None:
        pytest.skip("no C compiler: the C kernel is not built here")
    kvh, group, d = shape
    if rows > cpu_native.load().minillm_paged_decode_rows_max(group, d):
        rows = max(2, cpu_native.load().minillm_paged_decode_rows_max(group, d))
    g = torch.Generator().manual_seed(seed)
    lens = list(range(context + 1, context + rows + 1))
    width = -(-lens[-1] // bs)
    num_blocks = width + 2
    k_slots = torch.randn(kvh, num_blocks * bs, d, generator=g)
    v_slots = torch.randn(kvh, num_blocks * bs, d, generator=g)
    table = torch.randperm(num_blocks, generator=g)[:width]
    q = torch.randn(rows, kvh * group, d, generator=g)
    scale = d ** -0.5
    together = torch.empty_like(q)
    cpu_native.paged_decode(q, torch.arange(rows), k_slots, v_slots, table.expand(rows, -1), torch.tensor(lens), bs,
                            scale, together)
    for r in range(rows):
        alone = torch.empty(1, kvh * group, d)
        cpu_native.paged_decode(q[r:r + 1], torch.zeros(1, dtype=torch.long), k_slots, v_slots, table[None],
                                torch.tensor([lens[r]]), bs, scale, alone)
        assert torch.equal(together[r], alone[0]), (r, lens[r])


def test_auto_uses_c_where_it_applies_and_numba_elsewhere():
    if cpu_native.load() is None:
        pytest.skip("no C compiler")
    q, k_slots, v_slots, tables, lens = make_batch(2, 2, 12, 4, [5, 9], 1.0, 0)   # head_dim 12: not 8-aligned
    assert not cpu_native.supports(q, q, k_slots, v_slots)
    out = paged_attention_decode_cpu(q, k_slots, v_slots, tables, lens, 4, 0.3)   # numba path
    torch.testing.assert_close(out, dense_decode(q, k_slots, v_slots, tables, lens, 4, 0.3), atol=5e-5, rtol=1e-4)
    with pytest.raises(RuntimeError, match="head_dim % 8"):
        paged_attention_decode_cpu(q, k_slots, v_slots, tables, lens, 4, 0.3, impl="c")


def test_bad_tables_and_rows_are_rejected_before_the_kernel_runs():
    q, k_slots, v_slots, tables, lens = make_batch(2, 2, 16, 4, [5, 9], 1.0, 0)
    num_blocks = k_slots.shape[1] // 4
    for impl in IMPLS:
        bad = tables.clone()
        bad[1, 0] = num_blocks                        # one past the pool
        with pytest.raises(ValueError, match="index the pool"):
            paged_attention_decode_cpu(q, k_slots, v_slots, bad, lens, 4, 0.3, impl=impl)
        bad[1, 0] = -1
        with pytest.raises(ValueError, match="index the pool"):
            paged_attention_decode_cpu(q, k_slots, v_slots, bad, lens, 4, 0.3, impl=impl)
        with pytest.raises(ValueError, match="seq_lens must be"):
            paged_attention_decode_cpu(q, k_slots, v_slots, tables, torch.tensor([5, 999]), 4, 0.3, impl=impl)
        with pytest.raises(ValueError, match="rows must index"):
            paged_attention_decode_cpu(q, k_slots, v_slots, tables, lens, 4, 0.3, rows=torch.tensor([0, 2]),
                                       impl=impl)
        with pytest.raises(ValueError, match="one entry per sequence"):
            paged_attention_decode_cpu(q, k_slots, v_slots, tables[:1], lens, 4, 0.3, impl=impl)
    check_tables(tables, lens, 4, k_slots.shape[1])   # the good ones pass


def test_build_reports_a_missing_compiler(tmp_path):
    with pytest.raises(RuntimeError, match="no C compiler 'no-such-cc'"):
        cpu_native.build(compiler="no-such-cc", out_dir=tmp_path)


def test_build_is_cached_by_content(tmp_path):
    if cpu_native.load() is None:
        pytest.skip("no C compiler")
    first = cpu_native.build(out_dir=tmp_path)
    mtime = first.stat().st_mtime_ns
    assert cpu_native.build(out_dir=tmp_path) == first and first.stat().st_mtime_ns == mtime
    assert [p.name for p in tmp_path.iterdir()] == [first.name]        # no temporary files left behind


def test_env_switch_selects_numba(monkeypatch):
    monkeypatch.setenv("MINILLM_CPU_KERNEL", "numba")
    cpu_native.load.cache_clear()
    try:
        assert cpu_native.load() is None
        q, k_slots, v_slots, tables, lens = make_batch(1, 2, 16, 4, [7], 1.0, 1)
        assert not cpu_native.supports(q, q, k_slots, v_slots)
    finally:
        monkeypatch.delenv("MINILLM_CPU_KERNEL")
        cpu_native.load.cache_clear()
