"""minillm.plots: each lab figure drawn from small made-up measurements, read back from the Figure (titles, labels,
the plotted data), so a figure keeps saying what the lab's prose says it shows. And every `plots.X(...)` call in a
lab's source names a function that exists with arguments its signature accepts (the labs themselves run in
tests/test_course.py's slow autograde runs)."""
from __future__ import annotations

import ast
import inspect
import sys
from pathlib import Path

import matplotlib
import numpy as np
import pytest

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from minillm import plots  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import build_notebooks as bn  # noqa: E402


@pytest.fixture(autouse=True)
def close_figures():
    yield
    plt.close("all")


def texts(fig) -> str:
    """Every piece of text in the figure: titles, axis labels, tick labels, annotations, legend entries."""
    out = []
    for ax in fig.axes:
        out += [ax.get_title(), ax.get_xlabel(), ax.get_ylabel()]
        out += [t.get_text() for t in ax.get_xticklabels() + ax.get_yticklabels() + ax.texts]
        legend = ax.get_legend()
        if legend is not None:
            out += [t.get_text() for t in legend.get_texts()]
    return "\n".join(out)


def test_show_true_shows_and_returns_nothing_show_false_returns_the_figure(monkeypatch):
    shown = []
    monkeypatch.setattr(plt, "show", lambda: shown.append(True))
    assert plots.weight_bytes({"mlp": 2e6, "self_attn": 1e6}) is None and shown == [True]
    fig = plots.weight_bytes({"mlp": 2e6, "self_attn": 1e6}, show=False)
    assert shown == [True] and fig is not None


def test_lab00_figures():
    fig = plots.weight_bytes({"mlp": 320e6, "self_attn": 106e6, "norms": 0.1e6}, show=False)
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["norms", "self_attn", "mlp"]     # largest on top
    assert [round(p.get_width(), 1) for p in ax.patches] == [0.1, 106.0, 320.0]
    assert " 320.0 MB" in texts(fig)
    points = [("decode", 1, 2.7e8, 5.4e8, 0.05), ("prefill 64", 64, 1.7e10, 5.5e8, 0.4)]
    fig = plots.roofline(points, peak_flops=2e11, bandwidth=2e10, show=False)
    ax = fig.axes[0]
    lines = ax.get_lines()
    assert ax.get_xscale() == ax.get_yscale() == "log"
    assert max(lines[0].get_ydata()) == pytest.approx(200)                                  # the roof: 200 GFLOP/s
    assert lines[1].get_xydata()[0] == pytest.approx([0.5, 5.4])                        # decode: 0.5 FLOP/B, 5.4 GFLOP/s
    assert "decode: 20 tok/s" in texts(fig) and "prefill 64: 160 tok/s" in texts(fig)


def test_lab01_figures():
    keys = np.zeros((96, 8))
    keys[:10] = -1.0
    fig = plots.kv_cache_keys(keys, prompt_len=10, num_kv_heads=2, head_dim=4, cache_mib=3.4, show=False)
    image = fig.axes[0].get_images()[0].get_array()
    assert image.shape == (8, 96) and image[:, :10].min() == 1 and image[:, 10:].max() == 0         # |K|, transposed
    assert "10 prompt tokens filled" in texts(fig) and "3.4 MiB for 96 slots" in texts(fig)
    ns, total = plots.fitted_total([16, 64], [10.0, 10.0], 4)               # a flat 10 ms per step: 10, 20, 30, 40 ms
    assert ns.tolist() == [1, 2, 3, 4] and total == pytest.approx([0.01, 0.02, 0.03, 0.04])
    ns, total = plots.fitted_total([1, 3], [2.0, 6.0], 3)                   # 2 ms per token of length: 2, 4, 6
    assert total == pytest.approx([0.002, 0.006, 0.012])
    fig = plots.cache_vs_recompute([16, 64], [5.0, 6.0], [20.0, 80.0], show=False)
    assert [line.get_label() for line in fig.axes[1].get_lines()] == ["recompute: O(n²)", "KV cache: O(n)"]
    assert fig.axes[0].get_lines()[0].get_ydata().tolist() == [20.0, 80.0]


