"""Calibrate the step-time model on this machine: run the real engine over a spread of batch sizes, prompt lengths
and chunked-prefill mixes, record every step through the engine's public step observer, fit, save.

Each scenario queues `batch` requests of `prompt_len` random token ids (distinct, so the prefix cache stays out of
the measurement) and, for the mixed scenarios, a second wave of prompts a few steps later, so that prompt chunks
share steps with running decodes: the steps the max(compute, memory) form is about. Whole scenarios are held out
(every fourth), so the reported error is on batch/length mixes the fit never saw.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from minillm.config import EngineConfig, ModelConfig, cache_root
from minillm.engine.llm_engine import LLMEngine
from minillm.engine.outputs import StepInfo
from minillm.executor.launch import start_engine
from minillm.fleet.probe import probe
from minillm.fleet.step_model import StepFeatures, StepModel, StepTrace, fit
from minillm.kernels import cpu_qgemm
from minillm.kv.cache import KVCache
from minillm.models.llama import LlamaModel
from minillm.sampling.params import SamplingParams

TINY = "tiny-random"     # --model tiny-random: a 2-layer random model, for tests and a quick look at the machinery


@dataclass(frozen=True)
class Scenario:
    batch: int
    prompt_len: int
    output_len: int
    second_wave: int = 0      # prompts added after `wave_after` steps: chunks mixed with decodes
    wave_after: int = 3


def default_scenarios(quick: bool = False) -> list[Scenario]:
    """A spread over batch size, prompt length and prefill/decode mix (quick: a third of it). The largest batch,
    with its second wave, reaches 96 sequences: past the default max_num_seqs (64), so a saturated replica's
    steps are inside what the fit saw rather than extrapolated."""
    batches, prompts = ((1, 8, 32), (32, 256)) if quick else ((1, 4, 16, 32, 64), (32, 128, 512))
    out = []
    for b in batches:
        for p in prompts:
            out.append(Scenario(b, p, 12))
            out.append(Scenario(b, p, 12, second_wave=max(1, b // 2)))
    if not quick:
        # A lightly loaded replica runs one prompt at a time beside a few decodes, at any length: without these the
        # prefill fit is ruled by the big batched steps, and a lone 100-token prompt came out ~15 % faster than it
        # ran; the 1024-token prompts give decodes of long contexts (what the KV read costs per token).
        for b in (1, 2):
            for p in (16, 64, 96, 256, 1024):
                out.append(Scenario(b, p, 24))
                out.append(Scenario(b, p, 24, second_wave=1))
        # A decode step's cost is concave in its rows between 2 and ~12 (measured on 2026-11-29 before the tiles kept
        # their sums in registers: 4.5 ms at 1 row, +1.5 ms a row to 9, +1.1 after), where a lightly loaded replica
        # lives; with batches only at 1, 4, 16 the fit drew one line through them and ran 10-16 % fast at 5-9 rows.
        for b in (2, 3, 5, 6, 8, 10, 12):
            out.append(Scenario(b, 64, 16))
        # ... and one prompt joining a batch of running decodes (a step of one chunk and many decode rows)
        for b in (6, 12, 32, 48):
            for p in (48, 160):
                out.append(Scenario(b, p, 16, second_wave=1, wave_after=4))
    return out


def tiny_engine(seed: int = 0, **settings) -> LLMEngine:
    """An engine over a 2-layer random model (vocab 128): the calibration machinery without a download."""
    cfg = ModelConfig(vocab_size=128, hidden_size=64, intermediate_size=192, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=16, max_position_embeddings=2048, eos_token_id=2, name=TINY)
    torch.manual_seed(seed)
    model = LlamaModel(cfg)
    with torch.no_grad():
        for p in model.parameters():      # parallel layers allocate uninitialized: give them finite weights
            p.normal_(0, 0.3) if p.dim() > 1 else p.uniform_(0.5, 1.5)
    return LLMEngine(model.eval(), None, EngineConfig.from_kwargs(**settings))


def build_engine(model: str, **settings) -> LLMEngine:
    if model == TINY:
        return tiny_engine(**settings)
    return start_engine(model, EngineConfig.from_kwargs(**settings))[1]


def step_features(info: StepInfo) -> StepFeatures:
    """What the step just observed computed. After the step the scheduler has committed: a scheduled sequence
    computed n tokens from (now - n)."""
    return StepFeatures.of((s.num_computed_tokens - n, n, s.num_prompt_tokens)
                           for s, n in info.scheduler_output.scheduled)


def record(engine: LLMEngine, scenarios: Sequence[Scenario], seed: int = 0,
           progress: bool = True) -> list[list[StepTrace]]:
    """Run each scenario to completion on `engine` (warmed up: LLMEngine.warm_up, as calibrate does before its
    first probe); per scenario, the steps it took (features, wall seconds)."""
    rng = np.random.default_rng(seed)
    vocab = engine.model.cfg.vocab_size
    current: list[StepTrace] = []

    def observe(info: StepInfo) -> None:
        current.append(StepTrace(step_features(info), info.seconds))

    def add(sc: Scenario, count: int) -> None:
        for _ in range(count):
            ids = rng.integers(3, vocab, sc.prompt_len).tolist()
            engine.add_request(ids, SamplingParams(max_tokens=sc.output_len, temperature=0.0, ignore_eos=True))

    engine.add_step_observer(observe)
    out: list[list[StepTrace]] = []
    try:
        bar = tqdm(scenarios, desc="calibrating", unit="scenario", disable=not progress)
        for sc in bar:
            current.clear()
            engine.block_manager.reset_prefix_cache()
            add(sc, sc.batch)
            steps = 0
            while engine.has_unfinished_requests():
                engine.step()
                steps += 1
                if steps == sc.wave_after and sc.second_wave:
                    add(sc, sc.second_wave)
            out.append(list(current))
            bar.set_postfix(steps=sum(map(len, out)))
    finally:
        engine.remove_step_observer(observe)
    return out


def default_path(model: str) -> Path:
    """Where `calibrate` saves and `simulate` looks: the user cache dir (config.cache_root), one file a model."""
    return cache_root() / "fleet" / f"step-model-{Path(model).name}.json"


def calibrate(model: str = "default", engine: LLMEngine | None = None, scenarios: Sequence[Scenario] | None = None,
              quick: bool = False, seed: int = 0, progress: bool = True, out: str | Path | None = None,
              log: Callable[[str], None] | None = None, **settings) -> StepModel:
    """Record, fit on 3 of every 4 scenarios, measure the error on the 4th, save (unless out=""), return."""
    engine = engine or build_engine(model, **settings)
    scenarios = list(scenarios or default_scenarios(quick))
    engine.warm_up()          # lazy initialization is neither a step cost nor the machine's speed
    before = probe(engine)
    per = record(engine, scenarios, seed, progress)
    after = probe(engine)
    if log and abs(after / before - 1) > 0.05:
        log(f"warning: the machine's speed moved {100 * (after / before - 1):+.0f} % during calibration (probe "
            f"{before:.3f} s before, {after:.3f} s after): on a quieter machine the fit would be truer")
    train = [t for i, s in enumerate(per) if i % 4 != 3 for t in s]
    held = [t for i, s in enumerate(per) if i % 4 == 3 for t in s] or train
    cc, sc = engine.config.cache, engine.config.scheduler
    replica = {"num_blocks": engine.block_manager.num_blocks, "block_size": cc.block_size,
               "max_num_seqs": sc.max_num_seqs, "max_num_batched_tokens": sc.max_num_batched_tokens,
               "max_model_len": engine.max_model_len,
               # what a disaggregated fleet ships per token of context, and what a host KV tier stores
               "kv_bytes_per_token": KVCache.bytes_per_token(engine.model.cfg, engine.kv_cache.k.dtype),
               "model": engine.model.cfg.name,     # fleet validate refuses a step model of another model
               "probe_s": (before + after) / 2}    # the machine's speed at calibration (fleet/probe.py)
    name = engine.model.cfg.name
    # split: decode-only steps, and steps with prefill on either side of the quantized kernels' switch from tiles to
    # the int16 copy, run different code paths (see step_model's docstring)
    sm = fit(train, source=f"calibrated: {name} on this machine ({len(train)} steps)", replica=replica, held_out=held,
             split=True, short_prefill_tokens=cpu_qgemm.TILES_MAX_ROWS)
    if out != "":
        path = sm.save(out or default_path(model if model != "default" else "default"))
        if log:
            log(f"saved {path}")
    return sm
