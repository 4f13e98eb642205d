"""Frozen configs for the three model shapes, and what they share.

One `BlockConfig` describes every block of a stack; the model configs add what lies
around the stack: the vocabulary, how positions enter, and the last norm and head.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Literal

import torch
from torch import Tensor, nn

from qkv.attention.inputs import check_indices
from qkv.nn import BlockConfig, Embeddings, RotaryEmbedding
from qkv.nn.embeddings import Position
from qkv.nn.position import SinusoidLayout
from qkv.nn.relative import RelativePositionBias
from qkv.nn.rope import RopeScaling

LayerType = Literal["full", "sliding", "chunked", "linear"]


@dataclass(frozen=True, kw_only=True)
class StackConfig:
    vocab_size: int
    block: BlockConfig
    max_positions: int = 512  # learned positions only: how many there are
    # added (learned, sinusoidal), rotary in attention, relative (T5's score bias), none
    position: Position = "learned"
    sinusoid_layout: SinusoidLayout = "interleaved"  # sinusoidal only: Marian's are "halves"
    relative_buckets: int = 32  # relative only: T5's relative_attention_num_buckets
    relative_max_distance: int = 128  # relative only: distances this far share a bucket
    rope_base: float = 10000.0  # rotary only: the base of the rotation frequencies
    rope_dims: int | None = None  # rotary only: how many of a head's dimensions turn; None: all
    rope_scaling: RopeScaling | None = None  # rotary only: Llama 3's, YaRN, LongRoPE, ...
    # per layer, "full", "sliding", "chunked" or "linear" (the block's window applies to sliding
    # layers only, its chunk to chunked layers only, its linear attention to linear layers only);
    # None: every layer is the block as configured
    layer_types: tuple[LayerType, ...] | None = None
    local_rope_base: float | None = None  # sliding layers' own rotary base, unscaled (Gemma 3)
    # per layer, whether its queries and keys turn (SmolLM3 leaves every 4th layer without
    # positions); None: every layer turns them
    rope_layers: tuple[bool, ...] | None = None
    # per layer, whether its MLP is the block's mixture of experts (block.experts); the others
    # are dense, of hidden size dense_mlp_hidden (DeepSeek-V3's first layers, Llama 4's
    # interleaving, Qwen3-MoE's mlp_only_layers); None: every layer as the block says
    moe_layers: tuple[bool, ...] | None = None
    dense_mlp_hidden: int | None = None  # the dense layers' MLP size; None: block.mlp_hidden
    type_vocab_size: int = 0  # BERT's segment embeddings; 0 for none
    embed_norm: bool = False  # BERT normalizes the summed embeddings
    embed_scale: bool = False  # the original transformer scales token vectors by sqrt(C)
    # Gemma: sqrt(C) rounded to the vectors' dtype before it multiplies (as transformers does)
    embed_scale_rounded: bool = False
    final_norm: bool | None = None  # a norm after the last block; None: iff pre-norm blocks

    def __post_init__(self):
        if self.vocab_size <= 0:
            raise ValueError(f"vocab_size must be positive, got {self.vocab_size}")
        if self.position not in ("learned", "sinusoidal", "rotary", "relative", "none"):
            raise ValueError(
                f"position must be 'learned', 'sinusoidal', 'rotary', 'relative' or 'none', "
                f"got {self.position!r}"
            )
        if self.sinusoid_layout != "interleaved" and self.position != "sinusoidal":
            raise ValueError("sinusoid_layout needs sinusoidal positions")
        for name in ("num_layers", "encoder_layers", "decoder_layers"):
            if getattr(self, name, 1) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.layer_types is not None:
            layers = getattr(self, "num_layers", None)
            if layers is not None and len(self.layer_types) != layers:
                raise ValueError(
                    f"layer_types names {len(self.layer_types)} layers, the model has {layers}"
                )
            odd = sorted(set(self.layer_types) - {"full", "sliding", "chunked", "linear"})
            if odd:
                raise ValueError(
                    f"layer types are 'full', 'sliding', 'chunked' or 'linear', got {odd}"
                )
            if "linear" in self.layer_types and self.block.linear is None:
                raise ValueError("linear layers need the block's linear attention (block.linear)")
            if "sliding" in self.layer_types and self.block.window is None:
                raise ValueError("sliding layers need the block's window (block.window)")
            if "chunked" in self.layer_types and self.block.chunk is None:
                raise ValueError("chunked layers need the block's chunk (block.chunk)")
        if (self.local_rope_base is not None or self.rope_dims is not None
                or self.rope_scaling is not None) and self.position != "rotary":  # fmt: skip
            raise ValueError("rope_dims, rope_scaling and local_rope_base need rotary positions")
        if self.moe_layers is not None:
            layers = getattr(self, "num_layers", None)
            if self.block.experts is None:
                raise ValueError("moe_layers needs the block's experts (block.experts)")
            if layers is not None and len(self.moe_layers) != layers:
                raise ValueError(
                    f"moe_layers names {len(self.moe_layers)} layers, the model has {layers}"
                )
        if self.rope_layers is not None:
            if self.position != "rotary":
                raise ValueError("rope_layers needs rotary positions")
            layers = getattr(self, "num_layers", None)
            if layers is not None and len(self.rope_layers) != layers:
                raise ValueError(
                    f"rope_layers names {len(self.rope_layers)} layers, the model has {layers}"
                )

    @property
    def has_final_norm(self) -> bool:
        return self.block.norm_position == "pre" if self.final_norm is None else self.final_norm

    def embeddings(self) -> Embeddings:
        return Embeddings(
            self.vocab_size,
            self.block.width,
            position=self.position,
            max_positions=self.max_positions,
            type_vocab_size=self.type_vocab_size,
            norm=self.block.norm if self.embed_norm else None,
            norm_eps=self.block.norm_eps,
            norm_bias=self.block.norm_bias,
            scale=math.sqrt(self.block.width) if self.embed_scale else 1.0,
            round_scale=self.embed_scale_rounded,
            dropout=self.block.dropout,
            sinusoid_layout=self.sinusoid_layout,
        )

    def relative_bias(self, *, bidirectional: bool) -> RelativePositionBias | None:
        """T5's relative position bias of this stack, shared by its blocks; None unless
        position is "relative"."""
        if self.position != "relative":
            return None
        return RelativePositionBias(
            self.block.num_heads, bidirectional=bidirectional,
            num_buckets=self.relative_buckets, max_distance=self.relative_max_distance,
        )  # fmt: skip

    def rotary(self) -> RotaryEmbedding | None:
        if self.position != "rotary":
            return None
        return RotaryEmbedding(
            self.block.rotary_size, self.rope_base, dims=self.rope_dims, scaling=self.rope_scaling
        )

    def local_rotary(self) -> RotaryEmbedding | None:
        """The sliding layers' own rotary embedding, where they have one (Gemma 3)."""
        if self.position != "rotary" or self.local_rope_base is None:
            return None
        return RotaryEmbedding(self.block.head_size, self.local_rope_base, dims=self.rope_dims)

    def layer_type(self, layer: int) -> LayerType:
        """ "sliding" where the layer's keys are windowed, "chunked" where they are cut into
        chunks, "linear" where it keeps a memory instead of a softmax, else "full"."""
        if self.layer_types is None:
            if self.block.linear is not None:
                return "linear"
            if self.block.chunk is not None:
                return "chunked"
            return "full" if self.block.window is None else "sliding"
        return self.layer_types[layer]

    def turns(self, layer: int) -> bool:
        """Whether the layer turns its queries and keys by rotary positions."""
        return self.position == "rotary" and (self.rope_layers is None or self.rope_layers[layer])

    def block_for(self, layer: int) -> BlockConfig:
        """The block config of one layer: a full layer of a model with sliding or chunked
        layers has no window and no chunk; a layer without rotary positions has no L2 QK-norm
        (which follows the rotation) and, where the temperature is for such layers only,
        a layer with them has none."""
        block, kind, turns = self.block, self.layer_type(layer), self.turns(layer)
        changes: dict = {}
        if block.window is not None and kind != "sliding":
            changes["window"] = None
        if block.chunk is not None and kind != "chunked":
            changes["chunk"] = None
        if block.linear is not None and kind != "linear":
            changes["linear"] = None
        if block.qk_norm == "l2" and not turns:
            changes["qk_norm"] = None
        if block.temperature is not None and block.temperature_where == "nope" and turns:
            changes["temperature"] = None
        if self.moe_layers is not None and not self.moe_layers[layer]:  # a dense layer
            changes["experts"] = None
            changes["mlp_hidden"] = self.dense_mlp_hidden or block.mlp_hidden
        return replace(block, **changes) if changes else block