def test_lab02_figures():
    rows = [("r0", [0, 1]), ("r1 #0", [2, 3]), ("r1 #1", [2, 4])]
    refs = [1, 1, 2, 1, 1, 0]
    fig = plots.block_tables(rows, refs, "after 4 steps", show=False)
    top, pool = fig.axes
    assert [t.get_text() for t in top.texts] == ["0", "1", "2", "3", "2", "4"]
    shared = [p for p in top.patches if p.get_facecolor()[:3] == matplotlib.colors.to_rgb("#f5a623")]
    assert len(shared) == 2                                         # block 2, in both of r1's tables
    assert len(pool.patches) == 6 and sum(p.get_hatch() == "//" for p in pool.patches) == 1
    assert pool.patches[5].get_facecolor()[:3] == (1.0, 1.0, 1.0)  # block 5: free
    assert [t.get_text() for t in pool.get_legend().get_texts()] == ["r0", "r1"]
    trace = [{"running": 1, "used": 2, "tokens": 20}, {"running": 2, "used": 4, "tokens": 40}]
    fig = plots.kv_pool_trace(trace, pool_blocks=12, block_size=16, max_model_len=128, show=False)
    used, packed, contiguous = fig.axes[0].get_lines()[:3]
    assert used.get_ydata().tolist() == [2, 4] and packed.get_ydata().tolist() == [1.25, 2.5]
    assert contiguous.get_ydata().tolist() == [8, 16] and "pool: 12 blocks" in texts(fig)
    sweep = [dict(block_size=bs, paged_waste_frac=0.01 * bs, contiguous_waste_frac=0.9, paged_max_concurrency=40 - bs,
                  contiguous_max_concurrency=4) for bs in (1, 16)]
    fig = plots.block_size_sweep(sweep, show=False)
    assert fig.axes[0].get_lines()[0].get_ydata().tolist() == [1, 16] and fig.axes[0].get_xscale() == "log"
    assert fig.axes[1].get_lines()[0].get_ydata().tolist() == [39, 24]


def test_lab03_figures():
    fig = plots.block_table_chains({"0": [3, 5], "1": [3, 7, 8]}, {"0": 12, "1": 20}, {3: 2, 5: 1, 7: 1, 8: 1},
                                   block_size=8, show=False)
    ax = fig.axes[0]
    assert "request 0: 12 tokens" in texts(fig) and "block_size 8" in ax.get_title()
    assert len(ax.patches) == 1                                     # one grey span: block 3 is in both tables
    alphas = [c.get_alpha() for c in ax.collections]
    assert alphas == pytest.approx([1.0, 0.35 + 0.65 * 0.5, 1.0, 1.0, 0.35 + 0.65 * 0.5])   # pale = partly filled
    history = [([1.0, 2.0], [1.0, 1.0]), ([3.0, 2.0], [1.5, 2.0])]
    fig = plots.online_softmax_history(history, show=False)
    assert fig.axes[0].get_lines()[0].get_ydata().tolist() == [1.0, 3.0]
    assert fig.axes[1].get_lines()[1].get_ydata().tolist() == [1.0, 2.0]
    rows = [(16, 1, 0.1, 1e-4, 5e-5, 1e-7, 2e-7, 3e-7), (48, 3, 0.2, 2e-4, 6e-5, 1e-7, 2e-7, 3e-7)]
    fig = plots.kernel_time_and_error(rows, show=False)
    assert fig.axes[0].get_lines()[0].get_ydata().tolist() == [100.0, 200.0]                 # ms
    assert fig.axes[1].get_lines()[2].get_ydata().tolist() == [3e-7, 3e-7]


