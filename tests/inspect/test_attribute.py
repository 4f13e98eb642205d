"""qkv.attribute: exact where the metric is linear in what is patched (it then equals
qkv.patch), each edge's score the sender's change times the receiver's own gradient measured
by finite differences, integrated gradients by hand, batches as pairs alone, refusals."""

from __future__ import annotations

import json

import pytest
import torch

import qkv
from intervention_models import assert_refused_and_unchanged, encoder_like, llama_like
from qkv.inspect.attribute import Faithfulness
from qkv.inspect.attribute_edges import edge_mask
from qkv.nn.edit import Edit
from variant_models import gemma2_like, tiny

CLEAN, CORRUPT = "the bank of the river was wide", "the river of the bank was wide"
METRIC = "diff: bank, river"
BANK, RIVER = 2, 4  # their ids in variant_models.WORDS


def metric_of(logits):  # (B, T, vocab) -> (B,) at the last position
    logprobs = logits[:, -1].log_softmax(-1)
    return logprobs[:, BANK] - logprobs[:, RIVER]


@pytest.fixture(scope="module")
def model():
    pretrained = llama_like()
    pretrained.model.double()
    return pretrained


@pytest.fixture(scope="module")
def toy():
    """The metric linear in the last layer's head outputs and block output: its MLP writes
    nothing, no final norm, and "diff" is a difference of logits."""
    pretrained = llama_like()
    stack = pretrained.model.double()
    with torch.no_grad():
        stack.blocks[1].mlp.down.weight.zero_()
    stack.norm = None
    return pretrained


@pytest.mark.parametrize("steps", [1, 4])
def test_equals_real_patching_where_the_metric_is_linear(toy, steps):
    found = qkv.attribute(toy, CLEAN, CORRUPT, METRIC, steps=steps)
    patched = qkv.patch(toy, CLEAN, CORRUPT, METRIC)
    assert float(found.clean[0]) == pytest.approx(patched.clean)
    assert float(found.corrupt[0]) == pytest.approx(patched.corrupt)
    torch.testing.assert_close(found.heads[1], patched.heads[1] - patched.corrupt)
    torch.testing.assert_close(found.residual[1], patched.residual[1] - patched.corrupt)
    # patching every position of the last block's output restores the whole gap
    assert float(found.residual[1].sum()) == pytest.approx(patched.clean - patched.corrupt)
    checked = found.faithfulness(top=2)
    torch.testing.assert_close(checked.patched, patched.heads - patched.corrupt)
    assert -1 <= checked.pearson <= 1 and checked.top == 2


def test_each_grid_is_gradient_times_difference(model):
    found = qkv.attribute(model, CLEAN, CORRUPT, METRIC)
    clean = qkv.cache(model, CLEAN, names=["z", "q", "k", "v", "mlp_out", "resid_post"])
    corrupt = qkv.cache(model, CORRUPT, grad=METRIC, names=clean.names)
    for n in range(2):
        for name, sums in (("heads", (-1, -2)), ("q", (-1, -2)), ("k", (-1, -2)),
                           ("v", (-1, -2)), ("mlp", -1), ("residual", -1)):  # fmt: skip
            kind = {"heads": "z", "mlp": "mlp_out", "residual": "resid_post"}.get(name, name)
            expected = ((clean[kind, n] - corrupt[kind, n]) * corrupt.grad(kind, n)).sum(sums)
            torch.testing.assert_close(getattr(found, name)[n], expected[0])
    assert found.values["heads"].shape == (1, 2, 2)
    assert found.spread("heads").low.shape == (2, 2)


def test_each_edge_is_the_senders_change_times_the_receivers_own_gradient(model):
    found = qkv.attribute(model, CLEAN, CORRUPT, METRIC, edges=True)
    stack = model.model
    ids = torch.tensor([model.encode(CORRUPT).ids])
    kept = ["embed", "z", "mlp_out", "resid_mid", "resid_post"]
    clean, corrupt = (qkv.cache(model, t, names=kept) for t in (CLEAN, CORRUPT))
    deltas = {"embed": clean["embed"] - corrupt["embed"]}  # (1, T, C) each
    for n in range(2):
        for h in range(2):
            deltas[f"L{n}.H{h}"] = clean.result(n)[:, h] - corrupt.result(n)[:, h]
        deltas[f"L{n}.mlp"] = clean["mlp_out", n] - corrupt["mlp_out", n]

    def rest(n, after):  # the metric from block n's output on
        if n == 1:
            return metric_of(stack.project(stack.norm(after)))
        return metric_of(stack(ids, resume=(n + 1, after)).logits)

    def reading(receiver: str, delta):  # the metric with delta added to the receiver's input
        if receiver == "logits":
            return rest(1, corrupt["resid_post", 1] + delta)
        layer, _, part = receiver.partition(".")
        n = int(layer[1:])
        if part == "mlp":
            mid, block = corrupt["resid_mid", n], stack.blocks[n]
            return rest(n, mid + block.mlp(block.mlp_norm(mid + delta)))
        head, kind = int(part[1]), part[-1]
        add = torch.zeros(1, delta.shape[1], 2, delta.shape[2], dtype=delta.dtype)
        add[:, :, head] = delta
        return metric_of(stack(ids, edits={n: Edit(**{f"{kind}_input": add})}).logits)

    eps = 1e-6
    valid = edge_mask(2, 2)
    with torch.no_grad():
        for s, sender in enumerate(found.senders):
            for r, receiver in enumerate(found.receivers):
                if not valid[s, r]:
                    assert found.edges[s, r] != found.edges[s, r]  # NaN
                    continue
                delta = deltas[sender]
                slope = (reading(receiver, eps * delta) - reading(receiver, -eps * delta)) / (
                    2 * eps)  # fmt: skip
                assert float(found.edges[s, r]) == pytest.approx(float(slope), rel=1e-4, abs=1e-7)
    assert found.senders == ["embed", "L0.H0", "L0.H1", "L0.mlp", "L1.H0", "L1.H1", "L1.mlp"]
    assert found.receivers[:7] == ["L0.H0.q", "L0.H1.q", "L0.H0.k", "L0.H1.k", "L0.H0.v",
                                   "L0.H1.v", "L0.mlp"]  # fmt: skip
    # the taps split the shared key/value head by query head; the node grids are as without
    torch.testing.assert_close(found.k, qkv.attribute(model, CLEAN, CORRUPT, METRIC).k)


