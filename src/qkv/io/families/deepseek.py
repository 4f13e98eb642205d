"""DeepSeek-V3: a Llama-shaped decoder (pre-norm RMSNorm blocks, SwiGLU, rotary positions)
whose attention is multi-head latent attention (every head's keys and values made from one
compressed vector per token: `qkv.nn.latent`) and whose MLPs, after the first
first_k_dense_replace dense layers, are mixtures of experts: sigmoid scores, a correction bias
for choosing only, experts chosen among the best groups, weights renormalized and scaled, and
shared experts every token goes through (`qkv.nn.experts`, `qkv.nn.routing`).

A checkpoint keeps each expert's gate, up and down matrices as tensors of their own; qkv
stacks them into one gate_up (E, 2I, C) and one down (E, C, I) per layer (`expert_weights`).
With rope_interleave (the default) the rotary rows of q_proj (or q_b_proj) and
kv_a_proj_with_mqa come in interleaved pairs; the weight map reorders them to the halves
qkv's rotary turns, and back on export (`permuted_rows`): a permutation, so exact.
"""

from __future__ import annotations

from collections import ChainMap
from collections.abc import Mapping

import torch

from qkv.io.families.checks import ConfigValueError, flag, real, whole
from qkv.io.families.common import (
    SAME,
    Family,
    Layout,
    Template,
    Weight,
    expand,
    expert_weights,
    fits,
    permuted_rows,
    require,
)
from qkv.io.families.llama import check_fits
from qkv.io.families.rotary import hf_rope, read_rope
from qkv.models import Decoder, DecoderConfig
from qkv.nn import BlockConfig
from qkv.nn.experts import Experts
from qkv.nn.latent import LatentConfig
from qkv.nn.routing import Routing

NAME = "DeepSeek-V3"
# DeepseekV3Attention's q_a_layernorm and kv_a_layernorm keep the class default, whatever
# rms_norm_eps says
LATENT_NORM_EPS = 1e-6

READS = (
    "vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size",
    "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "n_shared_experts",
    "n_routed_experts", "routed_scaling_factor", "kv_lora_rank", "q_lora_rank",
    "qk_rope_head_dim", "v_head_dim", "qk_nope_head_dim", "n_group", "topk_group",
    "num_experts_per_tok", "first_k_dense_replace", "norm_topk_prob", "hidden_act",
    "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings", "rope_parameters",
    "rope_theta", "rope_scaling", "partial_rotary_factor", "rope_interleave", "attention_bias",
    "head_dim",
    # the hub's config.json (DeepSeek's own code) adds these
    "scoring_func", "topk_method", "moe_layer_freq", "quantization_config",
)  # fmt: skip
INERT = (
    "output_router_logits", "initializer_range", "use_cache", "pad_token_id", "bos_token_id",
    "eos_token_id", "pretraining_tp", "attention_dropout",
    "num_nextn_predict_layers",  # multi-token prediction modules: not part of the decoder
    "qk_head_dim",  # derived (qk_nope_head_dim + qk_rope_head_dim); the model recomputes it
    "seq_aux", "aux_loss_alpha", "ep_size",  # training and parallelism settings of the hub's
)  # fmt: skip


def _whole_not_null(hf: Mapping, key: str, default: int, minimum: int = 1) -> int:
    """A whole number transformers cannot run without: null is refused, not defaulted."""
    if key in hf and hf[key] is None:
        raise ConfigValueError(key, f"must be a whole number >= {minimum}, got None")
    return whole(hf, key, default, minimum=minimum)


def _flag_null_false(hf: Mapping, key: str, default: bool) -> bool:
    """A flag that transformers tests by truth (`if config.key:`), so null reads as false."""
    return False if key in hf and hf[key] is None else flag(hf, key, default)