@dataclass(frozen=True, kw_only=True)
class EncoderConfig(StackConfig):
    """A BERT-like encoder: bidirectional, post-norm by default as in BERT."""

    num_layers: int
    block: BlockConfig
    mlm_head: bool = False  # BERT's masked-language-model head, for logits over the vocabulary
    # RoBERTa's learned positions count from its padding id: a real token's position is
    # position_padding + 1 + how many real tokens precede it, padding sits at position_padding
    position_padding: int | None = None
    first_attn_norm: bool = True  # ModernBERT's first block reads the embeddings' norm instead


@dataclass(frozen=True, kw_only=True)
class DecoderConfig(StackConfig):
    """A GPT/Llama-like decoder: causal, with a language-model head."""

    num_layers: int
    block: BlockConfig
    tie_embeddings: bool = True  # the LM head reuses the token embedding matrix
    lm_head_bias: bool = False  # BART adds a fixed bias to the logits
    logit_softcap: float | None = None  # logits capped to cap * tanh(logit / cap) (Gemma 2)
    # the last hidden vectors are multiplied by this before the LM head (T5's tied head:
    # d_model ** -0.5); None: not scaled
    head_scale: float | None = None
    cross_attention: bool = False  # set by EncoderDecoder for its decoder


@dataclass(frozen=True, kw_only=True)
class EncoderDecoderConfig(StackConfig):
    """The original transformer: an encoder, and a decoder that cross-attends to it."""

    encoder_layers: int
    decoder_layers: int
    block: BlockConfig
    position: Position = "sinusoidal"
    embed_scale: bool = True
    tie_embeddings: bool = True  # one token matrix for encoder, decoder and LM head
    # with tie_embeddings, whether the LM head shares it too (T5 v1.1's has its own)
    tie_lm_head: bool = True
    lm_head_bias: bool = False
    head_scale: float | None = None  # see DecoderConfig

    def _stack(self) -> dict:
        return {
            name: getattr(self, name)
            for name in (
                "vocab_size", "block", "max_positions", "position", "rope_base", "rope_dims",
                "rope_scaling", "type_vocab_size", "embed_norm", "embed_scale",
                "embed_scale_rounded", "final_norm", "sinusoid_layout", "relative_buckets",
                "relative_max_distance", "layer_types", "local_rope_base", "rope_layers",
            )
        }  # fmt: skip

    def encoder(self) -> EncoderConfig:
        return EncoderConfig(num_layers=self.encoder_layers, **self._stack())

    def decoder(self) -> DecoderConfig:
        return DecoderConfig(
            num_layers=self.decoder_layers,
            tie_embeddings=self.tie_embeddings and self.tie_lm_head,
            lm_head_bias=self.lm_head_bias,
            head_scale=self.head_scale,
            cross_attention=True,
            **self._stack(),
        )