def test_integrated_gradients_average_the_gradients_between_the_embeddings(model):
    steps = 3
    found = qkv.attribute(model, CLEAN, CORRUPT, METRIC, steps=steps)
    stack = model.model
    ids = torch.tensor([model.encode(CORRUPT).ids])
    clean, corrupt = (qkv.cache(model, t, names=["embed", "z"]) for t in (CLEAN, CORRUPT))
    total = torch.zeros_like(clean["z", 0])
    for k in range(steps):
        x = corrupt["embed"] + (k + 0.5) / steps * (clean["embed"] - corrupt["embed"])
        tap = torch.zeros_like(total, requires_grad=True)
        logits = stack(ids, resume=(0, x), edits={0: Edit(head_add=tap)}).logits
        total += torch.autograd.grad(metric_of(logits).sum(), tap)[0]
    expected = ((clean["z", 0] - corrupt["z", 0]) * total / steps).sum((-1, -2))[0]
    torch.testing.assert_close(found.heads[0], expected)


def test_a_batch_of_pairs_is_each_pair_alone():
    pretrained = llama_like()
    pairs = [(CLEAN, CORRUPT), ("the river was deep", "the bank was deep")]
    metrics = [METRIC, "diff: river, bank"]
    both = qkv.attribute(pretrained, [p[0] for p in pairs], [p[1] for p in pairs], metrics,
                         edges=True)  # fmt: skip
    assert all(p.grad is None for p in pretrained.model.parameters())
    for n, (clean, corrupt) in enumerate(pairs):
        alone = qkv.attribute(pretrained, clean, corrupt, metrics[n], edges=True)
        for name, grid in alone.values.items():
            T = grid.shape[-1]
            torch.testing.assert_close(both.values[name][n, ..., :T], grid[0],
                                       rtol=1e-4, atol=1e-6)  # fmt: skip
        torch.testing.assert_close(both.edge_values[n], alone.edge_values[0], rtol=1e-4,
                                   atol=1e-6)  # fmt: skip
    assert bool(both.values["residual"][1, :, 4:].isnan().all())  # past its end
    assert both.heads.shape == (2, 2) and both.residual.shape == (2, 7)
    data = json.loads(json.dumps(both.to_dict()))
    assert len(data["edges"]) == len(both.senders) and data["steps"] == 1


def test_faithfulness_correlates_and_overlaps():
    a = torch.tensor([[1.0, -4.0], [2.0, float("nan")]])
    checked = Faithfulness.of(a, 2 * a + 1, top=2)
    assert checked.pearson == pytest.approx(1.0) and checked.spearman == pytest.approx(1.0)
    assert checked.overlap == 1.0
    flipped = Faithfulness.of(a, -a, top=1)
    assert flipped.pearson == pytest.approx(-1.0) and flipped.overlap == 1.0


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda p: qkv.attribute(p, CLEAN, "the river was wide", METRIC), "equal token length"),
        (lambda p: qkv.attribute(p, CLEAN, CORRUPT, METRIC, steps=0), "steps must be"),
        (lambda p: qkv.attribute(p, CLEAN, CORRUPT), "no metric: give metric="),
        (lambda p: qkv.attribute(p, [CLEAN], [CORRUPT, CLEAN], METRIC), "pair by position"),
        (lambda p: qkv.attribute(p, CLEAN, CORRUPT, [METRIC] * 2), "2 metrics for 1 prompts"),
        (lambda p: qkv.attribute(p, CLEAN, CORRUPT, "diff: bank, river bank"), "not one token"),
    ],
)
def test_bad_input_is_refused_by_name_and_the_model_left_as_it_was(call, message):
    assert_refused_and_unchanged(call, message)


def test_what_is_not_exact_is_refused_by_name():
    with pytest.raises(ValueError, match="a sub-layer norm"):
        qkv.attribute(tiny(gemma2_like()), CLEAN, CORRUPT, METRIC, edges=True)
    with pytest.raises(ValueError, match="is an encoder"):
        qkv.attribute(encoder_like(), CLEAN, CORRUPT, METRIC)


def test_the_result_shows_itself_self_contained_with_a_short_repr():
    found = qkv.attribute(llama_like(), CLEAN, CORRUPT, METRIC, edges=True)
    shown = found._repr_html_()
    assert shown.isascii() and ' id="' not in shown and "http" not in shown
    value = found.top_heads(1)[0][2]
    assert f'data-value="{value!r}"' in shown
    sender, receiver, score = found.top_edges(1)[0]
    assert f'<td>{sender}</td><td>{receiver}</td><td data-value="{score!r}">' in shown
    assert repr(found) == ("Attributed(log p(' bank') - log p(' river'), tiny, 1 pair, steps 1, "
                           "7x15 edges)")  # fmt: skip
