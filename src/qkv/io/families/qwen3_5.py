"""Qwen3.5 (dense and MoE) and what it shares with Qwen3-Next (qkv.io.families.qwen3_next):
decoders where three of every four layers attend linearly and the fourth with a softmax.

- A linear layer ("linear_attention") is a Gated DeltaNet (`qkv.nn.delta.GatedDeltaNet`,
  per-head fade, SiLU gate): each value head keeps a memory of the text, written token by
  token under L2-normalized keys; its sizes are the linear_* keys (linear_num_value_heads
  memories, read through linear_num_key_heads query/key heads), its convolution
  linear_conv_kernel_dim tokens wide. The conv's activation is hidden_act (SiLU).
- A full layer ("full_attention") is Qwen3's attention (per-head QK-norm, head_dim 256 by
  default) with an output gate: q_proj makes each head's query and, beside it, a gate whose
  sigmoid multiplies the head's output before o_proj (`BlockConfig.output_gate`; qkv keeps
  the two as `attn.q` and `attn.gate`, each head's rows taken from q_proj, `Rows`).
- Rotary positions turn the first partial_rotary_factor (0.25 by default) of each head.
  Qwen3.5's are multimodal (mrope_section: some frequencies follow an image's height or
  width), but a text's three position axes are equal, where mrope is plain rope: qkv reads
  text only.
- Every RMSNorm of the blocks, of the QK-norm and the final one scales by 1 + weight (the
  weight stored centred on 0, Gemma's `rmsnorm_plus1`); the linear layers' gated norm by
  its weight itself.
- Qwen3.5-MoE: every MLP a mixture of experts (softmax router, weights renormalized) beside a
  shared expert whose output is gated by a sigmoid of the token (`Experts.shared_gate`).

The multimodal checkpoints (`qwen3_5`, `qwen3_5_moe`: Qwen3_5ForConditionalGeneration, the
hub's) are read as their text model: the config's text_config, the weights under
model.language_model, the vision tower and the multi-token-prediction head left unread.
"""

from __future__ import annotations

from collections import ChainMap
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

import torch

from qkv.io.families.checks import ConfigValueError, divides, flag, real, whole
from qkv.io.families.common import Family, Rows, Weight, expert_weights, fits, require
from qkv.io.families.rotary import read_rope
from qkv.models import Decoder, DecoderConfig
from qkv.nn import BlockConfig
from qkv.nn.delta import DeltaConfig
from qkv.nn.experts import Experts
from qkv.nn.routing import Routing

LAYER_TYPES = {"linear_attention": "linear", "full_attention": "full"}
LINEAR_KEYS = ("linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim",
               "linear_num_key_heads", "linear_num_value_heads")  # fmt: skip
READS = (
    "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "hidden_act", "max_position_embeddings", "rms_norm_eps",
    "tie_word_embeddings", "rope_parameters", "rope_theta", "rope_scaling",
    "partial_rotary_factor", "attention_bias", "layer_types", "full_attention_interval",
    *LINEAR_KEYS,
)  # fmt: skip
INERT = ("attention_dropout", "bos_token_id", "eos_token_id", "pad_token_id",
         "initializer_range", "use_cache")  # fmt: skip
MOE_READS = ("num_experts", "num_experts_per_tok", "moe_intermediate_size",
             "shared_expert_intermediate_size")  # fmt: skip
ROUTER_INERT = ("output_router_logits", "router_aux_loss_coef")  # training only
# the multimodal wrapper's keys of its own: text_config is read, the rest belong to images
WRAPPER_INERT = ("vision_config", "image_token_id", "video_token_id", "vision_start_token_id",
                 "vision_end_token_id")  # fmt: skip
# rotary keys of other families' spellings, which a wrapper's top level must not hold either
OTHER_ROPE_KEYS = ("rotary_emb_base", "rotary_pct", "global_rope_theta", "local_rope_theta",
                   "rope_local_base_freq")  # fmt: skip
IGNORED = (r"mtp\..*", r"model\.visual\..*")  # the next-token-after-next head; the vision tower