def init_weights(module: nn.Module, std: float = 0.02) -> None:
    """GPT-2's initialization: normal(0, std) matrices and embeddings, zero biases."""
    if isinstance(module, nn.Linear):
        nn.init.normal_(module.weight, std=std)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.Embedding):
        nn.init.normal_(module.weight, std=std)


Layers = Iterable[int] | Literal["all"] | None  # which layers' AttentionRecords to return


def recorded_layers(layers: Layers, num_layers: int) -> set[int]:
    """The layer indices asked for: none for None, every one for "all"; a clear error for a
    layer out of range.

    >>> sorted(recorded_layers("all", 3)), sorted(recorded_layers([2, 0], 3))
    ([0, 1, 2], [0, 2])
    """
    if layers is None:
        return set()
    if isinstance(layers, str):
        if layers != "all":
            raise ValueError(f"layers must be layer indices or 'all', got {layers!r}")
        return set(range(num_layers))
    return set(check_indices("layer", layers, num_layers, "the model"))


class Rotaries(nn.Module):
    """A stack's rotary embeddings, shared by its blocks: one for full layers and, where
    sliding layers have their own base (Gemma 3), one for those. `rotations` makes each
    one's cos and sin once per forward pass; `for_layer` picks a layer's."""

    def __init__(self, config: StackConfig):
        super().__init__()
        self.config = config
        self.full = config.rotary()
        self.local = config.local_rotary()

    def for_layer(self, layer: int) -> RotaryEmbedding | None:
        if self.config.rope_layers is not None and not self.config.rope_layers[layer]:
            return None  # a layer without positions (SmolLM3's NoPE layers)
        local = self.local is not None and self.config.layer_type(layer) == "sliding"
        return self.local if local else self.full

    def rotations(self, positions: Tensor, dtype: torch.dtype) -> dict[int, object]:
        """{id of a rotary embedding: its Rotation of these positions}."""
        made = {}
        for rotary in (self.full, self.local):
            if rotary is not None:
                made[id(rotary)] = rotary.rotation(positions, dtype)
        return made

    def rotation_for(self, made: dict, layer: int):
        rotary = self.for_layer(layer)
        return None if rotary is None else made[id(rotary)]


