"""ModernBERT: a pre-norm encoder with rotary positions, GeGLU, no biases, and global
attention every few layers between local ones, each with its own rotary base.

A local layer's keys lie within local_attention // 2 positions of their query, either side
(qkv: window = local_attention // 2 + 1, not causal). The embeddings are normalized and the
first block reads them without a norm of its own. Wqkv holds [q; k; v] and Wi [input; gate],
of which transformers activates the first half, as qkv's fused gated MLP does.
"""

from __future__ import annotations

from collections import ChainMap
from collections.abc import Mapping
from dataclasses import replace

from qkv.io.families.checks import ConfigValueError, divides, flag, real, whole
from qkv.io.families.common import (
    Family,
    Weight,
    expand,
    fits,
    one_head_size,
    require,
    with_biases,
)
from qkv.io.families.rotary import FULL, SLIDING, read_rope
from qkv.models import Encoder, EncoderConfig
from qkv.nn import BlockConfig

MLM = "ModernBertForMaskedLM"
GATED = {"gelu": "geglu", "gelu_pytorch_tanh": "geglu_tanh", "gelu_new": "geglu_tanh",
         "silu": "swiglu"}  # fmt: skip
HF_GATED = {"geglu": "gelu", "geglu_tanh": "gelu_pytorch_tanh", "swiglu": "silu"}
TYPES = {FULL: "full", SLIDING: "sliding"}


def _layer_types(hf: dict, layers: int) -> tuple[str, ...]:
    given = hf.get("layer_types")
    if given is None:  # older config.json files: every n-th layer (from 0) is global
        every = whole(hf, "global_attn_every_n_layers", 3)
        return tuple("sliding" if i % every else "full" for i in range(layers))
    if not isinstance(given, list) or any(t not in TYPES for t in given):
        raise ConfigValueError("layer_types", f"must list {FULL!r} or {SLIDING!r}, got {given!r}")
    return tuple(TYPES[t] for t in given)


def _rope(hf: Mapping, head_dim: int) -> dict:
    """The rotary fields; older config.json files name the two bases at the top level."""
    # transformers merges a rope_scaling into both layer types' parameters, even beside
    # rope_parameters; qkv computes no scaling of ModernBERT, so none is read at all
    if hf.get("rope_scaling") is not None:
        raise ValueError("ModernBERT checkpoints with rope_scaling are not supported")
    given = hf.get("rope_parameters") or {}
    if not isinstance(given, Mapping) or not {FULL, SLIDING} >= set(given):
        nesting = f"must be nested by layer type ({FULL}, {SLIDING}), got {given!r}"
        raise ConfigValueError("rope_parameters", nesting)
    # as transformers fills them in: a layer type's base, where its parameters have none,
    # is the older top-level key's (global_rope_theta, local_rope_theta)
    nested = {t: dict(given.get(t) or {"rope_type": "default"}) for t in (FULL, SLIDING)}
    for kind, key, default in ((FULL, "global_rope_theta", 160000.0),
                               (SLIDING, "local_rope_theta", 10000.0)):  # fmt: skip
        if nested[kind].get("rope_theta") is None:
            base = hf.get(key)
            nested[kind]["rope_theta"] = default if base is None else base
    # an overlay, not a copy: the other rotary keys are still looked up in the file
    hf = ChainMap({"rope_parameters": nested}, hf)
    fields = read_rope(hf, head_dim, partial_keys=(), default_base=160000.0, local=True)
    if fields["rope_scaling"] is not None:
        raise ValueError(
            f"ModernBERT checkpoints with rope scaling {fields['rope_scaling'].kind!r} "
            "are not supported"
        )
    if fields["rope_dims"] is not None:  # transformers turns every dimension regardless
        raise ValueError("ModernBERT checkpoints with partial_rotary_factor are not supported")
    return fields


