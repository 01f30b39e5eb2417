"""Turn `--model` (\"default\", a .gguf file, or a Hugging Face directory) into a ready LlamaModel + Tokenizer."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

import torch

from minillm.calibration.smoothquant import attach, calibrate_cached
from minillm.config import ModelConfig
from minillm.distributed.device import resolve_device
from minillm.distributed.sharding import check_tp_size
from minillm.loading.default_model import DEFAULT_SAMPLING, default_model_path
from minillm.loading.errors import ModelLoadError
from minillm.loading.gguf_file import GGUFFile
from minillm.loading.sources import GGUFSource, SafetensorsSource
from minillm.loading.tokenizer import Tokenizer
from minillm.models.llama import LlamaModel
from minillm.quant.policy import apply_quantization, check_quantization, wants_calibration

SUPPORTED_ARCHS = ("llama", "mistral")
DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}


@dataclass
class LoadedModel:
    model: LlamaModel
    tokenizer: "Tokenizer"  # noqa: F821
    config: ModelConfig
    path: Path
    # the checkpoint's recommended sampling settings (SamplingParams field -> value; empty: none recorded)
    sampling_defaults: dict[str, float] = field(default_factory=dict)


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}: use float32 or bfloat16")
    return DTYPES[dtype]


def resolve_model_path(spec: str | Path) -> Path:
    if str(spec) == "default":
        return default_model_path()
    path = Path(spec).expanduser()
    if not path.exists():
        raise ModelLoadError(
            f"model path {str(path)!r} does not exist. --model takes 'default', a .gguf file, "
            "or a Hugging Face directory with config.json, *.safetensors and tokenizer.json.")
    return path


def load_model(spec: str | Path = "default", dtype: str | torch.dtype = "float32", comm=None,
               layers: range | None = None, rules=None, quantization: str = "none",
               group_size: int = 32, progress=None, device: str | torch.device = "cpu") -> LoadedModel:
    """Read a checkpoint into a LlamaModel. With `comm` (a tensor-parallel Communicator) the model is this rank's
    shard and only its slices are read (`rules` decide which); with `layers`, only a pipeline stage's layers.
    `quantization` (see minillm.quant.policy): "none" dequantizes everything to `dtype` (what the labs use);
    "auto" keeps a quantized checkpoint's formats; "int8" / "int4" quantize the linear layers (int4 in groups of
    `group_size`); "w8a8" quantizes weights and activations to int8, with SmoothQuant factors calibrated on the
    whole float model (calibration/smoothquant.py; cached per checkpoint, `progress(text)` hears about it).
    `device` (a torch.device or EngineConfig's setting, "auto" included): where the model ends up. Float weights
    ("none") are read straight onto it; a quantized model is quantized (and calibrated) on the CPU, then moved packed."""
    path = resolve_model_path(spec)
    torch_dtype = resolve_dtype(dtype)
    device = resolve_device(device)      # a parallel engine's rank passes its own GPU (executor/workers.py)
    if path.is_dir():
        cfg, weights, tok, recommended = _read_hf_dir(path)
    elif path.suffix == ".gguf" or _has_gguf_magic(path):
        cfg, weights, tok, recommended = _read_gguf(path)
    else:
        raise ModelLoadError(f"{path} is neither a .gguf file nor a Hugging Face model directory")
    if comm is not None and comm.world_size > 1:
        check_tp_size(cfg, comm.world_size)
    check_quantization(quantization, group_size, rules)
    model = build_model(cfg, weights, torch_dtype, comm, layers, rules, keep_quantized=quantization == "auto",
                        device=device if quantization == "none" else None)
    whole = (comm is None or comm.world_size == 1) and layers is None
    smooth = None
    if quantization == "w8a8" and whole:     # SmoothQuant factors from the float model, then quantize with them
        smooth = calibrate_cached(model, tok, path, progress)
    try:
        apply_quantization(model, quantization, group_size, smooth)
    except ValueError as e:
        raise ModelLoadError(str(e)) from None
    if wants_calibration(model) and whole:   # W8A8 copies for batched steps (MINILLM_QGEMM_BATCHED=w8a8)
        attach(model, calibrate_cached(model, tok, path, progress))
    if device.type != "cpu":
        model.to(device)        # packed quantized layers stay packed (Quantizable._apply); float ones are there
    return LoadedModel(model, tok, cfg, path, _recommended(recommended, path))


# GGUF's general.sampling.* keys and Hugging Face's generation_config.json fields -> SamplingParams fields
_GGUF_SAMPLING = {"general.sampling.temp": "temperature", "general.sampling.top_p": "top_p",
                  "general.sampling.top_k": "top_k", "general.sampling.min_p": "min_p"}
_HF_SAMPLING = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                "repetition_penalty": "repetition_penalty"}


def sampling_defaults(spec: str | Path = "default") -> dict[str, float]:
    """The sampling settings the checkpoint recommends: a GGUF file's general.sampling.* metadata, a Hugging Face
    directory's generation_config.json, else (the default model, whose file records none) its model card's."""
    path = resolve_model_path(spec)
    found = _hf_sampling(path) if path.is_dir() else _gguf_sampling(GGUFFile.open(path).metadata)
    return _recommended(found, path)


def _hf_sampling(path: Path) -> dict[str, Any]:
    gen = path / "generation_config.json"
    raw = _read_json_file(gen) if gen.is_file() else {}
    raw = raw if isinstance(raw, dict) else {}
    return {ours: raw[theirs] for theirs, ours in _HF_SAMPLING.items() if isinstance(raw.get(theirs), (int, float))}


def _gguf_sampling(md: dict[str, Any]) -> dict[str, Any]:
    return {ours: md[key] for key, ours in _GGUF_SAMPLING.items() if isinstance(md.get(key), (int, float))}


def _recommended(found: dict[str, Any], path: Path) -> dict[str, float]:
    """What the checkpoint recorded, else (the default model) its model card's, as SamplingParams' types."""
    if not found and path == _default_path_or_none():
        found = dict(DEFAULT_SAMPLING)
    return {k: (int(v) if k == "top_k" else float(v)) for k, v in found.items()}


def _default_path_or_none() -> Path | None:
    try:
        return default_model_path()
    except ModelLoadError:
        return None


def _read_json_file(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelLoadError(f"{path} is not valid JSON ({e}): restore the file from the model's source "
                             "(a truncated download?)") from None


def peek_tokenizer(spec: str | Path = "default"):
    """The model's shapes and tokenizer without reading its weights (to check a prompt against --max-model-len
    before the load): a GGUF file's header is memory-mapped, a directory's tokenizer.json read."""
    path = resolve_model_path(spec)
    if path.is_dir():
        cfg, _, tok, _ = _read_hf_dir(path)
        return cfg, tok
    gf = GGUFFile.open(path)
    return _gguf_config(gf), Tokenizer.from_gguf(gf.metadata)


def peek_config(spec: str | Path = "default") -> ModelConfig:
    """The model's shapes without reading its weights (to check a parallel layout before any process starts)."""
    path = resolve_model_path(spec)
    if path.is_dir():
        return _hf_dir_config(path)
    return _gguf_config(GGUFFile.open(path))


