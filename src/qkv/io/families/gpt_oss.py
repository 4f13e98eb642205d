"""gpt-oss (OpenAI's open-weight models): a Llama-shaped decoder whose every MLP is a mixture
of experts, with learned attention sinks.

What it adds to Llama (qkv.io.families.llama):
- each head has a learned sink, one more score in every query's softmax with no value
  (`BlockConfig.sinks`): the words' weights sum to less than 1, the sink takes the rest;
- layers alternate sliding-window and full attention (`layer_types`: by default even layers
  slide, odd layers see everything);
- biases on the q, k, v and o projections (`attention_bias`, true by default);
- YaRN rotary positions, the default where a file says nothing (factor 32 over 4096
  positions, `truncate` false: the ramp's ends are not rounded);
- the MLP is a mixture of experts: a router with a bias, the top k experts by logit, a
  softmax over those k; each expert a clamped SwiGLU with biases, its gate and up columns
  interleaved in the checkpoint (column 0 gate, 1 up, 2 gate...), which qkv stacks as halves.

The hub's checkpoints (openai/gpt-oss-20b, -120b) store the experts quantized as MXFP4
(`quantization_config`), which qkv does not read; their bfloat16 conversions load.
"""

from __future__ import annotations

from collections import ChainMap
from collections.abc import Mapping

import torch
from torch import Tensor

from qkv.io.families import llama
from qkv.io.families.checks import ConfigValueError, flag, real, whole
from qkv.io.families.common import Family, Layout, Template, decoder_weights
from qkv.models import Decoder, DecoderConfig
from qkv.nn.experts import Experts
from qkv.nn.routing import Routing

# GptOssConfig's rotary settings where a file has neither rope_parameters nor rope_scaling
DEFAULT_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                "truncate": False, "original_max_position_embeddings": 4096}  # fmt: skip


def routing(experts: int, top_k: int) -> Routing:
    """gpt-oss's router: a Linear with a bias, the top k of its logits, a softmax over the k,
    in the input's dtype (GptOssTopKRouter)."""
    return Routing(experts, top_k, choose_by="logits", normalize=False, router_bias=True,
                   scores_dtype="input", weights_dtype="input")  # fmt: skip


def config(hf: dict) -> DecoderConfig:
    """A gpt-oss config.json -> the qkv config of the same decoder."""
    quantized = hf.get("quantization_config")
    if quantized is not None:
        method = quantized.get("quant_method") if isinstance(quantized, Mapping) else quantized
        raise ConfigValueError(
            "quantization_config",
            f"({method!r}) is not supported: qkv reads gpt-oss experts stored unquantized "
            "(gate_up_proj, down_proj), e.g. a bfloat16 conversion of the checkpoint",
        )
    layers = whole(hf, "num_hidden_layers")
    derived = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
    window = llama.sliding_window(hf, 128)
    # num_experts, the class's alias, wins where a file has both (as transformers reads it)
    alias = hf.get("num_experts") is not None
    num_experts = whole(hf, "num_experts" if alias else "num_local_experts", 128)
    top_k = whole(hf, "num_experts_per_tok", 4)
    if top_k > num_experts:
        raise ConfigValueError(
            "num_experts_per_tok", f"({top_k}) must be at most num_local_experts ({num_experts})"
        )
    experts = Experts(
        routing(num_experts, top_k),
        hidden=whole(hf, "intermediate_size"),
        activation="clamped_swiglu",
        bias=True,
        limit=real(hf, "swiglu_limit", 7.0),
        alpha=real(hf, "swiglu_alpha", 1.702),
    )
    # hidden_act is never read by gpt-oss's model: llama's check of it is answered here
    overlay: dict = {"hidden_act": "silu"}
    if hf.get("rms_norm_eps") is None:
        overlay["rms_norm_eps"] = 1e-5  # GptOssConfig's, not Llama's
    if hf.get("rope_parameters") is None:  # as GptOssConfig fills it; rope_scaling still wins
        overlay["rope_parameters"] = DEFAULT_ROPE
    return llama.read_decoder(
        ChainMap(overlay, hf), "gpt-oss", max_positions=131072, tie=False, head_dim=64,
        rope_base=150000.0, layer_types=llama.read_layer_types(hf, derived, window),
        window=window, bias=flag(hf, "attention_bias", True), sinks=True, experts=experts,
    )  # fmt: skip


