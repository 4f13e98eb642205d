"""Gemma 4 (text, model_type "gemma4_text"): Gemma 3's decoder with layers that differ.

The sliding layers are the block as the config says it (head_dim, num_key_value_heads,
default rotary over the whole head); the full layers take per_layer_config's head_dim and
num_key_value_heads (derived by transformers from global_head_dim, default 512, and, where
attention_k_eq_v, num_global_key_value_heads) and "proportional" rotary positions. Scores
are unscaled (queries and keys are RMS-normalized per head), values RMS-normalized without a
gain, norms' gains are their weights (not 1 + weight). The last num_kv_shared_layers layers
read an earlier layer's keys and values (`qkv.models.gemma4`). Per-layer inputs, an
optional mixture of experts beside every dense MLP, a learned scalar per layer, tied
embeddings and a final soft-cap complete it. The multimodal Gemma 4 (model_type "gemma4") is
refused.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from qkv.io.families.checks import ConfigValueError, divides, flag, real, whole
from qkv.io.families.common import Family, Weight, decoder_weights, fits, require
from qkv.io.families.gemma import GATED, HF_ACTIVATION
from qkv.io.families.rotary import FULL, SLIDING
from qkv.models.gemma4 import Gemma4Config, Gemma4Decoder
from qkv.nn import BlockConfig
from qkv.nn.experts import Experts
from qkv.nn.routing import Routing

# Gemma4TextConfig's defaults, for the keys a config.json may leave out
DEFAULTS: dict[str, Any] = {
    "vocab_size": 262144, "hidden_size": 2304, "intermediate_size": 9216,
    "num_hidden_layers": 30, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
    "max_position_embeddings": 131072, "sliding_window": 512, "global_head_dim": 512,
    "hidden_size_per_layer_input": 256, "vocab_size_per_layer_input": 262144,
}  # fmt: skip
ROPE_DEFAULT = {
    SLIDING: {"rope_type": "default", "rope_theta": 10000.0},
    FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1000000.0},
}
LAYER_TYPES = {SLIDING: "sliding", FULL: "full"}
MULTIMODAL = ("multimodal Gemma 4 checkpoints (model_type 'gemma4') are not supported; qkv "
              "reads Gemma 4's text-only checkpoints (model_type 'gemma4_text')")  # fmt: skip
NAME = "Gemma 4"


def _given(hf: Mapping, key: str, read=whole) -> Any:
    return read(hf, key) if hf.get(key) is not None else DEFAULTS[key]


def _layer_types(hf: Mapping, layers: int) -> tuple[str, ...]:
    """Each layer's type, the last one full whatever the file says (as transformers forces)."""
    given = hf.get("layer_types")
    if given is None:
        given = [SLIDING if (i + 1) % 6 else FULL for i in range(layers)]
    if not isinstance(given, list) or len(given) != layers:
        raise ConfigValueError(
            "layer_types", f"must list the {layers} layers' types, got {given!r}"
        )
    odd = sorted({str(t) for t in given} - set(LAYER_TYPES))
    if odd:
        raise ConfigValueError("layer_types", f"holds {odd}; supported: {', '.join(LAYER_TYPES)}")
    return (*(LAYER_TYPES[t] for t in given[:-1]), "full")


def _full_layers(hf: Mapping, types: tuple[str, ...], k_eq_v: bool) -> tuple[int | None, ...]:
    """(head_dim, num_key_value_heads) of the full layers, None where the block's; from
    per_layer_config as given, else as transformers derives it."""
    given = hf.get("per_layer_config")
    if given is None:
        heads = whole(hf, "num_global_key_value_heads", None) if k_eq_v else None
        return _given(hf, "global_head_dim"), heads
    if not isinstance(given, Mapping):
        raise ConfigValueError("per_layer_config", f"must map layers to settings, got {given!r}")
    settings = {}
    for key, value in given.items():
        if not (isinstance(key, str) and key.isdigit() and int(key) < len(types)):
            raise ConfigValueError("per_layer_config", f"names a layer {key!r} the model lacks")
        if not isinstance(value, Mapping) or not set(value) <= {"head_dim", "num_key_value_heads"}:
            raise ValueError(
                f"{NAME} checkpoints with per_layer_config {key}: {value!r} are not supported: "
                "qkv reads head_dim and num_key_value_heads only"
            )
        settings[int(key)] = dict(value)
    for kind in set(types):
        seen = {
            tuple(sorted(settings.get(i, {}).items())) for i, t in enumerate(types) if t == kind
        }
        if len(seen) > 1 or (kind == "sliding" and seen != {()}):
            raise ValueError(f"{NAME} checkpoints whose per_layer_config differs between layers "
                             f"of one type or sets sliding layers are not supported")  # fmt: skip
    full = next((settings.get(i, {}) for i, t in enumerate(types) if t == "full"), {})
    return whole(full, "head_dim", None), whole(full, "num_key_value_heads", None)


