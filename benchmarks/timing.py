"""What every benchmark here shares: the cores to use and interleaved timing of peers."""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable

CORES = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def time_peers(
    fns: dict[str, Callable[[], object]],
    repeats: int,
    warmup: int = 1,
    statistic: Callable[[list[float]], float] = statistics.median,
) -> dict:
    """Median (or `statistic`, e.g. min) seconds per call of each fn, the calls interleaved
    across the peers.

    Who goes first rotates each round, so drift in the machine (other load, clock speed)
    falls on every peer alike.
    """
    names = list(fns)
    for _ in range(warmup):
        for name in names:
            fns[name]()
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(repeats):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            start = time.perf_counter()
            fns[name]()
            times[name].append(time.perf_counter() - start)
    return {name: statistic(t) for name, t in times.items()}
