"""Frozen configs for the three model shapes, and what they share.

One `BlockConfig` describes every block of a stack; the model configs add what lies
around the stack: the vocabulary, how positions enter, and the last norm and head.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor, nn

from qkv.attention.inputs import check_indices
from qkv.nn import BlockConfig, Embeddings, RotaryEmbedding
from qkv.nn.layers import Position


@dataclass(frozen=True, kw_only=True)
class StackConfig:
    vocab_size: int
    block: BlockConfig
    max_positions: int = 512  # learned positions only: how many there are
    position: Position = "learned"  # added (learned, sinusoidal), rotary in attention, none
    rope_base: float = 10000.0  # rotary only: the base of the rotation frequencies
    type_vocab_size: int = 0  # BERT's segment embeddings; 0 for none
    embed_norm: bool = False  # BERT normalizes the summed embeddings
    embed_scale: bool = False  # the original transformer scales token vectors by sqrt(C)
    final_norm: bool | None = None  # a norm after the last block; None: iff pre-norm blocks

    def __post_init__(self):
        if self.vocab_size <= 0:
            raise ValueError(f"vocab_size must be positive, got {self.vocab_size}")
        if self.position not in ("learned", "sinusoidal", "rotary", "none"):
            raise ValueError(
                f"position must be 'learned', 'sinusoidal', 'rotary' or 'none', "
                f"got {self.position!r}"
            )
        for name in ("num_layers", "encoder_layers", "decoder_layers"):
            if getattr(self, name, 1) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")

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
            scale=math.sqrt(self.block.width) if self.embed_scale else 1.0,
            dropout=self.block.dropout,
        )

    def rotary(self) -> RotaryEmbedding | None:
        if self.position != "rotary":
            return None
        return RotaryEmbedding(self.block.head_size, base=self.rope_base)


@dataclass(frozen=True, kw_only=True)
class EncoderConfig(StackConfig):
    """A BERT-like encoder: bidirectional, post-norm by default as in BERT."""

    num_layers: int
    block: BlockConfig
    mlm_head: bool = False  # BERT's masked-language-model head, for logits over the vocabulary


@dataclass(frozen=True, kw_only=True)
class DecoderConfig(StackConfig):
    """A GPT/Llama-like decoder: causal, with a language-model head."""

    num_layers: int
    block: BlockConfig
    tie_embeddings: bool = True  # the LM head reuses the token embedding matrix
    lm_head_bias: bool = False  # BART adds a fixed bias to the logits
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
    lm_head_bias: bool = False

    def _stack(self) -> dict:
        return {
            name: getattr(self, name)
            for name in (
                "vocab_size", "block", "max_positions", "position", "rope_base",
                "type_vocab_size", "embed_norm", "embed_scale", "final_norm",
            )
        }  # fmt: skip

    def encoder(self) -> EncoderConfig:
        return EncoderConfig(num_layers=self.encoder_layers, **self._stack())

    def decoder(self) -> DecoderConfig:
        return DecoderConfig(
            num_layers=self.decoder_layers,
            tie_embeddings=self.tie_embeddings,
            lm_head_bias=self.lm_head_bias,
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

    >>> sorted(recorded_layers("all", 3)), sorted(recorded_layers([2, 0, 2], 3))
    ([0, 1, 2], [0, 2])
    """
    if layers is None:
        return set()
    if isinstance(layers, str):
        if layers != "all":
            raise ValueError(f"layers must be layer indices or 'all', got {layers!r}")
        return set(range(num_layers))
    return set(check_indices("layer", layers, num_layers, "the model"))


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