def text_part(hf: Mapping, family: str) -> Mapping:
    """The text model's config of a multimodal wrapper (its text_config), or hf itself. The
    wrapper's tie_word_embeddings must agree with its text model's (which ties is the text
    model's question); a text model's key at the wrapper's top level, which its text model
    never reads, is refused by name."""
    if hf.get("model_type") not in ("qwen3_5", "qwen3_5_moe"):
        return hf
    for key in (*READS, *MOE_READS, *OTHER_ROPE_KEYS, "intermediate_size"):
        if key != "tie_word_embeddings" and hf.get(key) is not None:
            raise ConfigValueError(
                key,
                f"is the {family} text model's: it belongs in "
                "text_config (the text model does not read the wrapper's)",
            )
    text = hf.get("text_config")
    if not isinstance(text, Mapping):
        raise ConfigValueError("text_config", f"must be an object (the {family} text model's "
                               f"config), got {text!r}")  # fmt: skip
    outer = flag(hf, "tie_word_embeddings", False)
    inner = flag(text, "tie_word_embeddings", False)
    if outer != inner:
        raise ConfigValueError("tie_word_embeddings", f"({outer}) of the wrapper and "
                               f"({inner}) of its text_config differ")  # fmt: skip
    return text


def layer_types(hf: Mapping) -> tuple[str, ...]:
    """Each layer's "linear" or "full" attention: layer_types, or every
    full_attention_interval-th layer full (4: three linear layers, then a full one)."""
    layers = whole(hf, "num_hidden_layers")
    names = hf.get("layer_types")
    if names is None:
        every = whole(hf, "full_attention_interval", 4)
        names = ["full_attention" if (i + 1) % every == 0 else "linear_attention"
                 for i in range(layers)]  # fmt: skip
    if not isinstance(names, list | tuple) or len(names) != layers:
        raise ConfigValueError("layer_types", f"must list {layers} layer types, got {names!r}")
    odd = sorted({str(n) for n in names} - set(LAYER_TYPES))
    if odd:
        raise ConfigValueError("layer_types", f"holds {odd}; qkv computes {list(LAYER_TYPES)}")
    return tuple(LAYER_TYPES[n] for n in names)


def read(hf: Mapping, family: str, *, experts: Experts | None = None,
         moe_layers: tuple[bool, ...] | None = None, mlp_hidden: int | None = None,
         ) -> DecoderConfig:  # fmt: skip
    """The qkv config of a Qwen3.5 or Qwen3-Next text config.json (the keys they share);
    experts, moe_layers, mlp_hidden: the family's MLPs."""
    require(hf, family, hidden_act=("silu",), attention_bias=(False,))
    width, heads = whole(hf, "hidden_size"), whole(hf, "num_attention_heads")
    kv_heads = whole(hf, "num_key_value_heads", 2)
    divides(hf, "num_key_value_heads", "num_attention_heads", kv_heads, heads)
    head_dim = whole(hf, "head_dim", 256)
    eps = real(hf, "rms_norm_eps", 1e-6, positive=True)
    # transformers' default turns a quarter of each head, wherever a file says nothing
    rope = read_rope(ChainMap(hf, {"partial_rotary_factor": 0.25}), head_dim)
    if rope["rope_scaling"] is not None:
        raise ConfigValueError(
            "rope_parameters",
            f"scaling {rope['rope_scaling'].kind!r} is "
            f"not supported for {family} (its rotary is checked unscaled)",
        )
    key_heads = whole(hf, "linear_num_key_heads", 16)
    value_heads = whole(hf, "linear_num_value_heads", 32)
    divides(hf, "linear_num_key_heads", "linear_num_value_heads", key_heads, value_heads)
    linear = DeltaConfig(
        width, value_heads, key_heads, whole(hf, "linear_key_head_dim", 128),
        whole(hf, "linear_value_head_dim", 128), conv=whole(hf, "linear_conv_kernel_dim", 4),
        norm_eps=eps,
    )  # fmt: skip
    return DecoderConfig(
        vocab_size=whole(hf, "vocab_size"),
        num_layers=whole(hf, "num_hidden_layers"),
        max_positions=whole(hf, "max_position_embeddings", 32768),
        position="rotary",
        rope_base=rope["rope_base"],
        rope_dims=rope["rope_dims"],
        layer_types=layer_types(hf),
        moe_layers=moe_layers,
        tie_embeddings=flag(hf, "tie_word_embeddings", False),
        block=BlockConfig(
            width=width, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
            mlp_hidden=mlp_hidden, mlp="swiglu", norm="rmsnorm_plus1", norm_eps=eps, bias=False,
            qk_norm="head", output_gate=True, linear=linear, experts=experts,
        ),
    )  # fmt: skip