def test_lab04_figures():
    steps = [{"waiting": ["1"], "idle": [], "run": [("0", 64, "prefill")], "preempted": [], "kv_blocks": 4},
             {"waiting": [], "idle": [], "run": [("0", 1, "decode"), ("1", 40, "prefill")], "preempted": [],
              "kv_blocks": 7},
             {"waiting": [], "idle": ["1"], "run": [("0", 1, "decode")], "preempted": ["1"], "kv_blocks": 5}]
    fig = plots.timeline(steps, 2, "budget 64", pool_blocks=12, budget=64, show=False)
    grid = fig.axes[0].get_images()[0].get_array()
    assert grid.tolist() == [[3, 4, 4], [1, 3, 2]]
    legend = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert legend == ["waiting", "running, not scheduled", "prefill chunk", "decode", "preempted"]
    bars = [p.get_height() for p in fig.axes[1].patches]
    assert bars == [64, 40, 0, 0, 1, 1]                             # prefill tokens per step, then decode tokens
    assert fig.axes[2].get_lines()[0].get_ydata().tolist() == [4, 7, 5]
    results = {name: dict(tok_s=tps, ttft=[0.1, 0.2, 0.3], tpot=[0.01, 0.03], steps=[
        {"run": [("0", 1, "decode"), ("1", 1, "decode")], "seconds": 0.05}]) for name, tps in
        (("static", 10.0), ("continuous", 15.0))}
    fig = plots.static_vs_continuous(results, show=False)
    assert [p.get_height() for p in fig.axes[0].patches] == [10.0, 15.0]
    assert [round(p.get_height(), 3) for p in fig.axes[1].patches][:3] == [0.2, 0.28, 0.298]   # p50, p90, p99
    assert [round(p.get_height(), 1) for p in fig.axes[2].patches][:3] == [20.0, 28.0, 29.8]   # ms
    assert fig.axes[3].collections[0].get_offsets().tolist() == [[1.96, 50.0]]


def test_lab05_figures():
    ids_a, ids_b = list(range(40)), list(range(20)) + [99] * 20
    rows = [("A", ids_a, ([4, 5, 6], [0xABCDEF, 0x123, None], 0, None)),
            ("B", ids_b, ([4, 7, 8], [0xABCDEF, 0x456, None], 16, None))]
    fig = plots.prefix_chains(rows, block_size=16, title="at admission", show=False)
    ax = fig.axes[0]
    colours = [matplotlib.colors.to_hex(p.get_facecolor()) for p in ax.patches[:6]]
    assert colours == ["#fdb462", "#fdb462", "#d9d9d9", "#7fc97f", "#fdb462", "#d9d9d9"]   # computed / hit / partial
    assert "A and B diverge after token 20" in texts(fig)
    results = {"short": dict(off=[0.5, 0.2, 0.2], on=[0.5, 0.1, 0.1], lens=[30, 30, 30], cached=[0, 16, 16],
                             hit_rate=0.5),
               "multi-turn": dict(off=[0.2, 0.4], on=[0.2, 0.1], lens=[40, 80], cached=[0, 32], hit_rate=0.4)}
    fig = plots.prefix_cache_ttft(results, show=False)
    assert [round(p.get_height()) for p in fig.axes[0].patches[:4]] == [200, 400, 100, 100]
    assert "2.0×\nhit 50%" in texts(fig) and "48 new" in texts(fig)


def test_lab06_figures():
    logits = {"peaked": np.log([0.6, 0.35, 0.05, 1e-9]), "flat": np.zeros(4)}
    prompts = {"peaked": "The capital", "flat": "Once"}
    fig = plots.next_token_distributions(logits, prompts, lambda t: f"t{t}", top=3, show=False)
    ax = fig.axes[0]
    assert [round(p.get_height(), 3) for p in ax.patches] == [0.6, 0.35, 0.05]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["t0", "t1", "t2"]
    assert "90% of the mass takes 2 tokens" in ax.get_title() and "top token 0.60" in ax.get_title()
    assert "90% of the mass takes 4 tokens" in fig.axes[1].get_title()
    probs = np.array([[0.7, 0.3, 0, 0], [0.5, 0.3, 0.2, 0], [0.25] * 4, [0.5, 0.5, 0, 0]])
    fig = plots.processed_distributions(logits, prompts, ["T = 1", "top-k 2"], probs, [2, 3, 4, 2], top=4,
                                        show=False)
    line = fig.axes[0].get_lines()[0]
    assert line.get_ydata()[:2].tolist() == [0.7, 0.3] and np.isnan(line.get_ydata()[2:]).all()  # dropped: no point
    assert "top-k 2 (3 kept)" in texts(fig)
    counts, target = np.array([0, 30, 70, 0]), np.array([0.0, 0.25, 0.75, 0.0])
    fig = plots.draws_vs_expected(counts, target, lambda t: f"t{t}", "100 draws", show=False)
    ax = fig.axes[0]
    assert [p.get_height() for p in ax.patches] == [75.0, 25.0]                      # n · p, most likely first
    assert ax.get_lines()[0].get_ydata().tolist() == [70, 30]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["t2", "t1"]


