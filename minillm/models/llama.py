"""A Llama-family decoder in plain PyTorch: embedding, RMSNorm, RoPE, GQA attention, SwiGLU MLP.

Tokens arrive flat ([T]) with their positions: prefill chunks and decode tokens of many sequences share one
batch, and the AttentionMetadata says which rows belong to which sequence. Q/K/V and gate/up are fused into
one matmul each (fewer, larger GEMMs); the loader concatenates the checkpoint's separate matrices.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from minillm import interfaces
from minillm.config import ModelConfig
from minillm.distributed.comm import Communicator
from minillm.distributed.sharding import shard_config
from minillm.kernels.cpu_decode import DecodeWeights, LayerWeights
from minillm.kv.cache import KVCache
from minillm.layers.attention import AttentionMetadata, TorchAttentionBackend
from minillm.layers.linear import (MEGATRON, SINGLE, MergedColumnParallelLinear, ParallelLMHead, QKVParallelLinear,
                                   Quantizable, RowParallelLinear, VocabParallelEmbedding, as_source, gather_logits)
from minillm.layers.norm import RMSNorm
from minillm.layers.rotary import RotaryEmbedding, apply_rotary
from minillm.quant.formats import QuantizedWeight, QuantSpec


@dataclass
class ForwardContext:
    meta: AttentionMetadata
    cache: KVCache
    backend: interfaces.AttentionBackend
    cos: torch.Tensor | None = None
    sin: torch.Tensor | None = None


class Attention(nn.Module):
    """GQA attention over this rank's heads (all of them with one rank). `layer` indexes the rank's KV pool."""

    def __init__(self, cfg: ModelConfig, layer: int, comm: Communicator = SINGLE, rules=None) -> None:
        super().__init__()
        self.layer = layer
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads, comm=comm,
                                          rules=rules)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.head_dim = cfg.head_dim
        self.o_proj = RowParallelLinear(cfg.q_size, cfg.hidden_size, comm=comm, rules=rules)
        self.scale = cfg.head_dim ** -0.5

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        H, KV, D = self.num_heads, self.num_kv_heads, self.head_dim
        qk, v = self.qkv_proj(x).split([(H + KV) * D, KV * D], dim=-1)
        # Q and K heads side by side take one rotation (half the small ops of rotating them apart).
        qk = apply_rotary(qk.view(-1, H + KV, D), ctx.cos, ctx.sin)
        q, k = qk[:, :H], qk[:, H:]
        v = v.view(-1, KV, D)
        o = ctx.backend.forward(self.layer, q, k, v, ctx.meta, ctx.cache, self.scale)
        return self.o_proj(o.reshape(-1, H * D))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, comm: Communicator = SINGLE, rules=None) -> None:
        super().__init__()
        i = cfg.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(cfg.hidden_size, [i, i], ("gate", "up"), comm=comm, rules=rules)
        self.down_proj = RowParallelLinear(i, cfg.hidden_size, comm=comm, rules=rules)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, comm: Communicator = SINGLE, rules=None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer, comm, rules)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg, comm, rules)

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), ctx)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    """The decoder, whole or a shard of it: `comm` splits every layer over tensor-parallel ranks; `layers` keeps
    a pipeline stage's range of layers (the first stage embeds, the last one normalizes and scores). `rules`
    (interfaces.TensorParallelRules) decide which slice each rank holds and how row-parallel layers finish."""

    def __init__(self, cfg: ModelConfig, comm: Communicator | None = None, layers: range | None = None,
                 rules=None) -> None:
        super().__init__()
        self.cfg, self.comm = cfg, comm or SINGLE
        self.layer_range = range(cfg.num_layers) if layers is None else layers
        self.is_first = self.layer_range.start == 0
        self.is_last = self.layer_range.stop == cfg.num_layers
        c = self.comm
        has_embed = self.is_first or (self.is_last and cfg.tie_word_embeddings)
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, c) if has_embed else None
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, c, rules) for i in range(len(self.layer_range)))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps) if self.is_last else None
        self.lm_head = (ParallelLMHead(cfg.vocab_size, cfg.hidden_size, c)
                        if self.is_last and not cfg.tie_word_embeddings else None)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.max_position_embeddings, cfg.rope_scaling)

    @property
    def kv_cfg(self) -> ModelConfig:
        """The shapes this rank's KV pool holds: its KV heads, its stage's layers."""
        return shard_config(self.cfg, self.comm.world_size, len(self.layer_range))

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext,
                hidden: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids, positions: [T]. Returns final hidden states [T, hidden] (normed), or for a pipeline stage
        that is not the last, its layers' output (`hidden` is the previous stage's, for a stage that is not the
        first)."""
        if ctx.cos is None:     # a CUDA graph's step brings its own (gathered on the device from a fixed table)
            ctx.cos, ctx.sin = self.rotary.cos_sin(positions, ctx.meta.query_lens, ctx.meta.seq_lens)
        x = self.embed_tokens(input_ids) if hidden is None else hidden
        if self.layers:   # a quantized embedding dequantizes to float32: run the layers in the model's dtype
            x = x.to(self.layers[0].input_layernorm.weight.dtype)
        for layer in self.layers:
            x = layer(x, ctx)
        return self.norm(x) if self.is_last else x

    def decode_step_weights(self) -> DecodeWeights | None:
        """This model's weights as the fused CPU decode step reads them, or None where that step would not compute
        what the layers compute: a shard (tensor or pipeline parallel), a module that is not minillm's own class
        (a lab's swapped-in piece) or carries a forward hook, norms of different eps. Which weight formats the step
        takes is the kernel's to say (cpu_decode.run declines all but weight-only int8/int4). Cached while the
        modules, their hooks, quantized weights and norm storage stay the same: checked on every call, by identity
        (~30 us for SmolLM2's 30 layers)."""
        cached = self.__dict__.get("_decode_cache")
        if cached is None or not cached.valid():
            cached = _DecodeCache.build(self)
            self.__dict__["_decode_cache"] = cached
        return cached.weights

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """[rows, V] fp32 logits; with tensor parallelism each rank scores its slice of the vocabulary and the
        result exists on rank 0 only (None elsewhere)."""
        head = self.embed_tokens if self.lm_head is None else self.lm_head
        packed = self._packed_lm_head(head.weight) if head.quant is None else None
        if head.quant is not None:
            local = head.linear(hidden, sampled=True).float()
        elif packed is not None:
            local = torch.ops.mkldnn._linear_pointwise(hidden.contiguous(), packed, None, "none", [], "")
        else:
            local = F.linear(hidden, head.weight).float()
        return local if self.comm.world_size == 1 else gather_logits(local, self.comm, self.cfg.vocab_size)

    def load_weights(self, weights, dtype: torch.dtype = torch.float32, keep_quantized: bool = False,
                     device: torch.device | None = None) -> "LlamaModel":
        """Fill the parameters from (Hugging Face name, tensor or weight source) pairs. Each layer reads its own
        slice (`shard`); q/k/v and gate/up land in their fused matrices; layers outside this stage are skipped
        unread. With `keep_quantized`, a weight stored in a format minillm runs directly (GGUF Q8_0/Q4_0/Q4_1)
        stays in it (`shard(..., quantized=True)`). Float weights go to `device` as they are read (None: where the
        checkpoint's reader put them, the CPU). Raises ValueError naming what is missing, unexpected or misshaped."""
        state: dict[str, torch.Tensor | QuantizedWeight] = {}
        parts: dict[str, dict[str, torch.Tensor | QuantizedWeight]] = {}
        self.checkpoint_types: dict[str, str] = {}   # target -> the checkpoint's storage type, where quantized
        for hf_name, src in weights:
            target, part = fused_target(hf_name)
            if self.cfg.tie_word_embeddings and target == "lm_head.weight":
                continue
            target = self._local_name(target)
            if target is None:
                continue
            src = as_source(src)
            try:
                module = self.get_submodule(target.rsplit(".", 1)[0])
            except AttributeError:
                state[target] = src.read()   # reported below as unexpected
                continue
            qtype = getattr(src, "qtype", None)
            if qtype is not None and qtype.name not in ("F32", "F16", "BF16", "F64"):
                self.checkpoint_types[target] = qtype.name
            value = None
            if keep_quantized and isinstance(module, Quantizable):
                value = module.shard(src, part, quantized=True)
            if value is None:
                shard = getattr(module, "shard", None)
                value = shard(src, part) if shard is not None else src.read()
            if part is None:
                state[target] = value
            else:
                parts.setdefault(target, {})[part] = value
        for target, got in parts.items():
            order = self.get_submodule(target.rsplit(".", 1)[0]).parts
            missing = [p for p in order if p not in got]
            if missing:
                raise ValueError(f"checkpoint lacks the {missing} projection(s) for {target}")
            state[target] = _fuse([got[p] for p in order])
        expected = dict(self.named_parameters())
        missing = sorted(set(expected) - set(state))
        unexpected = sorted(set(state) - set(expected))
        if missing or unexpected:
            raise ValueError(f"checkpoint does not match a Llama model: missing {missing[:5]}, "
                             f"unexpected {unexpected[:5]}")
        for name, p in expected.items():
            if tuple(state[name].shape) != tuple(p.shape):
                raise ValueError(f"{name}: checkpoint shape {tuple(state[name].shape)} != expected {tuple(p.shape)}")
        quantized = {k: v for k, v in state.items() if isinstance(v, QuantizedWeight)}
        self.load_state_dict({k: v.to(dtype) if device is None else v.to(device=device, dtype=dtype)
                              for k, v in state.items() if k not in quantized}, assign=True, strict=False)
        for name, qw in quantized.items():
            self.get_submodule(name.rsplit(".", 1)[0]).set_quantized(qw)
        return self

    def quantizable(self):
        """(name, module) of every layer that can hold a quantized weight: the linear layers, embedding, LM head."""
        return [(n, m) for n, m in self.named_modules() if isinstance(m, Quantizable)]

    def quantize_(self, linear: QuantSpec | None, head: QuantSpec | None = None, only=None,
                  quantizer=None) -> "LlamaModel":
        """Quantize, in place, every float linear layer to `linear` and the embedding / LM head to `head` (None leaves
        them as they are). `only(name)` restricts which layers (default: all). `quantizer(weight, spec)` ->
        QuantizedWeight is the method (default: round to nearest, minillm.quant.formats.quantize); a learner's
        quantizer plugs in here (interfaces.Quantizer), and its weights then run through minillm's kernels."""
        if self.comm.world_size > 1 and any(
                getattr(m, "rules", MEGATRON) is not MEGATRON for _, m in self.quantizable()):
            raise ValueError("quantized layers run minillm's own tensor-parallel rules; tp_rules cannot be combined "
                             "with quantization (use quantization='none')")
        for name, m in self.quantizable():
            spec = head if isinstance(m, VocabParallelEmbedding) else linear
            if spec is None or m.quant is not None or (only is not None and not only(name)):
                continue
            m.quantize_(spec, quantizer)
        self.__dict__.pop("_lm_head_packed", None)
        return self

    def _local_name(self, name: str) -> str | None:
        """A checkpoint name in this stage's numbering, or None for weights another stage holds."""
        if name.startswith("layers."):
            _, idx, rest = name.split(".", 2)
            i = int(idx)
            if i not in self.layer_range:
                return None if 0 <= i < self.cfg.num_layers else name
            return f"layers.{i - self.layer_range.start}.{rest}"
        if name.startswith("embed_tokens") and self.embed_tokens is None:
            return None
        if (name.startswith("norm.") and self.norm is None) or (name.startswith("lm_head") and self.lm_head is None):
            return None
        return name

    def _packed_lm_head(self, weight: torch.Tensor):
        """The LM head (vocab x hidden, the largest matrix) pre-packed for oneDNN, on CPU in fp32.

        With few rows per step a plain matmul re-packs this matrix on every call; oneDNN's pre-packed copy
        makes the head 1.5-2x faster (it costs one extra copy of the matrix). Rebuilt if the weight changes."""
        if (weight.device.type != "cpu" or weight.dtype != torch.float32 or not torch.backends.mkldnn.is_available()
                or not hasattr(torch.ops.mkldnn, "_linear_pointwise")):
            return None
        key = (weight.data_ptr(), weight._version)
        cached = getattr(self, "_lm_head_packed", None)
        if cached is None or cached[0] != key:
            cached = (key, weight.detach().to_mkldnn())
            self._lm_head_packed = cached
        return cached[1]

    @property
    def dtype(self) -> torch.dtype:
        return next(self.parameters()).dtype

    def weight_bytes(self, per_token: bool = True) -> int:
        """Bytes of weights read per forward pass (the embedding table is gathered, not read whole, unless tied);
        quantized layers count their packed integers, scales and minimums."""
        total = sum(_nbytes(m) for m in self.modules())
        if per_token and self.lm_head is not None and self.embed_tokens is not None:
            total -= _nbytes(self.embed_tokens)
        return total


