"""GPT-2 with scale_attn_weights false: its scores are not divided at all, and qkv reads so."""

from __future__ import annotations

import pytest
import torch
import transformers as hf

from qkv.io.embedded import embedded_path
from qkv.io.families import family_for
from qkv.io.hf_folder import load_folder, save_folder
from qkv.io.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def unscaled(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gpt2-unscaled")
    config = hf.GPT2Config(vocab_size=99, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                           scale_attn_weights=False)  # fmt: skip
    torch.manual_seed(2)
    model = hf.GPT2LMHeadModel(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model.save_pretrained(folder)
    return folder, hf.GPT2LMHeadModel.from_pretrained(folder, attn_implementation="eager").eval()


@pytest.mark.parametrize("backend", ["eager", "sdpa"])
def test_unscaled_gpt2_matches_transformers(unscaled, backend):
    folder, theirs = unscaled
    ours, _, config, _ = load_folder(folder, torch.float32, backend)
    assert config.block.attn_scale == 1.0
    ids = torch.randint(0, 99, (2, 11))
    with torch.no_grad():
        want = theirs(ids, output_attentions=True)
        got = ours(ids, layers=[1])
    torch.testing.assert_close(got.logits, want.logits, atol=1e-5, rtol=0)
    torch.testing.assert_close(got.records[1].weights(), want.attentions[1], atol=1e-6, rtol=0)
    steps = got.records[1].steps(head=2, query=7)
    torch.testing.assert_close(steps.contextualized.float(), got.records[1].out[0, 2, 7])


def test_unscaled_gpt2_exports_as_unscaled(unscaled, tmp_path):
    folder, theirs = unscaled
    ours, family, config, hf_config = load_folder(folder, torch.float32, None)
    assert family.hf_config(config)["scale_attn_weights"] is False
    assert family_for(hf_config).config(family.hf_config(config)) == config
    tokenizer = Tokenizer.from_folder(embedded_path("minilm"))  # only the weights are compared
    save_folder(tmp_path / "out", ours, family, config, family.hf_config(config), tokenizer)
    again = hf.GPT2LMHeadModel.from_pretrained(tmp_path / "out", attn_implementation="eager")
    ids = torch.randint(0, 99, (1, 9))
    with torch.no_grad():
        torch.testing.assert_close(again(ids).logits, theirs(ids).logits, atol=1e-5, rtol=0)


def test_a_gpt2_scale_other_than_none_or_one_is_refused():
    from dataclasses import replace

    family = family_for({"model_type": "gpt2"})
    config = family.config(hf.GPT2Config(n_layer=1, n_embd=16, n_head=2).to_dict())
    with pytest.raises(ValueError, match="cannot hold attn_scale=0.5"):
        family.hf_config(replace(config, block=replace(config.block, attn_scale=0.5)))
