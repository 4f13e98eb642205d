"""Layers with different head counts (Qwen3.5's linear layers have more heads than its full
ones): every view reads each layer's own count, its (L, Hmax) tables hold NaN where a layer
has fewer heads, a head a layer lacks is refused naming that layer's count, and the numbers of
the heads a layer has are the ones that layer gives alone."""

from __future__ import annotations

import copy

import pytest
import torch

import qkv
from linear_models import wide_linear_model
from qkv.inspect.layer_heads import heads_per_layer
from qkv.inspect.probe import probe
from variant_models import TEXT

LACKS = "layer 2 of tiny has 2 heads"
ATOL = 1e-4  # as in test_linear_interventions: runs resumed after a prefix, float32


@pytest.fixture(scope="module")
def model():
    return wide_linear_model()


def nan_only_where_lacking(grid: torch.Tensor):
    assert grid.shape == (3, 4)
    assert bool(grid[2, 2:].isnan().all())
    assert not bool(grid[:2].isnan().any()) and not bool(grid[2, :2].isnan().any())


def test_each_layer_has_its_own_count(model):
    assert heads_per_layer(model.model) == [4, 4, 2]


def test_the_weights_stack_nan_for_heads_a_layer_lacks(model):
    seen = model.attentions(TEXT)
    weights = seen.weights
    assert weights.shape == (3, 4, 9, 9)
    assert bool(weights[2, 2:].isnan().all()) and not bool(weights[:2].isnan().any())
    for layer in range(3):
        record = seen.records[layer]
        own = record.weights()[0]  # (H_layer, T, T), the layer alone
        torch.testing.assert_close(weights[layer, : own.shape[0]], own.float())
    assert record.shape.H == 2
    only = model.attentions(TEXT, layers=[0, 2], heads=[3]).weights
    torch.testing.assert_close(only[0, 0], seen.records[0].weights([3])[0, 0].float())
    assert bool(only[1].isnan().all())
    with pytest.raises(ValueError, match=LACKS):
        model.attentions(TEXT, layers=[2], heads=[3])


def test_hide_fills_the_heads_each_layer_has(model):
    hidden = qkv.hide(model, TEXT, "bank", query="deep")
    nan_only_where_lacking(hidden.effect)
    alone = qkv.hide(model, TEXT, "bank", query="deep", layers=[2], heads=[0, 1])
    torch.testing.assert_close(hidden.effect[2, :2], alone.effect[2, :2], atol=1e-7, rtol=1e-4)
    assert all(h < 2 for n, h, _ in hidden.ranked() if n == 2)
    assert hidden.to_dict()["effect"][2][3] is None
    # head 3 everywhere: layers 0 and 1 hide it, layer 2 has none to hide
    three = qkv.hide(model, TEXT, "bank", query="deep", layers=[0, 1, 2], heads=[3])
    assert bool(three.effect[2].isnan().all()) and not bool(three.effect[:2, 3].isnan().any())
    with pytest.raises(ValueError, match=LACKS):
        qkv.hide(model, TEXT, "bank", layers=[2], heads=[3])


def test_ablate_reads_each_layers_heads(model):
    every = qkv.ablate(model, TEXT)
    assert len(every.heads) == 4 + 4 + 2
    nan_only_where_lacking(every.effect)
    with pytest.raises(ValueError, match=LACKS):
        qkv.ablate(model, TEXT, [(2, 3)])
    ablated = qkv.ablate(model, TEXT, [(0, 3)])  # a head only the linear layers have
    silent = copy.deepcopy(model)
    with torch.no_grad():
        silent.model.blocks[0].attn.out.weight[:, 48:64] = 0.0  # head 3's 16 columns
        expected = silent.model(torch.tensor([model.encode(TEXT).ids])).hidden[0]
    torch.testing.assert_close(ablated.states, expected, atol=ATOL, rtol=0)
    assert float(every.effect[0, 3]) == pytest.approx(ablated.total, rel=1e-4)


