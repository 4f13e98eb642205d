"""The `qkv` command, run as a user runs it: a real process."""

from __future__ import annotations

import json
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
    lines = run("backends").stdout.splitlines()
    assert [line.split()[0] for line in lines] == ["flash", "sdpa", "eager", "loop", "auto"]


def test_an_unknown_verb_exits_2():
    result = run("nope")
    assert result.returncode == 2
    assert "No such command" in result.stderr


def test_generate_streams_the_greedy_continuation():
    result = run("generate", "The bank on the side of the river", "-n", "12")
    assert result.returncode == 0, result.stderr
    expected = qkv.load("smollm2").generate("The bank on the side of the river", 12)
    assert result.stdout == "The bank on the side of the river" + expected + "\n"


def test_embed_prints_cosine_similarities_and_json():
    sentences = ["The bank of the river", "The river's edge", "I paid the bank"]
    table = run("embed", *sentences)
    assert table.returncode == 0, table.stderr
    rows = [line for line in table.stdout.splitlines() if line.startswith("  [")]
    similarity = [[float(x) for x in row.split("]")[1].split()[:3]] for row in rows]
    assert all(abs(similarity[i][i] - 1) < 1e-3 for i in range(3))
    assert similarity[0][1] > similarity[0][2], "the two river sentences are closer"
    lines = run("embed", "--json", *sentences).stdout.splitlines()
    assert [json.loads(line)["sentence"] for line in lines] == sentences
    assert len(json.loads(lines[0])["embedding"]) == 384


def test_bad_input_is_one_line_on_stderr_and_exit_2():
    result = run("generate", "hi", "--temperature", "-1")
    assert result.returncode == 2
    assert result.stderr.strip() == "error: temperature must be a finite number >= 0, got -1.0"
    result = run("embed", "hi", "--model", "./missing-model")
    assert result.returncode == 2 and result.stderr.startswith("error: ./missing-model does not")
