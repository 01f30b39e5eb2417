"""Latency distributions of a fleet run in bounded memory.

A run at 10K requests/s for 10 minutes finishes 6M requests: keeping each one's numbers would cost more than the
simulation. A LatencyStats keeps exact values up to `exact_limit` (small runs and tests read exact percentiles)
and always a log-bucketed histogram (2 % wide buckets from 1 us to ~1 day: a percentile is off by at most 1 %),
which is what it answers from once the exact store would outgrow its limit.
"""
from __future__ import annotations

import math
from array import array
from dataclasses import dataclass, field

import numpy as np

_LO, _RATIO, _BINS = 1e-6, 1.02, 1300      # 1e-6 x 1.02**1300 ~ 1.5e5 s
_LOG_RATIO = math.log(_RATIO)


@dataclass
class LatencyStats:
    exact_limit: int = 200_000
    count: int = 0
    total: float = 0.0
    _exact: array = field(default_factory=lambda: array("d"))
    _hist: np.ndarray = field(default_factory=lambda: np.zeros(_BINS + 1, np.int64))

    def add(self, x: float) -> None:
        self.count += 1
        self.total += x
        if len(self._exact) < self.exact_limit:
            self._exact.append(x)
        i = 0 if x <= _LO else min(_BINS, int(math.log(x / _LO) / _LOG_RATIO) + 1)
        self._hist[i] += 1

    def add_many(self, xs: np.ndarray) -> None:
        """add() for every value of xs, in one pass of numpy (the aggregate simulator folds a step's finishes)."""
        xs = np.asarray(xs, np.float64)
        if not len(xs):
            return
        self.count += len(xs)
        self.total += float(xs.sum())
        room = self.exact_limit - len(self._exact)
        if room > 0:
            self._exact.extend(xs[:room].tolist())
        i = np.zeros(len(xs), np.int64)
        big = xs > _LO
        i[big] = np.minimum(_BINS, (np.log(xs[big] / _LO) / _LOG_RATIO).astype(np.int64) + 1)
        self._hist += np.bincount(i, minlength=_BINS + 1)

    @property
    def exact(self) -> bool:
        return self.count <= self.exact_limit

    @property
    def mean(self) -> float:
        return self.total / self.count if self.count else math.nan

    def quantile(self, q: float) -> float:
        if not self.count:
            return math.nan
        if self.exact:
            return float(np.quantile(np.frombuffer(self._exact, dtype=np.float64), q))
        k = np.searchsorted(np.cumsum(self._hist), q * self.count, side="left")
        return 0.0 if k == 0 else _LO * _RATIO ** (k - 0.5)     # the bucket's geometric middle

    def cdf(self, points: int = 200) -> tuple[np.ndarray, np.ndarray]:
        """(seconds, fraction <= seconds) for plotting."""
        if self.exact:
            xs = np.sort(np.frombuffer(self._exact, dtype=np.float64))
            return xs, np.arange(1, len(xs) + 1) / max(1, len(xs))
        edges = _LO * _RATIO ** np.arange(_BINS + 1)
        return edges, np.cumsum(self._hist) / self.count
