"""Repeats that disagree: the one threshold, and the one warning, for every bench that repeats a measurement.

A bench that times the same configuration several times (--repeat rounds, prefill repeats) keeps its fastest or
median run; when the runs of one configuration differ by more than MAX_SPREAD (max / min), the machine was busy
while it measured. Configurations measured side by side, interleaved, were slowed alike, so their ratios still
hold; the absolute times do not."""
from __future__ import annotations

import math
import sys
from collections.abc import Mapping, Sequence

MAX_SPREAD = 1.25      # the largest max/min among one measurement's repeats that still counts as agreeing


def spread(values: Sequence[float]) -> float:
    """max / min of the positive, finite values (1.0 when fewer than two)."""
    xs = [v for v in values if isinstance(v, (int, float)) and math.isfinite(v) and v > 0]
    return max(xs) / min(xs) if len(xs) > 1 else 1.0


def widest(series: Mapping[str, Sequence[float]]) -> tuple[str, float] | None:
    """The measurement whose repeats disagree most, with its spread (None when nothing was repeated)."""
    spreads = {label: spread(v) for label, v in series.items() if len(v) > 1}
    if not spreads:
        return None
    label = max(spreads, key=spreads.get)
    return label, spreads[label]


def spread_warning(series: Mapping[str, Sequence[float]], limit: float = MAX_SPREAD) -> str | None:
    """One line when some measurement's repeats (label -> the repeats' values, times or rates alike) disagree by
    more than `limit`; None when they agree."""
    worst = widest(series)
    if worst is None or worst[1] <= limit:
        return None
    label, s = worst
    values = [v for v in series[label] if math.isfinite(v) and v > 0]
    return (f"repeats disagree by {100 * (s - 1):.0f}% (> {100 * (limit - 1):.0f}%): the machine is busy; ratios "
            f"measured side by side still hold, absolute times do not (widest: {label}, {min(values):.4g} .. "
            f"{max(values):.4g} over {len(series[label])} runs)")


def warn_if_repeats_disagree(bench: str, series: Mapping[str, Sequence[float]], file=None) -> str | None:
    """Print spread_warning (on stderr) for `bench`; returns it."""
    text = spread_warning(series)
    if text:
        print(f"warning: bench {bench}: {text}", file=file or sys.stderr, flush=True)
    return text
