"""GPT-NeoX (and Pythia): a pre-norm decoder whose attention and MLP read the same input
side by side (`use_parallel_residual`), with LayerNorms, biases everywhere, rotary positions
on part of each head (Pythia: a quarter) and one query-key-value matrix whose rows are
grouped by head ([h0: q, k, v][h1: q, k, v]...), where qkv's are grouped by kind."""

from __future__ import annotations

from collections import ChainMap
from functools import partial

from torch import Tensor

from qkv.io.families.checks import divides, flag, real, whole
from qkv.io.families.common import (
    Family,
    Layout,
    Template,
    Weight,
    activation,
    expand,
    fits,
    hf_activation,
    one_head_size,
    require,
    with_biases,
)
from qkv.io.families.rotary import hf_rope, read_rope
from qkv.models import Decoder, DecoderConfig
from qkv.nn import BlockConfig

# GPTNeoXConfig's rotary_pct when a file has none (not 1: the fraction Pythia turns)
ROTARY_PCT = 0.25


def config(hf: dict) -> DecoderConfig:
    """A config.json -> the qkv config of the same decoder."""
    # attention_bias=False drops the biases of query_key_value and dense but keeps the MLP's:
    # qkv's output projection and MLP share one bias flag
    require(hf, "GPT-NeoX", attention_bias=(True,))
    width, heads = whole(hf, "hidden_size"), whole(hf, "num_attention_heads")
    divides(hf, "num_attention_heads", "hidden_size", heads, width)
    # GPTNeoXConfig reads the base and the fraction from rope_parameters, else from
    # rotary_emb_base and rotary_pct (a top-level rope_theta or partial_rotary_factor is
    # not read); an overlay of GPTNeoXConfig's rotary_pct, not a copy of every key
    rotary = ChainMap({} if hf.get("rotary_pct") is not None else {"rotary_pct": ROTARY_PCT}, hf)
    rope = read_rope(rotary, width // heads, base_keys=("rotary_emb_base",),
                     partial_keys=("rotary_pct",))  # fmt: skip
    return DecoderConfig(
        vocab_size=whole(hf, "vocab_size"),
        num_layers=whole(hf, "num_hidden_layers"),
        max_positions=whole(hf, "max_position_embeddings", 2048),
        position="rotary",
        tie_embeddings=flag(hf, "tie_word_embeddings", False),
        **rope,
        block=BlockConfig(
            width=width,
            num_heads=heads,
            mlp_hidden=whole(hf, "intermediate_size"),
            mlp=activation(hf, "hidden_act"),
            norm_eps=real(hf, "layer_norm_eps", 1e-5),
            parallel=flag(hf, "use_parallel_residual", True),
            fused_qkv=True,
        ),
    )


def hf_config(cfg: DecoderConfig) -> dict:
    """The config.json of a GPT-NeoX-shaped decoder (GPTNeoXForCausalLM).

    >>> cfg = DecoderConfig(vocab_size=50, num_layers=2, position="rotary", rope_dims=2,
    ...     tie_embeddings=False, block=BlockConfig(width=32, num_heads=4, mlp_hidden=40,
    ...     parallel=True, fused_qkv=True))
    >>> hf = hf_config(cfg)
    >>> hf["rotary_pct"], hf["use_parallel_residual"], config(hf) == cfg
    (0.25, True, True)
    """
    block = cfg.block
    fits("GPT-NeoX", cfg, position="rotary", type_vocab_size=0, embed_norm=False,
         embed_scale=False, has_final_norm=True, lm_head_bias=False, cross_attention=False,
         logit_softcap=None, layer_types=None, local_rope_base=None,
         block__norm="layernorm", block__norm_bias=True, block__norm_position="pre",
         block__sublayer_norm=False, block__bias=True, block__qkv_bias=None,
         block__fused_qkv=True, block__attn_scale=None, block__softcap=None,
         block__window=None, block__qk_norm=None)  # fmt: skip
    one_head_size("GPT-NeoX", block)
    rope = hf_rope(cfg, block.head_size)
    hf = {
        "model_type": "gpt_neox",
        "architectures": ["GPTNeoXForCausalLM"],
        "vocab_size": cfg.vocab_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": block.num_heads,
        "hidden_size": block.width,
        "intermediate_size": block.mlp_hidden or 4 * block.width,
        "max_position_embeddings": cfg.max_positions,
        "hidden_act": hf_activation(block.mlp, "GPT-NeoX"),
        "layer_norm_eps": block.norm_eps,
        "use_parallel_residual": block.parallel,
        "attention_bias": True,
        "tie_word_embeddings": cfg.tie_embeddings,
        "rotary_emb_base": rope.pop("rope_theta"),
        "rotary_pct": rope.pop("partial_rotary_factor", 1.0),
        **rope,  # rope_scaling, where there is one
    }
    return hf


