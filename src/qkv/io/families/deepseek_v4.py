"""DeepSeek-V4 (model_type "deepseek_v4"): compressed sparse attention, hyper-connections and
hashed experts (`qkv.models.deepseek_v4`).

Every layer is "sliding_attention", "compressed_sparse_attention" (CSA: entries of
compress_rates' m tokens, overlapping, chosen by an indexer of index_n_heads heads of
index_head_dim keeping index_topk) or "heavily_compressed_attention" (HCA: entries of m'
tokens, all attended once complete); each has a window of sliding_window words, one key head
that is also its value head, learned sinks and a grouped output projection (o_groups,
o_lora_rank). The sliding layers turn by rope_parameters' "main" rotary, the others by its
"compress" one (default or YaRN). Experts: mlp_layer_types' "hash_moe" layers choose by a
table of token ids, "moe" layers by the top k of sqrt(softplus) (or sigmoid) scores.

The checkpoint names are DeepSeek's own (transformers writes them back on save): a file
transformers saved loads as it is, and qkv's export is what transformers reads.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from qkv.io.families.checks import ConfigValueError, flag, real, whole
from qkv.io.families.common import (
    Family,
    Weight,
    decoder_weights,
    expert_weights,
    fits,
    require,
)
from qkv.io.families.rotary import _scaling
from qkv.models.deepseek_v4 import DeepseekV4Config, DeepseekV4Decoder
from qkv.nn import BlockConfig

NAME = "DeepSeek-V4"
CSA, HCA, SLIDING = (
    "compressed_sparse_attention", "heavily_compressed_attention", "sliding_attention")  # fmt: skip
ATTENTION = {SLIDING: "sliding", CSA: "csa", HCA: "hca"}
RATIO_TYPES = {0: SLIDING, 4: CSA, 128: HCA}  # transformers' reading of compress_ratios
MLP_TYPES = ("hash_moe", "moe")
# DeepseekV4Config's defaults, for the keys a config.json may leave out
DEFAULTS: dict[str, Any] = {
    "vocab_size": 129280, "hidden_size": 4096, "moe_intermediate_size": 2048,
    "num_hidden_layers": 43, "num_attention_heads": 64, "head_dim": 512, "q_lora_rank": 1024,
    "num_experts_per_tok": 6, "n_routed_experts": 256, "max_position_embeddings": 1048576,
    "hc_mult": 4, "hc_sinkhorn_iters": 20, "sliding_window": 128, "o_groups": 8,
    "o_lora_rank": 1024, "index_n_heads": 64, "index_head_dim": 128, "index_topk": 512,
    "num_nextn_predict_layers": 1,
}  # fmt: skip


def _given(hf: Mapping, key: str) -> Any:
    return whole(hf, key, DEFAULTS[key])


# Sinkhorn's steps a hyper-connection takes per token and layer: the checkpoints use 20; a
# config may not make every forward pass loop without bound
MAX_SINKHORN_STEPS = 1000


def _sinkhorn_steps(hf: Mapping) -> int:
    steps = _given(hf, "hc_sinkhorn_iters")
    if steps > MAX_SINKHORN_STEPS:
        limit = f"{MAX_SINKHORN_STEPS} Sinkhorn steps (DeepSeek-V4 uses 20)"
        raise ConfigValueError("hc_sinkhorn_iters", f"is {steps}; qkv takes at most {limit}")
    return steps


def _types(hf: Mapping, key: str, layers: int, default: list, allowed) -> list[str]:
    given = hf.get(key)
    given = default if given is None else given
    if not isinstance(given, list) or len(given) < layers:
        raise ConfigValueError(key, f"must list the {layers} layers' types, got {given!r}")
    odd = sorted({str(t) for t in given[:layers]} - set(allowed))
    if odd:
        raise ConfigValueError(key, f"holds {odd}; supported: {', '.join(allowed)}")
    return list(given[:layers])


def _rates(hf: Mapping) -> dict[str, int]:
    given = hf.get("compress_rates")
    rates = {CSA: 4, HCA: 128}
    if given is not None:
        if not isinstance(given, Mapping) or not set(given) <= {CSA, HCA}:
            raise ConfigValueError("compress_rates", f"must map {CSA} and {HCA} to their "
                                   f"rates, got {given!r}")  # fmt: skip
        rates |= {kind: whole(given, kind, rates[kind]) for kind in (CSA, HCA) if kind in given}
    for key, kind in (("compress_rate_csa", CSA), ("compress_rate_hca", HCA)):  # older files
        rates[kind] = whole(hf, key, rates[kind])
    return rates


def _layer_types(hf: Mapping, layers: int) -> tuple[list[str], list[bool]]:
    ratios = hf.get("compress_ratios")  # older files: one rate per layer
    default = [HCA] * min(layers, 2) + [CSA if i % 2 else HCA for i in range(max(layers - 2, 0))]
    if ratios is not None and hf.get("layer_types") is None:
        if not isinstance(ratios, list) or any(r not in RATIO_TYPES for r in ratios):
            raise ConfigValueError("compress_ratios", f"must list 0, 4 or 128 per layer, got "
                                   f"{ratios!r}")  # fmt: skip
        default = [RATIO_TYPES[r] for r in ratios]
    types = _types(hf, "layer_types", layers, default, tuple(ATTENTION))
    hashed = whole(hf, "num_hash_layers", 3, minimum=0)
    mlp_default = ["hash_moe"] * min(layers, hashed) + ["moe"] * max(0, layers - hashed)
    mlp = _types(hf, "mlp_layer_types", layers, mlp_default, MLP_TYPES)
    return [ATTENTION[t] for t in types], [t == "hash_moe" for t in mlp]


def _rope(hf: Mapping, head_dim: int) -> dict:
    """rope_dims, the main base and the compressed layers' base and scaling."""
    fraction = hf.get("partial_rotary_factor")
    if fraction is None and hf.get("qk_rope_head_dim") is not None:
        dims = whole(hf, "qk_rope_head_dim")
    else:
        dims = int(head_dim * real(hf, "partial_rotary_factor", 64 / 512, positive=True))
        if hf.get("qk_rope_head_dim") not in (None, dims):
            raise ConfigValueError("qk_rope_head_dim", f"({hf.get('qk_rope_head_dim')}) is not "
                                   f"head_dim * partial_rotary_factor ({dims})")  # fmt: skip
    if not 0 < dims <= head_dim or dims % 2:
        raise ConfigValueError("partial_rotary_factor", f"turns {dims} of {head_dim} channels")
    main_base = real(hf, "rope_theta", 10000.0, positive=True)
    compress_base = real(hf, "compress_rope_theta", 160000.0, positive=True)
    given = hf.get("rope_parameters") or {}
    if not isinstance(given, Mapping):
        raise ConfigValueError("rope_parameters", f"must be an object, got {given!r}")
    nested = isinstance(given.get("main"), Mapping) and isinstance(given.get("compress"), Mapping)
    main = dict(given["main"]) if nested else {"rope_type": "default", "rope_theta": main_base}
    compress = dict(given["compress"]) if nested else {
        **{k: v for k, v in given.items() if k not in ("main", "compress")},
        "rope_theta": compress_base}  # fmt: skip
    if main.get("rope_type", "default") != "default":
        raise ConfigValueError("rope_parameters", f"main rotary of type {main.get('rope_type')!r}"
                               " is not supported; qkv computes default")  # fmt: skip
    kind = compress.get("rope_type", "default")
    if kind not in ("default", "yarn"):
        raise ConfigValueError("rope_parameters", f"compress rotary of type {kind!r} is not "
                               "supported; qkv computes default and yarn")  # fmt: skip
    if kind == "yarn":
        compress.setdefault("attention_factor", 1.0)  # as transformers' V4 sets it
    for name, part in (("main", main), ("compress", compress)):
        if real(part, "partial_rotary_factor", dims / head_dim) * head_dim != dims:
            raise ConfigValueError("rope_parameters", f"{name} turns other channels than "
                                   "partial_rotary_factor says")  # fmt: skip
    return {
        "rope_dims": dims,
        "rope_base": real(main, "rope_theta", main_base, positive=True),
        "compress_rope_base": real(compress, "rope_theta", compress_base, positive=True),
        "compress_rope_scaling": _scaling(hf, compress, dims),
    }


