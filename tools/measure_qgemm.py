"""Time every quantized-matmul path per batch size on SmolLM2's layer shapes, in one process (ratios are what count
on a shared machine). Prints the table that minillm/kernels/cpu_qgemm.py's BATCHED_PATH comment quotes; re-run it
when csrc/qgemm.c changes.

    PYTHONPATH=$PWD python tools/measure_qgemm.py [--threads 1] [--rows 1 4 8 16 32 64 128 256] [--repeat 3]

Paths: tiles = the integer kernel on the weights' codes reordered into tiles (csrc/qgemm.c; the default up to
TILES_MAX_ROWS rows), C = the same kernel's row loop on the packed weights (where the tiles are not built),
int16 = the int16 GEMM on a packed copy (csrc/int16_gemm.c, the default past TILES_MAX_ROWS rows), w8a8 = the requantized W8A8 copy (FBGEMM),
fp16 = an FBGEMM float16 copy, bf16 = a bfloat16 copy through oneDNN (emulated, slow, on CPUs without AVX-512),
float = a cached float32 copy (= what `--quantization none` runs), dequant =
expand to float32 on every call. Block layers are int4 g32 (the default GGUF's Q4_1), the LM head int8 g32 (Q8_0).
"""
from __future__ import annotations

import argparse
import time

import torch

from minillm.kernels import cpu_qgemm
from minillm.quant.formats import QuantSpec, quantize

SHAPES = [(576, 576, "q/o"), (192, 576, "k/v"), (1536, 576, "gate/up"), (576, 1536, "down"),
          (49152, 576, "lm head")]
PATHS = ("tiles", "C", "int16", "w8a8", "fp16", "bf16", "float", "dequant")


def _time_us(fn, min_s: float) -> float:
    fn()
    n, t0 = 0, time.perf_counter()
    while True:
        fn()
        n += 1
        dt = time.perf_counter() - t0
        if dt >= min_s and n >= 2:
            return dt / n * 1e6


def _call(path: str, x: torch.Tensor, qw):
    if path == "tiles":
        return cpu_qgemm.linear_tiles(x, cpu_qgemm.tiles_copy(qw))
    if path == "C":
        return cpu_qgemm.kernel(x, qw)
    return cpu_qgemm.batched(x, qw, path)


def measure(rows: list[int], repeat: int, min_s: float) -> dict:
    """{(shape, path): {rows: best µs}}: the fastest of `repeat` rounds, paths interleaved within each round."""
    best: dict = {}
    for n, k, name in SHAPES:
        g = torch.Generator().manual_seed(n + k)
        spec = QuantSpec("int8", 32) if name == "lm head" else QuantSpec("int4", 32)
        qw = quantize(torch.randn(n, k, generator=g) * 0.05, spec)
        for m in rows:
            x = torch.randn(m, k, generator=g)
            for _ in range(repeat):
                for path in PATHS:
                    us = _time_us(lambda: _call(path, x, qw), min_s)
                    key = (f"{n}x{k} {name}", path)
                    best.setdefault(key, {})[m] = min(best.get(key, {}).get(m, float("inf")), us)
    return best


def table(best: dict, rows: list[int]) -> str:
    lines = [f"{'shape':<20} {'path':<8}" + "".join(f"{m:>8}" for m in rows) + " rows (µs per call)"]
    for (shape, path), by_m in best.items():
        lines.append(f"{shape:<20} {path:<8}" + "".join(f"{by_m[m]:8.0f}" for m in rows))
    fastest = []
    for shape in dict.fromkeys(s for s, _ in best):
        win = [min(PATHS, key=lambda p: best[(shape, p)][m]) for m in rows]
        fastest.append(f"{shape:<20} {'fastest':<8}" + "".join(f"{w:>8}" for w in win))
    return "\n".join(lines + fastest)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 16, 32, 64, 128, 256])
    ap.add_argument("--repeat", type=int, default=3, help="rounds; each path keeps its fastest")
    ap.add_argument("--min-seconds", type=float, default=0.05, help="time per measurement")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    print(f"torch {torch.__version__}, {a.threads} thread(s), TILES_MAX_ROWS={cpu_qgemm.TILES_MAX_ROWS}, "
          f"BATCHED_PATH={cpu_qgemm.BATCHED_PATH}")
    print(table(measure(a.rows, a.repeat, a.min_seconds), a.rows))


if __name__ == "__main__":
    main()