def test_patch_fills_the_heads_each_layer_has(model):
    patched = qkv.patch(model, TEXT, "the bank of the river was deep and wide", "diff: river, wide")
    nan_only_where_lacking(patched.heads)
    assert patched.to_dict()["heads"][2][2] is None
    assert abs(float(patched.heads[0, 3]) - patched.corrupt) > 1e-6  # head 3 was patched


def test_the_lens_splits_each_layers_own_heads(model):
    split = qkv.lens(model, TEXT, token="river").attribution
    nan_only_where_lacking(split.heads)
    assert abs(split.remainder) < 1e-4 * max(1.0, abs(split.logit))
    assert split.total == pytest.approx(split.logit, abs=1e-4)
    names = [name for name, _ in split.terms()]
    assert "layer 0 head 3" in names and "layer 2 head 1" in names
    assert "layer 2 head 2" not in names
    assert split.to_dict()["heads"][2][3] is None


def test_the_census_scores_each_layers_own_heads(model):
    census = qkv.heads(model, prompts=[TEXT], rows=1, length=4)
    for name in ("previous_token", "induction", "first_token", "self", "entropy"):
        nan_only_where_lacking(census.scores(name))
    W = model.attentions(TEXT).records[0].weights()[0].double()  # (4, T, T)
    shares = W.abs() / W.abs().sum(-1, keepdim=True)
    torch.testing.assert_close(census.previous_token[0], shares.diagonal(-1, -2, -1).mean(-1),
                               atol=1e-6, rtol=0)  # fmt: skip
    full = model.attentions(TEXT).records[2].weights()[0].double()  # (2, T, T)
    torch.testing.assert_close(census.previous_token[2, :2], full.diagonal(-1, -2, -1).mean(-1),
                               atol=1e-6, rtol=0)  # fmt: skip
    assert all((n, h) != (2, 3) and (n, h) != (2, 2) for n, h, _ in census.top("self", 12))
    out = census.to_dict()
    assert out["heads"] == 4 and out["heads_per_layer"] == [4, 4, 2]
    assert out["scores"]["entropy"][2][2:] == [None, None]
    assert census.sink_per_layer[2] == pytest.approx(float(census.first_token[2, :2].mean()))


def test_a_trace_checks_the_head_against_its_layer(model):
    with pytest.raises(ValueError, match=LACKS):
        qkv.trace(model, TEXT, "deep", "bank", layer=2, head=3)
    traced = qkv.trace(model, TEXT, "deep", "bank", head=3)  # chosen among layers 0 and 1
    assert traced.layer in (0, 1) and traced.num_heads == 4
    full = qkv.trace(model, TEXT, "deep", "bank", layer=2, head=1)
    assert full.num_heads == 2 and full.linear is None
    best = qkv.trace(model, TEXT, "deep", "bank", layer=2)
    assert best.head in (0, 1)


def test_the_probes_cue_attention_has_each_layers_own_heads(model):
    sentences = ["the river bank was wide", "the bank was deep and wide", "river and the bank",
                 "the deep bank"]  # fmt: skip
    found = probe(model, "bank", sentences, ["a", "b", "a", "b"],
                  cues=["river", "deep", "river", "deep"])  # fmt: skip
    nan_only_where_lacking(found.cue_attention)
    layer, head, share = found.cue_head
    assert share == share and head < heads_per_layer(model.model)[layer]
    assert found.to_dict()["cue_attention"][2][3] is None


def test_recording_while_generating_takes_the_heads_of_the_layers_asked(model):
    every = model.generate("the bank of", max_new_tokens=2, record="all")  # (L, Hmax, ...)
    assert every.row(1).shape[:2] == (3, 4)
    nan_only_where_lacking(every.row(1)[..., -1])  # the full layer 2 has heads 0-1 only
    found = model.generate("the bank of", max_new_tokens=2, record={"layers": [2]})
    assert found.layers == [2] and found.heads == [0, 1]
    with pytest.raises(ValueError, match=LACKS):
        model.generate("the bank of", max_new_tokens=2, record={"layers": [2], "heads": [3]})
