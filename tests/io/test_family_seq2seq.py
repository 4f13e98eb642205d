"""Marian and T5, tiny random checkpoints built by `transformers`, loaded by qkv: equal logits,
padding, cached decoding, attention weights and traces, export, and config.json both ways."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace

import pytest
import torch
import transformers as hf
from safetensors.torch import load_file, save_file

import qkv
from qkv.generate import Sampling, seq2seq_steps
from qkv.io.embedded import embedded_path
from qkv.io.families import family_for, marian, t5
from qkv.io.hf_folder import load_folder, save_folder
from qkv.models import EncoderDecoderConfig
from qkv.nn import BlockConfig
from qkv.nn.relative import relative_buckets

MARIAN = dict(
    vocab_size=99, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
    decoder_attention_heads=4, encoder_ffn_dim=37, decoder_ffn_dim=37,
    max_position_embeddings=64, scale_embedding=True, activation_function="swish",
    pad_token_id=98, decoder_start_token_id=98, eos_token_id=0, forced_eos_token_id=0,
)  # fmt: skip
# d_kv 12 is not d_model / num_heads; 8 buckets up to distance 16: the texts below pass both
T5 = dict(
    vocab_size=99, d_model=32, d_kv=12, d_ff=37, num_layers=2, num_decoder_layers=3,
    num_heads=4, relative_attention_num_buckets=8, relative_attention_max_distance=16,
    decoder_start_token_id=0,
)  # fmt: skip
TINY = {
    "marian": (hf.MarianMTModel, hf.MarianConfig(**MARIAN)),
    "t5": (hf.T5ForConditionalGeneration, hf.T5Config(**T5)),  # relu, tied and scaled head
    # flan-t5 as published: gated tanh-gelu, tie_word_embeddings false, a head of its own
    "t5-v1.1": (hf.T5ForConditionalGeneration,
                hf.T5Config(**T5, feed_forward_proj="gated-gelu", tie_word_embeddings=False)),
    # the same written by transformers 5: scale_decoder_outputs false, no lm_head tensor
    "t5-v1.1-saved": (hf.T5ForConditionalGeneration,
                      hf.T5Config(**T5, feed_forward_proj="gated-gelu",
                                  tie_word_embeddings=False)),
}  # fmt: skip
NAMES = list(TINY)


def save_tiny(name: str, folder):
    """A tiny random checkpoint of `name` in `folder`, and transformers' model of it."""
    cls, config = TINY[name]
    torch.manual_seed(1)
    model = cls(config).eval()
    with torch.no_grad():  # random, not zero, weights everywhere: a mapping error must show
        for p in model.parameters():
            if p.requires_grad:  # Marian's sinusoid tables are frozen
                p.add_(torch.randn_like(p) * 0.02)
        if name.startswith("marian"):
            model.final_logits_bias.normal_()
        else:  # T5 draws its token matrix with std 1: logits of a trained model's size instead
            model.shared.weight.mul_(0.25)
    model.save_pretrained(folder)
    if name == "t5-v1.1":  # as flan-t5's files: a distinct lm_head, the old config spelling
        tensors = load_file(folder / "model.safetensors")
        tensors["lm_head.weight"] = torch.randn_like(tensors["shared.weight"]) * 0.25
        save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
        hf_config = json.loads((folder / "config.json").read_text())
        del hf_config["scale_decoder_outputs"]
        hf_config["tie_word_embeddings"] = False
        (folder / "config.json").write_text(json.dumps(hf_config))
    return cls.from_pretrained(folder, attn_implementation="eager").eval()


def batch(source_length=20, target_length=18):
    """A source batch whose second row is right-padded, and a target batch."""
    torch.manual_seed(2)
    source = torch.randint(1, 97, (2, source_length))
    source_mask = torch.ones_like(source)
    source_mask[1, source_length - 6 :] = 0
    target = torch.randint(1, 97, (2, target_length))
    return source, source_mask, target


@pytest.fixture(scope="module", params=NAMES)
def pair(request, tmp_path_factory):
    """(name, transformers' model, qkv's model with the eager backend, folder)."""
    folder = tmp_path_factory.mktemp(request.param)
    theirs = save_tiny(request.param, folder)
    ours, *_ = load_folder(folder, torch.float32, "eager")
    return request.param, theirs, ours, folder


def test_the_v1_1_heads_are_their_own():
    """The two v1.1 checkpoints differ as meant: one holds its own head, one does not."""
    assert t5.config(TINY["t5-v1.1"][1].to_dict()).tie_lm_head is False
    assert t5.config(TINY["t5"][1].to_dict()).head_scale == 32**-0.5


