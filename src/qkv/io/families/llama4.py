"""Llama 4 (text): a Llama-shaped decoder with four things of its own.

- Chunked attention on the layers with rotary positions: a query sees only the keys of its
  own chunk of `attention_chunk_size` tokens. Chunks count from each row's first real
  token (as transformers' chunked mask does), so a left-padded row is the row alone.
- Layers without positions (NoPE; `no_rope_layers` is 0 there, every 4th layer by default)
  attend over the whole text, with their queries' scores times a temperature that grows with
  the position (`attn_temperature_tuning`, `attn_scale`, `floor_scale`).
- Queries and keys of the rotary layers are L2-normalized (an RMS norm with no weight) after
  the rotation (`use_qk_norm`). The rotation turns interleaved pairs (2i, 2i + 1) of each
  head, Meta's layout; qkv turns halves (i, i + D/2), so the query and key rows of each
  rotary layer's heads are reordered once at load time, and back on export. Dot products
  and the L2 norm do not change under one reordering of both, so the scores are the same;
  the recorded q and k vectors of those layers list their dimensions in the new order.
- Mixture-of-experts layers interleaved with dense ones (`interleave_moe_layer_step` or
  `moe_layers`): a router takes the top k of its logits, and the sigmoid of each chosen
  logit scales that expert's input (not its output); a shared expert sees every token.
  Experts are `intermediate_size` wide, dense layers' MLPs `intermediate_size_mlp`.

The hub's checkpoints are multimodal (`model_type` "llama4", the text model under
`text_config`); qkv reads the text model's own files ("llama4_text", Llama4ForCausalLM).
"""

from __future__ import annotations

from collections import ChainMap
from collections.abc import Mapping
from dataclasses import replace

from torch import Tensor

from qkv.io.families import llama
from qkv.io.families.checks import ConfigValueError, flag, real, whole
from qkv.io.families.common import Family, Layout, Template, Weight, expand
from qkv.models import Decoder, DecoderConfig
from qkv.nn.experts import Experts
from qkv.nn.position import Temperature
from qkv.nn.routing import Routing

NAME = "Llama 4"
# transformers' layer type names of Llama 4, and qkv's
LAYER_TYPES = {"full_attention": "full", "chunked_attention": "chunked"}
# Llama4TextConfig's defaults, for the keys a config.json may leave out (read_decoder has
# none of its own for these, or other ones)
DEFAULTS = {"vocab_size": 202048, "hidden_size": 5120, "intermediate_size": 8192,
            "num_hidden_layers": 48, "num_attention_heads": 40, "num_key_value_heads": 8,
            "rms_norm_eps": 1e-5}  # fmt: skip


def routing(experts: int, top_k: int) -> Routing:
    """Llama 4's router: the top k logits, a sigmoid of each, on the expert's input."""
    return Routing(experts, top_k, score="sigmoid", choose_by="logits", normalize=False,
                   scale_input=True, weights_dtype="input")  # fmt: skip


def _zero_one_list(hf: Mapping, key: str, layers: int, derived: list[int]) -> list[int]:
    """no_rope_layers: one 0 or 1 per layer; null or empty means `derived`, as transformers
    reads it."""
    given = hf.get(key)
    if given is None or given == []:
        return derived
    if (
        not isinstance(given, list)
        or len(given) != layers
        or any(type(v) not in (int, bool) or v not in (0, 1) for v in given)
    ):
        raise ConfigValueError(key, f"must list {layers} values 0 or 1, got {given!r}")
    return [int(v) for v in given]


def _moe_layers(hf: Mapping, layers: int) -> tuple[bool, ...]:
    """Which layers are mixtures of experts: `moe_layers` (layer indices) or, where it is
    null, every `interleave_moe_layer_step`-th layer, the last of each step."""
    step = whole(hf, "interleave_moe_layer_step", 1)  # read even where moe_layers wins
    given = hf.get("moe_layers")
    if given is None:
        given = list(range(step - 1, layers, step))
    if not isinstance(given, list) or any(type(i) is not int or not 0 <= i < layers for i in given):
        raise ConfigValueError(
            "moe_layers", f"must list layer indices below {layers}, got {given!r}"
        )
    return tuple(i in given for i in range(layers))


