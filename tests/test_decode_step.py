"""The fused C decode step (kernels/cpu_decode.py, csrc/decode_step.c) against the layers it replaces.

The oracle is the model's own layer-by-layer forward (MINILLM_DECODE_STEP=layers), which tests/test_quant.py and the
parity tests pin to the dequantized model and to transformers. Both paths run the same matmul and attention kernels
— the C kernel's tiles (qgemm.c; each weight block widened once for all rows) at any number of rows — so what may
differ is float rounding in RMSNorm, RoPE and SiLU, and what that rounding does downstream: each matmul quantizes its
input (to int16 codes per block of 32), so a last-bit difference can move a code by one step at the next layer.
Hidden states and the KV slots it writes are held within TOL of their largest value (measured over 150 random cases
like the ones below: at most 1.5e-4). A step rotated for the wrong position is shown to be far outside.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from minillm import config
from minillm.kernels import cpu_decode, cpu_native, cpu_qgemm
from minillm.kv.cache import KVCache
from minillm.layers.attention import AttentionMetadata, CpuAttentionBackend, TorchAttentionBackend
from minillm.models.llama import ForwardContext
from minillm.quant.formats import QuantizedWeight, QuantSpec, quantize
from minillm.testing import random_model
from minillm.worker.model_runner import FUSED_MAX_QUERY, fused_decode
from tests.test_engine import run_engine

pytestmark = pytest.mark.skipif(cpu_decode.load() is None or cpu_native.load() is None, reason="needs a C compiler")

TOL = 1e-3
SPECS = {"int4": (QuantSpec("int4", 32), QuantSpec("int8")), "int8": (QuantSpec("int8"), None),
         "int4g64": (QuantSpec("int4", 64), QuantSpec("int8", 32))}


def _model(seed: int, kv_heads: int = 2, spec: str = "int4", layers: int = 2):
    lin, head = SPECS[spec]
    return random_model(seed, heads=4, kv_heads=kv_heads, head_dim=16, layers=layers, vocab=128).quantize_(lin, head)


def _paged(model, contexts: list[int], block_size: int, seed: int, new: list[int] | None = None):
    """A pool holding each sequence's context (prefilled by the layers) in scattered blocks; the step's inputs (one
    new token per sequence, or new[i]: a verification's k + 1) and its metadata."""
    g = torch.Generator().manual_seed(seed)
    new = new or [1] * len(contexts)
    need = [(c + n + block_size - 1) // block_size for c, n in zip(contexts, new)]
    perm = torch.randperm(sum(need) + 3, generator=g).tolist()
    tables, at = [], 0
    for n in need:
        tables.append(perm[at:at + n])
        at += n
    cache = KVCache(model.kv_cfg, sum(need) + 3, block_size)

    def meta(seqs, starts, lens):
        slots = [tables[i][p // block_size] * block_size + p % block_size
                 for i, s, n in zip(seqs, starts, lens) for p in range(s, s + n)]
        width = max(len(tables[i]) for i in seqs)
        return AttentionMetadata(list(lens), [s + n for s, n in zip(starts, lens)], torch.tensor(slots),
                                 torch.tensor([tables[i] + [0] * (width - len(tables[i])) for i in seqs]), block_size)

    ids = [torch.randint(0, 128, (c + n,), generator=g) for c, n in zip(contexts, new)]
    pre = [i for i, c in enumerate(contexts) if c]
    if pre:   # prefill the contexts through the layers
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("MINILLM_DECODE_STEP", "layers")
            model(torch.cat([ids[i][:contexts[i]] for i in pre]), torch.cat([torch.arange(contexts[i]) for i in pre]),
                  ForwardContext(meta(pre, [0] * len(pre), [contexts[i] for i in pre]), cache, CpuAttentionBackend()))
    step_ids = torch.cat([x[c:] for x, c in zip(ids, contexts)])
    positions = torch.cat([torch.arange(c, c + n) for c, n in zip(contexts, new)])
    return cache, step_ids, positions, meta(range(len(contexts)), contexts, new)


def _layers(model, ids, positions, meta, cache, monkeypatch):
    monkeypatch.setenv("MINILLM_DECODE_STEP", "layers")
    try:
        return model(ids, positions, ForwardContext(meta, cache, CpuAttentionBackend()))
    finally:
        monkeypatch.delenv("MINILLM_DECODE_STEP")


def _twin(cache: KVCache) -> KVCache:
    twin = KVCache.__new__(KVCache)
    twin.__dict__.update(cache.__dict__)
    twin.k, twin.v = cache.k.clone(), cache.v.clone()
    return twin


def _assert_step_matches_layers(model, cache, ids, positions, meta, monkeypatch):
    twin = _twin(cache)
    want = _layers(model, ids, positions, meta, twin, monkeypatch)
    got = fused_decode(model, ids, positions, ForwardContext(meta, cache, CpuAttentionBackend()))
    assert got is not None, "the fused step declined a step it should take"
    tol = TOL
    assert got.shape == want.shape and got.dtype == torch.float32
    assert float((got - want).abs().max()) <= tol * float(want.abs().max())
    for mine, theirs in ((cache.k, twin.k), (cache.v, twin.v)):
        assert float((mine - theirs).abs().max()) <= tol * float(theirs.abs().max())
    return got, want


@settings(max_examples=30, deadline=None)
@given(contexts=st.lists(st.integers(0, 40), min_size=1, max_size=12), block_size=st.sampled_from([4, 8, 16]),
       kv_heads=st.sampled_from([1, 2, 4]), spec=st.sampled_from(sorted(SPECS)), seed=st.integers(0, 2**16))
@example(contexts=[0], block_size=16, kv_heads=2, spec="int4", seed=0)          # a one-token prompt's first step
@example(contexts=[31, 0, 7, 16], block_size=8, kv_heads=1, spec="int8", seed=1)  # block edges, MQA
@example(contexts=[40, 39, 1, 2, 3, 4], block_size=4, kv_heads=4, spec="int4g64", seed=2)
@example(contexts=[0, 5, 9], block_size=8, kv_heads=2, spec="int4", seed=3)     # 3 rows: a pass of 3 (or 4 - 1)
@example(contexts=[40, 1, 2, 3, 4, 5, 6, 33, 17, 8, 0], block_size=16, kv_heads=1, spec="int8", seed=4)
def test_fused_step_equals_the_layers(contexts, block_size, kv_heads, spec, seed):
    with pytest.MonkeyPatch.context() as mp:
        model = _model(seed % 7, kv_heads, spec)
        cache, ids, pos, meta = _paged(model, contexts, block_size, seed)
        _assert_step_matches_layers(model, cache, ids, pos, meta, mp)


@pytest.mark.parametrize("contexts", [[5, 9], [5, 9, 3, 12, 7]], ids=["2 rows", "5 rows"])
def test_a_step_rotated_for_the_wrong_position_is_far_outside_the_tolerance(contexts, monkeypatch):
    model = _model(3)
    cache, ids, pos, meta = _paged(model, contexts, 8, 0)
    got, _ = _assert_step_matches_layers(model, cache, ids, pos, meta, monkeypatch)
    cache2, ids2, pos2, meta2 = _paged(model, contexts, 8, 0)
    wrong = _layers(model, ids2, pos2 + 1, meta2, cache2, monkeypatch)
    assert float((got - wrong).abs().max()) > 10 * TOL * float(got.abs().max())


def test_a_swapped_weight_is_used_at_the_next_step(monkeypatch):
    """The C view of the layers is cached; replacing a layer's quantized matrix must rebuild it."""
    model = _model(4)
    cache, ids, pos, meta = _paged(model, [6], 8, 1)
    _assert_step_matches_layers(model, _twin(cache), ids, pos, meta, monkeypatch)
    down = model.layers[1].mlp.down_proj
    down.set_quantized(quantize(torch.randn(down.quant.shape), QuantSpec("int8")))
    got, want = _assert_step_matches_layers(model, cache, ids, pos, meta, monkeypatch)


@settings(max_examples=25, deadline=None)
@given(seqs=st.lists(st.tuples(st.integers(0, 40), st.integers(1, FUSED_MAX_QUERY)), min_size=1, max_size=6),
       block_size=st.sampled_from([4, 8, 16]), kv_heads=st.sampled_from([1, 2, 4]), spec=st.sampled_from(sorted(SPECS)),
       seed=st.integers(0, 2**16))
@example(seqs=[(12, 5)], block_size=4, kv_heads=2, spec="int4", seed=0)         # batch 1 verifying 4 guesses: tiles
@example(seqs=[(7, 2)], block_size=8, kv_heads=1, spec="int8", seed=1)          # 2 rows of one sequence: C kernel
@example(seqs=[(3, 1), (30, 9), (0, 1), (15, 4)], block_size=4, kv_heads=4, spec="int4", seed=2)
@example(seqs=[(70, 9), (1, 1), (45, 3)], block_size=32, kv_heads=2, spec="int4", seed=3)    # chunks inside blocks
def test_verification_rows_of_one_sequence_equal_the_layers(seqs, block_size, kv_heads, spec, seed):
    """A speculative step's k + 1 tokens of a sequence are rows of the fused step too, each attending over the
    context and the rows before it (keys stored by other tasks: all are stored before any row attends). Equal to
    the layers' causal attention over the same pool within the step's tolerance, keys and values included."""
    with pytest.MonkeyPatch.context() as mp:
        model = _model(seed % 7, kv_heads, spec)
        contexts, new = [c for c, _ in seqs], [n for _, n in seqs]
        cache, ids, pos, meta = _paged(model, contexts, block_size, seed, new)
        _assert_step_matches_layers(model, cache, ids, pos, meta, mp)


def test_a_row_that_attends_before_the_rows_ahead_of_it_are_stored_is_caught(monkeypatch):
    """The property above fails when the step treats one sequence's rows as separate sequences that each see only
    the context (its last row then misses the keys of the rows before it)."""
    model = _model(3)
    cache, ids, pos, meta = _paged(model, [9], 8, 3, [5])
    wrong = AttentionMetadata([1] * 5, [10] * 5, meta.slot_mapping, meta.block_tables.repeat(5, 1), 8)
    got = fused_decode(model, ids, pos, ForwardContext(wrong, _twin(cache), CpuAttentionBackend()))
    want = _layers(model, ids, pos, meta, _twin(cache), monkeypatch)
    assert float((got - want)[1:].abs().max()) > 10 * TOL * float(want.abs().max())


def _declines(model, cache, ids, pos, meta, backend=None) -> bool:
    ctx = ForwardContext(meta, cache, backend or CpuAttentionBackend())
    return fused_decode(model, ids, pos, ctx) is None


def test_where_the_fused_step_does_not_apply_it_declines(monkeypatch):
    model = _model(5)
    cache, ids, pos, meta = _paged(model, [3, 4], 8, 2)
    assert not _declines(model, _twin(cache), ids, pos, meta)
    assert _declines(model, cache, ids, pos, meta, TorchAttentionBackend())
    assert _declines(model, cache, ids, pos, meta, CpuAttentionBackend.__new__(type("Mine", (CpuAttentionBackend,), {})))
    monkeypatch.setenv("MINILLM_DECODE_STEP", "layers")
    assert _declines(model, cache, ids, pos, meta)
    monkeypatch.delenv("MINILLM_DECODE_STEP")
    for qgemm in ("torch", "scalar"):       # the layers would run another matmul than the step's
        monkeypatch.setenv("MINILLM_QGEMM", qgemm)
        assert _declines(model, cache, ids, pos, meta)
    monkeypatch.delenv("MINILLM_QGEMM")
    batch = _paged(model, [3, 4, 5], 8, 2)           # rows for the tiles, whatever the batched path: the layers'
    assert not _declines(model, _twin(batch[0]), *batch[1:])    # qlinear runs the tiles up to TILES_MAX_ROWS too
    monkeypatch.setenv("MINILLM_QGEMM_BATCHED", "fp16")
    assert not _declines(model, _twin(batch[0]), *batch[1:])
    monkeypatch.delenv("MINILLM_QGEMM_BATCHED")
    monkeypatch.setenv("MINILLM_DECODE_STEP", "fast")
    with pytest.raises(ValueError, match="MINILLM_DECODE_STEP"):
        _declines(model, cache, ids, pos, meta)
    monkeypatch.delenv("MINILLM_DECODE_STEP")
    float_model = random_model(5, heads=4, kv_heads=2, head_dim=16, layers=2, vocab=128)
    assert _declines(float_model, cache, ids, pos, meta)
    w8a8 = random_model(5, heads=4, kv_heads=2, head_dim=16, layers=2, vocab=128).quantize_(
        QuantSpec("int8", act="int8"), None)
    assert _declines(w8a8, cache, ids, pos, meta)
    n = FUSED_MAX_QUERY + 1                            # a longer prompt chunk is prefill: the layers run it
    prefill = AttentionMetadata([n, 1], [n, 5], torch.arange(n + 1), meta.block_tables, 8)
    assert _declines(model, cache, torch.arange(n + 1), torch.cat([torch.arange(n), torch.tensor([4])]), prefill)


def test_a_hooked_or_swapped_module_runs_its_own_code(monkeypatch):
    """A lab that hooks or replaces a module must see it run: the step falls back to the layers."""
    model = _model(6)
    cache, ids, pos, meta = _paged(model, [3], 8, 3)
    calls = []
    handle = model.layers[1].mlp.register_forward_hook(lambda *a: calls.append(1))
    assert _declines(model, cache, ids, pos, meta)
    model(ids, pos, ForwardContext(meta, cache, CpuAttentionBackend()))
    assert calls == [1]
    handle.remove()
    assert not _declines(model, _twin(cache), ids, pos, meta)
    mlp = model.layers[0].mlp
    model.layers[0].mlp = type("MyMLP", (type(mlp),), {})(model.cfg)
    model.layers[0].mlp.load_state_dict(mlp.state_dict(), strict=False)
    assert _declines(model, cache, ids, pos, meta)


def test_a_slot_outside_the_pool_is_refused_before_anything_is_written():
    model = _model(7)
    cache, ids, pos, meta = _paged(model, [3], 8, 4)
    before = cache.k.clone()
    bad = AttentionMetadata([1], [4], torch.tensor([cache.k.shape[2]]), meta.block_tables, 8)
    with pytest.raises(IndexError, match="slot_mapping"):
        fused_decode(model, ids, pos, ForwardContext(bad, cache, CpuAttentionBackend()))
    assert torch.equal(cache.k, before)


@pytest.mark.parametrize("contexts", [[3, 8, 1, 5], [3]], ids=["4 rows", "1 row"])
def test_a_nan_or_inf_activation_leaves_the_step_to_the_layers(contexts, monkeypatch):
    """The tiles cannot carry inf or NaN (their codes are integers): the step gives up (None) and the layers run
    instead, whose matmul then takes the float product, so the non-finite values propagate as float math would
    rather than turning into finite garbage -- one row as well as many."""
    model = _model(15)
    cache, ids, pos, meta = _paged(model, contexts, 8, 8)
    assert not _declines(model, _twin(cache), ids, pos, meta)
    with torch.no_grad():
        model.layers[1].post_attention_layernorm.weight[3] = float("inf")
    assert _declines(model, _twin(cache), ids, pos, meta)
    out = model(ids, pos, ForwardContext(meta, cache, CpuAttentionBackend()))
    assert not bool(torch.isfinite(out).all())


@pytest.mark.parametrize("contexts", [[3, 8, 1, 5], [3]], ids=["4 rows", "1 row"])
def test_an_inf_gate_reaching_the_silu_leaves_the_step_to_the_layers(contexts):
    """The SiLU builds sigmoid(g) from exp(-|g|): an infinite gate (here from an infinite weight scale) must still
    give a non-finite product that the check before quantizing sees, whichever thread's share of the row holds it,
    not a finite code."""
    model = _model(15)
    with torch.no_grad():
        model.layers[1].mlp.gate_up_proj.quant.scales[0, 0] = float("inf")
    cache, ids, pos, meta = _paged(model, contexts, 8, 8)
    assert _declines(model, _twin(cache), ids, pos, meta)


def test_engine_greedy_tokens_fused_and_layers_agree(monkeypatch):
    """Whole engine, several requests of different lengths decoding together, chunked prefill and a tight pool that
    preempts: the same tokens with the fused step as with the layers."""
    from minillm.config import CacheConfig, EngineConfig, SchedulerConfig
    from minillm.engine.llm_engine import LLMEngine
    from minillm.sampling.params import SamplingParams
    from minillm.testing import tiny_tokenizer
    prompts = [[5, 9, 33], [100, 4, 4, 4, 7, 8, 9, 10, 11, 12, 13], [77], list(range(20, 50))]

    def run(mode):
        monkeypatch.setenv("MINILLM_DECODE_STEP", mode)
        cfg = EngineConfig(cache=CacheConfig(block_size=4, num_blocks=24),
                           scheduler=SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=4))
        engine = LLMEngine(_model(8, spec="int4"), tiny_tokenizer(), cfg)
        params = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True)
        out = run_engine(engine, [(p, params) for p in prompts])
        assert engine.block_manager.num_free_blocks == 24
        return out
    before = cpu_decode.FUSED_STEPS
    fused = run("fused")
    assert cpu_decode.FUSED_STEPS - before >= 14        # every decode step ran fused, 1 to 4 rows
    assert fused == run("layers")


@pytest.mark.parametrize("make, message", [
    (lambda q: QuantizedWeight(q.kind, q.qweight, q.scales.float(), q.mins, q.group_size), "scales must be float16"),
    (lambda q: QuantizedWeight(q.kind, q.qweight.to(torch.int8), q.scales, q.mins, q.group_size), "uint8"),
    (lambda q: QuantizedWeight(q.kind, q.qweight, q.scales, None, q.group_size), "mins must be float16"),
    (lambda q: QuantizedWeight(q.kind, q.qweight, q.scales[:, :1], q.mins[:, :1], 64), "scales must be float16 of shape"),
    (lambda q: QuantizedWeight(q.kind, q.qweight, q.scales, q.mins, 48), "multiple of 32"),
    (lambda q: QuantizedWeight("int3", q.qweight, q.scales, q.mins, 32), "unknown quantized kind"),
    (lambda q: QuantizedWeight("int4", q.qweight, q.scales, q.mins, 32, act="int8"), "act='int8'"),
])
def test_a_quantized_weight_the_kernels_would_misread_is_refused(make, message):
    """The kernels take raw pointers: a float32 scale read as float16 would be silently wrong math. A plugged
    quantizer's result is checked before any layer holds it."""
    model = _model(9)
    layer = model.layers[0].mlp.down_proj
    before = layer.quant
    with pytest.raises(ValueError, match=message):
        layer.set_quantized(make(quantize(torch.randn(before.shape), QuantSpec("int4", 32))))
    assert layer.quant is before


def test_a_non_contiguous_quantized_weight_is_made_contiguous(monkeypatch):
    model = _model(10)
    layer = model.layers[1].self_attn.o_proj
    q = quantize(torch.randn(layer.quant.shape), QuantSpec("int8"))
    column_major = torch.empty(q.qweight.shape[::-1], dtype=torch.int8).t().copy_(q.qweight)
    strided = QuantizedWeight("int8", column_major, q.scales, None, q.group_size)
    assert not strided.qweight.is_contiguous()
    layer.set_quantized(strided)
    assert layer.quant.qweight.is_contiguous() and torch.equal(layer.quant.qweight, q.qweight)
    cache, ids, pos, meta = _paged(model, [5], 8, 5)
    _assert_step_matches_layers(model, cache, ids, pos, meta, monkeypatch)


@pytest.fixture
def fixed_team():
    with config.kernels_set(kernel_threads="fixed"):
        yield


@pytest.mark.parametrize("threads", [2, 3])
@pytest.mark.parametrize("contexts, new", [([17], None), ([17, 3], None), ([17, 3, 30, 9, 0, 22, 5], None),
                                           ([17], [2]), ([17, 3, 30], [5, 1, 9])],
                         ids=["1 row", "2 rows", "7 rows", "verifying 3 rows", "verifying 15 rows"])
@pytest.mark.usefixtures("fixed_team")
def test_the_team_splits_the_step_without_changing_a_bit(threads, contexts, new, monkeypatch):
    """One OpenMP team runs the whole step (the rows' 32-column blocks split evenly for the norms, SiLU and
    quantization, so a thread's share may start or end inside a row; 24-column blocks for the matmuls; attention tasks from a shared counter;
    spinning barriers between pieces; 3 threads on this 2-core machine also exercise the barrier's yield). Every
    output element is computed by the same code whatever the split, so any thread count must give the single
    thread's result bit for bit: a missing barrier or a split that drops or doubles rows breaks that (with one
    sequence's rows verifying guesses: a row attending before another thread stored the keys ahead of it). The
    team is pinned to torch's thread count (kernel_threads fixed), whatever else runs on the machine."""
    model = _model(11, kv_heads=2, spec="int4g64")
    cache, ids, pos, meta = _paged(model, contexts, 4, 11, new)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one_cache = _twin(cache)
        one = fused_decode(model, ids, pos, ForwardContext(meta, one_cache, CpuAttentionBackend()))
        torch.set_num_threads(threads)
        for _ in range(3):
            many_cache = _twin(cache)
            many = fused_decode(model, ids, pos, ForwardContext(meta, many_cache, CpuAttentionBackend()))
            assert torch.equal(one, many)
            assert torch.equal(one_cache.k, many_cache.k) and torch.equal(one_cache.v, many_cache.v)
        _assert_step_matches_layers(model, _twin(cache), ids, pos, meta, monkeypatch)
    finally:
        torch.set_num_threads(before)


def test_rows_outside_the_pool_or_vocabulary_are_refused_before_anything_is_written():
    """The C step checks every row before it writes (it reads and writes through raw pointers)."""
    model = _model(12)          # int8 embedding: the step looks the token rows up itself
    cache, ids, pos, meta = _paged(model, [6, 2], 4, 6)
    assert fused_decode(model, ids, pos, ForwardContext(meta, _twin(cache), CpuAttentionBackend())) \
        is not None
    before = (cache.k.clone(), cache.v.clone())
    blocks = cache.k.shape[2] // 4
    cases = [
        (ValueError, "seq_lens", AttentionMetadata([1, 1], [meta.block_tables.shape[1] * 4 + 1, 3], meta.slot_mapping,
                                                   meta.block_tables, 4), ids),
        (ValueError, "block table entry", AttentionMetadata([1, 1], meta.seq_lens, meta.slot_mapping,
                                                            meta.block_tables.clone().fill_(blocks), 4), ids),
        (IndexError, "vocabulary", meta, torch.tensor([int(ids[0]), 128])),
    ]
    for err, text, bad_meta, bad_ids in cases:
        with pytest.raises(err, match=text):
            fused_decode(model, bad_ids, pos, ForwardContext(bad_meta, cache, CpuAttentionBackend()))
        assert torch.equal(cache.k, before[0]) and torch.equal(cache.v, before[1])


def test_a_model_cast_back_and_forth_gets_a_new_plan(monkeypatch):
    """model.to(dtype) gives the norms new storage: the cached C view (raw pointers) must not outlive it."""
    model = _model(13)
    cache, ids, pos, meta = _paged(model, [5], 8, 7)
    _assert_step_matches_layers(model, _twin(cache), ids, pos, meta, monkeypatch)
    model.to(torch.float64)
    assert _declines(model, _twin(cache), ids, pos, meta)     # float64 norms: not the C step's math
    model.to(torch.float32)
    _assert_step_matches_layers(model, cache, ids, pos, meta, monkeypatch)


@pytest.mark.slow
def test_smollm2_batched_decode_fused_and_layers_agree(monkeypatch):
    """The default GGUF with its quantized weights (auto), six chat prompts decoding together (the tiles'
    rows): the fused step's greedy tokens against the layers'. Both run the same tiles matmuls and attention; the
    step's own norms, RoPE and SiLU round differently in the last bits, which could flip a near-tie, so the claim is
    agreement before the first divergence on at least 95 % of the tokens (measured: all 96)."""
    from minillm.config import EngineConfig
    from minillm.engine.llm_engine import LLMEngine
    from minillm.loading.loader import load_model
    from minillm.sampling.params import SamplingParams
    loaded = load_model("default", quantization="auto")
    tok = loaded.tokenizer
    questions = ["What is the capital of France?", "Name a primary color.", "Write one sentence about cats.",
                 "What does a CPU do?", "Give me a synonym for happy.", "How many legs does a spider have?"]
    prompts = [tok.encode(f"<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n") for q in questions]

    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)

    def run(mode):
        monkeypatch.setenv("MINILLM_DECODE_STEP", mode)
        engine = LLMEngine(loaded.model, tok, EngineConfig.from_kwargs(quantization="auto"))
        return run_engine(engine, [(p, params) for p in prompts])
    before = cpu_decode.FUSED_STEPS
    fused = run("fused")
    assert cpu_decode.FUSED_STEPS - before >= 15          # the six rows decoded through the fused step
    layers = run("layers")
    agree = sum(next((i for i, (a, b) in enumerate(zip(f, layers[k])) if a != b), len(f)) for k, f in fused.items())
    total = sum(map(len, fused.values()))
    print(f"fused vs layers: {agree}/{total} greedy tokens before the first divergence")
    assert agree >= 0.95 * total
