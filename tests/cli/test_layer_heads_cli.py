"""`qkv explain`, `qkv ablate`, `qkv hide` and `qkv heads` on a model whose linear layers have
more heads than its full layer (as Qwen3.5's): each layer's own heads, a head a layer lacks
refused by that layer's count."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

import qkv.pretrained
from linear_models import wide_linear_model
from qkv.cli import app
from variant_models import TEXT


@pytest.fixture(scope="module")
def wide():
    return wide_linear_model()  # layers 0, 1 linear of 4 heads, layer 2 full of 2


@pytest.fixture
def run(wide, monkeypatch):
    monkeypatch.setattr(qkv.pretrained, "load", lambda *args, **kwargs: wide)
    runner = CliRunner()
    return lambda *args: runner.invoke(app, [*args, "--model", "wide"])


def test_explain_refuses_a_head_its_layer_lacks(run):
    told = run("explain", TEXT, "--query", "deep", "--key", "bank", "--layer", "2", "--head", "3")
    assert told.exit_code != 0
    assert "head 3 is out of range: layer 2 of tiny has 2 heads (0-1)" in told.output
    told = run("explain", TEXT, "--query", "deep", "--key", "bank", "--layer", "0", "--head", "3")
    assert told.exit_code == 0, told.output
    assert "this is head 3 of 4" in told.output


def test_ablate_takes_each_layers_own_heads(run):
    every = run("ablate", TEXT, "--json")
    assert every.exit_code == 0, every.output
    found = json.loads(every.output)
    assert len(found["heads"]) == 4 + 4 + 2 and [2, 3] not in found["heads"]
    three = json.loads(run("ablate", TEXT, "--heads", "3", "--json").output)
    assert three["heads"] == [[0, 3], [1, 3]]
    told = run("ablate", TEXT, "--layers", "2", "--heads", "3")
    assert told.exit_code != 0 and "layer 2 of wide has 2 heads" in told.output


def test_hide_and_heads_say_each_layers_count(run):
    hidden = run("hide", TEXT, "--key", "bank", "--query", "deep", "--json")
    assert hidden.exit_code == 0, hidden.output
    assert json.loads(hidden.output)["effect"][2][2:] == [None, None]
    census = run("heads", "--top", "2")
    assert census.exit_code == 0, census.output
    assert "3 layers x up to 4 heads (4, 4, 2 by layer)" in census.output
    dumped = json.loads(run("heads", "--json").output)
    assert dumped["heads_per_layer"] == [4, 4, 2]
