"""qkv.trace: the article's steps are the model's own computation, number for number."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch
import transformers as hf

import qkv
from qkv.io.embedded import embedded_path

SENTENCE = "The bank on the side of the river"


def test_minilm_trace_is_the_models_computation_and_matches_transformers(minilm):
    traced = qkv.trace(minilm, SENTENCE, "bank", "river")
    folder = embedded_path("minilm")
    theirs = hf.AutoModel.from_pretrained(folder, attn_implementation="eager").eval()
    ids = hf.AutoTokenizer.from_pretrained(folder)(SENTENCE, return_tensors="pt")
    with torch.no_grad():
        attentions = theirs(**ids, output_attentions=True).attentions  # L x (1, H, T, T)
    want = attentions[traced.layer][0, traced.head, traced.query_index]
    torch.testing.assert_close(traced.weights, want, atol=1e-5, rtol=0)
    # chosen where "bank" attends most to "river", over every layer and head
    best = max(a[0, :, traced.query_index, traced.key_index].max().item() for a in attentions)
    assert math.isclose(traced.weight, best, abs_tol=1e-5)
    # step by step: the numbers follow from each other as the article says
    assert math.isclose(traced.attention_scalar, float(traced.query_vector @ traced.key_vector))
    assert math.isclose(traced.scaled_scalar, traced.attention_scalar / math.sqrt(traced.head_dim))
    assert math.isclose(float(traced.weights.sum()), 1.0, rel_tol=1e-6)
    torch.testing.assert_close(traced.scaled_value_vector, traced.weight * traced.value_vector,
                               rtol=1e-6, atol=1e-7)  # fmt: skip
    torch.testing.assert_close(traced.contextualized, traced.model_output, atol=1e-5, rtol=0)


def test_asked_layer_and_head_and_a_second_occurrence(minilm):
    text = "The bank of the river and the bank of money"
    traced = qkv.trace(minilm, text, "bank#2", "money", layer=4, head=7)
    assert (traced.layer, traced.head, traced.chosen) == (4, 7, "asked")
    assert traced.tokens[traced.query_index] == "bank" and traced.query_index > 2
    torch.testing.assert_close(traced.contextualized, traced.model_output, atol=1e-5, rtol=0)


def test_decoder_trace_shows_the_causal_mask_grouped_heads_and_rotation(smollm2):
    later = qkv.trace(smollm2, SENTENCE, "bank", "river", layer=2, head=7)
    assert later.masked and later.weight == 0.0
    assert later.kv_head == 7 // 3 and later.num_kv_heads == 3
    assert later.query_unrotated is not None
    # rotation keeps lengths and changes directions (position 1 is not position 0)
    assert math.isclose(later.query_unrotated.norm().item(), later.query_vector.norm().item(),
                        rel_tol=1e-5)  # fmt: skip
    assert not torch.allclose(later.query_unrotated, later.query_vector)
    earlier = qkv.trace(smollm2, SENTENCE, "river", "bank")
    assert not earlier.masked and earlier.weight > 0
    torch.testing.assert_close(earlier.contextualized, earlier.model_output, atol=1e-4, rtol=0)
    assert (earlier.weights[earlier.query_index + 1 :] == 0).all()


def test_to_dict_is_json_with_every_step(minilm):
    data = json.loads(json.dumps(qkv.trace(minilm, SENTENCE, "bank", "river").to_dict()))
    steps = ["query_vector", "key_vector", "attention_scalar", "scaled_scalar", "weights",
             "value_vector", "scaled_value_vector", "contextualized", "model_output"]  # fmt: skip
    assert set(steps) <= set(data)
    assert len(data["weights"]) == len(data["tokens"]) and data["weight"] == data["weights"][8]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"query": "money"}, r"'money' is not a word of the text; its words are: The, bank"),
        ({"layer": 6}, r"layer 6 is out of range: minilm has 6 layers \(0-5\)"),
        ({"head": 12}, r"head 12 is out of range: minilm has 12 heads \(0-11\)"),
        ({"text": "   "}, "the text is empty"),
        (
            {"text": "The bank by the bank"},
            r"'bank' occurs 2 times in the text; name one: bank#1, ",
        ),
        ({"text": "bank " * 600}, "reads at most 512"),
    ],
)
def test_bad_input_is_one_clear_line(minilm, kwargs, message):
    args = {"text": SENTENCE, "query": "bank", "key": "river", **kwargs}
    text, query, key = args.pop("text"), args.pop("query"), args.pop("key")
    with pytest.raises(ValueError, match=message):
        qkv.trace(minilm, text, query, key, **args)


def test_explain_command_tells_the_walk_and_gives_json():
    def run(*args):
        return subprocess.run([sys.executable, "-m", "qkv.cli", "explain", SENTENCE, *args],
                              capture_output=True, text=True, timeout=300)  # fmt: skip

    walk = run("--query", "bank", "--key", "river")
    assert walk.returncode == 0, walk.stderr
    for step in ("1. Query vector", "3. Attention scalar", "4. Softmax", "7. The sum",
                 "by size after the output projection", "Several heads"):  # fmt: skip
        assert step in walk.stdout
    data = json.loads(run("--query", "bank", "--key", "river", "--json", "--layer", "1").stdout)
    assert data["layer"] == 1 and data["tokens"][data["key_index"]] == "river"
    bad = run("--query", "bank", "--key", "lake")
    assert bad.returncode == 2 and bad.stderr.startswith("error: 'lake' is not a word")


def test_encoder_decoder_traces_cross_attention_like_transformers(tmp_path):
    """A tiny random BART (transformers builds it) with a word-level tokenizer built here."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import models, pre_tokenizers

    from qkv.io.hf_folder import load_folder
    from qkv.io.tokenizer import Tokenizer
    from qkv.viz.narrate import narrate, tokens_line
    from tiny_models import save_tiny

    theirs = save_tiny("bart", tmp_path)
    model, family, config, hf_config = load_folder(tmp_path, torch.float32, None)
    words = ["[UNK]", "the", "bank", "on", "side", "of", "river", "la", "rive", "banque"]
    backend = Backend(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    bart = qkv.Pretrained(model, Tokenizer(backend), config, family=family,
                          hf_config=hf_config, source="tiny-bart")  # fmt: skip
    traced = qkv.trace(bart, "the bank of the river", "banque", "river", target="la banque")
    # the decoder reads its start token (BART's decoder_start_token_id 2: "bank" in this toy
    # vocabulary), then the target, as in training and generation
    assert hf_config["decoder_start_token_id"] == 2
    assert traced.query_tokens == ["bank", "la", "banque"] and traced.query_index == 2
    assert traced.tokens[traced.key_index] == "river"
    source, target = torch.tensor([[1, 2, 5, 1, 6]]), torch.tensor([[2, 7, 9]])
    with torch.no_grad():
        cross = theirs(input_ids=source, decoder_input_ids=target, output_attentions=True)
    want = cross.cross_attentions[traced.layer][0, traced.head, traced.query_index]
    torch.testing.assert_close(traced.weights, want, atol=1e-5, rtol=0)
    torch.testing.assert_close(traced.contextualized, traced.model_output, atol=1e-5, rtol=0)
    assert "Cross-attention" in tokens_line(traced) and "cross-attention" in narrate(traced)
    with pytest.raises(ValueError, match="give the target text too"):
        qkv.trace(bart, "the bank of the river", "bank", "river")


@pytest.mark.parametrize("name", ["minilm", "smollm2"])
def test_attention_vectors_rebuild_every_heads_weights_and_trace(name, request):
    from qkv.inspect.trace import attention_vectors

    pretrained = request.getfixturevalue(name)
    q, k, v = attention_vectors(pretrained, SENTENCE)
    L, H, T, D = q.shape
    scores = q @ k.transpose(-1, -2) / math.sqrt(D)  # (L, H, T, T)
    if name == "smollm2":
        scores = scores.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
    weights = scores.softmax(-1)
    torch.testing.assert_close(weights, pretrained.attentions(SENTENCE).weights, atol=1e-5, rtol=0)
    traced = qkv.trace(pretrained, SENTENCE, "river", "bank", layer=L - 1, head=H - 1)
    rebuilt = weights[L - 1, H - 1, traced.query_index] @ v[L - 1, H - 1]  # (D,)
    torch.testing.assert_close(rebuilt.double(), traced.contextualized, atol=1e-4, rtol=0)
