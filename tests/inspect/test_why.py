"""qkv.why: one score taken apart. Tiny models built by hand where the answer is known (a head
that writes a marker into a word, a later head whose key reads it), the causal checks where the
linear prediction must be exact (no norm, no MLP to respond), and the real models."""

from __future__ import annotations

import pytest
import torch

import qkv
from qkv.inspect.residual import walk
from qkv.inspect.why import stack_why
from qkv.models import Decoder, DecoderConfig, Encoder, EncoderConfig
from qkv.nn import BlockConfig
from qkv.nn.edit import Edit
from variant_models import TEXT, WORDS, tiny

C, D = 16, 8
RIVER, BANK, MARK = 4, 2, 12  # token ids of TEXT's words; the stream's dimension of the marker


def marker_model(*, norm: str = "none", noise: float = 0.05, mlp: bool = False) -> qkv.Pretrained:
    """Two layers, two heads of 8 dimensions, bidirectional. Tokens are one-hot in the stream.
    L0.H0 attends each word to itself and writes a marker (dimension 12) into "river" only;
    L1.H0's query reads "bank" and its key reads the marker: bank attends to river in L1.H0
    because of the term (bank's embedding, river's L0.H0 part). Everything else is small
    noise; the MLPs are zero unless `mlp`."""
    config = EncoderConfig(
        vocab_size=len(WORDS), num_layers=2, position="none", final_norm=False,
        block=BlockConfig(width=C, num_heads=2, head_dim=D, mlp_hidden=8, bias=False,
                          norm="rmsnorm", norm_position=norm),
    )  # fmt: skip
    torch.manual_seed(0)
    model = Encoder(config).double().eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.copy_(noise * torch.randn_like(p))
        model.embed.tokens.weight.copy_(torch.eye(len(WORDS), C, dtype=torch.float64))
        a, b = model.blocks[0].attn, model.blocks[1].attn
        a.q.weight[:D, :D] += 10 * torch.eye(D, dtype=torch.float64)  # each word on itself
        a.k.weight[:D, :D] += 10 * torch.eye(D, dtype=torch.float64)
        a.v.weight[0, RIVER] += 1.0  # river's value: head dimension 0 ...
        a.out.weight[MARK, 0] += 3.0  # ... written into the marker dimension
        b.q.weight[0, BANK] += 3.0  # bank's query and the marker's key meet in dimension 0
        b.k.weight[0, MARK] += 3.0
        for block in model.blocks:
            if not mlp:
                block.mlp.fc_in.weight.zero_()
                block.mlp.fc_out.weight.zero_()
    pretrained = tiny(config)
    pretrained.model = model
    return pretrained


@pytest.mark.parametrize("norm", ["none", "pre"])
def test_the_planted_marker_is_the_top_term_and_its_head_carried_river(norm):
    why = qkv.why(marker_model(norm=norm), TEXT, "bank", "river", layer=1, head=0)
    top_query, top_key, value = why.ranked(1)[0]
    assert (top_query, top_key) == ("embedding", "L0.H0")
    assert value > 0.8 * why.total  # it makes the score, not just leads it
    assert why.by_part("key")[0][0] == "L0.H0"
    carried = next(c for c in why.carried if c.side == "key" and c.part == "L0.H0")
    assert carried.words[0][:2] == ("river", RIVER)  # what L0.H0 moved into river: river
    assert carried.whole == pytest.approx(carried.value, rel=1e-9)
    assert why.total == pytest.approx(why.pre_cap, rel=1e-9, abs=1e-9)


def test_without_norms_or_mlps_the_causal_checks_equal_the_prediction():
    """Nothing responds to a removed part here (no norm, MLPs zero), so zeroing a head at a
    word and rerunning must give exactly the linear prediction, score and weight."""
    why = qkv.why(marker_model(), TEXT, "bank", "river", layer=1, head=0, checks=3)
    assert {c.side for c in why.checks} == {"query", "key"}
    for check in why.checks:
        assert check.real_score == pytest.approx(check.predicted_score, abs=1e-9)
        assert check.real_weight == pytest.approx(check.predicted_weight, abs=1e-9)
    key = next(c for c in why.checks if c.side == "key" and c.part == "L0.H0")
    assert key.real_weight < 0.5 * why.weight  # the marker was why bank attended to river