@pytest.mark.parametrize("backend", ["eager", "sdpa"])
def test_logits_match_transformers_past_the_bucket_distance(pair, backend):
    _, theirs, _, folder = pair
    ours, *_ = load_folder(folder, torch.float32, backend)
    source, source_mask, target = batch()
    with torch.no_grad():
        want = theirs(input_ids=source, attention_mask=source_mask, decoder_input_ids=target)
        got = ours(source, target, source_mask=source_mask)
    real = source_mask.bool()
    torch.testing.assert_close(
        got.encoder_hidden[real], want.encoder_last_hidden_state[real], atol=1e-5, rtol=0
    )
    torch.testing.assert_close(got.logits, want.logits, atol=1e-5, rtol=0)


def test_padded_rows_equal_each_row_alone(pair):
    """A right-padded source and target batch: on real tokens, each row as if alone."""
    _, _, ours, _ = pair
    source, source_mask, target = batch()
    target_mask = torch.ones_like(target)
    target_mask[0, 12:] = 0
    with torch.no_grad():
        got = ours(source, target, source_mask=source_mask, target_mask=target_mask)
        for row in range(2):
            S, T = int(source_mask[row].sum()), int(target_mask[row].sum())
            alone = ours(source[row : row + 1, :S], target[row : row + 1, :T]).logits
            torch.testing.assert_close(got.logits[row, :T], alone[0], atol=1e-5, rtol=0)


def test_cached_decoding_token_by_token_equals_the_full_forward(pair):
    _, _, ours, _ = pair
    source, source_mask, target = batch()
    with torch.no_grad():
        full = ours(source, target, source_mask=source_mask).logits
        encoded = ours.read_source(source, source_mask=source_mask)
        cache = ours.new_cache()
        steps = [
            ours(source, target[:, t : t + 1], source_mask=source_mask, encoded=encoded,
                 cache=cache).logits
            for t in range(target.shape[1])
        ]  # fmt: skip
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=0)


def test_records_weigh_as_transformers_output_attentions(pair):
    _, theirs, ours, _ = pair
    source, source_mask, target = batch()
    with torch.no_grad():
        want = theirs(input_ids=source, attention_mask=source_mask, decoder_input_ids=target,
                      output_attentions=True)  # fmt: skip
        got = ours(source, target, source_mask=source_mask, encoder_layers=[1], layers=[0, 1],
                   cross_layers=[1])  # fmt: skip
    pairs = [(got.encoder_records[1], want.encoder_attentions[1]),
             (got.decoder_records[0], want.decoder_attentions[0]),
             (got.decoder_records[1], want.decoder_attentions[1]),
             (got.cross_records[1], want.cross_attentions[1])]  # fmt: skip
    for record, attentions in pairs:
        torch.testing.assert_close(record.weights(), attentions, atol=1e-6, rtol=0)


def test_the_trace_of_a_query_is_the_head_output(pair):
    """record.steps (the article's loop, float64) gives what the model's head computed,
    T5's position bias included in every score."""
    name, _, ours, _ = pair
    source, source_mask, target = batch()
    with torch.no_grad():
        got = ours(source, target, source_mask=source_mask, encoder_layers=[0], layers=[1],
                   cross_layers=[0])  # fmt: skip
    records = [got.encoder_records[0], got.decoder_records[1], got.cross_records[0]]
    if name.startswith("t5"):
        assert records[0].bias is not None and records[1].bias is not None
        assert records[2].bias is None  # cross-attention has no position bias
    for record in records:
        for head, query in [(0, 0), (3, 17)]:
            steps = record.steps(head, query, batch=1)
            torch.testing.assert_close(
                steps.contextualized, record.out[1, head, query].double(), atol=1e-5, rtol=0
            )
            if record.bias is not None:  # the score the softmax reads holds the bias
                pair_step = steps.pairs[2]
                bias = record.bias[0, head, query, 2].double()
                assert float(pair_step.score) == pytest.approx(
                    float(pair_step.scaled_scalar + bias)
                )


TOKENIZER_FILES = ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"]


def test_export_loads_in_transformers_with_equal_logits(pair, tmp_path):
    """Pretrained.save (the original config.json), and a config.json written by the family's
    own hf_config: transformers loads both with qkv's logits."""
    name, _, _, folder = pair
    for file in TOKENIZER_FILES:  # any tokenizer will do: only the weights are compared
        shutil.copy(embedded_path("minilm") / file, tmp_path / file)
    for file in folder.iterdir():
        shutil.copy(file, tmp_path / file.name)
    ours = qkv.load(tmp_path)
    ours.save(tmp_path / "saved")
    hf_config = ours.family.hf_config(ours.config)
    save_folder(tmp_path / "written", ours.model, ours.family, ours.config, hf_config,
                ours.tokenizer)  # fmt: skip
    source, source_mask, target = batch()
    with torch.no_grad():
        want = ours.model(source, target, source_mask=source_mask).logits
        for exported in ("saved", "written"):
            theirs = TINY[name][0].from_pretrained(tmp_path / exported).eval()
            got = theirs(input_ids=source, attention_mask=source_mask, decoder_input_ids=target)
            torch.testing.assert_close(got.logits, want, atol=1e-5, rtol=0)