def _layer_types(hf: Mapping, rope: list[int], chunk: int | None) -> tuple[str, ...]:
    """Each layer's attention: the file's `layer_types`, else chunked where a layer turns its
    queries and keys and there is a chunk size, full elsewhere (transformers' derivation)."""
    layers = len(rope)
    given = hf.get("layer_types")
    if given is None:
        given = ["chunked_attention" if r and chunk is not None else "full_attention"
                 for r in rope]  # fmt: skip
    if not isinstance(given, list) or len(given) != layers:
        raise ConfigValueError("layer_types", f"must list {layers} layer types, got {given!r}")
    odd = sorted({str(n) for n in given} - set(LAYER_TYPES))
    if odd:
        raise ConfigValueError("layer_types", f"holds {odd}; qkv computes {list(LAYER_TYPES)}")
    types = tuple(LAYER_TYPES[n] for n in given)
    if "chunked" in types and chunk is None:  # transformers' chunked mask fails without one
        raise ConfigValueError(
            "attention_chunk_size", "must be set: layer_types has chunked layers"
        )
    return types


def _temperature(hf: Mapping) -> Temperature | None:
    """The NoPE layers' temperature, 1 + attn_scale * log(1 + floor((p + 1) / floor_scale)).

    transformers evaluates it at the token's index in the text (cache length + i), qkv at the
    model's per-row positions, which count from each row's first real token so that a
    left-padded row equals the row alone. The two agree on every row without left padding.
    """
    tuning = hf.get("attn_temperature_tuning", True)
    if type(tuning) is not bool:  # transformers 4.51 wrote 4 (truthy); 5's class refuses it
        raise ConfigValueError(
            "attn_temperature_tuning", f"must be true or false, got {tuning!r} (qkv does not "
            "guess what a number meant; write true to tune the NoPE layers' temperature)"
        )  # fmt: skip
    strength = real(hf, "attn_scale", 0.1)
    every = real(hf, "floor_scale", 8192.0, positive=True)
    return Temperature(strength, every, 1.0) if tuning else None


def _check_llama3(hf: Mapping) -> None:
    """transformers' llama3 rotary reads low_freq_factor and high_freq_factor and fails
    without them; qkv's defaults (Llama 3.1's) would be a guess."""
    params = hf.get("rope_scaling") or hf.get("rope_parameters")
    if isinstance(params, Mapping) and params.get("rope_type", params.get("type")) == "llama3":
        missing = [k for k in ("low_freq_factor", "high_freq_factor") if params.get(k) is None]
        if missing:
            raise ConfigValueError("rope_parameters", f"of type llama3 needs {', '.join(missing)}")


def config(file: dict) -> DecoderConfig:
    """A Llama 4 text config.json -> the qkv config of the same decoder."""
    hf = ChainMap(file, DEFAULTS)  # an overlay, not a copy: keys are looked up one by one
    if flag(hf, "attention_bias", False):  # on q, k, v and o but not the MLPs: qkv's do not split
        raise ValueError(f"{NAME} checkpoints with attention_bias=True are not supported")
    _check_llama3(hf)
    layers = whole(hf, "num_hidden_layers")
    interval = whole(hf, "no_rope_layer_interval", 4)  # read even where no_rope_layers wins
    derived = [int((i + 1) % interval != 0) for i in range(layers)]
    rope = _zero_one_list(hf, "no_rope_layers", layers, derived)
    chunk = whole(hf, "attention_chunk_size", None) if "attention_chunk_size" in hf else 8192
    types = _layer_types(hf, rope, chunk)
    hidden = whole(hf, "intermediate_size")
    experts = Experts(
        routing(whole(hf, "num_local_experts", 16), whole(hf, "num_experts_per_tok", 1)),
        hidden, shared_hidden=hidden,
    )  # fmt: skip
    temperature = _temperature(hf)
    moe = _moe_layers(hf, layers)
    dense_hidden = whole(hf, "intermediate_size_mlp", 16384)
    decoder = llama.read_decoder(
        hf, NAME, max_positions=4096 * 32, tie=False,
        head_dim=None if "head_dim" in hf else 128,  # null: hidden_size / heads, as in 4.x
        rope_base=500000.0, layer_types=types, rope_layers=tuple(bool(r) for r in rope),
        bias=False, chunk=chunk if "chunked" in types else None,
        qk_norm="l2" if flag(hf, "use_qk_norm", True) else None,
        temperature=temperature, temperature_where="nope" if temperature else "all",
        experts=experts,
    )  # fmt: skip
    return replace(decoder, moe_layers=None if all(moe) else moe, dense_mlp_hidden=dense_hidden)


