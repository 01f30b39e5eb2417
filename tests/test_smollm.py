"""End-to-end checks on the real default model (SmolLM2-135M-Instruct, Q4_1 GGUF) against transformers."""
import pytest
import torch

from minillm.engine.prompt import build_prompt_ids
from minillm.engine.simple import SimpleGenerator
from minillm.sampling.params import SamplingParams
from tests.tiny_models import minillm_logits

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def hf_smollm(default_model_path):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(default_model_path.parent, gguf_file=default_model_path.name,
                                                dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def prompt_ids(smollm):
    ids = build_prompt_ids(smollm.tokenizer, "Explain in one sentence why the sky is blue.")
    assert len(ids) >= 30
    return ids[:30]


def test_config_read_from_gguf(smollm):
    c = smollm.config
    assert (c.num_layers, c.hidden_size, c.intermediate_size, c.num_heads, c.num_kv_heads, c.head_dim) == \
        (30, 576, 1536, 9, 3, 64)
    assert (c.vocab_size, c.rope_theta, c.tie_word_embeddings) == (49152, 100000.0, True)


def test_logits_match_transformers(smollm, hf_smollm, prompt_ids):
    ours = minillm_logits(smollm.model, prompt_ids)
    with torch.no_grad():
        ref = hf_smollm(torch.tensor([prompt_ids])).logits[0].float()
    assert (ours - ref).abs().max().item() <= 1e-3


def test_bench_peer_holds_transformers_own_gguf_weights(smollm, hf_smollm):
    """`bench throughput` builds transformers' Llama from minillm's dequantized weights (transformers' GGUF import
    is ~30 s): they must be the very tensors transformers' import makes, from a quantized load as from a float one."""
    from minillm.bench.throughput import load_hf_peer
    from minillm.loading.loader import load_model
    ref = hf_smollm.state_dict()
    for loaded in (smollm, load_model(smollm.path, "float32", quantization="auto")):
        peer = load_hf_peer(loaded).state_dict()
        assert set(peer) == set(ref)
        bad = [k for k in ref if peer[k].dtype != ref[k].dtype or not torch.equal(peer[k], ref[k])]
        assert not bad, bad[:5]


def test_greedy_tokens_match_transformers_generate(smollm, hf_smollm):
    # A story opening keeps the model talking: 32 tokens without EOS in both engines.
    ids = smollm.tokenizer.encode("Once upon a time, in a small village by the sea, there lived an old fisherman who")
    gen = SimpleGenerator(smollm.model, smollm.tokenizer)
    _, ours = gen.generate(ids, SamplingParams(temperature=0, max_tokens=32))
    with torch.no_grad():
        out = hf_smollm.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False,
                                 pad_token_id=smollm.tokenizer.eos_token_id)
    theirs = out[0, len(ids):].tolist()
    assert len(ours) == len(theirs) == 32
    assert ours == theirs


def test_engine_matches_one_at_a_time_on_smollm(smollm):
    from minillm.engine.llm_engine import LLMEngine
    prompts = ["What is the capital of France?", "Write a haiku about the sea.", "List three fruits.",
               "What is 2 + 2?"]
    ids = [build_prompt_ids(smollm.tokenizer, p) for p in prompts]
    params = SamplingParams(temperature=0, max_tokens=24)
    gen = SimpleGenerator(smollm.model, smollm.tokenizer)
    ref = [gen.generate(p, params)[1] for p in ids]
    # a pool small enough that the four requests cannot all fit: preemption and chunking happen
    engine = LLMEngine.from_model(smollm.model, smollm.tokenizer, num_blocks=12, block_size=16,
                                  max_num_batched_tokens=48)
    for i, p in enumerate(ids):
        engine.add_request(p, params, request_id=str(i))
    done = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                done[o.request_id] = o.token_ids
        engine.block_manager.check_invariants()
    assert [done[str(i)] for i in range(4)] == ref
