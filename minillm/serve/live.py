"""The live view of the engine behind the page: a step observer (on the engine thread) that keeps the latest
snapshot — requests running and waiting, every KV block as used / cached / free, prefix-cache hit rate, tokens per
step, speculative acceptance — for the page's event stream to read. At most one snapshot per SNAPSHOT_EVERY
seconds: walking a large pool every step would cost the engine time."""
from __future__ import annotations

import threading
import time

from minillm.engine.llm_engine import LLMEngine
from minillm.engine.outputs import StepInfo

SNAPSHOT_EVERY = 0.1      # seconds
MAX_CELLS = 4096          # a bigger pool is drawn with several blocks per cell (the busiest state wins)


class EngineView:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._lock = threading.Lock()
        self._last = 0.0
        self._tokens = 0                     # output tokens since the last snapshot
        self._version = 0
        self.watchers = 0                    # pages reading the events: with none, steps cost nothing here
        self._snapshot = self._take(None, 0.0)
        engine.add_step_observer(self.on_step)

    def close(self) -> None:
        self.engine.remove_step_observer(self.on_step)

    def latest(self) -> tuple[int, dict]:
        with self._lock:
            return self._version, self._snapshot

    def refresh(self) -> dict:
        """A snapshot of the engine now (call it on the engine thread: AsyncEngine.call)."""
        snap = self._take(None, 0.0)
        with self._lock:
            self._snapshot, self._version = snap, self._version + 1
        return snap

    def on_step(self, info: StepInfo) -> None:
        if not self.watchers:
            return
        self._tokens += sum(len(o.delta_token_ids) for o in info.outputs)
        now = time.perf_counter()
        idle = not self.engine.has_unfinished_requests()
        if now - self._last < SNAPSHOT_EVERY and not idle:       # the step that empties the engine always shows
            return
        snap = self._take(info, now - self._last if self._last else 0.0)
        with self._lock:
            self._snapshot, self._version, self._last, self._tokens = snap, self._version + 1, now, 0

    def _take(self, info: StepInfo | None, elapsed: float) -> dict:
        engine, bm = self.engine, self.engine.block_manager
        cells = _pool_cells(bm)
        stats = getattr(bm, "stats", None)
        hits, misses = (stats.hits, stats.misses) if stats is not None else (0, 0)
        spec = getattr(engine.spec, "stats", None)
        return {
            "step": engine.num_steps,
            "running": [{"id": s.request_id, "prompt": len(s.prompt_token_ids),
                         "output": len(s.token_ids) - len(s.prompt_token_ids)} for s in engine.scheduler.running],
            "waiting": len(engine.scheduler.waiting),
            "num_blocks": bm.num_blocks, "block_size": bm.block_size, "pool": cells,
            "used": cells.count("u"), "cached": cells.count("c"), "free": cells.count("."),
            "prefix_hit_rate": hits / (hits + misses) if hits + misses else None,
            "tokens_per_step": info.scheduler_output.num_batched_tokens if info is not None else 0,
            "step_ms": 1000 * info.seconds if info is not None else 0.0,
            "output_tok_s": self._tokens / elapsed if elapsed > 0 else 0.0,
            "spec_acceptance": spec.acceptance_rate if spec is not None and spec.num_draft_tokens else None,
        }


def _pool_cells(bm) -> str:
    """The pool as one character per block ('u' in use, 'c' free but holding a cached prefix, '.' free), grouped
    when there are more than MAX_CELLS blocks."""
    cached = {cb.block_id for cb in bm.cached_blocks.values()} if hasattr(bm, "cached_blocks") else set()
    states = ["u" if bm.ref_count(b) > 0 else "c" if b in cached else "." for b in range(bm.num_blocks)]
    group = -(-len(states) // MAX_CELLS)
    if group == 1:
        return "".join(states)
    rank = {"u": 2, "c": 1, ".": 0}
    return "".join(max(states[i:i + group], key=rank.__getitem__) for i in range(0, len(states), group))
