"""Kimi Linear (Moonshot AI): a decoder whose layers are mostly linear attention (KDA), with a
full-attention layer now and then that is DeepSeek's latent attention without positions, and
DeepSeek-V3's mixture of experts.

What it holds, layer by layer (`layer_types`, or the checkpoint's linear_attn_config, whose
kda_layers and full_attn_layers count layers from 1):
- a KDA layer ("linear"): the gated delta rule with a fade per key channel (`qkv.nn.delta`,
  fade="channel"): a low-rank fade (f_a_proj, f_b_proj) with a bias per channel (dt_bias) and
  a rate per head (A_log), a sigmoid write strength (b_proj), a sigmoid output gate through a
  low-rank step (g_a_proj, g_b_proj), queries, keys and values each through a short causal
  convolution; the checkpoint keeps q, k and v, and their convolutions, as three tensors each,
  which qkv joins into one;
- a full layer: multi-head latent attention (`qkv.nn.latent`) with no rotary positions at all
  (NoPE): the qk_rope_head_dim part of each key is one more part all heads share, unturned; the
  scale is qk_head_dim**-0.5;
- MLPs: dense in the first layers (first_k_dense_replace, or mlp_layer_types), then DeepSeek's
  experts: sigmoid scores, a correction bias for choosing only, groups, renormalized weights
  times routed_scaling_factor, and shared experts.

The model has no position embedding: the KDA layers' memory and convolution carry order.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from qkv.io.families.checks import ConfigValueError, flag, real, whole
from qkv.io.families.common import (
    Family,
    Layout,
    Parts,
    Template,
    Weight,
    expand,
    expert_weights,
    fits,
)
from qkv.models import Decoder, DecoderConfig
from qkv.nn import BlockConfig
from qkv.nn.delta import DeltaConfig
from qkv.nn.experts import Experts
from qkv.nn.latent import LatentConfig
from qkv.nn.routing import Routing

NAME = "Kimi Linear"
# KimiLinearAttention's q_a_layernorm and kv_a_layernorm keep the class default, whatever
# rms_norm_eps says; the KDA layers' L2 norm of queries and keys is FLA's, eps 1e-6
LATENT_NORM_EPS = 1e-6
L2_EPS = 1e-6
# transformers' other names of KimiLinearConfig's keys (its attribute_map): a file may use
# either; where it holds both, the first wins, as transformers reads it
ALIASES = {
    "model_max_length": "max_position_embeddings",
    "moe_renormalize": "norm_topk_prob",
    "num_expert_group": "n_group",
    "num_experts": "num_local_experts",
    "num_experts_per_token": "num_experts_per_tok",
    "num_shared_experts": "n_shared_experts",
}
LINEAR = ("head_dim", "num_heads", "short_conv_kernel_size")  # linear_attn_config's sizes

READS = (
    "vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size",
    "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "num_shared_experts",
    "routed_scaling_factor", "kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "v_head_dim",
    "qk_nope_head_dim", "num_expert_group", "topk_group", "num_experts_per_token",
    "moe_renormalize", "hidden_act", "model_max_length", "rms_norm_eps", "attention_bias",
    "num_experts", "mlp_layer_types", "layer_types", "linear_head_dim", "linear_num_heads",
    "linear_conv_kernel_dim", *ALIASES.values(),
    # the hub's config.json (Moonshot's own code) adds these
    "linear_attn_config", "first_k_dense_replace", "moe_router_activation_func",
    "moe_layer_freq", "use_grouped_topk", "mla_use_nope", "quantization_config",
)  # fmt: skip
INERT = (
    "output_router_logits", "initializer_range", "use_cache", "pad_token_id", "bos_token_id",
    "eos_token_id", "pretraining_tp", "attention_dropout",
    # KimiLinearForCausalLM ties nothing (its _tied_weights_keys is empty): lm_head is its own
    "tie_word_embeddings",
    # derived (qk_nope_head_dim + qk_rope_head_dim; qk_rope_head_dim): the model recomputes them
    "qk_head_dim", "head_dim",
    "num_nextn_predict_layers",  # multi-token prediction modules: not part of the decoder
    # the full layers turn nothing (NoPE): no rotary frequencies or scaling enter
    "rope_theta", "rope_scaling",
)  # fmt: skip


def _key(hf: Mapping, name: str) -> str:
    """The key a file gives `name` under: its own, else its alias, else its own (missing)."""
    alias = ALIASES.get(name)
    return alias if name not in hf and alias is not None and alias in hf else name


def _whole(hf: Mapping, name: str, default: Any, minimum: int = 1) -> Any:
    """A whole number under its own key or its alias; null is refused, not defaulted, where
    transformers cannot run without one."""
    key = _key(hf, name)
    if key in hf and hf[key] is None and default is not None:
        raise ConfigValueError(key, f"must be a whole number >= {minimum}, got None")
    return whole(hf, key, default, minimum=minimum)


def _list(hf: Mapping, key: str, allowed: tuple[str, ...], layers: int) -> list[str] | None:
    """A per-layer list of names (layer_types, mlp_layer_types), None where the file has none."""
    given = hf.get(key)
    if given is None:
        return None
    if (
        not isinstance(given, list)
        or len(given) != layers
        or any(not isinstance(v, str) or v not in allowed for v in given)
    ):
        raise ConfigValueError(key, f"must list one of {', '.join(allowed)} for each of the "
                               f"{layers} layers, got {given!r}")  # fmt: skip
    return given


def _linear_attn_config(hf: Mapping) -> Mapping:
    given = hf.get("linear_attn_config")
    if given is None:
        return {}
    if not isinstance(given, Mapping):
        raise ConfigValueError("linear_attn_config", f"must be a mapping, got {given!r}")
    return given


def _layer_types(hf: Mapping, layers: int, linear_config: Mapping) -> list[str]:
    """As transformers reads them: layer_types, else linear_attn_config's kda_layers and
    full_attn_layers (counted from 1), else every 4th layer from layer 4 full."""
    given = _list(hf, "layer_types", ("linear_attention", "full_attention"), layers)
    if given is not None:
        return given
    if "full_attn_layers" in linear_config and "kda_layers" in linear_config:
        types: list[str | None] = [None] * layers
        for key, kind in (("full_attn_layers", "full_attention"),
                          ("kda_layers", "linear_attention")):  # fmt: skip
            numbers = linear_config[key]
            if not isinstance(numbers, list) or any(
                type(n) is not int or not 1 <= n <= layers for n in numbers
            ):
                raise ConfigValueError("linear_attn_config", f"{key} must list layers from 1 "
                                       f"to {layers}, got {numbers!r}")  # fmt: skip
            for n in numbers:
                types[n - 1] = kind
        if None in types:
            raise ConfigValueError("linear_attn_config", "names no kind for layer "
                                   f"{types.index(None) + 1} (counted from 1)")  # fmt: skip
        return types  # type: ignore[return-value]
    return ["full_attention" if i and i % 4 == 0 else "linear_attention" for i in range(layers)]


def _mlp_layers(hf: Mapping, layers: int) -> tuple[bool, ...]:
    """Which layers' MLPs are experts: mlp_layer_types, else all after first_k_dense_replace."""
    given = _list(hf, "mlp_layer_types", ("dense", "sparse"), layers)
    if given is not None:
        return tuple(kind == "sparse" for kind in given)
    dense = whole(hf, "first_k_dense_replace", 1, minimum=0)
    return tuple(i >= dense for i in range(layers))