def config(hf: dict) -> DeepseekV4Config:
    """A DeepSeek-V4 config.json -> the qkv config of the same decoder."""
    require(hf, NAME, hidden_act=("silu",), mlp_bias=(False,), num_key_value_heads=(1,))
    score = hf.get("scoring_func", "sqrtsoftplus")
    if score not in ("sqrtsoftplus", "sigmoid"):
        raise ConfigValueError("scoring_func", f"{score!r} is not supported; qkv computes "
                               "sqrtsoftplus and sigmoid")  # fmt: skip
    if hf.get("quantization_config") is not None:
        raise ValueError(f"{NAME} checkpoints with quantization_config are not supported: "
                         "qkv reads float weights")  # fmt: skip
    layers, width = _given(hf, "num_hidden_layers"), _given(hf, "hidden_size")
    heads, head_dim = _given(hf, "num_attention_heads"), _given(hf, "head_dim")
    groups = _given(hf, "o_groups")
    if heads % groups:
        raise ConfigValueError("o_groups", f"({groups}) must divide num_attention_heads ({heads})")
    types, hashed = _layer_types(hf, layers)
    rates = _rates(hf)
    experts, top_k = _given(hf, "n_routed_experts"), _given(hf, "num_experts_per_tok")
    if top_k > experts:
        raise ConfigValueError("num_experts_per_tok", f"({top_k}) is more than n_routed_experts")
    return DeepseekV4Config(
        vocab_size=_given(hf, "vocab_size"),
        num_layers=layers,
        max_positions=_given(hf, "max_position_embeddings"),
        position="rotary",
        tie_embeddings=flag(hf, "tie_word_embeddings", False),
        **_rope(hf, head_dim),
        attention_types=tuple(types),
        q_rank=_given(hf, "q_lora_rank"),
        out_groups=groups,
        out_rank=_given(hf, "o_lora_rank"),
        csa_rate=rates[CSA],
        hca_rate=rates[HCA],
        index_heads=_given(hf, "index_n_heads"),
        index_head_dim=_given(hf, "index_head_dim"),
        index_top_k=_given(hf, "index_topk"),
        streams=_given(hf, "hc_mult"),
        hc_iterations=_sinkhorn_steps(hf),
        hc_eps=real(hf, "hc_eps", 1e-6, positive=True),
        num_experts=experts,
        experts_per_token=top_k,
        expert_hidden=_given(hf, "moe_intermediate_size"),
        hashed_layers=tuple(hashed),
        expert_score=score,
        expert_scaling=real(hf, "routed_scaling_factor", 1.5, positive=True),
        swiglu_limit=real(hf, "swiglu_limit", 10.0, positive=True),
        mtp_layers=whole(hf, "num_nextn_predict_layers", 1, minimum=0),
        block=BlockConfig(
            width=width,
            num_heads=heads,
            num_kv_heads=1,
            head_dim=head_dim,
            norm="rmsnorm",
            norm_eps=real(hf, "rms_norm_eps", 1e-6, positive=True),
            bias=False,
            window=_given(hf, "sliding_window"),
        ),
    )