def check(family: str, cfg: DecoderConfig, **needed: Any) -> None:
    """Refuse a qkv config no Qwen3.5 or Qwen3-Next config.json describes (with `needed`,
    what this family's cannot)."""
    block, linear = cfg.block, cfg.block.linear
    if linear is None:
        raise ValueError(f"a {family} config.json cannot hold a model without linear attention")
    odd = sorted(set(cfg.layer_types or ()) - {"linear", "full"})
    if cfg.layer_types is None or odd:
        raise ValueError(f"a {family} config.json lists each layer's type, linear or full; "
                         f"this model's are {cfg.layer_types}")  # fmt: skip
    fits(family, cfg, position="rotary", type_vocab_size=0, embed_norm=False, embed_scale=False,
         has_final_norm=True, lm_head_bias=False, cross_attention=False, logit_softcap=None,
         head_scale=None, local_rope_base=None, rope_scaling=None, rope_layers=None,
         block__norm="rmsnorm_plus1", block__norm_bias=True, block__norm_position="pre",
         block__sublayer_norm=False, block__parallel=False, block__fused_qkv=False,
         block__fused_mlp=False, block__mlp="swiglu", block__attn_scale=None,
         block__softcap=None, block__bias=False, block__qkv_bias=None, block__qk_norm="head",
         block__window=None, block__chunk=None, block__sinks=False, block__temperature=None,
         block__output_gate=True, block__latent=None, block__linear__width=block.width,
         block__linear__fade="head", block__linear__fade_rank=None, block__linear__gate="silu",
         block__linear__gate_rank=None, block__linear__norm_eps=block.norm_eps,
         block__linear__l2_eps=1e-6, **needed)  # fmt: skip


def hf_text(cfg: DecoderConfig, model_type: str, architecture: str) -> dict[str, Any]:
    """The config.json keys Qwen3.5 and Qwen3-Next share."""
    block, linear = cfg.block, cfg.block.linear
    assert linear is not None and cfg.layer_types is not None
    names = {qkv: name for name, qkv in LAYER_TYPES.items()}
    return {
        "model_type": model_type,
        "architectures": [architecture],
        "vocab_size": cfg.vocab_size,
        "hidden_size": block.width,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": block.num_heads,
        "num_key_value_heads": block.kv_heads,
        "head_dim": block.head_size,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_positions,
        "rms_norm_eps": block.norm_eps,
        "tie_word_embeddings": cfg.tie_embeddings,
        "attention_bias": False,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": cfg.rope_base,
            "partial_rotary_factor": (cfg.rope_dims or block.head_size) / block.head_size,
        },
        "layer_types": [names[t] for t in cfg.layer_types],
        "linear_conv_kernel_dim": linear.conv,
        "linear_key_head_dim": linear.key_size,
        "linear_value_head_dim": linear.value_size,
        "linear_num_key_heads": linear.key_heads,
        "linear_num_value_heads": linear.heads,
    }


# ---- the weight map -------------------------------------------------------------------------


def split_rows(sizes: list[int], groups: int) -> list[torch.Tensor]:
    """The rows of each of several parameters in a checkpoint tensor made of `groups` equal
    groups, each holding a slice of every parameter side by side (`sizes`: a slice's rows).

    >>> [t.tolist() for t in split_rows([1, 2], 2)]  # rows a b b | a b b
    [[0, 3], [1, 2, 4, 5]]
    """
    step, starts = sum(sizes), [sum(sizes[:i]) for i in range(len(sizes))]
    return [torch.cat([torch.arange(g * step + s, g * step + s + n) for g in range(groups)])
            for s, n in zip(starts, sizes, strict=True)]  # fmt: skip


Name = Callable[[str], tuple[str, ...]]


def shared_rows(name: tuple[str, ...], params: list[str], sizes: list[int],
                groups: int) -> list[Weight]:  # fmt: skip
    """Weights of several parameters kept in one checkpoint tensor of `groups` groups."""
    total = sum(sizes) * groups
    return [Weight(p, name, rows=Rows(rows, total))
            for p, rows in zip(params, split_rows(sizes, groups), strict=True)]  # fmt: skip