def _experts(hf: Mapping) -> Experts:
    """DeepSeek-V3's router and experts, under Kimi's names (KimiLinearTopkRouter)."""
    E = _whole(hf, "num_experts", 256, minimum=2)  # transformers scores the top two always
    k = _whole(hf, "num_experts_per_token", 8)
    groups = _whole(hf, "num_expert_group", 1)
    chosen = _whole(hf, "topk_group", 1)
    if E % groups:
        raise ConfigValueError(_key(hf, "num_expert_group"), f"({groups}) must divide "
                               f"num_experts ({E})")  # fmt: skip
    if groups > 1 and E // groups < 2:
        raise ConfigValueError(_key(hf, "num_expert_group"), f"({groups}) leaves groups of "
                               "one expert; a group scores the sum of its top two")  # fmt: skip
    if chosen > groups:
        raise ConfigValueError("topk_group", f"({chosen}) must be at most num_expert_group "
                               f"({groups})")  # fmt: skip
    if k > chosen * (E // groups):
        raise ConfigValueError(_key(hf, "num_experts_per_token"), f"({k}) is more than the "
                               f"{chosen * (E // groups)} experts of {chosen} groups")  # fmt: skip
    if not flag(hf, "use_grouped_topk", True) and groups > 1:
        raise ConfigValueError("use_grouped_topk", "is false with groups of experts: "
                               "transformers always chooses among the best groups")  # fmt: skip
    renormalize = _key(hf, "moe_renormalize")  # tested by truth: null reads as false
    normalize = False if renormalize in hf and hf[renormalize] is None else flag(
        hf, renormalize, True
    )  # fmt: skip
    routing = Routing(
        E, k, score="sigmoid", normalize=normalize, groups=groups, groups_chosen=chosen,
        correction_bias=True, scaling=real(hf, "routed_scaling_factor", 2.446, positive=True),
        logits_dtype="float32",
    )  # fmt: skip
    hidden = whole(hf, "moe_intermediate_size", 1024)
    shared = _whole(hf, "num_shared_experts", 1)
    return Experts(routing, hidden, "silu", shared_hidden=shared * hidden)


def _linear(hf: Mapping, width: int, eps: float) -> DeltaConfig:
    """The KDA layers' sizes: linear_attn_config's where it has them (as transformers reads
    them), else linear_head_dim, linear_num_heads, linear_conv_kernel_dim."""
    sizes = _linear_attn_config(hf)
    for key in LINEAR:
        value = sizes.get(key)
        if key in sizes and (type(value) is not int or value < 1):
            raise ConfigValueError("linear_attn_config", f"{key} must be a whole number >= 1, "
                                   f"got {value!r}")  # fmt: skip
    head_dim = sizes.get("head_dim") or whole(hf, "linear_head_dim", 128)
    heads = sizes.get("num_heads") or whole(hf, "linear_num_heads", 32)
    conv = sizes.get("short_conv_kernel_size") or whole(hf, "linear_conv_kernel_dim", 4)
    return DeltaConfig(
        width, heads, heads, head_dim, head_dim, conv=conv, fade="channel", fade_rank=head_dim,
        gate="sigmoid", gate_rank=head_dim, norm_eps=eps, l2_eps=L2_EPS,
    )  # fmt: skip


def config(hf: dict) -> DecoderConfig:
    """A Kimi Linear config.json -> the qkv config of the same decoder; what qkv does not
    compute (another router function, rotary positions in the full layers, grouped key and
    value heads, quantized weights) is refused by name."""
    require = {"hidden_act": ("silu",), "moe_router_activation_func": ("sigmoid",),
               "moe_layer_freq": (1,), "mla_use_nope": (True,)}  # fmt: skip
    for key, allowed in require.items():
        value = hf.get(key, allowed[0])
        if type(value) is not type(allowed[0]) or value not in allowed:  # 1 is not True here
            raise ConfigValueError(key, f"={value!r} is not supported in {NAME} checkpoints "
                                   "(transformers computes only "
                                   f"{key}={allowed[0]!r})")  # fmt: skip
    if hf.get("quantization_config") is not None:
        raise ConfigValueError("quantization_config", f"is set: qkv reads {NAME}'s weights "
                               "unquantized")  # fmt: skip
    width, heads = whole(hf, "hidden_size"), whole(hf, "num_attention_heads")
    if whole(hf, "num_key_value_heads", heads) != heads:  # kv_b makes one head per query head
        raise ConfigValueError("num_key_value_heads", f"must equal num_attention_heads ({heads})")
    q_lora_rank = None if hf.get("q_lora_rank") is None else whole(hf, "q_lora_rank")
    latent = LatentConfig(
        width, heads, kv_lora_rank=_whole(hf, "kv_lora_rank", 512),
        qk_nope_head_dim=_whole(hf, "qk_nope_head_dim", 128),
        qk_rope_head_dim=_whole(hf, "qk_rope_head_dim", 64),
        v_head_dim=_whole(hf, "v_head_dim", 128), q_lora_rank=q_lora_rank,
        bias=flag(hf, "attention_bias", False), norm_eps=LATENT_NORM_EPS,
    )  # fmt: skip
    layers = whole(hf, "num_hidden_layers")
    kinds = _layer_types(hf, layers, _linear_attn_config(hf))
    moe_layers = _mlp_layers(hf, layers)
    eps = real(hf, "rms_norm_eps", 1e-5, positive=True)
    return DecoderConfig(
        vocab_size=whole(hf, "vocab_size"),
        num_layers=layers,
        max_positions=whole(hf, _key(hf, "model_max_length"), 1048576),
        position="none",
        tie_embeddings=False,
        layer_types=tuple("linear" if k == "linear_attention" else "full" for k in kinds),
        moe_layers=None if all(moe_layers) else moe_layers,
        block=BlockConfig(
            width=width,
            num_heads=heads,
            head_dim=latent.qk_head_dim,  # what each query and key head is made of
            mlp_hidden=whole(hf, "intermediate_size", 9216),  # the dense layers'
            mlp="swiglu",
            norm="rmsnorm",
            norm_eps=eps,
            bias=False,
            experts=_experts(hf),
            latent=latent,
            linear=_linear(hf, width, eps),
        ),
    )


def hf_config(cfg: DecoderConfig) -> dict:
    """The config.json of a Kimi Linear decoder (KimiLinearForCausalLM); a qkv config that
    one cannot describe is refused, naming what does not fit."""
    block, latent, experts, linear = (cfg.block, cfg.block.latent, cfg.block.experts,
                                      cfg.block.linear)  # fmt: skip
    if latent is None or experts is None or linear is None:
        raise ValueError(f"a {NAME} config.json holds latent attention, linear attention and "
                         f"experts; this model has latent={latent!r}, linear={linear!r}, "
                         f"experts={experts!r}")  # fmt: skip
    fits(NAME, cfg, position="none", type_vocab_size=0, embed_norm=False, embed_scale=False,
         has_final_norm=True, lm_head_bias=False, cross_attention=False, logit_softcap=None,
         tie_embeddings=False, dense_mlp_hidden=None, block__norm="rmsnorm",
         block__norm_position="pre", block__sublayer_norm=False, block__parallel=False,
         block__fused_qkv=False, block__fused_mlp=False, block__mlp="swiglu",
         block__attn_scale=None, block__softcap=None, block__num_kv_heads=None,
         block__head_dim=latent.qk_head_dim, block__bias=False, block__qkv_bias=None,
         block__window=None, block__qk_norm=None, block__chunk=None, block__sinks=False,
         block__temperature=None)  # fmt: skip
    D = linear.key_size
    fits(NAME, cfg, block__latent__width=block.width, block__latent__num_heads=block.num_heads,
         block__latent__norm_eps=LATENT_NORM_EPS, block__latent__scale=None,
         block__latent__rope_interleave=False, block__linear__width=block.width,
         block__linear__key_heads=linear.heads, block__linear__value_size=D,
         block__linear__fade="channel", block__linear__fade_rank=D,
         block__linear__gate="sigmoid", block__linear__gate_rank=D,
         block__linear__norm_eps=block.norm_eps, block__linear__l2_eps=L2_EPS)  # fmt: skip
    r = experts.routing
    shared = (experts.shared_hidden or 0) // experts.hidden
    want = Experts(Routing(r.num_experts, r.top_k, score="sigmoid", normalize=r.normalize,
                           groups=r.groups, groups_chosen=r.groups_chosen, correction_bias=True,
                           scaling=r.scaling, logits_dtype="float32"),
                   experts.hidden, "silu", shared_hidden=shared * experts.hidden)  # fmt: skip
    if experts != want or shared < 1:
        raise ValueError(f"a {NAME} config.json cannot hold these experts: {experts}; it holds "
                         f"DeepSeek's routing and at least one shared expert: {want}")  # fmt: skip
    kinds = [cfg.layer_type(i) for i in range(cfg.num_layers)]
    if set(kinds) - {"linear", "full"}:
        raise ValueError(f"a {NAME} config.json holds linear and full layers only, not "
                         f"{sorted(set(kinds) - {'linear', 'full'})}")  # fmt: skip
    moe = cfg.moe_layers or (True,) * cfg.num_layers
    numbers = {kind: [i + 1 for i, k in enumerate(kinds) if k == kind] for kind in kinds}
    return {
        "model_type": "kimi_linear",
        "architectures": ["KimiLinearForCausalLM"],
        "vocab_size": cfg.vocab_size,
        "hidden_size": block.width,
        "intermediate_size": block.mlp_hidden or 4 * block.width,
        "moe_intermediate_size": experts.hidden,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": block.num_heads,
        "num_key_value_heads": block.num_heads,
        "num_shared_experts": shared,
        "num_experts": r.num_experts,
        "routed_scaling_factor": r.scaling,
        "kv_lora_rank": latent.kv_lora_rank,
        "q_lora_rank": latent.q_lora_rank,
        "qk_rope_head_dim": latent.qk_rope_head_dim,
        "v_head_dim": latent.v_head_dim,
        "qk_nope_head_dim": latent.qk_nope_head_dim,
        "num_expert_group": r.groups,
        "topk_group": r.groups_chosen,
        "num_experts_per_token": r.top_k,
        "moe_renormalize": r.normalize,
        "hidden_act": "silu",
        "model_max_length": cfg.max_positions,
        "rms_norm_eps": block.norm_eps,
        "tie_word_embeddings": False,
        "attention_bias": latent.bias,
        "layer_types": [f"{k}_attention" for k in kinds],
        "mlp_layer_types": ["sparse" if m else "dense" for m in moe],
        "linear_attn_config": {
            "kda_layers": numbers.get("linear", []), "full_attn_layers": numbers.get("full", []),
            "head_dim": D, "num_heads": linear.heads, "short_conv_kernel_size": linear.conv,
        },
    }  # fmt: skip


# ---- weights ----------------------------------------------------------------------------

LAYER = "model.layers.{}."
ATTENTION = LAYER + "self_attn."
TEMPLATES: list[Template] = [
    ("embed.tokens.weight", "model.embed_tokens.weight"),
    ("norm.weight", "model.norm.weight"),
    ("lm_head.weight", "lm_head.weight"),
    ("blocks.{}.attn_norm.weight", LAYER + "input_layernorm.weight"),
    ("blocks.{}.mlp_norm.weight", LAYER + "post_attention_layernorm.weight"),
    ("blocks.{}.attn.out.weight", ATTENTION + "o_proj.weight"),
]


def _latent(latent: LatentConfig) -> list[Template]:
    """A full layer's latent attention (its rows as they are: nothing turns)."""
    if latent.q_lora_rank is None:
        out: list[Template] = [("blocks.{}.attn.q.weight", ATTENTION + "q_proj.weight")]
    else:
        out = [
            ("blocks.{}.attn.q_a.weight", ATTENTION + "q_a_proj.weight"),
            ("blocks.{}.attn.q_a_norm.weight", ATTENTION + "q_a_layernorm.weight"),
            ("blocks.{}.attn.q_b.weight", ATTENTION + "q_b_proj.weight"),
        ]
    out += [
        ("blocks.{}.attn.kv_a.weight", ATTENTION + "kv_a_proj_with_mqa.weight"),
        ("blocks.{}.attn.kv_a_norm.weight", ATTENTION + "kv_a_layernorm.weight"),
        ("blocks.{}.attn.kv_b.weight", ATTENTION + "kv_b_proj.weight"),
    ]
    if latent.bias:  # attention_bias: on q_a, kv_a and o only
        if latent.q_lora_rank is not None:
            out.append(("blocks.{}.attn.q_a.bias", ATTENTION + "q_a_proj.bias"))
        out.append(("blocks.{}.attn.kv_a.bias", ATTENTION + "kv_a_proj_with_mqa.bias"))
        out.append(("blocks.{}.attn.out.bias", ATTENTION + "o_proj.bias"))
    return out


def _joined(sizes: list[int]) -> tuple:
    """(join, split) of tensors stacked along their first dimension, `sizes` rows each."""
    return (lambda parts: torch.cat(parts, 0),
            lambda whole: [t.clone() for t in whole.split(sizes, 0)])  # fmt: skip


# A_log is (1, 1, H, 1) in the checkpoint, (H,) in qkv
RATES = Layout(lambda t: t.reshape(-1), lambda t: t.reshape(1, 1, -1, 1))


def _kda(layer: int, linear: DeltaConfig) -> list[Weight]:
    """A KDA layer: q, k and v (and their convolutions) joined into one; the forget gate's
    tensors under the attention (the checkpoint's) or its own module (transformers')."""
    ours, theirs = f"blocks.{layer}.attn.", ATTENTION.format(layer)
    sizes = [linear.key_width, linear.key_width, linear.value_width]
    joined = [
        Weight(ours + "qkv.weight", (), parts=Parts(
            tuple(f"{theirs}{x}_proj.weight" for x in "qkv"), *_joined(sizes))),
        Weight(ours + "conv", (theirs + "conv1d.weight",), parts=Parts(
            tuple(f"{theirs}{x}_conv1d.weight" for x in "qkv"), *_joined(sizes))),
    ]  # fmt: skip
    gate = theirs + "forget_gate."
    return joined + expand([
        (ours + "write.weight", theirs + "b_proj.weight"),
        (ours + "fade.0.weight", (theirs + "f_a_proj.weight", gate + "f_a_proj.weight")),
        (ours + "fade.1.weight", (theirs + "f_b_proj.weight", gate + "f_b_proj.weight")),
        (ours + "fade_bias", (theirs + "dt_bias", gate + "dt_bias")),
        (ours + "fade_log_rate", (theirs + "A_log", gate + "A_log"), RATES),
        (ours + "gate.0.weight", theirs + "g_a_proj.weight"),
        (ours + "gate.1.weight", theirs + "g_b_proj.weight"),
        (ours + "norm_weight", theirs + "o_norm.weight"),
    ], 0)  # fmt: skip


def _mlp(layer: int, experts: Experts | None) -> list[Weight]:
    """One layer's MLP, dense or experts, under block_sparse_moe (the hub's experts, and what
    transformers writes for every MLP) or mlp (the hub's dense MLPs, transformers' modules)."""
    ours = f"blocks.{layer}.mlp."
    hub, module = (LAYER + "block_sparse_moe.").format(layer), (LAYER + "mlp.").format(layer)
    if experts is None:
        return expand([(f"{ours}{q}.weight", (f"{hub}{q}_proj.weight", f"{module}{q}_proj.weight"))
                       for q in ("gate", "up", "down")], 0)  # fmt: skip
    each = hub + "experts.{e}."
    stacked = expert_weights(
        ours[:-1], experts.routing.num_experts, each + "w1.weight", each + "w3.weight",
        each + "w2.weight", fused=(module + "experts.gate_up_proj", module + "experts.down_proj"),
    )  # fmt: skip
    return stacked + expand([
        (ours + "router.weight", (hub + "gate.weight", module + "gate.weight")),
        (ours + "router.correction_bias", (hub + "gate.e_score_correction_bias",
                                           module + "gate.e_score_correction_bias")),
        *[(f"{ours}shared.{q}.weight", (f"{hub}shared_experts.{q}_proj.weight",
                                        f"{module}shared_experts.{q}_proj.weight"))
          for q in ("gate", "up", "down")],
    ], 0)  # fmt: skip


def weights(cfg: DecoderConfig) -> list[Weight]:
    """The weight map: norms, each layer's attention (KDA or latent, as layer_types says) and
    MLP (dense or experts, as moe_layers says), the LM head."""
    block = cfg.block
    assert block.latent is not None and block.linear is not None, f"{NAME} has both attentions"
    out = expand(TEMPLATES, cfg.num_layers)
    latent = _latent(block.latent)
    for layer in range(cfg.num_layers):
        if cfg.layer_type(layer) == "linear":
            out += _kda(layer, block.linear)
        else:
            out += expand([(q.format(layer), h.format(layer)) for q, h in latent], 0)
        out += _mlp(layer, cfg.block_for(layer).experts)
    return out


FAMILY = Family(
    "kimi_linear", ("kimi_linear",), Decoder, config, hf_config, weights, reads=READS,
    inert=INERT, config_classes=("KimiLinearConfig",),
)  # fmt: skip
