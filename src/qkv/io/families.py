"""Model families: a Hugging Face config.json to a qkv config, and one weight map each.

A weight map lists, for every qkv parameter, the checkpoint names it may come from (the
first is the name written on export; others are aliases tied checkpoints may use
instead) and how to turn the tensor between the two layouts. `{}` stands for a layer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch
from torch import Tensor

from qkv.models import (
    Decoder,
    DecoderConfig,
    Encoder,
    EncoderConfig,
    EncoderDecoder,
    EncoderDecoderConfig,
)
from qkv.nn import BlockConfig


def _same(t: Tensor) -> Tensor:
    return t


def _transposed(t: Tensor) -> Tensor:
    return t.t().contiguous()  # GPT-2's Conv1D stores (in, out); Linear wants (out, in)


BART_POSITION_OFFSET = 2  # BART's learned positions start at row 2 of their table


def _drop_bart_offset(t: Tensor) -> Tensor:
    return t[BART_POSITION_OFFSET:].contiguous()


def _add_bart_offset(t: Tensor) -> Tensor:
    # the two rows qkv never reads are written as zeros
    return torch.cat([t.new_zeros(BART_POSITION_OFFSET, *t.shape[1:]), t])


@dataclass(frozen=True)
class Weight:
    """One qkv parameter and where it lives in a checkpoint."""

    qkv: str
    names: tuple[str, ...]  # checkpoint names; the first is canonical
    load: Callable[[Tensor], Tensor] = _same
    save: Callable[[Tensor], Tensor] = _same


def _layers(n: int, template: list[tuple[str, str]], **kw) -> list[Weight]:
    return [Weight(q.format(i), (h.format(i),), **kw) for i in range(n) for q, h in template]


ACTIVATIONS = {
    "gelu": "gelu",
    "gelu_new": "gelu_tanh",
    "gelu_pytorch_tanh": "gelu_tanh",
    "relu": "relu",
    "silu": "silu",
    "swish": "silu",
}


def _activation(hf: dict, key: str) -> str:
    name = hf.get(key, "gelu")
    if name not in ACTIVATIONS:
        raise ValueError(f"activation {name!r} is not supported; supported: {list(ACTIVATIONS)}")
    return ACTIVATIONS[name]


def _require(hf: dict, family: str, **expected) -> None:
    for key, allowed in expected.items():
        value = hf.get(key, allowed[0])
        if value not in allowed:
            raise ValueError(f"{family} checkpoints with {key}={value!r} are not supported")


# ----------------------------------------------------------------------------- BERT


BERT_MLM = "BertForMaskedLM"  # the architecture whose checkpoints carry the MLM head


def bert_config(hf: dict) -> EncoderConfig:
    _require(hf, "BERT", position_embedding_type=("absolute",))
    mlm_head = BERT_MLM in (hf.get("architectures") or ())
    if mlm_head:  # qkv's head always decodes with the token matrix
        _require(hf, "BertForMaskedLM", tie_word_embeddings=(True,))
    return EncoderConfig(
        vocab_size=hf["vocab_size"],
        num_layers=hf["num_hidden_layers"],
        max_positions=hf["max_position_embeddings"],
        position="learned",
        type_vocab_size=hf.get("type_vocab_size", 2),
        embed_norm=True,
        final_norm=False,
        mlm_head=mlm_head,
        block=BlockConfig(
            width=hf["hidden_size"],
            num_heads=hf["num_attention_heads"],
            mlp_hidden=hf["intermediate_size"],
            mlp=_activation(hf, "hidden_act"),
            norm_eps=hf.get("layer_norm_eps", 1e-12),
            norm_position="post",
        ),
    )


def bert_weights(cfg: EncoderConfig) -> list[Weight]:
    # sentence-transformers folders drop the "bert." prefix that BertForX checkpoints have;
    # with the MLM head qkv writes the prefix, as BertForMaskedLM does
    def w(qkv: str, name: str) -> Weight:
        names = ("bert." + name, name)
        return Weight(qkv, names if cfg.mlm_head else names[::-1])

    top = [
        ("embed.tokens.weight", "embeddings.word_embeddings.weight"),
        ("embed.positions.embedding.weight", "embeddings.position_embeddings.weight"),
        ("embed.types.weight", "embeddings.token_type_embeddings.weight"),
        ("embed.norm.weight", "embeddings.LayerNorm.weight"),
        ("embed.norm.bias", "embeddings.LayerNorm.bias"),
    ]
    layer = [
        ("attn.q", "attention.self.query"),
        ("attn.k", "attention.self.key"),
        ("attn.v", "attention.self.value"),
        ("attn.out", "attention.output.dense"),
        ("attn_norm", "attention.output.LayerNorm"),
        ("mlp.fc_in", "intermediate.dense"),
        ("mlp.fc_out", "output.dense"),
        ("mlp_norm", "output.LayerNorm"),
    ]
    weights = [w(q, h) for q, h in top]
    for i in range(cfg.num_layers):
        for q, h in layer:
            for part in ("weight", "bias"):
                weights.append(w(f"blocks.{i}.{q}.{part}", f"encoder.layer.{i}.{h}.{part}"))
    if cfg.mlm_head:
        head = "cls.predictions."
        # the decoder's matrix is the token matrix, which transformers 5 writes once, under
        # the embeddings' name (older checkpoints repeat it); its bias is cls.predictions.bias
        tokens = weights[0]
        weights[0] = replace(tokens, names=(*tokens.names, head + "decoder.weight"))
        for q, h in [("dense", "transform.dense"), ("norm", "transform.LayerNorm")]:
            for part in ("weight", "bias"):
                weights.append(Weight(f"mlm.{q}.{part}", (f"{head}{h}.{part}",)))
        weights.append(Weight("mlm.decoder.bias", (head + "bias", head + "decoder.bias")))
    return weights


def bert_hf_config(cfg: EncoderConfig) -> dict:
    """The config.json that `transformers` (and `bert_config`) read `cfg` back from:
    BertForMaskedLM for an encoder with the MLM head, BertModel without.

    >>> cfg = EncoderConfig(vocab_size=50, num_layers=2, type_vocab_size=2, embed_norm=True,
    ...     mlm_head=True, block=BlockConfig(width=16, num_heads=4, norm_position="post"))
    >>> hf = bert_hf_config(cfg)
    >>> hf["architectures"], hf["intermediate_size"], bert_config(hf).mlm_head
    (['BertForMaskedLM'], 64, True)
    """
    block = cfg.block
    hidden_act = {"gelu": "gelu", "gelu_tanh": "gelu_pytorch_tanh", "relu": "relu",
                  "silu": "silu"}.get(block.mlp)  # fmt: skip
    if not (
        cfg.position == "learned" and cfg.embed_norm and not cfg.embed_scale
        and not cfg.has_final_norm and cfg.type_vocab_size > 0
        and block.norm == "layernorm" and block.norm_position == "post" and block.bias
        and not block.fused_qkv and block.kv_heads == block.num_heads
        and block.head_size * block.num_heads == block.width and hidden_act is not None
    ):  # fmt: skip
        raise ValueError(
            "only a BERT-shaped encoder can be written as a BERT config.json: learned "
            "positions, segment embeddings and a LayerNorm after them, post-norm LayerNorm "
            "blocks with biases, a gelu/relu/silu MLP, no final norm"
        )
    return {
        "architectures": [BERT_MLM if cfg.mlm_head else "BertModel"],
        "model_type": "bert",
        "vocab_size": cfg.vocab_size,
        "hidden_size": block.width,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": block.num_heads,
        "intermediate_size": block.mlp_hidden or 4 * block.width,
        "hidden_act": hidden_act,
        "max_position_embeddings": cfg.max_positions,
        "type_vocab_size": cfg.type_vocab_size,
        "layer_norm_eps": block.norm_eps,
        "position_embedding_type": "absolute",
        "hidden_dropout_prob": block.dropout,
        "attention_probs_dropout_prob": 0.0,  # qkv drops no attention weights
        "tie_word_embeddings": True,
    }


# ----------------------------------------------------------------------------- GPT-2


def gpt2_config(hf: dict) -> DecoderConfig:
    _require(
        hf, "GPT-2", scale_attn_by_inverse_layer_idx=(False,), reorder_and_upcast_attn=(False,)
    )
    width = hf["n_embd"]
    return DecoderConfig(
        vocab_size=hf["vocab_size"],
        num_layers=hf["n_layer"],
        max_positions=hf["n_positions"],
        position="learned",
        tie_embeddings=hf.get("tie_word_embeddings", True),
        block=BlockConfig(
            width=width,
            num_heads=hf["n_head"],
            mlp_hidden=hf.get("n_inner") or 4 * width,
            mlp=_activation(hf, "activation_function"),
            norm_eps=hf.get("layer_norm_epsilon", 1e-5),
            fused_qkv=True,
        ),
    )


def gpt2_weights(cfg: DecoderConfig) -> list[Weight]:
    def w(qkv: str, name: str, **kw) -> Weight:
        return Weight(qkv, ("transformer." + name, name), **kw)

    weights = [
        w("embed.tokens.weight", "wte.weight"),
        w("embed.positions.embedding.weight", "wpe.weight"),
        w("norm.weight", "ln_f.weight"),
        w("norm.bias", "ln_f.bias"),
    ]
    conv = {"_same": {}, "conv": {"load": _transposed, "save": _transposed}}
    layer = [
        ("attn_norm", "ln_1", "_same"),
        ("attn.qkv", "attn.c_attn", "conv"),
        ("attn.out", "attn.c_proj", "conv"),
        ("mlp_norm", "ln_2", "_same"),
        ("mlp.fc_in", "mlp.c_fc", "conv"),
        ("mlp.fc_out", "mlp.c_proj", "conv"),
    ]
    for i in range(cfg.num_layers):
        for q, h, kind in layer:
            weights.append(w(f"blocks.{i}.{q}.weight", f"h.{i}.{h}.weight", **conv[kind]))
            weights.append(w(f"blocks.{i}.{q}.bias", f"h.{i}.{h}.bias"))
    if not cfg.tie_embeddings:
        weights.append(Weight("lm_head.weight", ("lm_head.weight",)))
    return weights


# ----------------------------------------------------------------------------- Llama


def _rope_theta(hf: dict) -> float:
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind != "default":
        raise ValueError(f"rope scaling {kind!r} is not supported; supported: 'default'")
    return float(rope.get("rope_theta", hf.get("rope_theta", 10000.0)))


def llama_config(hf: dict) -> DecoderConfig:
    _require(hf, "Llama", attention_bias=(False,), mlp_bias=(False,), hidden_act=("silu",))
    heads = hf["num_attention_heads"]
    return DecoderConfig(
        vocab_size=hf["vocab_size"],
        num_layers=hf["num_hidden_layers"],
        max_positions=hf.get("max_position_embeddings", 2048),
        position="rotary",
        rope_base=_rope_theta(hf),
        tie_embeddings=hf.get("tie_word_embeddings", False),
        block=BlockConfig(
            width=hf["hidden_size"],
            num_heads=heads,
            num_kv_heads=hf.get("num_key_value_heads") or heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
            mlp_hidden=hf["intermediate_size"],
            mlp="swiglu",
            norm="rmsnorm",
            norm_eps=hf.get("rms_norm_eps", 1e-6),
            bias=False,
        ),
    )


def llama_weights(cfg: DecoderConfig) -> list[Weight]:
    weights = [
        Weight("embed.tokens.weight", ("model.embed_tokens.weight",)),
        Weight("norm.weight", ("model.norm.weight",)),
    ]
    weights += _layers(
        cfg.num_layers,
        [
            ("blocks.{}.attn_norm.weight", "model.layers.{}.input_layernorm.weight"),
            ("blocks.{}.attn.q.weight", "model.layers.{}.self_attn.q_proj.weight"),
            ("blocks.{}.attn.k.weight", "model.layers.{}.self_attn.k_proj.weight"),
            ("blocks.{}.attn.v.weight", "model.layers.{}.self_attn.v_proj.weight"),
            ("blocks.{}.attn.out.weight", "model.layers.{}.self_attn.o_proj.weight"),
            ("blocks.{}.mlp_norm.weight", "model.layers.{}.post_attention_layernorm.weight"),
            ("blocks.{}.mlp.gate.weight", "model.layers.{}.mlp.gate_proj.weight"),
            ("blocks.{}.mlp.up.weight", "model.layers.{}.mlp.up_proj.weight"),
            ("blocks.{}.mlp.down.weight", "model.layers.{}.mlp.down_proj.weight"),
        ],
    )
    if not cfg.tie_embeddings:
        weights.append(Weight("lm_head.weight", ("lm_head.weight",)))
    return weights


# ----------------------------------------------------------------------------- BART


def bart_config(hf: dict) -> EncoderDecoderConfig:
    for a, b in [("encoder_attention_heads", "decoder_attention_heads"),
                 ("encoder_ffn_dim", "decoder_ffn_dim")]:  # fmt: skip
        if hf[a] != hf[b]:
            raise ValueError(f"BART checkpoints with {a} != {b} are not supported")
    _require(hf, "BART", add_final_layer_norm=(False,), normalize_before=(False,))
    return EncoderDecoderConfig(
        vocab_size=hf["vocab_size"],
        encoder_layers=hf["encoder_layers"],
        decoder_layers=hf["decoder_layers"],
        max_positions=hf["max_position_embeddings"],
        position="learned",
        embed_norm=True,
        embed_scale=bool(hf.get("scale_embedding", False)),
        final_norm=False,
        tie_embeddings=True,
        lm_head_bias=True,
        block=BlockConfig(
            width=hf["d_model"],
            num_heads=hf["encoder_attention_heads"],
            mlp_hidden=hf["encoder_ffn_dim"],
            mlp=_activation(hf, "activation_function"),
            norm_position="post",
        ),
    )


def bart_weights(cfg: EncoderDecoderConfig) -> list[Weight]:
    shared = (
        "model.shared.weight",
        "model.encoder.embed_tokens.weight",
        "model.decoder.embed_tokens.weight",
        "lm_head.weight",
    )
    weights = [
        Weight("encoder.embed.tokens.weight", shared),
        Weight("decoder.lm_head.bias", ("final_logits_bias",), load=lambda t: t.reshape(-1),
               save=lambda t: t.reshape(1, -1)),
    ]  # fmt: skip
    attention = [("q", "q_proj"), ("k", "k_proj"), ("v", "v_proj"), ("out", "out_proj")]
    for stack, layers in (("encoder", cfg.encoder_layers), ("decoder", cfg.decoder_layers)):
        hf = f"model.{stack}"
        weights.append(
            Weight(
                f"{stack}.embed.positions.embedding.weight",
                (f"{hf}.embed_positions.weight",),
                load=_drop_bart_offset,
                save=_add_bart_offset,
            )
        )
        parts = [("embed.norm", "layernorm_embedding")]
        for i in range(layers):
            block, layer = f"blocks.{i}", f"layers.{i}"
            parts += [(f"{block}.attn.{q}", f"{layer}.self_attn.{h}") for q, h in attention]
            parts.append((f"{block}.attn_norm", f"{layer}.self_attn_layer_norm"))
            if stack == "decoder":
                parts += [
                    (f"{block}.cross_attn.{q}", f"{layer}.encoder_attn.{h}") for q, h in attention
                ]
                parts.append((f"{block}.cross_norm", f"{layer}.encoder_attn_layer_norm"))
            parts += [
                (f"{block}.mlp.fc_in", f"{layer}.fc1"),
                (f"{block}.mlp.fc_out", f"{layer}.fc2"),
                (f"{block}.mlp_norm", f"{layer}.final_layer_norm"),
            ]
        for q, h in parts:
            for p in ("weight", "bias"):
                weights.append(Weight(f"{stack}.{q}.{p}", (f"{hf}.{h}.{p}",)))
    return weights


# ----------------------------------------------------------------------------- registry


@dataclass(frozen=True)
class Family:
    name: str
    model_types: tuple[str, ...]  # Hugging Face `model_type` values this family reads
    model: type
    config: Callable[[dict], object]
    weights: Callable[[object], list[Weight]]
    # checkpoint keys that hold no weights qkv uses (buffers, heads it does not have)
    ignored: tuple[str, ...] = field(default=())


FAMILIES = [
    Family(
        "bert", ("bert",), Encoder, bert_config, bert_weights,
        ignored=(r"(bert\.)?pooler\..*", r"(bert\.)?embeddings\.position_ids", r"cls\..*"),
    ),
    Family(
        "gpt2", ("gpt2",), Decoder, gpt2_config, gpt2_weights,
        ignored=(r"(transformer\.)?h\.\d+\.attn\.(masked_)?bias",),
    ),
    Family(
        "llama", ("llama", "mistral"), Decoder, llama_config, llama_weights,
        ignored=(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq",),
    ),
    Family("bart", ("bart",), EncoderDecoder, bart_config, bart_weights),
]  # fmt: skip


def family_for(hf_config: dict) -> Family:
    """The family that reads a config.json, or a ValueError listing those supported."""
    model_type = hf_config.get("model_type")
    for family in FAMILIES:
        if model_type in family.model_types:
            return family
    supported = sorted(t for f in FAMILIES for t in f.model_types)
    raise ValueError(f"unknown model family {model_type!r}; supported: {', '.join(supported)}")