def test_a_t5_config_json_without_a_start_token_starts_from_pad(pair, tmp_path):
    name, _, _, folder = pair
    for file in [*folder.iterdir(), *(embedded_path("minilm") / f for f in TOKENIZER_FILES)]:
        shutil.copy(file, tmp_path / file.name)
    written = json.loads((tmp_path / "config.json").read_text())
    written.pop("decoder_start_token_id", None)  # as transformers 5 writes T5's
    (tmp_path / "config.json").write_text(json.dumps(written))
    loaded = qkv.load(tmp_path)
    if name.startswith("t5"):
        assert loaded.decoder_start() == 0
    else:  # Marian's own key is gone, and this tokenizer has no end-of-sequence token
        with pytest.raises(ValueError, match="names no decoder_start_token_id in its config"):
            loaded.decoder_start()


def test_greedy_generation_equals_transformers_generate(pair):
    """seq2seq_steps from the family's decoder start token: the tokens transformers picks."""
    name, theirs, ours, _ = pair
    source, source_mask, _ = batch()
    start = TINY[name][1].decoder_start_token_id
    steps = seq2seq_steps(ours, source, source_mask, start, Sampling(), 6)
    got = torch.stack(list(steps), dim=1)
    want = theirs.generate(input_ids=source, attention_mask=source_mask, max_new_tokens=6,
                           min_new_tokens=6, do_sample=False, num_beams=1, use_cache=False,
                           decoder_start_token_id=start, forced_eos_token_id=None)  # fmt: skip
    assert want[:, 0].tolist() == [start, start]
    assert got.tolist() == want[:, 1:].tolist()


def test_relative_buckets_are_t5s():
    from transformers.models.t5.modeling_t5 import T5Attention

    distances = torch.arange(-300, 300)
    for bidirectional in (True, False):
        for buckets, max_distance in [(32, 128), (8, 16), (6, 10)]:
            want = T5Attention._relative_position_bucket(
                distances, bidirectional, buckets, max_distance
            )
            got = relative_buckets(distances, bidirectional=bidirectional,
                                   num_buckets=buckets, max_distance=max_distance)  # fmt: skip
            assert torch.equal(got, want)


def test_marian_positions_are_marians_table():
    from transformers.models.marian.modeling_marian import MarianSinusoidalPositionalEmbedding

    table = MarianSinusoidalPositionalEmbedding(512, 64).create_weight()
    ours = qkv.nn.position.SinusoidalPositions(64, layout="halves")
    assert torch.equal(ours(torch.arange(512)), table)


# ---- config.json both ways ------------------------------------------------------------------

MARIAN_QKV = marian.config(hf.MarianConfig(**MARIAN).to_dict())
T5_QKV = t5.config(hf.T5Config(**T5).to_dict())
ROUND_TRIPS = [
    (marian, MARIAN_QKV),
    (marian, replace(MARIAN_QKV, embed_scale=False)),
    (marian, replace(MARIAN_QKV, block=replace(MARIAN_QKV.block, mlp="gelu_tanh"))),
    (t5, T5_QKV),
    (t5, replace(T5_QKV, tie_lm_head=False, head_scale=None,
                 block=replace(T5_QKV.block, mlp="geglu_tanh"))),
    (t5, replace(T5_QKV, block=replace(T5_QKV.block, mlp="swiglu", head_dim=5))),
]  # fmt: skip


@pytest.mark.parametrize("family, config", ROUND_TRIPS)
def test_a_qkv_config_written_as_config_json_reads_back_equal(family, config):
    written = family.hf_config(config)
    assert family_for(written) is family.FAMILY
    assert family.config(written) == config


@pytest.mark.parametrize("name", NAMES)
def test_a_transformers_config_json_round_trips_through_qkv(name):
    written = TINY[name][1].to_dict()
    family = family_for(written)
    config = family.config(written)
    assert family.config(family.hf_config(config)) == config
    # and transformers reads the written config.json as the same model
    again = type(TINY[name][1])(**family.hf_config(config)).to_dict()
    assert family.config(again) == config


def test_every_config_key_is_read_or_inert():
    for family, config_class in [(marian, hf.MarianConfig), (t5, hf.T5Config)]:
        keys = set(config_class().to_dict()) - set(hf.PretrainedConfig().to_dict())
        known = set(family.FAMILY.reads) | set(family.FAMILY.inert)
        assert keys <= known, sorted(keys - known)
        assert family.FAMILY.config_classes == (config_class.__name__,)


