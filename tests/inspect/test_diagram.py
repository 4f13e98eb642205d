"""The model diagram: every shape it states equals the shape of the real tensor of a real
forward pass of that model (MiniLM, SmolLM2, tiny random Gemma 2, Gemma 3, T5 and BART
checkpoints built by transformers), each family's departures from the article drawn where
they are and nowhere else, and what it cannot draw refused by name."""

from __future__ import annotations

import json
import re

import pytest
import torch
import transformers as hf

from linear_models import linear_model
from qkv.inspect.diagram import STEPS, model_diagram
from qkv.io.hf_folder import load_folder
from qkv.models import DecoderConfig, EncoderDecoder
from qkv.nn import BlockConfig
from qkv.nn.head_edits import per_query_head
from qkv.nn.latent import LatentConfig
from tiny_models import TINY as TINY_HF

SHARED = dict(vocab_size=99, hidden_size=32, intermediate_size=37, max_position_embeddings=64)
TINY = {
    "gemma2": hf.Gemma2ForCausalLM(hf.Gemma2Config(
        **SHARED, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, query_pre_attn_scalar=64, sliding_window=8, attn_logit_softcapping=4.0,
        final_logit_softcapping=3.0)),
    "gemma3": hf.Gemma3ForCausalLM(hf.Gemma3TextConfig(
        **SHARED, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=1,
        head_dim=16, query_pre_attn_scalar=64, sliding_window=8, tie_word_embeddings=False,
        layer_types=["sliding_attention", "sliding_attention", "full_attention",
                     "sliding_attention"])),
    "t5": hf.T5ForConditionalGeneration(hf.T5Config(
        vocab_size=99, d_model=32, d_kv=12, d_ff=37, num_layers=2, num_decoder_layers=3,
        num_heads=4, relative_attention_num_buckets=8, relative_attention_max_distance=16,
        decoder_start_token_id=0, feed_forward_proj="gated-gelu")),
    "bart": TINY_HF["bart"][0](TINY_HF["bart"][1]),
    # Pythia: attention and MLP side by side, half of each head turned
    "pythia": hf.GPTNeoXForCausalLM(hf.GPTNeoXConfig(
        vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=37, max_position_embeddings=64, rotary_pct=0.5)),
    # OLMo 2: no norm before a sub-layer, one on each output; QK-norm over all heads
    "olmo2": hf.Olmo2ForCausalLM(hf.Olmo2Config(
        vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=37, max_position_embeddings=64)),
}  # fmt: skip


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """name -> qkv's model of a tiny random checkpoint that transformers saved."""
    made = {}
    for name, theirs in TINY.items():
        folder = tmp_path_factory.mktemp(name)
        theirs.save_pretrained(folder)
        made[name] = load_folder(folder, torch.float32, "eager")[0].eval()
    return made


def stack_tensors(stack, ids, prefix="", context=None) -> dict[str, torch.Tensor]:
    """Every tensor a diagram may name, by name, from the stack's own records and states."""
    extra = {} if context is None else {"context": context, "cross_layers": "all"}
    with torch.no_grad():
        out = stack(ids, layers="all", hidden_states=True, **extra)
    B, T = ids.shape
    found = {f"{prefix}tokens": ids, f"{prefix}embed": out.hidden_states[0],
             f"{prefix}final": out.hidden}  # fmt: skip
    if getattr(out, "logits", None) is not None:
        found["logits"] = out.logits
    for n, record in out.records.items():
        block, t = stack.blocks[n], f"{prefix}L{n}."
        resid_pre, attn_out, mlp_out = out.hidden_states[n], record.attn_out, record.mlp_out
        resid_mid = resid_pre + attn_out
        names = {"resid_pre": resid_pre, "attn_in": resid_pre, "q": record.q, "k": record.k,
                 "v": record.v, "weights": record.weights(), "z": record.out,
                 "concat": record.out.transpose(1, 2).reshape(B, T, -1), "attn_out": attn_out,
                 "resid_mid": resid_mid, "mlp_out": mlp_out, "resid_post": out.hidden_states[n + 1],
                 "scores": record.q @ per_query_head(record.k, record.q.shape[1]).mT}  # fmt: skip
        if record.q_before_rotary is not None:
            names |= {"q_before_rotary": record.q_before_rotary,
                      "k_before_rotary": record.k_before_rotary}  # fmt: skip
        if record.bias is not None:
            names["bias"] = record.bias.expand(B, -1, -1, -1)
        if block.position == "pre":
            names["attn_in"] = block.attn_norm(resid_pre)
        stream = resid_mid if block.position != "post" else block.attn_norm(resid_mid)
        if context is not None:
            cross = out.cross_records[n]
            cross_in = block.cross_norm(stream) if block.position == "pre" else stream
            cross_out = block.cross_attn.out(cross.out.transpose(1, 2).reshape(B, T, -1))
            names |= {"cross_in": cross_in, "cross_q": cross.q, "cross_k": cross.k,
                      "cross_v": cross.v, "cross_weights": cross.weights(), "cross_z": cross.out,
                      "cross_scores": cross.q @ per_query_head(cross.k, cross.q.shape[1]).mT,
                      "cross_concat": cross.out.transpose(1, 2).reshape(B, T, -1),
                      "cross_out": cross_out, "resid_cross": stream + cross_out}  # fmt: skip
            stream = stream + cross_out
            if block.position == "post":
                stream = block.cross_norm(stream)
        if block.parallel:
            stream = resid_pre
        names["mlp_in"] = block.mlp_norm(stream) if block.position == "pre" else stream
        found |= {t + name: value for name, value in names.items()}
    return found


