"""The labs' figures: one function per figure, so a lab shows one call where the figure goes and keeps its cells for
what it measures.

Each function takes what the lab measured (plain lists, dicts, arrays or CPU tensors; never an engine), draws the
figure and shows it. With `show=False` it returns the matplotlib Figure instead (tests read its contents). Nothing
here computes a result the lab reports: the numbers are the lab's, this module only lays them out.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.colors import ListedColormap
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Rectangle


def _done(fig: Figure, show: bool) -> Figure | None:
    fig.tight_layout()
    if show:
        plt.show()
        return None
    return fig


def _np(x) -> np.ndarray:
    """A float64 array from a list, a numpy array or a (CPU) torch tensor."""
    if hasattr(x, "detach"):
        x = x.detach().cpu().double().numpy()
    return np.asarray(x, dtype=np.float64)


# ---------------------------------------------------------------- lab00: anatomy of inference

def weight_bytes(groups: Mapping[str, float], show: bool = True) -> Figure | None:
    """lab00: bytes of float32 weights per kind of layer (name -> bytes), largest at the top."""
    fig, ax = plt.subplots(figsize=(7, 2.8))
    names = sorted(groups, key=groups.get)
    ax.barh(names, [groups[n] / 1e6 for n in names], color="tab:blue")
    for i, n in enumerate(names):
        ax.text(groups[n] / 1e6, i, f" {groups[n] / 1e6:.1f} MB", va="center")
    ax.set_xlabel("MB of float32 weights (all 30 layers)")
    ax.set_title("SmolLM2-135M: what a decode step has to read")
    ax.set_xlim(0, max(groups.values()) / 1e6 * 1.25)
    return _done(fig, show)


def roofline(points: Sequence[tuple[str, int, float, float, float]], peak_flops: float, bandwidth: float,
             show: bool = True) -> Figure | None:
    """lab00: measured phases on the roofline. points: (label, tokens, flops, bytes, seconds) each."""
    fig, ax = plt.subplots(figsize=(7, 4.2))
    ai = [10 ** (x / 20) for x in range(-20, 61)]
    ax.loglog(ai, [min(peak_flops, a * bandwidth) / 1e9 for a in ai], "k-",
              label="roofline: min(peak, intensity × bandwidth)")
    for label, tokens, flops, nbytes, secs in points:
        ax.loglog(flops / nbytes, flops / secs / 1e9, "o", ms=8, label=f"{label}: {tokens / secs:.0f} tok/s")
    ax.axvline(peak_flops / bandwidth, color="gray", ls=":", lw=1)
    ax.set_xlabel("arithmetic intensity (FLOP / byte)")
    ax.set_ylabel("achieved GFLOP/s")
    ax.set_title("SmolLM2-135M float32 on this CPU")
    ax.legend(fontsize=8, loc="lower right")
    return _done(fig, show)


# ---------------------------------------------------------------- lab01: the KV cache

def kv_cache_keys(keys, prompt_len: int, num_kv_heads: int, head_dim: int, cache_mib: float,
                  show: bool = True) -> Figure | None:
    """lab01: |K| of one layer's cache, keys [positions, kv_heads * head_dim]: the filled prompt slots, then the
    reserved empty ones."""
    k = np.abs(_np(keys))
    fig, ax = plt.subplots(figsize=(8, 3.2))
    im = ax.imshow(k.T, aspect="auto", cmap="magma", interpolation="nearest")
    ax.axvline(prompt_len - 0.5, color="cyan", lw=1)
    for h in range(1, num_kv_heads):
        ax.axhline(h * head_dim - 0.5, color="white", lw=0.5)
    ax.set_xlabel(f"position ({prompt_len} prompt tokens filled | reserved, empty)")
    ax.set_ylabel("kv head × dim")
    ax.set_title(f"|K| in layer 0 of the KV cache — cache holds {cache_mib:.1f} MiB for {k.shape[0]} slots")
    fig.colorbar(im, ax=ax, fraction=0.03)
    return _done(fig, show)


def fitted_total(lengths: Sequence[float], ms: Sequence[float], upto: int) -> tuple[np.ndarray, np.ndarray]:
    """Least-squares line through measured step times (ms at each length), summed over steps 1..upto: the seconds
    it takes to generate 1, 2, ..., upto tokens (each step at least the fastest one measured)."""
    x, y = _np(lengths), _np(ms)
    slope = ((x - x.mean()) * (y - y.mean())).sum() / ((x - x.mean()) ** 2).sum()
    ns = np.arange(1, upto + 1, dtype=np.float64)
    return ns, np.cumsum(np.maximum(y.mean() + slope * (ns - x.mean()), y.min())) / 1000


def cache_vs_recompute(lengths: Sequence[int], cached_ms: Sequence[float], recompute_ms: Sequence[float],
                       show: bool = True) -> Figure | None:
    """lab01: one decode step with and without the KV cache, and the total time those steps add up to."""
    fig, ax = plt.subplots(1, 2, figsize=(10, 3.4))
    ax[0].plot(lengths, recompute_ms, "o-", label="recompute (no cache)")
    ax[0].plot(lengths, cached_ms, "o-", label="KV cache")
    ax[0].set_xlabel("sequence length n")
    ax[0].set_ylabel("ms for the step producing token n+1")
    ax[0].set_ylim(bottom=0)
    ax[0].legend()
    ax[1].plot(*fitted_total(lengths, recompute_ms, max(lengths)), label="recompute: O(n²)")
    ax[1].plot(*fitted_total(lengths, cached_ms, max(lengths)), label="KV cache: O(n)")
    ax[1].set_xlabel("tokens generated")
    ax[1].set_ylabel("total seconds (from the measured steps)")
    ax[1].legend()
    return _done(fig, show)


# ---------------------------------------------------------------- lab02: paged KV cache

def block_tables(rows: Sequence[tuple[str, Sequence[int]]], refs: Sequence[int], title: str,
                 show: bool = True) -> Figure | None:
    """lab02: each sequence's block table (rows: (label, block ids); "r1 #0", "r1 #1" are one request's samples) and
    the pool of physical blocks (refs: each block's reference count), shared blocks marked."""
    colours: dict[str, tuple] = {}
    for name, _ in rows:
        colours.setdefault(name.split(" #")[0], plt.cm.tab10(len(colours) % 10))
    width, n = max(len(t) for _, t in rows), len(refs)
    fig, (ax, ax2) = plt.subplots(2, 1, figsize=(10, 0.42 * len(rows) + 2.4),
                                  gridspec_kw=dict(height_ratios=[max(len(rows), 2), 1.4]))
    for i, (name, table) in enumerate(rows):
        for j, b in enumerate(table):
            shared = refs[b] > 1
            ax.add_patch(Rectangle((j, i), 1, 1, fc="#f5a623" if shared else "#cfe3f7", ec="white", lw=2))
            ax.text(j + 0.5, i + 0.5, str(b), ha="center", va="center", fontsize=9,
                    fontweight="bold" if shared else "normal")
    ax.set_xlim(0, width)
    ax.set_ylim(len(rows), 0)
    ax.set_yticks([i + 0.5 for i in range(len(rows))], [name for name, _ in rows])
    ax.set_xticks([j + 0.5 for j in range(width)], [str(j) for j in range(width)])
    ax.set_xlabel("logical block (cell = physical block id; orange = shared, ref count > 1)")
    ax.set_title(title)
    owner: dict[int, str] = {}
    for name, table in rows:
        for b in table:
            owner.setdefault(b, name.split(" #")[0])
    for b in range(n):
        fc = colours[owner[b]] if b in owner else "white"
        ax2.add_patch(Rectangle((b, 0), 1, 1, fc=fc, ec="grey", lw=0.5, hatch="//" if refs[b] > 1 else None))
    ax2.set_xlim(0, n)
    ax2.set_ylim(0, 1)
    ax2.set_yticks([])
    ax2.set_xlabel(f"physical block id — the pool of {n} blocks (colour = owning request, hatched = shared, "
                   "white = free)")
    ax2.legend(handles=[Rectangle((0, 0), 1, 1, fc=c) for c in colours.values()], labels=list(colours),
               ncol=len(colours), loc="upper center", bbox_to_anchor=(0.5, -0.9), frameon=False, fontsize=8)
    return _done(fig, show)


def kv_pool_trace(trace: Sequence[Mapping[str, int]], pool_blocks: int, block_size: int, max_model_len: int,
                  show: bool = True) -> Figure | None:
    """lab02: blocks in use at each engine step (trace: {"running", "used", "tokens"} per step) against what a
    contiguous cache reserving max_model_len per sequence would hold."""
    steps = range(1, len(trace) + 1)
    fig, ax = plt.subplots(figsize=(9, 3.6))
    ax.plot(steps, [t["used"] for t in trace], "o-", ms=3, label="paged: blocks in use (your block manager)")
    ax.plot(steps, [t["tokens"] / block_size for t in trace], "--", label="computed tokens / block_size (no sharing)")
    ax.plot(steps, [t["running"] * (max_model_len // block_size) for t in trace], ":", lw=2,
            label="contiguous: running × max_model_len / block_size")
    ax.axhline(pool_blocks, color="black", lw=1)
    ax.text(1, pool_blocks + 1, f"pool: {pool_blocks} blocks", fontsize=8)
    ax.set_xlabel("engine step")
    ax.set_ylabel(f"blocks of {block_size} slots")
    ax.legend(fontsize=8, loc="upper right")
    ax.set_title("KV pool during the plug-in run")
    return _done(fig, show)


def block_size_sweep(rows: Sequence[Mapping[str, float]], show: bool = True) -> Figure | None:
    """lab02: waste and concurrency against block_size (rows: minillm.bench.kv.kv_bench results, one per size)."""
    sizes = [r["block_size"] for r in rows]
    fig, ax = plt.subplots(1, 2, figsize=(10, 3.6))
    ax[0].plot(sizes, [100 * r["paged_waste_frac"] for r in rows], "o-", label="paged")
    ax[0].plot(sizes, [100 * r["contiguous_waste_frac"] for r in rows], "s--", label="contiguous (2048/seq)")
    ax[0].set_ylabel("% of reserved KV slots unused")
    ax[1].plot(sizes, [r["paged_max_concurrency"] for r in rows], "o-", label="paged")
    ax[1].plot(sizes, [r["contiguous_max_concurrency"] for r in rows], "s--", label="contiguous (2048/seq)")
    ax[1].set_ylabel("max sequences running at once")
    for a in ax:
        a.set_xscale("log", base=2)
        a.set_xlabel("block_size (tokens)")
        a.set_ylim(bottom=0)
        a.legend()
    return _done(fig, show)


# ---------------------------------------------------------------- lab03: PagedAttention

def block_table_chains(tables: Mapping[str, Sequence[int]], lens: Mapping[str, int], ref_counts: Mapping[int, int],
                       block_size: int, show: bool = True) -> Figure | None:
    """lab03: where each running sequence's blocks sit in the pool (tables: request -> block ids; lens: tokens with
    KV cached; ref_counts: block -> reference count), linked in logical order."""
    fig, ax = plt.subplots(figsize=(10, 2.8))
    colors = plt.cm.tab10.colors
    used = sorted({b for t in tables.values() for b in t})
    for b in used:
        if ref_counts[b] > 1:                               # one physical block in several tables
            ax.axvspan(b - 0.5, b + 0.5, color="0.9", zorder=0)
    for row, (rid, table) in enumerate(tables.items()):
        ax.plot(table, [row] * len(table), "-", color=colors[row], alpha=0.35, lw=6, solid_capstyle="round")
        for i, b in enumerate(table):
            full = min(block_size, lens[rid] - block_size * i) / block_size
            ax.scatter([b], [row], s=330, color=colors[row], alpha=0.35 + 0.65 * full, zorder=3)
            ax.annotate(str(i), (b, row), ha="center", va="center", fontsize=8, color="white", zorder=4)
        for i in range(len(table) - 1):
            ax.annotate("", xy=(table[i + 1], row + 0.18), xytext=(table[i], row + 0.18),
                        arrowprops=dict(arrowstyle="->", color=colors[row], lw=0.8, connectionstyle="arc3,rad=-0.3"))
    ax.set_yticks(range(len(tables)), [f"request {rid}: {lens[rid]} tokens" for rid in tables])
    ax.set_xticks(range(max(used) + 2))
    ax.set_xlim(-0.8, max(used) + 1.5)
    ax.set_xlabel("physical block id in the KV pool (number in a dot = logical block index; pale = partly filled)")
    ax.set_ylim(-0.6, len(tables) - 0.4)
    ax.set_title(f"block tables of {len(tables)} running sequences (block_size {block_size}; grey = block shared by "
                 "several tables)")
    return _done(fig, show)


def online_softmax_history(history: Sequence[tuple[Sequence[float], Sequence[float]]],
                           show: bool = True) -> Figure | None:
    """lab03: the running max m and running sum l of each query head after each block (history: (m, l) per block,
    each with one value per head)."""
    m = np.stack([_np(hm) for hm, _ in history])             # [blocks, heads]
    sums = np.stack([_np(hl) for _, hl in history])
    fig, ax = plt.subplots(1, 2, figsize=(10, 3))
    blocks = range(len(history))
    for h in range(m.shape[1]):
        ax[0].step(blocks, m[:, h], where="post", marker="o", label=f"query head {h}")
        ax[1].plot(blocks, sums[:, h], marker="o", label=f"query head {h}")
    ax[0].set_title("running max m after each block")
    ax[1].set_title("running sum l (relative to the current m)")
    for a in ax:
        a.set_xlabel("block")
        a.legend(fontsize=8)
    return _done(fig, show)


def kernel_time_and_error(rows: Sequence[tuple], show: bool = True) -> Figure | None:
    """lab03: time and error of the decode kernel against gather + dense and dense attention. rows: (L, blocks,
    kernel s, gather s, dense s, kernel error, gather error, dense error) per sequence length L."""
    lengths = [r[0] for r in rows]
    fig, ax = plt.subplots(1, 2, figsize=(10, 3.3))
    ax[0].plot(lengths, [r[2] * 1e3 for r in rows], "o-", label="your kernel (Triton interpreter)")
    ax[0].plot(lengths, [r[3] * 1e3 for r in rows], "s-", label="gather_kv + dense attention")
    ax[0].plot(lengths, [r[4] * 1e3 for r in rows], "^-", label="dense attention (contiguous K/V)")
    ax[0].set_yscale("log")
    ax[0].set_xlabel("sequence length (tokens)")
    ax[0].set_ylabel("ms per decode call")
    ax[0].legend(fontsize=8)
    ax[0].set_title("time: the interpreter measures correctness, not speed")
    for i, name in ((5, "your kernel"), (6, "gather + dense"), (7, "dense")):
        ax[1].plot(lengths, [r[i] for r in rows], "o-", label=name)
    ax[1].set_yscale("log")
    ax[1].set_ylim(1e-9, 1e-4)
    ax[1].set_xlabel("sequence length (tokens)")
    ax[1].set_ylabel("max |out - float64 reference|")
    ax[1].legend(fontsize=8)
    ax[1].set_title("error: float32 rounding only")
    return _done(fig, show)


# ---------------------------------------------------------------- lab04: scheduling

TIMELINE_STATES = ["not arrived", "waiting", "running, not scheduled", "prefill chunk", "decode", "recompute"]
TIMELINE_COLORS = ["white", "#d9d9d9", "#fee391", "#3182bd", "#31a354", "#fd8d3c"]


def timeline(steps: Sequence[Mapping], n_requests: int, title: str, pool_blocks: int | None = None,
             budget: int | None = None, show: bool = True) -> Figure | None:
    """lab04: Gantt chart of a recorded run, one row per request and one column per engine step, over the tokens
    each step ran (and the KV blocks in use). steps: {"waiting": [rid], "idle": [rid], "run": [(rid, tokens, kind)],
    "preempted": [rid], "kv_blocks": n} per step; kind is "prefill", "decode" or "recompute"."""
    states, colors = TIMELINE_STATES, TIMELINE_COLORS
    grid = np.zeros((n_requests, len(steps)), dtype=int)
    for k, st in enumerate(steps):
        for r in st["waiting"]:
            grid[int(r), k] = 1
        for r in st["idle"]:
            grid[int(r), k] = 2
        for r, n, kind in st["run"]:
            grid[int(r), k] = {"prefill": 3, "decode": 4, "recompute": 5}[kind]
    fig, (ax, ax2) = plt.subplots(2, 1, figsize=(11, 5.2), sharex=True, gridspec_kw={"height_ratios": [3, 2]})
    ax.imshow(grid, aspect="auto", cmap=ListedColormap(colors), vmin=0, vmax=len(colors) - 1,
              interpolation="nearest")
    for k, st in enumerate(steps):
        for r, n, kind in st["run"]:
            if kind != "decode":
                ax.text(k, int(r), str(n), ha="center", va="center", fontsize=6, color="white")
        for r in st["preempted"]:
            ax.plot(k, int(r), marker="x", color="red", ms=7, mew=2)
    ax.set_yticks(range(n_requests))
    ax.set_yticklabels([f"request {i}" for i in range(n_requests)])
    shown = [i for i in range(1, len(states)) if (grid == i).any()]
    handles = [Rectangle((0, 0), 1, 1, color=colors[i], ec="gray") for i in shown]
    handles.append(Line2D([], [], marker="x", color="red", ls="", mew=2))
    ax.legend(handles, [states[i] for i in shown] + ["preempted"], ncol=6, fontsize=7, loc="upper center",
              bbox_to_anchor=(0.5, 1.17), frameon=False)
    ax.set_title(title, pad=24)
    pre = [sum(n for _, n, kind in st["run"] if kind != "decode") for st in steps]
    dec = [sum(n for _, n, kind in st["run"] if kind == "decode") for st in steps]
    ax2.bar(range(len(steps)), pre, color=colors[3], label="prefill / recompute tokens")
    ax2.bar(range(len(steps)), dec, bottom=pre, color=colors[4], label="decode tokens")
    if budget:
        ax2.axhline(budget, color="black", ls="--", lw=0.8, label="token budget")
        ax2.set_ylim(0, budget * 1.25)
    ax2.set_ylabel("tokens in the step")
    ax2.set_xlabel("engine step")
    if pool_blocks:
        ax3 = ax2.twinx()
        ax3.plot([st["kv_blocks"] for st in steps], color="purple", lw=1.5, label="KV blocks in use")
        ax3.axhline(pool_blocks, color="purple", ls=":", lw=1)
        ax3.set_ylim(0, pool_blocks * 1.15)
        ax3.set_ylabel("KV blocks in use", color="purple")
    ax2.legend(fontsize=7, loc="upper right")
    return _done(fig, show)


def static_vs_continuous(results: Mapping[str, Mapping], show: bool = True) -> Figure | None:
    """lab04: throughput, TTFT and TPOT percentiles, and step time against batch size, for "static" and
    "continuous" batching. results[name]: {"tok_s", "ttft": [s], "tpot": [s], "steps": [{"run", "seconds"}]}."""
    fig, ax = plt.subplots(1, 4, figsize=(14, 3.6))
    names, colors = ["static", "continuous"], ["tab:gray", "tab:green"]
    bars = ax[0].bar(names, [results[n]["tok_s"] for n in names], color=colors)
    ax[0].bar_label(bars, fmt="%.1f")
    ax[0].set_ylabel("output tokens / s")
    ax[0].set_title("throughput")
    for j, (metric, unit, scale) in enumerate([("ttft", "s", 1), ("tpot", "ms", 1000)], start=1):
        qs = [50, 90, 99]
        x = np.arange(len(qs))
        for i, n in enumerate(names):
            values = results[n][metric]     # linear interpolation between ranks, as minillm.bench's percentile
            ax[j].bar(x + (i - 0.5) * 0.38, [scale * float(np.percentile(values, q)) if len(values) else np.nan
                                             for q in qs], 0.38, color=colors[i], label=n)
        ax[j].set_xticks(x, [f"p{q}" for q in qs])
        ax[j].set_ylabel(unit)
        ax[j].set_title(metric.upper())
        ax[j].legend(fontsize=8)
    for i, n in enumerate(names):
        decode_only = [s for s in results[n]["steps"] if all(k == "decode" for _, _, k in s["run"])]
        ax[3].scatter([len(s["run"]) + 0.08 * (i - 0.5) for s in decode_only],
                      [1000 * s["seconds"] for s in decode_only], s=10, alpha=0.6, color=colors[i], label=n)
    ax[3].set_xlabel("sequences in the step (decode-only steps)")
    ax[3].set_ylabel("step time (ms)")
    ax[3].set_title("batch size vs step time")
    ax[3].legend(fontsize=8)
    return _done(fig, show)


# ---------------------------------------------------------------- lab05: prefix caching

def prefix_chains(rows: Sequence[tuple[str, Sequence[int], tuple]], block_size: int, title: str,
                  show: bool = True) -> Figure | None:
    """lab05: block tables at admission, each block with its physical id and chained hash, coloured by whether the
    prefix cache served it. rows: (label, prompt ids, (block table, hashes, cached tokens, ...)); the first two
    prompts' common prefix is marked."""
    fig, ax = plt.subplots(figsize=(11, 0.9 + 0.75 * len(rows)))
    colors = {"hit": "#7fc97f", "computed": "#fdb462", "partial": "#d9d9d9"}
    for r, (label, ids, (table, hashes, cached, *_)) in enumerate(rows):
        y = len(rows) - 1 - r
        for i, b in enumerate(table):
            full = (i + 1) * block_size <= len(ids)
            kind = "hit" if i < cached // block_size else ("computed" if full else "partial")
            ax.add_patch(Rectangle((i, y + 0.1), 0.94, 0.8, color=colors[kind]))
            h = hashes[i]
            ax.text(i + 0.47, y + 0.5, f"#{b}\n{h:032x}"[:len(str(b)) + 7] if h is not None else f"#{b}\n—",
                    ha="center", va="center", fontsize=8, family="monospace")
        ax.text(-0.2, y + 0.5, label, ha="right", va="center", fontsize=9)
    a, b = rows[0][1], rows[1][1]
    shared = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)        # where the two prompts diverge
    ax.axvline(shared / block_size, color="k", ls="--", lw=1)
    ax.text(shared / block_size, len(rows) + 0.05, f" A and B diverge after token {shared}: system prompt + "
            "user tag are common", fontsize=8, va="bottom")
    for kind, c in colors.items():
        ax.bar(0, 0, color=c, label={"hit": "from the cache (hit)", "computed": "computed, then cached",
                                     "partial": "partial block (not cached)"}[kind])
    ax.legend(loc="lower right", fontsize=8, ncol=3, bbox_to_anchor=(1, -0.45))
    ax.set_xlim(-0.1, max(len(r[2][0]) for r in rows) + 0.1)
    ax.set_ylim(0, len(rows) + 0.5)
    ax.set_xlabel(f"block index in the sequence (×{block_size} tokens)")
    ax.set_yticks([])
    ax.set_title(title)
    return _done(fig, show)


def prefix_cache_ttft(results: Mapping[str, Mapping], show: bool = True) -> Figure | None:
    """lab05: mean TTFT with the prefix cache off and on per workload, and TTFT per turn of the multi-turn one.
    results[name]: {"off": [s], "on": [s], "lens": [tokens], "cached": [tokens], "hit_rate": fraction}; the first
    request of each workload (a cold cache) is left out of the means."""
    fig, ax = plt.subplots(1, 2, figsize=(11, 3.8))
    names = list(results)
    x = range(len(names))
    off = [1000 * float(np.mean(results[n]["off"][1:])) for n in names]
    on = [1000 * float(np.mean(results[n]["on"][1:])) for n in names]
    ax[0].bar([i - 0.2 for i in x], off, width=0.4, label="prefix cache off", color="tab:gray")
    ax[0].bar([i + 0.2 for i in x], on, width=0.4, label="on (your block manager)", color="tab:green")
    for i, n in enumerate(names):
        ax[0].text(i + 0.2, on[i], f"{off[i] / on[i]:.1f}×\nhit {results[n]['hit_rate']:.0%}", ha="center",
                   va="bottom", fontsize=8)
    ax[0].set_xticks(list(x))
    ax[0].set_xticklabels(names, fontsize=8)
    ax[0].set_ylabel("mean TTFT from the 2nd request on (ms)")
    ax[0].set_ylim(0, max(off) * 1.25)
    ax[0].legend(fontsize=8)
    conv = results["multi-turn"]
    ax[1].plot(conv["lens"], [1000 * t for t in conv["off"]], "o-", color="tab:gray", label="prefix cache off")
    ax[1].plot(conv["lens"], [1000 * t for t in conv["on"]], "o-", color="tab:green", label="on")
    for n, t, c in zip(conv["lens"], conv["on"], conv["cached"]):
        ax[1].annotate(f"{n - c} new", (n, 1000 * t), textcoords="offset points", xytext=(0, 6), fontsize=7,
                       ha="center")
    ax[1].set_xlabel("prompt length at this turn (tokens)")
    ax[1].set_ylabel("TTFT (ms)")
    ax[1].set_ylim(bottom=0)
    ax[1].set_title("multi-turn: TTFT per turn", fontsize=10)
    ax[1].legend(fontsize=8)
    return _done(fig, show)


# ---------------------------------------------------------------- lab06: sampling

def _softmax(logits) -> np.ndarray:
    z = _np(logits)
    z = np.exp(z - z.max())
    return z / z.sum()


def next_token_distributions(logits: Mapping[str, Sequence[float]], prompts: Mapping[str, str],
                             token_label: Callable[[int], str], top: int = 30, show: bool = True) -> Figure | None:
    """lab06: the model's next-token distribution (T = 1) after each prompt: the top tokens and their cumulative
    mass. logits[name]: one row of logits; prompts[name]: its text; token_label(id): how a token is written."""
    fig, axes = plt.subplots(1, len(logits), figsize=(12, 3.8), sharey=True, squeeze=False)
    for ax, (name, row) in zip(axes[0], logits.items()):
        p = _softmax(row)
        order = np.argsort(-p, kind="stable")
        top_p = p[order[:top]]
        needed = int((np.cumsum(p[order]) < 0.9).sum()) + 1
        ax.bar(range(top), top_p, color="tab:blue")
        ax.plot(range(top), np.cumsum(top_p), "k.-", lw=1, label="cumulative")
        ax.set_xticks(range(top))
        ax.set_xticklabels([token_label(int(t)) for t in order[:top]], rotation=90, fontsize=7)
        ax.set_title(f"{prompts[name]!r}…\ntop token {top_p[0]:.2f}; 90% of the mass takes {needed} "
                     f"tokens; outside the top {top}: {1 - top_p.sum():.0%}", fontsize=9)
        ax.set_ylim(0, 1)
        ax.legend(fontsize=8, loc="lower right")
    axes[0][0].set_ylabel("probability (T = 1)")
    return _done(fig, show)


def processed_distributions(logits: Mapping[str, Sequence[float]], prompts: Mapping[str, str],
                            settings: Sequence[str], probs, kept, top: int = 30, show: bool = True) -> Figure | None:
    """lab06: what each sampling setting leaves of the model's top tokens, per prompt. probs: [rows, vocab] after
    processing, rows ordered prompt-major (prompt i, setting j is row i * len(settings) + j); kept: tokens left per
    row. A dropped token has no point (its line stops)."""
    probs, kept = _np(probs), _np(kept)
    fig, axes = plt.subplots(1, len(logits), figsize=(12, 4), sharey=True, squeeze=False)
    for i, (ax, name) in enumerate(zip(axes[0], logits)):
        order = np.argsort(-_np(logits[name]), kind="stable")[:top]
        for j, setting in enumerate(settings):
            r = i * len(settings) + j
            y = probs[r, order].copy()
            y[y == 0] = np.nan
            ax.plot(range(1, top + 1), y, ".-", lw=1, label=f"{setting} ({int(kept[r])} kept)")
        ax.set_yscale("log")
        ax.set_xlabel("rank in the model's distribution (T = 1)")
        ax.set_title(f"{prompts[name]!r}…", fontsize=10)
        ax.legend(fontsize=7)
    axes[0][0].set_ylabel("probability after processing")
    return _done(fig, show)


def draws_vs_expected(counts, target, token_label: Callable[[int], str], title: str,
                      show: bool = True) -> Figure | None:
    """lab06: how often each token of the processed distribution was drawn against n · p (tokens with p > 0, most
    likely first). counts: draws per token id; target: the distribution drawn from."""
    counts, target = _np(counts), _np(target)
    n = counts.sum()
    support = int((target > 0).sum())
    order = np.argsort(-target, kind="stable")[:support]
    fig, ax = plt.subplots(figsize=(12, 3.6))
    ax.bar(range(len(order)), n * target[order], color="#cccccc", label="expected: n · p")
    ax.plot(range(len(order)), counts[order], "o", ms=4, color="tab:red", label="your draws")
    ax.set_xticks(range(len(order)))
    ax.set_xticklabels([token_label(int(t)) for t in order], rotation=90, fontsize=7)
    ax.set_ylabel("count")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    return _done(fig, show)


# ---------------------------------------------------------------- lab07: speculative decoding

def spec_steps(rows: Sequence[tuple[Sequence[int], Sequence[int], Sequence[int]]], piece: Callable[[int], str],
               title: str, max_rows: int = 14, show: bool = True) -> Figure | None:
    """lab07: what each engine step of a speculative run did. rows: (drafted ids, kept ids, emitted ids) per step,
    the prefill step first (left out); kept ends with the target's own token. piece(id): how a token is written."""
    rows = rows[1:max_rows + 1]
    fig, ax = plt.subplots(figsize=(12, 0.42 * len(rows) + 1.2))
    colors = {"kept": "#7fc97f", "refused": "#f4868c", "unchecked": "#d9d9d9", "target": "#80b1d3"}
    right = 0.0
    for r, (drafts, kept, emitted) in enumerate(rows):
        y, x = len(rows) - 1 - r, 0.0
        n_kept = len(kept) - 1 if drafts else 0
        cells = [(t, "kept" if j < n_kept else "refused" if j == n_kept else "unchecked")
                 for j, t in enumerate(drafts)]
        cells.append((kept[-1] if drafts else emitted[0], "target"))
        for t, kind in cells:
            if kind == "target":
                x += 0.3                                   # a gap: the guesses, then the target's own token
            text = piece(t)
            w = max(len(text), 2) * 0.105 + 0.1
            ax.add_patch(Rectangle((x, y + 0.12), w - 0.05, 0.76, color=colors[kind]))
            ax.text(x + (w - 0.05) / 2, y + 0.5, text, ha="center", va="center", fontsize=8, family="monospace")
            x += w
        right = max(right, x)
        ax.text(-0.15, y + 0.5, f"step {r + 2}: +{len(emitted)}", ha="right", va="center", fontsize=8)
    for kind, c in colors.items():
        ax.bar(0, 0, color=c, label={"kept": "guess kept", "refused": "first guess refused",
                                     "unchecked": "guess after it (dropped)",
                                     "target": "the target's own token (replacement or bonus)"}[kind])
    ax.legend(loc="upper center", fontsize=8, ncol=4, bbox_to_anchor=(0.5, 0.0))
    ax.set_xlim(-0.1, right + 0.1)
    ax.set_ylim(0, len(rows))
    ax.axis("off")
    ax.set_title(title, fontsize=10)
    return _done(fig, show)


def rejection_frequencies(p, q, freq: Mapping[str, tuple], words: Sequence[str], runs: int, title: str,
                          show: bool = True) -> Figure | None:
    """lab07: the target p, the draft q, and how often each token came out of the rule and of the wrong rule.
    freq: {"your rule": (frequencies, chi-square p-value), "resample from p": (...)}."""
    p, q = _np(p), _np(q)
    fig, ax = plt.subplots(figsize=(11, 3.8))
    xs = np.arange(len(p), dtype=np.float64)
    ax.bar(xs - 0.27, p, width=0.27, color="tab:gray", label="p: the target (SmolLM2, full context)")
    ax.bar(xs, _np(freq["your rule"][0]), width=0.27, color="tab:green",
           label=f"your rule's emitted token, {runs} runs (chi-square p = {freq['your rule'][1]:.2f})")
    ax.bar(xs + 0.27, _np(freq["resample from p"][0]), width=0.27, color="tab:red",
           label=f"wrong rule: resample from p (p = {freq['resample from p'][1]:.1e})")
    ax.plot(xs, q, "k_", markersize=22, mew=2, label="q: the draft (sees only \"lived a\")")
    ax.set_xticks(xs.tolist())
    ax.set_xticklabels([repr(w) for w in words], fontsize=9)
    ax.set_ylabel("probability / frequency")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    return _done(fig, show)


def spec_speedup(rows: Mapping[str, Mapping[str, float]], step_cost: Mapping[int, float], k: int,
                 show: bool = True) -> Figure | None:
    """lab07: decode tokens/s with and without speculation per task (rows[task]: plain_tps, spec_tps, speedup,
    formula, alpha), and what a step feeding n tokens costs in plain steps (step_cost)."""
    fig, ax = plt.subplots(1, 2, figsize=(11.5, 3.9))
    names = list(rows)
    xs = range(len(names))
    ax[0].bar([i - 0.2 for i in xs], [rows[n]["plain_tps"] for n in names], width=0.4, color="tab:gray",
              label="no speculation")
    ax[0].bar([i + 0.2 for i in xs], [rows[n]["spec_tps"] for n in names], width=0.4, color="tab:blue",
              label=f"speculation (your pieces, k = {k})")
    for i, n in enumerate(names):
        r = rows[n]
        ax[0].text(i + 0.2, r["spec_tps"], f"{r['speedup']:.2f}×\nformula {r['formula']:.2f}×\nα = {r['alpha']:.0%}",
                   ha="center", va="bottom", fontsize=8)
    ax[0].set_xticks(list(xs))
    ax[0].set_xticklabels(names)
    ax[0].set_ylabel("decode tokens/s")
    ax[0].set_ylim(0, max(rows[n]["spec_tps"] for n in names) * 1.45)
    ax[0].legend(fontsize=8, loc="upper right")
    sizes = list(step_cost)
    ax[1].plot(sizes, [step_cost[n] for n in sizes], "o-", color="tab:orange", label="this CPU (measured steps)")
    ax[1].plot(sizes, [1.0] * len(sizes), "--", color="tab:gray", label="the formula's assumption (GPU, batch 1)")
    ax[1].set_xticks(sizes)
    ax[1].set_xlabel("tokens fed to the model in one decode step (1 + guesses)")
    ax[1].set_ylabel("step time / plain step time")
    ax[1].set_ylim(bottom=0)
    ax[1].set_title("what verifying k guesses costs", fontsize=10)
    ax[1].legend(fontsize=8)
    return _done(fig, show)


# ---------------------------------------------------------------- lab08: quantization

def int4_round_trip(panels: Mapping[str, tuple], show: bool = True) -> Figure | None:
    """lab08: groups of weights, the 16 levels int4 gives each group (min + scale · q), and where the round trip puts
    every weight. panels[title]: (weights, levels, round-tripped weights), one group each."""
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 3.2), squeeze=False)
    for ax, (title, (weights, levels, back)) in zip(axes[0], panels.items()):
        w, back = _np(weights), _np(back)
        ks = np.arange(len(w))
        for i, v in enumerate(_np(levels)):
            ax.axhline(v, color="tab:orange", lw=0.6, alpha=0.7, label="the 16 int4 levels" if i == 0 else None)
        ax.vlines(ks, np.minimum(w, back), np.maximum(w, back), color="tab:red", lw=1, zorder=2)
        ax.scatter(ks, w, s=14, label="weights", zorder=3)
        ax.scatter(ks, back, s=10, marker="x", color="tab:red", label="after the int4 round trip", zorder=4)
        err = np.abs(back - w)
        ax.set_title(f"{title}\nlargest error {err.max():.4f}, RMS {np.sqrt((err ** 2).mean()):.4f}", fontsize=9)
        ax.set_xlabel(f"input index k (one group of {len(w)})")
    axes[0][0].legend(loc="lower right", fontsize=8)      # one legend: an outlier elsewhere may sit in that corner
    axes[0][0].set_ylabel("weight")
    return _done(fig, show)


