"""What a model computes where it departs from the article's plain attention, read from its
qkv config: how positions enter, where the norms sit, which keys a window hides, and what
the softmax reads instead of q . k / sqrt(D).

`layer_anatomy` gives one layer's facts (for `qkv explain`, which tells them at the step they
change); `anatomy` sums a whole model up in a few words per column (for `qkv models`, which
describes each family by what it computes for transformers' default config).

>>> from qkv.models import DecoderConfig
>>> from qkv.nn import BlockConfig
>>> cfg = DecoderConfig(vocab_size=10, num_layers=2, position="rotary", block=BlockConfig(
...     width=64, num_heads=2, attn_scale=144**-0.5, softcap=50.0, window=4096))
>>> a = anatomy(cfg)
>>> a.position, a.window
('rotary (base 10000)', 'the last 4096 tokens')
>>> a.scores
'q.k / sqrt(144) (not sqrt(32)), capped 50 tanh(s/50)'
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from qkv.io.families import FAMILIES
from qkv.models import DecoderConfig, EncoderDecoderConfig
from qkv.nn.latent import softmax_scale

NORMS = {"layernorm": "LayerNorm", "rmsnorm": "RMSNorm", "rmsnorm_plus1": "RMSNorm (1 + w)"}


@dataclass(frozen=True)
class LayerAnatomy:
    """One layer's departures from the article, as plain values (JSON-ready).

    scale_divisor: the d with scale = 1/sqrt(d), None for the article's d = head_dim;
    relative_bias: the layer adds a learned bias for the distance between query and key."""

    head_dim: int
    causal: bool
    scale: float
    scale_divisor: float | None
    softcap: float | None
    window: int | None
    qk_norm: str | None
    relative_bias: bool
    position: str
    rope_base: float | None
    rope_dims: int | None  # partial rotary: how many of a head's dims turn
    rope_scaling: str | None  # e.g. "llama3 x8 past 8192 tokens"
    norm: str
    norm_position: str
    sublayer_norm: bool
    parallel: bool
    logit_softcap: float | None
    chunk: int | None = None  # a query sees only the keys of its chunk of this many tokens
    sinks: bool = False  # one learned score per head in every query's softmax
    # each query's scores times 1 + strength * log(1 + floor((position + shift) / every))
    temperature: dict | None = None
    latent_rank: int | None = None  # latent attention: the compressed vector's size
    value_dim: int | None = None  # the value head size, where it differs from head_dim
    experts: str | None = None  # the MLP's mixture of experts, in words; None: a plain MLP
    # a running memory instead of a softmax (linear attention), in words: "gated delta rule,
    # per-head fade" or "gated delta rule, per-channel fade (KDA)"; None: a softmax layer
    linear: str | None = None


@dataclass(frozen=True)
class Anatomy:
    """A model in a few words per column (see `qkv models`)."""

    shape: str  # encoder, decoder or encoder-decoder
    position: str
    norm: str
    window: str
    scores: str
    attention: str = "softmax(q.k) over the words"  # how a query's weights are made, in words
    mlp: str = "dense"  # a plain MLP, or its mixture of experts in words
    # what the KV cache holds per token over every layer, in 16-bit numbers (bfloat16): keys
    # and values, or a latent layer's compressed vectors (a linear layer's: none)
    cache_bytes_per_token: int = 0
    # what the linear layers keep whatever the text's length, in 16-bit numbers: each head's
    # memory S and the convolution's last inputs (`state_bytes`)
    state_bytes: int = 0


def _divisor(scale: float, head_dim: int) -> float | None:
    """d where scale = 1/sqrt(d), or None where d is the head size (the article's)."""
    divisor = 1 / scale**2
    if math.isclose(divisor, head_dim, rel_tol=1e-9):
        return None
    return round(divisor) if math.isclose(divisor, round(divisor), rel_tol=1e-9) else divisor


def _rope_scaling(config) -> str | None:
    scaling = config.rope_scaling if config.position == "rotary" else None
    if scaling is None:
        return None
    past = scaling.original_max_positions or scaling.max_positions
    return f"{scaling.kind} x{scaling.factor:g}" + (f" past {past} tokens" if past else "")


def layer_anatomy(config, layer: int = 0, *, cross: bool = False) -> LayerAnatomy:
    """Layer `layer` of a stack config (EncoderConfig or DecoderConfig; for an
    EncoderDecoderConfig its decoder, whose cross-attention `cross` asks for)."""
    if isinstance(config, EncoderDecoderConfig):
        config = config.decoder()
    block = config.block_for(layer)
    D = block.head_size
    scale = block.attn_scale if block.attn_scale is not None else 1 / math.sqrt(D)
    if block.latent is not None:  # DeepSeek's: its query and key size, YaRN's mscale squared
        D = block.latent.qk_head_dim
        scale = block.latent.scale or softmax_scale(D, getattr(config, "rope_scaling", None))
    linear = block.linear
    if linear is not None:  # a memory read with normalized queries: no softmax, no positions
        D, scale = linear.key_size, linear.key_size**-0.5
    rotary = config.position == "rotary" and not cross and linear is None
    local = config.local_rope_base is not None and config.layer_type(layer) == "sliding"
    return LayerAnatomy(
        head_dim=D,
        causal=isinstance(config, DecoderConfig) and not cross,
        scale=scale,
        scale_divisor=_divisor(scale, D),
        softcap=block.softcap,
        window=None if cross else block.window,
        qk_norm=block.qk_norm,
        # T5's learned bias on the distance between query and key: relative positions only
        # (every config has relative_buckets, which no other position reads)
        relative_bias=config.position == "relative" and not cross,
        position="cross" if cross else config.position,
        rope_base=(config.local_rope_base if local else config.rope_base) if rotary else None,
        rope_dims=config.rope_dims if rotary and config.rope_dims not in (None, D) else None,
        rope_scaling=_rope_scaling(config) if rotary and not local else None,
        norm=NORMS.get(block.norm, block.norm),
        norm_position=block.norm_position,
        sublayer_norm=block.sublayer_norm,
        parallel=block.parallel,
        logit_softcap=getattr(config, "logit_softcap", None),
        chunk=None if cross else block.chunk,
        sinks=block.sinks and not cross,
        temperature=None if cross or block.temperature is None else asdict(block.temperature),
        latent_rank=None if block.latent is None else block.latent.kv_lora_rank,
        value_dim=_value_dim(block),
        experts=None if block.experts is None else experts_words(block.experts),
        linear=None if linear is None else linear_words(linear),
    )


def _value_dim(block) -> int | None:
    if block.linear is not None:
        size = block.linear.value_size
        return None if size == block.linear.key_size else size
    return None if block.latent is None else block.latent.v_head_dim


def linear_words(linear) -> str:
    """A linear layer's rule in a few words: "gated delta rule, per-head fade", or
    "gated delta rule, per-channel fade (KDA)"."""
    fade = "per-head fade" if linear.fade == "head" else "per-channel fade (KDA)"
    return f"gated delta rule, {fade}"


def experts_words(experts) -> str:
    """A mixture of experts in a few words: "8 experts, top 2 by softmax, + 1 shared"."""
    r = experts.routing
    words = f"{r.num_experts} experts, top {r.top_k} by {r.score}"
    if r.groups > 1:
        words += f" within {r.groups_chosen} of {r.groups} groups"
    if r.scale_input:
        words += " (scaling the expert's input)"
    if experts.shared_hidden is not None:
        words += ", + 1 shared"
    return words


def anatomy(config) -> Anatomy:
    """A model config (EncoderConfig, DecoderConfig or EncoderDecoderConfig) summed up."""
    pair = isinstance(config, EncoderDecoderConfig)
    stack = config.decoder() if pair else config
    shape = "encoder-decoder" if pair else "decoder" if isinstance(config, DecoderConfig) else (
        "encoder")  # fmt: skip
    # the scores are the softmax layers': the first of them, beside any linear layers
    layers = range(_layers(stack))
    first = layer_anatomy(stack, next((n for n in layers if stack.layer_type(n) != "linear"), 0))
    return Anatomy(shape, _positions(stack, first), _norms(stack, first),
                   _window(stack, first), _scores(first), _attention(stack), _mlp(stack),
                   cache_bytes_per_token(config), state_bytes(config))  # fmt: skip


def _layers(config) -> int:
    return getattr(config, "num_layers", None) or config.decoder_layers


def _attention(config) -> str:
    """How the model's queries weigh their keys, beyond softmax(q.k): sinks, chunks,
    temperatures, latent keys and values."""
    parts, L = [], _layers(config)
    block = config.block
    if block.linear is not None:
        linear = sum(config.layer_type(i) == "linear" for i in range(L))
        parts.append(f"linear ({linear_words(block.linear)}) in {linear} of {L} layers, a "
                     "running memory instead of a softmax")  # fmt: skip
    if block.latent is not None:
        c = block.latent
        parts.append(f"latent keys and values (one {c.kv_lora_rank}-number vector per token, "
                     f"{c.qk_rope_head_dim} rotary)")  # fmt: skip
    kinds = getattr(config, "attention_types", None)  # DeepSeek-V4's
    if kinds is not None:
        csa, hca = kinds.count("csa"), kinds.count("hca")
        parts.append(
            f"compressed keys in {csa + hca} of {L} layers beside a window: entries of "
            f"{config.csa_rate} tokens, the indexer's top {config.index_top_k} (CSA), in {csa}; "
            f"entries of {config.hca_rate} tokens, all (HCA), in {hca}; a learned sink per head; "
            f"{config.streams} residual streams (hyper-connections)"
        )
    elif block.sinks:
        parts.append("a learned sink per head takes part of each query's weight")
    if block.chunk is not None:
        chunked = sum(config.layer_type(i) == "chunked" for i in range(L))
        parts.append(f"chunks of {block.chunk} tokens in {chunked} of {L} layers")
    if config.position == "rotary" and config.rope_layers is not None:
        nope = sum(not turns for turns in config.rope_layers)
        parts.append(f"{nope} of {L} layers without positions")
    if block.temperature is not None:
        where = "on layers without positions" if block.temperature_where == "nope" else ""
        parts.append(f"a temperature growing with the position {where}".rstrip())
    shared = getattr(config, "kv_shared_layers", 0)  # Gemma 4's
    if shared:
        parts.append(f"the last {shared} of {L} layers attend over an earlier layer's keys")
    if getattr(config, "values_from_keys", False):
        parts.append("full layers' values are their keys (k = v)")
    if getattr(config, "per_layer_input", 0):
        parts.append(f"each layer reads a {config.per_layer_input}-number input of its own")
    return "; ".join(parts) or "softmax(q.k) over the words"


def _mlp(config) -> str:
    block = config.block
    beside = getattr(config, "experts", None)  # Gemma 4's: beside each layer's dense MLP
    if beside is not None:
        return f"dense + {experts_words(beside)} beside it"
    hashed = getattr(config, "hashed_layers", None)  # DeepSeek-V4's
    if hashed is not None:
        by_id = f"chosen by the token's id in {sum(hashed)} of {len(hashed)} layers"
        return (
            f"{config.num_experts} experts, {config.experts_per_token} a token + 1 shared; {by_id}"
        )
    if block.experts is None:
        return "dense"
    words = experts_words(block.experts)
    if config.moe_layers is not None:
        words += f" in {sum(config.moe_layers)} of {len(config.moe_layers)} layers"
    return words


def cache_bytes_per_token(config, element_size: int = 2) -> int:
    """Bytes the decoder's self-attention cache holds per token over every layer, at
    `element_size` bytes a number (2: bfloat16): each layer's keys and values, or a latent
    layer's compressed vector and rotary key (DeepSeek-V3: 576 numbers where its 128 heads'
    keys and values would be 40,960); DeepSeek-V4's compressed layers one entry (and an
    indexer key in CSA) per block of tokens, its window a fixed size. Encoders cache nothing."""
    if isinstance(config, EncoderDecoderConfig):
        config = config.decoder()
    if not isinstance(config, DecoderConfig):
        return 0
    kinds = getattr(config, "attention_types", None)
    if kinds is not None:  # DeepSeek-V4: a window of fixed size, and compressed entries
        head = config.block.head_size  # one key head, its own value
        csa = kinds.count("csa") * (head + config.index_head_dim) / config.csa_rate
        return round((csa + kinds.count("hca") * head / config.hca_rate) * element_size)
    total = 0
    for layer in range(config.num_layers):
        block = config.block_for(layer)
        shares = getattr(config, "shares_with", None)  # Gemma 4: a sharing layer caches none
        if shares is not None and shares(layer) is not None:
            continue
        if block.linear is not None:  # a memory of fixed size: see state_bytes
            continue
        if block.latent is not None:
            total += block.latent.kv_lora_rank + block.latent.qk_rope_head_dim
        else:
            total += 2 * block.kv_heads * block.head_size
    return total * element_size


def state_bytes(config, element_size: int = 2) -> int:
    """Bytes the decoder's linear layers keep for one sequence, whatever its length, at
    `element_size` bytes a number: each head's memory S (Dk x Dv) and the convolution's last
    inputs (`DeltaConfig.state_bytes` numbers a layer). 0 without linear layers."""
    if isinstance(config, EncoderDecoderConfig):
        config = config.decoder()
    if not isinstance(config, DecoderConfig):
        return 0
    blocks = (config.block_for(layer) for layer in range(config.num_layers))
    return sum(b.linear.state_bytes for b in blocks if b.linear is not None) * element_size


def _positions(config, a: LayerAnatomy) -> str:
    if config.position == "learned":
        where = f"learned ({config.max_positions} positions)"
    elif config.position == "rotary":
        where = f"rotary (base {config.rope_base:g})"
        if a.rope_dims:
            where += f", {a.rope_dims} of {a.head_dim} dims turn"
        if a.rope_scaling:
            where += f", {a.rope_scaling}"
        if config.local_rope_base is not None:
            where += f", sliding layers base {config.local_rope_base:g}"
    elif config.position == "relative":  # none added to the tokens: a bias on the scores
        where = (f"relative bias ({config.relative_buckets} buckets, "
                 f"max distance {config.relative_max_distance})")  # fmt: skip
    else:
        where = config.position
    return where


def _norms(config, a: LayerAnatomy) -> str:
    if a.norm_position == "none":
        words = f"{a.norm} on sub-layer outputs only"
    else:
        words = f"{a.norm_position}-norm {a.norm}"
        if a.sublayer_norm:
            words += " + on sub-layer outputs"
    if a.parallel:
        words += ", attention and MLP in parallel"
    if config.embed_norm:
        words += ", embeddings too"
    return words


def _window(config, a: LayerAnatomy) -> str:
    window = config.block.window
    if window is None:
        return "none"
    seen = f"the last {window} tokens" if a.causal else f"+-{window - 1} tokens"
    L = getattr(config, "num_layers", None)
    sliding = sum(config.layer_type(i) == "sliding" for i in range(L)) if L else None
    if config.layer_types is not None and sliding != L:
        seen += f" in {sliding} of {L} layers"
    return seen


def _scores(a: LayerAnatomy) -> str:
    if a.scale_divisor is None:
        parts = [f"q.k / sqrt({a.head_dim})"]
    elif a.scale == 1.0:
        parts = ["q.k (not divided)"]
    else:
        parts = [f"q.k / sqrt({a.scale_divisor:g}) (not sqrt({a.head_dim}))"]
    if a.qk_norm:
        over = {"head": "per head", "full": "all heads", "l2": "L2, after rotary"}[a.qk_norm]
        parts.append(f"QK-norm ({over})")
    if a.softcap is not None:
        parts.append(f"capped {a.softcap:g} tanh(s/{a.softcap:g})")
    if a.relative_bias:
        parts.append("+ distance bias")
    if a.logit_softcap is not None:
        parts.append(f"logits capped {a.logit_softcap:g} tanh(x/{a.logit_softcap:g})")
    return ", ".join(parts)


@dataclass(frozen=True)
class FamilyModel:
    """One model type qkv reads, described by what its family computes for transformers'
    default config of that type (e.g. MistralConfig(): Mistral 7B)."""

    model_type: str
    family: str
    anatomy: Anatomy | None
    problem: str | None = None  # why the default config could not be described


def family_models(families=None) -> list[FamilyModel]:
    """Every model type of `families` (default: all that qkv reads), in order."""
    import transformers  # an optional dependency, loaded only to describe its configs

    found = []
    for family in FAMILIES if families is None else families:
        named = [getattr(transformers, n) for n in family.config_classes]
        for model_type in family.model_types:
            classes = [c for c in named if c.model_type == model_type]
            cls = classes[0] if classes else _config_class(transformers, model_type)
            if cls is None:
                found.append(FamilyModel(model_type, family.name, None,
                                         "transformers has no config of this type"))  # fmt: skip
                continue
            try:
                found.append(FamilyModel(model_type, family.name,
                                         anatomy(family.config(cls().to_dict()))))  # fmt: skip
            except ValueError as error:
                found.append(FamilyModel(model_type, family.name, None, f"{cls.__name__}: {error}"))
    return found


def _config_class(transformers, model_type: str):
    try:
        return transformers.CONFIG_MAPPING[model_type]
    except KeyError:
        return None
