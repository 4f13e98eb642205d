"""Encoder's masked-language-model head against transformers' BertForMaskedLM: equal logits
loading theirs and exporting ours, the decoder tied to the token matrix, clear errors."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
import transformers as hf

import qkv
from qkv.io.checkpoint import read_checkpoint
from qkv.io.embedded import embedded_path
from qkv.io.families import bert_hf_config, family_for
from qkv.io.hf_folder import save_folder
from qkv.io.tokenizer import Tokenizer
from qkv.models import Encoder, EncoderConfig
from qkv.nn import BlockConfig

TINY_BERT = dict(
    vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
    intermediate_size=37, max_position_embeddings=64,
)  # fmt: skip
BERT_LIKE = EncoderConfig(
    vocab_size=99,
    num_layers=2,
    max_positions=64,
    type_vocab_size=2,
    embed_norm=True,
    final_norm=False,
    mlm_head=True,
    block=BlockConfig(width=32, num_heads=4, mlp_hidden=37, norm_position="post", norm_eps=1e-12),
)

MINILM_TOKENIZER = Tokenizer.from_folder(embedded_path("minilm"))


def padded_batch() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, 99, (2, 9))
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[1, 6:] = 0
    return ids, mask


def save_tiny_mlm(folder) -> hf.BertForMaskedLM:
    torch.manual_seed(1)
    model = hf.BertForMaskedLM(hf.BertConfig(**TINY_BERT)).eval()
    with torch.no_grad():  # random, not zero, biases: a mapping error must show
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    model.save_pretrained(folder)
    MINILM_TOKENIZER.save(folder)  # any tokenizer will do: only the weights are compared
    return hf.BertForMaskedLM.from_pretrained(folder, attn_implementation="eager").eval()


def test_bert_for_masked_lm_loads_with_equal_logits(tmp_path):
    theirs = save_tiny_mlm(tmp_path)
    assert "cls.predictions.bias" in read_checkpoint(tmp_path)
    ours = qkv.load(tmp_path)
    assert ours.config.mlm_head
    ids, mask = padded_batch()
    with torch.no_grad():
        want = theirs(ids, attention_mask=mask).logits
        got = ours.model(ids, attention_mask=mask, logits=True).logits
    real = mask.bool()  # padded positions' vectors are not defined alike
    torch.testing.assert_close(got[real], want[real], atol=1e-5, rtol=0)


def test_older_checkpoints_that_repeat_the_tied_decoder_load_too(tmp_path):
    from safetensors.torch import save_file

    save_tiny_mlm(tmp_path)
    tensors = read_checkpoint(tmp_path)
    ids = torch.randint(0, 99, (1, 5))
    with torch.no_grad():
        want = qkv.load(tmp_path).model(ids, logits=True).logits
    older = {
        **tensors,
        "cls.predictions.decoder.weight": tensors["bert.embeddings.word_embeddings.weight"],
        "cls.predictions.decoder.bias": tensors["cls.predictions.bias"],
        "cls.seq_relationship.weight": torch.zeros(2, 32),  # BertForPreTraining's other head
    }
    save_file({k: v.clone() for k, v in older.items()}, tmp_path / "model.safetensors")
    with torch.no_grad():
        got = qkv.load(tmp_path).model(ids, logits=True).logits
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    del tensors["cls.predictions.transform.dense.weight"]
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="has no cls.predictions.transform.dense.weight"):
        qkv.load(tmp_path)


def test_a_fresh_encoder_with_the_head_exports_to_bert_for_masked_lm(tmp_path):
    torch.manual_seed(0)
    ours = Encoder(BERT_LIKE).eval()
    with torch.no_grad():  # random biases and norms too, so each must travel right
        for p in ours.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    hf_config = bert_hf_config(BERT_LIKE)
    family = family_for(hf_config)
    save_folder(tmp_path / "out", ours, family, BERT_LIKE, hf_config, MINILM_TOKENIZER)
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert written["architectures"] == ["BertForMaskedLM"]
    theirs, report = hf.AutoModelForMaskedLM.from_pretrained(
        tmp_path / "out", attn_implementation="eager", output_loading_info=True
    )
    assert isinstance(theirs, hf.BertForMaskedLM)
    assert not any(report.values()), report  # nothing missing, unexpected or misshapen
    reloaded = qkv.load(tmp_path / "out")
    assert reloaded.config == BERT_LIKE
    head = {k for k in read_checkpoint(tmp_path / "out") if not k.startswith("bert.")}
    assert head == {
        "cls.predictions.bias",
        "cls.predictions.transform.dense.weight",
        "cls.predictions.transform.dense.bias",
        "cls.predictions.transform.LayerNorm.weight",
        "cls.predictions.transform.LayerNorm.bias",
    }
    ids, mask = padded_batch()
    real = mask.bool()
    with torch.no_grad():
        want = theirs.eval()(ids, attention_mask=mask).logits
        got = ours(ids, attention_mask=mask, logits=True).logits
        again = reloaded.model(ids, attention_mask=mask, logits=True).logits
    torch.testing.assert_close(got[real], want[real], atol=1e-5, rtol=0)
    torch.testing.assert_close(again, got, atol=0, rtol=0)


def test_the_decoder_stays_tied_to_the_token_matrix_through_training():
    model = Encoder(BERT_LIKE)
    assert model.mlm.decoder.weight is model.embed.tokens.weight
    names = [name for name, _ in model.named_parameters()]
    assert "mlm.decoder.weight" not in names and "mlm.decoder.bias" in names
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.randint(0, 99, (2, 7))
    logits = model(ids, logits=True).logits  # (B, T, vocab)
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids.flatten()).backward()
    before = model.embed.tokens.weight.detach().clone()
    optimizer.step()
    assert model.mlm.decoder.weight is model.embed.tokens.weight
    assert not torch.equal(model.embed.tokens.weight, before)
    model.mlm.decoder.weight = torch.nn.Parameter(before)  # untied by hand, re-tied
    model.tie_weights()
    assert model.mlm.decoder.weight is model.embed.tokens.weight


def test_logits_without_the_head_is_a_clear_error():
    model = Encoder(replace(BERT_LIKE, mlm_head=False))
    assert model.mlm is None
    assert model(torch.tensor([[1, 2, 3]])).logits is None
    with pytest.raises(ValueError, match="logits=True needs the masked-language-model head"):
        model(torch.tensor([[1, 2, 3]]), logits=True)


def test_sentence_transformers_minilm_still_loads_without_the_head():
    minilm = qkv.load("minilm")
    assert not minilm.config.mlm_head and minilm.model.mlm is None
