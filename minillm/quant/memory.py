"""Weight memory at a given precision: the first line of every VRAM budget (lab08)."""
from __future__ import annotations


def weight_bytes(num_params: float, bits: float, group_size: int | None = None, scale_bits: int = 16) -> float:
    """Bytes to store `num_params` weights at `bits` each.

    With group-wise quantization every `group_size` weights also carry one scale (and nothing else here),
    which is why 4-bit checkpoints come out a little above params / 2 bytes.
    """
    total_bits = num_params * bits
    if group_size:
        total_bits += num_params / group_size * scale_bits
    return total_bits / 8
