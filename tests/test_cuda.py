"""The same model code on a CUDA GPU: a quantized tiny Llama moved with `.to("cuda")` runs its linear layers through
the Triton dequant-matmul (kernels/triton_qgemm.py) and its decode attention through the Triton PagedAttention
kernel (float and int8 KV pools), and must decode like its dequantized float twin on the CPU.

CI has no GPU, so these tests skip there; on a machine with one run them compiled, not interpreted:
    TRITON_INTERPRET=0 python -m pytest tests/test_cuda.py tests/test_triton_qgemm.py tests/test_triton_kernel.py
(docs/benchmarks.md, "On a GPU", records what they gave on an H200).

Tolerances: float32 activations take IEEE products in the kernel (no TF32), so fp32 logits agree with the CPU
twin to float rounding (1e-4 of the logits' scale); an int8 KV pool moves them by its quantization step (the
int8 tests in test_kv_int8.py bound that), so there greedy tokens must agree at >= 90 % of steps."""
import pytest
import torch

from minillm.kernels.triton_launch import kernel_device
from minillm.kernels.triton_paged_attention import paged_attention_decode_kernel
from minillm.kv.cache import KVCache
from minillm.layers.attention import AttentionMetadata, TorchAttentionBackend
from minillm.models.llama import ForwardContext
from minillm.quant.formats import QuantSpec
from minillm.testing import dequantized_twin, random_model

pytestmark = pytest.mark.skipif(kernel_device(paged_attention_decode_kernel) != "cuda",
                                reason="needs a CUDA GPU with compiled Triton (TRITON_INTERPRET unset or 0)")

PROMPT = [3, 17, 99, 5, 64, 2, 31, 8, 120, 45, 7, 11, 90]


def _model(linear: QuantSpec, head: QuantSpec | None, tie: bool):
    return random_model(seed=5, heads=4, kv_heads=2, head_dim=32, layers=3, vocab=256, tie=tie).quantize_(linear,
                                                                                                          head)


def _greedy(model, steps: int, device: str, backend, kv_dtype=torch.float32, block_size: int = 4,
            forced: list[int] | None = None):
    """Prefill PROMPT into a paged pool whose blocks are scattered (reversed), then `steps` decode steps. Feeds
    `forced` tokens when given (so two runs see the same inputs), else its own argmax. Returns (tokens, logits)."""
    total = len(PROMPT) + steps
    used = -(-total // block_size)
    cache = KVCache(model.cfg, used + 2, block_size, dtype=kv_dtype, device=device)
    table = list(range(used + 1, 1, -1))

    def step(ids: list[int], start: int) -> torch.Tensor:
        n = len(ids)
        slots = [table[p // block_size] * block_size + p % block_size for p in range(start, start + n)]
        meta = AttentionMetadata(query_lens=[n], seq_lens=[start + n],
                                 slot_mapping=torch.tensor(slots, device=device),
                                 block_tables=torch.tensor([table], device=device), block_size=block_size)
        h = model(torch.tensor(ids, device=device), torch.arange(start, start + n, device=device),
                  ForwardContext(meta, cache, backend))
        return model.compute_logits(h[-1:]).float().cpu()

    logits, tokens = [step(PROMPT, 0)], []
    for i in range(steps):
        tokens.append(forced[i] if forced else int(logits[-1].argmax()))
        logits.append(step([tokens[-1]], len(PROMPT) + i))
    return tokens, torch.cat(logits)


CASES = [(QuantSpec("int4", 32), QuantSpec("int8"), False), (QuantSpec("int8"), QuantSpec("int8", 32), True),
         (QuantSpec("int4", 64), None, False)]


@pytest.mark.parametrize("linear, head, tie", CASES)
def test_quantized_model_on_cuda_decodes_like_its_float_twin_on_cpu(linear, head, tie):
    from minillm.layers.attention import get_attention_backend
    model = _model(linear, head, tie)
    twin = dequantized_twin(model)
    want_tokens, want = _greedy(twin, 12, "cpu", TorchAttentionBackend())
    model = model.to("cuda")
    assert all(t.is_cuda for _, m in model.quantizable() if m.quant is not None for t in m.quant.tensors())
    backend = get_attention_backend("auto", "cuda")
    assert backend.name == "triton"
    got_tokens, got = _greedy(model, 12, "cuda", backend, forced=want_tokens)
    assert float((got - want).abs().max()) <= 1e-4 * float(want.abs().max())
    assert _greedy(model, 12, "cuda", backend)[0] == want_tokens


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_quantized_model_on_cuda(dtype):
    """fp16/bf16 activations use the tensor cores; logits stay within that dtype's rounding of the float twin's."""
    model = _model(QuantSpec("int4", 32), QuantSpec("int8"), False)
    twin = dequantized_twin(model)
    want_tokens, want = _greedy(twin, 8, "cpu", TorchAttentionBackend())
    from minillm.layers.attention import TritonAttentionBackend
    model = model.to("cuda", dtype)
    assert all(m.quant.scales.dtype == torch.float16 for _, m in model.quantizable() if m.quant is not None)
    _, got = _greedy(model, 8, "cuda", TritonAttentionBackend(), kv_dtype=dtype, forced=want_tokens)
    rel = float((got - want).norm() / want.norm())
    assert rel < (2e-2 if dtype == torch.float16 else 1.6e-1), rel


def test_int8_kv_pool_on_cuda_agrees_with_the_float_pool():
    from minillm.layers.attention import TritonAttentionBackend
    model = _model(QuantSpec("int4", 32), QuantSpec("int8"), False).to("cuda")
    base, _ = _greedy(model, 24, "cuda", TritonAttentionBackend())
    tokens, _ = _greedy(model, 24, "cuda", TritonAttentionBackend(), kv_dtype=torch.int8)
    same = sum(a == b for a, b in zip(base, tokens)) / len(base)
    assert same >= 0.9, (base, tokens)
