"""Time the GPU paths on a CUDA machine: the Triton dequant-matmul (kernels/triton_qgemm.py) against cuBLAS fp16 on
Llama-3-8B-shaped layers, and the Triton PagedAttention decode kernel over fp16 vs int8 KV pools.

    TRITON_INTERPRET=0 PYTHONPATH=$PWD python tools/bench_gpu_qgemm.py [--json out.json] [--sweep]

Per layer shape and row count: µs per call (triton.testing.do_bench, median), the weight bytes the call must read,
the rate that implies (GB/s; at few rows a linear layer is bound by streaming its weights) and the time relative to
fp16. --sweep also times a grid of tile configurations at decode (1 row) and prints the fastest, to check
tile_config's choice. Each product is checked against the dequantized float32 reference before it is timed.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F

SHAPES = {"qkv 6144x4096": (6144, 4096), "gate_up 28672x4096": (28672, 4096), "down 4096x14336": (4096, 14336)}
ROWS = (1, 16, 256)
FORMATS = (("int4 g32", "int4", 32), ("int4 g128", "int4", 128), ("int8/ch", "int8", None))


def _bench(fn) -> float:
    from triton.testing import do_bench
    return do_bench(fn, warmup=10, rep=50, return_mode="median") * 1e3   # µs


def _weights(n: int, k: int, kind: str, group: int | None):
    from minillm.quant.formats import QuantizedWeight, QuantSpec, quantize
    qw = quantize(torch.randn(n, k) * 0.02, QuantSpec(kind, group) if group else QuantSpec(kind))
    return QuantizedWeight(qw.kind, *(None if t is None else t.cuda() for t in (qw.qweight, qw.scales, qw.mins)),
                           qw.group_size)


def _check(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> float:
    ref = x.float() @ w.T
    return float((y.float() - ref).norm() / ref.norm())


def linear_table(sweep: bool) -> list[dict]:
    from minillm.kernels.triton_qgemm import TileConfig, qlinear_triton, tile_config
    rows_out = []
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for label, (n, k) in SHAPES.items():
        w16 = (torch.randn(n, k, device="cuda") * 0.02).half()
        for fmt, kind, group in FORMATS:
            qw = _weights(n, k, kind, group)
            wf = qw.dequantize(torch.float32)
            for m in ROWS:
                x = torch.randn(m, k, device="cuda").half()
                err = _check(qlinear_triton(x, qw), x, wf)
                t_q = _bench(lambda: qlinear_triton(x, qw))
                t_16 = _bench(lambda: F.linear(x, w16))
                c = tile_config(m, n, k, sms)
                row = {"layer": label, "format": fmt, "rows": m, "us": round(t_q, 1), "fp16_us": round(t_16, 1),
                       "x_fp16": round(t_16 / t_q, 2), "weight_MB": round(qw.nbytes / 1e6, 1),
                       "GB_s": round(qw.nbytes / t_q / 1e3, 0), "fp16_GB_s": round(2 * n * k / t_16 / 1e3, 0),
                       "rel_err": float(f"{err:.2e}"), "config": [c.block_m, c.block_n, c.block_k, c.split_k]}
                rows_out.append(row)
                print(json.dumps(row), flush=True)
            if sweep and kind == "int4" and group == 32 and n * k < 28672 * 4096:
                x = torch.randn(1, k, device="cuda").half()
                best = []
                for bn in (32, 64, 128):
                    for bk in (64, 128, 256):
                        for split in (1, 4, 16):
                            if split > -(-k // bk):
                                continue
                            cfg = TileConfig(16, bn, bk, split)
                            try:
                                err = _check(qlinear_triton(x, qw, cfg), x, wf)
                                best.append((_bench(lambda: qlinear_triton(x, qw, cfg)), cfg, err))
                            except Exception as e:  # noqa: BLE001 - a config the compiler refuses is reported
                                print(f"  sweep {label} {fmt} {cfg}: {type(e).__name__}: {str(e)[:120]}")
                best.sort(key=lambda b: b[0])
                chosen = tile_config(1, n, k, sms)
                t_chosen = next((t for t, cfg, _ in best if cfg == chosen), None)
                print(f"  sweep {label} {fmt} 1 row: best {[(round(t, 1), c) for t, c, _ in best[:3]]}; "
                      f"tile_config {chosen} {t_chosen and round(t_chosen, 1)} us; max rel err "
                      f"{max(e for _, _, e in best):.1e}", flush=True)
    return rows_out


def attention_table() -> list[dict]:
    """Decode attention for 32 sequences x 1024 cached tokens, Llama-3-8B heads (32 query, 8 KV, head_dim 128)."""
    from minillm.config import ModelConfig
    from minillm.kernels.triton_paged_attention import paged_attention_decode_triton
    from minillm.kv.cache import KVCache
    cfg = ModelConfig(vocab_size=8, hidden_size=4096, intermediate_size=8, num_layers=1, num_heads=32,
                      num_kv_heads=8, head_dim=128)
    S, L, bs = 32, 1024, 16
    out = []
    blocks = S * L // bs
    tables = torch.randperm(blocks, device="cuda").view(S, L // bs).int()
    lens = torch.full((S,), L, dtype=torch.int32, device="cuda")
    q = torch.randn(S, 32, 128, device="cuda").half()
    ref = None
    k = torch.randn(blocks * bs, 8, 128, device="cuda")    # the same K/V in both pools
    v = torch.randn(blocks * bs, 8, 128, device="cuda")
    for dtype in (torch.float16, torch.int8):
        cache = KVCache(cfg, blocks, bs, dtype=dtype, device="cuda")
        cache.write(0, k, v, torch.arange(blocks * bs, device="cuda"))
        kc, vc = cache.layer(0)
        scales = cache.layer_scale_views(0) if dtype == torch.int8 else (None, None)
        fn = lambda: paged_attention_decode_triton(q, kc, vc, tables, lens, 128 ** -0.5,  # noqa: E731
                                                   k_scale=scales[0], v_scale=scales[1])
        y = fn().float()
        ref = y if ref is None else ref
        t = _bench(fn)
        nbytes = 2 * S * L * 8 * (128 * (1 if dtype == torch.int8 else 2) + (2 if dtype == torch.int8 else 0))
        row = {"attention": f"{S} seqs x {L} tokens", "kv": str(dtype).replace("torch.", ""), "us": round(t, 1),
               "KV_MB": round(nbytes / 1e6, 1), "GB_s": round(nbytes / t / 1e3, 0),
               "rel_diff_vs_fp16": float(f"{float((y - ref).norm() / ref.norm()):.2e}")}
        out.append(row)
        print(json.dumps(row), flush=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument("--sweep", action="store_true", help="also time a grid of decode tile configurations")
    args = ap.parse_args()
    if not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1":
        print("needs a CUDA GPU and TRITON_INTERPRET unset or 0", file=sys.stderr)
        return 2
    print(f"device: {torch.cuda.get_device_name(0)}, torch {torch.__version__}", flush=True)
    result = {"device": torch.cuda.get_device_name(0), "linear": linear_table(args.sweep),
              "attention": attention_table()}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
