"""SmoothQuant factors for the W8A8 copies that run a weight-only model's batched steps.

A quantized model decodes small batches through the weight-only kernel (exact weights, int16 activations). Batched
steps (prefill, many decodes) are bound by arithmetic, not by weight bytes, and on a CPU without fast bf16 the only
GEMM faster than float32 is int8 x int8 (FBGEMM, kernels/cpu_w8a8.py): so past cpu_qgemm.TILES_MAX_ROWS rows (with
MINILLM_QGEMM_BATCHED=w8a8) a layer runs a W8A8 copy of its weight. Quantizing activations per token costs SmolLM2 a lot (+13 % perplexity with
the layers W8A8, measured): a few input channels carry values 10-100x the rest, and one token's step is set by its
largest channel. SmoothQuant (Xiao et al., 2023) divides each input channel j by s_j and multiplies W's column j by
the same s_j (formats.py), with

    s_j = max|X_j|^alpha / max|W_j|^(1 - alpha)

so the outlier channels shrink and the weights, which have a step per output channel, absorb them. max|X_j| comes
from calibration text (a slice of pydoc_data.topics, the one bench quality keeps apart from its held-out windows);
alpha is chosen per layer from ALPHAS by the output error on a sample of the calibration activations (the method's
per-layer search; with one alpha for all layers the held-out perplexity moved by several percent from one alpha to
the next). `calibrate` returns {layer name: s}; `attach` gives them to the layers (Quantizable.w8a8_smooth). The
factors are cached on disk per checkpoint, so only the first load of a model pays the ~5 s.
"""
from __future__ import annotations

import hashlib
import os
from pathlib import Path

import torch

from minillm import config
from minillm.calibration.text import eval_windows
from minillm.kernels import cpu_qgemm
from minillm.kv.contiguous import ContiguousKVCache
from minillm.layers.attention import TorchAttentionBackend
from minillm.layers.linear import ColumnParallelLinear, RowParallelLinear
from minillm.models.llama import ForwardContext
from minillm.quant.formats import quantize_per_token
from minillm.quant.policy import describe

ALPHAS = (0.4, 0.5, 0.6, 0.7, 0.8)
WINDOWS, WINDOW, SAMPLE_ROWS = 4, 256, 96
SEARCH_OUTPUTS = 2048    # the alpha search scores at most this many output channels (evenly spaced): the LM head's
                         # 49,152 rows cost 20x a layer's, and a spread sample of them ranks the alphas alike
VERSION = 1      # bump when the method changes: cached factors of another version are not used


