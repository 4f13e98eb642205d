"""A run with layers of linear attention (Gated DeltaNet) beside softmax ones: it trains,
saves its memory's sizes in config.toml and config.json, reloads equal and resumes exactly."""

from __future__ import annotations

import importlib.util
import json
import re

import pytest
import torch
from conftest import REPO, qkv_command, tiny, write_toml

import qkv
from qkv.nn.delta import GatedDeltaNet
from qkv.nn.record import AttentionRecord
from qkv.train import RunConfig, train

HYBRID = {"layer_types": ["linear", "full"]}


@pytest.mark.parametrize("arch", ["bert", "llama"])
def test_a_run_with_a_linear_layer_reloads_equal_and_resumes_exactly(arch, tmp_path):
    config = tiny(arch, "bank", model=HYBRID, train={"steps": 4, "checkpoint_every": 2})
    whole = train(config, tmp_path / "whole", quiet=True)
    assert whole.losses[4] < whole.losses[1]
    half = train(config.override(["train.steps=2"]), tmp_path / "half", quiet=True)
    resumed = train(config, tmp_path / "half", resume=True, quiet=True)
    assert resumed.losses == {k: v for k, v in whole.losses.items() if k > 2}
    assert half.losses == {k: v for k, v in whole.losses.items() if k <= 2}

    saved = RunConfig.from_toml(tmp_path / "whole" / "config.toml")
    assert saved == config and saved.model.layer_types == ("linear", "full")
    hf = json.loads((whole.checkpoint / "config.json").read_text())
    assert hf["qkv_linear_attention"]["layer_types"] == ["linear", "full"]
    assert hf["qkv_linear_attention"]["key_size"] == 16

    mine, theirs = qkv.load(tmp_path / "half"), qkv.load(tmp_path / "whole")
    assert mine.config == theirs.config and mine.config.layer_types == ("linear", "full")
    assert isinstance(theirs.model.blocks[0].attn, GatedDeltaNet)
    assert not isinstance(theirs.model.blocks[1].attn, GatedDeltaNet)
    a, b = mine.model.state_dict(), theirs.model.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in b)

    # the linear layer's record: effective weights that give its heads' reads of the memory
    ids = torch.tensor([theirs.tokenizer.encode("anna saw the reeds near the bank .").ids])
    out = theirs.model(ids, layers=[0])
    record: AttentionRecord = out.records[0]
    weights = record.weights()
    assert record.linear is not None and (weights < 0).any()
    assert torch.allclose(weights.float() @ record.v, record.out, atol=1e-5)


def test_the_command_line_names_each_layers_attention(tmp_path):
    config = tiny("bert", "bank", train={"steps": 1, "eval_every": 0})
    toml = write_toml(config, tmp_path / "t.toml")
    done = qkv_command("train", str(toml), "--layers", "full,linear,full", "--out",
                       str(tmp_path / "run"), "--quiet")  # fmt: skip
    assert done.returncode == 0, done.stderr
    saved = RunConfig.from_toml(tmp_path / "run" / "config.toml")
    assert saved.model.layers == 3 and saved.model.layer_types == ("full", "linear", "full")
    assert qkv.load(tmp_path / "run").config.layer_types == ("full", "linear", "full")


def test_layer_types_that_cannot_be_built_are_refused_by_name():
    with pytest.raises(ValueError, match=r"model.layer_types names 1 layers, model.layers is 2"):
        tiny("bert", "bank", model={"layer_types": ["linear"]})
    with pytest.raises(ValueError, match=r"model.layer_types must be one of full, linear"):
        tiny("bert", "bank", model={"layer_types": ["linear", "sliding"]})
    with pytest.raises(ValueError, match=r"needs arch gpt2, llama or bert: bart's decoder"):
        tiny("bart", "swap", model=HYBRID)


def test_the_linear_page_shows_a_runs_own_effective_weights(tmp_path):
    """docs/make_linear.py writes docs/linear.md from a run's records (the page's run is the
    bank preset trained in full; here one of 2 steps)."""
    spec = importlib.util.spec_from_file_location("make_linear", REPO / "docs" / "make_linear.py")
    page = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(page)
    config = tiny("bert", "bank", model=HYBRID, train={"steps": 2, "eval_every": 0})
    train(config, tmp_path / "run", quiet=True)
    page.write(tmp_path / "linear.md", tmp_path / "run")
    text = (tmp_path / "linear.md").read_text()
    assert not re.search(r"\{[a-z_]+\}", text)  # every number filled in
    assert text.count("| *sum* |") == 2 and "Trained 2 steps" in text
    differences = [float(d) for d in re.findall(r"largest difference ([0-9.e+-]+)\.", text)]
    assert len(differences) == 2 and max(differences) < 1e-5
    rows = [line for line in text.splitlines() if line.startswith("| reeds |")]
    assert len(rows) == 1 and len(rows[0].split("|")) == 2 + 1 + 2 * 2  # 2 heads a layer