def build_model(cfg: ModelConfig, weights: Iterable[tuple[str, Any]], dtype: torch.dtype, comm=None,
                layers: range | None = None, rules=None, keep_quantized: bool = False,
                device: torch.device | None = None) -> LlamaModel:
    """Instantiate on the meta device, then fill from (hf_name, tensor or weight source) pairs, fusing qkv and
    gate/up; a tensor-parallel rank (`comm`) or pipeline stage (`layers`) takes only its part."""
    with torch.device("meta"):
        model = LlamaModel(cfg, comm, layers, rules)
    try:
        model.load_weights(weights, dtype, keep_quantized=keep_quantized, device=device)
    except ValueError as e:
        raise ModelLoadError(str(e)) from None
    model.rotary = type(model.rotary)(cfg.head_dim, cfg.rope_theta, cfg.max_position_embeddings, cfg.rope_scaling)
    if getattr(cfg, "_rope_freqs", None) is not None:
        model.rotary.inv_freq = model.rotary.inv_freq / cfg._rope_freqs  # llama3-style factors stored in GGUF
    return model.eval()


# ---------------------------------------------------------------- Hugging Face directories

def _hf_dir_config(path: Path) -> ModelConfig:
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise ModelLoadError(f"{path} has no config.json: a Hugging Face model directory needs config.json, "
                             "*.safetensors and tokenizer.json")
    return config_from_hf(_read_json_file(cfg_file))