# rotary keys of other families and of older files, which transformers' Gemma 4 never reads
OTHER_ROPE_KEYS = (
    "rope_theta",
    "rope_scaling",
    "partial_rotary_factor",
    "rope_local_base_freq",
    "rotary_emb_base",
    "rotary_pct",
    "global_rope_theta",
    "local_rope_theta",
)


def _rope(hf: Mapping, types: tuple[str, ...]) -> dict:
    for key in OTHER_ROPE_KEYS:
        if hf.get(key) is not None:
            raise ValueError(f"{NAME} checkpoints with {key} are not supported: Gemma 4 reads "
                             "its rotary settings from rope_parameters only")  # fmt: skip
    given = hf.get("rope_parameters") or ROPE_DEFAULT
    if not isinstance(given, Mapping):
        raise ConfigValueError("rope_parameters", f"must be nested by layer type, got {given!r}")
    for kind in (SLIDING, FULL):
        if LAYER_TYPES[kind] in types and not isinstance(given.get(kind), Mapping):
            raise ConfigValueError("rope_parameters", f"has no {kind} entry")
    sliding, full = dict(given.get(SLIDING) or {}), dict(given.get(FULL) or {})
    if sliding.get("rope_type", "default") != "default" or full.get("rope_type", "default") not in (
        "default", "proportional"):  # fmt: skip
        raise ValueError(f"{NAME} checkpoints with rope types {sliding.get('rope_type')!r} "
                         f"(sliding) / {full.get('rope_type')!r} (full) are not supported; qkv "
                         "computes default (both) and proportional (full)")  # fmt: skip
    proportional = full.get("rope_type") == "proportional"
    # transformers has no default base for a type its layers use
    slides, fulls = "sliding" in types, "full" in types
    return {
        "local_rope_base": real(sliding, "rope_theta", *([] if slides else [1e4]), positive=True),
        "rope_base": real(full, "rope_theta", *([] if fulls else [1e6]), positive=True),
        "full_rope_fraction": real(full, "partial_rotary_factor", 1.0) if proportional else 1.0,
        "full_rope_factor": real(full, "factor", 1.0, positive=True) if proportional else 1.0,
    }


def _experts(hf: Mapping, eps: float) -> Experts | None:
    # looked at always; without the block the sizes mean nothing, as to transformers
    sizes = [hf.get(k) for k in ("num_experts", "top_k_experts", "moe_intermediate_size")]
    if not flag(hf, "enable_moe_block", False) or not sizes:
        return None
    routing = Routing(whole(hf, "num_experts"), whole(hf, "top_k_experts"), input_norm=True,
                      norm_eps=eps, expert_scale=True)  # fmt: skip
    return Experts(routing, whole(hf, "moe_intermediate_size"), activation="gelu_tanh")


