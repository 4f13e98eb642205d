"""Phi-3 (Phi-3-mini, Phi-3.5-mini, Phi-4-mini): a Llama-shaped decoder whose query, key and
value matrices are one (`qkv_proj`, rows [q; k; v]) and whose gate and up matrices are one
(`gate_up_proj`, rows [gate; up]), with LongRoPE past its trained context, partial rotary
(Phi-4-mini turns 3/4 of each head) and, in Phi-3-mini, a sliding window on every layer."""

from __future__ import annotations

from collections import ChainMap
from collections.abc import Mapping

from qkv.io.families.checks import ConfigValueError, divides, flag, real, whole
from qkv.io.families.common import Family, Weight, decoder_weights, fits, require
from qkv.io.families.rotary import hf_rope, read_rope
from qkv.models import Decoder, DecoderConfig
from qkv.nn import BlockConfig

# transformers reads the scaling types of early Phi-3 checkpoints, "su" and "yarn", as
# longrope (Phi3Config.convert_rope_params_to_dict): their factors are LongRoPE's
LONGROPE_ALIASES = ("su", "yarn")
TRAINED_LENGTH = 4096  # Phi3Config's original_max_position_embeddings when a file has none
PAD_TOKEN = 32000  # Phi3Config's pad_token_id when a file has none


def _standard(hf: Mapping) -> Mapping:
    """hf with Phi-3's rotary spellings made standard, as Phi3Config reads them: an overlay
    of the values that change, so every other key is still looked up in the file itself."""
    changed: dict = {}
    for key in ("rope_parameters", "rope_scaling"):
        given = hf.get(key)
        if isinstance(given, Mapping):
            given = dict(given)
            for kind in ("rope_type", "type"):
                if given.get(kind) in LONGROPE_ALIASES:
                    given[kind] = "longrope"
            changed[key] = given
    # read with or without a scaling that uses it, so a wrong kind fails either way
    trained = whole(hf, "original_max_position_embeddings", TRAINED_LENGTH)
    changed["original_max_position_embeddings"] = trained
    return ChainMap(changed, hf)


def config(hf: Mapping) -> DecoderConfig:
    """A config.json -> the qkv config of the same decoder."""
    require(hf, "Phi-3", hidden_act=("silu",))
    hf = _standard(hf)
    width, heads = whole(hf, "hidden_size"), whole(hf, "num_attention_heads")
    kv_heads = whole(hf, "num_key_value_heads", heads)
    divides(hf, "num_key_value_heads", "num_attention_heads", kv_heads, heads)
    head_dim = whole(hf, "head_dim", None)
    if head_dim is None:
        divides(hf, "num_attention_heads", "hidden_size", heads, width)
        head_dim = width // heads
    rope = read_rope(hf, head_dim)
    if rope["rope_scaling"] is not None and rope["rope_scaling"].kind != "longrope":
        # Phi3Config itself refuses any other scaling
        raise ConfigValueError(
            "rope_scaling", f"type {rope['rope_scaling'].kind!r} is not Phi-3's (longrope)"
        )
    return DecoderConfig(
        vocab_size=whole(hf, "vocab_size"),
        num_layers=whole(hf, "num_hidden_layers"),
        max_positions=whole(hf, "max_position_embeddings", 4096),
        position="rotary",
        tie_embeddings=flag(hf, "tie_word_embeddings", False),
        **rope,
        block=BlockConfig(
            width=width,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            mlp_hidden=whole(hf, "intermediate_size"),
            mlp="swiglu",
            fused_mlp=True,
            fused_qkv=True,
            norm="rmsnorm",
            norm_eps=real(hf, "rms_norm_eps", 1e-5),
            bias=False,
            # HF's sliding window W shows a key iff query - key < W: qkv's window W
            window=whole(hf, "sliding_window", None),
        ),
    )