def test_with_norms_and_mlps_the_checks_report_what_really_changes():
    pretrained = marker_model(norm="pre", mlp=True, noise=0.3)
    why = qkv.why(pretrained, TEXT, "bank", "river", layer=1, head=0, checks=2)
    stack = pretrained.model
    ids = torch.tensor([pretrained.encode(TEXT).ids])
    for check in why.checks:  # the real number is the model's own, rerun with the part zeroed
        m, what = check.part[1:].split(".")
        T = ids.shape[1]
        if what == "mlp":
            edit = Edit(mlp=torch.arange(T)[None] == check.position)
        else:
            heads = torch.zeros(1, 2, T, 1, dtype=torch.bool)
            heads[0, int(what[1:]), check.position] = True
            edit = Edit(heads=heads)
        with torch.inference_mode():
            record = stack(ids, layers=[1], edits={int(m): edit}).records[1]
        real = record.steps(0, why.query_index).pairs[why.key_index]
        assert check.real_score == pytest.approx(float(real.score), abs=1e-9)
        assert check.real_weight == pytest.approx(float(real.normalized_weight), abs=1e-9)


def test_edit_mlp_zeroes_the_mlp_output_at_its_positions_only():
    pretrained = marker_model(norm="pre", mlp=True, noise=0.3)
    stack, ids = pretrained.model, torch.tensor([pretrained.encode(TEXT).ids])
    T = ids.shape[1]
    with torch.inference_mode():
        plain = stack(ids, layers="all", hidden_states=True)
        edited = stack(ids, layers="all", hidden_states=True,
                       edits={0: Edit(mlp=torch.arange(T)[None] == RIVER)})  # fmt: skip
    before = walk(stack, plain, 1, list(range(T)))
    after = walk(stack, edited, 1, list(range(T)))
    mlp = before.index("L0.mlp")
    assert after.vectors[mlp, RIVER].abs().max() < 1e-12  # zeroed there
    assert before.vectors[mlp, RIVER].abs().max() > 1e-3  # and it was not zero
    others = [n for n in range(T) if n != RIVER]
    torch.testing.assert_close(after.vectors[mlp, others], before.vectors[mlp, others])
    with pytest.raises(ValueError, match="Edit.mlp must be a boolean"):
        Edit(mlp=torch.zeros(1, T))


def test_content_is_the_score_of_the_unturned_query_and_key():
    """In a rotary layer content is each term at distance 0: summed, the dot product of the
    query and key before their rotation, which the record keeps."""
    config = DecoderConfig(
        vocab_size=len(WORDS), num_layers=2, position="rotary",
        block=BlockConfig(width=32, num_heads=4, num_kv_heads=2, bias=False, norm="rmsnorm",
                          mlp="swiglu"),
    )  # fmt: skip
    pretrained = tiny(config)
    pretrained.model.double()
    why = qkv.why(pretrained, TEXT, "deep", "river", layer=1, head=3)
    with torch.inference_mode():
        record = pretrained.model(torch.tensor([pretrained.encode(TEXT).ids]), layers=[1]).records[
            1
        ]
    q = record.q_before_rotary[0, 3, why.query_index]
    k = record.k_before_rotary[0, 1, why.key_index]  # GQA: head 3 reads key head 1
    assert float(why.content.sum()) == pytest.approx(float(q @ k) * record.scale, rel=1e-9)
    assert why.position == pytest.approx(why.total - float(q @ k) * record.scale, abs=1e-9)
    assert why.kv_head == 1


