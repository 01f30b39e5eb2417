"""`minillm bench spec`: what speculative decoding buys, per task, proposer, k and batch size, in one process run.

Three seeded tasks that differ in how predictable the output is:
  rewrite  repeat a passage of English prose (Python's own documentation, shipped with CPython) word for word
  code     add type hints to a small function from Python's standard library and return the whole function
  chat     open-ended requests (a story, advice, an explanation)
Each runs greedy through the same engine without speculation (the baseline) and with every proposer at every k
(a fixed k, or "auto": the engine picks each sequence's k every step, spec_decode/adaptive.py); the baseline's text
is the reference, so the table also says whether speculation changed a single token.

Numbers: acceptance (accepted / drafted), tokens per target step (output tokens / engine steps), output tokens/s
over the whole run (prefill included), the speedup over the baseline, the same speedup for the decode phase alone
(output tokens after each request's first, over the time after the last request of a group had its first token:
speculation cannot shorten a prefill, so a task with long prompts shows a gap between the two), and the speedup
speculative_math expects
from the measured acceptance and draft cost, assuming verifying k + 1 tokens costs one plain step. Where the
measurement falls short of that, the verification step costs more than a plain one (printed as `verify`). A
separate measurement times steps that verify exactly k + 1 tokens for every sequence against plain steps, per batch
size: the price speculation has to beat.
"""
from __future__ import annotations

import inspect
import random
import re
import time
from dataclasses import asdict, dataclass, field
from typing import Optional

from tqdm.auto import tqdm

from minillm.bench.registry import SPEC_PROPOSERS, SPEC_TASKS
from minillm.config import EngineConfig
from minillm.distributed.device import module_device
from minillm.engine.llm_engine import LLMEngine
from minillm.engine.prompt import build_prompt_ids
from minillm.layers.attention import get_attention_backend
from minillm.loading import loader
from minillm.sampling.params import SamplingParams
from minillm.spec_decode.draft import Draft
from minillm.spec_decode.draft_model import ModelDraftProposer
from minillm.spec_decode.expected import expected_speedup, expected_tokens_per_step
from minillm.spec_decode.proposers import check_same_vocabulary

TASKS, PROPOSERS = SPEC_TASKS, SPEC_PROPOSERS     # named once, in the registry (the CLI's choices)

CHAT = ["Write a short story about a robot who learns to paint.", "Give me three tips for sleeping better.",
        "Explain why the sea is salty.", "Describe your ideal weekend in a few sentences.",
        "Write a poem about autumn leaves.", "What are some good habits for learning a new language?",
        "Tell me about the history of bicycles.", "How can I make my garden more friendly to bees?",
        "Write a letter to a friend who moved to another city.", "Why do cats purr?",
        "Suggest a plan for a rainy Sunday afternoon.", "Explain how a rainbow forms.",
        "Write a dialogue between a baker and a customer.", "What makes a good team leader?",
        "Describe a walk through a busy market.", "Give me ideas for a birthday party for a ten-year-old.",
        "How do airplanes stay in the air?", "Write a short fable with a moral."]

CODE_FUNCTIONS = ["shlex:quote", "colorsys:rgb_to_hsv", "colorsys:hsv_to_rgb", "colorsys:rgb_to_hls",
                  "calendar:leapdays", "string:capwords", "fnmatch:filter", "glob:has_magic", "statistics:median",
                  "posixpath:splitext", "textwrap:indent", "shutil:copyfileobj", "operator:length_hint",
                  "base64:b32decode", "html:escape", "random:Random.shuffle", "json:loads", "os:makedirs"]


# ---------------------------------------------------------------------------------------------- the prompts

def passages(rng: random.Random, n: int) -> list[str]:
    """n prose paragraphs of Python's reference documentation (pydoc_data, part of every CPython)."""
    import pydoc_data.topics
    paras = []
    for text in pydoc_data.topics.topics.values():
        for p in re.split(r"\n\s*\n", text):
            if 250 <= len(p) <= 600 and not re.search(r"^\s|[*=:]{2}|::=|>>>", p, re.M):
                paras.append(" ".join(p.split()))
    return rng.sample(sorted(set(paras)), n)


