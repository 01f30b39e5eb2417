"""Differential: minillm's decoder vs Hugging Face transformers on the same random weights."""
import pytest
import torch

from tests.tiny_models import load_minillm_from_dir, make_hf_model, minillm_logits, save_hf_dir

CONFIGS = [
    dict(heads=4, kv_heads=4, tie=False),                 # MHA
    dict(heads=4, kv_heads=2, tie=True),                  # GQA, tied embeddings
    dict(heads=6, kv_heads=1, tie=False),                 # MQA
    dict(heads=4, kv_heads=2, rope={"rope_type": "linear", "factor": 2.0}),
    dict(heads=4, kv_heads=2, rope={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                    "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    dict(heads=4, kv_heads=1, rope={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}),
    dict(heads=4, kv_heads=2, rope={"rope_type": "dynamic", "factor": 2.0}),
]


@pytest.mark.parametrize("kw", CONFIGS, ids=lambda kw: f"h{kw['heads']}kv{kw['kv_heads']}"
                         f"{'-tied' if kw.get('tie') else ''}-{(kw.get('rope') or {}).get('rope_type', 'default')}")
def test_logits_match_transformers_fp32(tmp_path, kw):
    hf = make_hf_model(seed=len(str(kw)), **kw)
    ours = load_minillm_from_dir(save_hf_dir(hf, tmp_path / "m"))
    ids = torch.randint(3, 128, (1, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids).logits[0].float()
    got = minillm_logits(ours, ids[0].tolist())
    assert (got - ref).abs().max().item() <= 1e-4


def test_bf16_close_to_transformers_bf16(tmp_path):
    hf = make_hf_model(seed=3, heads=4, kv_heads=2)
    ours = load_minillm_from_dir(save_hf_dir(hf, tmp_path / "m"), dtype=torch.bfloat16)
    hf = hf.to(torch.bfloat16)
    ids = torch.randint(3, 128, (1, 24), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = hf(ids).logits[0].float()
    got = minillm_logits(ours, ids[0].tolist())
    # bf16 keeps ~3 significant digits; the same ops in the same order keep the argmax and most of the value.
    assert (got - ref).abs().max().item() <= 0.05 * ref.abs().max().item()
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.95


def test_a_sliding_window_model_runs_exactly_within_its_window_and_refuses_beyond(tmp_path):
    """Mistral's sliding window is not implemented: the context is capped at the window, inside which the logits
    equal transformers' (which does slide); a longer prompt is refused instead of run with full attention."""
    import warnings
    from transformers import MistralConfig, MistralForCausalLM
    from minillm.engine.llm_engine import LLMEngine
    cfg = MistralConfig(vocab_size=128, hidden_size=64, intermediate_size=192, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                        sliding_window=12, rms_norm_eps=1e-5)
    torch.manual_seed(0)
    hf = MistralForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.2) if p.dim() > 1 else p.uniform_(0.5, 1.5)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ours = load_minillm_from_dir(save_hf_dir(hf, tmp_path / "m"))
    assert any("sliding window of 12 tokens" in str(w.message) for w in caught)
    assert ours.cfg.max_position_embeddings == 12
    ids = torch.randint(3, 128, (1, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids).logits[0].float()
    assert (minillm_logits(ours, ids[0].tolist()) - ref).abs().max().item() <= 1e-4
    with pytest.raises(ValueError, match="context window holds 12"):
        LLMEngine.from_model(ours).add_request(list(range(3, 20)))


@pytest.mark.parametrize("change, words", [({"hidden_act": "gelu"}, "activation is 'gelu'"),
                                           ({"attn_logit_softcapping": 50.0}, "soft-capping"),
                                           ({"attention_bias": True}, "biases")])
def test_config_keys_that_change_the_math_are_refused(change, words):
    from minillm.loading.errors import ModelLoadError
    from minillm.loading.loader import config_from_hf
    base = {"model_type": "llama", "vocab_size": 128, "hidden_size": 64, "intermediate_size": 192,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}
    config_from_hf(base)
    with pytest.raises(ModelLoadError, match=words):
        config_from_hf({**base, **change})


# ---------------------------------------------------------------- dynamic NTK scaling past the trained length

DYNAMIC_MAX_POS = 32


@pytest.mark.parametrize("factor", [2.0, 4.0])
def test_dynamic_ntk_logits_match_transformers_past_the_maximum_position(tmp_path, factor):
    """Dynamic NTK scaling grows RoPE's base once a sequence outgrows max_position_embeddings (32 here): the logits
    of whole sequences of 32, 33 and 80 tokens equal transformers' (lengths in increasing order: transformers keeps
    the frequencies of the longest sequence it has seen). Past 32 the same weights without the scaling give other
    logits, so the comparison does see the scaling."""
    from minillm.layers.rotary import RotaryEmbedding
    hf = make_hf_model(seed=7, rope={"rope_type": "dynamic", "factor": factor}, max_pos=DYNAMIC_MAX_POS)
    ours = load_minillm_from_dir(save_hf_dir(hf, tmp_path / "m"))
    unscaled = load_minillm_from_dir(tmp_path / "m")
    unscaled.rotary = RotaryEmbedding(ours.cfg.head_dim, ours.cfg.rope_theta, DYNAMIC_MAX_POS, None)
    for n in (32, 33, 80):
        ids = torch.randint(3, 128, (1, n), generator=torch.Generator().manual_seed(n))
        with torch.no_grad():
            ref = hf(ids).logits[0].float()
        assert (minillm_logits(ours, ids[0].tolist()) - ref).abs().max().item() <= 1e-4, n
        gap = (minillm_logits(unscaled, ids[0].tolist()) - ref).abs().max().item()
        assert gap > 0.05 if n > DYNAMIC_MAX_POS else gap <= 1e-4, (n, gap)


def test_dynamic_ntk_generation_past_the_maximum_position_matches_transformers_in_a_batch(tmp_path):
    """Greedy generation of 24 tokens after a 24-token prompt (so past max_position_embeddings = 32) equals
    transformers' generate with its KV cache (each step scaled for the sequence's length then), also when the
    engine runs the request in one batch with a 56-token one: each sequence is scaled for its own length, never for
    the batch's furthest position (the engine did that: the short request's output changed with the batch)."""
    from minillm.engine.llm_engine import LLMEngine
    from minillm.sampling.params import SamplingParams
    from tests.test_engine import run_engine
    hf = make_hf_model(seed=11, rope={"rope_type": "dynamic", "factor": 4.0}, max_pos=DYNAMIC_MAX_POS)
    ours = load_minillm_from_dir(save_hf_dir(hf, tmp_path / "m"))
    prompts = [torch.randint(3, 128, (1, n), generator=torch.Generator().manual_seed(n)) for n in (24, 56)]
    new = [24, 6]
    with torch.no_grad():
        want = [hf.generate(p, max_new_tokens=m, do_sample=False, eos_token_id=None, pad_token_id=0)[0, p.shape[1]:]
                .tolist() for p, m in zip(prompts, new)]
    engine = LLMEngine.from_model(ours, num_blocks=64, block_size=4, max_model_len=96)
    got = run_engine(engine, [(p[0].tolist(), SamplingParams(temperature=0, max_tokens=m, ignore_eos=True))
                              for p, m in zip(prompts, new)])
    assert [got["0"], got["1"]] == want


def test_dynamic_ntk_tables_of_a_batch_are_each_sequences_own():
    """cos/sin for two sequences in one call (lengths 10 and 70, max position 32) equal those of each alone."""
    from minillm.layers.rotary import RotaryEmbedding
    rope = RotaryEmbedding(16, 10000.0, DYNAMIC_MAX_POS, {"rope_type": "dynamic", "factor": 2.0})
    a, b = torch.arange(6, 10), torch.arange(60, 70)            # 4 new tokens of a 10-token and 10 of a 70-token one
    cos, sin = rope.cos_sin(torch.cat([a, b]), [4, 10], [10, 70])
    for part, pos, n in ((slice(0, 4), a, 10), (slice(4, 14), b, 70)):
        alone = rope.cos_sin(pos, [len(pos)], [n])
        assert torch.equal(cos[part], alone[0]) and torch.equal(sin[part], alone[1])
    assert not torch.equal(cos[:4], rope.cos_sin(a, [4], [70])[0])     # the length does matter past 32
