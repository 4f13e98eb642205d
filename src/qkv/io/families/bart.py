"""BART: a post-norm encoder-decoder with learned positions (offset by two rows), one token
matrix shared by the encoder, the decoder and the LM head, and a fixed bias on the logits."""

from __future__ import annotations

import torch
from torch import Tensor

from qkv.io.families.checks import divides, flag, whole
from qkv.io.families.common import (
    Family,
    Layout,
    Weight,
    activation,
    expand,
    fits,
    hf_activation,
    one_head_size,
    require,
    with_biases,
)
from qkv.models import EncoderDecoder, EncoderDecoderConfig
from qkv.nn import BlockConfig

POSITION_OFFSET = 2  # BART's learned positions start at row 2 of their table
NORM_EPS = 1e-5  # BART's LayerNorms: its config.json has no key for it


def config(hf: dict) -> EncoderDecoderConfig:
    """A config.json -> the qkv config of the same encoder-decoder."""
    for a, b in [("encoder_attention_heads", "decoder_attention_heads"),
                 ("encoder_ffn_dim", "decoder_ffn_dim")]:  # fmt: skip
        if whole(hf, a) != whole(hf, b):
            raise ValueError(f"BART checkpoints with {a} != {b} are not supported")
    # the older mBART-style keys; and qkv's LM head is always the token matrix
    require(hf, "BART", add_final_layer_norm=(False,), normalize_before=(False,))
    if not flag(hf, "tie_word_embeddings", True):
        raise ValueError("BART checkpoints with tie_word_embeddings=False are not supported")
    width, heads = whole(hf, "d_model"), whole(hf, "encoder_attention_heads")
    divides(hf, "encoder_attention_heads", "d_model", heads, width)
    return EncoderDecoderConfig(
        vocab_size=whole(hf, "vocab_size"),
        encoder_layers=whole(hf, "encoder_layers"),
        decoder_layers=whole(hf, "decoder_layers"),
        max_positions=whole(hf, "max_position_embeddings"),
        position="learned",
        embed_norm=True,
        embed_scale=flag(hf, "scale_embedding", False),
        final_norm=False,
        tie_embeddings=True,
        lm_head_bias=True,
        block=BlockConfig(
            width=width,
            num_heads=heads,
            mlp_hidden=whole(hf, "encoder_ffn_dim"),
            mlp=activation(hf, "activation_function"),
            norm_eps=NORM_EPS,
            norm_position="post",
        ),
    )


def hf_config(cfg: EncoderDecoderConfig) -> dict:
    """The config.json of a BART-shaped encoder-decoder (BartForConditionalGeneration).

    >>> cfg = EncoderDecoderConfig(vocab_size=50, encoder_layers=2, decoder_layers=1,
    ...     position="learned", embed_norm=True, embed_scale=False, final_norm=False,
    ...     lm_head_bias=True, block=BlockConfig(width=16, num_heads=4, mlp_hidden=32,
    ...     norm_position="post"))
    >>> hf = hf_config(cfg)
    >>> hf["d_model"], hf["decoder_layers"], config(hf) == cfg
    (16, 1, True)
    """
    block = cfg.block
    fits("BART", cfg, position="learned", type_vocab_size=0, embed_norm=True,
         has_final_norm=False, tie_embeddings=True, lm_head_bias=True,
         block__norm="layernorm", block__norm_position="post", block__norm_eps=NORM_EPS,
         block__bias=True, block__fused_qkv=False)  # fmt: skip
    one_head_size("BART", block)
    mlp = block.mlp_hidden or 4 * block.width
    return {
        "model_type": "bart",
        "architectures": ["BartForConditionalGeneration"],
        "vocab_size": cfg.vocab_size,
        "d_model": block.width,
        "encoder_layers": cfg.encoder_layers,
        "decoder_layers": cfg.decoder_layers,
        "encoder_attention_heads": block.num_heads,
        "decoder_attention_heads": block.num_heads,
        "encoder_ffn_dim": mlp,
        "decoder_ffn_dim": mlp,
        "activation_function": hf_activation(block.mlp, "BART"),
        "max_position_embeddings": cfg.max_positions,
        "scale_embedding": cfg.embed_scale,
        "dropout": block.dropout,
        "attention_dropout": 0.0,  # qkv drops no attention weights
        "activation_dropout": 0.0,
        "is_encoder_decoder": True,
    }


