"""`qkv generate`, run as a user runs it: a real process."""

from __future__ import annotations

import subprocess
import sys

import qkv


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "qkv.cli", *args], capture_output=True, text=True, timeout=120
    )


def test_generate_streams_the_greedy_continuation():
    result = run("generate", "The bank on the side of the river", "-n", "12")
    assert result.returncode == 0, result.stderr
    expected = qkv.load("smollm2").generate("The bank on the side of the river", 12)
    assert result.stdout == "The bank on the side of the river" + expected + "\n"
