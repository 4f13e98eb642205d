"""Pretrained.save writes a Hugging Face folder that `transformers` loads with equal outputs."""

from __future__ import annotations

import shutil

import pytest
import torch
import transformers as hf

import qkv
from qkv.io.embedded import embedded_path
from tiny_models import save_tiny

TOKENIZER_FILES = ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"]
CLASSES = {
    "gpt2": hf.GPT2LMHeadModel,
    "llama": hf.LlamaForCausalLM,
    "bart": hf.BartForConditionalGeneration,
    "bert": hf.BertModel,
}


def tiny_pretrained(name: str, folder) -> qkv.Pretrained:
    save_tiny(name, folder)
    for file in TOKENIZER_FILES:  # any tokenizer will do: only the weights are compared
        shutil.copy(embedded_path("minilm") / file, folder / file)
    return qkv.load(folder)


@pytest.mark.parametrize("name", ["gpt2", "llama", "bart", "bert"])
def test_export_loads_in_transformers_with_equal_outputs(name, tmp_path):
    ours = tiny_pretrained(name, tmp_path / "original")
    ours.save(tmp_path / "exported")
    theirs = CLASSES[name].from_pretrained(tmp_path / "exported", attn_implementation="eager")
    ids = torch.randint(0, 99, (2, 7))
    with torch.no_grad():
        if name == "bart":
            target = torch.randint(0, 99, (2, 4))
            want = theirs(input_ids=ids, decoder_input_ids=target).logits
            got = ours.model(ids, target).logits
        elif name == "bert":
            want, got = theirs(ids).last_hidden_state, ours.model(ids).hidden
        else:
            want, got = theirs(ids).logits, ours.model(ids).logits
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    reloaded = qkv.load(tmp_path / "exported")
    assert (
        reloaded.tokenizer.encode("the river bank").ids
        == ours.tokenizer.encode("the river bank").ids
    )


def test_smollm2_exported_from_gguf_loads_in_transformers(tmp_path):
    ours = qkv.load("smollm2")
    ours.save(tmp_path / "smollm2")
    theirs = hf.AutoModelForCausalLM.from_pretrained(tmp_path / "smollm2", dtype=torch.float32)
    tokenizer = hf.AutoTokenizer.from_pretrained(tmp_path / "smollm2")
    ids = tokenizer("The bank on the side of the river", return_tensors="pt").input_ids
    assert ids[0].tolist() == ours.tokenizer.encode("The bank on the side of the river").ids
    with torch.no_grad():
        # float32's rounding apart: logits of up to 20, 1.03e-4 measured on an AVX2 EPYC
        torch.testing.assert_close(ours.model(ids).logits, theirs(ids).logits, atol=2e-4, rtol=0)


def test_export_refuses_a_non_empty_folder_and_leaves_nothing_behind(tmp_path):
    ours = tiny_pretrained("gpt2", tmp_path / "original")
    target = tmp_path / "taken"
    target.mkdir()
    (target / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="exists and is not empty"):
        ours.save(target)
    assert [p.name for p in target.iterdir()] == ["notes.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["original", "taken"]