def quant_tradeoffs(rows: Sequence[Mapping], show: bool = True) -> Figure | None:
    """lab08: perplexity against bytes per weight, and decode time against MB read per token, one point per format
    (rows: {"name", "bpw", "ppl", "mb", "ms"})."""
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 3.6))
    for r in rows:
        ax1.scatter(r["bpw"], r["ppl"])
        ax1.annotate(r["name"], (r["bpw"], r["ppl"]), textcoords="offset points", xytext=(5, 4))
        ax2.scatter(r["mb"], r["ms"])
        ax2.annotate(r["name"], (r["mb"], r["ms"]), textcoords="offset points", xytext=(5, 4))
    ax1.set_xlabel("bytes per weight read per token")
    ax1.set_ylabel("perplexity (held out)")
    ax1.set_title("memory vs quality")
    ax2.set_xlabel("MB of weights read per token")
    ax2.set_ylabel("decode ms / token")
    ax2.set_title("memory vs decode time (batch 1)")
    return _done(fig, show)


# ---------------------------------------------------------------- lab09: tensor and pipeline parallelism

def heads_per_rank(heads: Mapping[int, Sequence[tuple[Sequence[int], Sequence[int]]]], num_heads: int,
                   num_kv_heads: int, show: bool = True) -> Figure | None:
    """lab09: which query heads and KV heads each rank holds. heads[world]: (query heads, KV heads) per rank."""
    fig, axes = plt.subplots(1, len(heads), figsize=(6 * len(heads), 3.2), squeeze=False)
    for ax, (world, held) in zip(axes[0], heads.items()):
        grid = np.full((world, num_heads + num_kv_heads), np.nan)
        for rank, (q, kv) in enumerate(held):
            grid[rank, list(q)] = rank
            grid[rank, [num_heads + g for g in kv]] = rank
        ax.imshow(grid, cmap="tab10", vmin=0, vmax=9, aspect="auto")
        ax.axvline(num_heads - 0.5, color="k", lw=2)
        ax.set_xticks(range(grid.shape[1]))
        ax.set_xticklabels([f"q{h}" for h in range(num_heads)] + [f"kv{g}" for g in range(num_kv_heads)])
        ax.set_yticks(range(world))
        ax.set_yticklabels([f"rank {r}" for r in range(world)])
        ax.set_title(f"TP={world}: query heads | KV heads held by each rank", fontsize=10)
    return _done(fig, show)


