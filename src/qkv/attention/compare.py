"""The article's "parallel computation", measured: the same attention computed one pair at a
time by the `loop` backend and all at once by the fused ones, their largest difference, and
how many times longer the loop takes (a ratio: the times themselves depend on the machine).

>>> rows = compare_backends([8], repeats=1)
>>> sorted({row.backend for row in rows}) >= ["eager", "sdpa"], rows[0].max_difference < 1e-5
(True, True)
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from qkv.attention.registry import BACKENDS, attend

TOLERANCE = 1e-5  # float32 against the loop's float64, on unit-normal q, k, v


@dataclass(frozen=True)
class Compared:
    length: int  # T, queries and keys
    backend: str
    max_difference: float  # the largest |output - loop's output|
    seconds: float  # the best of the repeats
    loop_seconds: float

    @property
    def ratio(self) -> float:
        """How many times longer the loop takes than this backend."""
        return self.loop_seconds / self.seconds


def _best(backend: str, q, k, v, repeats: int) -> tuple[float, torch.Tensor]:
    """The best time of `repeats` causal attend calls on `backend` (after one untimed call),
    and its output. The loop is timed once, without a warm-up: a pair at a time in Python, it
    takes seconds at a few hundred tokens, and a first call costs it nothing more."""
    if backend == "loop":
        repeats = 1
    else:
        attend(q, k, v, causal=True, backend=backend)
    best, out = float("inf"), None
    for _ in range(repeats):
        start = time.perf_counter()
        out = attend(q, k, v, causal=True, backend=backend)
        best = min(best, time.perf_counter() - start)
    return best, out


def compare_backends(
    lengths: Sequence[int], *, heads: int = 4, dim: int = 64, repeats: int = 3, seed: int = 0
) -> list[Compared]:
    """For each length T: random q, k, v (1, heads, T, dim), causal, float32, attended by the
    loop backend and by every other backend that runs here (flash on a GPU only: on a CPU it
    runs in Triton's interpreter, which says nothing of its speed)."""
    if not lengths or any(type(t) is not int or not 1 <= t <= 1024 for t in lengths):
        raise ValueError(f"lengths must be whole numbers from 1 to 1024, got {list(lengths)}")
    generator = torch.Generator().manual_seed(seed)
    rows = []
    with torch.inference_mode():
        for T in lengths:
            q, k, v = torch.randn(3, 1, heads, T, dim, generator=generator)
            loop_seconds, want = _best("loop", q, k, v, repeats)
            for name in BACKENDS:
                if name == "loop" or (name == "flash" and q.device.type != "cuda"):
                    continue  # the oracle itself; the kernel on a CPU is Triton's interpreter
                seconds, got = _best(name, q, k, v, repeats)
                difference = float((got.double() - want.double()).abs().max())
                rows.append(Compared(T, name, difference, seconds, loop_seconds))
    return rows