def test_lab07_figures():
    rows = [([], [], [5]), ([1, 2, 3], [1, 9], [1, 9]), ([], [], [4])]     # prefill; 1 kept + 2 refused; no guess
    fig = plots.spec_steps(rows, lambda t: f"<{t}>", "repeating", show=False)
    ax = fig.axes[0]
    colours = [matplotlib.colors.to_hex(p.get_facecolor()) for p in ax.patches if p.get_height() > 0]
    assert colours == ["#7fc97f", "#f4868c", "#d9d9d9", "#80b1d3", "#80b1d3"]
    assert [t.get_text() for t in ax.texts] == ["<1>", "<2>", "<3>", "<9>", "step 2: +2", "<4>", "step 3: +1"]
    p, q = np.array([0.6, 0.4]), np.array([0.5, 0.5])
    freq = {"your rule": (np.array([0.59, 0.41]), 0.5), "resample from p": (np.array([0.7, 0.3]), 1e-9)}
    fig = plots.rejection_frequencies(p, q, freq, ["a", "b"], 6000, "k = 1", show=False)
    heights = [round(b.get_height(), 2) for b in fig.axes[0].patches]
    assert heights == [0.6, 0.4, 0.59, 0.41, 0.7, 0.3]
    assert "6000 runs (chi-square p = 0.50)" in texts(fig) and "(p = 1.0e-09)" in texts(fig)
    rows = {"repeat": dict(plain_tps=10.0, spec_tps=20.0, speedup=2.0, formula=2.2, alpha=0.8),
            "chat": dict(plain_tps=10.0, spec_tps=9.0, speedup=0.9, formula=1.0, alpha=0.1)}
    fig = plots.spec_speedup(rows, {1: 1.0, 4: 1.6}, k=3, show=False)
    assert [p.get_height() for p in fig.axes[0].patches] == [10.0, 10.0, 20.0, 9.0]
    assert "2.00×\nformula 2.20×\nα = 80%" in texts(fig) and "k = 3" in texts(fig)
    assert fig.axes[1].get_lines()[0].get_ydata().tolist() == [1.0, 1.6]


def test_lab08_figures():
    weights = np.array([0.0, 0.1, 0.26, 1.5])
    levels = np.linspace(0, 1.5, 16)
    back = levels[np.abs(weights[:, None] - levels).argmin(1)]
    fig = plots.int4_round_trip({"a group with an outlier": (weights, levels, back)}, show=False)
    ax = fig.axes[0]
    assert len(ax.get_lines()) == 16                                       # one line per int4 level
    err = np.abs(back - weights)
    assert f"largest error {err.max():.4f}" in ax.get_title() and err.max() > 0
    assert ax.collections[1].get_offsets()[:, 1].tolist() == weights.tolist()
    assert ax.collections[2].get_offsets()[:, 1].tolist() == back.tolist()
    rows = [dict(name="float32", bpw=4.0, ppl=10.0, mb=540.0, ms=50.0), dict(name="int8", bpw=1.1, ppl=10.1,
                                                                           mb=150.0, ms=20.0)]
    fig = plots.quant_tradeoffs(rows, show=False)
    assert [c.get_offsets().tolist() for c in fig.axes[0].collections] == [[[4.0, 10.0]], [[1.1, 10.1]]]
    assert [c.get_offsets().tolist() for c in fig.axes[1].collections] == [[[540.0, 50.0]], [[150.0, 20.0]]]


def test_lab09_figures():
    heads = {2: [([0, 1], [0]), ([2, 3], [1])]}
    fig = plots.heads_per_rank(heads, num_heads=4, num_kv_heads=2, show=False)
    grid = fig.axes[0].get_images()[0].get_array()
    assert np.array_equal(grid.filled(-1), [[0, 0, -1, -1, 0, -1], [-1, -1, 1, 1, -1, 1]])
    assert [t.get_text() for t in fig.axes[0].get_xticklabels()] == ["q0", "q1", "q2", "q3", "kv0", "kv1"]
    table = {"small": {"TP": 100, "PP=2": 10, "PP=4": 30}, "big": {"TP": 1000, "PP=2": 100, "PP=4": 300}}
    fig = plots.comm_bytes(table, show=False)
    assert [p.get_height() for p in fig.axes[0].patches] == [100, 1000, 10, 100, 30, 300]
    assert [round(p.get_x() + p.get_width() / 2, 2) for p in fig.axes[0].patches[::2]] == [-0.27, 0.0, 0.27]


