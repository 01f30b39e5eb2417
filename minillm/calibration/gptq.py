"""GPTQ (Frantar et al., 2022): int4 weights chosen with calibration data, so that each layer's *output* on real
inputs changes least, not each weight.

Why GPTQ rather than AWQ here: both need only a few hundred calibration sequences; GPTQ's error feedback works on
the weights alone and keeps minillm's int4 format as it is (AWQ rescales input channels, which needs the scale folded
into the previous RMSNorm — a second change to the model), and its effect is largest exactly where RTN is worst:
coarse groups.

For a linear layer y = x W^T the loss of a quantized W' on inputs X is ||X (W - W')^T||^2, whose Hessian per output
row is H = 2 X^T X. Columns are quantized one at a time, left to right; the rounding error of column i, divided by
the pivot of H^-1, is spread over the columns not yet quantized (in H^-1's upper Cholesky factor's row i), so later
columns absorb what earlier ones lost. Group parameters (scale, minimum) are set from the updated weights when the
quantizer reaches the group's first column.

Here the inputs of every layer are collected in one pass of the float model (the "non-sequential" variant; the
paper quantizes layer by layer on the quantized model's activations — a little better, and one pass per layer).
"""
from __future__ import annotations

import torch

from minillm.calibration.text import sequence_logits
from minillm.layers.linear import ColumnParallelLinear, RowParallelLinear
from minillm.quant.formats import QuantizedWeight, QuantSpec, pack_int4


def collect_hessians(model, windows: list[list[int]], progress=None) -> dict[str, torch.Tensor]:
    """Sum of x^T x (float64) over the calibration tokens for the input of every linear layer, by module name."""
    sums: dict[str, torch.Tensor] = {}
    hooks = []
    for name, m in model.named_modules():
        if isinstance(m, (ColumnParallelLinear, RowParallelLinear)):
            def hook(mod, inp, out, name=name):
                x = inp[0].reshape(-1, inp[0].shape[-1]).double()
                sums[name] = sums.get(name, 0) + x.T @ x
            hooks.append(m.register_forward_hook(hook))
    try:
        for i, w in enumerate(windows):
            if progress:
                progress(f"gptq: calibration window {i + 1}/{len(windows)}")
            sequence_logits(model, w)
    finally:
        for h in hooks:
            h.remove()
    return sums


def gptq_int4(w: torch.Tensor, hessian: torch.Tensor, group_size: int, damp: float = 0.01,
              block: int = 128) -> QuantizedWeight:
    """Quantize w [N, K] to int4 (asymmetric, groups of `group_size` along K) minimizing the output error under
    `hessian` [K, K] (x^T x summed over calibration inputs)."""
    spec = QuantSpec("int4", group_size)
    n, k = w.shape
    g = spec.group_for(k)
    W = w.detach().double().clone()
    H = hessian.double().clone()
    dead = torch.diag(H) == 0
    H[dead, dead] = 1.0
    W[:, dead] = 0.0
    H += damp * torch.diag(H).mean() * torch.eye(k, dtype=H.dtype)
    block = g * max(1, block // g)     # a block holds whole groups, so a group's columns share one update
    U = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(H)), upper=True)
    codes = torch.zeros(n, k, dtype=torch.uint8)
    scales = torch.zeros(n, k // g, dtype=torch.float16)
    mins = torch.zeros(n, k // g, dtype=torch.float16)
    for b0 in range(0, k, block):
        b1 = min(b0 + block, k)
        Wb, Err = W[:, b0:b1].clone(), torch.zeros(n, b1 - b0, dtype=W.dtype)
        Ub = U[b0:b1, b0:b1]
        for j in range(b1 - b0):
            col = b0 + j
            if col % g == 0:     # the group's parameters, from the weights as the feedback left them
                lo, hi = Wb[:, j:j + g].amin(1), Wb[:, j:j + g].amax(1)
                scales[:, col // g], mins[:, col // g] = ((hi - lo) / 15).half(), lo.half()
            s = scales[:, col // g].double()
            m = mins[:, col // g].double()
            safe = torch.where(s > 0, s, torch.ones_like(s))
            q = torch.clamp(torch.round((Wb[:, j] - m) / safe), 0, 15)
            codes[:, col] = q.to(torch.uint8)
            err = (Wb[:, j] - (q * s + m)) / Ub[j, j]
            Wb[:, j + 1:] -= err.unsqueeze(1) * Ub[j, j + 1:].unsqueeze(0)
            Err[:, j] = err
        W[:, b1:] -= Err @ U[b0:b1, b1:]
    return QuantizedWeight("int4", pack_int4(codes), scales, mins, g)


def gptq_quantize_model(model, group_size: int, windows: list[list[int]], head: QuantSpec | None = None,
                        progress=None):
    """Replace every float linear layer of `model` by its GPTQ int4 version (calibrated on `windows`), in place; the
    embedding / LM head by round-to-nearest `head` (default int8 per channel)."""
    hessians = collect_hessians(model, windows, progress)
    layers = [(n, m) for n, m in model.named_modules() if isinstance(m, (ColumnParallelLinear, RowParallelLinear))
              and m.quant is None]
    for i, (name, m) in enumerate(layers):
        if progress:
            progress(f"gptq: layer {i + 1}/{len(layers)} {name}")
        m.set_quantized(gptq_int4(m.weight, hessians[name], group_size))
    model.quantize_(None, head if head is not None else QuantSpec("int8"))
    return model
