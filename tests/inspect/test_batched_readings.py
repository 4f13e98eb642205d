"""The logit lens and the census of heads over several prompts of different token lengths, in
padded batches: each prompt's values are what it gives alone, the result their mean."""

from __future__ import annotations

import json

import pytest
import torch

from intervention_models import assert_refused_and_unchanged, encoder_like, llama_like
from qkv.inspect.census import heads
from qkv.inspect.lens import lens

TEXTS = ["the river bank was deep", "river and bank", "the wide deep river was the bank of"]
CLOSE = {"atol": 1e-5, "rtol": 1e-4}


def close(a, b) -> None:
    a, b = torch.as_tensor(a).double(), torch.as_tensor(b).double()
    torch.testing.assert_close(a, b, equal_nan=True, **CLOSE)


@pytest.fixture(scope="module")
def decoder():
    return llama_like()


@pytest.mark.parametrize("token", [None, "deep"])
def test_lens_over_prompts_is_each_prompt_alone(decoder, token):
    together = lens(decoder, TEXTS, token=token, top=3)
    alone = [lens(decoder, text, token=token, top=3) for text in TEXTS]
    spreads = together.spreads
    for n, one in enumerate(alone):
        close(spreads["rank"].values[n], one.rank)
        close(spreads["logprob"].values[n], one.logprob)
        close(spreads["heads"].values[n], one.attribution.heads)
        close(spreads["mlps"].values[n], one.attribution.mlps)
        close(spreads["logit"].values[n], one.attribution.logit)
        assert together.positions[n] == one.position == len(one.tokens) - 1
        assert together.token_ids[n] == one.token_id
    close(together.logprob, torch.tensor([one.logprob for one in alone]).mean(0))
    a = together.attribution
    assert a.total == pytest.approx(a.logit, abs=1e-6)  # the mean of sums is the sum of means
    close(together.logits, alone[0].logits)
    # the top tokens of the mean probability over the prompts
    probs = torch.stack([one.logits.double().softmax(-1) for one in alone]).mean(0)
    assert together.top_ids == probs.topk(3).indices.tolist()
    assert together.tokens == alone[0].tokens and together.texts == TEXTS
    data = json.loads(json.dumps(together.to_dict()))
    assert len(data["spreads"]["logprob"]["per_prompt"]) == 3
    assert data["spreads"]["heads"]["low"][0][0] <= data["attribution"]["heads"][0][0]


def test_lens_position_counts_in_each_prompt(decoder):
    together = lens(decoder, TEXTS, position=1, attribute=False)
    alone = [lens(decoder, text, position=1, attribute=False) for text in TEXTS]
    assert together.positions == [1, 1, 1] and together.attribution is None
    for n, one in enumerate(alone):
        close(together.spreads["logprob"].values[n], one.logprob)


@pytest.mark.parametrize("make", [llama_like, encoder_like])
def test_census_over_prompts_is_each_prompt_alone(make):
    pretrained = make()
    together = heads(pretrained, prompts=TEXTS, rows=2, length=3)
    alone = [heads(pretrained, prompts=[text], rows=2, length=3) for text in TEXTS]
    for name in ("previous_token", "first_token", "self", "entropy"):
        for n, one in enumerate(alone):
            close(together.spreads[name].values[n], one.scores(name))
        close(together.scores(name), torch.stack([one.scores(name) for one in alone]).mean(0))
    close(together.induction, alone[0].induction)  # the same random rows
    assert together.spreads["induction"].values.shape[0] == 2  # one per random row
    data = json.loads(json.dumps(together.to_dict()))
    assert len(data["spreads"]["entropy"]["per_prompt"]) == 3


def test_census_reads_a_file_of_prompts(tmp_path):
    pretrained = encoder_like()
    path = tmp_path / "prompts.txt"
    path.write_text("\n".join(TEXTS) + "\n\n")
    found = heads(pretrained, prompts=path, rows=1, length=3)
    listed = heads(pretrained, prompts=TEXTS, rows=1, length=3)
    assert found.prompts == TEXTS
    close(found.entropy, listed.entropy)


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda p: lens(p, [*TEXTS, "deep"], position=-2),
         r"prompt 3 \('deep'\): position -2 is out of range: the text has 1 tokens"),
        (lambda p: lens(p, TEXTS, token="river bank"), "'river bank' is not one token"),
        (lambda p: heads(p, prompts=["the river", "deep"]), r"prompt 1 \('deep'\) has 1 token"),
        (lambda p: heads(p, prompts=[]), "non-empty list"),
    ],
)  # fmt: skip
def test_bad_prompts_are_refused_by_name(call, message):
    assert_refused_and_unchanged(call, message)