def config(hf: dict) -> Gemma4Config:
    """A Gemma 4 text config.json -> the qkv config of the same decoder."""
    kind = hf.get("model_type")
    if kind == "gemma4":
        raise ValueError(MULTIMODAL)
    if kind != "gemma4_text":
        raise ValueError(f"model_type {kind!r} is not Gemma 4's text model ('gemma4_text')")
    require(hf, NAME, attention_bias=(False,), use_bidirectional_attention=(None, "vision"))
    act = hf.get("hidden_activation", "gelu_pytorch_tanh")
    if act not in ("gelu_pytorch_tanh", "gelu_new"):
        raise ConfigValueError(
            "hidden_activation",
            f"{act!r} is not supported: qkv computes gelu_pytorch_tanh (MLP, experts, gate)",
        )
    width, heads = _given(hf, "hidden_size"), _given(hf, "num_attention_heads")
    kv_heads, num_layers = _given(hf, "num_key_value_heads"), _given(hf, "num_hidden_layers")
    divides(hf, "num_key_value_heads", "num_attention_heads", kv_heads, heads)
    types = _layer_types(hf, num_layers)
    k_eq_v = flag(hf, "attention_k_eq_v", False)
    full_head, full_kv = _full_layers(hf, types, k_eq_v)
    full_head = None if full_head == _given(hf, "head_dim") else full_head  # None: the block's
    full_kv = None if full_kv == kv_heads else full_kv
    if full_kv is not None and heads % full_kv:
        raise ConfigValueError("num_key_value_heads", f"({full_kv}, full) must divide {heads}")
    shared = whole(hf, "num_kv_shared_layers", 0, minimum=0)
    if shared >= num_layers:
        raise ValueError(f"{NAME} checkpoints whose every layer shares keys (num_kv_shared_layers"
                         f"={shared}) read them from another model; qkv cannot")  # fmt: skip
    ple = whole(hf, "hidden_size_per_layer_input", DEFAULTS["hidden_size_per_layer_input"],
                minimum=0)  # fmt: skip
    eps = real(hf, "rms_norm_eps", 1e-6, positive=True)
    cap = hf.get("final_logit_softcapping")
    return Gemma4Config(
        vocab_size=_given(hf, "vocab_size"),
        num_layers=num_layers,
        max_positions=_given(hf, "max_position_embeddings"),
        position="rotary",
        layer_types=types,
        embed_scale=True,
        embed_scale_rounded=True,
        tie_embeddings=flag(hf, "tie_word_embeddings", True),
        logit_softcap=None if cap is None else real(hf, "final_logit_softcapping", positive=True),
        **_rope(hf, types),
        full_head_dim=full_head,
        full_kv_heads=full_kv,
        values_from_keys=k_eq_v,
        kv_shared_layers=shared,
        double_wide_mlp=flag(hf, "use_double_wide_mlp", False),
        per_layer_input=ple,
        per_layer_vocab=_given(hf, "vocab_size_per_layer_input") if ple else 0,
        experts=_experts(hf, eps),
        block=BlockConfig(
            width=width,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=_given(hf, "head_dim"),
            mlp_hidden=_given(hf, "intermediate_size"),
            mlp=GATED["gelu_pytorch_tanh"],
            norm="rmsnorm",
            norm_eps=eps,
            bias=False,
            sublayer_norm=True,
            attn_scale=1.0,
            window=_given(hf, "sliding_window") if "sliding" in types else None,
            qk_norm="head",
        ),
    )


