"""`qkv.inspect.path_patch`: through every receiver it is ordinary patching of the sender,
through none the corrupted run, through one head's query the edit made by hand from W_O."""

from __future__ import annotations

import pytest
import torch

from intervention_models import (
    assert_refused_and_unchanged,
    gemma2_like_pretrained,
    gentle,
    llama_like,
)
from qkv.inspect.metrics import Metric
from qkv.inspect.patch import patch
from qkv.inspect.path_patch import path_patch
from qkv.nn.edit import Edit
from variant_models import TEXT, decoder, tiny

CORRUPT = "the bank of the river was deep and wide"
CLEANS = [TEXT, "the bank of the river", "the river was wide and deep and"]
CORRUPTS = [CORRUPT, "the river of the bank", "the bank was deep and wide and"]
METRICS = ["diff: river, wide", "prob: deep", "kl"]


@pytest.fixture(scope="module", params=[llama_like, gemma2_like_pretrained])
def model(request):
    return request.param()  # GQA with RMSNorm; and norms on each sublayer's output


@pytest.fixture(scope="module")
def ordinary(model):
    return patch(model, CLEANS, CORRUPTS, METRICS, what="heads")


@pytest.mark.parametrize("sender", [(0, 0), (0, 1), (1, 1)])
def test_through_every_receiver_it_is_patching_the_sender(model, ordinary, sender):
    every = path_patch(model, CLEANS, CORRUPTS, METRICS, sender=sender, via=("q", "k", "v"))
    expected = ordinary.grids["heads"].values[:, sender[0], sender[1]]  # (N,): each pair
    torch.testing.assert_close(every.spread.values, expected, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(every.clean_spread.values, ordinary.clean_spread.values)
    layer = sender[0]
    assert every.receivers[-1] == "logits" and (layer, "mlp") in every.receivers
    assert all(r[0] > layer for r in every.receivers if r != "logits" and r[1] != "mlp")


def test_through_no_receiver_it_is_the_corrupted_run(model, ordinary):
    none = path_patch(model, CLEANS, CORRUPTS, METRICS, sender=(0, 1), receivers=[])
    torch.testing.assert_close(none.spread.values, ordinary.corrupt_spread.values, atol=1e-5,
                               rtol=1e-5)  # fmt: skip
    data = none.to_dict()
    assert data["receivers"] == [] and data["sender"] == [0, 1] and len(data["pairs"]) == 3


def test_through_one_heads_query_it_is_the_edit_made_by_hand_from_w_o():
    """delta = W_O[:, head 1's slice] (clean z - corrupt z) of layer 0, added to the input of
    layer 1 head 0's query alone (under GQA its keys and values are left as they were)."""
    model = llama_like()
    stack, metric = model.model, Metric.parse("diff: river, wide")
    ids = [torch.tensor([model.encode(text).ids]) for text in (TEXT, CORRUPT)]
    with torch.inference_mode():
        clean, corrupt = (stack(i, layers=[0]).records[0].out for i in ids)  # (1, H, T, D)
        D = clean.shape[-1]
        w_o = stack.blocks[0].attn.out.weight[:, D : 2 * D]  # (C, D): head 1's columns
        delta = (clean[:, 1] - corrupt[:, 1]) @ w_o.T  # (1, T, C)
        added = torch.zeros(1, delta.shape[1], 2, delta.shape[2])  # (B, T, H, C)
        added[:, :, 0] = delta
        logits = stack(ids[1], edits={1: Edit(q_input=added)}).logits[0, -1]
    expected = float(metric.score(logits, metric.ids(model.tokenizer)))
    found = path_patch(model, TEXT, CORRUPT, metric, sender=(0, 1), receivers=[(1, 0)])
    assert found.value == pytest.approx(expected, abs=1e-5)
    assert found.value != pytest.approx(found.corrupt, abs=1e-4)  # the path carries something


def test_the_interval_holds_the_mean(model):
    found = path_patch(model, CLEANS, CORRUPTS, METRICS, sender=(0, 0), receivers=["logits"])
    assert float(found.spread.low) <= found.value <= float(found.spread.high)


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda p: path_patch(p, TEXT, CORRUPT, "prob: deep", sender=(1, 0),
                              receivers=[(1, 1)]), "a layer after the sender"),
        (lambda p: path_patch(p, TEXT, CORRUPT, "prob: deep", sender=(2, 0)), "layers 0 to 1"),
        (lambda p: path_patch(p, TEXT, CORRUPT, "prob: deep", sender=(0, 5)), "head 5 is out"),
        (lambda p: path_patch(p, TEXT, CORRUPT, "prob: deep", sender=0), "sender is"),
        (lambda p: path_patch(p, TEXT, CORRUPT, "prob: deep", sender=(0, 0), via="o"), "via is"),
        (lambda p: path_patch(p, TEXT, CORRUPT, "prob: deep", sender=(0, 0),
                              receivers=[(1, "attn")]), "a receiver is"),
        (lambda p: path_patch(p, TEXT, CORRUPT, "prob: deep", sender=(0, 0),
                              receivers="some"), "receivers is 'all'"),
        (lambda p: path_patch(p, TEXT, "the bank", "prob: deep", sender=(0, 0)),
         "equal token length"),
    ],
)  # fmt: skip
def test_bad_input_is_refused_by_name(call, message):
    assert_refused_and_unchanged(call, message)


def test_post_norm_blocks_are_refused():
    post = gentle(tiny(decoder(norm_position="post")))
    with pytest.raises(ValueError, match="post-norm"):
        path_patch(post, TEXT, CORRUPT, "prob: deep", sender=(0, 0))