def comm_bytes(table: Mapping[str, Mapping[str, float]], show: bool = True) -> Figure | None:
    """lab09: payload bytes per token crossing the links, per model and scheme (table[model][scheme])."""
    models = list(table)
    schemes = list(next(iter(table.values())))
    fig, ax = plt.subplots(figsize=(10, 3.6))
    width = 0.27
    for i, s in enumerate(schemes):
        ax.bar(np.arange(len(models)) + (i - (len(schemes) - 1) / 2) * width, [table[m][s] for m in models], width,
               label=s)
    ax.set_xticks(range(len(models)))
    ax.set_xticklabels(models)
    ax.set_yscale("log")
    ax.set_ylabel("payload bytes per token (bf16)")
    ax.set_title("what crosses the links for one token: tensor vs pipeline parallelism", fontsize=10)
    ax.legend(fontsize=8)
    return _done(fig, show)


# ---------------------------------------------------------------- lab10: structured outputs

def mask_sizes(allowed: Sequence[int], pieces: Sequence[str], vocab_size: int, show: bool = True) -> Figure | None:
    """lab10: how many tokens the mask allowed at each step of a constrained output (pieces: the tokens emitted)."""
    fig, ax = plt.subplots(figsize=(12, 3.6))
    xs = range(len(allowed))
    ax.bar(xs, allowed, color=["tab:red" if c == 1 else "tab:blue" for c in allowed])
    ax.axhline(vocab_size, color="gray", ls="--", lw=1)
    ax.set_yscale("log")
    ax.set_xticks(list(xs))
    ax.set_xticklabels(pieces, rotation=90, fontsize=8, family="monospace")
    ax.set_ylabel("tokens allowed")
    ax.set_title("what the mask let through at each step (red: exactly one token allowed)", fontsize=10)
    return _done(fig, show)