_DECODE_KINDS = (DecoderLayer, Attention, MLP, RMSNorm, QKVParallelLinear, RowParallelLinear, RMSNorm,
                 MergedColumnParallelLinear, RowParallelLinear)


@dataclass
class _DecodeCache:
    """A model's DecodeWeights (or None) and what they were read from. `valid()` runs before every decode step, so
    it reads nn.Module's own storage (`_modules`, the hook dicts) with plain dict lookups and identity tests: the
    same walk through nn.Module.__getattr__ cost ~270 us a step, 6 % of a SmolLM2 int4 decode step."""
    weights: DecodeWeights | None
    children: list        # (module dict, key, module): every module the weights were read from, where it hangs
    hook_dicts: list      # their forward (pre-)hook dicts
    hooked: bool          # whether any of them held a hook (then weights is None)
    quants: list          # (layer, QuantizedWeight or None) of every matmul
    norms: list           # (Parameter, data_ptr, dtype) of every norm

    def valid(self) -> bool:
        return (all(d.get(k) is m for d, k, m in self.children) and any(self.hook_dicts) == self.hooked
                and all(layer.__dict__.get("quant") is q for layer, q in self.quants)
                and all(p.data_ptr() == ptr and p.dtype == dt for p, ptr, dt in self.norms))

    @staticmethod
    def build(model: LlamaModel) -> _DecodeCache:
        top = model._modules
        children = [(top, "layers", model.layers), (top, "norm", model.norm), (top, "embed_tokens", model.embed_tokens)]
        if model.comm.world_size != 1 or not (model.is_first and model.is_last) or type(model.norm) is not RMSNorm:
            return _DecodeCache(None, children, [], False, [], [])
        parts = []
        for key, layer in model.layers._modules.items():
            sub = layer._modules
            a, m = sub["self_attn"], sub["mlp"]
            parts.append((layer, a, m, sub["input_layernorm"], a._modules["qkv_proj"], a._modules["o_proj"],
                          sub["post_attention_layernorm"], m._modules["gate_up_proj"], m._modules["down_proj"]))
            children.append((model.layers._modules, key, layer))
            children += [(layer._modules, k, v) for k, v in sub.items()]
            children += [(a._modules, k, v) for k, v in a._modules.items()]
            children += [(m._modules, k, v) for k, v in m._modules.items()]
        mods = [x for p in parts for x in p] + [model.norm]
        hook_dicts = [d for x in mods for d in (x._forward_hooks, x._forward_pre_hooks)]
        quants = [(p[i], p[i].__dict__.get("quant")) for p in parts for i in (4, 5, 7, 8)]
        norm_params = [n.weight for p in parts for n in (p[3], p[6])] + [model.norm.weight]
        norms = [(w, w.data_ptr(), w.dtype) for w in norm_params]
        hooked = any(hook_dicts)
        ok = (not hooked and all(type(x) is kind for p in parts for x, kind in zip(p, _DECODE_KINDS))
              and all(n.eps == model.norm.eps for p in parts for n in (p[3], p[6])))
        embed = model.embed_tokens.quant if model.embed_tokens.tp_size == 1 else None
        quants.append((model.embed_tokens, model.embed_tokens.quant))
        weights = None
        if ok:
            a0 = parts[0][1]
            weights = DecodeWeights(
                tuple(LayerWeights(n1.weight, n2.weight, qkv.quant, o.quant, gu.quant, d.quant)
                      for _, _, _, n1, qkv, o, n2, gu, d in parts),
                model.norm.weight, model.norm.eps, model.cfg.hidden_size, model.cfg.intermediate_size,
                a0.num_heads, a0.num_kv_heads, a0.head_dim, a0.scale, embed)
        return _DecodeCache(weights, children, hook_dicts, hooked, quants, norms)


