"""OLMo 2: a decoder that normalizes each sub-layer's output instead of its input (no norm
before attention or the MLP; RMSNorms `post_attention_layernorm` and
`post_feedforward_layernorm` before each residual sum), with one RMSNorm over all query
heads at once and one over all key heads (QK-norm over the full width), rotary positions,
SwiGLU and no biases."""

from __future__ import annotations

from qkv.io.families.checks import ConfigValueError, divides, flag, real, whole
from qkv.io.families.common import Family, Weight, decoder_weights, fits, require
from qkv.io.families.rotary import hf_rope, read_rope
from qkv.models import Decoder, DecoderConfig
from qkv.nn import BlockConfig


def config(hf: dict) -> DecoderConfig:
    """A config.json -> the qkv config of the same decoder."""
    # attention_bias would bias o_proj too but not the MLP: qkv's biases do not split so
    require(hf, "OLMo 2", attention_bias=(False,), hidden_act=("silu",))
    width, heads = whole(hf, "hidden_size"), whole(hf, "num_attention_heads")
    kv_heads = whole(hf, "num_key_value_heads", heads)
    divides(hf, "num_key_value_heads", "num_attention_heads", kv_heads, heads)
    head_dim = whole(hf, "head_dim", None)
    if head_dim is None:
        divides(hf, "num_attention_heads", "hidden_size", heads, width)
        head_dim = width // heads
    rope = read_rope(hf, head_dim)
    if rope["rope_dims"] is not None:  # OLMo 2's rotary turns whole heads, whatever it says
        raise ConfigValueError("partial_rotary_factor", "must be 1 in an OLMo 2 checkpoint")
    return DecoderConfig(
        vocab_size=whole(hf, "vocab_size"),
        num_layers=whole(hf, "num_hidden_layers"),
        max_positions=whole(hf, "max_position_embeddings", 2048),
        position="rotary",
        tie_embeddings=flag(hf, "tie_word_embeddings", False),
        final_norm=True,
        **rope,
        block=BlockConfig(
            width=width,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            mlp_hidden=whole(hf, "intermediate_size"),
            mlp="swiglu",
            norm="rmsnorm",
            norm_eps=real(hf, "rms_norm_eps", 1e-5),
            norm_position="none",
            sublayer_norm=True,
            qk_norm="full",
            bias=False,
        ),
    )


def hf_config(cfg: DecoderConfig) -> dict:
    """The config.json of an OLMo-2-shaped decoder (Olmo2ForCausalLM).

    >>> cfg = DecoderConfig(vocab_size=50, num_layers=2, position="rotary", final_norm=True,
    ...     tie_embeddings=False, block=BlockConfig(width=16, num_heads=4, num_kv_heads=2,
    ...     head_dim=4, mlp_hidden=40, mlp="swiglu", norm="rmsnorm", norm_position="none",
    ...     sublayer_norm=True, qk_norm="full", bias=False))
    >>> hf = hf_config(cfg)
    >>> hf["num_key_value_heads"], config(hf) == cfg
    (2, True)
    """
    block = cfg.block
    fits("OLMo 2", cfg, position="rotary", type_vocab_size=0, embed_norm=False,
         embed_scale=False, has_final_norm=True, lm_head_bias=False, cross_attention=False,
         logit_softcap=None, layer_types=None, local_rope_base=None, rope_dims=None,
         block__norm="rmsnorm", block__norm_position="none", block__sublayer_norm=True,
         block__parallel=False, block__bias=False, block__qkv_bias=None,
         block__fused_qkv=False, block__fused_mlp=False, block__mlp="swiglu",
         block__attn_scale=None, block__softcap=None, block__window=None,
         block__qk_norm="full")  # fmt: skip
    hf = {
        "model_type": "olmo2",
        "architectures": ["Olmo2ForCausalLM"],
        "vocab_size": cfg.vocab_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": block.num_heads,
        "num_key_value_heads": block.kv_heads,
        "hidden_size": block.width,
        "intermediate_size": block.mlp_hidden or 4 * block.width,
        "max_position_embeddings": cfg.max_positions,
        "rms_norm_eps": block.norm_eps,
        "hidden_act": "silu",
        "attention_bias": False,
        "tie_word_embeddings": cfg.tie_embeddings,
        **hf_rope(cfg, block.head_size),
    }
    if block.head_size != block.width // block.num_heads:  # written only where it differs
        hf["head_dim"] = block.head_size
    return hf


TEMPLATES = [
    ("embed.tokens.weight", "model.embed_tokens.weight"),
    ("norm.weight", "model.norm.weight"),
    ("blocks.{}.attn.q.weight", "model.layers.{}.self_attn.q_proj.weight"),
    ("blocks.{}.attn.k.weight", "model.layers.{}.self_attn.k_proj.weight"),
    ("blocks.{}.attn.v.weight", "model.layers.{}.self_attn.v_proj.weight"),
    ("blocks.{}.attn.out.weight", "model.layers.{}.self_attn.o_proj.weight"),
    ("blocks.{}.attn.q_norm.weight", "model.layers.{}.self_attn.q_norm.weight"),
    ("blocks.{}.attn.k_norm.weight", "model.layers.{}.self_attn.k_norm.weight"),
    ("blocks.{}.attn_out_norm.weight", "model.layers.{}.post_attention_layernorm.weight"),
    ("blocks.{}.mlp.gate.weight", "model.layers.{}.mlp.gate_proj.weight"),
    ("blocks.{}.mlp.up.weight", "model.layers.{}.mlp.up_proj.weight"),
    ("blocks.{}.mlp.down.weight", "model.layers.{}.mlp.down_proj.weight"),
    ("blocks.{}.mlp_out_norm.weight", "model.layers.{}.post_feedforward_layernorm.weight"),
]


def weights(cfg: DecoderConfig) -> list[Weight]:
    return decoder_weights(TEMPLATES, cfg)


FAMILY = Family(
    "olmo2", ("olmo2",), Decoder, config, hf_config, weights,
    ignored=(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq",),
    reads=("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
           "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_act",
           "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings", "attention_bias",
           "rope_parameters", "rope_scaling", "rope_theta", "partial_rotary_factor"),
    inert=("attention_dropout", "initializer_range", "use_cache", "bos_token_id",
           "eos_token_id", "pad_token_id"),
    config_classes=("Olmo2Config",),
)  # fmt: skip