def _fake_w8a8(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x W^T as the W8A8 path computes it (per-token activation codes, per-channel weight codes), in float."""
    codes, step = quantize_per_token(x)
    ws = (w.abs().amax(1, keepdim=True) / 127).half().float().clamp_min(torch.finfo(torch.float32).tiny)
    wq = torch.clamp(torch.round(w / ws), -127, 127)
    return (codes @ wq.T) * step[:, None] * ws.view(1, -1)


def choose(x_sample: torch.Tensor, amax: torch.Tensor, w: torch.Tensor, alphas=ALPHAS) -> torch.Tensor:
    """The factors s [K] (float32) for one layer: of s = 1 and s(alpha) for each alpha, the one whose W8A8 product
    is closest to the float product on the sample rows."""
    x = x_sample.float()
    w = w.float()
    if w.shape[0] > SEARCH_OUTPUTS:
        w = w[torch.linspace(0, w.shape[0] - 1, SEARCH_OUTPUTS).long()]
    want = x @ w.T
    wmax = w.abs().amax(0).clamp_min(1e-5)
    best, best_err = torch.ones(w.shape[1]), float((_fake_w8a8(x, w) - want).norm())
    for a in alphas:
        s = (amax.float().clamp_min(1e-5) ** a / wmax ** (1 - a)).clamp(1e-3, 1e3)
        err = float((_fake_w8a8(x / s, w * s) - want).norm())
        if err < best_err:
            best, best_err = s, err
    return best.contiguous()


def calibration_windows(tokenizer) -> list[list[int]]:
    """The token windows calibration runs: from the calibration slice bench quality keeps apart from its held-out
    windows."""
    return eval_windows(tokenizer, WINDOWS, WINDOW, calibration=True)


def calibrate(model, windows: list[list[int]], progress=None) -> dict[str, torch.Tensor]:
    """{name: s} for every linear layer and the LM head of a whole (one-rank) model, from prefills of `windows`."""
    amax: dict[str, torch.Tensor] = {}
    sample: dict[str, list[torch.Tensor]] = {}
    per_window = max(1, SAMPLE_ROWS // len(windows))

    def record(name: str, x: torch.Tensor) -> None:
        x = x.detach().reshape(-1, x.shape[-1]).float()
        a = x.abs().amax(0)
        amax[name] = a if name not in amax else torch.maximum(amax[name], a)
        rows = torch.linspace(0, x.shape[0] - 1, min(per_window, x.shape[0])).long()
        sample.setdefault(name, []).append(x[rows])

    hooks = []
    for name, m in model.named_modules():
        if isinstance(m, (ColumnParallelLinear, RowParallelLinear)):
            hooks.append(m.register_forward_hook(lambda mod, inp, out, name=name: record(name, inp[0])))
    try:
        with cpu_qgemm.exact_batched():     # calibrate on the exact products, not on a W8A8 copy's
            for i, w in enumerate(windows):
                if progress:
                    progress(f"calibrating SmoothQuant for W8A8 (once per checkpoint, then cached): window "
                             f"{i + 1}/{len(windows)}")
                cache = ContiguousKVCache(model.cfg, 1, len(w), dtype=model.dtype)
                hidden = model(torch.tensor(w), torch.arange(len(w)),
                               ForwardContext(cache.metadata([0], [0], [len(w)]), cache, TorchAttentionBackend()))
                record(_head(model)[0], hidden)     # the LM head's input: the final normed hidden states
    finally:
        for h in hooks:
            h.remove()
    modules = dict(model.named_modules())
    out = {}
    for name in amax:
        m = modules[name]
        w = m.quant.dequantize() if m.quant is not None else m.weight
        out[name] = choose(torch.cat(sample[name]), amax[name], w)
    return out


def _head(model):
    name = "lm_head" if model.lm_head is not None else "embed_tokens"
    return name, getattr(model, name)


def attach(model, factors: dict[str, torch.Tensor]) -> None:
    modules = dict(model.named_modules())
    for name, s in factors.items():
        modules[name].set_w8a8_smooth(s)


def cache_path(checkpoint: Path, model) -> Path:
    """Where a checkpoint's factors are kept: keyed by its path, size and mtime, the model's formats and VERSION."""
    st = Path(checkpoint).stat()
    key = f"{Path(checkpoint).resolve()}|{st.st_size}|{st.st_mtime_ns}|{describe(model)}|{VERSION}|{ALPHAS}"
    root = config.cache_root() / "smoothquant"
    return root / (hashlib.sha256(key.encode()).hexdigest()[:24] + ".pt")


def calibrate_cached(model, tokenizer, checkpoint: Path, progress=None) -> dict[str, torch.Tensor]:
    """calibrate(), or the factors an earlier load of the same checkpoint saved."""
    path = cache_path(checkpoint, model)
    if path.is_file():
        try:
            factors = torch.load(path, weights_only=True)
            names = {n for n, _ in model.quantizable()}
            if isinstance(factors, dict) and set(factors) <= names:
                return factors
        except Exception:   # noqa: BLE001 - a damaged cache file is recomputed, not fatal
            pass
    factors = calibrate(model, calibration_windows(tokenizer), progress)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        torch.save(factors, tmp)
        os.replace(tmp, path)   # atomic: two processes calibrating at once both leave a whole file
    except OSError:
        pass                    # a read-only home: calibrate again next time
    return factors
