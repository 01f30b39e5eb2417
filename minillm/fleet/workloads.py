"""Seeded request streams for the fleet simulator: what arrives when, with which prompt token ids and how many
output tokens.

Prompts are token ids, not lengths: the replica simulation runs the engine's real BlockManager, whose prefix cache
hits only where ids really repeat (a shared system prompt, a RAG document, a session's earlier turns). Every
workload is a generator in arrival order, so the simulator holds only the requests in flight, never the whole run.

Arrivals: Poisson (exponential gaps) or bursty (gamma gaps with a given coefficient of variation: CV 1 is
Poisson, larger CVs bunch requests into bursts at the same mean rate).
"""
from __future__ import annotations

import heapq
import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

WORKLOADS = ("chat", "rag", "multi-turn", "bursty")
VOCAB = 32000   # token ids drawn below this; only equality matters to the simulator


@dataclass(slots=True)
class SimRequest:
    """One request as the simulator sees it. `output_ids`, when given, are the tokens the replica appends (a
    multi-turn session's next prompt repeats them, so they must be the same ids); else it appends dummies."""
    request_id: int
    arrival: float
    prompt: list[int]
    output_len: int
    output_ids: list[int] | None = None

    @property
    def prompt_len(self) -> int:
        return len(self.prompt)


def arrival_gaps(rng: np.random.Generator, rate: float, cv: float = 1.0, chunk: int = 4096) -> Iterator[float]:
    """Inter-arrival gaps at mean `rate` per second: exponential for cv == 1, else gamma with that CV (shape 1/cv^2,
    so the mean stays 1/rate)."""
    if rate <= 0 or cv <= 0:
        raise ValueError(f"the arrival rate and its CV must be > 0, got rate={rate}, cv={cv}")
    for gaps in gap_chunks(rng, rate, cv, chunk):
        yield from gaps.tolist()


def gap_chunks(rng: np.random.Generator, rate: float, cv: float = 1.0, chunk: int = 4096) -> Iterator[np.ndarray]:
    """arrival_gaps a chunk (an array) at a time: the same draws, for the columnar workloads."""
    if rate <= 0 or cv <= 0:
        raise ValueError(f"the arrival rate and its CV must be > 0, got rate={rate}, cv={cv}")
    shape = 1.0 / (cv * cv)
    while True:
        yield rng.exponential(1 / rate, chunk) if cv == 1.0 else rng.gamma(shape, 1 / (rate * shape), chunk)


def arrival_times(rng: np.random.Generator, rate: float, duration: float, cv: float = 1.0) -> Iterator[float]:
    """Arrival times in [0, duration): the running sum of arrival_gaps."""
    t = 0.0
    for gap in arrival_gaps(rng, rate, cv):
        t += gap
        if t >= duration:
            return
        yield t


def _lognormal_len(rng: np.random.Generator, median: float, sigma: float, lo: int, hi: int) -> int:
    return int(min(hi, max(lo, round(rng.lognormal(math.log(median), sigma)))))


@dataclass(frozen=True)
class Lengths:
    """A lognormal token count: its median, its sigma and its cap, before a workload's `scale` shrinks them. The
    request generators here and the columnar ones (aggregate/streams.py) draw from the same Lengths."""
    median: float
    sigma: float
    cap: int

    def draw(self, rng: np.random.Generator, scale: float) -> int:
        return _lognormal_len(rng, self.median * scale, self.sigma, 1, int(self.cap * scale) + 1)

    def draw_many(self, rng: np.random.Generator, scale: float, n: int) -> np.ndarray:
        x = np.round(rng.lognormal(math.log(self.median * scale), self.sigma, n))
        return np.clip(x, 1, int(self.cap * scale) + 1).astype(np.int64)