def test_lab10_figures():
    fig = plots.mask_sizes([1, 500, 1], ["{", "name", "}"], vocab_size=49152, show=False)
    ax = fig.axes[0]
    reds = [p.get_height() for p in ax.patches if matplotlib.colors.to_hex(p.get_facecolor()) == "#d62728"]
    assert reds == [1, 1] and ax.get_lines()[0].get_ydata()[0] == 49152
    per_step = {"decode step, unconstrained": 0.05, "decode step, constrained": 0.06, "mask (cached rows)": 0.001,
                "mask (rows built)": 0.004}
    once = {"compile: yours": 0.5, "compile: minillm": 0.1}
    fig = plots.mask_costs(per_step, once, batch=9, constrained=9, show=False)
    assert [p.get_width() for p in fig.axes[0].patches] == pytest.approx([50, 60, 1, 4])
    assert fig.axes[1].get_lines()[0].get_xdata()[0] == pytest.approx(50)
    assert "batch of 9, 9 constrained rows" in texts(fig)


def test_lab11_figures():
    rows = [{"output_throughput": x, "p99_ttft_ms": t, "p99_tpot_ms": p, "knee": k}
            for x, t, p, k in [(25, 300, 15, False), (100, 580, 80, True), (150, 4200, 98, False)]]
    fig = plots.latency_throughput({"minillm": rows, "peer": rows[:2]}, show=False)
    ttft, tpot = fig.axes
    assert ttft.get_yscale() == "log" and "p99 time to first token" in ttft.get_title()
    assert list(ttft.get_lines()[0].get_xydata()[:, 1]) == [300, 580, 4200]
    assert list(tpot.get_lines()[1].get_xydata()[:, 1]) == [15, 80]
    circled = [c.get_offsets().tolist() for c in ttft.collections]
    assert circled == [[[100, 580]], [[100, 580]]]                        # the knee of each run, circled
    assert "minillm" in texts(fig) and "peer" in texts(fig)


def test_lab12_figures():
    fig = plots.step_time_curve([0, 256, 512], {"max(compute, memory)": [0.008, 0.008, 0.012],
                                                "compute + memory": [0.009, 0.013, 0.017]}, "a step", show=False)
    ax = fig.axes[0]
    assert [list(line.get_ydata()) for line in ax.get_lines()] == [[8, 8, 12], [9, 13, 17]]
    assert ax.get_lines()[0].get_linestyle() == "-" and ax.get_lines()[1].get_linestyle() == "--"
    fig = plots.step_fit([0.001, 0.01], {"yours": [0.0011, 0.009], "sum": [0.002, 0.02]}, show=False)
    ax = fig.axes[0]
    assert ax.get_xscale() == ax.get_yscale() == "log"
    assert [c.get_offsets().tolist() for c in ax.collections] == [[[1, 1.1], [10, 9]], [[1, 2], [10, 20]]]
    assert "yours" in texts(fig) and "sum" in texts(fig)


def plot_calls(source: str) -> list[ast.Call]:
    return [node for node in ast.walk(ast.parse(source)) if isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute) and isinstance(node.func.value, ast.Name)
            and node.func.value.id == "plots"]


@pytest.mark.parametrize("lab", [lab for lab in bn.lab_ids(ROOT) if (ROOT / "solutions" / lab / f"{lab}.py").is_file()])
def test_labs_call_plots_with_arguments_its_functions_take(lab):
    """Each `plots.X(...)` in a lab names a function of minillm.plots and binds to its signature (no figure is drawn
    here: the values are the lab's, known only when it runs)."""
    source = (ROOT / "solutions" / lab / f"{lab}.py").read_text()
    for call in plot_calls(source):
        fn = getattr(plots, call.func.attr, None)
        assert callable(fn), f"{lab}: plots.{call.func.attr} does not exist"
        if any(isinstance(a, ast.Starred) for a in call.args) or any(k.arg is None for k in call.keywords):
            continue
        inspect.signature(fn).bind(*call.args, **{k.arg: k.value for k in call.keywords})   # TypeError if not
