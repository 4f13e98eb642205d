"""`qkv.inspect.patch` is exact by construction: a patch of everything is the clean run,
checked against a forward with the clean residual stream put in."""

from __future__ import annotations

import json
import math

import pytest
import torch

from intervention_models import (
    assert_refused_and_unchanged,
    assert_unchanged,
    encoder_like,
    gemma2_like_pretrained,
    gentle,
    llama_like,
    snapshot,
)
from qkv.inspect.patch import WHATS, Metric, patch
from qkv.inspect.prompts import Spread, bootstrap
from qkv.inspect.runs import run
from qkv.nn.edit import Edit, Swap
from variant_models import TEXT, decoder, tiny


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


# ---------------------------------------------------------------------------- sets of pairs

CORRUPT = "the bank of the river was deep and wide"  # as many tokens as TEXT
PAIRS = [  # three lengths: 9, 5 and 7 tokens
    (TEXT, CORRUPT, "diff: river, wide"),
    ("the bank of the river", "the river of the bank", "prob: deep"),
    ("the river was wide and deep and", "bank the was deep and wide and", "kl"),  # from 0
]
EVERY = list(WHATS)


@pytest.fixture(scope="module")
def model():
    return llama_like()  # grouped-query attention: 2 query heads share 1 key/value head


@pytest.fixture(scope="module")
def batched(model):
    return patch(model, [p[0] for p in PAIRS], [p[1] for p in PAIRS], [p[2] for p in PAIRS],
                 what=EVERY)  # fmt: skip


def test_a_batch_of_pairs_of_different_lengths_is_each_pair_alone(model, batched):
    for n, (clean, corrupt, metric) in enumerate(PAIRS):
        alone = patch(model, clean, corrupt, metric, what=EVERY)
        assert batched.clean_spread.values[n] == pytest.approx(alone.clean, abs=1e-5)
        assert batched.corrupt_spread.values[n] == pytest.approx(alone.corrupt, abs=1e-5)
        for what in EVERY:
            torch.testing.assert_close(batched.per_pair(what, n), alone.grid(what), atol=1e-5,
                                       rtol=1e-5, equal_nan=True, msg=what)  # fmt: skip
    # positions aligned from the end: a mean only where every pair has the position
    residual = batched.residual
    assert residual.shape == (2, 9) and torch.isnan(residual[:, :4]).all()
    assert not torch.isnan(residual[:, 4:]).any()
    assert batched.position_labels()[-1] == "-1"


def test_the_interval_holds_the_mean_and_is_seeded(model, batched):
    for what in ("heads", "q", "mlp_layers"):
        spread = batched.grids[what]
        assert bool((spread.low <= spread.mean + 1e-12).all())
        assert bool((spread.mean <= spread.high + 1e-12).all())
    six = PAIRS * 2  # three values each twice: the 2.5% quantile is no longer the least
    runs = [patch(model, [p[0] for p in six], [p[1] for p in six], [p[2] for p in six],
                  what="heads", seed=seed).grids["heads"] for seed in (0, 0, 1, 2)]  # fmt: skip
    assert torch.equal(runs[0].low, runs[1].low) and torch.equal(runs[0].high, runs[1].high)
    # six values, three distinct: a resampled mean takes one of 28 values, and the 2.5%
    # quantile lands on the same one for most seeds; the seed is passed on all the same
    assert [run.seed for run in runs] == [0, 0, 1, 2]
    again = Spread.of(runs[3].values, 2)
    assert torch.equal(again.low, runs[3].low) and torch.equal(again.high, runs[3].high)
    continuous = torch.randn(12, 3, generator=torch.Generator().manual_seed(0))
    assert not torch.equal(bootstrap(continuous, 0)[0], bootstrap(continuous, 1)[0])
    data = batched.to_dict()
    assert data["what"] == EVERY and len(data["pairs"]) == 3
    assert len(data["spreads"]["head_positions"]["per_prompt"]) == 3
    assert data["residual"][0][0] is None and isinstance(data["mlp_layers"][0], float)


def _metric_of(model, metric: str, edits, text=CORRUPT, clean_text=TEXT) -> float:
    stack, chosen = model.model, Metric.parse(metric)
    with torch.inference_mode():
        logits = stack(torch.tensor([model.encode(text).ids]), edits=edits).logits[0, -1]
        clean = stack(torch.tensor([model.encode(clean_text).ids])).logits[0, -1]
    return float(chosen.score(logits, chosen.ids(model.tokenizer), clean=clean))


def _clean_records(model):
    with torch.inference_mode():
        return model.model(torch.tensor([model.encode(TEXT).ids]), layers="all").records


