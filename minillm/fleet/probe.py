"""The machine's speed now, against the speed it had when a step model was calibrated.

A shared VM's speed drifts: on the 2-core development machine the same batch-1 decode step took 3.7 ms and 4.5 ms a
few minutes apart. A step model is fitted to the machine as it was during calibration, so when `fleet validate` runs
later, part of its error is the machine's drift rather than the model's. `probe` times a fixed small workload (four
64-token prompts in one prompt step, then 15 decode steps of the four: both kernels of the CPU's quantized path);
calibrate stores its seconds in the step model (`replica["probe_s"]`), and validate runs it again beside every real
run and reports the ratio, and, unless told not to, simulates each workload on the step model scaled by its ratio.
"""
from __future__ import annotations

import time
from typing import Protocol

import numpy as np

from minillm.engine.llm_engine import LLMEngine
from minillm.sampling.params import SamplingParams

PROBE_REQUESTS, PROBE_PROMPT, PROBE_OUTPUT = 4, 64, 16
PROBE_REPEATS = 3      # the median of three: one probe is ~0.3 s of steps on SmolLM2, and a lone one can be hit


class Clock(Protocol):
    """Where the time is read: the wall clock, or (to check the replay itself) a step model's clock."""
    def now(self) -> float: ...
    def sleep(self, seconds: float) -> None: ...


class WallClock:
    def now(self) -> float:
        return time.perf_counter()

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)


def probe(engine: LLMEngine, clock: Clock | None = None, seed: int = 0) -> float:
    """Seconds the fixed probe workload takes on `engine` (on `clock`, the wall clock unless given): the median of
    PROBE_REPEATS runs. The engine must be idle; it is left idle with its prefix cache reset."""
    clock = clock or WallClock()
    vocab = engine.model.cfg.vocab_size
    times = []
    for r in range(PROBE_REPEATS):
        rng = np.random.default_rng(seed + r)
        engine.block_manager.reset_prefix_cache()
        for _ in range(PROBE_REQUESTS):
            engine.add_request(rng.integers(3, vocab, PROBE_PROMPT).tolist(),
                               SamplingParams(max_tokens=PROBE_OUTPUT, temperature=0.0, ignore_eos=True))
        t0 = clock.now()
        while engine.has_unfinished_requests():
            engine.step()
        times.append(clock.now() - t0)
    engine.block_manager.reset_prefix_cache()
    return float(np.median(times))
