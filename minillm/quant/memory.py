"""Weight memory at a given precision: the first line of every VRAM budget (lab08)."""
from __future__ import annotations

from dataclasses import dataclass

from minillm.catalog import lookup, param_groups
from minillm.config import ModelConfig


def weight_bytes(num_params: float, bits: float, group_size: int | None = None, scale_bits: int = 16) -> float:
    """Bytes to store `num_params` weights at `bits` each.

    With group-wise quantization every `group_size` weights also carry one scale (and nothing else here),
    which is why 4-bit checkpoints come out a little above params / 2 bytes.
    """
    total_bits = num_params * bits
    if group_size:
        total_bits += num_params / group_size * scale_bits
    return total_bits / 8


@dataclass(frozen=True)
class WeightFormat:
    """How a checkpoint stores its linear (matmul) weights, and the tensor-core dtype its GEMMs run in."""
    name: str
    bits: float
    group_size: int | None = None    # weights sharing one scale; None = per-channel/per-block, negligible
    scale_bits: int = 16
    compute: str = "bf16"            # W4A16 dequantizes to bf16; W8A8 FP8 and FP4 use their own tensor cores


# The formats real checkpoints ship in. FP8 scales are per channel or per 128x128 block (DeepSeek-V3 style
# block-wise): under 0.01 bits per weight, so not counted. NVFP4: an FP8 (E4M3) scale per 16 values (plus
# one FP32 scale per tensor); MXFP4 (OCP microscaling): an 8-bit power-of-two scale per 32 values.
WEIGHT_FORMATS: dict[str, WeightFormat] = {f.name: f for f in [
    WeightFormat("bf16", 16),
    WeightFormat("fp16", 16),
    WeightFormat("fp8", 8, compute="fp8"),
    WeightFormat("int4", 4, group_size=128, scale_bits=16),      # GPTQ/AWQ, group-128 fp16 scales
    WeightFormat("nvfp4", 4, group_size=16, scale_bits=8, compute="fp4"),
    WeightFormat("mxfp4", 4, group_size=32, scale_bits=8, compute="fp4"),
    # GGUF (llama.cpp) blocks of 32 with an fp16 scale. GGUF files quantize the token embeddings too (and the
    # output matrix, often to Q6_K): pass embeddings_bits to checkpoint_bytes for them.
    WeightFormat("q8_0", 8, group_size=32, scale_bits=16),
    WeightFormat("q4_0", 4, group_size=32, scale_bits=16),
]}


def weight_format(name: str | WeightFormat) -> WeightFormat:
    """A WeightFormat by name (or pass one through)."""
    return lookup(name, WEIGHT_FORMATS, WeightFormat, "weight format")


def checkpoint_bytes(model: str | ModelConfig, format: str | WeightFormat, embeddings_bits: float = 16) -> float:
    """Bytes of a whole model's weights as real quantized checkpoints store them: the per-layer matmuls in
    `format`, while the embedding table, the LM head and the norms stay 16-bit (GPTQ/AWQ, FP8 and NVFP4
    checkpoints of Llama models all leave them unquantized). Pass embeddings_bits=format bits to get the
    everything-quantized figure (params x bits), which understates a 128K-vocabulary model by GBs."""
    f, p = weight_format(format), param_groups(model)
    return (weight_bytes(p.linear, f.bits, f.group_size, f.scale_bits)
            + weight_bytes(p.embedding + p.lm_head, embeddings_bits) + weight_bytes(p.norms, 16))
