"""`qkv.inspect.ablate` is exact by construction: an ablation of every head is a layer
without attention, a mean ablation a forward with the mean put in, each checked against an
independent computation."""

from __future__ import annotations

import copy

import pytest
import torch

from intervention_models import (
    assert_refused_and_unchanged,
    assert_unchanged,
    encoder_like,
    gemma2_like_pretrained,
    llama_like,
    snapshot,
)
from qkv.inspect.ablate import ablate
from qkv.inspect.runs import run
from qkv.nn.edit import Edit
from variant_models import TEXT


def test_ablating_every_head_of_a_layer_removes_its_attention_output():
    """Zero-ablating all heads of layer 0 equals a copy of the model whose layer 0 output
    projection is zero (a model without biases: nothing of attention reaches the stream)."""
    pretrained = llama_like()
    result = ablate(pretrained, TEXT, [0])
    without = copy.deepcopy(pretrained.model)
    with torch.no_grad():
        without.blocks[0].attn.out.weight.zero_()
        expected = without(torch.tensor([pretrained.encode(TEXT).ids])).hidden[0]
    torch.testing.assert_close(result.states, expected, atol=1e-6, rtol=1e-5)
    assert result.heads == [(0, 0), (0, 1)] and result.effect[1].isnan().all()
    assert result.total > 0 and result.next is not None


def test_mean_ablation_puts_the_heads_mean_output_over_the_reference_in_its_place():
    """With one reference text equal to the text, a head's mean output is the mean over the
    text's own tokens: check against a forward where that head's outputs are set to it."""
    pretrained = encoder_like()
    result = ablate(pretrained, TEXT, [(1, 2)], mode="mean", reference=[TEXT])
    ids = torch.tensor([pretrained.encode(TEXT).ids])
    with torch.inference_mode():
        clean = run(pretrained.model, ids)
        mean = clean.head_outputs[1][2].mean(0)  # (D,)
        which = torch.zeros(1, 4, 1, 1, dtype=torch.bool)
        which[0, 2] = True
        values = torch.zeros(1, 4, 1, mean.shape[0])
        values[0, 2, 0] = mean
        expected = pretrained.model(ids, edits={1: Edit(heads=which, head_values=values)}).hidden
    torch.testing.assert_close(result.states, expected[0], atol=1e-6, rtol=1e-5)
    zero = ablate(pretrained, TEXT, [(1, 2)])
    assert not torch.allclose(zero.states, result.states)


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda p: ablate(p, TEXT, [(0, 5)]), "head 5"),
        (lambda p: ablate(p, TEXT, "all", mode="half"), "mode must be"),
        (lambda p: ablate(p, TEXT, "all", reference=[TEXT]), "mode='mean'"),
    ],
)
def test_bad_input_is_one_clear_error(call, message):
    assert_refused_and_unchanged(call, message)


@pytest.mark.parametrize("make", [llama_like, encoder_like, gemma2_like_pretrained])
def test_ablate_leaves_the_model_as_it_was(make):
    pretrained = make()
    before = snapshot(pretrained)
    ablate(pretrained, TEXT, "all", mode="mean", reference=[TEXT, "the river"])
    assert_unchanged(pretrained, before)
    assert not torch.is_grad_enabled() or all(p.grad is None for p in pretrained.model.parameters())
