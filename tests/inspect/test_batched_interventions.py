"""hide and ablate over several prompts of different token lengths, in padded batches: each
prompt's values are what it gives alone, and the result holds their mean and interval."""

from __future__ import annotations

import json

import pytest
import torch

from intervention_models import assert_refused_and_unchanged, encoder_like, llama_like
from qkv.inspect.ablate import ablate
from qkv.inspect.hide import hide
from qkv.inspect.runs import MASK_BUDGET

# river before bank in each (a decoder's query sees only earlier words); 5, 3 and 7 tokens
TEXTS = ["the river bank was deep", "river and bank", "the wide deep river was the bank"]
CLOSE = {"atol": 1e-5, "rtol": 1e-4}


def close(a, b) -> None:
    a, b = torch.as_tensor(a).double(), torch.as_tensor(b).double()
    torch.testing.assert_close(a, b, equal_nan=True, **CLOSE)


@pytest.fixture(scope="module")
def models():
    return {"decoder": llama_like(), "encoder": encoder_like()}


@pytest.mark.parametrize("kind", ["decoder", "encoder"])
@pytest.mark.parametrize("query", ["bank", None])
def test_hide_over_prompts_is_each_prompt_alone(models, kind, query):
    pretrained = models[kind]
    together = hide(pretrained, TEXTS, "river", query=query)
    alone = [hide(pretrained, text, "river", query=query) for text in TEXTS]
    spreads = together.spreads
    for n, one in enumerate(alone):
        close(spreads["effect"].values[n], one.effect)
        close(spreads["distance"].values[n], one.distance)
        close(spreads["total"].values[n], one.total)
        if kind == "decoder":
            close(spreads["next_by_head"].values[n], one.next_by_head)
            close(spreads["top_change"].values[n], one.next.top_change)
    close(together.effect, torch.stack([one.effect for one in alone]).mean(0))
    assert together.total == pytest.approx(sum(one.total for one in alone) / 3, abs=1e-6)
    close(together.states, alone[0].states)  # the first prompt's, its real tokens only
    assert together.texts == TEXTS and together.tokens == alone[0].tokens
    low, high = spreads["effect"].low, spreads["effect"].high
    assert bool((low <= together.effect + 1e-12).all() and (together.effect <= high + 1e-12).all())
    assert bool((high > low).any()), "three different prompts: an interval of some width"
    data = json.loads(json.dumps(together.to_dict(), allow_nan=False))
    assert len(data["spreads"]["total"]["per_prompt"]) == 3 and data["texts"] == TEXTS


def test_hide_in_small_batches_is_the_same(models, monkeypatch):
    """A budget of one prompt a batch (and one head a run) changes nothing but the batching."""
    pretrained = models["decoder"]
    whole = hide(pretrained, TEXTS, "river", query="bank")
    monkeypatch.setattr("qkv.inspect.runs.MASK_BUDGET", 1)
    assert MASK_BUDGET > 1
    split = hide(pretrained, TEXTS, "river", query="bank")
    close(split.spreads["effect"].values, whole.spreads["effect"].values)
    close(split.spreads["total"].values, whole.spreads["total"].values)


def test_a_file_of_prompts_is_the_list(models, tmp_path):
    lines = tmp_path / "prompts.tsv"
    lines.write_text("".join(f"{text}\tlabel\n" for text in TEXTS))
    jsonl = tmp_path / "prompts.jsonl"
    jsonl.write_text("".join(json.dumps({"text": text}) + "\n" for text in TEXTS))
    listed = hide(models["encoder"], TEXTS, "river", query="bank", table=False)
    for path in (lines, jsonl):
        found = hide(models["encoder"], path, "river", query="bank", table=False)
        assert found.texts == TEXTS
        close(found.spreads["total"].values, listed.spreads["total"].values)


@pytest.mark.parametrize("kind", ["decoder", "encoder"])
def test_ablate_over_prompts_is_each_prompt_alone(models, kind):
    pretrained = models[kind]
    heads = [(0, 1), (1, 0)]
    together = ablate(pretrained, TEXTS, heads, mode="mean", reference=TEXTS[:2])
    alone = [ablate(pretrained, text, heads, mode="mean", reference=TEXTS[:2]) for text in TEXTS]
    for n, one in enumerate(alone):
        close(together.spreads["effect"].values[n], one.effect)
        close(together.spreads["total"].values[n], one.total)
        if kind == "decoder":
            close(together.spreads["top_change"].values[n], one.next.top_change)
    close(together.effect, torch.stack([one.effect for one in alone]).mean(0))
    close(together.states, alone[0].states)


@pytest.mark.parametrize("kind", ["decoder", "encoder"])
def test_one_knockout_without_the_clean_run_is_the_same_run(models, kind):
    """compare=False: one forward pass with the key hidden (the head ablated), the same
    vectors as with the comparison, and no comparison in the result."""
    pretrained = models[kind]
    compared = hide(pretrained, TEXTS, "river", query="bank", table=False)
    quick = hide(pretrained, TEXTS, "river", query="bank", table=False, compare=False)
    close(quick.states, compared.states)
    assert quick.clean_states is None and quick.next is None and quick.spreads == {}
    assert quick.total != quick.total and quick.effect.isnan().all()
    one = ablate(pretrained, TEXTS, [(1, 0)])
    knocked = ablate(pretrained, TEXTS, [(1, 0)], compare=False)
    close(knocked.states, one.states)
    assert knocked.clean_states is None and knocked.spreads == {}
    close(one.effect[1, 0], one.total)  # one head alone is all of them at once
    if kind == "decoder":
        assert [t.id for t in quick.after] == [t.id for t in compared.next.after]
        assert [t.id for t in knocked.after] == [t.id for t in one.next.after]
    for result in (quick, knocked):
        json.dumps(result.to_dict(), allow_nan=False)


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda p: hide(p, [*TEXTS, "the bank was deep"], "river", query="bank"),
         r"prompt 3 \('the bank was deep'\): the key word: 'river' is not a word"),
        (lambda p: hide(p, ["river and bank", "the river"], "river", query="bank"),
         r"prompt 1 \('the river'\): the query word: 'bank' is not a word"),
        (lambda p: hide(p, ["river and bank", "bank and river"], "river", query="bank"),
         r"prompt 1 \('bank and river'\): tiny is a decoder"),
        (lambda p: hide(p, TEXTS, "river", compare=False), "compare=False needs table=False"),
        (lambda p: ablate(p, ["the river", " "], [(0, 0)]), r"texts\[1\] is ' '"),
        (lambda p: hide(p, [], "river"), "non-empty list"),
    ],
)  # fmt: skip
def test_bad_prompts_are_refused_by_name(call, message):
    assert_refused_and_unchanged(call, message)
