"""`qkv backends --compare`: the article's loop against the fused backends, on random inputs."""

from __future__ import annotations

import subprocess
import sys

import pytest

from qkv.attention.compare import TOLERANCE, compare_backends


def test_every_fused_backend_equals_the_loop_at_each_length():
    rows = compare_backends([5, 33], repeats=1, seed=3)
    assert [(r.length, r.backend) for r in rows] == [(5, "sdpa"), (5, "eager"), (33, "sdpa"),
                                                     (33, "eager")]  # fmt: skip
    assert all(0 <= r.max_difference < TOLERANCE and r.seconds > 0 for r in rows)


@pytest.mark.parametrize("lengths", [[], [0], [2000], ["8"]])
def test_lengths_out_of_range_are_refused(lengths):
    with pytest.raises(ValueError, match="lengths must be whole numbers"):
        compare_backends(lengths)


def test_the_command_prints_a_line_per_length_and_backend():
    shown = subprocess.run([sys.executable, "-m", "qkv.cli", "backends", "--compare", "4,9"],
                           capture_output=True, text=True, timeout=120)  # fmt: skip
    assert shown.returncode == 0, shown.stderr
    lines = [line for line in shown.stdout.splitlines() if line.startswith("  T=")]
    assert len(lines) == 4 and all("difference below 1e-05" in line for line in lines)
    bad = subprocess.run([sys.executable, "-m", "qkv.cli", "backends", "--compare", "4,x"],
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert bad.returncode == 2 and "--compare takes lengths" in bad.stderr
