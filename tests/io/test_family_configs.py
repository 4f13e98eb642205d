"""Each family's config.json both ways: a qkv config written as the family's config.json
reads back equal, and a qkv config the family cannot hold is refused by name."""

from __future__ import annotations

import re
from dataclasses import replace

import pytest

from qkv.io.families import FAMILIES, family_for, family_named
from qkv.models import DecoderConfig, EncoderConfig, EncoderDecoderConfig
from qkv.nn import BlockConfig
from tiny_models import TINY

FAMILY = {f.name: f for f in FAMILIES}

BERT = EncoderConfig(
    vocab_size=50, num_layers=2, max_positions=20, position="learned", type_vocab_size=2,
    embed_norm=True, final_norm=False,
    block=BlockConfig(width=16, num_heads=4, mlp_hidden=24, mlp="gelu", norm_eps=1e-12,
                      norm_position="post"),
)  # fmt: skip
GPT2 = DecoderConfig(
    vocab_size=50, num_layers=2, max_positions=20, position="learned",
    block=BlockConfig(width=16, num_heads=4, mlp_hidden=24, mlp="gelu_tanh", norm_eps=1e-5,
                      fused_qkv=True),
)  # fmt: skip
LLAMA = DecoderConfig(
    vocab_size=50, num_layers=2, max_positions=64, position="rotary", rope_base=500.0,
    tie_embeddings=False,
    block=BlockConfig(width=16, num_heads=4, num_kv_heads=2, head_dim=4, mlp_hidden=24,
                      mlp="swiglu", norm="rmsnorm", norm_eps=1e-6, bias=False),
)  # fmt: skip
BART = EncoderDecoderConfig(
    vocab_size=50, encoder_layers=2, decoder_layers=1, max_positions=20, position="learned",
    embed_norm=True, embed_scale=True, final_norm=False, tie_embeddings=True,
    lm_head_bias=True,
    block=BlockConfig(width=16, num_heads=4, mlp_hidden=24, mlp="gelu", norm_position="post"),
)  # fmt: skip
MODERNBERT = EncoderConfig(
    vocab_size=50, num_layers=3, max_positions=64, position="rotary", rope_base=500.0,
    local_rope_base=50.0, layer_types=("full", "sliding", "sliding"), embed_norm=True,
    final_norm=True, first_attn_norm=False,
    block=BlockConfig(width=16, num_heads=4, mlp_hidden=24, mlp="geglu", fused_mlp=True,
                      fused_qkv=True, norm_bias=False, bias=False, window=5),
)  # fmt: skip
PHI3 = DecoderConfig(
    vocab_size=50, num_layers=2, max_positions=64, position="rotary", rope_dims=6,
    tie_embeddings=False,
    block=BlockConfig(width=32, num_heads=4, num_kv_heads=2, head_dim=8, mlp_hidden=24,
                      mlp="swiglu", fused_mlp=True, fused_qkv=True, norm="rmsnorm",
                      bias=False, window=16),
)  # fmt: skip
OLMO2 = DecoderConfig(
    vocab_size=50, num_layers=2, max_positions=64, position="rotary", final_norm=True,
    tie_embeddings=False,
    block=BlockConfig(width=16, num_heads=4, num_kv_heads=2, head_dim=4, mlp_hidden=24,
                      mlp="swiglu", norm="rmsnorm", norm_position="none", sublayer_norm=True,
                      qk_norm="full", bias=False),
)  # fmt: skip
NEOX = DecoderConfig(
    vocab_size=50, num_layers=2, max_positions=64, position="rotary", rope_dims=2,
    tie_embeddings=False,
    block=BlockConfig(width=16, num_heads=4, mlp_hidden=24, parallel=True, fused_qkv=True),
)  # fmt: skip


def _tiny_gemma(name: str) -> dict:
    from test_family_gemma import TINY

    return TINY[name][1].to_dict()


def _tiny_olmo3_ministral(name: str) -> dict:
    from test_family_olmo3_ministral3 import TINY

    return TINY[name][1].to_dict()


def _tiny_moe(name: str) -> dict:
    from test_family_moe import TINY

    return TINY[name][1].to_dict()


def _tiny_gemma4(name: str) -> dict:
    from test_family_gemma4 import TINY

    return TINY[name].to_dict()


def _tiny_gpt_oss(name: str) -> dict:
    from test_family_gpt_oss import CASES

    return CASES[name].to_dict()