def _nbytes(module: nn.Module) -> int:
    """The module's own weights (not its children's)."""
    own = list(module.parameters(recurse=False))
    if isinstance(module, Quantizable):
        own += list(module.buffers(recurse=False))
    return sum(t.numel() * t.element_size() for t in own)


def _fuse(parts: list) -> torch.Tensor | QuantizedWeight:
    """q/k/v or gate/up stacked by rows; quantized parts stay quantized when they share a format, otherwise all
    of them are dequantized (the loader quantizes the result again where the checkpoint was quantized)."""
    if all(isinstance(p, QuantizedWeight) for p in parts):
        try:
            return QuantizedWeight.cat(parts)
        except ValueError:
            pass
    return torch.cat([p.dequantize() if isinstance(p, QuantizedWeight) else p for p in parts], dim=0)


def fused_target(hf_name: str) -> tuple[str, str | None]:
    """A checkpoint name -> (this model's parameter, which part of a fused matrix it is)."""
    name = hf_name.removeprefix("model.") if not hf_name.startswith("lm_head") else hf_name
    for part in ("q", "k", "v"):
        if name.endswith(f"self_attn.{part}_proj.weight"):
            return name.replace(f"{part}_proj", "qkv_proj"), part
    for part in ("gate", "up"):
        if name.endswith(f"mlp.{part}_proj.weight"):
            return name.replace(f"{part}_proj", "gate_up_proj"), part
    return name, None