def config(hf: dict) -> EncoderConfig:
    """A config.json -> the qkv config of the same encoder."""
    act = hf.get("hidden_activation", "gelu")
    require(hf, "ModernBERT", hidden_activation=tuple(GATED))
    bias = flag(hf, "mlp_bias", False)
    if flag(hf, "attention_bias", False) != bias:  # qkv's blocks have both biases or neither
        raise ValueError(
            f"ModernBERT checkpoints with attention_bias={not bias} and mlp_bias={bias} "
            "are not supported"
        )
    mlm_head = MLM in (hf.get("architectures") or ())
    # the head's settings matter only where there is a head (ModernBertModel has none), but
    # a value of the wrong kind is refused everywhere
    head = {"tie_word_embeddings": flag(hf, "tie_word_embeddings", True),
            "decoder_bias": flag(hf, "decoder_bias", True),
            "classifier_bias": flag(hf, "classifier_bias", False)}  # fmt: skip
    head_act = hf.get("classifier_activation", "gelu")
    if not isinstance(head_act, str):
        raise ConfigValueError("classifier_activation", f"must be a name, got {head_act!r}")
    if mlm_head:  # qkv's head: the blocks' gate activation and biases, a biased decoder
        require(head, MLM, tie_word_embeddings=(True,), decoder_bias=(True,),
                classifier_bias=(bias,))  # fmt: skip
        if GATED.get(head_act) != GATED[act]:
            raise ValueError(
                f"{MLM} checkpoints with classifier_activation={head_act!r} and "
                f"hidden_activation={act!r} are not supported: qkv's head uses the MLP's"
            )
    width, heads = whole(hf, "hidden_size"), whole(hf, "num_attention_heads")
    divides(hf, "num_attention_heads", "hidden_size", heads, width)
    layers = whole(hf, "num_hidden_layers")
    layer_types = _layer_types(hf, layers)
    return EncoderConfig(
        vocab_size=whole(hf, "vocab_size"),
        num_layers=layers,
        max_positions=whole(hf, "max_position_embeddings", 8192),
        position="rotary",
        **_rope(hf, width // heads),
        layer_types=layer_types,
        embed_norm=True,
        final_norm=True,
        first_attn_norm=False,
        mlm_head=mlm_head,
        block=BlockConfig(
            width=width,
            num_heads=heads,
            mlp_hidden=whole(hf, "intermediate_size"),
            mlp=GATED[act],
            fused_mlp=True,
            fused_qkv=True,
            norm_eps=real(hf, "norm_eps", 1e-5),
            norm_bias=flag(hf, "norm_bias", False),
            bias=bias,
            window=whole(hf, "local_attention", 128) // 2 + 1,
        ),
    )


def hf_config(cfg: EncoderConfig) -> dict:
    """The config.json that `transformers` (and `config`) read `cfg` back from:
    ModernBertForMaskedLM with the MLM head, ModernBertModel without."""
    block = cfg.block
    fits("ModernBERT", cfg, position="rotary", embed_norm=True, embed_scale=False,
         has_final_norm=True, first_attn_norm=False, type_vocab_size=0, position_padding=None,
         rope_dims=None, rope_scaling=None, block__norm="layernorm", block__norm_position="pre",
         block__sublayer_norm=False, block__parallel=False, block__qkv_bias=None,
         block__fused_qkv=True, block__fused_mlp=True, block__attn_scale=None,
         block__softcap=None, block__qk_norm=None)  # fmt: skip
    one_head_size("ModernBERT", block)
    if block.mlp not in HF_GATED:
        raise ValueError(
            f"a ModernBERT config.json cannot hold mlp={block.mlp!r}: its MLP is gated"
        )
    if block.window is None:
        raise ValueError("a ModernBERT config.json cannot hold window=None: it has local layers")
    types = cfg.layer_types or tuple(cfg.layer_type(i) for i in range(cfg.num_layers))
    act = HF_GATED[block.mlp]
    local_base = cfg.rope_base if cfg.local_rope_base is None else cfg.local_rope_base
    return {
        "architectures": [MLM if cfg.mlm_head else "ModernBertModel"],
        "model_type": "modernbert",
        "vocab_size": cfg.vocab_size,
        "hidden_size": block.width,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": block.num_heads,
        "intermediate_size": block.mlp_hidden or 4 * block.width,
        "hidden_activation": act,
        "max_position_embeddings": cfg.max_positions,
        "norm_eps": block.norm_eps,
        "norm_bias": block.norm_bias,
        "attention_bias": block.bias,
        "mlp_bias": block.bias,
        "layer_types": [{"full": FULL, "sliding": SLIDING}[t] for t in types],
        "local_attention": 2 * (block.window - 1),
        "rope_parameters": {
            FULL: {"rope_type": "default", "rope_theta": cfg.rope_base},
            SLIDING: {"rope_type": "default", "rope_theta": local_base},
        },
        "classifier_activation": act,
        "classifier_bias": block.bias,
        "decoder_bias": True,
        "mlp_dropout": block.dropout,
        "attention_dropout": 0.0,  # qkv drops no attention weights
        "embedding_dropout": 0.0,
        "tie_word_embeddings": True,
        # the special tokens are the tokenizer's: transformers' defaults (pad 50283) lie
        # outside a smaller vocabulary, where its embedding refuses them as padding_idx
        **dict.fromkeys(
            ["pad_token_id", "bos_token_id", "eos_token_id", "cls_token_id", "sep_token_id"]
        ),
    }


EMBED = [("embed.tokens.weight", "embeddings.tok_embeddings.weight")]
NORMS = [("embed.norm", "embeddings.norm"), ("blocks.{}.attn_norm", "layers.{}.attn_norm"),
         ("blocks.{}.mlp_norm", "layers.{}.mlp_norm"), ("norm", "final_norm")]  # fmt: skip
PROJECTIONS = [
    ("blocks.{}.attn.qkv", "layers.{}.attn.Wqkv"),
    ("blocks.{}.attn.out", "layers.{}.attn.Wo"),
    ("blocks.{}.mlp.gate_up", "layers.{}.mlp.Wi"),
    ("blocks.{}.mlp.down", "layers.{}.mlp.Wo"),
]
HEAD_NORM, HEAD_DENSE = [("mlm.norm", "head.norm")], [("mlm.dense", "head.dense")]


def _params(pairs: list[tuple[str, str]], bias: bool) -> list:
    """(module, checkpoint module) pairs -> their weights, and biases if they have them."""
    return with_biases(pairs) if bias else [(f"{q}.weight", f"{h}.weight") for q, h in pairs]


def weights(cfg: EncoderConfig) -> list[Weight]:
    block = cfg.block
    templates = EMBED + _params(NORMS, block.norm_bias) + _params(PROJECTIONS, block.bias)
    # ModernBertModel's names, under "model." in ModernBertForX
    prefixes = ("model.", "") if cfg.mlm_head else ("", "model.")
    body = [w for w in expand(templates, cfg.num_layers, prefixes=prefixes)
            if cfg.first_attn_norm or not w.qkv.startswith("blocks.0.attn_norm.")]  # fmt: skip
    if not cfg.mlm_head:
        return body
    tokens = body[0]  # the decoder's matrix is the token matrix, written once
    body[0] = replace(tokens, names=(*tokens.names, "decoder.weight"))
    head = _params(HEAD_DENSE, block.bias) + _params(HEAD_NORM, block.norm_bias)
    return body + expand([*head, ("mlm.decoder.bias", "decoder.bias")], 0)


FAMILY = Family(
    "modernbert", ("modernbert",), Encoder, config, hf_config, weights,
    ignored=(r"(model\.)?embeddings\.position_ids", r"head\..*", r"decoder\..*"),
    reads=("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
           "num_attention_heads", "hidden_activation", "max_position_embeddings", "norm_eps",
           "norm_bias", "attention_bias", "mlp_bias", "layer_types", "rope_parameters",
           "rope_scaling", "global_rope_theta", "local_rope_theta", "global_attn_every_n_layers",
           "local_attention", "decoder_bias", "classifier_bias", "classifier_activation",
           "tie_word_embeddings"),
    # classifier_pooling and classifier_dropout belong to the classification heads, which
    # qkv does not load; sparse_prediction only changes which positions a loss scores
    inert=("initializer_range", "initializer_cutoff_factor", "pad_token_id", "eos_token_id",
           "bos_token_id", "cls_token_id", "sep_token_id", "attention_dropout",
           "embedding_dropout", "mlp_dropout", "classifier_pooling", "classifier_dropout",
           "deterministic_flash_attn", "sparse_prediction", "sparse_pred_ignore_index",
           "reference_compile", "repad_logits_with_grad", "gradient_checkpointing",
           "position_embedding_type", "layer_norm_eps"),
    config_classes=("ModernBertConfig",),
)  # fmt: skip