def hf_config(cfg: DecoderConfig) -> dict:
    """The config.json of a Llama 4 text decoder (Llama4ForCausalLM)."""
    block = cfg.block
    experts = block.experts
    if experts is None:
        raise ValueError(f"a {NAME} config.json needs block.experts (its MoE layers')")
    E, k = experts.routing.num_experts, experts.routing.top_k
    want = Experts(routing(E, k), block.mlp_hidden, shared_hidden=block.mlp_hidden)
    if experts != want:
        raise ValueError(
            f"a {NAME} config.json cannot hold block.experts={experts!r}; it holds {want!r} "
            "(a sigmoid of the top k logits on the experts' input, a shared expert as wide)"
        )
    temperature = block.temperature
    if temperature is not None and (
        temperature.shift != 1.0
        or block.temperature_where != "nope"
        or not float(temperature.every).is_integer()
    ):
        raise ValueError(
            f"a {NAME} config.json cannot hold temperature={temperature!r} on "
            f"{block.temperature_where!r} layers: it holds Temperature(attn_scale, floor_scale "
            "(a whole number), 1.0) on layers without rotary positions only"
        )  # fmt: skip
    odd = sorted({cfg.layer_type(i) for i in range(cfg.num_layers)} - {"full", "chunked"})
    if odd:
        raise ValueError(f"a {NAME} config.json cannot hold {odd} layers, only full or chunked")
    if block.qk_norm not in (None, "l2"):
        raise ValueError(f"a {NAME} config.json cannot hold qk_norm={block.qk_norm!r}: only 'l2'")
    llama.check_fits(NAME, cfg, block__bias=False, block__qkv_bias=None, block__window=None,
                     block__sinks=False, block__latent=None)  # fmt: skip
    names = {qkv: name for name, qkv in LAYER_TYPES.items()}
    rope = cfg.rope_layers or (True,) * cfg.num_layers
    moe = cfg.moe_layers or (True,) * cfg.num_layers
    hf = llama.hf_decoder(cfg, "llama4_text", "Llama4ForCausalLM")
    return hf | {
        "head_dim": block.head_size,  # its default is 128, not width / heads
        "intermediate_size": block.mlp_hidden,
        "intermediate_size_mlp": cfg.dense_mlp_hidden or block.mlp_hidden,
        "attention_bias": False,
        "num_local_experts": E,
        "num_experts_per_tok": k,
        "moe_layers": [i for i in range(cfg.num_layers) if moe[i]],
        "no_rope_layers": [int(r) for r in rope],
        "layer_types": [names[cfg.layer_type(i)] for i in range(cfg.num_layers)],
        "attention_chunk_size": block.chunk,
        "use_qk_norm": block.qk_norm == "l2",
        "attn_temperature_tuning": temperature is not None,
        **({} if temperature is None else {"attn_scale": temperature.strength,
                                           "floor_scale": int(temperature.every)}),
    }  # fmt: skip


# ---- weights ---------------------------------------------------------------------------------


def interleaved_to_halves(head_dim: int) -> Layout:
    """A q_proj or k_proj (heads * D, C) whose rows give each head's dimensions in pairs
    (2i, 2i + 1) -> rows in halves (i, i + D/2), the pairs qkv's rotation turns; and back.

    >>> import torch
    >>> layout = interleaved_to_halves(4)
    >>> layout.load(torch.arange(8.0)[:, None]).flatten().tolist()
    [0.0, 2.0, 1.0, 3.0, 4.0, 6.0, 5.0, 7.0]
    >>> layout.save(layout.load(torch.arange(8.0)[:, None])).flatten().tolist()
    [0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0]
    """
    half = head_dim // 2

    def load(w: Tensor) -> Tensor:  # (heads * D, C) -> each head's (D/2, 2) rows as (2, D/2)
        return w.reshape(-1, half, 2, w.shape[-1]).transpose(1, 2).reshape(w.shape).contiguous()

    def save(w: Tensor) -> Tensor:
        return w.reshape(-1, 2, half, w.shape[-1]).transpose(1, 2).reshape(w.shape).contiguous()

    return Layout(load, save)


