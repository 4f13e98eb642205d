"""DistilBERT: BERT distilled to half its layers, with no segment embeddings, in a
config.json and weight names of its own (dim, n_layers, q_lin, sa_layer_norm, ffn.lin1).

Its norms' epsilon is fixed at 1e-12 in transformers, whatever the config says; its masked-LM
head is BERT's (vocab_transform, activation, vocab_layer_norm, vocab_projector). Exported
sinusoidal positions are written as the learned table they are stored as.
"""

from __future__ import annotations

from dataclasses import replace

from qkv.io.families.checks import divides, flag, whole
from qkv.io.families.common import (
    Family,
    Weight,
    activation,
    expand,
    hf_activation,
    with_biases,
)
from qkv.io.families.roberta import bert_shaped
from qkv.models import Encoder, EncoderConfig
from qkv.nn import BlockConfig

MLM = "DistilBertForMaskedLM"
NORM_EPS = 1e-12  # transformers builds every DistilBERT LayerNorm with it


def config(hf: dict) -> EncoderConfig:
    """A config.json -> the qkv config of the same encoder."""
    # a sinusoidal table is made at init but stored in the checkpoint, and transformers
    # reads it from there: qkv reads it too, as learned positions, the same numbers
    flag(hf, "sinusoidal_pos_embds", False)
    mlm_head = MLM in (hf.get("architectures") or ())
    # an untied head is refused where there is one; the kind is refused everywhere
    if not flag(hf, "tie_word_embeddings", True) and mlm_head:
        raise ValueError(f"{MLM} checkpoints with tie_word_embeddings=False are not supported")
    width, heads = whole(hf, "dim", 768), whole(hf, "n_heads", 12)
    divides(hf, "n_heads", "dim", heads, width)
    return EncoderConfig(
        vocab_size=whole(hf, "vocab_size"),
        num_layers=whole(hf, "n_layers", 6),
        max_positions=whole(hf, "max_position_embeddings", 512),
        position="learned",
        embed_norm=True,
        final_norm=False,
        mlm_head=mlm_head,
        block=BlockConfig(
            width=width,
            num_heads=heads,
            mlp_hidden=whole(hf, "hidden_dim", 4 * width),
            mlp=activation(hf, "activation"),
            norm_eps=NORM_EPS,
            norm_position="post",
        ),
    )


def hf_config(cfg: EncoderConfig) -> dict:
    """The config.json that `transformers` (and `config`) read `cfg` back from:
    DistilBertForMaskedLM with the MLM head, DistilBertModel without.

    >>> cfg = EncoderConfig(vocab_size=50, num_layers=2, embed_norm=True, final_norm=False,
    ...     block=BlockConfig(width=16, num_heads=4, mlp_hidden=64, norm_eps=1e-12,
    ...                       norm_position="post"))
    >>> hf = hf_config(cfg)
    >>> hf["architectures"], hf["hidden_dim"], config(hf) == cfg
    (['DistilBertModel'], 64, True)
    """
    block = cfg.block
    bert_shaped("DistilBERT", cfg)
    if cfg.type_vocab_size or cfg.position_padding is not None:
        raise ValueError("a DistilBERT config.json cannot hold segments or padded positions")
    if block.norm_eps != NORM_EPS:
        raise ValueError(f"a DistilBERT config.json cannot hold norm_eps={block.norm_eps}: "
                         f"its norms' epsilon is {NORM_EPS}")  # fmt: skip
    return {
        "architectures": [MLM if cfg.mlm_head else "DistilBertModel"],
        "model_type": "distilbert",
        "vocab_size": cfg.vocab_size,
        "dim": block.width,
        "n_layers": cfg.num_layers,
        "n_heads": block.num_heads,
        "hidden_dim": block.mlp_hidden or 4 * block.width,
        "activation": hf_activation(block.mlp, "DistilBERT", gelu_tanh="gelu_new"),
        "max_position_embeddings": cfg.max_positions,
        "sinusoidal_pos_embds": False,
        "dropout": block.dropout,
        "attention_dropout": 0.0,  # qkv drops no attention weights
        "tie_word_embeddings": True,
    }


BODY = [
    ("embed.tokens.weight", "embeddings.word_embeddings.weight"),
    ("embed.positions.embedding.weight", "embeddings.position_embeddings.weight"),
    *with_biases([
        ("embed.norm", "embeddings.LayerNorm"),
        ("blocks.{}.attn.q", "transformer.layer.{}.attention.q_lin"),
        ("blocks.{}.attn.k", "transformer.layer.{}.attention.k_lin"),
        ("blocks.{}.attn.v", "transformer.layer.{}.attention.v_lin"),
        ("blocks.{}.attn.out", "transformer.layer.{}.attention.out_lin"),
        ("blocks.{}.attn_norm", "transformer.layer.{}.sa_layer_norm"),
        ("blocks.{}.mlp.fc_in", "transformer.layer.{}.ffn.lin1"),
        ("blocks.{}.mlp.fc_out", "transformer.layer.{}.ffn.lin2"),
        ("blocks.{}.mlp_norm", "transformer.layer.{}.output_layer_norm"),
    ]),
]  # fmt: skip
MLM_HEAD = [
    *with_biases([("mlm.dense", "vocab_transform"), ("mlm.norm", "vocab_layer_norm")]),
    ("mlm.decoder.bias", "vocab_projector.bias"),
]


def weights(cfg: EncoderConfig) -> list[Weight]:
    prefixes = ("distilbert.", "") if cfg.mlm_head else ("", "distilbert.")
    body = expand(BODY, cfg.num_layers, prefixes=prefixes)
    if not cfg.mlm_head:
        return body
    tokens = body[0]  # the projector's matrix is the token matrix, written once
    body[0] = replace(tokens, names=(*tokens.names, "vocab_projector.weight"))
    return body + expand(MLM_HEAD, 0)


FAMILY = Family(
    "distilbert", ("distilbert",), Encoder, config, hf_config, weights,
    ignored=(r"(distilbert\.)?embeddings\.position_ids",
             r"vocab_(transform|layer_norm|projector)\..*"),
    reads=("vocab_size", "dim", "n_layers", "n_heads", "hidden_dim", "activation",
           "max_position_embeddings", "sinusoidal_pos_embds", "tie_word_embeddings"),
    inert=("dropout", "attention_dropout", "qa_dropout", "seq_classif_dropout",
           "initializer_range", "pad_token_id", "bos_token_id", "eos_token_id"),
    config_classes=("DistilBertConfig",),
)  # fmt: skip
