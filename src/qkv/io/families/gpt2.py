"""GPT-2: a pre-norm decoder with learned positions and one fused query-key-value matrix,
stored by its Conv1D layers transposed."""

from __future__ import annotations

from qkv.io.families.checks import divides, flag, real, whole
from qkv.io.families.common import (
    TRANSPOSED,
    Family,
    Weight,
    activation,
    decoder_weights,
    fits,
    hf_activation,
    one_head_size,
    require,
    with_biases,
)
from qkv.models import Decoder, DecoderConfig
from qkv.nn import BlockConfig


def config(hf: dict) -> DecoderConfig:
    """A config.json -> the qkv config of the same decoder."""
    require(hf, "GPT-2", scale_attn_by_inverse_layer_idx=(False,),
            reorder_and_upcast_attn=(False,), add_cross_attention=(False,))  # fmt: skip
    width, heads = whole(hf, "n_embd"), whole(hf, "n_head")
    divides(hf, "n_head", "n_embd", heads, width)
    return DecoderConfig(
        vocab_size=whole(hf, "vocab_size"),
        num_layers=whole(hf, "n_layer"),
        max_positions=whole(hf, "n_positions"),
        position="learned",
        tie_embeddings=flag(hf, "tie_word_embeddings", True),
        block=BlockConfig(
            width=width,
            num_heads=heads,
            mlp_hidden=whole(hf, "n_inner", None) or 4 * width,
            mlp=activation(hf, "activation_function"),
            norm_eps=real(hf, "layer_norm_epsilon", 1e-5),
            fused_qkv=True,
            # scale_attn_weights false: GPT-2 then does not divide its scores at all
            attn_scale=None if flag(hf, "scale_attn_weights", True) else 1.0,
        ),
    )


def hf_config(cfg: DecoderConfig) -> dict:
    """The config.json of a GPT-2-shaped decoder (GPT2LMHeadModel).

    >>> cfg = DecoderConfig(vocab_size=50, num_layers=2, block=BlockConfig(width=16,
    ...     num_heads=4, mlp_hidden=64, mlp="gelu_tanh", fused_qkv=True))
    >>> hf = hf_config(cfg)
    >>> hf["n_embd"], hf["activation_function"], config(hf) == cfg
    (16, 'gelu_new', True)
    """
    block = cfg.block
    fits("GPT-2", cfg, position="learned", type_vocab_size=0, embed_norm=False,
         embed_scale=False, has_final_norm=True, lm_head_bias=False, cross_attention=False,
         block__norm="layernorm", block__norm_position="pre", block__bias=True,
         block__fused_qkv=True)  # fmt: skip
    one_head_size("GPT-2", block)
    if block.attn_scale not in (None, 1.0):
        raise ValueError(
            f"a GPT-2 config.json cannot hold attn_scale={block.attn_scale!r}: its scores are "
            "divided by sqrt(head size) or not at all (scale_attn_weights)"
        )
    return {
        "model_type": "gpt2",
        "architectures": ["GPT2LMHeadModel"],
        "vocab_size": cfg.vocab_size,
        "n_layer": cfg.num_layers,
        "n_head": block.num_heads,
        "n_embd": block.width,
        "n_inner": block.mlp_hidden or 4 * block.width,
        "n_positions": cfg.max_positions,
        "activation_function": hf_activation(block.mlp, "GPT-2", gelu_tanh="gelu_new"),
        "layer_norm_epsilon": block.norm_eps,
        "tie_word_embeddings": cfg.tie_embeddings,
        "scale_attn_weights": block.attn_scale is None,
        "resid_pdrop": block.dropout,
        "embd_pdrop": block.dropout,
        "attn_pdrop": 0.0,  # qkv drops no attention weights
    }


TEMPLATES = [
    ("embed.tokens.weight", "wte.weight"),
    ("embed.positions.embedding.weight", "wpe.weight"),
    *with_biases([("norm", "ln_f"), ("blocks.{}.attn_norm", "h.{}.ln_1"),
                  ("blocks.{}.mlp_norm", "h.{}.ln_2")]),
    *with_biases([("blocks.{}.attn.qkv", "h.{}.attn.c_attn"),
                  ("blocks.{}.attn.out", "h.{}.attn.c_proj"),
                  ("blocks.{}.mlp.fc_in", "h.{}.mlp.c_fc"),
                  ("blocks.{}.mlp.fc_out", "h.{}.mlp.c_proj")], TRANSPOSED),
]  # fmt: skip


def weights(cfg: DecoderConfig) -> list[Weight]:
    # GPT2LMHeadModel's names start with "transformer."; GPT2Model's do not
    return decoder_weights(TEMPLATES, cfg, prefixes=("transformer.", ""))


FAMILY = Family(
    "gpt2", ("gpt2",), Decoder, config, hf_config, weights,
    ignored=(r"(transformer\.)?h\.\d+\.attn\.(masked_)?bias",),
    reads=("vocab_size", "n_positions", "n_embd", "n_layer", "n_head", "n_inner",
           "activation_function", "layer_norm_epsilon", "scale_attn_weights",
           "scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn", "add_cross_attention",
           "tie_word_embeddings"),
    # dropout and init are training settings; summary_* configure GPT2DoubleHeadsModel's
    # classification head, which qkv does not build; use_cache and token ids change no logits
    inert=("resid_pdrop", "embd_pdrop", "attn_pdrop", "initializer_range", "summary_type",
           "summary_use_proj", "summary_activation", "summary_proj_to_labels",
           "summary_first_dropout", "use_cache", "bos_token_id", "eos_token_id",
           "pad_token_id"),
    config_classes=("GPT2Config",),
)  # fmt: skip