# The mixes, once (tokens; the system prompts' lengths are drawn uniformly from CHAT_SYSTEM).
CHAT_SYSTEM, CHAT_USER, CHAT_ANSWER = (64, 256), Lengths(200, 0.8, 4000), Lengths(150, 0.7, 1024)
RAG_INSTRUCTION, RAG_DOC, RAG_DOCS = 120, Lengths(600, 0.3, 1500), (2, 6)     # 2..5 documents a prompt
RAG_QUESTION, RAG_ANSWER, RAG_ZIPF = Lengths(40, 0.5, 200), Lengths(120, 0.6, 512), 1.1
TURN_SYSTEM, TURN_MESSAGE, TURN_ANSWER = 150, Lengths(80, 0.7, 1000), Lengths(150, 0.6, 800)


def _ids(rng: np.random.Generator, n: int, vocab: int) -> list[int]:
    return rng.integers(3, vocab, n).tolist()


def chat(rate: float, duration: float, seed: int = 0, cv: float = 1.0, vocab: int = VOCAB,
         num_system_prompts: int = 4, scale: float = 1.0) -> Iterator[SimRequest]:
    """A chat mix: one of a few system prompts (shared prefixes), a user message (median 200 tokens) and an
    answer (median 150 tokens), lognormal lengths. `scale` shrinks every length (tiny models in tests)."""
    rng = np.random.default_rng(seed)
    systems = [_ids(rng, max(1, int(s * scale)), vocab) for s in rng.integers(*CHAT_SYSTEM, num_system_prompts)]
    weights = 1 / np.arange(1, num_system_prompts + 1)    # Zipf: a few apps carry most traffic
    weights /= weights.sum()
    for i, t in enumerate(arrival_times(rng, rate, duration, cv)):
        system = systems[rng.choice(num_system_prompts, p=weights)]
        user = _ids(rng, CHAT_USER.draw(rng, scale), vocab)
        yield SimRequest(i, t, system + user, CHAT_ANSWER.draw(rng, scale))


def rag(rate: float, duration: float, seed: int = 0, cv: float = 1.0, vocab: int = VOCAB, num_docs: int = 200,
        scale: float = 1.0) -> Iterator[SimRequest]:
    """Long-prompt retrieval: a shared instruction, k in 2..5 documents of ~600 tokens from a Zipf-popular pool
    (the first one retrieved is often the same), a question; short answers (median 120 tokens)."""
    rng = np.random.default_rng(seed)
    instruction = _ids(rng, max(1, int(RAG_INSTRUCTION * scale)), vocab)
    docs = [_ids(rng, RAG_DOC.draw(rng, scale), vocab) for _ in range(num_docs)]
    popularity = 1 / np.arange(1, num_docs + 1) ** RAG_ZIPF
    popularity /= popularity.sum()
    for i, t in enumerate(arrival_times(rng, rate, duration, cv)):
        picked = rng.choice(num_docs, size=int(rng.integers(*RAG_DOCS)), replace=False, p=popularity)
        prompt = list(instruction)
        for d in picked:
            prompt += docs[d]
        prompt += _ids(rng, RAG_QUESTION.draw(rng, scale), vocab)
        yield SimRequest(i, t, prompt, RAG_ANSWER.draw(rng, scale))


