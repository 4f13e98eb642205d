"""A model config summed up by how it departs from the article, and `qkv models`, which
describes every family qkv reads by what it computes for transformers' default config."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from typer.testing import CliRunner

from qkv.cli import app
from qkv.inspect.anatomy import Anatomy, anatomy, family_models, layer_anatomy
from qkv.io.families import FAMILIES
from qkv.models import DecoderConfig, EncoderConfig, EncoderDecoderConfig
from qkv.nn import BlockConfig
from qkv.nn.rope import RopeScaling


def decoder(**fields) -> DecoderConfig:
    block = BlockConfig(**{"width": 256, "num_heads": 2, **fields.pop("block", {})})
    return DecoderConfig(**{"vocab_size": 10, "num_layers": 4, "block": block, **fields})


def test_a_gemma2_like_decoder():
    cfg = decoder(position="rotary", logit_softcap=30.0, layer_types=("sliding", "full") * 2,
                  block={"attn_scale": 144**-0.5, "softcap": 50.0, "window": 4096,
                         "norm": "rmsnorm_plus1", "sublayer_norm": True})  # fmt: skip
    assert anatomy(cfg) == Anatomy(
        shape="decoder",
        position="rotary (base 10000)",
        norm="pre-norm RMSNorm (1 + w) + on sub-layer outputs",
        window="the last 4096 tokens in 2 of 4 layers",
        scores="q.k / sqrt(144) (not sqrt(128)), capped 50 tanh(s/50), logits capped 30 tanh(x/30)",
        attention="softmax(q.k) over the words",
        mlp="dense",
        cache_bytes_per_token=4 * 2 * 2 * 128 * 2,  # layers x (k, v) x heads x D x bfloat16
    )
    assert layer_anatomy(cfg, 0).window == 4096 and layer_anatomy(cfg, 1).window is None


def test_rotary_variants_and_qk_norm_and_parallel_blocks():
    scaling = RopeScaling("llama3", factor=8.0, original_max_positions=8192)
    cfg = decoder(position="rotary", rope_base=500000.0, rope_dims=32, rope_scaling=scaling,
                  block={"qk_norm": "head", "parallel": True})  # fmt: skip
    a = anatomy(cfg)
    assert a.position == "rotary (base 500000), 32 of 128 dims turn, llama3 x8 past 8192 tokens"
    assert a.norm == "pre-norm LayerNorm, attention and MLP in parallel"
    assert a.scores == "q.k / sqrt(128), QK-norm (per head)"
    # sliding layers with their own unscaled base (Gemma 3): no scaling told for those
    local = replace(cfg, local_rope_base=10000.0, layer_types=("sliding", "full") * 2,
                    block=replace(cfg.block, window=512))  # fmt: skip
    assert layer_anatomy(local, 0).rope_base == 10000.0
    assert layer_anatomy(local, 0).rope_scaling is None
    assert layer_anatomy(local, 1).rope_scaling == "llama3 x8 past 8192 tokens"
    assert anatomy(local).position.endswith(", sliding layers base 10000")


def test_an_undivided_score_norms_only_on_outputs_and_an_encoder_window():
    cfg = decoder(block={"attn_scale": 1.0, "norm": "rmsnorm", "norm_position": "none",
                         "sublayer_norm": True, "qk_norm": "full"})  # fmt: skip
    a = anatomy(cfg)
    assert a.scores == "q.k (not divided), QK-norm (all heads)"
    assert a.norm == "RMSNorm on sub-layer outputs only"
    encoder = EncoderConfig(vocab_size=10, num_layers=2, embed_norm=True,
                            block=BlockConfig(width=64, num_heads=2, window=65,
                                              norm_position="post"))  # fmt: skip
    e = anatomy(encoder)
    assert (e.shape, e.window, e.norm) == ("encoder", "+-64 tokens", "post-norm LayerNorm, "
                                           "embeddings too")  # fmt: skip
    assert not layer_anatomy(encoder).causal and layer_anatomy(cfg).causal


def test_an_encoder_decoder_and_its_cross_attention():
    cfg = EncoderDecoderConfig(vocab_size=10, encoder_layers=1, decoder_layers=1,
                               block=BlockConfig(width=64, num_heads=4))  # fmt: skip
    assert anatomy(cfg).shape == "encoder-decoder"
    assert anatomy(cfg).position == "sinusoidal"
    cross = layer_anatomy(cfg, 0, cross=True)
    assert cross.position == "cross" and not cross.causal and cross.window is None


def test_every_model_type_of_every_family_is_listed_and_described():
    found = family_models()
    assert [m.model_type for m in found] == [t for f in FAMILIES for t in f.model_types]
    for model in found:
        assert model.anatomy is not None, f"{model.model_type}: {model.problem}"
    gpt2 = next(m for m in found if m.model_type == "gpt2")
    assert gpt2.anatomy == Anatomy("decoder", "learned (1024 positions)", "pre-norm LayerNorm",
                                   "none", "q.k / sqrt(64)", "softmax(q.k) over the words",
                                   "dense", 12 * 2 * 12 * 64 * 2)  # fmt: skip
    bert = next(m for m in found if m.model_type == "bert")
    assert bert.anatomy.shape == "encoder" and bert.anatomy.norm.startswith("post-norm")
    llama = next(m for m in found if m.model_type == "llama")
    assert llama.anatomy.position.startswith("rotary") and "RMSNorm" in llama.anatomy.norm
    described = {m.model_type: m.anatomy for m in found}
    assert described["mistral"].window == "the last 4096 tokens"  # MistralConfig(): 7B's
    assert described["llama"].window == "none" and "bias" not in described["llama"].scores
    assert described["t5"].position == "relative bias (32 buckets, max distance 128)"
    assert described["t5"].scores == "q.k (not divided), + distance bias"
    assert [t for t, a in described.items() if "distance bias" in a.scores] == ["t5"]
    # a type a family knows only to refuse (multimodal Gemma 3) is not listed as read
    assert "gemma3" not in described and "gemma3_text" in described
    # the late-2026 families, each by what it does beyond softmax(q.k): transformers' defaults
    assert described["gpt_oss"].attention.startswith("a learned sink per head")
    assert described["gpt_oss"].mlp == "128 experts, top 4 by softmax"
    assert described["llama4_text"].attention.startswith("chunks of 8192 tokens in 36 of 48")
    assert described["deepseek_v3"].cache_bytes_per_token == 61 * (512 + 64) * 2  # bfloat16
    assert "+ 1 shared in 58 of 61 layers" in described["deepseek_v3"].mlp
    assert "a 256-number input of its own" in described["gemma4_text"].attention
    assert described["ministral3"].attention == "a temperature growing with the position"


def test_a_family_whose_default_config_is_refused_is_listed_with_the_reason():
    gpt2 = next(f for f in FAMILIES if f.name == "gpt2")

    def refuse(hf):
        raise ValueError("GPT-2 checkpoints with n_layer=12 are not supported")

    [model] = family_models([replace(gpt2, config=refuse)])
    assert model.anatomy is None and "n_layer=12" in model.problem
    [unknown] = family_models([replace(gpt2, model_types=("no-such-type",))])
    assert unknown.problem == "transformers has no config of this type"


@pytest.fixture(scope="module")
def listing():
    result = CliRunner().invoke(app, ["models"])
    assert result.exit_code == 0, result.output
    return result.output.splitlines()


def test_qkv_models_prints_one_aligned_row_per_model_type(listing):
    header, *rows = listing
    assert header.split()[:3] == ["model", "type", "family"]
    assert [row.split()[0] for row in rows] == [t for f in FAMILIES for t in f.model_types]
    column = header.index("scores")
    assert all(row[column:].startswith("q.k") for row in rows)
    gpt2 = next(row for row in rows if row.startswith("gpt2"))
    assert "learned (1024 positions)" in gpt2 and "pre-norm LayerNorm" in gpt2


def test_qkv_models_json_is_one_object_per_model_type():
    result = CliRunner().invoke(app, ["models", "--json"])
    assert result.exit_code == 0
    lines = [json.loads(line) for line in result.output.splitlines()]
    assert {line["model_type"] for line in lines} == {t for f in FAMILIES for t in f.model_types}
    assert all(line["anatomy"]["scores"] for line in lines)


def test_a_relative_position_bias_is_found_by_its_position():
    # every config carries T5's relative_buckets and relative_max_distance (with defaults):
    # only position="relative" reads them, so only it adds a bias to the scores
    cfg = decoder(position="relative", relative_buckets=16, relative_max_distance=64,
                  block={"attn_scale": 1.0})  # fmt: skip
    a = anatomy(cfg)
    assert a.position == "relative bias (16 buckets, max distance 64)"
    assert a.scores == "q.k (not divided), + distance bias"
    assert layer_anatomy(cfg).relative_bias
    for position in ("learned", "sinusoidal", "rotary", "none"):
        plain = replace(cfg, position=position)
        assert plain.relative_buckets == 16 and not layer_anatomy(plain).relative_bias
        assert "bias" not in anatomy(plain).position + anatomy(plain).scores
    pair = EncoderDecoderConfig(
        vocab_size=10,
        encoder_layers=1,
        decoder_layers=1,
        position="relative",
        block=BlockConfig(width=64, num_heads=4),
    )
    assert layer_anatomy(pair).relative_bias  # the decoder's self-attention has it
    assert not layer_anatomy(pair, cross=True).relative_bias  # T5's cross-attention has none


def test_the_late_2026_departures_in_words_and_the_latent_caches_bytes():
    from qkv.nn.experts import Experts
    from qkv.nn.latent import LatentConfig
    from qkv.nn.position import Temperature
    from qkv.nn.routing import Routing

    moe = Experts(Routing(8, 2, score="sigmoid", groups=4, groups_chosen=2), hidden=16,
                  shared_hidden=32)  # fmt: skip
    cfg = decoder(position="rotary", layer_types=("chunked", "full") * 2,
                  rope_layers=(True, False) * 2, moe_layers=(False, True, True, True),
                  dense_mlp_hidden=64,
                  block={"chunk": 8192, "sinks": True, "experts": moe,
                         "temperature": Temperature(0.1, 8192.0, 1.0),
                         "temperature_where": "nope"})  # fmt: skip
    a = anatomy(cfg)
    assert a.attention == (
        "a learned sink per head takes part of each query's weight; chunks of 8192 tokens in 2 "
        "of 4 layers; 2 of 4 layers without positions; a temperature growing with the position "
        "on layers without positions"
    )
    assert a.mlp == "8 experts, top 2 by sigmoid within 2 of 4 groups, + 1 shared in 3 of 4 layers"
    assert layer_anatomy(cfg, 0).chunk == 8192 and layer_anatomy(cfg, 1).chunk is None
    assert layer_anatomy(cfg, 0).temperature is None
    assert layer_anatomy(cfg, 1).temperature == {"strength": 0.1, "every": 8192.0, "shift": 1.0}
    assert layer_anatomy(cfg, 0).experts is None and layer_anatomy(cfg, 1).experts is not None
    latent = LatentConfig(256, 2, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                          v_head_dim=128)  # fmt: skip
    mla = anatomy(decoder(position="rotary", block={"latent": latent}))
    assert mla.cache_bytes_per_token == 4 * (512 + 64) * 2  # the compressed vectors alone
    assert mla.attention.startswith("latent keys and values (one 512-number vector per token")
