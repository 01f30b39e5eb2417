"""int8 KV rows: symmetric quantization with one float16 scale per (token, KV head) row of head_dim values.

    scale = fp16(amax(|x|) / 127)            over the row's head_dim values
    q     = clamp(round(x / scale), -127, 127)   (an all-zero row: scale 0, q 0, dequantizes to 0, no NaN)
    x~    = q * scale

Why per token and head (not per block or per tensor): keys carry a few outlier channels and their magnitude moves
from token to token; one scale per row bounds each row's error by its own amax / 254, and a row is written once
(a block's scale would change as the block fills, forcing a requantization of its earlier rows).
The quantization uses the scale *after* rounding to fp16, so dequantizing with the stored scale is the inverse the
rounding was done against; the clamp catches the values the fp16 rounding pushed just past 127 * scale.
"""
from __future__ import annotations

import torch

QMAX = 127
SCALE_DTYPE = torch.float16
SCALE_BYTES = 2
_FP16_MAX = 65504.0      # a row with amax past 127 * this saturates instead of getting an inf scale


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] float -> (q int8 [..., D], scale float16 [...])."""
    xf = x.float()
    scale = (xf.abs().amax(-1) / QMAX).clamp_(max=_FP16_MAX).to(SCALE_DTYPE)
    s = scale.float()
    s = s.masked_fill(s == 0, 1.0)       # all-zero rows (or amax underflowing fp16) give q = round(x) = 0
    q = torch.round(xf / s.unsqueeze(-1)).clamp_(-QMAX, QMAX).to(torch.int8)
    return q, scale


def dequantize_rows(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(q int8 [..., D], scale [...]) -> q * scale in `dtype` (computed in fp32)."""
    return (q.float() * scale.float().unsqueeze(-1)).to(dtype)