def _read_hf_dir(path: Path):
    cfg = _hf_dir_config(path)
    files = _safetensors_files(path)
    if not (path / "tokenizer.json").is_file():
        raise ModelLoadError(f"{path} has no tokenizer.json")
    tok = Tokenizer.from_dir(path)
    return cfg, _iter_safetensors(files), tok, _hf_sampling(path)


def config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    model_type = hf.get("model_type", "")
    archs = hf.get("architectures") or []
    if model_type not in SUPPORTED_ARCHS and not any(a in ("LlamaForCausalLM", "MistralForCausalLM") for a in archs):
        raise ModelLoadError(f"unsupported architecture {model_type or archs!r}: minillm runs Llama-family models "
                             f"({', '.join(SUPPORTED_ARCHS)})")
    if hf.get("attention_bias") or hf.get("mlp_bias"):
        raise ModelLoadError("unsupported architecture: attention/MLP biases are not part of the Llama family minillm runs")
    _refuse_unimplemented(hf)
    heads = hf["num_attention_heads"]
    rope = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
    theta = hf.get("rope_theta", rope.get("rope_theta", 10000.0))
    max_pos = _cap_at_sliding_window(hf.get("max_position_embeddings", 2048),
                                     hf.get("sliding_window") if hf.get("use_sliding_window", True) else None)
    return ModelConfig(
        vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"], intermediate_size=hf["intermediate_size"],
        num_layers=hf["num_hidden_layers"], num_heads=heads, num_kv_heads=hf.get("num_key_value_heads") or heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // heads, rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
        rope_theta=theta, rope_scaling=scaling, max_position_embeddings=max_pos,
        tie_word_embeddings=hf.get("tie_word_embeddings", False), bos_token_id=hf.get("bos_token_id"),
        eos_token_id=hf.get("eos_token_id"), name=hf.get("_name_or_path") or model_type)


# Config keys that change a Llama's math and that minillm does not implement: refused, never ignored.
_UNIMPLEMENTED = {
    "attn_logit_softcapping": "attention logit soft-capping", "final_logit_softcapping": "final logit soft-capping",
    "query_pre_attn_scalar": "a custom attention scale", "qk_norm": "query/key normalization",
    "use_qk_norm": "query/key normalization", "logits_scaling": "logit scaling", "embedding_multiplier": "embedding "
    "scaling", "residual_multiplier": "residual scaling", "attention_multiplier": "a custom attention scale",
}


def _refuse_unimplemented(hf: dict[str, Any]) -> None:
    act = hf.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise ModelLoadError(f"unsupported architecture: the MLP activation is {act!r}, minillm implements SiLU "
                             "(the Llama family's)")
    found = [f"{key} ({what})" for key, what in _UNIMPLEMENTED.items() if hf.get(key) not in (None, False, 1, 1.0)]
    if found:
        raise ModelLoadError(f"unsupported architecture: config.json sets {', '.join(found)}, which minillm does not "
                             "implement; it refuses to run the model rather than compute different logits")


def _cap_at_sliding_window(max_pos: int, window: int | None) -> int:
    """Sliding-window attention (Mistral) is not implemented; within the window it *is* full attention, so the
    model runs exactly, with its context capped at the window (longer sequences are refused, never run wrongly)."""
    if window is None or window >= max_pos:
        return max_pos
    import warnings
    warnings.warn(f"this model attends over a sliding window of {window} tokens, which minillm does not implement: "
                  f"its context is capped at {window} tokens (within the window the results are exact)",
                  stacklevel=3)
    return int(window)


def _safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / s for s in shards]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{path} has no *.safetensors weights")
    return files


