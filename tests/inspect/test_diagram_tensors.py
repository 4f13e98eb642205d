"""The tensor behind every box of the diagram: equal to qkv.cache's where both name it
(SmolLM2), present with the shape the box states for every layer of every family, and tied
to the block's real output by the block's own arithmetic (a residual sum, a norm)."""

from __future__ import annotations

import pytest
import torch
import transformers as hf

import qkv
from qkv.inspect.diagram import model_diagram
from qkv.inspect.diagram_tensors import diagram_tensors
from qkv.io.hf_folder import load_folder
from qkv.models import Decoder, DecoderConfig, Encoder, EncoderConfig
from qkv.nn import BlockConfig
from tiny_models import TINY as TINY_HF

TEXT = "The bank of the river was steep"
TINY = {
    "gemma2": lambda: hf.Gemma2ForCausalLM(hf.Gemma2Config(
        vocab_size=99, hidden_size=32, intermediate_size=37, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=8,
        attn_logit_softcapping=4.0)),
    "t5": lambda: hf.T5ForConditionalGeneration(hf.T5Config(
        vocab_size=99, d_model=32, d_kv=12, d_ff=37, num_layers=2, num_decoder_layers=3,
        num_heads=4, relative_attention_num_buckets=8, relative_attention_max_distance=16)),
    "bart": lambda: TINY_HF["bart"][0](TINY_HF["bart"][1]),
    "pythia": lambda: hf.GPTNeoXForCausalLM(hf.GPTNeoXConfig(
        vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=37, max_position_embeddings=64, rotary_pct=0.5)),
}  # fmt: skip


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    made = {}
    for name, build in TINY.items():
        torch.manual_seed(5)
        folder = tmp_path_factory.mktemp(name)
        build().save_pretrained(folder)
        made[name] = load_folder(folder, torch.float32, "eager")[0].eval()
    return made


def test_equal_to_qkv_cache_where_both_name_a_tensor(smollm2):
    found = diagram_tensors(smollm2, TEXT)
    cached = qkv.cache(smollm2, TEXT)
    assert set(cached.names) <= set(found)
    for name in cached.names:
        torch.testing.assert_close(found[name], cached[name], atol=0, rtol=0, msg=name)


def every_box_is_there(model, found, B, T, S=None):
    """Each box's tensor, in every layer, has the size the box states."""
    config = model.config
    layers = {"L.": getattr(config, "decoder_layers", getattr(config, "num_layers", 0)),
              "enc.L.": getattr(config, "encoder_layers", 0)}  # fmt: skip
    diagram = model_diagram(model, S or T, batch=B, target=T if S else None)
    for box in diagram.boxes:
        if box.tensor is None:
            continue
        stack = "enc.L." if box.id.startswith("enc.L.") else "L." if ".L." in f".{box.id}" else ""
        for layer in range(layers[stack]) if stack else [0]:
            name = box.tensor.format(layer=layer)
            assert tuple(found[name].shape) == box.size, (name, found[name].shape, box.size)


def test_every_box_of_every_family_has_its_tensor(minilm, smollm2, tiny):
    for pretrained in (minilm, smollm2):
        found = diagram_tensors(pretrained, TEXT)
        every_box_is_there(pretrained.model, found, 1, found["tokens"].shape[1])
    ids = torch.randint(1, 99, (2, 7))
    for name in ("gemma2", "pythia"):
        every_box_is_there(tiny[name], diagram_tensors(tiny[name], ids), 2, 7)
    for name in ("t5", "bart"):
        target = torch.randint(1, 99, (2, 5))
        found = diagram_tensors(tiny[name], ids, target=target)
        every_box_is_there(tiny[name], found, 2, 5, S=7)


