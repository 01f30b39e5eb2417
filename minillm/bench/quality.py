"""`minillm bench quality`: what quantization costs in accuracy — perplexity and agreement with the float model.

Text: the Python reference topics that ship with CPython (`pydoc_data.topics`, ~465k characters of English, no
download). The first CALIBRATION_CHARS characters are the calibration slice (for methods that calibrate); the
evaluation windows are cut from the held-out rest, so the two never overlap.

For each --quantization setting (plus `int4-gptq`: int4 chosen by GPTQ on 16 calibration windows, at
--quantization-group-size like `int4`): perplexity over the windows (teacher-forced, every position scored), and how
often the top-1 next token equals the reference's (the first setting, `none` by default) on the same positions.
Note for the default model: its block weights were Q4_1 in the file, so `none` is the dequantized Q4_1 model and
requantizing to int4 g32 lands on nearly the same grid; coarser formats (int4 with large groups) show the loss.

`kv-int8` is `none`'s weights with an int8 KV cache (kv/int8.py): its row is what quantizing the cache alone costs.
Every position then attends to dequantized keys and values, as every decode step does (the attention backends read
an int8 pool back even in prefill). The engine's --kv-cache-dtype applies to every other row.
"""
from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from minillm.calibration.gptq import gptq_quantize_model
from minillm.calibration.text import (CALIBRATION_CHARS, calibration_text, corpus, eval_windows,  # noqa: F401
                                      sequence_logits)
from minillm.loading import loader
from minillm.quant.policy import describe

CALIBRATED = {"int4-gptq": "gptq"}   # settings bench quality adds: quantized with calibration (calibration/gptq.py)
KV_SETTINGS = {"kv-int8": ("none", "int8")}   # settings that quantize the KV cache: (weights, kv_cache_dtype)


@dataclass
class QualityRow:
    quantization: str
    formats: str
    bytes_per_weight: float      # weight bytes per token / parameters read per token
    weight_mb: float
    perplexity: float
    top1_agreement: float        # with the first row's argmax, same positions
    seconds: float
    kv_cache_dtype: str = "auto"


def run_quality_bench(model_spec: str, quantizations: list[str], group_size: int = 32, num_windows: int = 8,
                      window: int = 256, progress=None, calibration_windows: int = 16,
                      kv_cache_dtype: str = "auto") -> list[QualityRow]:
    """One row per setting of `quantizations` (QUANTIZATIONS, int4-gptq, kv-int8); kv_cache_dtype: the KV cache of
    the rows that do not choose their own."""
    rows: list[QualityRow] = []
    ref_top1: list[torch.Tensor] | None = None
    windows = None
    for q in quantizations:
        t0 = time.perf_counter()
        if progress:
            progress(f"quality: loading with quantization={q}")
        weights, kv = KV_SETTINGS.get(q, (q, kv_cache_dtype))
        loaded = loader.load_model(model_spec, "float32", quantization="none" if q in CALIBRATED else weights,
                            group_size=group_size)
        model = loaded.model
        if q == "int4-gptq":
            calib = eval_windows(loaded.tokenizer, calibration_windows, window, calibration=True)
            gptq_quantize_model(model, group_size, calib, progress=progress)
        if windows is None:
            windows = eval_windows(loaded.tokenizer, num_windows, window)
        nll, count, top1 = 0.0, 0, []
        for i, w in enumerate(windows):
            if progress:
                progress(f"quality: {q} window {i + 1}/{len(windows)}")
            logits = sequence_logits(model, w, kv)[:-1].float()
            target = torch.tensor(w[1:])
            nll += float(F.cross_entropy(logits, target, reduction="sum"))
            count += len(w) - 1
            top1.append(logits.argmax(-1))
        agree = 1.0 if ref_top1 is None else float(
            sum((a == b).sum() for a, b in zip(top1, ref_top1)) / sum(len(a) for a in top1))
        ref_top1 = ref_top1 if ref_top1 is not None else top1
        params = _params_read_per_token(model)
        formats = describe(model) + (f" + KV {kv}" if kv != "auto" else "")
        rows.append(QualityRow(q, formats, model.weight_bytes() / params, model.weight_bytes() / 1e6,
                               math.exp(nll / count), agree, time.perf_counter() - t0, kv))
    return rows


def _params_read_per_token(model) -> int:
    n = 0
    for name, m in model.quantizable():
        if name == "embed_tokens" and model.lm_head is not None:
            continue   # looked up, not read whole
        shape = m.quant.shape if m.quant is not None else m.weight.shape
        n += shape[0] * shape[1]
    return n + sum(p.numel() for n_, p in model.named_parameters() if p.dim() == 1)


def format_quality(rows: list[QualityRow], num_windows: int, window: int) -> str:
    ref = rows[0]
    lines = [f"perplexity on {num_windows} held-out windows x {window} tokens of pydoc_data.topics "
             f"(top-1 agreement vs {ref.quantization})",
             f"{'quantization':12s} {'formats':34s} {'B/weight':>8s} {'MB':>7s} {'ppl':>8s} {'vs ref':>7s} "
             f"{'top-1 agree':>11s}"]
    for r in rows:
        lines.append(f"{r.quantization:12s} {r.formats[:34]:34s} {r.bytes_per_weight:8.3f} {r.weight_mb:7.1f} "
                     f"{r.perplexity:8.3f} {100 * (r.perplexity / ref.perplexity - 1):+6.2f}% "
                     f"{100 * r.top1_agreement:10.1f}%")
    return "\n".join(lines)


def quality_plot(rows: list[QualityRow], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 4))
    for r in rows:
        ax.scatter(r.bytes_per_weight, r.perplexity)
        ax.annotate(r.quantization, (r.bytes_per_weight, r.perplexity), textcoords="offset points", xytext=(5, 5))
    ax.set_xlabel("bytes per weight read per token")
    ax.set_ylabel("perplexity (pydoc_data.topics, held out)")
    ax.set_title("quantization: memory vs quality")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def as_dicts(rows: list[QualityRow]) -> list[dict]:
    return [asdict(r) for r in rows]
