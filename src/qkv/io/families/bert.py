"""BERT (and sentence-transformers' BERT folders such as all-MiniLM-L6-v2): a post-norm
encoder with learned positions and segment embeddings, with or without the masked-LM head."""

from __future__ import annotations

from dataclasses import replace

from qkv.io.families.checks import divides, flag, real, whole
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
from qkv.models import Encoder, EncoderConfig
from qkv.nn import BlockConfig

MLM = "BertForMaskedLM"  # the architecture whose checkpoints carry the MLM head


def config(hf: dict) -> EncoderConfig:
    """A config.json -> the qkv config of the same encoder."""
    # is_decoder makes BERT causal; add_cross_attention gives it layers qkv's encoder lacks
    require(hf, "BERT", position_embedding_type=("absolute",), is_decoder=(False,),
            add_cross_attention=(False,))  # fmt: skip
    mlm_head = MLM in (hf.get("architectures") or ())
    tied = flag(hf, "tie_word_embeddings", True)
    if mlm_head and not tied:  # qkv's head always decodes with the token matrix
        raise ValueError(f"{MLM} checkpoints with tie_word_embeddings=False are not supported")
    width, heads = whole(hf, "hidden_size"), whole(hf, "num_attention_heads")
    divides(hf, "num_attention_heads", "hidden_size", heads, width)
    return EncoderConfig(
        vocab_size=whole(hf, "vocab_size"),
        num_layers=whole(hf, "num_hidden_layers"),
        max_positions=whole(hf, "max_position_embeddings"),
        position="learned",
        type_vocab_size=whole(hf, "type_vocab_size", 2, minimum=0),
        embed_norm=True,
        final_norm=False,
        mlm_head=mlm_head,
        block=BlockConfig(
            width=width,
            num_heads=heads,
            mlp_hidden=whole(hf, "intermediate_size"),
            mlp=activation(hf, "hidden_act"),
            norm_eps=real(hf, "layer_norm_eps", 1e-12),
            norm_position="post",
        ),
    )


def hf_config(cfg: EncoderConfig) -> dict:
    """The config.json that `transformers` (and `config`) read `cfg` back from:
    BertForMaskedLM for an encoder with the MLM head, BertModel without.

    >>> cfg = EncoderConfig(vocab_size=50, num_layers=2, type_vocab_size=2, embed_norm=True,
    ...     mlm_head=True, block=BlockConfig(width=16, num_heads=4, norm_position="post"))
    >>> hf = hf_config(cfg)
    >>> hf["architectures"], hf["intermediate_size"], config(hf).mlm_head
    (['BertForMaskedLM'], 64, True)
    """
    block = cfg.block
    fits("BERT", cfg, position="learned", embed_norm=True, embed_scale=False,
         has_final_norm=False, block__norm="layernorm", block__norm_position="post",
         block__bias=True, block__fused_qkv=False)  # fmt: skip
    one_head_size("BERT", block)
    if cfg.type_vocab_size < 1:
        raise ValueError("a BERT config.json cannot hold type_vocab_size=0: BERT has segments")
    return {
        "architectures": [MLM if cfg.mlm_head else "BertModel"],
        "model_type": "bert",
        "vocab_size": cfg.vocab_size,
        "hidden_size": block.width,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": block.num_heads,
        "intermediate_size": block.mlp_hidden or 4 * block.width,
        "hidden_act": hf_activation(block.mlp, "BERT"),
        "max_position_embeddings": cfg.max_positions,
        "type_vocab_size": cfg.type_vocab_size,
        "layer_norm_eps": block.norm_eps,
        "position_embedding_type": "absolute",
        "hidden_dropout_prob": block.dropout,
        "attention_probs_dropout_prob": 0.0,  # qkv drops no attention weights
        "tie_word_embeddings": True,
    }


BODY = [
    ("embed.tokens.weight", "embeddings.word_embeddings.weight"),
    ("embed.positions.embedding.weight", "embeddings.position_embeddings.weight"),
    ("embed.types.weight", "embeddings.token_type_embeddings.weight"),
    *with_biases([("embed.norm", "embeddings.LayerNorm")]),
    *with_biases([
        ("blocks.{}.attn.q", "encoder.layer.{}.attention.self.query"),
        ("blocks.{}.attn.k", "encoder.layer.{}.attention.self.key"),
        ("blocks.{}.attn.v", "encoder.layer.{}.attention.self.value"),
        ("blocks.{}.attn.out", "encoder.layer.{}.attention.output.dense"),
        ("blocks.{}.attn_norm", "encoder.layer.{}.attention.output.LayerNorm"),
        ("blocks.{}.mlp.fc_in", "encoder.layer.{}.intermediate.dense"),
        ("blocks.{}.mlp.fc_out", "encoder.layer.{}.output.dense"),
        ("blocks.{}.mlp_norm", "encoder.layer.{}.output.LayerNorm"),
    ]),
]  # fmt: skip
MLM_HEAD = [
    *with_biases([("mlm.dense", "cls.predictions.transform.dense"),
                  ("mlm.norm", "cls.predictions.transform.LayerNorm")]),
    ("mlm.decoder.bias", ("cls.predictions.bias", "cls.predictions.decoder.bias")),
]  # fmt: skip


def weights(cfg: EncoderConfig) -> list[Weight]:
    # sentence-transformers folders drop the "bert." prefix that BertForX checkpoints have;
    # with the MLM head qkv writes the prefix, as BertForMaskedLM does
    prefixes = ("bert.", "") if cfg.mlm_head else ("", "bert.")
    body = expand(BODY, cfg.num_layers, prefixes=prefixes)
    if not cfg.mlm_head:
        return body
    # the head's decoder matrix is the token matrix, which transformers 5 writes once, under
    # the embeddings' name (older checkpoints repeat it, outside the "bert." prefix)
    tokens = body[0]
    body[0] = replace(tokens, names=(*tokens.names, "cls.predictions.decoder.weight"))
    return body + expand(MLM_HEAD, 0)


FAMILY = Family(
    "bert", ("bert",), Encoder, config, hf_config, weights,
    ignored=(r"(bert\.)?pooler\..*", r"(bert\.)?embeddings\.position_ids", r"cls\..*"),
    reads=("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
           "intermediate_size", "hidden_act", "max_position_embeddings", "type_vocab_size",
           "layer_norm_eps", "position_embedding_type", "is_decoder", "add_cross_attention",
           "tie_word_embeddings"),
    # dropout and init are training settings; pad_token_id only marks the embedding row
    # whose gradient is zero; classifier_dropout belongs to heads qkv does not build
    inert=("hidden_dropout_prob", "attention_probs_dropout_prob", "initializer_range",
           "classifier_dropout", "use_cache", "pad_token_id", "bos_token_id", "eos_token_id"),
    config_classes=("BertConfig",),
)  # fmt: skip