def functions(rng: random.Random, n: int) -> list[str]:
    """Up to n functions of the standard library, as source (the first 30 lines: prompts stay short)."""
    import importlib
    out = []
    for spec in rng.sample(CODE_FUNCTIONS, len(CODE_FUNCTIONS)):
        mod, name = spec.split(":")
        obj = importlib.import_module(mod)
        for part in name.split("."):
            obj = getattr(obj, part)
        try:
            src = inspect.getsource(obj)
        except (OSError, TypeError):     # implemented in C in this build
            continue
        out.append("\n".join(src.splitlines()[:30]))
        if len(out) == n:
            break
    return out


def task_prompts(tokenizer, task: str, n: int, seed: int) -> list[list[int]]:
    rng = random.Random(f"{task}-{seed}")
    if task == "rewrite":
        texts = [f"Repeat the following passage exactly, word for word:\n\n{p}" for p in passages(rng, n)]
    elif task == "code":
        fns = functions(rng, n)
        texts = [f"Add type hints to this Python function and return the whole function:\n\n```python\n{f}\n```"
                 for f in fns]
    elif task == "chat":
        texts = rng.sample(CHAT, min(n, len(CHAT)))
    else:
        raise ValueError(f"unknown task {task!r}: use {', '.join(TASKS)}")
    texts = (texts * (n // max(len(texts), 1) + 1))[:n]
    return [build_prompt_ids(tokenizer, t, chat=True) for t in texts]


# ---------------------------------------------------------------------------------------------- one run

class TimedProposer:
    """Wraps a proposer and adds up the time it spends drafting (the draft cost)."""

    def __init__(self, inner) -> None:
        self.inner, self.seconds = inner, 0.0

    def propose(self, seqs, num_tokens):
        t = time.perf_counter()
        try:
            return self.inner.propose(seqs, num_tokens)
        finally:
            self.seconds += time.perf_counter() - t

    def verified(self, seq, num_accepted):
        self.inner.verified(seq, num_accepted)

    def free(self, seq):
        self.inner.free(seq)


@dataclass
class Run:
    task: str
    proposer: str            # "none" for the baseline
    k: int | str             # "auto": the engine chose k per sequence and step
    batch: int
    output_tokens: int
    seconds: float
    steps: int
    decode_tokens: int = 0        # output tokens after each request's first, over ...
    decode_seconds: float = 0.0   # ... the time after a group's last first token (prefill excluded)
    draft_seconds: float = 0.0
    draft_tokens: int = 0
    verify_steps: int = 0    # verifications: a sequence's guesses checked in a step (a step of 16 can hold 16)
    acceptance: Optional[float] = None
    acceptance_per_position: list[float] = field(default_factory=list)
    mean_accepted_length: Optional[float] = None
    texts: list[str] = field(default_factory=list)

    @property
    def tok_s(self) -> float:
        return self.output_tokens / self.seconds

    @property
    def tokens_per_step(self) -> float:
        return self.output_tokens / self.steps

    @property
    def decode_tok_s(self) -> float:
        return self.decode_tokens / self.decode_seconds if self.decode_seconds > 0 else float("nan")


@dataclass
class Totals:
    """What run_once measured: output tokens, seconds and engine steps over the whole run, the texts, and the
    decode phase's tokens and seconds (after each group's last first token)."""
    tokens: int = 0
    seconds: float = 0.0
    steps: int = 0
    texts: list[str] = field(default_factory=list)
    decode_tokens: int = 0
    decode_seconds: float = 0.0


def run_once(engine: LLMEngine, prompts: list[list[int]], batch: int, max_tokens: int) -> Totals:
    """The prompts through the engine, `batch` at a time (all of a batch arriving together); greedy."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    t = Totals()
    for i in range(0, len(prompts), batch):
        group = prompts[i:i + batch]
        done = {}
        s0, t0 = engine.num_steps, time.perf_counter()
        ids = [engine.add_request(p, params) for p in group]
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out
        end = time.perf_counter()
        t.seconds += end - t0
        t.steps += engine.num_steps - s0
        t.tokens += sum(len(done[r].token_ids) for r in ids)
        t.texts += [done[r].text for r in ids]
        t.decode_tokens += sum(len(done[r].token_ids) - 1 for r in ids)
        t.decode_seconds += end - max(done[r].metrics.first_token_time for r in ids)
    return t


def make_engine(loaded, config: EngineConfig, proposer: str | None, k: int | str, draft, draft_layers: int
                ) -> LLMEngine:
    if proposer is None:
        return LLMEngine(loaded.model, loaded.tokenizer, config)
    spec = {"method": "ngram", "num_speculative_tokens": k}
    if proposer == "layer_skip":
        spec = {"method": "layer_skip", "draft_layers": draft_layers, "num_speculative_tokens": k}
    engine = LLMEngine(loaded.model, loaded.tokenizer, config.replace(speculative_config=spec))
    if proposer == "draft_model":       # the draft is loaded once for the whole bench and plugged in (on the engine's device)
        if module_device(draft) != engine.device:
            draft.to(engine.device)
        engine.plug(proposer=ModelDraftProposer(draft, engine.kv_cache.num_blocks, config.cache.block_size,
                                                get_attention_backend(config.attention_backend, engine.device,
                                                                      config.cache.block_size)))
    engine.plug(proposer=TimedProposer(engine.spec.proposer))
    return engine


# ---------------------------------------------------------------------------------------------- the bench

@dataclass
class SpecBenchConfig:
    tasks: tuple[str, ...] = TASKS
    proposers: tuple[str, ...] = PROPOSERS
    ks: tuple[int | str, ...] = (2, 4, 8, "auto")
    batch_sizes: tuple[int, ...] = (1, 16)
    batch1_requests: int = 2        # batch 1: this many prompts, one after the other
    max_tokens: int = 96
    draft_model: str = "default"
    draft_layers: int = 24
    seed: int = 0
    repeat: int = 1                 # rounds over all configurations; each keeps its fastest


def run_spec_bench(loaded, config: EngineConfig, bc: SpecBenchConfig, progress: bool = True) -> dict:
    for name, allowed, given in (("task", TASKS, bc.tasks), ("proposer", PROPOSERS, bc.proposers)):
        bad = sorted(set(given) - set(allowed))
        if bad:
            raise ValueError(f"unknown {name}(s) {bad}: choose from {', '.join(allowed)}")
    if any(k != "auto" and k < 1 for k in bc.ks) or any(b < 1 for b in bc.batch_sizes) or bc.repeat < 1:
        raise ValueError("--k (or auto), --batch-sizes and --repeat take positive integers")
    draft = None
    if "draft_model" in bc.proposers:
        d = loader.load_model(bc.draft_model, loaded.model.dtype)
        check_same_vocabulary(loaded.config.vocab_size, loaded.tokenizer, d.config.vocab_size, d.tokenizer, str(d.path))
        draft = d.model
    LLMEngine(loaded.model, loaded.tokenizer, config).warm_up()
    plan = [(t, b, p, k) for t in bc.tasks for b in bc.batch_sizes for p in (None, *bc.proposers)
            for k in ((0,) if p is None else bc.ks)]
    # Rounds interleave every configuration, and each keeps its fastest round: a burst of load on a shared machine
    # then slows one round of one configuration instead of skewing the ratio between two of them.
    bar = tqdm(total=len(plan) * bc.repeat, desc="bench spec", unit="run", disable=not progress, dynamic_ncols=True)
    prompts, best, seconds = {}, {}, {}
    for _ in range(bc.repeat):
        for item in plan:
            task, batch, proposer, k = item
            bar.set_postfix(task=task, batch=batch, proposer=proposer or "none", k=k, refresh=False)
            if (task, batch) not in prompts:
                n = bc.batch1_requests if batch == 1 else batch
                prompts[task, batch] = task_prompts(loaded.tokenizer, task, n, bc.seed)
            r = _measure(loaded, config, bc, item, prompts[task, batch], draft)
            seconds.setdefault(item, []).append(round(r.seconds, 4))
            if item not in best or r.seconds < best[item].seconds:
                best[item] = r
            bar.update()
    bar.close()
    runs = [best[item] for item in plan]
    base = {(r.task, r.batch): r for r in runs if r.proposer == "none"}
    fixed = tuple(k for k in bc.ks if k != "auto") or (1, 4, 8)
    verify = {b: verify_costs(loaded, config, b, fixed, bc.seed) for b in bc.batch_sizes}
    return {"runs": [summarize(r, base[(r.task, r.batch)]) for r in runs], "verify_cost": verify,
            "settings": asdict(bc),
            "engine": config.as_kwargs(), "model": loaded.path.name,
            "dtype": str(loaded.model.dtype).removeprefix("torch."), "threads": _threads(),
            "repeats": {f"{t} batch {b} {p or 'none'} k={k} seconds": v for (t, b, p, k), v in seconds.items()}}


def _measure(loaded, config: EngineConfig, bc: SpecBenchConfig, item: tuple, prompts: list, draft) -> Run:
    """One configuration on a fresh engine (so the prefix cache never carries over from an earlier round)."""
    task, batch, proposer, k = item
    engine = make_engine(loaded, config, proposer, k, draft, bc.draft_layers)
    engine.warm_up()
    t = run_once(engine, prompts, batch, bc.max_tokens)
    r = Run(task, proposer or "none", k, batch, t.tokens, t.seconds, t.steps, t.decode_tokens, t.decode_seconds,
            texts=t.texts)
    if proposer is not None:
        s = engine.spec.stats
        r.draft_seconds, r.draft_tokens, r.verify_steps = engine.spec.proposer.seconds, s.num_draft_tokens, s.num_steps
        r.acceptance, r.mean_accepted_length = s.acceptance_rate, s.mean_accepted_length
        r.acceptance_per_position = [round(x, 3) for x in s.acceptance_rate_per_position]
    return r


class FullDraftProposer:
    """Always drafts the full k (the last token, repeated): every step verifies exactly k + 1 rows per sequence."""

    def propose(self, seqs, num_tokens):
        return [Draft([s.token_ids[-1]] * k) for s, k in zip(seqs, num_tokens)]

    def verified(self, seq, num_accepted):
        pass

    def free(self, seq):
        pass


def verify_costs(loaded, config: EngineConfig, batch: int, ks: tuple[int, ...], seed: int, steps: int = 8
                 ) -> dict[int, float]:
    """{k: the time of a step verifying k + 1 tokens for each of `batch` sequences, in plain decode steps at the
    same batch size}: `steps` decode steps of each after two untimed ones, chat prompts, drafts that are always k
    long (so no step is cut short by a missing draft)."""
    prompts = task_prompts(loaded.tokenizer, "chat", batch, seed)

    def step_seconds(k: int) -> float:
        engine = make_engine(loaded, config, None if k == 0 else "ngram", k, None, 0)
        if k:
            engine.plug(proposer=FullDraftProposer())
        params = SamplingParams(temperature=0, max_tokens=(steps + 3) * (k + 1) + k + 2, ignore_eos=True)
        for p in prompts:
            engine.add_request(p, params)
        while any(s.num_tokens == s.num_prompt_tokens for s in engine.scheduler.running) or engine.scheduler.waiting:
            engine.step()                   # prefill
        for _ in range(2):
            engine.step()
        t0 = time.perf_counter()
        for _ in range(steps):
            engine.step()
        return (time.perf_counter() - t0) / steps

    plain = min(step_seconds(0) for _ in range(2))
    return {k: round(min(step_seconds(k) for _ in range(2)) / plain, 3) for k in ks}


def _threads() -> int:
    import torch
    return torch.get_num_threads()


def summarize(r: Run, base: Run) -> dict:
    out = {"task": r.task, "proposer": r.proposer, "k": r.k, "batch": r.batch, "output_tokens": r.output_tokens,
           "seconds": round(r.seconds, 3), "steps": r.steps, "tok_s": round(r.tok_s, 2),
           "tokens_per_step": round(r.tokens_per_step, 3), "baseline_tok_s": round(base.tok_s, 2),
           "speedup": round(r.tok_s / base.tok_s, 3), "decode_tokens": r.decode_tokens,
           "decode_seconds": round(r.decode_seconds, 4), "decode_tok_s": round(r.decode_tok_s, 2),
           "decode_speedup": round(r.decode_tok_s / base.decode_tok_s, 3), "same_text": r.texts == base.texts}
    if r.proposer == "none":
        return out
    base_step = base.seconds / base.steps                       # one plain step at this batch size
    # auto: k as it came out, the mean guesses per verifying step (a step at k = 0 costs a plain step)
    k = r.k if r.k != "auto" else (r.draft_tokens / r.verify_steps if r.verify_steps else 0.0)
    draft_cost = (r.draft_seconds / r.steps / k) / base_step if k else 0.0   # one drafted position, in plain steps
    verify = (r.seconds - r.draft_seconds) / r.steps / base_step
    alpha = r.acceptance or 0.0
    out.update(acceptance=None if r.acceptance is None else round(r.acceptance, 3),
               acceptance_per_position=r.acceptance_per_position,
               mean_accepted_length=None if r.mean_accepted_length is None else round(r.mean_accepted_length, 3),
               draft_cost=round(draft_cost, 3), verify_cost=round(verify, 3), mean_k=round(k, 2),
               draft_tokens=r.draft_tokens, verify_steps=r.verify_steps,
               expected_tokens_per_step=round(expected_tokens_per_step(alpha, k), 3),
               expected_speedup=round(expected_speedup(alpha, k, draft_cost), 3))
    out["why"] = why(out)
    return out


def why(r: dict) -> str:
    """One line on what limited a run (empty when it won)."""
    if r["speedup"] >= 1.0:
        return ""
    alpha, k = r["acceptance"] or 0.0, r["k"]
    if k == "auto":
        return (f"{r['verify_steps']} sequences' guesses verified over {r['steps']} steps (mean k {r['mean_k']:.1f}): "
                "its first, "
                "prior-driven guesses and the plain steps it times cost this much, or load on the machine moved "
                "between this run and the baseline's (try --repeat 3)")
    if alpha < 0.25:
        return (f"drafts are rarely right (acceptance {alpha:.0%}): each step verifies {k} extra tokens per "
                "sequence and still yields about one")
    if r["draft_cost"] * k > 0.5:
        return f"drafting {k} tokens costs {r['draft_cost'] * k:.1f} plain steps, more than the accepted tokens save"
    return (f"verifying {r['batch']}x{k + 1} tokens costs {r['verify_cost']:.1f} plain steps: at batch {r['batch']} "
            "the step is no longer bound by reading the weights, so extra tokens are not free")


def format_spec_bench(result: dict) -> str:
    lines = [f"{result['model']}, {result['dtype']}, {result['threads']} threads, greedy, "
             f"max_tokens {result['settings']['max_tokens']} (batch 1: {result['settings']['batch1_requests']} "
             f"requests one after the other)",
             f"{'task':8s} {'batch':>5s} {'proposer':12s} {'k':>4s} {'accept':>7s} {'tok/step':>8s} {'tok/s':>7s} "
             f"{'speedup':>7s} {'decode':>7s} {'expect':>7s} {'draft':>6s} {'verify':>6s}  same"]
    for r in result["runs"]:
        if r["proposer"] == "none":
            lines.append(f"{r['task']:8s} {r['batch']:5d} {'(none)':12s} {'':>4s} {'':>7s} {r['tokens_per_step']:8.2f} "
                         f"{r['tok_s']:7.1f} {'1.00x':>7s} {'1.00x':>7s}")
            continue
        acc = "-" if r["acceptance"] is None else f"{r['acceptance']:.0%}"
        lines.append(f"{r['task']:8s} {r['batch']:5d} {r['proposer']:12s} {str(r['k']):>4s} {acc:>7s} "
                     f"{r['tokens_per_step']:8.2f} {r['tok_s']:7.1f} {r['speedup']:6.2f}x {r['decode_speedup']:6.2f}x "
                     f"{r['expected_speedup']:6.2f}x {r['draft_cost']:6.2f} {r['verify_cost']:6.2f}  "
                     f"{'yes' if r['same_text'] else 'NO'}")
    slow = [r for r in result["runs"] if r.get("why")]
    if slow:
        lines.append("\nslower with speculation, and why:")
        for r in slow:
            lines.append(f"  {r['task']}/{r['proposer']}/k={r['k']}/batch {r['batch']} ({r['speedup']:.2f}x): {r['why']}")
    lines.append("\nspeedup: output tok/s over the whole run, prefill included; decode: the same after each group's "
                 "last first token (speculation cannot shorten a prefill: long prompts widen the gap). "
                 "draft: one drafted token's cost in plain target steps; verify: a speculative step's target "
                 "work (drafting excluded) in plain steps (auto: over all its steps, plain ones included); expect: "
                 "speculative_math.expected_speedup(acceptance, k, draft), which assumes verify = 1 (auto: k = the "
                 "mean guesses per verifying step).")
    costs = result.get("verify_cost") or {}
    if costs:
        ks = sorted({k for per in costs.values() for k in per})
        lines.append("\ncost of one step verifying k + 1 tokens per sequence, in plain decode steps at the same batch "
                     "size (every sequence drafts exactly k; what a draft must earn back):")
        lines.append(f"{'batch':>5s} " + " ".join(f"{f'k={k}':>6s}" for k in ks))
        for b, per in costs.items():
            lines.append(f"{b:5d} " + " ".join(f"{per[k]:5.2f}x" if k in per else f"{'-':>6s}" for k in ks))
    return "\n".join(lines)


def spec_plot(result: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker
    batches = sorted({r["batch"] for r in result["runs"]})
    fig, axes = plt.subplots(1, len(batches), figsize=(6 * len(batches), 4.2), squeeze=False, sharey=True)
    styles = {"rewrite": "-", "code": "--", "chat": ":"}
    colors = {"ngram": "tab:blue", "layer_skip": "tab:orange", "draft_model": "tab:green"}
    for ax, b in zip(axes[0], batches):
        for (task, prop) in sorted({(r["task"], r["proposer"]) for r in result["runs"] if r["proposer"] != "none"}):
            rows = [r for r in result["runs"] if r["batch"] == b and r["task"] == task and r["proposer"] == prop]
            pts = sorted((r["k"], r["speedup"]) for r in rows if r["k"] != "auto")
            if pts:
                ax.plot(*zip(*pts), styles.get(task, "-"), marker="o", color=colors.get(prop), label=f"{task} / {prop}")
            for r in rows:        # auto: a star at its mean k
                if r["k"] == "auto":
                    ax.plot([r["mean_k"]], [r["speedup"]], marker="*", ms=12, color=colors.get(prop), ls="none")
        ax.axhline(1.0, color="grey", lw=1)
        ax.set_title(f"batch {b}")
        ax.set_xlabel("k (tokens drafted per step; stars: auto at its mean k)")
        ax.set_yscale("log")
        ax.yaxis.set_major_locator(matplotlib.ticker.FixedLocator([0.1, 0.15, 0.2, 0.3, 0.5, 0.7, 1, 1.5, 2, 3, 5, 8]))
        ax.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda y, _: f"{y:g}x"))
        ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.set_xticks(sorted({r["k"] for r in result["runs"] if r["proposer"] != "none" and r["k"] != "auto"}))
    axes[0][0].set_ylabel("speedup over no speculation (output tok/s)")
    fig.legend(*axes[0][0].get_legend_handles_labels(), fontsize=8, loc="center left", bbox_to_anchor=(1.0, 0.5))
    fig.suptitle("speculative decoding on this machine (greedy; above 1 = faster)")
    fig.tight_layout()
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
