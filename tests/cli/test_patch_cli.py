"""`qkv patch` and `qkv path-patch` as a user runs them: in-process on a tiny Llama-like model
(its numbers the library's own), and one real process on SmolLM2 reading a file of pairs."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from typer.testing import CliRunner

import qkv.pretrained
from intervention_models import llama_like
from qkv.cli import app
from qkv.inspect.patch import patch
from qkv.inspect.path_patch import path_patch
from variant_models import TEXT

CORRUPT = "the bank of the river was deep and wide"
PAIRS = [(TEXT, CORRUPT, "diff: river, wide"), ("the bank of the river", "the river of the bank",
                                                "prob: deep")]  # fmt: skip


@pytest.fixture(scope="module")
def model():
    return llama_like()


@pytest.fixture
def run(model, monkeypatch):
    monkeypatch.setattr(qkv.pretrained, "load", lambda *args, **kwargs: model)
    runner = CliRunner()
    return lambda *args: runner.invoke(app, [*args, "--model", "tiny"])


@pytest.fixture
def pairs_file(tmp_path):
    path = tmp_path / "pairs.tsv"
    path.write_text("".join(f"{a}\t{b}\t{m}\n" for a, b, m in PAIRS), encoding="utf-8")
    return path


def test_patch_reads_a_file_of_pairs_and_its_json_is_the_librarys(run, model, pairs_file):
    told = run("patch", "--pairs", str(pairs_file), "--what", "heads,q,mlp_layers", "--json")
    assert told.exit_code == 0, told.output
    data = json.loads(told.stdout)
    expected = patch(model, pairs_file, what=["heads", "q", "mlp_layers"])
    assert data["what"] == ["heads", "q", "mlp_layers"] and len(data["pairs"]) == 2
    torch.testing.assert_close(torch.tensor(data["q"], dtype=torch.float64), expected.grid("q"))
    assert data["clean"] == pytest.approx(expected.clean)
    shown = run("patch", "--pairs", str(pairs_file), "--what", "heads,residual,head_positions")
    assert shown.exit_code == 0, shown.output
    assert shown.stdout.startswith("2 pairs") and "95% interval" in shown.stdout
    assert "head outputs at one position" in shown.stdout and "-1" in shown.stdout


def test_path_patch_prints_and_its_json_is_the_librarys(run, model):
    args = ("path-patch", TEXT, CORRUPT, "--metric", "diff: river, wide", "--sender", "0.1")
    told = run(*args, "--receivers", "1.0,1.mlp,logits", "--via", "q,v", "--json")
    assert told.exit_code == 0, told.output
    data = json.loads(told.stdout)
    expected = path_patch(model, TEXT, CORRUPT, "diff: river, wide", sender=(0, 1),
                          receivers=[(1, 0), (1, "mlp"), "logits"], via=["q", "v"])  # fmt: skip
    assert data["value"] == pytest.approx(expected.value)
    assert data["receivers"] == [[1, 0], [1, "mlp"], "logits"] and data["via"] == ["q", "v"]
    shown = run(*args)
    assert shown.exit_code == 0, shown.output
    assert "layer 0 head 1's change through" in shown.stdout


@pytest.mark.parametrize(
    "args, message",
    [
        (["patch", TEXT], "give two texts"),
        (["patch", TEXT, CORRUPT, "--pairs", "x.tsv", "--metric", "prob: deep"], "not both"),
        (["patch", TEXT, CORRUPT, "--metric", "prob: deep", "--what", "heads,attn"], "attn"),
        (["patch", TEXT, CORRUPT], "no metric"),
        (["path-patch", TEXT, CORRUPT, "--metric", "prob: deep", "--sender", "1"], "LAYER.HEAD"),
        (["path-patch", TEXT, CORRUPT, "--metric", "prob: deep", "--sender", "0.0",
          "--receivers", "1.x"], "--receivers takes"),
    ],
)  # fmt: skip
def test_bad_input_is_one_line_and_exit_2(run, args, message):
    told = run(*args)
    assert told.exit_code == 2, told.output
    assert message in told.output


def test_the_qkv_process_patches_a_file_of_pairs_on_smollm2(tmp_path):
    """One real process: pairs of two lengths, their mean and interval, each pair's last
    layer's residual at its last position restoring its clean metric."""
    path = tmp_path / "ioi.jsonl"
    rows = [{"clean": "Mary met John. John thanked", "corrupt": "Mary met John. Mary thanked",
             "metric": "diff: Mary, John"},
            {"clean": "Anna and Tom talked. Tom thanked", "corrupt":
             "Anna and Tom talked. Anna thanked", "metric": "diff: Anna, Tom"}]  # fmt: skip
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    shown = subprocess.run([sys.executable, "-m", "qkv.cli", "patch", "--pairs", str(path),
                            "--what", "residual", "--layers", "29", "--json"],
                           capture_output=True, text=True,
                           timeout=300)  # fmt: skip
    assert shown.returncode == 0, shown.stderr
    data = json.loads(shown.stdout)
    per_pair = data["spreads"]["residual"]["per_prompt"]
    for n in range(2):
        clean = data["clean_spread"]["per_prompt"][n]
        assert per_pair[n][-1][-1] == pytest.approx(clean, abs=1e-3)
    assert data["clean_spread"]["low"] <= data["clean"] <= data["clean_spread"]["high"]