def mask_positions(attention_mask: Tensor, length: int) -> Tensor:
    """(B, length) positions of the last `length` tokens of a (B, Tk) attention mask: each
    row counts from its own first real token, so a left-padded row is placed as if alone."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)[:, -length:]


def check_resume(
    resume: tuple[int, Tensor] | None, input_ids: Tensor, config: StackConfig
) -> tuple[int, Tensor | None]:
    """(the first block to run, its input or None for the embeddings) from a forward's
    `resume=(layer, x)`: x must be (B, T, C) for input_ids (B, T), the layer one the model has."""
    if resume is None:
        return 0, None
    layer, x = resume
    check_indices("layer", [layer], config.num_layers, "the model")
    expected = (*input_ids.shape, config.block.width)
    if x.dim() != 3 or x.shape[1:] != expected[1:] or x.shape[0] not in (1, expected[0]):
        raise ValueError(
            f"resume's x has shape {tuple(x.shape)}; block {layer} reads {expected} for these ids"
        )
    return layer, x.expand(expected)


def check_stop(stop: int | None, first: int, num_layers: int) -> int:
    """The block after the last one a forward's `stop=` runs: all of them for None; else a
    layer after the first one run (`resume`) and at most the model's count."""
    if stop is None:
        return num_layers
    if type(stop) is not int or not first < stop <= num_layers:
        raise ValueError(f"stop must be a whole number in {first + 1}..{num_layers} (the blocks "
                         f"before it run), got {stop!r}")  # fmt: skip
    return stop


def key_padding(attention_mask: Tensor | None) -> Tensor | None:
    """A (B, T) mask of 1/True for real tokens, 0/False for padding, as booleans."""
    if attention_mask is None:
        return None
    if attention_mask.dim() != 2:
        raise ValueError(
            "attention_mask must be (B, T) with 1 for real tokens, got shape "
            f"{tuple(attention_mask.shape)}"
        )
    return attention_mask.to(torch.bool)
