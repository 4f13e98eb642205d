"""Marian (Opus-MT): BART's post-norm encoder-decoder with fixed sinusoidal positions in
Marian's own layout (every sin, then every cos), token vectors scaled by sqrt(d_model), no
norm on the embeddings, one token matrix for both stacks and a fixed bias on the logits."""

from __future__ import annotations

from qkv.io.families.bart import ATTENTION, LOGITS_BIAS
from qkv.io.families.checks import ConfigValueError, divides, flag, whole
from qkv.io.families.common import (
    Family,
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

NORM_EPS = 1e-5  # Marian's LayerNorms: its config.json has no key for it


def config(hf: dict) -> EncoderDecoderConfig:
    """A config.json -> the qkv config of the same encoder-decoder."""
    for a, b in [("encoder_attention_heads", "decoder_attention_heads"),
                 ("encoder_ffn_dim", "decoder_ffn_dim")]:  # fmt: skip
        if whole(hf, a) != whole(hf, b):
            raise ValueError(f"Marian checkpoints with {a} != {b} are not supported")
    vocab = whole(hf, "vocab_size")
    if whole(hf, "decoder_vocab_size", vocab) != vocab:
        raise ValueError(
            "Marian checkpoints with decoder_vocab_size != vocab_size are not supported"
        )
    # transformers 5 ties no token matrix of a Marian model whose tie_word_embeddings is false
    require(
        hf,
        "Marian",
        share_encoder_decoder_embeddings=(True,),
        tie_word_embeddings=(True,),
        is_decoder=(False,),
    )
    width, heads = whole(hf, "d_model"), whole(hf, "encoder_attention_heads")
    divides(hf, "encoder_attention_heads", "d_model", heads, width)
    if width % 2:
        raise ConfigValueError("d_model", f"must be even for sinusoidal positions, got {width}")
    return EncoderDecoderConfig(
        vocab_size=vocab,
        encoder_layers=whole(hf, "encoder_layers"),
        decoder_layers=whole(hf, "decoder_layers"),
        max_positions=whole(hf, "max_position_embeddings"),
        position="sinusoidal",
        sinusoid_layout="halves",
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
    """The config.json of a Marian-shaped encoder-decoder (MarianMTModel). Its token ids
    follow Opus-MT: the last id pads and starts the decoder, id 0 ends a text.

    >>> cfg = EncoderDecoderConfig(vocab_size=50, encoder_layers=2, decoder_layers=1,
    ...     position="sinusoidal", sinusoid_layout="halves", final_norm=False,
    ...     lm_head_bias=True, block=BlockConfig(width=16, num_heads=4, mlp_hidden=32,
    ...     mlp="silu", norm_position="post"))
    >>> hf = hf_config(cfg)
    >>> hf["d_model"], hf["activation_function"], config(hf) == cfg
    (16, 'swish', True)
    """
    block = cfg.block
    fits("Marian", cfg, position="sinusoidal", sinusoid_layout="halves", type_vocab_size=0,
         embed_norm=False, has_final_norm=False, tie_embeddings=True, lm_head_bias=True,
         tie_lm_head=True, head_scale=None,
         block__norm="layernorm", block__norm_position="post", block__norm_eps=NORM_EPS,
         block__bias=True, block__qkv_bias=None, block__fused_qkv=False,
         block__sublayer_norm=False, block__attn_scale=None, block__softcap=None,
         block__window=None, block__qk_norm=None)  # fmt: skip
    one_head_size("Marian", block)
    mlp = block.mlp_hidden or 4 * block.width
    pad = cfg.vocab_size - 1
    return {
        "model_type": "marian",
        "architectures": ["MarianMTModel"],
        "vocab_size": cfg.vocab_size,
        "decoder_vocab_size": cfg.vocab_size,
        "d_model": block.width,
        "encoder_layers": cfg.encoder_layers,
        "decoder_layers": cfg.decoder_layers,
        "encoder_attention_heads": block.num_heads,
        "decoder_attention_heads": block.num_heads,
        "encoder_ffn_dim": mlp,
        "decoder_ffn_dim": mlp,
        # Opus-MT's spelling of silu
        "activation_function": "swish"
        if block.mlp == "silu"
        else hf_activation(block.mlp, "Marian"),
        "max_position_embeddings": cfg.max_positions,
        "scale_embedding": cfg.embed_scale,
        "share_encoder_decoder_embeddings": True,
        "tie_word_embeddings": True,
        "dropout": block.dropout,
        "attention_dropout": 0.0,  # qkv drops no attention weights
        "activation_dropout": 0.0,
        "pad_token_id": pad,
        "decoder_start_token_id": pad,
        "eos_token_id": 0,
        "forced_eos_token_id": 0,
        "is_encoder_decoder": True,
    }


SHARED = ("model.shared.weight", "model.encoder.embed_tokens.weight",
          "model.decoder.embed_tokens.weight")  # fmt: skip


def _stack(stack: str) -> list:
    """The templates of one stack: "encoder" or "decoder" (which cross-attends too)."""
    q, h = f"{stack}.blocks.{{}}", f"model.{stack}.layers.{{}}"
    modules = [(f"{q}.attn.{a}", f"{h}.self_attn.{b}") for a, b in ATTENTION]
    modules.append((f"{q}.attn_norm", f"{h}.self_attn_layer_norm"))
    if stack == "decoder":
        modules += [(f"{q}.cross_attn.{a}", f"{h}.encoder_attn.{b}") for a, b in ATTENTION]
        modules.append((f"{q}.cross_norm", f"{h}.encoder_attn_layer_norm"))
    modules += [(f"{q}.mlp.fc_in", f"{h}.fc1"), (f"{q}.mlp.fc_out", f"{h}.fc2"),
                (f"{q}.mlp_norm", f"{h}.final_layer_norm")]  # fmt: skip
    return with_biases(modules)


def weights(cfg: EncoderDecoderConfig) -> list[Weight]:
    # the checkpoint's lm_head.weight, if written, is the shared matrix
    shared = [("encoder.embed.tokens.weight", (*SHARED, "lm_head.weight")),
              ("decoder.lm_head.bias", "final_logits_bias", LOGITS_BIAS)]  # fmt: skip
    return (expand(shared, 0) + expand(_stack("encoder"), cfg.encoder_layers)
            + expand(_stack("decoder"), cfg.decoder_layers))  # fmt: skip


FAMILY = Family(
    "marian",
    ("marian",),
    EncoderDecoder,
    config,
    hf_config,
    weights,
    # older checkpoints store the sinusoid tables, which qkv computes (transformers 5 does
    # not save them)
    ignored=(r"model\.(en|de)coder\.embed_positions\.weight",),
    reads=(
        "vocab_size",
        "decoder_vocab_size",
        "d_model",
        "encoder_layers",
        "decoder_layers",
        "encoder_attention_heads",
        "decoder_attention_heads",
        "encoder_ffn_dim",
        "decoder_ffn_dim",
        "activation_function",
        "max_position_embeddings",
        "scale_embedding",
        "share_encoder_decoder_embeddings",
        "tie_word_embeddings",
        "is_decoder",
    ),
    inert=(
        "dropout",
        "attention_dropout",
        "activation_dropout",
        "encoder_layerdrop",
        "decoder_layerdrop",
        "init_std",
        "use_cache",
        "is_encoder_decoder",
        "pad_token_id",
        "bos_token_id",
        "eos_token_id",
        "decoder_start_token_id",
        "forced_eos_token_id",
    ),
    config_classes=("MarianConfig",),
)