def hf_config(cfg: DecoderConfig) -> dict:
    """The config.json of a Phi-3-shaped decoder (Phi3ForCausalLM).

    >>> cfg = DecoderConfig(vocab_size=50, num_layers=2, position="rotary", rope_dims=6,
    ...     tie_embeddings=False, block=BlockConfig(width=32, num_heads=4, num_kv_heads=2,
    ...     head_dim=8, mlp_hidden=40, mlp="swiglu", fused_mlp=True, fused_qkv=True, norm="rmsnorm",
    ...     norm_eps=1e-5, bias=False, window=16))
    >>> hf = hf_config(cfg)
    >>> hf["partial_rotary_factor"], hf["sliding_window"], config(hf) == cfg
    (0.75, 16, True)
    """
    block = cfg.block
    fits("Phi-3", cfg, position="rotary", type_vocab_size=0, embed_norm=False,
         embed_scale=False, has_final_norm=True, lm_head_bias=False, cross_attention=False,
         logit_softcap=None, layer_types=None, local_rope_base=None,
         block__norm="rmsnorm", block__norm_position="pre", block__sublayer_norm=False,
         block__parallel=False, block__bias=False, block__qkv_bias=None,
         block__fused_qkv=True, block__fused_mlp=True, block__mlp="swiglu",
         block__attn_scale=None, block__softcap=None, block__qk_norm=None)  # fmt: skip
    scaling = cfg.rope_scaling
    if scaling is not None and scaling.kind != "longrope":
        raise ValueError(f"a Phi-3 config.json cannot hold rope scaling {scaling.kind!r}")
    hf = {
        "model_type": "phi3",
        "architectures": ["Phi3ForCausalLM"],
        "vocab_size": cfg.vocab_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": block.num_heads,
        "num_key_value_heads": block.kv_heads,
        "hidden_size": block.width,
        "intermediate_size": block.mlp_hidden or 4 * block.width,
        "max_position_embeddings": cfg.max_positions,
        "rms_norm_eps": block.norm_eps,
        "hidden_act": "silu",
        "tie_word_embeddings": cfg.tie_embeddings,
        "sliding_window": block.window,
        **hf_rope(cfg, block.head_size),
    }
    if scaling is not None:  # Phi-3 keeps the trained length at the top level, where it wins
        hf["original_max_position_embeddings"] = scaling.original_max_positions
    if block.head_size != block.width // block.num_heads:  # written only where it differs
        hf["head_dim"] = block.head_size
    if cfg.vocab_size <= PAD_TOKEN:  # transformers' embedding refuses a padding id past it
        hf["pad_token_id"] = None
    return hf


TEMPLATES = [
    ("embed.tokens.weight", "model.embed_tokens.weight"),
    ("norm.weight", "model.norm.weight"),
    ("blocks.{}.attn_norm.weight", "model.layers.{}.input_layernorm.weight"),
    ("blocks.{}.attn.qkv.weight", "model.layers.{}.self_attn.qkv_proj.weight"),
    ("blocks.{}.attn.out.weight", "model.layers.{}.self_attn.o_proj.weight"),
    ("blocks.{}.mlp_norm.weight", "model.layers.{}.post_attention_layernorm.weight"),
    ("blocks.{}.mlp.gate_up.weight", "model.layers.{}.mlp.gate_up_proj.weight"),
    ("blocks.{}.mlp.down.weight", "model.layers.{}.mlp.down_proj.weight"),
]


def weights(cfg: DecoderConfig) -> list[Weight]:
    return decoder_weights(TEMPLATES, cfg)


FAMILY = Family(
    "phi3", ("phi3",), Decoder, config, hf_config, weights,
    ignored=(r"model\.layers\.\d+\.self_attn\.rotary_emb\.(long_|short_)?inv_freq",),
    reads=("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
           "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_act",
           "max_position_embeddings", "original_max_position_embeddings", "rms_norm_eps",
           "tie_word_embeddings", "rope_parameters", "rope_scaling", "rope_theta",
           "partial_rotary_factor", "sliding_window"),
    inert=("resid_pdrop", "embd_pdrop", "attention_dropout", "initializer_range", "use_cache",
           "bos_token_id", "eos_token_id", "pad_token_id"),
    config_classes=("Phi3Config",),
)  # fmt: skip