def test_a_hidden_pair_and_a_linear_layer_are_refused_by_name():
    config = DecoderConfig(vocab_size=len(WORDS), num_layers=1, position="rotary",
                           block=BlockConfig(width=16, num_heads=2))  # fmt: skip
    with pytest.raises(ValueError, match="does not see the key word"):
        qkv.why(tiny(config), TEXT, "bank", "river", layer=0, head=0)  # river comes later
    with pytest.raises(ValueError, match="layer 3 is out of range"):
        qkv.why(tiny(config), TEXT, "river", "bank", layer=3)


def test_stack_why_names_token_positions_out_of_range():
    model = Decoder(DecoderConfig(vocab_size=9, num_layers=1,
                                  block=BlockConfig(width=16, num_heads=2))).eval()  # fmt: skip
    with pytest.raises(ValueError, match="query position 7 is outside the text's 3 tokens"):
        stack_why(model, torch.tensor([[1, 2, 3]]), 7, 0)


def test_minilm_bank_and_river_in_float32():
    pretrained = qkv.load("minilm")
    text = "I sat by the river bank and watched it flood"
    why = qkv.why(pretrained, text, "bank", "river", layer=3, head=5)
    seen = pretrained.attentions(text).records[3].steps(5, why.query_index)
    assert why.score == pytest.approx(float(seen.pairs[why.key_index].score), rel=1e-6)
    assert why.total == pytest.approx(why.pre_cap, rel=1e-5)
    assert why.content is None  # learned positions: nothing turns
    assert set(why.parts_q) >= {"embedding", "position", "segment", "bias", "L0.H0", "L2.mlp"}
    assert all(c.whole == pytest.approx(c.value, rel=1e-4, abs=1e-6) for c in why.carried)


def test_an_encoder_decoders_cross_attention_through_qkv_why(tmp_path):
    """A tiny random BART (transformers builds it) with a word-level tokenizer: the target's
    word asks, the source's word answers, as qkv.trace reads them."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import models, pre_tokenizers

    from qkv.io.hf_folder import load_folder
    from qkv.io.tokenizer import Tokenizer
    from tiny_models import save_tiny

    save_tiny("bart", tmp_path)
    model, family, config, hf_config = load_folder(tmp_path, torch.float32, None)
    words = ["[UNK]", "the", "bank", "on", "side", "of", "river", "la", "rive", "banque"]
    backend = Backend(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    bart = qkv.Pretrained(model, Tokenizer(backend), config, family=family,
                          hf_config=hf_config, source="tiny-bart")  # fmt: skip
    text, target = "the bank of the river", "la banque"
    why = qkv.why(bart, text, "banque", "river", target=target)
    traced = qkv.trace(bart, text, "banque", "river", target=target)
    assert (why.layer, why.head) == (traced.layer, traced.head)
    assert why.query_tokens == ["bank", "la", "banque"] and why.query_index == 2
    assert why.tokens[why.key_index] == "river"
    assert why.weight == pytest.approx(float(traced.weights[why.key_index]), abs=1e-6)
    assert why.total == pytest.approx(why.pre_cap, rel=1e-5, abs=1e-6)
    assert why.to_dict()["query_tokens"] == why.query_tokens
    with pytest.raises(ValueError, match="encoder-decoder models' cross-attention"):
        qkv.why(marker_model(), TEXT, "bank", "river", target="x")


def test_carried_words_are_the_same_in_blocks_of_two(monkeypatch):
    from qkv.inspect import why_parts

    whole = qkv.why(marker_model(norm="pre", mlp=True, noise=0.3), TEXT, "bank", "river",
                    layer=1, head=0, checks=0)  # fmt: skip
    monkeypatch.setattr(why_parts, "CARRIED_BLOCK", 2)
    blocks = qkv.why(marker_model(norm="pre", mlp=True, noise=0.3), TEXT, "bank", "river",
                     layer=1, head=0, checks=0)  # fmt: skip
    for mine, theirs in zip(blocks.carried, whole.carried, strict=True):
        assert [w[:3] for w in mine.words] == [w[:3] for w in theirs.words]
        assert [w[3] for w in mine.words] == pytest.approx([w[3] for w in theirs.words])
    assert len(whole.carried) == 4 and all(len(c.words) >= 2 for c in whole.carried)
