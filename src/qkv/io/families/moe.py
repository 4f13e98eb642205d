"""Mixtral and Qwen3-MoE: Llama-shaped decoders (qkv.io.families.llama) whose MLP is a
mixture of experts (`qkv.nn.experts.MoE`).

Mixtral is Mistral with every layer's MLP replaced by E experts, a token going to the top
k of a softmax router, their weights renormalized to sum to 1; its window (sliding_window,
null by default) slides on every layer. Qwen3-MoE is Qwen3 (a per-head RMSNorm of queries
and keys) with the same router, renormalized only with norm_topk_prob, its weights rounded
to the hidden dtype; layer i has experts iff (i + 1) % decoder_sparse_step == 0 and i is
not in mlp_only_layers, the others a dense SwiGLU of intermediate_size. Its window slides
on every layer where use_sliding_window is set (max_window_layers and layer_types, which
Qwen3 reads, are not used by transformers' Qwen3-MoE).

Both checkpoints keep each expert's matrices apart; qkv stacks them (`common.expert_weights`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import fields, replace

from qkv.io.families import llama
from qkv.io.families.checks import ConfigValueError, flag, whole
from qkv.io.families.common import Family, Weight, expert_weights, fits, require
from qkv.models import Decoder, DecoderConfig
from qkv.nn.experts import Experts
from qkv.nn.routing import Routing

ROUTER_INERT = ("output_router_logits", "router_aux_loss_coef")  # training only
EXPERT_COUNTS = ("num_experts", "num_local_experts")  # one setting, two spellings


def num_experts(hf: Mapping, default: int) -> int:
    """E: transformers' config classes store num_experts as num_local_experts (to_dict
    writes that), hub files write num_experts. The two classes disagree on which wins where
    both are given, so two different values are refused."""
    given = [whole(hf, key, None) for key in EXPERT_COUNTS]
    values = {v for v in given if v is not None}
    if len(values) > 1:
        raise ConfigValueError(
            "num_experts",
            f"({given[0]}) and num_local_experts ({given[1]}) differ; they are one setting",
        )
    return values.pop() if values else default


def check_experts(family: str, cfg: DecoderConfig, ours: Callable[[Experts], Experts]) -> Experts:
    """The config's experts, refused unless they are the family's (`ours`: the family's
    experts of the same sizes), naming each field that differs."""
    experts = cfg.block.experts
    if experts is None:
        raise ValueError(f"a {family} config.json cannot hold a model without experts")
    expected = ours(experts)
    needed = {f"block__experts__{f.name}": getattr(expected, f.name)
              for f in fields(expected) if f.name != "routing"}  # fmt: skip
    needed |= {f"block__experts__routing__{f.name}": getattr(expected.routing, f.name)
               for f in fields(expected.routing)}  # fmt: skip
    fits(family, cfg, **needed)
    return experts


def moe_weights(
    cfg: DecoderConfig, router: tuple[str, ...], experts: tuple[str, ...], whole=("", "")
) -> list[Weight]:
    """A Llama-shaped weight map whose MoE layers have a router and stacked experts instead
    of the dense MLP: `router` (its aliases) and `experts` (gate, up, down) are checkpoint
    names with "{n}" for the layer and "{e}" for the expert; whole: the stacked experts'
    one-tensor names (transformers' in-memory gate_up_proj and down_proj), with "{n}"."""
    moe = [n for n in range(cfg.num_layers) if cfg.moe_layers is None or cfg.moe_layers[n]]
    dense_mlp = tuple(f"blocks.{n}.mlp." for n in moe)
    out = [w for w in llama.weights(cfg) if not w.qkv.startswith(dense_mlp)]
    for n in moe:
        names = [name.format(n=n, e="{e}") for name in experts]
        out.append(Weight(f"blocks.{n}.mlp.router.weight", tuple(r.format(n=n) for r in router)))
        out += expert_weights(f"blocks.{n}.mlp", cfg.block.experts.routing.num_experts, *names,
                              whole=tuple(w.format(n=n) for w in whole))  # fmt: skip
    return out


# ---- Mixtral --------------------------------------------------------------------------------


def mixtral_experts(hf: Mapping) -> Experts:
    E = num_experts(hf, 8)
    top_k = whole(hf, "num_experts_per_tok", 2)
    if top_k > E:
        raise ConfigValueError("num_experts_per_tok", f"({top_k}) must be at most {E} experts")
    return Experts(Routing(E, top_k), hidden=whole(hf, "intermediate_size"))


def mixtral_config(hf: dict) -> DecoderConfig:
    """A Mixtral config.json -> the qkv config: every layer a mixture of experts, a window on
    every layer where sliding_window is set (MixtralConfig's default: none)."""
    return llama.read_decoder(hf, "Mixtral", max_positions=4096 * 32, tie=False,
                              rope_base=1000000.0, bias=False, experts=mixtral_experts(hf),
                              window=llama.sliding_window(hf, None))  # fmt: skip


def mixtral_hf_config(cfg: DecoderConfig) -> dict:
    experts = check_experts("Mixtral", cfg, lambda x: Experts(
        Routing(x.routing.num_experts, x.routing.top_k), x.hidden))  # fmt: skip
    llama.check_fits("Mixtral", cfg, layer_types=None, rope_layers=None, moe_layers=None,
                     dense_mlp_hidden=None, block__bias=False, block__qkv_bias=None,
                     block__qk_norm=None, block__mlp_hidden=experts.hidden)  # fmt: skip
    return llama.hf_decoder(cfg, "mixtral", "MixtralForCausalLM") | {
        "sliding_window": cfg.block.window,
        "num_local_experts": experts.routing.num_experts,
        "num_experts_per_tok": experts.routing.top_k,
    }


def mixtral_weights(cfg: DecoderConfig) -> list[Weight]:
    """Mistral's map, with block_sparse_moe's router and per-expert w1 (gate), w3 (up) and
    w2 (down) for the MLP; the router and stacked experts under transformers' in-memory
    names (mlp.gate, mlp.experts.gate_up_proj, mlp.experts.down_proj) are read too."""
    moe = "model.layers.{n}.block_sparse_moe"
    return moe_weights(
        cfg, (f"{moe}.gate.weight", "model.layers.{n}.mlp.gate.weight"),
        tuple(f"{moe}.experts.{{e}}.{w}.weight" for w in ("w1", "w3", "w2")),
        whole=("model.layers.{n}.mlp.experts.gate_up_proj",
               "model.layers.{n}.mlp.experts.down_proj"),
    )  # fmt: skip


MIXTRAL = Family(
    "mixtral", ("mixtral",), Decoder, mixtral_config, mixtral_hf_config, mixtral_weights,
    ignored=llama.IGNORED, config_classes=("MixtralConfig",),
    reads=(*llama.READS, "sliding_window", "num_experts_per_tok", *EXPERT_COUNTS),
    # stored by transformers but unused by its Mixtral: jitter is for training only
    inert=(*llama.INERT, *ROUTER_INERT, "router_jitter_noise", "layer_types",
           "max_window_layers"),
)  # fmt: skip


# ---- Qwen3-MoE ------------------------------------------------------------------------------


def qwen3_moe_layers(hf: Mapping) -> tuple[bool, ...] | None:
    """Whether each layer is a mixture of experts, as transformers decides: (i + 1) %
    decoder_sparse_step == 0 and i not in mlp_only_layers (None: every layer is)."""
    layers = whole(hf, "num_hidden_layers")
    step = whole(hf, "decoder_sparse_step", 1)
    dense = hf.get("mlp_only_layers")
    dense = [] if dense is None else dense
    if not isinstance(dense, list) or any(type(i) is not int or i < 0 for i in dense):
        raise ConfigValueError("mlp_only_layers", f"must list layer indices, got {dense!r}")
    moe = tuple(i not in dense and (i + 1) % step == 0 for i in range(layers))
    return None if all(moe) else moe


def qwen3_moe_experts(hf: Mapping) -> Experts:
    E = num_experts(hf, 128)
    top_k = whole(hf, "num_experts_per_tok", 8)
    if top_k > E:
        raise ConfigValueError("num_experts_per_tok", f"({top_k}) must be at most {E} experts")
    routing = Routing(E, top_k, normalize=flag(hf, "norm_topk_prob", False),
                      weights_dtype="input")  # fmt: skip
    return Experts(routing, hidden=whole(hf, "moe_intermediate_size", 768))


def qwen3_moe_config(hf: dict) -> DecoderConfig:
    """A Qwen3-MoE config.json -> the qkv config: Qwen3's attention (head_dim, when given;
    else hidden_size / num_attention_heads), a window on every layer with
    use_sliding_window, experts where `qwen3_moe_layers` says, dense MLPs elsewhere."""
    require(hf, "Qwen3-MoE", attention_bias=(False,))
    if "head_dim" in hf and hf["head_dim"] is None:  # transformers would fail on it
        raise ConfigValueError("head_dim", "must be a whole number or absent, got None")
    window = llama.sliding_window(hf, 4096)  # read either way, so a wrong kind fails
    window = window if flag(hf, "use_sliding_window", False) else None
    experts = qwen3_moe_experts(hf)
    cfg = llama.read_decoder(hf, "Qwen3-MoE", max_positions=32768, tie=False, bias=False,
                             qk_norm="head", window=window, experts=experts)  # fmt: skip
    return replace(cfg, moe_layers=qwen3_moe_layers(hf))


def qwen3_moe_hf_config(cfg: DecoderConfig) -> dict:
    """Dense layers are written as mlp_only_layers (decoder_sparse_step 1)."""
    experts = check_experts("Qwen3-MoE", cfg, lambda x: Experts(Routing(
        x.routing.num_experts, x.routing.top_k, normalize=x.routing.normalize,
        weights_dtype="input"), x.hidden))  # fmt: skip
    llama.check_fits("Qwen3-MoE", cfg, layer_types=None, rope_layers=None,
                     dense_mlp_hidden=None, block__bias=False, block__qkv_bias=None,
                     block__qk_norm="head")  # fmt: skip
    moe = cfg.moe_layers or (True,) * cfg.num_layers
    return llama.hf_decoder(cfg, "qwen3_moe", "Qwen3MoeForCausalLM") | {
        "head_dim": cfg.block.head_size,
        "attention_bias": False,
        "use_sliding_window": cfg.block.window is not None,
        "sliding_window": cfg.block.window,
        "num_experts": experts.routing.num_experts,
        "num_experts_per_tok": experts.routing.top_k,
        "norm_topk_prob": experts.routing.normalize,
        "moe_intermediate_size": experts.hidden,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [i for i, m in enumerate(moe) if not m],
    }


def qwen3_moe_weights(cfg: DecoderConfig) -> list[Weight]:
    """Qwen3's map, with mlp.gate (the router) and per-expert gate_proj, up_proj and
    down_proj on the MoE layers; the stacked experts' in-memory names are read too."""
    layer = "model.layers.{n}.mlp"
    return moe_weights(
        cfg, (f"{layer}.gate.weight",),
        tuple(f"{layer}.experts.{{e}}.{w}_proj.weight" for w in ("gate", "up", "down")),
        whole=(f"{layer}.experts.gate_up_proj", f"{layer}.experts.down_proj"),
    )  # fmt: skip


QWEN3_MOE = Family(
    "qwen3_moe", ("qwen3_moe",), Decoder, qwen3_moe_config, qwen3_moe_hf_config,
    qwen3_moe_weights, ignored=llama.IGNORED, config_classes=("Qwen3MoeConfig",),
    reads=(*llama.READS, "attention_bias", "use_sliding_window", "sliding_window",
           "decoder_sparse_step", "mlp_only_layers", "num_experts_per_tok", *EXPERT_COUNTS,
           "norm_topk_prob", "moe_intermediate_size"),
    # Qwen3's layer keys, which transformers' Qwen3-MoE stores but never uses
    inert=(*llama.INERT, *ROUTER_INERT, "max_window_layers", "layer_types"),
)  # fmt: skip
