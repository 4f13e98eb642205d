"""RoBERTa and XLM-RoBERTa: BERT's post-norm encoder, trained without next-sentence pairs,
whose learned positions count from the padding id (fairseq's make_positions).

The weights have BERT's names under "roberta."; the masked-LM head is `lm_head`, whose
activation is gelu whatever `hidden_act` says. XLM-R is the same network with another
vocabulary: one module, two families, so that each exports its own model_type.
"""

from __future__ import annotations

from dataclasses import replace

from qkv.io.families import bert
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

# model_type -> (its name in messages, the MLM architecture, the plain one)
KINDS = {
    "roberta": ("RoBERTa", "RobertaForMaskedLM", "RobertaModel"),
    "xlm-roberta": ("XLM-R", "XLMRobertaForMaskedLM", "XLMRobertaModel"),
}


def config(hf: dict) -> EncoderConfig:
    """A config.json -> the qkv config of the same encoder."""
    name, mlm, _ = KINDS.get(hf.get("model_type"), KINDS["roberta"])
    require(hf, name, position_embedding_type=("absolute",), is_decoder=(False,),
            add_cross_attention=(False,))  # fmt: skip
    mlm_head = mlm in (hf.get("architectures") or ())
    if mlm_head:  # qkv's head decodes with the token matrix, through the blocks' activation
        require(hf, mlm, tie_word_embeddings=(True,), hidden_act=("gelu",))
    flag(hf, "tie_word_embeddings", True)
    width, heads = whole(hf, "hidden_size"), whole(hf, "num_attention_heads")
    divides(hf, "num_attention_heads", "hidden_size", heads, width)
    return EncoderConfig(
        vocab_size=whole(hf, "vocab_size"),
        num_layers=whole(hf, "num_hidden_layers"),
        max_positions=whole(hf, "max_position_embeddings"),
        position="learned",
        position_padding=whole(hf, "pad_token_id", 1, minimum=0),
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


def bert_shaped(family: str, cfg: EncoderConfig) -> None:
    """Refuse, by field, a qkv encoder that a BERT-shaped config.json cannot describe."""
    fits(family, cfg, position="learned", embed_norm=True, embed_scale=False,
         has_final_norm=False, first_attn_norm=True, layer_types=None, block__norm="layernorm",
         block__norm_bias=True, block__norm_position="post", block__sublayer_norm=False,
         block__parallel=False, block__bias=True, block__qkv_bias=None, block__fused_qkv=False,
         block__attn_scale=None, block__softcap=None, block__window=None,
         block__qk_norm=None)  # fmt: skip
    one_head_size(family, cfg.block)


def _hf_config(model_type: str):
    name, mlm, plain = KINDS[model_type]

    def hf_config(cfg: EncoderConfig) -> dict:
        """The config.json that `transformers` (and `config`) read `cfg` back from."""
        block = cfg.block
        bert_shaped(name, cfg)
        if cfg.position_padding is None:
            raise ValueError(
                f"a {name} config.json cannot hold position_padding=None: its positions "
                "count from the padding id (pad_token_id)"
            )
        if cfg.type_vocab_size < 1:
            raise ValueError(f"a {name} config.json cannot hold type_vocab_size=0")
        if cfg.mlm_head and block.mlp != "gelu":
            raise ValueError(f"a {name} masked-LM head uses gelu; it cannot hold mlp={block.mlp!r}")
        return {
            "architectures": [mlm if cfg.mlm_head else plain],
            "model_type": model_type,
            "vocab_size": cfg.vocab_size,
            "hidden_size": block.width,
            "num_hidden_layers": cfg.num_layers,
            "num_attention_heads": block.num_heads,
            "intermediate_size": block.mlp_hidden or 4 * block.width,
            "hidden_act": hf_activation(block.mlp, name),
            "max_position_embeddings": cfg.max_positions,
            "type_vocab_size": cfg.type_vocab_size,
            "layer_norm_eps": block.norm_eps,
            "pad_token_id": cfg.position_padding,
            "hidden_dropout_prob": block.dropout,
            "attention_probs_dropout_prob": 0.0,  # qkv drops no attention weights
            "tie_word_embeddings": True,
        }

    return hf_config


MLM_HEAD = [
    *with_biases([("mlm.dense", "lm_head.dense"), ("mlm.norm", "lm_head.layer_norm")]),
    ("mlm.decoder.bias", ("lm_head.bias", "lm_head.decoder.bias")),
]


def weights(cfg: EncoderConfig) -> list[Weight]:
    # BERT's names under "roberta." (RobertaForX) or none (RobertaModel, sentence-transformers)
    prefixes = ("roberta.", "") if cfg.mlm_head else ("", "roberta.")
    body = expand(bert.BODY, cfg.num_layers, prefixes=prefixes)
    if not cfg.mlm_head:
        return body
    tokens = body[0]  # the head's decoder matrix is the token matrix, written once
    body[0] = replace(tokens, names=(*tokens.names, "lm_head.decoder.weight"))
    return body + expand(MLM_HEAD, 0)


READS = (
    "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
    "intermediate_size", "hidden_act", "max_position_embeddings", "type_vocab_size",
    "layer_norm_eps", "pad_token_id", "position_embedding_type", "is_decoder",
    "add_cross_attention", "tie_word_embeddings",
)  # fmt: skip
INERT = (
    "hidden_dropout_prob", "attention_probs_dropout_prob", "classifier_dropout",
    "initializer_range", "bos_token_id", "eos_token_id", "use_cache",
)  # fmt: skip
IGNORED = (r"(roberta\.)?pooler\..*", r"(roberta\.)?embeddings\.position_ids",
           r"(roberta\.)?embeddings\.token_type_ids", r"lm_head\..*")  # fmt: skip

FAMILY = Family(
    "roberta", ("roberta",), Encoder, config, _hf_config("roberta"), weights, ignored=IGNORED,
    reads=READS, inert=INERT, config_classes=("RobertaConfig",),
)  # fmt: skip
XLM_FAMILY = Family(
    "xlm-roberta", ("xlm-roberta",), Encoder, config, _hf_config("xlm-roberta"), weights,
    ignored=IGNORED, reads=READS, inert=INERT, config_classes=("XLMRobertaConfig",),
)  # fmt: skip