REFUSED_JSON = [
    (marian, dict(MARIAN, decoder_vocab_size=50), "decoder_vocab_size != vocab_size"),
    (marian, dict(MARIAN, share_encoder_decoder_embeddings=False),
     "share_encoder_decoder_embeddings=False are not supported"),
    (marian, dict(MARIAN, tie_word_embeddings=False),
     "tie_word_embeddings=False are not supported"),
    (marian, dict(MARIAN, decoder_attention_heads=2),
     "encoder_attention_heads != decoder_attention_heads"),
    (marian, dict(MARIAN, d_model=33, encoder_attention_heads=3, decoder_attention_heads=3),
     "d_model must be even for sinusoidal positions, got 33"),
    (marian, dict(MARIAN, activation_function="mish"), "activation 'mish' is not supported"),
    (t5, dict(T5, feed_forward_proj="gated-relu"),
     "feed_forward_proj='gated-relu' are not supported"),
    (t5, dict(T5, feed_forward_proj="relu", dense_act_fn="gelu"),
     "dense_act_fn='gelu' and feed_forward_proj='relu'"),
    (t5, dict(T5, feed_forward_proj="gelu-gated"), "must be 'ACT' or 'gated-ACT'"),
    (t5, dict(T5, is_decoder=True), "is_decoder=True are not supported"),
    (t5, dict(T5, relative_attention_num_buckets=2),
     "relative_attention_num_buckets must be a whole number >= 4, got 2"),
    (t5, dict(T5, scale_decoder_outputs="no"), "scale_decoder_outputs must be true or false"),
]  # fmt: skip


@pytest.mark.parametrize("family, config_json, message", REFUSED_JSON)
def test_a_config_json_value_qkv_does_not_compute_is_refused_by_name(family, config_json, message):
    with pytest.raises(ValueError, match=message) as error:
        family.config(config_json)
    assert "\n" not in str(error.value)


BLOCK = MARIAN_QKV.block
REFUSED = [
    (marian, replace(MARIAN_QKV, final_norm=True),
     r"a Marian config.json cannot hold this model: has_final_norm=True \(it has False\)"),
    (marian, replace(MARIAN_QKV, position="learned", sinusoid_layout="interleaved"),
     r"position='learned' \(it has 'sinusoidal'\), sinusoid_layout='interleaved'"),
    (t5, replace(T5_QKV, block=replace(T5_QKV.block, bias=True)),
     r"a T5 config.json cannot hold this model: block.bias=True \(it has False\)"),
    (t5, replace(T5_QKV, head_scale=None),
     r"head_scale=None \(it has 0.17677"),
    (t5, replace(T5_QKV, block=replace(T5_QKV.block, attn_scale=None)),
     r"block.attn_scale=None \(it has 1.0\)"),
    (t5, replace(T5_QKV, block=replace(T5_QKV.block, mlp="geglu")),
     "a T5 config.json cannot hold mlp='geglu'"),
]  # fmt: skip


@pytest.mark.parametrize("family, config, message", REFUSED)
def test_a_config_the_family_cannot_hold_is_refused_by_name(family, config, message):
    with pytest.raises(ValueError, match=message) as error:
        family.hf_config(config)
    assert "\n" not in str(error.value)


def test_a_qkv_t5_config_builds_from_fields():
    """The fields T5 needs, set by hand, make a model whose decoder scales and ties."""
    cfg = EncoderDecoderConfig(
        vocab_size=50, encoder_layers=1, decoder_layers=1, position="relative",
        embed_scale=False, head_scale=0.25,
        block=BlockConfig(width=16, num_heads=2, head_dim=4, norm="rmsnorm", bias=False,
                          attn_scale=1.0),
    )  # fmt: skip
    model = qkv.models.EncoderDecoder(cfg)
    assert model.decoder.lm_head.weight is model.encoder.embed.tokens.weight
    assert model.encoder.relative.bidirectional and not model.decoder.relative.bidirectional


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rmsnorm_is_t5s_layer_norm_in_every_dtype(dtype):
    """T5LayerNorm: the mean square in float32, the scaled vector cast to the weight's dtype,
    then the gain; qkv's RMSNorm computes the same numbers."""
    from transformers.models.t5.modeling_t5 import T5LayerNorm

    from qkv.nn.norms import make_norm

    theirs, ours = T5LayerNorm(32, eps=1e-6), make_norm("rmsnorm", 32, 1e-6)
    with torch.no_grad():
        theirs.weight.normal_()
        ours.weight.copy_(theirs.weight)
    theirs, ours = theirs.to(dtype), ours.to(dtype)
    x = (torch.randn(3, 5, 32) * 4).to(dtype)
    with torch.no_grad():
        assert torch.equal(ours(x), theirs(x))