def mask_costs(per_step: Mapping[str, float], once: Mapping[str, float], batch: int, constrained: int,
               show: bool = True) -> Figure | None:
    """lab10: seconds of what runs every step (a decode step, the masks) and of what runs once per schema
    (compiling, indexing), on log scales; per_step must name "decode step, unconstrained"."""
    fig, ax = plt.subplots(1, 2, figsize=(12, 3.8))
    names = list(per_step)
    ax[0].barh(names, [1000 * per_step[n] for n in names],
               color=["tab:gray", "tab:blue", "tab:green", "tab:olive"][:len(names)])
    ax[0].set_xscale("log")
    ax[0].set_xlabel("milliseconds (log scale)")
    ax[0].set_title(f"every step (batch of {batch}, {constrained} constrained rows)", fontsize=10)
    names = list(once)
    ax[1].barh(names, [1000 * once[n] for n in names], color=(["tab:orange", "tab:purple"] * len(names))[:len(names)])
    ax[1].axvline(1000 * per_step["decode step, unconstrained"], color="gray", ls="--", lw=1, label="one decode step")
    ax[1].set_xscale("log")
    ax[1].set_xlabel("milliseconds (log scale)")
    ax[1].set_title("once per new schema", fontsize=10)
    ax[1].legend(fontsize=8)
    return _done(fig, show)


