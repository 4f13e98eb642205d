"""Tiny random models of every family, built by `transformers`, loaded by qkv: equal logits."""

from __future__ import annotations

import json

import pytest
import torch

from qkv.io.checkpoint import read_checkpoint
from qkv.io.families import FAMILIES, family_for
from qkv.io.hf_folder import load_folder
from tiny_models import save_tiny


@pytest.mark.parametrize("name", ["bert", "gpt2", "llama", "llama-tied", "bart"])
@pytest.mark.parametrize("backend", ["eager", "sdpa"])
def test_tiny_models_match_transformers(name, backend, tmp_path):
    theirs = save_tiny(name, tmp_path)
    ours, *_ = load_folder(tmp_path, torch.float32, backend)
    ids = torch.randint(0, 99, (2, 9))
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[1, 6:] = 0
    with torch.no_grad():
        if name == "bert":
            want = theirs(ids, attention_mask=mask, output_attentions=True)
            got = ours(ids, attention_mask=mask, layers=[1])
            real = mask.bool()
            torch.testing.assert_close(
                got.hidden[real], want.last_hidden_state[real], atol=1e-5, rtol=0
            )
            torch.testing.assert_close(
                got.records[1].weights([2])[0, 0], want.attentions[1][0, 2], atol=1e-5, rtol=0
            )
        elif name == "bart":
            target = torch.randint(0, 99, (2, 5))
            want = theirs(input_ids=ids, attention_mask=mask, decoder_input_ids=target).logits
            got = ours(ids, target, source_mask=mask).logits
            torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
        else:
            want = theirs(ids).logits
            torch.testing.assert_close(ours(ids).logits, want, atol=1e-5, rtol=0)


def test_pytorch_model_bin_loads_too(tmp_path):
    theirs = save_tiny("gpt2", tmp_path)  # transformers 5 writes only safetensors: convert
    torch.save(read_checkpoint(tmp_path), tmp_path / "pytorch_model.bin")
    (tmp_path / "model.safetensors").unlink()
    ours, *_ = load_folder(tmp_path, torch.float32, None)
    ids = torch.randint(0, 99, (1, 7))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids).logits, theirs(ids).logits, atol=1e-5, rtol=0)


def test_unknown_family_lists_the_supported_ones():
    with pytest.raises(ValueError, match=r"unknown model family 'xlnet'; supported: bart, bert"):
        family_for({"model_type": "xlnet"})
    assert {f.name for f in FAMILIES} >= {"bert", "gpt2", "llama", "bart", "marian", "t5"}


def test_a_leftover_or_missing_or_misshapen_tensor_is_an_error(tmp_path):
    from safetensors.torch import save_file

    save_tiny("llama", tmp_path)
    tensors = read_checkpoint(tmp_path)
    extra = dict(tensors, **{"model.layers.0.mlp.extra.weight": torch.zeros(2)})
    save_file(extra, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="1 checkpoint tensors are not used.*mlp.extra"):
        load_folder(tmp_path, torch.float32, None)
    missing = {k: v for k, v in tensors.items() if "layers.1.mlp.up_proj" not in k}
    save_file(missing, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="has no model.layers.1.mlp.up_proj.weight"):
        load_folder(tmp_path, torch.float32, None)
    config = json.loads((tmp_path / "config.json").read_text())
    config["intermediate_size"] = 40
    save_file(tensors, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"has shape \(37, 48\) but the model .* needs \(40, 48\)"):
        load_folder(tmp_path, torch.float32, None)


def test_a_truncated_safetensors_file_is_reported_as_truncated(tmp_path):
    save_tiny("bert", tmp_path)
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(ValueError, match="model.safetensors is truncated or corrupt"):
        load_folder(tmp_path, torch.float32, None)
