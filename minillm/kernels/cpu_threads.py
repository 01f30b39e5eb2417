"""How many threads the C kernels' team uses: torch's thread count, or one thread while the team measures slower.

A fused decode step meets at ~150 barriers (kernels/csrc/decode_step.c), one every 30-100 us. The barrier spins
briefly and then yields, and on a quiet machine a team of two is ~1.6x faster than one thread. On a busy machine
the scheduler runs each team thread for a time slice and then something else, and every barrier then waits for a
partner that is not running: beside other work the same step took 40-120 ms instead of 4 (SmolLM2 int4, 2
cores, another session's tests and notebooks running), while one thread, with no partner to wait for, took 5-15.
Which kind of load collapses a team (how many other threads, whether they spin too) is hard to read from /proc, so
the choice is measured: the fused step times itself (`record`), each team size keeps its recent step times per
number of rows, and the faster one runs. The other size is tried again on one step per PROBE_EVERY_S of fused
steps run (their own time, not the wall clock: a long prompt step in between must not make the next decode step
a probe, which made every first decode step after a prefill ~1.6x slower), so a machine that quiets down gets its
team back within about a second of decoding. A number of rows the team has not run at yet takes the size the last
step chose, rather than a probe of its own (the batch changes size at every join and finish). One thread replaces
the team only when it measures MARGIN times faster: a collapsed team is 3-10x slower, while on a quiet machine a
team step that ran right after a prompt step, or beside a short blip, can look slower than one lucky probe, and the
other C kernels (prompt steps through the layers) follow the choice: a validation run whose decode steps had
picked one thread on such noise ran every later prompt step ~1.65x slower (2026-11-29). Those kernels follow the
last choice, never a probe.

Results do not depend on the team's size: every output element is computed by the same code whichever thread
runs it (tests/test_decode_step.py checks bit equality across thread counts).
"""
from __future__ import annotations

import collections
import statistics

import torch

from minillm import config

PROBE_EVERY_S = 1.0          # the size not in use runs one step this often
SAMPLES = 5                  # a size's time at a number of rows: the median of its last SAMPLES steps
MARGIN = 1.25                # one thread replaces the team only when it measures this many times faster


class TeamChoice:
    """Recent step times per (team size, rows) and the size to use next."""

    def __init__(self) -> None:
        self.times: dict[tuple[int, int], collections.deque[float]] = {}
        self.since_probe = 0.0         # seconds of fused steps run since the last probe
        self.last_best = 0             # the size the last non-probe step chose (0: none yet)

    def size(self, wanted: int, rows: int) -> int:
        """The team for the next step of `rows` rows: `wanted` or 1, whichever measured faster at these rows (at
        rows not measured with both: the last choice, else wanted); now and then the other one, to keep both
        measurements current."""
        if wanted == 1:
            return 1
        many, one = self._median(wanted, rows), self._median(1, rows)
        if many is not None and one is not None:
            best = 1 if one * MARGIN < many else wanted
        else:
            best = self.last_best if self.last_best in (1, wanted) else wanted
        if self.since_probe >= PROBE_EVERY_S:
            self.since_probe = 0.0
            return 1 if best == wanted else wanted
        self.last_best = best
        return best

    def record(self, team: int, rows: int, seconds: float) -> None:
        self.times.setdefault((team, rows), collections.deque(maxlen=SAMPLES)).append(seconds)
        self.since_probe += seconds

    def _median(self, team: int, rows: int) -> float | None:
        samples = self.times.get((team, rows))
        return statistics.median(samples) if samples else None


_choice = TeamChoice()


def adaptive() -> bool:
    return config.kernels().kernel_threads == "adaptive"


def step_team(rows: int) -> int:
    """The team for a fused decode step of `rows` rows (report its time with `record`)."""
    wanted = torch.get_num_threads()
    return _choice.size(wanted, rows) if adaptive() else wanted


def record(team: int, rows: int, seconds: float) -> None:
    _choice.record(team, rows, seconds)


def team_size() -> int:
    """The team for a C kernel outside the fused step: torch's thread count, or one while the fused step found one
    thread faster (its last choice: a probe of one thread is not a choice)."""
    wanted = torch.get_num_threads()
    best = _choice.last_best
    return min(wanted, best) if best and adaptive() else wanted
