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
    clock: Callable[[], float] = time.perf_counter,
) -> dict:
    """Median (or `statistic`, e.g. min) seconds per call of each fn, the calls interleaved
    across the peers.

    Who goes first rotates each round, so drift in the machine (other load, clock speed)
    falls on every peer alike. clock: time.perf_counter (wall time), or time.process_time
    (this process's CPU time: on a machine shared with other work, the time spent waiting
    for a core is left out).
    """
    names = list(fns)
    for _ in range(warmup):
        for name in names:
            fns[name]()
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(repeats):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            start = clock()
            fns[name]()
            times[name].append(clock() - start)
    return {name: statistic(t) for name, t in times.items()}


def read_bandwidth(megabytes: int = 512, repeats: int = 5) -> float:
    """GB/s of reading memory, as a sum over a float32 buffer far larger than the caches
    reads it (the best of `repeats`): the floor of a decode step that reads every weight."""
    import torch

    buffer = torch.ones(megabytes * 2**20 // 4)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        buffer.sum()
        best = min(best, time.perf_counter() - start)
    return buffer.numel() * 4 / best / 1e9


def machine() -> str:
    """One line a benchmark prints first: the CPU, what torch's kernels use on it, the
    instruction sets that decide the fast paths (`qkv.device`, as the library reads them), the
    threads and the memory bandwidth."""
    import platform

    import torch

    from qkv.device import capability

    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as file:
            model = next(line.split(":", 1)[1].strip() for line in file if "model name" in line)
    except (OSError, StopIteration):
        pass
    return (
        f"{model}; torch {torch.__version__}; {capability().describe()}; "
        f"{torch.get_num_threads()} threads; memory read {read_bandwidth():.1f} GB/s"
    )
