"""Llama (and Mistral, SmolLM2): a pre-norm decoder with rotary positions, RMSNorm, SwiGLU,
no biases, and grouped key/value heads."""

from __future__ import annotations

from qkv.io.families.checks import divides, flag, real, whole
from qkv.io.families.common import Family, Weight, expand, fits, require
from qkv.models import Decoder, DecoderConfig
from qkv.nn import BlockConfig


def _rope_theta(hf: dict) -> float:
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if not isinstance(rope, dict):
        raise ValueError(f"rope_scaling must be an object like {{'rope_type': ...}}, got {rope!r}")
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind != "default":
        raise ValueError(f"rope scaling {kind!r} is not supported; supported: 'default'")
    if "rope_theta" in rope:
        return real(rope, "rope_theta", positive=True)
    return real(hf, "rope_theta", 10000.0, positive=True)


def config(hf: dict) -> DecoderConfig:
    """A config.json -> the qkv config of the same decoder."""
    require(hf, "Llama", attention_bias=(False,), mlp_bias=(False,), hidden_act=("silu",))
    width, heads = whole(hf, "hidden_size"), whole(hf, "num_attention_heads")
    kv_heads = whole(hf, "num_key_value_heads", heads)
    divides(hf, "num_key_value_heads", "num_attention_heads", kv_heads, heads)
    head_dim = whole(hf, "head_dim", None)
    if head_dim is None:
        divides(hf, "num_attention_heads", "hidden_size", heads, width)
    return DecoderConfig(
        vocab_size=whole(hf, "vocab_size"),
        num_layers=whole(hf, "num_hidden_layers"),
        max_positions=whole(hf, "max_position_embeddings", 2048),
        position="rotary",
        rope_base=_rope_theta(hf),
        tie_embeddings=flag(hf, "tie_word_embeddings", False),
        block=BlockConfig(
            width=width,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim or width // heads,
            mlp_hidden=whole(hf, "intermediate_size"),
            mlp="swiglu",
            norm="rmsnorm",
            norm_eps=real(hf, "rms_norm_eps", 1e-6),
            bias=False,
        ),
    )


def hf_config(cfg: DecoderConfig) -> dict:
    """The config.json of a Llama-shaped decoder (LlamaForCausalLM). Dropout is not
    written: a Llama config.json has none where qkv puts it (a training setting only).

    >>> cfg = DecoderConfig(vocab_size=50, num_layers=2, position="rotary", block=BlockConfig(
    ...     width=16, num_heads=4, num_kv_heads=2, head_dim=4, mlp_hidden=40, mlp="swiglu",
    ...     norm="rmsnorm", bias=False))
    >>> hf = hf_config(cfg)
    >>> hf["num_key_value_heads"], "head_dim" in hf, config(hf) == cfg
    (2, False, True)
    """
    block = cfg.block
    fits("Llama", cfg, position="rotary", type_vocab_size=0, embed_norm=False,
         embed_scale=False, has_final_norm=True, lm_head_bias=False, cross_attention=False,
         block__norm="rmsnorm", block__norm_position="pre", block__bias=False,
         block__fused_qkv=False, block__mlp="swiglu")  # fmt: skip
    hf = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": cfg.vocab_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": block.num_heads,
        "num_key_value_heads": block.kv_heads,
        "hidden_size": block.width,
        "intermediate_size": block.mlp_hidden or 4 * block.width,
        "max_position_embeddings": cfg.max_positions,
        "rms_norm_eps": block.norm_eps,
        "rope_theta": cfg.rope_base,
        "hidden_act": "silu",
        "tie_word_embeddings": cfg.tie_embeddings,
        "attention_bias": False,
        "mlp_bias": False,
    }
    if block.head_size != block.width // block.num_heads:  # written only where it differs
        hf["head_dim"] = block.head_size
    return hf


TEMPLATES = [
    ("embed.tokens.weight", "model.embed_tokens.weight"),
    ("norm.weight", "model.norm.weight"),
    ("blocks.{}.attn_norm.weight", "model.layers.{}.input_layernorm.weight"),
    ("blocks.{}.attn.q.weight", "model.layers.{}.self_attn.q_proj.weight"),
    ("blocks.{}.attn.k.weight", "model.layers.{}.self_attn.k_proj.weight"),
    ("blocks.{}.attn.v.weight", "model.layers.{}.self_attn.v_proj.weight"),
    ("blocks.{}.attn.out.weight", "model.layers.{}.self_attn.o_proj.weight"),
    ("blocks.{}.mlp_norm.weight", "model.layers.{}.post_attention_layernorm.weight"),
    ("blocks.{}.mlp.gate.weight", "model.layers.{}.mlp.gate_proj.weight"),
    ("blocks.{}.mlp.up.weight", "model.layers.{}.mlp.up_proj.weight"),
    ("blocks.{}.mlp.down.weight", "model.layers.{}.mlp.down_proj.weight"),
]


def weights(cfg: DecoderConfig) -> list[Weight]:
    out = expand(TEMPLATES, cfg.num_layers)
    if not cfg.tie_embeddings:
        out += expand([("lm_head.weight", "lm_head.weight")], 0)
    return out


FAMILY = Family(
    "llama", ("llama", "mistral"), Decoder, config, hf_config, weights,
    ignored=(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq",),
)  # fmt: skip