def test_the_names_add_up_to_each_blocks_real_output(minilm, smollm2, tiny):
    """A post-norm block's output is its MLP norm of mlp_in + mlp_out; a pre-norm block's,
    the sum itself; a cross-attention sits between resid_mid and mlp_in."""
    found = diagram_tensors(minilm, TEXT)
    for n, block in enumerate(minilm.model.blocks):
        L = f"L{n}."
        torch.testing.assert_close(block.attn_norm(found[L + "resid_mid"]), found[L + "mlp_in"])
        torch.testing.assert_close(block.mlp_norm(found[L + "mlp_in"] + found[L + "mlp_out"]),
                                   found[f"L{n + 1}.resid_pre" if n < 5 else "final"])  # fmt: skip
    ids, target = torch.randint(1, 99, (1, 6)), torch.randint(1, 99, (1, 4))
    found = diagram_tensors(tiny["pythia"], ids)  # parallel: one sum of both sub-layers
    torch.testing.assert_close(found["L0.resid_pre"] + found["L0.attn_out"] + found["L0.mlp_out"],
                               found["L1.resid_pre"])  # fmt: skip
    for name, post in (("t5", False), ("bart", True)):
        found = diagram_tensors(tiny[name], ids, target=target)
        block = tiny[name].decoder.blocks[1]
        sum_ = found["L1.resid_cross"]
        want = block.cross_norm(sum_) if post else block.mlp_norm(sum_)
        torch.testing.assert_close(found["L1.mlp_in"], want)
        after = (block.mlp_norm(found["L1.mlp_in"] + found["L1.mlp_out"]) if post else
                 sum_ + found["L1.mlp_out"])  # fmt: skip
        torch.testing.assert_close(after, found["L1.resid_post"])
        following = "L2.resid_pre" if name == "t5" else "final"  # BART: 2 layers, no final norm
        torch.testing.assert_close(found[following], found["L1.resid_post"])


def test_an_mlm_head_and_layers_without_positions_have_their_tensors():
    """BERT's masked-language-model head draws logits; a layer of a rotary stack that turns
    nothing (SmolLM3's) names its q and k before rotary all the same: they are its q and k."""
    block = BlockConfig(width=16, num_heads=2)
    ids = torch.randint(1, 20, (2, 5))
    mlm = Encoder(EncoderConfig(vocab_size=20, num_layers=2, block=block, mlm_head=True)).eval()
    found = diagram_tensors(mlm, ids)
    assert "logits" in model_diagram(mlm, 5).ids
    every_box_is_there(mlm, found, 2, 5)
    torch.testing.assert_close(found["logits"], mlm(ids, logits=True).logits)
    nope = Decoder(DecoderConfig(vocab_size=20, num_layers=2, block=block, position="rotary",
                                 rope_layers=(True, False))).eval()  # fmt: skip
    found = diagram_tensors(nope, ids)
    every_box_is_there(nope, found, 2, 5)
    assert found["L1.q_before_rotary"] is found["L1.q"]
    assert not torch.equal(found["L0.q_before_rotary"], found["L0.q"])
    assert "in 1 of 2 layers" in model_diagram(nope, 5).box("L.q_rotary").explain


def test_t5s_weights_are_the_softmax_of_its_scores_plus_the_bias(tiny):
    found = diagram_tensors(tiny["t5"], torch.randint(1, 99, (1, 6)),
                            target=torch.randint(1, 99, (1, 4)))  # fmt: skip
    for name in ("enc.L0.", "L2."):
        want = torch.softmax(found[name + "scores"] + found[name + "bias"], dim=-1)
        torch.testing.assert_close(found[name + "weights"], want)
    cross = torch.softmax(found["L0.cross_scores"], dim=-1)  # no position bias across
    torch.testing.assert_close(found["L0.cross_weights"], cross)


def test_bad_inputs_are_refused(minilm, tiny):
    with pytest.raises(ValueError, match="give target="):
        diagram_tensors(tiny["t5"], torch.randint(1, 99, (1, 6)))
    with pytest.raises(ValueError, match="a text where the model is a Pretrained"):
        diagram_tensors(tiny["gemma2"], "a text")
    with pytest.raises(ValueError, match=r"\(B, T\) long tensor"):
        diagram_tensors(minilm, torch.zeros(3))
