"""Small models the intervention tests (`tests/inspect/test_hide.py`, `test_ablate.py`,
`test_patch.py`) share, and the check that a call leaves a model as it was."""

from __future__ import annotations

import pytest
import torch

from qkv.inspect.runs import stack_of
from qkv.models import EncoderConfig
from qkv.nn import BlockConfig
from variant_models import TEXT, WORDS, decoder, gemma2_like, tiny


def gentle(pretrained):
    """`tiny`'s weights a quarter as large: attention spread over several keys, not one."""
    with torch.no_grad():
        for p in pretrained.model.parameters():
            p.div_(4.0)
    return pretrained


def llama_like(**block):
    return gentle(tiny(decoder(num_kv_heads=1, mlp="swiglu", norm="rmsnorm", **block)))


def encoder_like():
    block = BlockConfig(width=32, num_heads=4, norm_position="post")
    config = EncoderConfig(vocab_size=len(WORDS), num_layers=2, max_positions=16, block=block)
    return gentle(tiny(config))


def gemma2_like_pretrained():
    return tiny(gemma2_like())


def snapshot(pretrained):
    """The parameters, and the outputs for TEXT: what a call must leave as they were."""
    ids = torch.tensor([pretrained.encode(TEXT).ids])
    with torch.inference_mode():
        states = stack_of(pretrained)(ids).hidden.clone()
    return {k: v.clone() for k, v in pretrained.model.state_dict().items()}, states


def assert_unchanged(pretrained, before):
    params, states = snapshot(pretrained)
    assert params.keys() == before[0].keys()
    assert all(torch.equal(params[k], before[0][k]) for k in params)
    assert torch.equal(states, before[1])


def assert_refused_and_unchanged(call, message: str) -> None:
    """`call(model)` on a Llama-like model raises one ValueError matching `message` and leaves
    the model's parameters and outputs as they were."""
    pretrained = llama_like()
    before = snapshot(pretrained)
    with pytest.raises(ValueError, match=message):
        call(pretrained)
    assert_unchanged(pretrained, before)
