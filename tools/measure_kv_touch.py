"""Time the first writes into a fresh KV pool, per way of allocating it, each in its own child process (so no run
inherits another's already-faulted memory). What minillm/kv/cache.py's zeros_lazily comment quotes.

    PYTHONPATH=$PWD python tools/measure_kv_touch.py [--repeat 2] [--steps 400] [--seqs 40]

The pool has SmolLM2's float32 shape per layer and the default engine's size (30 layers x 3 KV heads x 46,592 slots
x 64 = 2 GiB per K); each step writes one token for each of --seqs sequences into every layer, as a decode step
does, so every new block's first write touches one fresh 4 KiB page per (layer, head).
  mmap         an anonymous mmap (what KVCache uses)
  numpy        np.zeros (calloc; numpy advises huge pages for it)
  numpy-small  np.zeros with numpy's huge-page advice turned off
  torch        torch.zeros (writes every byte up front: the allocation is timed too)
"""
from __future__ import annotations

import argparse
import mmap
import subprocess
import sys
import time

WAYS = ("mmap", "numpy", "numpy-small", "torch")
SLOTS, LAYERS, HEADS, DIM = 46_592, 30, 3, 64


def child(way: str, steps: int, seqs: int) -> float:
    import numpy as np
    import torch
    torch.set_num_threads(2)
    shape = (LAYERS, HEADS, SLOTS, DIM)
    nbytes = LAYERS * HEADS * SLOTS * DIM * 4
    t0 = time.perf_counter()
    if way == "mmap":
        k = torch.frombuffer(mmap.mmap(-1, nbytes), dtype=torch.uint8).view(torch.float32).view(shape)
    elif way.startswith("numpy"):
        if way == "numpy-small":
            np.core.multiarray._set_madvise_hugepage(False)
        k = torch.from_numpy(np.zeros(nbytes, dtype=np.uint8)).view(torch.float32).view(shape)
    else:
        k = torch.zeros(shape)
    x = torch.randn(seqs, HEADS, DIM)
    stride = SLOTS // seqs
    for step in range(steps):
        slots = torch.arange(seqs) * stride + step
        for i in range(LAYERS):
            k[i].index_copy_(1, slots, x.transpose(0, 1))
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--seqs", type=int, default=40)
    ap.add_argument("--child", choices=WAYS, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(child(a.child, a.steps, a.seqs))
        return
    best: dict[str, float] = {}
    for _ in range(a.repeat):
        for way in WAYS:
            out = subprocess.run([sys.executable, __file__, "--child", way, "--steps", str(a.steps), "--seqs",
                                  str(a.seqs)], capture_output=True, text=True, check=True).stdout
            best[way] = min(best.get(way, float("inf")), float(out.split()[-1]))
    for way in WAYS:
        print(f"{way:12s} {best[way]:6.2f} s   {best[way] / best['mmap']:5.2f}x mmap")


if __name__ == "__main__":
    main()
