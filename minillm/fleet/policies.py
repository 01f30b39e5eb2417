"""The fleet's knobs beyond routing, as small torch-free values the CLI parses and the simulator reads:
a KV link between prefill and decode pools, an autoscaling rule, a failure plan, a latency SLO.

Kept free of the engine (pure Python) so `minillm fleet simulate` can check its flags before anything heavy loads.
"""
from __future__ import annotations

import math
import random
import re
from dataclasses import dataclass

SIGNALS = ("queue", "kv", "tokens")
_SIGNAL_MEANING = {"queue": "waiting requests per replica", "kv": "share of the KV pool in use (0..1)",
                   "tokens": "arriving prompt + output tokens per second per replica"}


def _positive(name: str, v: float, zero_ok: bool = False) -> float:
    if not math.isfinite(v) and v != math.inf or v < 0 or (v == 0 and not zero_ok):
        raise ValueError(f"{name} must be a number {'>=' if zero_ok else '>'} 0, got {v}")
    return v


# ---------------------------------------------------------------------- disaggregation

@dataclass(frozen=True)
class KVLink:
    """The link a prefill replica ships a prompt's KV over to a decode replica: bytes = prompt tokens x KV bytes
    per token (the whole replica: every layer, K and V); each prefill replica has one link and sends one request's
    KV at a time (later ones queue). `gbps` is gigabits per second; inf is an instant link."""
    kv_bytes_per_token: float
    gbps: float = math.inf

    def __post_init__(self) -> None:
        _positive("KV bytes per token", self.kv_bytes_per_token)
        _positive("--kv-link-gbps", self.gbps)

    def seconds(self, tokens: int) -> float:
        return 0.0 if self.gbps == math.inf else tokens * self.kv_bytes_per_token * 8 / (self.gbps * 1e9)


def parse_split(spec: str) -> tuple[int, int]:
    """"P:D" -> (prefill replicas, decode replicas), both >= 1."""
    m = re.fullmatch(r"\s*(\d+)\s*:\s*(\d+)\s*", spec)
    if not m or int(m[1]) < 1 or int(m[2]) < 1:
        raise ValueError(f"--disaggregate takes P:D (prefill:decode replicas, each >= 1), got {spec!r}")
    return int(m[1]), int(m[2])


# ---------------------------------------------------------------------- autoscaling

@dataclass(frozen=True)
class Autoscaler:
    """Every `interval_s` the fleet reads `signal` averaged over its routable replicas. Above `high` it starts as
    many replicas as would bring the signal back to `high` (ceil(up x value / high), counting replicas already
    starting; HPA's rule), each routable only after `cold_start_s`; below `low` it drains one (no new requests,
    it finishes what it holds, then it is gone). Never more than `max_replicas` billed-and-running, never fewer
    than `min_replicas` up or starting (a failed replica is replaced)."""
    signal: str
    low: float
    high: float
    min_replicas: int = 1
    max_replicas: int = 64
    cold_start_s: float = 30.0
    interval_s: float = 5.0

    def __post_init__(self) -> None:
        if self.signal not in SIGNALS:
            raise ValueError(f"unknown autoscaling signal {self.signal!r}; known: "
                             + ", ".join(f"{k} ({v})" for k, v in _SIGNAL_MEANING.items()))
        if not (0 <= self.low < self.high) or not math.isfinite(self.high):
            raise ValueError(f"--autoscale needs 0 <= LOW < HIGH, got {self.low}:{self.high}")
        if not 1 <= self.min_replicas <= self.max_replicas:
            raise ValueError(f"need 1 <= --min-replicas <= --max-replicas, got {self.min_replicas}, "
                             f"{self.max_replicas}")
        _positive("--cold-start", self.cold_start_s, zero_ok=True)
        _positive("--scale-interval", self.interval_s)

    @classmethod
    def parse(cls, spec: str, **kw) -> "Autoscaler":
        parts = spec.split(":")
        try:
            signal, low, high = parts[0].strip(), float(parts[1]), float(parts[2])
        except (IndexError, ValueError):
            raise ValueError(f"--autoscale takes SIGNAL:LOW:HIGH (signal one of {', '.join(SIGNALS)}), got "
                             f"{spec!r}") from None
        if len(parts) != 3:
            raise ValueError(f"--autoscale takes SIGNAL:LOW:HIGH, got {spec!r}")
        return cls(signal, low, high, **kw)

    def decide(self, value: float, up: int, starting: int) -> int:
        """How many replicas to start (> 0) or drain (< 0) now."""
        active = up + starting
        if active < self.min_replicas:
            return self.min_replicas - active
        if value > self.high and active < self.max_replicas:
            want = self.max_replicas if math.isinf(value) else \
                min(self.max_replicas, math.ceil(max(up, 1) * value / self.high))
            return max(0, want - active)
        if value < self.low and starting == 0 and up > self.min_replicas:
            return -1
        return 0