def hf_config(cfg: Gemma4Config) -> dict:
    """The config.json of a Gemma 4 decoder (with per_layer_config written out).

    >>> cfg = config({"model_type": "gemma4_text", "vocab_size": 50, "hidden_size": 16,
    ...               "intermediate_size": 24, "num_hidden_layers": 2, "head_dim": 4,
    ...               "num_attention_heads": 4, "num_key_value_heads": 2, "global_head_dim": 8,
    ...               "hidden_size_per_layer_input": 0, "layer_types": ["sliding_attention"] * 2})
    >>> cfg.layer_types, cfg.full_head_dim, cfg.block.window
    (('sliding', 'full'), 8, 512)
    >>> config(hf_config(cfg)) == cfg
    True
    """
    block = cfg.block
    if not isinstance(cfg, Gemma4Config):
        raise ValueError("a Gemma 4 config.json holds a Gemma4Config")
    fits(NAME, cfg, position="rotary", embed_scale=True, embed_scale_rounded=True,
         lm_head_bias=False, cross_attention=False, rope_dims=None, rope_scaling=None,
         block__norm="rmsnorm", block__norm_position="pre", block__bias=False,
         block__qkv_bias=None, block__fused_qkv=False, block__fused_mlp=False,
         block__parallel=False, block__sublayer_norm=True, block__qk_norm="head",
         block__attn_scale=1.0, block__softcap=None, block__mlp="geglu_tanh",
         block__chunk=None, block__sinks=False, block__temperature=None, block__experts=None,
         block__latent=None, rope_layers=None, moe_layers=None, head_scale=None)  # fmt: skip
    full = [i for i in range(cfg.num_layers) if cfg.layer_type(i) == "full"]
    width = len(str(cfg.num_layers - 1))
    per_layer = {key: value for key, value in (("head_dim", cfg.full_head_dim),
                 ("num_key_value_heads", cfg.full_kv_heads)) if value is not None}  # fmt: skip
    full_rope = {"rope_type": "proportional", "partial_rotary_factor": cfg.full_rope_fraction,
                 "rope_theta": cfg.rope_base, "factor": cfg.full_rope_factor}  # fmt: skip
    hf: dict[str, Any] = {
        "model_type": "gemma4_text",
        "architectures": ["Gemma4ForCausalLM"],
        "vocab_size": cfg.vocab_size,
        "hidden_size": block.width,
        "intermediate_size": block.mlp_hidden or 4 * block.width,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": block.num_heads,
        "num_key_value_heads": block.kv_heads,
        "head_dim": block.head_size,
        "per_layer_config": {str(i).zfill(width): dict(per_layer) for i in full if per_layer},
        "hidden_activation": HF_ACTIVATION["geglu_tanh"],
        "max_position_embeddings": cfg.max_positions,
        "rms_norm_eps": block.norm_eps,
        "tie_word_embeddings": cfg.tie_embeddings,
        "rope_parameters": {
            SLIDING: {"rope_type": "default", "rope_theta": cfg.local_rope_base},
            FULL: full_rope,
        },
        "attention_bias": False,
        "sliding_window": block.window,
        "layer_types": [f"{cfg.layer_type(i)}_attention" for i in range(cfg.num_layers)],
        "final_logit_softcapping": cfg.logit_softcap,
        "attention_k_eq_v": cfg.values_from_keys,
        "num_kv_shared_layers": cfg.kv_shared_layers,
        "use_double_wide_mlp": cfg.double_wide_mlp,
        "hidden_size_per_layer_input": cfg.per_layer_input,
        "vocab_size_per_layer_input": cfg.per_layer_vocab or cfg.vocab_size,
        "enable_moe_block": cfg.experts is not None,
    }
    if cfg.experts is not None:
        e = cfg.experts
        expected = Experts(Routing(e.routing.num_experts, e.routing.top_k, input_norm=True,
                                   norm_eps=block.norm_eps, expert_scale=True),
                           e.hidden, activation="gelu_tanh")  # fmt: skip
        if e != expected:
            raise ValueError(f"a {NAME} config.json holds Gemma 4's router and experts only")
        hf |= {"num_experts": e.routing.num_experts, "top_k_experts": e.routing.top_k,
               "moe_intermediate_size": e.hidden}  # fmt: skip
    return hf


# ---- weights --------------------------------------------------------------------------------