def _transposed_experts(t: Tensor) -> Tensor:
    return t.transpose(1, 2).contiguous()  # (E, C, 2I) <-> (E, 2I, C); (E, I, C) <-> (E, C, I)


EXPERTS_LAYOUT = Layout(_transposed_experts, _transposed_experts)

TEMPLATES = [
    ("embed.tokens.weight", "model.embed_tokens.weight"),
    ("norm.weight", "model.norm.weight"),
    ("blocks.{}.attn_norm.weight", "model.layers.{}.input_layernorm.weight"),
    ("blocks.{}.attn.v.weight", "model.layers.{}.self_attn.v_proj.weight"),
    ("blocks.{}.attn.out.weight", "model.layers.{}.self_attn.o_proj.weight"),
    ("blocks.{}.mlp_norm.weight", "model.layers.{}.post_attention_layernorm.weight"),
]
QUERY_KEY = [
    ("blocks.{}.attn.q.weight", "model.layers.{}.self_attn.q_proj.weight"),
    ("blocks.{}.attn.k.weight", "model.layers.{}.self_attn.k_proj.weight"),
]
FEED_FORWARD = "model.layers.{}.feed_forward"
DENSE = [
    ("blocks.{}.mlp.gate.weight", f"{FEED_FORWARD}.gate_proj.weight"),
    ("blocks.{}.mlp.up.weight", f"{FEED_FORWARD}.up_proj.weight"),
    ("blocks.{}.mlp.down.weight", f"{FEED_FORWARD}.down_proj.weight"),
]
MOE = [
    ("blocks.{}.mlp.router.weight", f"{FEED_FORWARD}.router.weight"),
    ("blocks.{}.mlp.gate_up", f"{FEED_FORWARD}.experts.gate_up_proj", EXPERTS_LAYOUT),
    ("blocks.{}.mlp.down", f"{FEED_FORWARD}.experts.down_proj", EXPERTS_LAYOUT),
    ("blocks.{}.mlp.shared.gate.weight", f"{FEED_FORWARD}.shared_expert.gate_proj.weight"),
    ("blocks.{}.mlp.shared.up.weight", f"{FEED_FORWARD}.shared_expert.up_proj.weight"),
    ("blocks.{}.mlp.shared.down.weight", f"{FEED_FORWARD}.shared_expert.down_proj.weight"),
]  # fmt: skip


def _at(templates: list[Template], layer: int, layout: Layout | None = None) -> list[Template]:
    """Templates of one layer (its index written in), with `layout` where given."""
    out: list[Template] = []
    for qkv, names, *how in templates:
        assert isinstance(names, str)
        turned = (layout,) if layout is not None else tuple(how)
        out.append((qkv.format(layer), names.format(layer), *turned))  # type: ignore[arg-type]
    return out


def weights(cfg: DecoderConfig) -> list[Weight]:
    """Every layer's weights; its q and k rows reordered where it turns them, its MLP dense
    or experts as moe_layers says."""
    templates: list[Template] = list(TEMPLATES)
    halves = interleaved_to_halves(cfg.block.head_size)
    for i in range(cfg.num_layers):
        templates += _at(QUERY_KEY, i, halves if cfg.turns(i) else None)
        dense = cfg.moe_layers is not None and not cfg.moe_layers[i]
        templates += _at(DENSE if dense else MOE, i)
    if not cfg.tie_embeddings:
        templates.append(("lm_head.weight", "lm_head.weight"))
    return expand(templates, cfg.num_layers)


FAMILY = Family(
    "llama4", ("llama4_text",), Decoder, config, hf_config, weights,
    ignored=llama.IGNORED, inert=(*llama.INERT, "router_aux_loss_coef", "router_jitter_noise",
                                  "output_router_logits"),
    reads=(*llama.READS, "attention_bias", "intermediate_size_mlp", "num_local_experts",
           "num_experts_per_tok", "moe_layers", "interleave_moe_layer_step", "use_qk_norm",
           "no_rope_layers", "no_rope_layer_interval", "attention_chunk_size", "layer_types",
           "attn_temperature_tuning", "floor_scale", "attn_scale"),
    config_classes=("Llama4TextConfig",),
    refused_types=(("llama4", "multimodal Llama 4 checkpoints (model_type 'llama4') are not "
                    "supported; qkv reads the text model alone (model_type 'llama4_text', "
                    "Llama4ForCausalLM)"),),
)  # fmt: skip