def hf_config(cfg: DeepseekV4Config) -> dict:
    """The config.json of a DeepSeek-V4 decoder."""
    if not isinstance(cfg, DeepseekV4Config):
        raise ValueError(f"a {NAME} config.json holds a DeepseekV4Config")
    fits(NAME, cfg, position="rotary", embed_scale=False, lm_head_bias=False,
         logit_softcap=None, head_scale=None, cross_attention=False, rope_scaling=None,
         layer_types=None, local_rope_base=None, rope_layers=None, moe_layers=None,
         block__norm="rmsnorm", block__bias=False, block__qkv_bias=None, block__kv_heads=1,
         block__chunk=None, block__softcap=None, block__experts=None,
         block__latent=None)  # fmt: skip
    b = cfg.block
    names = {v: k for k, v in ATTENTION.items()}
    compress: dict[str, Any] = {"rope_type": "default", "rope_theta": cfg.compress_rope_base,
                                "partial_rotary_factor": cfg.rope_dims / b.head_size}  # fmt: skip
    s = cfg.compress_rope_scaling
    if s is not None:
        if s.kind != "yarn":
            raise ValueError(f"a {NAME} config.json holds a yarn compress rotary only")
        compress |= {"rope_type": "yarn", "factor": s.factor, "beta_fast": s.beta_fast,
                     "beta_slow": s.beta_slow, "truncate": s.truncate,
                     "original_max_position_embeddings": s.original_max_positions}  # fmt: skip
        compress |= {k: getattr(s, k) for k in ("mscale", "mscale_all_dim", "attention_factor")
                     if getattr(s, k) is not None}  # fmt: skip
    return {
        "model_type": "deepseek_v4",
        "architectures": ["DeepseekV4ForCausalLM"],
        "vocab_size": cfg.vocab_size,
        "hidden_size": b.width,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": b.num_heads,
        "num_key_value_heads": 1,
        "head_dim": b.head_size,
        "q_lora_rank": cfg.q_rank,
        "o_groups": cfg.out_groups,
        "o_lora_rank": cfg.out_rank,
        "sliding_window": b.window,
        "max_position_embeddings": cfg.max_positions,
        "rms_norm_eps": b.norm_eps,
        "tie_word_embeddings": cfg.tie_embeddings,
        "hidden_act": "silu",
        "layer_types": [names[t] for t in cfg.attention_types],
        "compress_rates": {CSA: cfg.csa_rate, HCA: cfg.hca_rate},
        "index_n_heads": cfg.index_heads,
        "index_head_dim": cfg.index_head_dim,
        "index_topk": cfg.index_top_k,
        "partial_rotary_factor": cfg.rope_dims / b.head_size,
        "rope_theta": cfg.rope_base,
        "compress_rope_theta": cfg.compress_rope_base,
        "rope_parameters": {
            "main": {
                "rope_type": "default",
                "rope_theta": cfg.rope_base,
                "partial_rotary_factor": cfg.rope_dims / b.head_size,
            },
            "compress": compress,
        },
        "hc_mult": cfg.streams,
        "hc_sinkhorn_iters": cfg.hc_iterations,
        "hc_eps": cfg.hc_eps,
        "n_routed_experts": cfg.num_experts,
        "num_experts_per_tok": cfg.experts_per_token,
        "moe_intermediate_size": cfg.expert_hidden,
        "mlp_layer_types": ["hash_moe" if h else "moe" for h in cfg.hashed_layers],
        "scoring_func": cfg.expert_score,
        "routed_scaling_factor": cfg.expert_scaling,
        "swiglu_limit": cfg.swiglu_limit,
        "num_nextn_predict_layers": cfg.mtp_layers,
    }


