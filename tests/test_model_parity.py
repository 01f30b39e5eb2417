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