def _tiny_deepseek() -> list[dict]:
    from test_family_deepseek import CASES
    from transformers import DeepseekV3Config

    return [DeepseekV3Config(**case).to_dict() for case in CASES.values()]


def _tiny_deepseek_v4() -> list[dict]:
    from test_family_deepseek_v4 import CASES
    from transformers import DeepseekV4Config

    return [DeepseekV4Config(**case).to_dict() for case in CASES.values()]


def _tiny_qwen3_5(name: str) -> dict:
    from test_family_qwen3_5 import CASES

    config_class, _, settings = CASES[name]
    return config_class(**settings).to_dict()


def _tiny_kimi_linear() -> list[dict]:
    from test_family_kimi_linear import CASES
    from transformers import KimiLinearConfig

    return [KimiLinearConfig(**case).to_dict() for case in CASES.values()]


ROUND_TRIPS = {
    "bert": [BERT, replace(BERT, mlm_head=True)],
    "gpt2": [GPT2, replace(GPT2, tie_embeddings=False)],
    "llama": [LLAMA, replace(LLAMA, block=replace(LLAMA.block, head_dim=8))],  # D != C / H
    "bart": [BART, replace(BART, embed_scale=False)],
    "roberta": [
        replace(BERT, position_padding=1),
        replace(BERT, position_padding=0, mlm_head=True),
    ],
    "xlm-roberta": [replace(BERT, position_padding=1, type_vocab_size=1)],
    "distilbert": [
        replace(BERT, type_vocab_size=0),
        replace(BERT, type_vocab_size=0, mlm_head=True),
    ],
    "modernbert": [MODERNBERT, replace(MODERNBERT, mlm_head=True)],
    "phi3": [PHI3, replace(PHI3, rope_dims=None, block=replace(PHI3.block, window=None))],
    "olmo2": [OLMO2, replace(OLMO2, tie_embeddings=True)],
    "gpt_neox": [NEOX, replace(NEOX, block=replace(NEOX.block, parallel=False))],
    # the Llama-shaped families' own round trips are in test_family_llama_like.py
    "mistral": [replace(LLAMA, block=replace(LLAMA.block, window=4))],
    "smollm3": [replace(LLAMA, rope_layers=(True, False))],
    "qwen2": [replace(LLAMA, block=replace(LLAMA.block, qkv_bias=True))],
    "qwen3": [replace(LLAMA, block=replace(LLAMA.block, qk_norm="head"))],
    # the Gemma families' configs, as transformers' own tiny ones read
    **{name: [FAMILY[name].config(_tiny_gemma(name))] for name in ("gemma", "gemma2", "gemma3")},
    # OLMo 3 and the Ministrals, as transformers' own tiny configs read
    **{
        name: [FAMILY[name].config(_tiny_olmo3_ministral(name))]
        for name in ("olmo3", "ministral", "ministral3")
    },
    # more of each in tests/io/test_family_moe.py
    **{name: [FAMILY[name].config(_tiny_moe(name))] for name in ("mixtral", "qwen3_moe")},
    "llama4": [FAMILY["llama4"].config({"model_type": "llama4_text"})],  # more in its own file
    # gpt-oss's, as its tiny models read (more in tests/io/test_family_gpt_oss.py)
    "gpt_oss": [FAMILY["gpt_oss"].config(_tiny_gpt_oss(name)) for name in ("oss", "oss-other")],
    # Gemma 4's, as its tiny models read (more in tests/io/test_family_gemma4.py)
    "gemma4": [FAMILY["gemma4"].config(_tiny_gemma4(name)) for name in ("plain", "all")],
    # DeepSeek-V3's, as its tiny checkpoints' configs read (more in test_family_deepseek.py)
    "deepseek_v3": [FAMILY["deepseek_v3"].config(hf) for hf in _tiny_deepseek()],
    # DeepSeek-V4's, as its tiny checkpoints' configs read (more in test_family_deepseek_v4.py)
    "deepseek_v4": [FAMILY["deepseek_v4"].config(hf) for hf in _tiny_deepseek_v4()],
    # Qwen3.5's and Qwen3-Next's, as their tiny checkpoints' read (test_family_qwen3_5.py)
    **{
        name: [FAMILY[name].config(_tiny_qwen3_5(name))]
        for name in ("qwen3_5", "qwen3_5_moe", "qwen3_next")
    },
    # Kimi Linear's, as its tiny checkpoints' configs read (more in test_family_kimi_linear.py)
    "kimi_linear": [FAMILY["kimi_linear"].config(hf) for hf in _tiny_kimi_linear()],
    # more of each in tests/io/test_family_seq2seq.py
    "marian": [replace(BART, position="sinusoidal", sinusoid_layout="halves", embed_norm=False)],
    "t5": [
        EncoderDecoderConfig(
            vocab_size=50,
            encoder_layers=2,
            decoder_layers=1,
            position="relative",
            embed_scale=False,
            tie_lm_head=False,
            block=BlockConfig(
                width=16,
                num_heads=4,
                head_dim=8,
                mlp_hidden=24,
                mlp="geglu_tanh",
                norm="rmsnorm",
                norm_eps=1e-6,
                bias=False,
                attn_scale=1.0,
            ),
        )
    ],
}