def real_tensors(model, tokens: int, target: int | None = None) -> dict[str, torch.Tensor]:
    torch.manual_seed(3)
    vocab = model.config.vocab_size
    if not isinstance(model, EncoderDecoder):
        return stack_tensors(model, torch.randint(1, vocab, (2, tokens)))
    source = torch.randint(1, vocab, (2, tokens))
    encoded = stack_tensors(model.encoder, source, "enc.")
    context = model.encoder(source).hidden
    return encoded | stack_tensors(model.decoder, torch.randint(1, vocab, (2, target)),
                                   context=context)  # fmt: skip


# boxes that show no tensor kept apart: the real tensor whose shape they state
UNNAMED = {"tokens": "tokens", "embed": "embed", "position": "embed", "concat": "concat",
           "o": "attn_out", "cross_o": "cross_out", "mlp": "mlp_out", "add_mlp": "mlp_out",
           "cross_concat": "cross_concat"}  # fmt: skip


def check_shapes(diagram, found: dict, layers: int, encoder_layers: int = 0) -> int:
    """Every box's stated size is its real tensor's, in its first and last layer."""
    checked = 0
    for box in diagram.boxes:
        prefix = "enc." if box.id.startswith("enc.") else ""
        last = (encoder_layers if prefix else layers) - 1
        name, repeated = box.tensor, ".L." in f".{box.id}"
        if name is None:
            kind = box.id.rpartition(".")[2]
            name = prefix + ("L{layer}." if repeated else "") + UNNAMED[kind]
        for layer in {0, last} if repeated else {0}:
            tensor = found[name.format(layer=layer)]
            assert tuple(tensor.shape) == box.size, (box.id, tuple(tensor.shape), box.size)
            checked += 1
    return checked


def check_vocabulary(diagram, sizes: dict) -> None:
    """The shape string says the size in the article's letters, each letter its own number."""
    for box in diagram.boxes:
        letters, numbers = re.fullmatch(r"\((.*)\) = \((.*)\)", box.shape).groups()
        numbers = tuple(int(n) for n in numbers.split(", "))
        assert numbers == box.size, box
        for letter, number in zip(letters.split(", "), numbers, strict=True):
            assert sizes[letter] == number, (box.id, letter, number)


def sizes_of(config, batch, T, S=None) -> dict:
    block = config.block
    D = block.head_size
    return {"B": batch, "T": T, "S": S, "C": block.width, "H": block.num_heads,
            "Hkv": block.kv_heads, "D": D, "H·D": block.num_heads * D,
            "V": config.vocab_size}  # fmt: skip


def test_minilm_shapes_equal_its_real_tensors(minilm):
    diagram = model_diagram(minilm, 7, batch=2)
    found = real_tensors(minilm.model, 7)
    assert check_shapes(diagram, found, 6) == 2 * len(diagram.boxes) - 4  # 4 global boxes
    check_vocabulary(diagram, sizes_of(minilm.config, 2, 7))
    assert diagram.title == "MiniLM (BERT encoder): 6 layers, 12 heads of 32, width 384"