# ---------------------------------------------------------------------- failures

@dataclass(frozen=True)
class FailurePlan:
    """When replicas die: at given (time, replica index) pairs, and/or each up replica after an exponential time
    with mean `mtbf_s` (seeded). A failed replica comes back empty after `repair_s` (None: it stays down; it is
    then no longer billed). Requests it held are retried on the others, resuming from the tokens already streamed
    (the prompt plus those tokens is recomputed: the lost work), at most `retries` times each."""
    at: tuple[tuple[float, int], ...] = ()
    mtbf_s: float | None = None
    repair_s: float | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if self.mtbf_s is not None:
            _positive("--mtbf", self.mtbf_s)
        if self.repair_s is not None:
            _positive("--repair", self.repair_s, zero_ok=True)

    @property
    def active(self) -> bool:
        return bool(self.at) or self.mtbf_s is not None

    def rng(self) -> random.Random:
        return random.Random(self.seed)

    @staticmethod
    def parse_at(spec: str) -> tuple[float, int]:
        m = re.fullmatch(r"\s*([0-9.eE+-]+)\s*:\s*(\d+)\s*", spec)
        try:
            t = float(m[1]) if m else -1.0
        except ValueError:
            t = -1.0
        if not m or not math.isfinite(t) or t < 0:
            raise ValueError(f"--fail-at takes T:REPLICA (seconds >= 0 : replica index), got {spec!r}")
        return t, int(m[2])


# ---------------------------------------------------------------------- SLO

_UNITS = {"ms": 1e-3, "s": 1.0, "us": 1e-6}


def parse_seconds(text: str) -> float:
    m = re.fullmatch(r"\s*([0-9.]+(?:[eE][+-]?\d+)?)\s*(ms|s|us)?\s*", text)
    if not m:
        raise ValueError(f"not a duration: {text!r} (e.g. 200ms, 0.2s)")
    v = float(m[1]) * _UNITS[m[2] or "s"]
    if not math.isfinite(v) or v <= 0:
        raise ValueError(f"a duration must be > 0, got {text!r}")
    return v


@dataclass(frozen=True)
class Slo:
    """Per-request latency targets: a request meets the SLO when its TTFT <= ttft_s and its TPOT <= tpot_s (a
    one-token answer has no TPOT); a failed request misses it."""
    ttft_s: float | None = None
    tpot_s: float | None = None

    @classmethod
    def parse(cls, spec: str) -> "Slo":
        """"ttft=200ms,tpot=50ms" (either may be left out)."""
        got: dict[str, float] = {}
        for part in filter(None, (p.strip() for p in spec.split(","))):
            key, _, value = part.partition("=")
            key = key.strip().lower()
            if key not in ("ttft", "tpot") or not value:
                raise ValueError(f"--slo takes ttft=DURATION,tpot=DURATION (e.g. ttft=200ms,tpot=50ms), got "
                                 f"{spec!r}")
            got[f"{key}_s"] = parse_seconds(value)
        if not got:
            raise ValueError(f"--slo names no target: {spec!r}")
        return cls(**got)

    def met(self, ttft: float, tpot: float | None) -> bool:
        return (self.ttft_s is None or ttft <= self.ttft_s) and \
            (self.tpot_s is None or tpot is None or tpot <= self.tpot_s)

    def __str__(self) -> str:
        return ", ".join(f"{k} <= {1e3 * v:g} ms" for k, v in (("TTFT", self.ttft_s), ("TPOT", self.tpot_s))
                         if v is not None)


def parse_p99_slo(spec: str) -> tuple[float, float]:
    """`minillm fleet plan --slo ttft_p99=200ms,tpot_p99=50ms` -> (TTFT p99, TPOT p99) in seconds; both needed."""
    got: dict[str, float] = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        key, _, value = part.partition("=")
        key = key.strip().lower().removesuffix("_p99")
        if key not in ("ttft", "tpot") or not value:
            raise ValueError(f"--slo takes ttft_p99=DURATION,tpot_p99=DURATION (e.g. ttft_p99=200ms,tpot_p99=50ms), "
                             f"got {spec!r}")
        got[key] = parse_seconds(value)
    if set(got) != {"ttft", "tpot"}:
        raise ValueError(f"--slo needs both ttft_p99 and tpot_p99, got {spec!r}")
    return got["ttft"], got["tpot"]
