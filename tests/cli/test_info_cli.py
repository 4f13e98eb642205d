"""`qkv --help`, `qkv version` and `qkv backends`, run as a user runs them: a real process."""

from __future__ import annotations

import subprocess
import sys

import torch

import qkv


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "qkv.cli", *args], capture_output=True, text=True, timeout=120
    )


def test_help_lists_the_verbs():
    result = run("--help")
    assert result.returncode == 0
    assert "version" in result.stdout and "backends" in result.stdout


def test_version_names_qkv_and_torch():
    result = run("version")
    assert result.returncode == 0
    assert result.stdout.strip() == f"qkv {qkv.__version__} (torch {torch.__version__})"


def test_backends_lists_every_registered_backend():
    softmax, linear = run("backends").stdout.split("\n\n")
    assert [line.split()[0] for line in softmax.splitlines()] == [
        "flash",
        "sdpa",
        "eager",
        "loop",
        "auto",
    ]
    assert [line.split()[0] for line in linear.splitlines()[1:]] == ["loop", "recurrent", "chunked"]


def test_an_unknown_verb_exits_2():
    result = run("nope")
    assert result.returncode == 2
    assert "No such command" in result.stderr
