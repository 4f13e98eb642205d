"""`qkv.inspect.patch` is exact by construction: a patch of everything is the clean run,
checked against a forward with the clean residual stream put in."""

from __future__ import annotations

import math

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
from qkv.inspect.patch import Metric, patch
from qkv.inspect.runs import run
from qkv.nn.edit import Edit
from variant_models import TEXT


def test_patching_clean_into_clean_changes_nothing_and_a_whole_layer_restores_it():
    pretrained = llama_like()
    metric = Metric.parse("diff:deep,wide")
    same = patch(pretrained, TEXT, TEXT, metric)
    assert same.clean == same.corrupt
    torch.testing.assert_close(same.heads, torch.full_like(same.heads, same.clean))
    torch.testing.assert_close(same.residual, torch.full_like(same.residual, same.clean))

    corrupt = "the bank of the river was deep and wide"  # as many tokens
    result = patch(pretrained, TEXT, corrupt, metric)
    assert result.clean != pytest.approx(result.corrupt)
    # every position of a layer's residual patched at once: the clean metric exactly
    stack = pretrained.model
    T = len(pretrained.encode(TEXT).ids)
    with torch.inference_mode():
        clean = run(stack, torch.tensor([pretrained.encode(TEXT).ids]))
        target = run(stack, torch.tensor([pretrained.encode(corrupt).ids]))
        everywhere = Edit(positions=torch.ones(1, T, dtype=torch.bool), residual=clean.inputs[1])
        states = stack(target.ids, edits={0: everywhere}).hidden
        restored = metric.score(stack.project(states[0, -1]), metric.ids(pretrained.tokenizer))
    assert float(restored) == pytest.approx(result.clean, abs=1e-5)
    # the last layer's residual at the last position decides the next token alone
    assert float(result.residual[-1, -1]) == pytest.approx(result.clean, abs=1e-5)
    assert float(result.residual[-1, 0]) == pytest.approx(result.corrupt, abs=1e-5)
    restored = result.restored(result.residual)
    assert float(restored[-1, -1]) == pytest.approx(1.0, abs=1e-4)
    data = result.to_dict()
    assert len(data["heads"]) == 2 and len(data["residual"][0]) == T


def test_the_metric_scores_the_next_token():
    logits = torch.tensor([0.0, 1.0, 2.0])
    logprobs = logits.log_softmax(-1)
    assert float(Metric("diff", ("a", "b")).score(logits, [2, 0])) == pytest.approx(2.0)
    assert float(Metric("prob", ("a",)).score(logits, [1])) == pytest.approx(
        math.exp(float(logprobs[1]))
    )
    assert Metric.parse("diff: Mary, John").tokens == (" Mary", " John")
    assert Metric.parse(("prob", "x")) == Metric("prob", ("x",))


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda p: patch(p, TEXT, "the bank", "diff:deep,wide"), "equal token length"),
        (lambda p: patch(p, TEXT, TEXT, "diff:deep,wide and"), "not one token"),
        (lambda p: patch(p, TEXT, TEXT, "diff:deep"), "takes 2 token"),
        (lambda p: patch(p, TEXT, TEXT, "deep"), "a metric is"),
    ],
)
def test_bad_input_is_one_clear_error(call, message):
    assert_refused_and_unchanged(call, message)


def test_patch_needs_a_decoder():
    with pytest.raises(ValueError, match="needs a decoder"):
        patch(encoder_like(), TEXT, TEXT, "prob:deep")


@pytest.mark.parametrize("make", [llama_like, gemma2_like_pretrained])
def test_patch_leaves_the_model_as_it_was(make):
    pretrained = make()
    before = snapshot(pretrained)
    patch(pretrained, TEXT, "the bank of the river was deep and wide", "prob:deep")
    assert_unchanged(pretrained, before)
    assert not torch.is_grad_enabled() or all(p.grad is None for p in pretrained.model.parameters())