def full_weights(n: int, cfg: DecoderConfig, name: Name) -> list[Weight]:
    """A full layer's: q_proj holds each head's query rows, then its gate rows."""
    H, D = cfg.block.num_heads, cfg.block.head_size
    layer = f"model.layers.{n}.self_attn"
    out = shared_rows(name(f"{layer}.q_proj.weight"), [f"blocks.{n}.attn.q.weight",
                      f"blocks.{n}.attn.gate.weight"], [D, D], H)  # fmt: skip
    for qkv, theirs in (("k", "k_proj"), ("v", "v_proj"), ("out", "o_proj"),
                        ("q_norm", "q_norm"), ("k_norm", "k_norm")):  # fmt: skip
        out.append(Weight(f"blocks.{n}.attn.{qkv}.weight", name(f"{layer}.{theirs}.weight")))
    return out


def linear_common(n: int, name: Name) -> list[Weight]:
    """A linear layer's weights that Qwen3.5 and Qwen3-Next name alike."""
    layer, attn = f"model.layers.{n}.linear_attn", f"blocks.{n}.attn"
    pairs = (("conv", "conv1d.weight"), ("fade_bias", "dt_bias"), ("fade_log_rate", "A_log"),
             ("norm_weight", "norm.weight"), ("out.weight", "out_proj.weight"))  # fmt: skip
    return [Weight(f"{attn}.{qkv}", name(f"{layer}.{theirs}")) for qkv, theirs in pairs]


def mlp_weights(n: int, cfg: DecoderConfig, name: Name) -> list[Weight]:
    """A dense SwiGLU, or the experts, their router and their gated shared expert."""
    layer, mlp = f"model.layers.{n}.mlp", f"blocks.{n}.mlp"
    experts = cfg.block_for(n).experts
    if experts is None:
        return [Weight(f"{mlp}.{p}.weight", name(f"{layer}.{p}_proj.weight"))
                for p in ("gate", "up", "down")]  # fmt: skip
    out = [
        Weight(f"{mlp}.router.weight", name(f"{layer}.gate.weight")),
        Weight(f"{mlp}.shared_gate.weight", name(f"{layer}.shared_expert_gate.weight")),
    ]
    out += [Weight(f"{mlp}.shared.{p}.weight", name(f"{layer}.shared_expert.{p}_proj.weight"))
            for p in ("gate", "up", "down")]  # fmt: skip
    per_expert = [f"{layer}.experts.{{e}}.{p}_proj.weight" for p in ("gate", "up", "down")]
    stacked = expert_weights(
        mlp,
        experts.routing.num_experts,
        *per_expert,
        fused=(f"{layer}.experts.gate_up_proj", f"{layer}.experts.down_proj"),
    )
    return out + [replace(w, names=tuple(a for m in w.names for a in name(m))) for w in stacked]


LinearWeights = Callable[[int, DecoderConfig, Name], list[Weight]]


def decoder_weights(cfg: DecoderConfig, name: Name, linear: LinearWeights) -> list[Weight]:
    """Every weight of a Qwen3.5 or Qwen3-Next decoder; `linear`: a linear layer's own."""
    out = [Weight("embed.tokens.weight", name("model.embed_tokens.weight")),
           Weight("norm.weight", name("model.norm.weight"))]  # fmt: skip
    for n in range(cfg.num_layers):
        layer = f"model.layers.{n}"
        out += [Weight(f"blocks.{n}.attn_norm.weight", name(f"{layer}.input_layernorm.weight")),
                Weight(f"blocks.{n}.mlp_norm.weight",
                       name(f"{layer}.post_attention_layernorm.weight"))]  # fmt: skip
        if cfg.layer_type(n) == "linear":
            out += linear_common(n, name) + linear(n, cfg, name)
        else:
            out += full_weights(n, cfg, name)
        out += mlp_weights(n, cfg, name)
    if not cfg.tie_embeddings:
        out.append(Weight("lm_head.weight", ("lm_head.weight",)))
    return out


def text_or_wrapped(name: str) -> tuple[str, ...]:
    """A text model's name and the multimodal wrapper's (its text model is
    model.language_model)."""
    return (name, name.replace("model.", "model.language_model.", 1))


def qwen3_5_linear(n: int, cfg: DecoderConfig, name: Name) -> list[Weight]:
    """Qwen3.5's linear layer: in_proj_qkv is qkv's `qkv` ([q | k | v], as the conv reads
    them), in_proj_z the gate, in_proj_b the write strength, in_proj_a the fade."""
    layer, attn = f"model.layers.{n}.linear_attn", f"blocks.{n}.attn"
    pairs = (("qkv", "in_proj_qkv"), ("gate", "in_proj_z"), ("write", "in_proj_b"),
             ("fade", "in_proj_a"))  # fmt: skip
    return [Weight(f"{attn}.{q}.weight", name(f"{layer}.{h}.weight")) for q, h in pairs]