def _iter_safetensors(files: list[Path]):
    from safetensors import safe_open
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as st:
                for name in st.keys():
                    if "rotary_emb" in name:
                        continue
                    yield name, SafetensorsSource(st, name)
        except (OSError, ValueError, RuntimeError) as e:  # safetensors raises SafetensorError(Exception)
            raise ModelLoadError(f"could not read {f}: {e}. The file is corrupt or truncated; re-download it.") from e
        except Exception as e:
            if type(e).__name__ == "SafetensorError":
                raise ModelLoadError(f"could not read {f}: {e}. The file is corrupt or truncated.") from e
            raise


# ---------------------------------------------------------------- GGUF

def _has_gguf_magic(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False


GGUF_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def config_from_gguf(md: dict[str, Any]) -> ModelConfig:
    arch = md.get("general.architecture")
    if arch not in SUPPORTED_ARCHS:
        raise ModelLoadError(f"unsupported architecture {arch!r} in GGUF: minillm runs Llama-family models "
                             f"({', '.join(SUPPORTED_ARCHS)})")

    def get(key: str, default: Any = None) -> Any:
        return md.get(f"{arch}.{key}", default)

    heads = get("attention.head_count")
    kv_heads = get("attention.head_count_kv", heads)
    hidden = get("embedding_length")
    scaling = None
    stype = get("rope.scaling.type")
    if stype and stype != "none":
        scaling = {"rope_type": stype, "factor": get("rope.scaling.factor", 1.0)}
        if get("rope.scaling.original_context_length"):
            scaling["original_max_position_embeddings"] = get("rope.scaling.original_context_length")
    vocab = get("vocab_size") or len(md.get("tokenizer.ggml.tokens", []))
    return ModelConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=get("feed_forward_length"),
        num_layers=get("block_count"), num_heads=heads, num_kv_heads=kv_heads,
        head_dim=get("attention.key_length") or hidden // heads,
        rms_norm_eps=get("attention.layer_norm_rms_epsilon", 1e-5), rope_theta=get("rope.freq_base", 10000.0),
        rope_scaling=scaling, max_position_embeddings=_cap_at_sliding_window(get("context_length", 2048),
                                                                             get("attention.sliding_window")),
        bos_token_id=md.get("tokenizer.ggml.bos_token_id"), eos_token_id=md.get("tokenizer.ggml.eos_token_id"),
        name=md.get("general.name", arch))


def unpermute_qk(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's row permutation of Q/K (it interleaves RoPE pairs); back to Hugging Face's rotate-half layout."""
    out_features, in_features = w.shape
    head_dim = out_features // n_head
    return w.view(n_head, head_dim // 2, 2, in_features).transpose(1, 2).reshape(out_features, in_features)


def _gguf_config(gf) -> ModelConfig:
    cfg = config_from_gguf(gf.metadata)
    cfg.tie_word_embeddings = not gf.has_tensor("output.weight")
    return cfg


def _read_gguf(path: Path):
    gf = GGUFFile.open(path)
    cfg = _gguf_config(gf)
    if gf.has_tensor("rope_freqs.weight"):
        cfg._rope_freqs = gf.load("rope_freqs.weight")
    tok = Tokenizer.from_gguf(gf.metadata)
    return cfg, _iter_gguf(gf, cfg), tok, _gguf_sampling(gf.metadata)


def _iter_gguf(gf, cfg: ModelConfig):
    D = cfg.head_dim
    for name in gf.tensor_names:
        if name == "rope_freqs.weight":
            continue
        t = GGUFSource(gf, name)
        if name == "token_embd.weight":
            yield "embed_tokens.weight", t
        elif name == "output_norm.weight":
            yield "norm.weight", t
        elif name == "output.weight":
            yield "lm_head.weight", t
        elif name.startswith("blk."):
            _, idx, kind, _ = name.split(".", 3)
            if kind not in GGUF_NAMES:
                raise ModelLoadError(f"unexpected GGUF tensor {name}: not a Llama-family weight")
            if kind in ("attn_q", "attn_k"):   # per head, so it applies to any whole-head slice a rank reads
                t = GGUFSource(gf, name, transform=lambda w: unpermute_qk(w, w.shape[0] // D))
            yield f"layers.{idx}.{GGUF_NAMES[kind]}.weight", t
        else:
            raise ModelLoadError(f"unexpected GGUF tensor {name}: not a Llama-family weight")
