"""`qkv attribute`, in process on a tiny Llama-like model (`load` answers with it): its JSON is
the library's, a file of pairs reads as the pairs, and bad input is one line with exit code 2."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

import qkv
import qkv.pretrained
from intervention_models import llama_like
from qkv.cli import app

CLEAN, CORRUPT = "the bank of the river was wide", "the river of the bank was wide"
METRIC = "diff: bank, river"


@pytest.fixture(scope="module")
def model():
    return llama_like()


@pytest.fixture
def run(model, monkeypatch):
    monkeypatch.setattr(qkv.pretrained, "load", lambda *args, **kwargs: model)
    return lambda *args: CliRunner().invoke(app, ["attribute", *args])


def test_json_is_the_librarys_and_text_lists_heads_edges_and_faithfulness(model, run):
    shown = run(CLEAN, CORRUPT, "--metric", METRIC, "--edges", "--json", "--faithfulness")
    assert shown.exit_code == 0, shown.output
    data = json.loads(shown.output)
    expected = qkv.attribute(model, CLEAN, CORRUPT, METRIC, edges=True)
    torch.testing.assert_close(torch.tensor(data["heads"], dtype=torch.float64), expected.heads)
    assert data["senders"] == expected.senders and len(data["edges"][0]) == 15
    assert data["faithfulness"]["top"] == 4 and -1 <= data["faithfulness"]["pearson"] <= 1
    text = run(CLEAN, CORRUPT, "--metric", METRIC, "--edges", "--top", "3", "--faithfulness")
    assert text.exit_code == 0, text.output
    layer, head, value = expected.top_heads(1)[0]
    assert f"{layer:>5}  {head:>4}   {value:+.4f}" in text.output
    sender, receiver, _ = expected.top_edges(1)[0]
    assert f"{sender:>8} -> {receiver}" in text.output
    assert "against real patching" in text.output


def test_a_file_of_pairs_with_their_own_metrics(model, run, tmp_path):
    pairs = tmp_path / "pairs.tsv"
    pairs.write_text(f"{CLEAN}\t{CORRUPT}\t{METRIC}\nthe river was deep\tthe bank was deep\t"
                     "diff: river, bank\n")  # fmt: skip
    shown = run("--pairs", str(pairs), "--json", "--steps", "2")
    assert shown.exit_code == 0, shown.output
    data = json.loads(shown.output)
    assert [m["tokens"] for m in data["metrics"]] == [[" bank", " river"], [" river", " bank"]]
    assert data["steps"] == 2 and len(data["spreads"]["heads"]["per_prompt"]) == 2


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ([CLEAN, "the river was wide", "--metric", METRIC], "equal token length"),
        ([CLEAN, CORRUPT], "give --metric"),
        ([CLEAN, CORRUPT, "--metric", METRIC, "--pairs", "x.tsv"], "not both"),
        ([CLEAN, CORRUPT, "--metric", METRIC, "--top", "0"], "--top must be 1 or more"),
        ([CLEAN, CORRUPT, "--metric", METRIC, "--steps", "0"], "steps must be"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(run, args, message):
    shown = run(*args)
    assert shown.exit_code == 2
    assert message in shown.output and shown.output.count("\n") == 1