# ---- weights: DeepSeek's own names, as transformers saves them ------------------------------

GLOBAL = [
    ("embed.tokens.weight", ("model.embed_tokens.weight", "embed.weight")),
    ("norm.weight", ("model.norm.weight", "norm.weight")),
    ("head.fn", ("model.hc_head.hc_fn", "hc_head_fn")),
    ("head.base", ("model.hc_head.hc_base", "hc_head_base")),
    ("head.scale", ("model.hc_head.hc_scale", "hc_head_scale")),
]
LAYER = [
    ("attn_norm.weight", "attn_norm.weight"),
    ("mlp_norm.weight", "ffn_norm.weight"),
    ("attn_hc.fn", "hc_attn_fn"), ("attn_hc.base", "hc_attn_base"),
    ("attn_hc.scale", "hc_attn_scale"),
    ("mlp_hc.fn", "hc_ffn_fn"), ("mlp_hc.base", "hc_ffn_base"), ("mlp_hc.scale", "hc_ffn_scale"),
    ("attn.q_a.weight", "attn.wq_a.weight"), ("attn.q_a_norm.weight", "attn.q_norm.weight"),
    ("attn.q_b.weight", "attn.wq_b.weight"), ("attn.kv.weight", "attn.wkv.weight"),
    ("attn.kv_norm.weight", "attn.norm.weight"), ("attn.out_a.weight", "attn.wo_a.weight"),
    ("attn.out_b.weight", "attn.wo_b.weight"), ("attn.sinks", "attn.attn_sink"),
    ("moe.router", "ffn.gate.weight"),
    ("moe.shared.gate.weight", "ffn.shared_experts.w1.weight"),
    ("moe.shared.up.weight", "ffn.shared_experts.w3.weight"),
    ("moe.shared.down.weight", "ffn.shared_experts.w2.weight"),
]  # fmt: skip
COMPRESSOR = [("kv.weight", "wkv.weight"), ("gate.weight", "wgate.weight"),
              ("position_bias", "ape"), ("norm.weight", "norm.weight")]  # fmt: skip
