"""How many threads the C kernels' team should use now: torch's thread count, or one while other processes keep
the machine's cores heavily oversubscribed.

A fused decode step meets at ~150 barriers (kernels/csrc/decode_step.c), one every 30-100 us. The barrier spins
briefly and then yields, which carries a moderately busy machine well: the scheduler shares the cores per thread,
so two team threads beside a few busy processes still get more CPU than one would (SmolLM2 int4, 2 cores, busy
Python loops beside it: 7.6 ms/token with two threads vs 9.9 with one beside 1 loop; about even beside 4). With
many more runnable threads than cores, though, time slices shrink and a barrier keeps waiting on a partner the
scheduler has not run: beside 8 loops two threads took 0.7-1.1 s a token, one thread 48 ms. So the team drops to
one thread while other processes' runnable threads are at least OVERSUBSCRIBED times the cores, sampled from the
kernel's runnable count every SAMPLE_EVERY_S (~50 us a sample: under 0.1 % of the time) and smoothed over the last
SAMPLES samples so a short burst elsewhere does not shrink the team.

Results do not depend on the team's size: every output element is computed by the same code whichever thread
runs it (tests/test_decode_step.py checks bit equality across thread counts).
"""
from __future__ import annotations

import collections
import os
import statistics
import time

import torch

from minillm import config

SAMPLE_EVERY_S = 0.05
SAMPLES = 5                       # the median of the last SAMPLES samples: ~0.25 s of history
OVERSUBSCRIBED = 2                # other runnable threads per core from which one thread is faster than a team


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def runnable_elsewhere() -> int | None:
    """Threads of other processes that are running or waiting for a core right now (None where /proc cannot say):
    the kernel's runnable count (/proc/loadavg's fourth field, R/T) less this process's own runnable threads."""
    try:
        with open("/proc/loadavg") as f:
            total = int(f.read().split()[3].split("/")[0])
        own = 0
        for tid in os.listdir("/proc/self/task"):
            try:
                with open(f"/proc/self/task/{tid}/stat") as f:
                    own += f.read().rpartition(")")[2].split()[0] == "R"
            except OSError:             # the thread ended while we looked
                pass
    except (OSError, ValueError, IndexError):
        return None
    return max(0, total - own)


class _Team:
    def __init__(self) -> None:
        self.cores = _cores()
        self.samples: collections.deque[int] = collections.deque(maxlen=SAMPLES)
        self.sampled_at = -1.0

    def size(self, wanted: int) -> int:
        now = time.monotonic()
        if now - self.sampled_at >= SAMPLE_EVERY_S:
            self.sampled_at = now
            busy = runnable_elsewhere()
            if busy is not None:
                self.samples.append(busy)
        if self.samples and statistics.median(self.samples) >= OVERSUBSCRIBED * self.cores:
            return 1
        return wanted


_team = _Team()


def team_size() -> int:
    """The thread count to hand the next C kernel call (torch's, or fewer on a busy machine)."""
    wanted = torch.get_num_threads()
    if wanted == 1 or config.kernels().kernel_threads == "fixed":
        return wanted
    return _team.size(wanted)
