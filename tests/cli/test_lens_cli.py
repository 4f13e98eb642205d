"""`qkv lens`, run as a user runs it: the table, --json, and one-line errors."""

from __future__ import annotations

import json
import subprocess
import sys

from qkv.inspect.lens import lens

TEXT = "The capital of France is"


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "qkv.cli", "lens", *args], capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip


def test_lens_prints_each_layer_then_the_terms_and_json_matches_the_library(smollm2):
    expected = lens(smollm2, TEXT, top=3)
    table = run(TEXT, "--top", "3", "--terms", "4")
    assert table.returncode == 0, table.stderr
    lines = table.stdout.splitlines()
    rows = [line for line in lines if line.startswith(("  embeddings", "  layer "))]
    assert len(rows) == 31 and rows[-1].split()[:2] == ["layer", "29"]
    assert rows[-1].split(None, 2)[2].startswith("' Paris' ") and "| rank 0," in rows[-1]
    start = next(i for i, line in enumerate(lines) if line.startswith("direct logit"))
    assert "' Paris'" in lines[start]
    terms = lines[start + 1 : start + 5]
    name, value = expected.attribution.terms()[0]
    assert terms[0].split(None, 1) == [f"{value:+.4f}", name]
    assert "the other 297 terms" in lines[start + 5] and "remainder" in lines[start + 6]
    assert lines[start + 7].split()[0] == f"{expected.attribution.total:.4f}"
    assert "total = the logit" in lines[start + 7]

    data = json.loads(run(TEXT, "--top", "3", "--json").stdout)
    assert data["token"] == " Paris" and data["rank"] == expected.rank
    assert [[t["id"] for t in row] for row in data["top"]] == expected.top_ids
    assert data["attribution"]["heads"] == expected.attribution.heads.tolist()


def test_an_encoder_is_refused_in_one_line():
    refused = run("The bank of the river", "-m", "minilm")
    assert refused.returncode == 2 and refused.stdout == ""
    assert refused.stderr.strip() == (
        "error: the logit lens reads a decoder's next-token predictions; minilm is bert, not a "
        "decoder"
    )