def hf_config(cfg: DecoderConfig) -> dict:
    """The config.json of a gpt-oss decoder (GptOssForCausalLM)."""
    block, experts = cfg.block, cfg.block.experts
    if experts is None:
        raise ValueError("a gpt-oss config.json cannot hold this model: its MLP has no experts")
    llama.check_fits("gpt-oss", cfg, rope_layers=None, moe_layers=None, block__qkv_bias=None,
                     block__qk_norm=None, block__chunk=None, block__sinks=True,
                     block__temperature=None, block__latent=None,
                     block__mlp_hidden=experts.hidden, block__experts__activation="clamped_swiglu",
                     block__experts__bias=True, block__experts__shared_hidden=None,
                     block__experts__routing=routing(experts.routing.num_experts,
                                                     experts.routing.top_k))  # fmt: skip
    hf = llama.hf_decoder(cfg, "gpt_oss", "GptOssForCausalLM")
    if cfg.rope_scaling is None:  # said, or the file would mean GptOssConfig's YaRN
        hf["rope_scaling"] = {"rope_type": "default"}
    return hf | {
        "head_dim": block.head_size,  # its default is 64, not width / heads
        "attention_bias": block.bias,
        # transformers makes the sliding mask even where no layer slides, so a window is
        # written there too (its default, which no layer uses)
        "sliding_window": 128 if block.window is None else block.window,
        "layer_types": llama.hf_layer_types(cfg),
        "num_local_experts": experts.routing.num_experts,
        "num_experts_per_tok": experts.routing.top_k,
        "swiglu_limit": experts.limit,
        "swiglu_alpha": experts.alpha,
    }


# ---- the weight map -------------------------------------------------------------------------


def _halves(t: Tensor) -> Tensor:
    """(..., 2I) gate and up interleaved (gate at even columns) -> (..., 2I) gate then up."""
    return torch.cat([t[..., 0::2], t[..., 1::2]], dim=-1)


def _interleaved(t: Tensor) -> Tensor:
    """(..., 2I) gate then up -> (..., 2I) interleaved: `_halves` undone."""
    gate, up = t.chunk(2, dim=-1)
    return torch.stack([gate, up], dim=-1).flatten(-2)


def _swap_last(t: Tensor) -> Tensor:
    return t.transpose(-1, -2).contiguous()


# gate_up_proj (E, C, 2I) interleaved <-> gate_up (E, 2I, C); its bias (E, 2I) likewise
GATE_UP = Layout(lambda t: _swap_last(_halves(t)), lambda t: _interleaved(_swap_last(t)))
GATE_UP_BIAS = Layout(_halves, _interleaved)
DOWN = Layout(_swap_last, _swap_last)  # down_proj (E, I, C) <-> down (E, C, I)

LAYER = "model.layers.{}."
TEMPLATES: list[Template] = [
    *llama.TEMPLATES[:7],  # embeddings, final norm, attention and its norm (no dense MLP)
    ("blocks.{}.mlp_norm.weight", LAYER + "post_attention_layernorm.weight"),
    ("blocks.{}.attn.sinks", LAYER + "self_attn.sinks"),
    ("blocks.{}.mlp.router.weight", LAYER + "mlp.router.weight"),
    ("blocks.{}.mlp.router.bias", LAYER + "mlp.router.bias"),
    ("blocks.{}.mlp.gate_up", LAYER + "mlp.experts.gate_up_proj", GATE_UP),
    ("blocks.{}.mlp.gate_up_bias", LAYER + "mlp.experts.gate_up_proj_bias", GATE_UP_BIAS),
    ("blocks.{}.mlp.down", LAYER + "mlp.experts.down_proj", DOWN),
    ("blocks.{}.mlp.down_bias", LAYER + "mlp.experts.down_proj_bias"),
]
ATTENTION_BIASES: list[Template] = [*llama.QKV_BIASES, llama.BIASES[0]]  # q, k, v and o


def weights(cfg: DecoderConfig):
    """gpt-oss's weight map: attention biases where attention_bias says so."""
    return decoder_weights(TEMPLATES + (ATTENTION_BIASES if cfg.block.bias else []), cfg)


READS = (*llama.READS, "attention_bias", "sliding_window", "layer_types", "num_local_experts",
         "num_experts", "num_experts_per_tok", "swiglu_limit", "swiglu_alpha",
         "quantization_config")  # fmt: skip
INERT = (*llama.INERT, "router_aux_loss_coef", "output_router_logits",
         "experts_per_token", "initial_context_length")  # fmt: skip

FAMILY = Family(
    "gpt_oss", ("gpt_oss",), Decoder, config, hf_config, weights, ignored=llama.IGNORED,
    reads=tuple(k for k in READS if k != "hidden_act"), inert=(*INERT, "hidden_act"),
    config_classes=("GptOssConfig",),
)  # fmt: skip