def _drop_offset(t: Tensor) -> Tensor:
    return t[POSITION_OFFSET:].contiguous()


def _add_offset(t: Tensor) -> Tensor:
    # the two rows qkv never reads are written as zeros
    return torch.cat([t.new_zeros(POSITION_OFFSET, *t.shape[1:]), t])


OFFSET = Layout(_drop_offset, _add_offset)
LOGITS_BIAS = Layout(lambda t: t.reshape(-1), lambda t: t.reshape(1, -1))  # (1, V) <-> (V,)
SHARED = ("model.shared.weight", "model.encoder.embed_tokens.weight",
          "model.decoder.embed_tokens.weight", "lm_head.weight")  # fmt: skip
ATTENTION = [("q", "q_proj"), ("k", "k_proj"), ("v", "v_proj"), ("out", "out_proj")]


def _stack(stack: str) -> list:
    """The templates of one stack: "encoder" or "decoder" (which cross-attends too)."""
    q, h = f"{stack}.blocks.{{}}", f"model.{stack}.layers.{{}}"
    modules = [(f"{q}.attn.{a}", f"{h}.self_attn.{b}") for a, b in ATTENTION]
    modules.append((f"{q}.attn_norm", f"{h}.self_attn_layer_norm"))
    if stack == "decoder":
        modules += [(f"{q}.cross_attn.{a}", f"{h}.encoder_attn.{b}") for a, b in ATTENTION]
        modules.append((f"{q}.cross_norm", f"{h}.encoder_attn_layer_norm"))
    modules += [(f"{q}.mlp.fc_in", f"{h}.fc1"), (f"{q}.mlp.fc_out", f"{h}.fc2"),
                (f"{q}.mlp_norm", f"{h}.final_layer_norm"),
                (f"{stack}.embed.norm", f"model.{stack}.layernorm_embedding")]  # fmt: skip
    positions = (f"{stack}.embed.positions.embedding.weight",
                 f"model.{stack}.embed_positions.weight", OFFSET)  # fmt: skip
    return [positions, *with_biases(modules)]


def weights(cfg: EncoderDecoderConfig) -> list[Weight]:
    shared = [("encoder.embed.tokens.weight", SHARED),
              ("decoder.lm_head.bias", "final_logits_bias", LOGITS_BIAS)]  # fmt: skip
    return (expand(shared, 0) + expand(_stack("encoder"), cfg.encoder_layers)
            + expand(_stack("decoder"), cfg.decoder_layers))  # fmt: skip


FAMILY = Family(
    "bart", ("bart",), EncoderDecoder, config, hf_config, weights,
    reads=("vocab_size", "d_model", "encoder_layers", "decoder_layers",
           "encoder_attention_heads", "decoder_attention_heads", "encoder_ffn_dim",
           "decoder_ffn_dim", "activation_function", "max_position_embeddings",
           "scale_embedding", "add_final_layer_norm", "normalize_before", "tie_word_embeddings"),
    # dropout, layer drop and init are training settings; is_decoder is BartForCausalLM's
    # (qkv reads BartForConditionalGeneration); token ids steer generation, not the logits
    inert=("dropout", "attention_dropout", "activation_dropout", "encoder_layerdrop",
           "decoder_layerdrop", "init_std", "classifier_dropout", "use_cache", "is_decoder",
           "pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id",
           "forced_eos_token_id"),
    config_classes=("BartConfig",),
)  # fmt: skip