def test_smollm2_shapes_equal_its_real_tensors(smollm2):
    diagram = model_diagram(smollm2, 5, batch=2)
    found = real_tensors(smollm2.model, 5)
    check_shapes(diagram, found, smollm2.config.num_layers)
    check_vocabulary(diagram, sizes_of(smollm2.config, 2, 5))
    assert diagram.box("L.k").shape == "(B, Hkv, T, D) = (2, 3, 5, 64)"  # GQA: 3 key heads
    assert diagram.box("L.q").shape == "(B, H, T, D) = (2, 9, 5, 64)"
    assert "sharing 3 key/value heads" in diagram.title


@pytest.mark.parametrize("name", ["gemma2", "gemma3", "pythia", "olmo2"])
def test_decoder_shapes_equal_their_real_tensors(name, tiny):
    model = tiny[name]
    diagram = model_diagram(model, 11, batch=2)
    check_shapes(diagram, real_tensors(model, 11), model.config.num_layers)
    check_vocabulary(diagram, sizes_of(model.config, 2, 11))


@pytest.mark.parametrize("name", ["t5", "bart"])
def test_encoder_decoder_shapes_equal_its_real_tensors(name, tiny):
    model = tiny[name]
    config = model.config
    diagram = model_diagram(model, 9, batch=2, target=6)
    found = real_tensors(model, 9, 6)
    check_shapes(diagram, found, config.decoder_layers, config.encoder_layers)
    sizes = sizes_of(config, 2, 6, 9)
    check_vocabulary(diagram, sizes)
    assert diagram.box("L.cross_weights").shape == "(B, H, T, S) = (2, 4, 6, 9)"
    assert diagram.box("enc.L.weights").shape == "(B, H, S, S) = (2, 4, 9, 9)"
    assert [s.layers for s in diagram.stacks] == [config.encoder_layers, config.decoder_layers]


def test_rotary_boxes_only_where_positions_rotate(minilm, smollm2, tiny):
    for model, rotary in [(minilm, False), (smollm2, True), (tiny["gemma2"], True),
                          (tiny["t5"], False), (tiny["bart"], False)]:  # fmt: skip
        ids = model_diagram(model, 4).ids
        assert ("L.q_rotary" in ids and "L.k_rotary" in ids) is rotary
        assert ("position" in ids) is (model.config.position in ("learned", "sinusoidal"))
    d = model_diagram(smollm2, 4)
    assert ("L.q", "L.q_rotary") in d.edges and ("L.q_rotary", "L.scores") in d.edges
    assert d.box("L.q").tensor == "L{layer}.q_before_rotary"


def test_grouped_keys_say_hkv_only_under_gqa(minilm, smollm2, tiny):
    assert model_diagram(minilm, 4).box("L.k").shape.startswith("(B, H, T, D)")
    assert model_diagram(tiny["gemma3"], 4).box("L.v").shape == "(B, Hkv, T, D) = (1, 1, 4, 16)"
    assert "shared by 9 query heads" not in model_diagram(smollm2, 4).box("L.k").explain
    assert "shared by 3 query heads" in model_diagram(smollm2, 4).box("L.k").explain


def test_cross_attention_only_in_encoder_decoders(minilm, smollm2, tiny):
    for model in (minilm, smollm2, tiny["gemma2"]):
        d = model_diagram(model, 4)
        assert not d.lit("cross") and not any("cross" in box.id for box in d.boxes)
    for name, source in (("t5", "enc.final_norm"), ("bart", "enc.L.norm_mlp")):
        d = model_diagram(tiny[name], 4, target=3)
        assert (source, "L.cross_k") in d.edges and (source, "L.cross_v") in d.edges
        assert (source, "L.cross_q") not in d.edges
        assert "shifted right" in d.box("tokens").explain


def test_pre_and_post_norm_in_the_order_each_block_computes(minilm, smollm2, tiny):
    post = model_diagram(minilm, 4)  # BERT: normalize after each residual sum
    ids = post.ids
    assert ("L.resid_pre", "L.q") in post.edges
    assert ids.index("L.resid_mid") < ids.index("L.norm_attn") < ids.index("L.mlp")
    assert ids.index("L.add_mlp") < ids.index("L.norm_mlp") and "final_norm" not in ids
    pre = model_diagram(smollm2, 4)  # Llama: normalize each sub-layer's input
    ids = pre.ids
    assert ("L.norm_attn", "L.q") in pre.edges and ("L.resid_pre", "L.q") not in pre.edges
    assert ids.index("L.norm_attn") < ids.index("L.q") and "final_norm" in ids
    assert ids.index("L.norm_mlp") < ids.index("L.mlp") < ids.index("L.resid_post")
    gemma = model_diagram(tiny["gemma2"], 4)  # pre-norms and norms on sub-layer outputs
    assert ("L.o", "L.norm_attn_out") in gemma.edges and ("L.mlp", "L.norm_mlp_out") in gemma.edges


