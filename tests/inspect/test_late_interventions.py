"""hide, ablate, patch, lens and heads on models with the late-2026 departures (learned sinks,
chunks, temperatures, experts, latent attention): each still computes what it says, checked by
a property that would fail if the departure were dropped or mishandled."""

from __future__ import annotations

import pytest
import torch

import qkv
from qkv.nn.experts import Experts
from qkv.nn.latent import LatentConfig
from qkv.nn.position import Temperature
from qkv.nn.routing import Routing
from variant_models import TEXT, decoder, tiny

LATENT = LatentConfig(32, 2, kv_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=4,
                      v_head_dim=6)  # fmt: skip
MODELS = {
    "sinks-experts": dict(sinks=True, experts=Experts(Routing(4, 2), hidden=8, shared_hidden=8)),
    "chunks-temperature": dict(chunk=3, layer_types=("chunked", "full"),
                               temperature=Temperature(0.5, 2.0)),
    "latent-sigmoid-experts": dict(latent=LATENT, experts=Experts(
        Routing(4, 2, score="sigmoid", scale_input=True, choose_by="logits", normalize=False),
        hidden=8)),
}  # fmt: skip


@pytest.fixture(scope="module", params=list(MODELS))
def model(request):
    pretrained = tiny(decoder(**MODELS[request.param]))
    if getattr(pretrained.model.blocks[0].attn, "sinks", None) is not None:
        with torch.no_grad():
            for block in pretrained.model.blocks:
                block.attn.sinks.copy_(torch.tensor([1.0, -1.0]))
    return pretrained


def last_states(pretrained) -> torch.Tensor:
    ids = torch.tensor([pretrained.encode(TEXT).ids])
    with torch.no_grad():
        return pretrained.model(ids).hidden[0]  # after the final norm


def test_hide_changes_the_run_and_leaves_the_clean_one_the_models(model):
    hidden = qkv.hide(model, TEXT, "bank", layers=[0])
    torch.testing.assert_close(hidden.clean_states, last_states(model), atol=1e-5, rtol=0)
    assert (hidden.states - hidden.clean_states).abs().max() > 1e-4


def test_ablating_every_head_changes_the_run_and_its_clean_run_is_the_models(model):
    ablated = qkv.ablate(model, TEXT, "all")
    torch.testing.assert_close(ablated.clean_states, last_states(model), atol=1e-5, rtol=0)
    assert ablated.total > 0 and bool(torch.isfinite(ablated.effect).all())


def test_patching_a_run_into_itself_changes_nothing_and_another_run_something(model):
    same = qkv.patch(model, TEXT, TEXT, "prob: river")
    assert same.clean == pytest.approx(same.corrupt, rel=1e-6)
    torch.testing.assert_close(same.heads, torch.full_like(same.heads, same.clean), rtol=1e-4,
                               atol=1e-9)  # fmt: skip
    other = qkv.patch(model, TEXT, "the bank of the river was deep and wide", "prob: river")
    assert (other.heads - other.corrupt).abs().max() > 1e-3 * abs(other.clean - other.corrupt)


def test_the_lens_splits_the_logit_into_terms_that_sum_to_it(model):
    found = qkv.lens(model, TEXT, token="river")
    split = found.attribution
    assert abs(split.remainder) < 1e-4 * max(1.0, abs(split.logit))
    assert split.mlps.abs().sum() > 0  # the experts' (or the MLP's) share is a term too


def test_the_census_counts_each_heads_weights(model):
    census = qkv.heads(model, prompts=[TEXT], rows=1, length=4)
    assert census.first_token.shape == (2, 2)
    assert bool(torch.isfinite(census.first_token).all())
    assert bool((census.first_token >= 0).all()) and bool((census.first_token <= 1).all())


def test_absorbed_latent_records_are_refused_by_what_reads_head_outputs():
    pretrained = tiny(decoder(latent=LATENT))
    for block in pretrained.model.blocks:
        block.attn.absorb = True  # decoding's latent-space attention: out is a latent vector
    with pytest.raises(ValueError, match="record is of absorbed latent attention"):
        qkv.ablate(pretrained, TEXT, "all")
    with pytest.raises(ValueError, match="a trace reads each head's output, but layer 0"):
        qkv.trace(pretrained, TEXT, "deep", "bank", layer=0, head=0)
    with pytest.raises(ValueError, match="direct logit attribution reads each head's output"):
        qkv.lens(pretrained, TEXT, token="river")
    weights = pretrained.attentions(TEXT).records[0].weights()  # the weights stay the model's
    for block in pretrained.model.blocks:
        block.attn.absorb = False
    torch.testing.assert_close(pretrained.attentions(TEXT).records[0].weights(), weights,
                               atol=1e-6, rtol=0)  # fmt: skip