@pytest.mark.parametrize("what", ["heads", "q", "k", "v", "weights"])
def test_a_heads_own_part_patched_is_the_edit_made_by_hand(model, what):
    """Head 1 of layer 1 (GQA: its keys and values are its own copy of the shared head's)."""
    record = _clean_records(model)[1]
    where = torch.tensor([False, True])[None, :, None, None]
    made = {"heads": lambda: Edit(heads=where, head_values=record.out),
            "q": lambda: Edit(q=Swap(where, record.q)),
            "k": lambda: Edit(k=Swap(where, record.k.expand(-1, 2, -1, -1))),
            "v": lambda: Edit(v=Swap(where, record.v.expand(-1, 2, -1, -1))),
            "weights": lambda: Edit(weights=Swap(where, record.weights()))}[what]()  # fmt: skip
    expected = _metric_of(model, "diff: river, wide", {1: made})
    found = patch(model, TEXT, CORRUPT, "diff: river, wide", what=what)
    assert float(found.grid(what)[1, 1]) == pytest.approx(expected, abs=1e-5)
    assert expected != pytest.approx(found.corrupt, abs=1e-4)  # the patch moved it


def test_positions_and_mlps_patched_are_the_edits_made_by_hand(model):
    records = _clean_records(model)
    found = patch(model, TEXT, CORRUPT, "logprob: deep", what=["head_positions", "mlp",
                                                               "mlp_layers"])  # fmt: skip
    where = torch.zeros(1, 2, 9, 1, dtype=torch.bool)
    where[0, 0, 6] = True  # layer 0, head 0, position 6
    edit = Edit(heads=where, head_values=records[0].out)
    assert float(found.grid("head_positions")[0, 0, 6]) == pytest.approx(
        _metric_of(model, "logprob: deep", {0: edit}), abs=1e-5)  # fmt: skip
    at = torch.zeros(1, 9, dtype=torch.bool)
    at[0, 4] = True  # layer 1's MLP at position 4
    edit = Edit(mlp=at, mlp_values=records[1].mlp_out)
    assert float(found.grid("mlp")[1, 4]) == pytest.approx(
        _metric_of(model, "logprob: deep", {1: edit}), abs=1e-5)  # fmt: skip
    edit = Edit(mlp=torch.ones(1, 9, dtype=torch.bool), mlp_values=records[0].mlp_out)
    assert float(found.grid("mlp_layers")[0]) == pytest.approx(
        _metric_of(model, "logprob: deep", {0: edit}), abs=1e-5)  # fmt: skip


def test_patching_clean_into_clean_changes_no_cell_of_any_grid(model):
    same = patch(model, [TEXT, "the river of the bank"], [TEXT, "the river of the bank"],
                 "kl", what=EVERY)  # fmt: skip
    assert same.clean == same.corrupt == pytest.approx(0.0, abs=1e-9)
    for what in EVERY:
        grid = same.grids[what].values
        assert grid[~grid.isnan()].abs().max() < 1e-5, what


def test_a_file_of_pairs_with_each_lines_metric_is_the_lists(model, batched, tmp_path):
    tsv = tmp_path / "pairs.tsv"
    tsv.write_text("".join(f"{a}\t{b}\t{m}\n" for a, b, m in PAIRS), encoding="utf-8")
    jsonl = tmp_path / "pairs.jsonl"
    jsonl.write_text("".join(json.dumps({"clean": a, "corrupt": b, "metric": m}) + "\n"
                             for a, b, m in PAIRS), encoding="utf-8")  # fmt: skip
    for path in (tsv, jsonl):
        found = patch(model, path, what="heads")
        torch.testing.assert_close(found.heads, batched.heads, atol=1e-9, rtol=0)


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda p: patch(p, TEXT, CORRUPT, "prob: deep", what="attention"), "not a thing patch"),
        (lambda p: patch(p, TEXT, CORRUPT, "prob: deep", what=[]), "got none"),
        (lambda p: patch(p, [TEXT, TEXT], [CORRUPT, CORRUPT], ["prob: deep"]), "1 metrics for 2"),
        (lambda p: patch(p, [TEXT, TEXT], [CORRUPT], "prob: deep"), "pair by position"),
        (lambda p: patch(p, TEXT, CORRUPT), "no metric"),
        (lambda p: patch(p, [TEXT, "the bank"], [CORRUPT, "the bank of"], "prob: deep"),
         "pair 1: the clean text has 2 tokens"),
    ],
)  # fmt: skip
def test_bad_sets_and_whats_are_refused_by_name(call, message):
    assert_refused_and_unchanged(call, message)


def test_an_mlp_is_refused_where_the_block_does_not_add_it_to_the_stream():
    post = gentle(tiny(decoder(norm_position="post")))
    with pytest.raises(ValueError, match="post-norm"):
        patch(post, TEXT, CORRUPT, "prob: deep", what="mlp")
