"""Tiny random Llama checkpoints built in-test with transformers and saved as safetensors."""
from __future__ import annotations

import json
from pathlib import Path

import torch


def hf_llama_config(heads: int = 4, kv_heads: int = 2, head_dim: int = 16, layers: int = 2, vocab: int = 128,
                    tie: bool = False, rope: dict | None = None, max_pos: int = 256):
    from transformers import LlamaConfig
    rope_parameters = {"rope_type": "default", "rope_theta": 10000.0}
    if rope:
        rope_parameters = {"rope_theta": 10000.0, **rope}
    return LlamaConfig(vocab_size=vocab, hidden_size=heads * head_dim, intermediate_size=3 * heads * head_dim,
                       num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                       head_dim=head_dim, rms_norm_eps=1e-5, max_position_embeddings=max_pos,
                       tie_word_embeddings=tie, rope_parameters=rope_parameters,
                       bos_token_id=1, eos_token_id=2, pad_token_id=0)


def make_hf_model(seed: int = 0, **kw):
    from transformers import LlamaForCausalLM
    torch.manual_seed(seed)
    model = LlamaForCausalLM(hf_llama_config(**kw)).eval()
    with torch.no_grad():  # default init is tiny; widen it so differences would show
        for p in model.parameters():
            p.normal_(0, 0.2) if p.dim() > 1 else p.uniform_(0.5, 1.5)
    return model


def save_hf_dir(model, path: Path) -> Path:
    model.save_pretrained(path, safe_serialization=True)
    return path


def load_minillm_from_dir(path: Path, dtype=torch.float32):
    from minillm.loading.loader import _iter_safetensors, _safetensors_files, build_model, config_from_hf
    cfg = config_from_hf(json.loads((path / "config.json").read_text()))
    return build_model(cfg, _iter_safetensors(_safetensors_files(path)), dtype)


def minillm_logits(model, ids: list[int]) -> torch.Tensor:
    """Full-sequence logits [n, V] through the reference path (contiguous cache, one prefill)."""
    from minillm.kv.contiguous import ContiguousKVCache
    from minillm.layers.attention import TorchAttentionBackend
    from minillm.models.llama import ForwardContext
    cache = ContiguousKVCache(model.cfg, 1, len(ids), dtype=model.dtype)
    meta = cache.metadata([0], [0], [len(ids)])
    h = model(torch.tensor(ids), torch.arange(len(ids)), ForwardContext(meta, cache, TorchAttentionBackend()))
    return model.compute_logits(h)


from minillm.testing import random_model  # noqa: E402,F401  (the one tiny-model fixture, shared with the graders)


# A chat template so that chat mode, LLM.chat and the benches' chat workloads run on the tiny model too.
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def tiny_model_dir(path, context: int) -> Path:
    """A tiny random model (minillm.testing's) as a Hugging Face directory (what `--model DIR` and LLM(DIR) take),
    with a chat template."""
    from minillm.testing import save_model_dir, tiny_tokenizer
    path = save_model_dir(random_model(vocab=tiny_tokenizer().vocab_size, max_pos=context), path)
    (path / "chat_template.jinja").write_text(TEMPLATE)
    return path