# ---------------------------------------------------------------- lab11: serving

def latency_throughput(runs: Mapping[str, Sequence[Mapping[str, float]]], show: bool = True) -> Figure | None:
    """lab11 / bench serve: p99 TTFT and p99 TPOT against achieved output tok/s, one line per engine (label -> the
    sweep's rows, as bench.serving.rows_of makes them); the row marked "knee" is circled."""
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for label, rows in runs.items():
        x = [r["output_throughput"] for r in rows]
        for ax, metric in zip(axes, ("p99_ttft_ms", "p99_tpot_ms")):
            ax.plot(x, [r[metric] for r in rows], marker="o", label=label)
            for xi, r in zip(x, rows):
                if r.get("knee"):
                    ax.scatter([xi], [r[metric]], s=180, facecolors="none", edgecolors="red", zorder=3)
    for ax, title in zip(axes, ("p99 time to first token", "p99 time per output token")):
        ax.set_xlabel("output tokens / s (achieved)")
        ax.set_ylabel("ms")
        ax.set_yscale("log")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle("latency vs throughput, one point per request rate (red circle: the knee)")
    return _done(fig, show)


# ---------------------------------------------------------------- lab12: fleet

def step_time_curve(tokens: Sequence[int], curves: Mapping[str, Sequence[float]], title: str,
                    show: bool = True) -> Figure | None:
    """lab12: one engine step's time (curves: label -> seconds) as prompt tokens join it (tokens, the x axis)."""
    fig, ax = plt.subplots(figsize=(8, 4))
    for label, seconds in curves.items():
        ax.plot(tokens, 1000 * _np(seconds), label=label, lw=2 if label.startswith("max") else 1.2,
                ls="-" if label.startswith("max") else "--")
    ax.set_xlabel("prompt tokens in the step")
    ax.set_ylabel("step time (ms)")
    ax.set_ylim(bottom=0)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    return _done(fig, show)