GLOBAL = [
    ("embed.tokens.weight", "model.embed_tokens.weight"),
    ("norm.weight", "model.norm.weight"),
]
PER_LAYER_GLOBAL = [
    ("per_layer.tokens.weight", "model.embed_tokens_per_layer.weight"),
    ("per_layer.projection.weight", "model.per_layer_model_projection.weight"),
    ("per_layer.norm.weight", "model.per_layer_projection_norm.weight"),
]
LAYER = [
    ("blocks.{}.attn_norm.weight", "model.layers.{}.input_layernorm.weight"),
    ("blocks.{}.attn.q.weight", "model.layers.{}.self_attn.q_proj.weight"),
    ("blocks.{}.attn.q_norm.weight", "model.layers.{}.self_attn.q_norm.weight"),
    ("blocks.{}.attn.out.weight", "model.layers.{}.self_attn.o_proj.weight"),
    ("blocks.{}.attn_out_norm.weight", "model.layers.{}.post_attention_layernorm.weight"),
    ("blocks.{}.mlp_norm.weight", "model.layers.{}.pre_feedforward_layernorm.weight"),
    ("blocks.{}.mlp.gate.weight", "model.layers.{}.mlp.gate_proj.weight"),
    ("blocks.{}.mlp.up.weight", "model.layers.{}.mlp.up_proj.weight"),
    ("blocks.{}.mlp.down.weight", "model.layers.{}.mlp.down_proj.weight"),
    ("blocks.{}.mlp_out_norm.weight", "model.layers.{}.post_feedforward_layernorm.weight"),
    ("blocks.{}.scalar", "model.layers.{}.layer_scalar"),
]
KEYS = [
    ("blocks.{}.attn.k.weight", "model.layers.{}.self_attn.k_proj.weight"),
    ("blocks.{}.attn.k_norm.weight", "model.layers.{}.self_attn.k_norm.weight"),
]
VALUES = [("blocks.{}.attn.v.weight", "model.layers.{}.self_attn.v_proj.weight")]
MOE = [
    ("blocks.{}.dense_out_norm.weight", "model.layers.{}.post_feedforward_layernorm_1.weight"),
    ("blocks.{}.moe_norm.weight", "model.layers.{}.pre_feedforward_layernorm_2.weight"),
    ("blocks.{}.moe_out_norm.weight", "model.layers.{}.post_feedforward_layernorm_2.weight"),
    ("blocks.{}.moe.router.weight", "model.layers.{}.router.proj.weight"),
    ("blocks.{}.moe.router.input_scale", "model.layers.{}.router.scale"),
    ("blocks.{}.moe.router.expert_scale", "model.layers.{}.router.per_expert_scale"),
    ("blocks.{}.moe.gate_up", "model.layers.{}.experts.gate_up_proj"),
    ("blocks.{}.moe.down", "model.layers.{}.experts.down_proj"),
]
PER_LAYER = [
    ("blocks.{}.per_layer_gate.weight", "model.layers.{}.per_layer_input_gate.weight"),
    ("blocks.{}.per_layer_projection.weight", "model.layers.{}.per_layer_projection.weight"),
    ("blocks.{}.per_layer_norm.weight", "model.layers.{}.post_per_layer_input_norm.weight"),
]


def _layer(templates, layer: int) -> list[Weight]:
    """Templates of one layer, expanded for that layer only."""
    return [Weight(q.format(layer), (h.format(layer),)) for q, h in templates]


def weights(cfg: Gemma4Config) -> list[Weight]:
    out = decoder_weights(GLOBAL + (PER_LAYER_GLOBAL if cfg.per_layer_input else []), cfg)
    for i in range(cfg.num_layers):
        layer = cfg.layer(i)
        templates = (
            LAYER + (MOE if layer.experts else []) + (PER_LAYER if cfg.per_layer_input else [])
        )
        if not layer.shares_keys:
            templates += KEYS + ([] if layer.values_from_keys else VALUES)
        out += _layer(templates, i)
    return out


READS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
         "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_activation",
         "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings", "rope_parameters",
         "attention_bias", "sliding_window", "layer_types", "final_logit_softcapping",
         "use_bidirectional_attention", "vocab_size_per_layer_input",
         "hidden_size_per_layer_input", "attention_k_eq_v", "num_kv_shared_layers",
         "enable_moe_block", "use_double_wide_mlp", "num_experts", "top_k_experts",
         "moe_intermediate_size", "per_layer_config", "global_head_dim",
         "num_global_key_value_heads")  # fmt: skip
INERT = ("initializer_range", "use_cache", "pad_token_id", "eos_token_id", "bos_token_id",
         "attention_dropout", "sliding_window_pattern", "dtype", "torch_dtype")  # fmt: skip
# layers that share keys have none of their own; files may hold them all the same
IGNORED = (r"model\.layers\.\d+\.self_attn\.(k_proj|v_proj|k_norm|v_norm)\.weight",)

FAMILY = Family(
    "gemma4", ("gemma4_text",), Gemma4Decoder, config, hf_config, weights, ignored=IGNORED,
    refused_types=(("gemma4", MULTIMODAL),), reads=READS, inert=INERT,
    config_classes=("Gemma4TextConfig",),
)  # fmt: skip