def _experts(hf: Mapping) -> Experts:
    E = whole(hf, "n_routed_experts", 256, minimum=2)  # transformers scores the top two always
    k = _whole_not_null(hf, "num_experts_per_tok", 8)
    groups = _whole_not_null(hf, "n_group", 8)
    chosen = _whole_not_null(hf, "topk_group", 4)
    if E % groups:
        raise ConfigValueError("n_group", f"({groups}) must divide n_routed_experts ({E})")
    if groups > 1 and E // groups < 2:
        raise ConfigValueError("n_group", f"({groups}) leaves groups of one expert; a group "
                               "scores the sum of its top two")  # fmt: skip
    if chosen > groups:
        raise ConfigValueError("topk_group", f"({chosen}) must be at most n_group ({groups})")
    if k > chosen * (E // groups):
        raise ConfigValueError(
            "num_experts_per_tok",
            f"({k}) is more than the {chosen * (E // groups)} experts of {chosen} groups",
        )
    routing = Routing(
        E, k, score="sigmoid", normalize=_flag_null_false(hf, "norm_topk_prob", True),
        groups=groups, groups_chosen=chosen, correction_bias=True,
        scaling=real(hf, "routed_scaling_factor", 2.5, positive=True), logits_dtype="float32",
    )  # fmt: skip
    hidden = whole(hf, "moe_intermediate_size", 2048)
    shared = whole(hf, "n_shared_experts", 1)
    return Experts(routing, hidden, "silu", shared_hidden=shared * hidden)


def config(hf: dict) -> DecoderConfig:
    """A DeepSeek-V3 config.json -> the qkv config of the same decoder; what qkv does not
    compute (FP8 weights, another scoring function, grouped key/value heads) is refused by
    name."""
    require(hf, NAME, hidden_act=("silu",), scoring_func=("sigmoid",),
            topk_method=("noaux_tc", None), moe_layer_freq=(1,))  # fmt: skip
    if hf.get("quantization_config") is not None:
        raise ConfigValueError("quantization_config", "is set: qkv reads DeepSeek-V3's weights "
                               "unquantized (dequantize the FP8 blocks first)")  # fmt: skip
    width, heads = whole(hf, "hidden_size"), whole(hf, "num_attention_heads")
    if whole(hf, "num_key_value_heads", heads) != heads:  # kv_b makes one head per query head
        raise ConfigValueError("num_key_value_heads", f"must equal num_attention_heads ({heads})")
    rope_dims = whole(hf, "qk_rope_head_dim", 64)
    if whole(hf, "head_dim", rope_dims) != rope_dims:  # the rotary's size; another fails
        raise ConfigValueError("head_dim", f"must equal qk_rope_head_dim ({rope_dims})")
    q_lora_rank = None if "q_lora_rank" in hf and hf["q_lora_rank"] is None else whole(
        hf, "q_lora_rank", 1536
    )  # fmt: skip
    latent = LatentConfig(
        width, heads, kv_lora_rank=whole(hf, "kv_lora_rank", 512),
        qk_nope_head_dim=whole(hf, "qk_nope_head_dim", 128), qk_rope_head_dim=rope_dims,
        v_head_dim=_whole_not_null(hf, "v_head_dim", 128), q_lora_rank=q_lora_rank,
        bias=flag(hf, "attention_bias", False), norm_eps=LATENT_NORM_EPS,
        rope_interleave=_flag_null_false(hf, "rope_interleave", True),
    )  # fmt: skip
    max_positions = whole(hf, "max_position_embeddings", 4096)
    rope = read_rope(ChainMap({"max_position_embeddings": max_positions}, hf), rope_dims)
    if rope["rope_dims"] is not None:
        raise ConfigValueError("partial_rotary_factor", f"must be 1 in a {NAME} checkpoint: "
                               "rotary turns all of qk_rope_head_dim")  # fmt: skip
    layers = whole(hf, "num_hidden_layers")
    dense = _whole_not_null(hf, "first_k_dense_replace", 3, minimum=0)
    moe_layers = tuple(i >= dense for i in range(layers))
    return DecoderConfig(
        vocab_size=whole(hf, "vocab_size"),
        num_layers=layers,
        max_positions=max_positions,
        position="rotary",
        rope_base=rope["rope_base"],
        rope_scaling=rope["rope_scaling"],
        tie_embeddings=flag(hf, "tie_word_embeddings", False),
        moe_layers=None if all(moe_layers) else moe_layers,
        block=BlockConfig(
            width=width,
            num_heads=heads,
            head_dim=latent.qk_head_dim,  # what each query and key head is made of
            mlp_hidden=whole(hf, "intermediate_size"),  # the dense layers'
            mlp="swiglu",
            norm="rmsnorm",
            norm_eps=real(hf, "rms_norm_eps", 1e-6),
            bias=False,
            experts=_experts(hf),
            latent=latent,
        ),
    )


def hf_config(cfg: DecoderConfig) -> dict:
    """The config.json of a DeepSeek-V3 decoder (DeepseekV3ForCausalLM); a qkv config that
    one cannot describe is refused, naming what does not fit."""
    block, latent, experts = cfg.block, cfg.block.latent, cfg.block.experts
    if latent is None or experts is None:
        raise ValueError(f"a {NAME} config.json holds latent attention and experts; this model "
                         f"has latent={latent!r}, experts={experts!r}")  # fmt: skip
    check_fits(NAME, cfg, layer_types=None, rope_layers=None, dense_mlp_hidden=None,
               block__num_kv_heads=None, block__head_dim=latent.qk_head_dim, block__bias=False,
               block__qkv_bias=None, block__window=None, block__qk_norm=None,
               block__chunk=None, block__sinks=False, block__temperature=None)  # fmt: skip
    fits(NAME, cfg, block__latent__width=block.width, block__latent__num_heads=block.num_heads,
         block__latent__norm_eps=LATENT_NORM_EPS, block__latent__scale=None)  # fmt: skip
    r = experts.routing
    shared = (experts.shared_hidden or 0) // experts.hidden
    want = Experts(Routing(r.num_experts, r.top_k, score="sigmoid", normalize=r.normalize,
                           groups=r.groups, groups_chosen=r.groups_chosen, correction_bias=True,
                           scaling=r.scaling, logits_dtype="float32"),
                   experts.hidden, "silu", shared_hidden=shared * experts.hidden)  # fmt: skip
    if experts != want or shared < 1:
        raise ValueError(f"a {NAME} config.json cannot hold these experts: {experts}; it holds "
                         f"DeepSeek's routing and at least one shared expert: {want}")  # fmt: skip
    moe = cfg.moe_layers or (True,) * cfg.num_layers
    dense = moe.index(True) if True in moe else cfg.num_layers
    if any(not m for m in moe[dense:]):
        raise ValueError(f"a {NAME} config.json cannot hold moe_layers={cfg.moe_layers}: its "
                         "dense layers are the first first_k_dense_replace only")  # fmt: skip
    hf = {
        "model_type": "deepseek_v3",
        "architectures": ["DeepseekV3ForCausalLM"],
        "vocab_size": cfg.vocab_size,
        "hidden_size": block.width,
        "intermediate_size": block.mlp_hidden or 4 * block.width,
        "moe_intermediate_size": experts.hidden,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": block.num_heads,
        "num_key_value_heads": block.num_heads,
        "n_shared_experts": shared,
        "n_routed_experts": r.num_experts,
        "routed_scaling_factor": r.scaling,
        "kv_lora_rank": latent.kv_lora_rank,
        "q_lora_rank": latent.q_lora_rank,
        "qk_rope_head_dim": latent.qk_rope_head_dim,
        "v_head_dim": latent.v_head_dim,
        "qk_nope_head_dim": latent.qk_nope_head_dim,
        "n_group": r.groups,
        "topk_group": r.groups_chosen,
        "num_experts_per_tok": r.top_k,
        "first_k_dense_replace": dense,
        "norm_topk_prob": r.normalize,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_positions,
        "rms_norm_eps": block.norm_eps,
        "tie_word_embeddings": cfg.tie_embeddings,
        "rope_interleave": latent.rope_interleave,
        "attention_bias": latent.bias,
    } | hf_rope(cfg, latent.qk_rope_head_dim)
    scaling = cfg.rope_scaling
    if scaling is not None and scaling.kind != "yarn":  # hf_rope writes these for yarn only
        for key in ("mscale", "mscale_all_dim"):
            if getattr(scaling, key) is not None:
                hf["rope_scaling"][key] = getattr(scaling, key)
    return hf


# ---- weights ----------------------------------------------------------------------------

TEMPLATES: list[Template] = [
    ("embed.tokens.weight", "model.embed_tokens.weight"),
    ("norm.weight", "model.norm.weight"),
    ("blocks.{}.attn_norm.weight", "model.layers.{}.input_layernorm.weight"),
    ("blocks.{}.mlp_norm.weight", "model.layers.{}.post_attention_layernorm.weight"),
    ("blocks.{}.attn.kv_a_norm.weight", "model.layers.{}.self_attn.kv_a_layernorm.weight"),
    ("blocks.{}.attn.kv_b.weight", "model.layers.{}.self_attn.kv_b_proj.weight"),
    ("blocks.{}.attn.out.weight", "model.layers.{}.self_attn.o_proj.weight"),
]
ATTENTION = "model.layers.{}.self_attn."


def _rope_layouts(latent: LatentConfig) -> tuple[Layout, Layout]:
    """How the rows of every head's query (q_proj, q_b_proj) and of kv_a turn from the
    checkpoint's interleaved rope pairs (2i, 2i+1) to qkv's halves (i, i + rope/2)."""
    if not latent.rope_interleave:
        return SAME, SAME
    nope, rope, rank = latent.qk_nope_head_dim, latent.qk_rope_head_dim, latent.kv_lora_rank
    halves = torch.cat([torch.arange(0, rope, 2), torch.arange(1, rope, 2)])
    head = torch.cat([torch.arange(nope), nope + halves])  # one head's rows [nope; rope]
    heads = torch.cat([h * latent.qk_head_dim + head for h in range(latent.num_heads)])
    return permuted_rows(heads), permuted_rows(torch.cat([torch.arange(rank), rank + halves]))


def _attention(latent: LatentConfig) -> list[Template]:
    query, kv_a = _rope_layouts(latent)
    if latent.q_lora_rank is None:
        out: list[Template] = [("blocks.{}.attn.q.weight", ATTENTION + "q_proj.weight", query)]
    else:
        out = [
            ("blocks.{}.attn.q_a.weight", ATTENTION + "q_a_proj.weight"),
            ("blocks.{}.attn.q_a_norm.weight", ATTENTION + "q_a_layernorm.weight"),
            ("blocks.{}.attn.q_b.weight", ATTENTION + "q_b_proj.weight", query),
        ]
    out.append(("blocks.{}.attn.kv_a.weight", ATTENTION + "kv_a_proj_with_mqa.weight", kv_a))
    if latent.bias:  # attention_bias: on q_a, kv_a and o only
        if latent.q_lora_rank is not None:
            out.append(("blocks.{}.attn.q_a.bias", ATTENTION + "q_a_proj.bias"))
        out.append(("blocks.{}.attn.kv_a.bias", ATTENTION + "kv_a_proj_with_mqa.bias", kv_a))
        out.append(("blocks.{}.attn.out.bias", ATTENTION + "o_proj.bias"))
    return out


def _mlp(layer: int, experts: Experts | None) -> list[Weight]:
    """One layer's MLP: dense, or the experts (each one's tensors stacked, `expert_weights`)
    and the shared ones."""
    ours, theirs = f"blocks.{layer}.mlp.", f"model.layers.{layer}.mlp."
    if experts is None:
        return expand([(f"{ours}{q}.weight", f"{theirs}{q}_proj.weight")
                       for q in ("gate", "up", "down")], 0)  # fmt: skip
    each = theirs + "experts.{e}."
    stacked = expert_weights(
        ours[:-1], experts.routing.num_experts, each + "gate_proj.weight",
        each + "up_proj.weight", each + "down_proj.weight",
        fused=(theirs + "experts.gate_up_proj", theirs + "experts.down_proj"),
    )  # fmt: skip
    return stacked + expand([
        (ours + "router.weight", theirs + "gate.weight"),
        (ours + "router.correction_bias", theirs + "gate.e_score_correction_bias"),
        *[(f"{ours}shared.{q}.weight", f"{theirs}shared_experts.{q}_proj.weight")
          for q in ("gate", "up", "down")],
    ], 0)  # fmt: skip


def weights(cfg: DecoderConfig) -> list[Weight]:
    """The weight map: the attention's and norms' templates for every layer, each layer's
    MLP (dense or experts, as moe_layers says), and the LM head unless tied."""
    assert cfg.block.latent is not None, "a DeepSeek-V3 model has latent attention"
    out = expand([*TEMPLATES, *_attention(cfg.block.latent)], cfg.num_layers)
    for layer in range(cfg.num_layers):
        out += _mlp(layer, cfg.block_for(layer).experts)
    if not cfg.tie_embeddings:
        out += expand([("lm_head.weight", "lm_head.weight")], 0)
    return out


# The hub's 61-layer checkpoints hold a multi-token-prediction module as layer 61, which
# transformers ignores the same way (a layer 61 that qkv's model has is read, never ignored)
IGNORED = (r"model\.layers\.61\..*",)

FAMILY = Family(
    "deepseek_v3", ("deepseek_v3",), Decoder, config, hf_config, weights, ignored=IGNORED,
    reads=READS, inert=INERT, config_classes=("DeepseekV3Config",),
)  # fmt: skip