def _by_kind(heads: int, t: Tensor) -> Tensor:
    """Rows (or bias entries) [h0: q, k, v][h1: q, k, v]... -> [all q; all k; all v]."""
    return t.reshape(heads, 3, -1, *t.shape[1:]).transpose(0, 1).reshape(t.shape).contiguous()


def _by_head(heads: int, t: Tensor) -> Tensor:
    """[all q; all k; all v] -> [h0: q, k, v][h1: q, k, v]..., GPT-NeoX's rows."""
    return t.reshape(3, heads, -1, *t.shape[1:]).transpose(0, 1).reshape(t.shape).contiguous()


def templates(cfg: DecoderConfig) -> list[Template]:
    """The weight map of a model with cfg.block.num_heads heads (the fused rows' order
    depends on it)."""
    heads = cfg.block.num_heads
    grouped = Layout(partial(_by_kind, heads), partial(_by_head, heads))
    q, h = "blocks.{}", "layers.{}"
    return [
        ("embed.tokens.weight", "embed_in.weight"),
        *with_biases([("norm", "final_layer_norm"), (f"{q}.attn_norm", f"{h}.input_layernorm"),
                      (f"{q}.mlp_norm", f"{h}.post_attention_layernorm"),
                      (f"{q}.attn.out", f"{h}.attention.dense"),
                      (f"{q}.mlp.fc_in", f"{h}.mlp.dense_h_to_4h"),
                      (f"{q}.mlp.fc_out", f"{h}.mlp.dense_4h_to_h")]),
        (f"{q}.attn.qkv.weight", f"{h}.attention.query_key_value.weight", grouped),
        (f"{q}.attn.qkv.bias", f"{h}.attention.query_key_value.bias", grouped),
    ]  # fmt: skip


def weights(cfg: DecoderConfig) -> list[Weight]:
    # GPTNeoXForCausalLM's names start with "gpt_neox."; GPTNeoXModel's do not
    out = expand(templates(cfg), cfg.num_layers, prefixes=("gpt_neox.", ""))
    if not cfg.tie_embeddings:  # Pythia's files call the head embed_out
        out += expand([("lm_head.weight", ("embed_out.weight", "lm_head.weight"))], 0)
    return out


FAMILY = Family(
    "gpt_neox", ("gpt_neox",), Decoder, config, hf_config, weights,
    # buffers older checkpoints saved: the causal mask, its fill value, rotary frequencies
    ignored=(r"(gpt_neox\.)?layers\.\d+\.attention\.(bias|masked_bias|rotary_emb\.inv_freq)",),
    reads=("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
           "num_attention_heads", "hidden_act", "max_position_embeddings", "layer_norm_eps",
           "use_parallel_residual", "attention_bias", "tie_word_embeddings", "rope_parameters",
           "rope_scaling", "rotary_emb_base", "rotary_pct"),
    inert=("attention_dropout", "hidden_dropout", "classifier_dropout", "initializer_range",
           "use_cache", "bos_token_id", "eos_token_id", "pad_token_id", "is_decoder"),
    config_classes=("GPTNeoXConfig",),
)  # fmt: skip