@pytest.mark.parametrize("name, config", [(n, c) for n, cs in ROUND_TRIPS.items() for c in cs])
def test_a_qkv_config_written_as_config_json_reads_back_equal(name, config):
    family = FAMILY[name]
    hf = family.hf_config(config)
    assert family_for(hf) is family
    assert family.config(hf) == config


@pytest.mark.parametrize("name", ["bert", "gpt2", "llama", "llama-tied", "bart"])
def test_a_transformers_config_json_round_trips_through_qkv(name):
    """transformers' own config.json -> qkv -> config.json -> qkv: the same model."""
    hf = TINY[name][1].to_dict()
    family = family_for(hf)
    config = family.config(hf)
    assert family.config(family.hf_config(config)) == config


def test_every_family_is_tested_both_ways():
    assert set(ROUND_TRIPS) == set(FAMILY)
    assert family_named("llama") is FAMILY["llama"]
    with pytest.raises(ValueError, match="unknown model family 'xlnet'; known: bert, gpt2"):
        family_named("xlnet")


REFUSED = [
    ("bert", replace(BERT, block=replace(BERT.block, norm_position="pre")),
     r"a BERT config.json cannot hold this model: block.norm_position='pre' \(it has 'post'\)"),
    ("bert", replace(BERT, type_vocab_size=0), "cannot hold type_vocab_size=0"),
    ("gpt2", replace(GPT2, position="rotary"),
     r"a GPT-2 config.json cannot hold this model: position='rotary' \(it has 'learned'\)"),
    ("gpt2", replace(GPT2, block=replace(GPT2.block, mlp="swiglu")),
     "a GPT-2 config.json cannot hold mlp='swiglu'; it holds gelu, gelu_tanh, relu, silu"),
    ("gpt2", replace(GPT2, block=replace(GPT2.block, num_kv_heads=2)),
     r"GPT-2 config.json cannot hold head_dim=4 with num_kv_heads=2: its heads are width"),
    ("llama", replace(LLAMA, block=replace(LLAMA.block, window=4, norm="layernorm")),
     r"block.norm='layernorm' \(it has 'rmsnorm'\), block.window=4 \(it has None\)"),
    ("bart", replace(BART, block=replace(BART.block, norm_eps=1e-6)),
     r"a BART config.json cannot hold this model: block.norm_eps=1e-06 \(it has 1e-05\)"),
    ("bart", replace(BART, tie_embeddings=False, lm_head_bias=False),
     r"tie_embeddings=False \(it has True\), lm_head_bias=False \(it has True\)"),
]  # fmt: skip


@pytest.mark.parametrize("name, config, message", REFUSED)
def test_a_config_the_family_cannot_hold_is_refused_by_name(name, config, message):
    with pytest.raises(ValueError, match=message) as error:
        FAMILY[name].hf_config(config)
    assert "\n" not in str(error.value)


WIDTH_KEYS = {"bert": "hidden_size", "gpt2": "n_embd", "llama": "hidden_size", "bart": "d_model"}


@pytest.mark.parametrize("name", list(WIDTH_KEYS))
@pytest.mark.parametrize("value", ["32", 32.5, None, [32], True, 0])
def test_every_family_refuses_a_width_that_is_not_a_whole_number_by_its_key(name, value):
    """Each family reads its config.json through the one check (qkv.io.families.checks)."""
    key = WIDTH_KEYS[name]
    hf = TINY[name][1].to_dict() | {key: value}
    says = re.escape(f"{key} must be a whole number >= 1, got {value!r}")
    with pytest.raises(ValueError, match=says):
        family_for(hf).config(hf)