def multi_turn(rate: float, duration: float, seed: int = 0, cv: float = 1.0, vocab: int = VOCAB,
               mean_turns: float = 4.0, think_s: float = 20.0, scale: float = 1.0) -> Iterator[SimRequest]:
    """Chat sessions: sessions start at `rate` / mean_turns per second, each turn's prompt is the whole
    conversation so far (previous prompt + previous answer + a new user message), the next turn comes
    `think_s` (exponential) later. `rate` is requests per second over all turns. Memory: the live sessions."""
    rng = np.random.default_rng(seed)
    system = _ids(rng, max(1, int(TURN_SYSTEM * scale)), vocab)
    pending: list[tuple[float, int, list[int], int]] = []   # (arrival, session, history, turns left)
    starts = arrival_gaps(rng, rate / mean_turns, cv)
    next_start, session, rid = next(starts), 0, 0
    while True:
        if pending and pending[0][0] <= next_start:
            t, s, history, left = heapq.heappop(pending)
        elif next_start < duration:
            t, s, history = next_start, session, list(system)
            left = int(rng.geometric(1 / mean_turns))
            session += 1
            next_start += next(starts)
        else:
            return
        if t >= duration:
            if not pending and next_start >= duration:
                return
            continue
        prompt = history + _ids(rng, TURN_MESSAGE.draw(rng, scale), vocab)
        out_len = TURN_ANSWER.draw(rng, scale)
        out_ids = _ids(rng, out_len, vocab)
        yield SimRequest(rid, t, prompt, out_len, out_ids)
        rid += 1
        if left > 1:
            heapq.heappush(pending, (t + float(rng.exponential(think_s)), s, prompt + out_ids, left - 1))


def make(name: str, rate: float, duration: float, seed: int = 0, cv: float = 3.0, vocab: int = VOCAB,
         scale: float = 1.0) -> Iterator[SimRequest]:
    """A workload by name (WORKLOADS): "bursty" is the chat mix with gamma arrivals of the given CV."""
    if name == "chat":
        return chat(rate, duration, seed, vocab=vocab, scale=scale)
    if name == "bursty":
        return chat(rate, duration, seed, cv=cv, vocab=vocab, scale=scale)
    if name == "rag":
        return rag(rate, duration, seed, vocab=vocab, scale=scale)
    if name == "multi-turn":
        return multi_turn(rate, duration, seed, vocab=vocab, scale=scale)
    raise ValueError(f"unknown workload {name!r}; known: {', '.join(WORKLOADS)}")


# ---------------------------------------------------------------------- traces

TRACE_FIELDS = "arrival_time (seconds), prompt_token_ids (list of ints) or prompt_len (int), output_len (int)"


def read_trace(path: str | Path, seed: int = 0, vocab: int = VOCAB) -> Iterator[SimRequest]:
    """Requests from a JSONL file, one object per line: {"arrival_time": 0.5, "prompt_token_ids": [...] or
    "prompt_len": 900, "output_len": 200}, in non-decreasing arrival order. A prompt given by length gets fresh
    random ids (no prefix sharing). A bad line is refused with its number and what is wrong. Blank lines skip."""
    rng = np.random.default_rng(seed)
    last = 0.0
    with open(path) as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            where = f"{path}, line {lineno}"
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: not JSON ({e.msg}); each line is one object with {TRACE_FIELDS}") \
                    from None
            if not isinstance(rec, dict):
                raise ValueError(f"{where}: a {type(rec).__name__}, expected an object with {TRACE_FIELDS}")
            t = rec.get("arrival_time")
            if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
                raise ValueError(f"{where}: arrival_time must be a number of seconds >= 0, got {t!r}")
            if t < last:
                raise ValueError(f"{where}: arrival_time {t} is before the previous line's {last}: sort the trace "
                                 "by arrival_time")
            out = rec.get("output_len")
            if isinstance(out, bool) or not isinstance(out, int) or out < 1:
                raise ValueError(f"{where}: output_len must be an integer >= 1, got {out!r}")
            ids, n = rec.get("prompt_token_ids"), rec.get("prompt_len")
            if ids is not None:
                if not isinstance(ids, list) or not ids or \
                        not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in ids):
                    raise ValueError(f"{where}: prompt_token_ids must be a non-empty list of integers >= 0")
            elif isinstance(n, int) and not isinstance(n, bool) and n >= 1:
                ids = _ids(rng, n, vocab)
            else:
                raise ValueError(f"{where}: give prompt_token_ids (a list) or prompt_len (an integer >= 1), got "
                                 f"prompt_len={n!r}")
            last = float(t)
            yield SimRequest(lineno, float(t), ids, out)