def test_parallel_blocks_and_norms_on_outputs_only(tiny):
    pythia = model_diagram(tiny["pythia"], 4)  # the MLP reads the layer input, beside attention
    assert ("L.resid_pre", "L.norm_mlp") in pythia.edges and "L.resid_mid" not in pythia.ids
    assert {a for a, b in pythia.edges if b == "L.resid_post"} == {"L.resid_pre", "L.o", "L.mlp"}
    assert "4 of 8 numbers turn" in pythia.box("L.q_rotary").explain
    olmo2 = model_diagram(tiny["olmo2"], 4)  # no norm before a sub-layer, one after each
    assert ("L.resid_pre", "L.q") in olmo2.edges and "L.norm_attn" not in olmo2.ids
    assert ("L.o", "L.norm_attn_out") in olmo2.edges and "QK-norm" in olmo2.box("L.k").explain


def test_family_words_follow_the_config(smollm2, tiny):
    gemma2 = model_diagram(tiny["gemma2"], 4)
    assert "sqrt(64), not sqrt(D)" in gemma2.box("L.scores").explain
    assert "4 · tanh(score / 4)" in gemma2.box("L.scores").explain
    assert "in 2 of 3 layers (a sliding window)" in gemma2.box("L.weights").explain
    assert "capped: 3 · tanh" in gemma2.box("logits").explain
    assert gemma2.box("embed").label.endswith("× √C")
    gemma3 = model_diagram(tiny["gemma3"], 4)
    assert "in 3 of 4 layers" in gemma3.box("L.weights").explain
    assert "QK-norm" in gemma3.box("L.q").explain and "own matrix" in gemma3.box("logits").explain
    assert "tied" in model_diagram(smollm2, 4).box("logits").explain
    t5 = model_diagram(tiny["t5"], 4)
    assert t5.box("L.scores").label == "Scores q·k" and "position" not in t5.ids
    assert ("L.scores", "L.position_bias") in t5.edges
    assert t5.box("L.position_bias").step == "embeddings"
    assert "L.cross_position_bias" not in t5.ids  # T5's cross-attention has no positions
    assert t5.box("L.mlp").label == "GeGLU MLP"


def test_every_box_has_a_step_an_explanation_and_a_unique_id(minilm, tiny):
    for model in (minilm, tiny["t5"]):
        d = model_diagram(model, 4)
        assert len(set(d.ids)) == len(d.ids)
        assert all(box.step in STEPS and box.explain.endswith(".") for box in d.boxes)
        assert {a for edge in d.edges for a in edge} <= set(d.ids)
        back = json.loads(json.dumps(d.to_dict()))  # JSON-ready, for a page's script
        assert [b["id"] for b in back["boxes"]] == list(d.ids)
        assert back["edges"] == [list(e) for e in d.edges] and back["title"] == d.title
        assert back["boxes"][3]["size"] == list(d.boxes[3].size)


@pytest.mark.parametrize(
    "block, words",
    [(dict(output_gate=True), "output gate"),
     (dict(latent=LatentConfig(32, 4, kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=4,
                               v_head_dim=8)), "latent attention")],
)  # fmt: skip
def test_what_it_cannot_draw_is_refused_by_name(block, words):
    config = DecoderConfig(vocab_size=10, num_layers=2, position="rotary",
                           block=BlockConfig(width=32, num_heads=4, **block))  # fmt: skip
    with pytest.raises(ValueError, match=words):
        model_diagram(config, 4)


def test_linear_attention_and_other_stacks_are_refused():
    with pytest.raises(ValueError, match="linear attention"):
        model_diagram(linear_model(), 4)
    config = DecoderConfig(vocab_size=10, num_layers=2, block=BlockConfig(width=32, num_heads=4))
    for bad in ({"tokens": 0}, {"batch": -1}, {"tokens": 2.5}):
        with pytest.raises(ValueError, match="whole number"):
            model_diagram(config, **{"tokens": 4, **bad})
    with pytest.raises(ValueError, match="got str"):
        model_diagram("smollm2", 4)
    with pytest.raises(ValueError, match="no box 'L.nothing'"):
        model_diagram(config, 4).box("L.nothing")
    with pytest.raises(ValueError, match="step must be one of"):
        model_diagram(config, 4).lit("nothing")
