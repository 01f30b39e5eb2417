"""Which quantization a loaded model runs with: the `quantization` setting (EngineConfig, --quantization).

    auto  keep the checkpoint's format: GGUF Q4_0/Q4_1 -> int4, Q8_0 -> int8 (bytes copied, no float round trip);
          other quantized GGML types are dequantized and quantized again (<= 5 bits -> int4, more -> int8);
          float checkpoints stay float
    none  dequantize everything to the float dtype (exact float math; what the labs use)
    int8  every linear layer int8 per output channel; embedding / LM head int8 per output channel
    int4  every linear layer int4 in groups of `group_size`; embedding / LM head int8 per output channel
    w8a8  every linear layer and the LM head int8 per output channel with int8 activations quantized per token at
          run time (formats.py; FBGEMM on CPU); the embedding lookup reads the same int8 table
Weight-only layers (auto, int8, int4) run on a copy of their codes reordered into tiles (cpu_qgemm.tiles_copy, the
same bytes), made on the first product, and steps of more than cpu_qgemm.TILES_MAX_ROWS rows through a copy made on
the first such step (cpu_qgemm.BATCHED_PATH: the int16 GEMM by default); describe() reports the memory they hold.
w8a8 and the W8A8 batched copies (MINILLM_QGEMM_BATCHED=w8a8) are SmoothQuant-calibrated when load_model reads a
whole model (calibration/smoothquant.py).
"""
from __future__ import annotations

from minillm.config import QUANT_BLOCK as BLOCK, QUANTIZATIONS, check_quantization, kernels  # noqa: F401 (re-exported)
from minillm.quant.formats import QuantSpec, quantize

_LOW_BITS = ("Q4", "Q5", "Q3", "Q2", "IQ1", "IQ2", "IQ3", "IQ4", "TQ")


def apply_quantization(model, quantization: str, group_size: int = 32, smooth: dict | None = None) -> None:
    """Quantize a loaded model in place according to the setting (see the module docstring). `smooth`: SmoothQuant
    factors by layer name for w8a8 (calibration/smoothquant.py; layers without an entry are quantized unsmoothed)."""
    if quantization == "none":
        return
    int8_rows = QuantSpec("int8")
    if quantization == "int8":
        model.quantize_(int8_rows, int8_rows)
    elif quantization == "int4":
        model.quantize_(QuantSpec("int4", group_size), int8_rows)
    elif quantization == "w8a8":
        w8a8 = QuantSpec("int8", act="int8")
        factors = smooth or {}
        names = {id(m.weight): name for name, m in model.quantizable() if m.weight is not None}
        model.quantize_(w8a8, w8a8, quantizer=lambda w, spec: quantize(w, spec, factors.get(names.get(id(w)))))
    else:   # auto: what the checkpoint stored quantized but could not be taken as it is
        types = getattr(model, "checkpoint_types", {})
        was_quantized = {name.rsplit(".", 1)[0] for name in types}
        low = {name.rsplit(".", 1)[0] for name, t in types.items() if t.startswith(_LOW_BITS)}
        model.quantize_(QuantSpec("int8", BLOCK), QuantSpec("int8", BLOCK),
                        only=lambda n: n in was_quantized and n not in low)
        model.quantize_(QuantSpec("int4", BLOCK), QuantSpec("int8", BLOCK), only=lambda n: n in low)


def wants_calibration(model) -> bool:
    """Whether batched steps run W8A8 copies that want SmoothQuant factors: MINILLM_QGEMM_BATCHED=w8a8 and a CPU
    model with weight-only quantized layers."""
    if kernels().qgemm_batched != "w8a8":
        return False
    return any(m.quant is not None and m.quant.act is None and m.quant.qweight.device.type == "cpu"
               for _, m in model.quantizable())


def describe(model) -> str:
    """One line: which formats the model's weights are in, e.g. 'int4 g32 x210, int8 g32 x1', and the extra memory
    held by the copies the kernels built, if any ('+ 140.2 MB kernel copies')."""
    from collections import Counter
    kinds = Counter()
    for _, m in model.quantizable():
        q = m.quant
        kinds["float" if q is None else f"{q.kind}{'+a8' if q.act else ''} g{q.group_size}"] += 1
    extra = cache_bytes(model)
    return ", ".join(f"{k} x{n}" for k, n in sorted(kinds.items())) + (
        f" + {extra / 1e6:.1f} MB kernel copies" if extra else "")


def cache_bytes(model) -> int:
    """Bytes held beyond the weights themselves by the quantized layers' kernel copies (0 until the model has run:
    the tiles, then the batched path's copy once a step has more than cpu_qgemm.TILES_MAX_ROWS rows)."""
    return sum(m.quant.cache_nbytes for _, m in model.quantizable() if m.quant is not None)