INDEXER = [("q.weight", "wq_b.weight"), ("head_weights.weight", "weights_proj.weight")]


def _named(qkv: str, name: str) -> Weight:
    return Weight(qkv, (f"model.{name}", name))


def weights(cfg: DeepseekV4Config) -> list[Weight]:
    out = decoder_weights([], cfg)
    out = [Weight(w.qkv, ("head.weight", "lm_head.weight")) for w in out]  # the LM head
    out += [Weight(q, names) for q, names in GLOBAL]
    for i in range(cfg.num_layers):
        at, ours = f"layers.{i}.", f"blocks.{i}."
        templates = list(LAYER)
        kind = cfg.attention_types[i]
        if kind != "sliding":
            templates += [(f"attn.compressor.{q}", f"attn.compressor.{h}") for q, h in COMPRESSOR]
        if kind == "csa":
            templates += [(f"attn.indexer.compressor.{q}", f"attn.indexer.compressor.{h}")
                          for q, h in COMPRESSOR]  # fmt: skip
            templates += [(f"attn.indexer.{q}", f"attn.indexer.{h}") for q, h in INDEXER]
        templates.append(("moe.token_experts", "ffn.gate.tid2eid") if cfg.hashed_layers[i]
                         else ("moe.correction_bias", "ffn.gate.bias"))  # fmt: skip
        out += [_named(ours + q, at + h) for q, h in templates]
        experts = f"model.{at}ffn.experts." + "{e}"
        out += expert_weights(ours + "moe", cfg.num_experts, experts + ".w1.weight",
                              experts + ".w3.weight", experts + ".w2.weight")  # fmt: skip
    return out


READS = ("vocab_size", "hidden_size", "moe_intermediate_size", "num_hidden_layers",
         "num_attention_heads", "num_key_value_heads", "head_dim", "q_lora_rank",
         "num_experts_per_tok", "n_routed_experts", "scoring_func", "routed_scaling_factor",
         "max_position_embeddings", "rope_theta", "layer_types", "compress_rates",
         "compress_rope_theta", "hc_mult", "hc_sinkhorn_iters", "hc_eps", "mlp_layer_types",
         "swiglu_limit", "sliding_window", "o_groups", "o_lora_rank", "index_n_heads",
         "index_head_dim", "index_topk", "num_nextn_predict_layers", "hidden_act",
         "rms_norm_eps", "tie_word_embeddings", "rope_parameters", "partial_rotary_factor",
         "mlp_bias", "qk_rope_head_dim")  # fmt: skip
INERT = ("initializer_range", "use_cache", "pad_token_id", "eos_token_id", "bos_token_id",
         "attention_dropout", "output_router_logits", "router_aux_loss_coef",
         # transformers' V4 never reads these: no attention bias, no router jitter, one shared
         # expert of moe_intermediate_size, weights always renormalized
         "attention_bias", "router_jitter_noise", "n_shared_experts", "norm_topk_prob")  # fmt: skip
# the multi-token-prediction layers: not part of the forward pass (transformers skips them too)
IGNORED = (r"(model\.)?mtp\..*",)

FAMILY = Family(
    "deepseek_v4", ("deepseek_v4",), DeepseekV4Decoder, config, hf_config, weights,
    ignored=IGNORED, reads=READS, inert=INERT, config_classes=("DeepseekV4Config",),
)  # fmt: skip