# ---- Qwen3.5 --------------------------------------------------------------------------------


def config(hf: dict) -> DecoderConfig:
    """A Qwen3.5 config.json (qwen3_5_text, or the multimodal qwen3_5's text_config) -> the
    qkv config: a dense SwiGLU MLP of intermediate_size in every layer."""
    text = text_part(hf, "Qwen3.5")
    return read(text, "Qwen3.5", mlp_hidden=whole(text, "intermediate_size", 12288))


def hf_config(cfg: DecoderConfig) -> dict:
    check("Qwen3.5", cfg, moe_layers=None, block__experts=None)
    return hf_text(cfg, "qwen3_5_text", "Qwen3_5ForCausalLM") | {
        "intermediate_size": cfg.block.mlp_hidden or 4 * cfg.block.width,
    }


def weights(cfg: DecoderConfig) -> list[Weight]:
    return decoder_weights(cfg, text_or_wrapped, qwen3_5_linear)


FAMILY = Family(
    "qwen3_5", ("qwen3_5_text", "qwen3_5"), Decoder, config, hf_config, weights,
    ignored=IGNORED, config_classes=("Qwen3_5TextConfig", "Qwen3_5Config"),
    reads=(*READS, "intermediate_size", "text_config"), inert=(*INERT, *WRAPPER_INERT),
)  # fmt: skip


# ---- Qwen3.5-MoE ----------------------------------------------------------------------------


def moe_experts(hf: Mapping, normalize: bool) -> Experts:
    """The experts of a Qwen3-Next or Qwen3.5-MoE config.json: a softmax router's top k,
    weights rounded to the input's dtype, and a shared expert gated by a sigmoid."""
    E = whole(hf, "num_experts", 512)
    top_k = whole(hf, "num_experts_per_tok", 10)
    if top_k > E:
        raise ConfigValueError("num_experts_per_tok", f"({top_k}) must be at most {E} experts")
    routing = Routing(E, top_k, normalize=normalize, weights_dtype="input")
    return Experts(routing, hidden=whole(hf, "moe_intermediate_size", 512),
                   shared_hidden=whole(hf, "shared_expert_intermediate_size", 512),
                   shared_gate=True)  # fmt: skip


def hf_experts(experts: Experts) -> dict[str, Any]:
    return {
        "num_experts": experts.routing.num_experts,
        "num_experts_per_tok": experts.routing.top_k,
        "moe_intermediate_size": experts.hidden,
        "shared_expert_intermediate_size": experts.shared_hidden,
    }


def expected_experts(experts: Experts, normalize: bool) -> dict[str, Any]:
    """The fits() fields that an Experts must have to be a Qwen3-Next / Qwen3.5-MoE one."""
    r = experts.routing
    return {"block__experts": Experts(Routing(r.num_experts, r.top_k, normalize=normalize,
            weights_dtype="input"), experts.hidden, shared_hidden=experts.shared_hidden,
            shared_gate=True)}  # fmt: skip


def moe_config(hf: dict) -> DecoderConfig:
    """A Qwen3.5-MoE config.json (qwen3_5_moe_text, or the multimodal qwen3_5_moe's
    text_config) -> the qkv config: every MLP the experts, their weights renormalized."""
    text = text_part(hf, "Qwen3.5-MoE")
    return read(text, "Qwen3.5-MoE", experts=moe_experts(text, normalize=True))


def moe_hf_config(cfg: DecoderConfig) -> dict:
    experts = cfg.block.experts
    if experts is None:
        raise ValueError("a Qwen3.5-MoE config.json cannot hold a model without experts")
    check("Qwen3.5-MoE", cfg, moe_layers=None, block__mlp_hidden=None,
          **expected_experts(experts, True))  # fmt: skip
    return hf_text(cfg, "qwen3_5_moe_text", "Qwen3_5MoeForCausalLM") | hf_experts(experts)


MOE = Family(
    "qwen3_5_moe", ("qwen3_5_moe_text", "qwen3_5_moe"), Decoder, moe_config, moe_hf_config,
    weights, ignored=IGNORED, config_classes=("Qwen3_5MoeTextConfig", "Qwen3_5MoeConfig"),
    reads=(*READS, *MOE_READS, "text_config"), inert=(*INERT, *ROUTER_INERT, *WRAPPER_INERT),
)  # fmt: skip
