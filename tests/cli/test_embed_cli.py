"""`qkv embed`, run as a user runs it: a real process."""

from __future__ import annotations

import json
import subprocess
import sys


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "qkv.cli", *args], capture_output=True, text=True, timeout=120
    )


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