def step_fit(measured: Sequence[float], predicted: Mapping[str, Sequence[float]], show: bool = True) -> Figure | None:
    """lab12: each model's predicted step time against the measured one (seconds in, ms on log axes); on the
    diagonal a prediction is exact."""
    fig, ax = plt.subplots(figsize=(5.5, 5))
    x = 1000 * _np(measured)
    for label, seconds in predicted.items():
        ax.scatter(x, 1000 * _np(seconds), s=14, alpha=0.6, label=label)
    lo, hi = x.min() / 1.5, x.max() * 1.5
    ax.plot([lo, hi], [lo, hi], color="gray", lw=1, ls=":")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("measured step time (ms)")
    ax.set_ylabel("predicted (ms)")
    ax.set_title("held-out steps: prediction vs measurement")
    ax.grid(alpha=0.3)
    ax.legend()
    return _done(fig, show)


def latency_cdfs(runs: Mapping[str, Mapping[str, tuple[Sequence[float], Sequence[float]]]],
                 show: bool = True) -> Figure | None:
    """lab12 / fleet simulate: the TTFT and TPOT distributions (CDFs) of each router. runs: label -> {"ttft":
    (seconds, fraction), "tpot": (seconds, fraction)}, as LatencyStats.cdf() gives them."""
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for label, cdfs in runs.items():
        for ax, metric in zip(axes, ("ttft", "tpot")):
            x, y = cdfs[metric]
            ax.plot(1000 * _np(x), _np(y), label=label, drawstyle="steps-post")
    for ax, title in zip(axes, ("time to first token", "time per output token")):
        ax.set_xscale("log")
        ax.set_xlabel("ms (log scale)")
        ax.set_ylabel("fraction of requests")
        ax.axhline(0.99, color="gray", ls=":", lw=1)
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle("latency distributions by router (dotted: p99)")
    return _done(fig, show)


def replica_timeline(runs: Mapping[str, Sequence[tuple[float, int, int]]], show: bool = True) -> Figure | None:
    """fleet simulate --autoscale / failures: replicas taking requests (solid) and replicas billed (dashed: starting,
    draining or down count too) over simulated time, per run. runs: label -> [(t, routable, billed), ...] at each
    change, as FleetResult.timeline gives them."""
    fig, ax = plt.subplots(figsize=(9, 3.6))
    for label, tl in runs.items():
        t = [x[0] for x in tl]
        line, = ax.plot(t, [x[1] for x in tl], drawstyle="steps-post", label=f"{label}: routable")
        ax.plot(t, [x[2] for x in tl], drawstyle="steps-post", ls="--", color=line.get_color(),
                label=f"{label}: billed")
    ax.set_xlabel("simulated seconds")
    ax.set_ylabel("replicas")
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title("fleet size over time (the gap between the lines: cold starts, drains, repairs)")
    return _done(fig, show)
