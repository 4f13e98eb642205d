"""Encoder and decoder blocks: attention, then an MLP, each inside a residual connection.

The article's "several layers" are these blocks stacked: each takes contextualized
vectors and adds context to them again. Pre-norm blocks (GPT-2, Llama) normalize the
input of each sub-layer; post-norm blocks (the original transformer, BERT) normalize
after each residual sum.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from torch import Tensor, nn

from qkv.nn.attention import KVCache, MultiHeadAttention
from qkv.nn.layers import MLP, Activation, NormKind, SwiGLU, make_norm
from qkv.nn.position import RotaryEmbedding, Rotation
from qkv.nn.record import AttentionRecord


@dataclass(frozen=True)
class BlockConfig:
    """The shape of one transformer block; every block of a stack shares it."""

    width: int  # C, the size of every token's vector between blocks
    num_heads: int  # H
    num_kv_heads: int | None = None  # Hkv; None means H (no sharing)
    head_dim: int | None = None  # D; None means C / H, so concatenated heads are C wide
    mlp_hidden: int | None = None  # None means 4 * C, the original paper's ratio
    mlp: Activation | Literal["swiglu"] = "gelu"
    norm: NormKind = "layernorm"
    norm_eps: float = 1e-5
    norm_position: Literal["pre", "post"] = "pre"
    bias: bool = True  # biases on the attention and MLP projections
    fused_qkv: bool = False  # one Linear for the query, key and value matrices
    dropout: float = 0.0  # on each sub-layer's output, before the residual sum
    backend: str = "auto"  # the `attend` backend

    def __post_init__(self):
        if self.width <= 0 or self.num_heads <= 0:
            raise ValueError(f"width and num_heads must be positive, got {self}")
        if self.head_dim is None and self.width % self.num_heads:
            raise ValueError(
                f"width {self.width} is not divisible by num_heads {self.num_heads}; set head_dim"
            )
        if self.num_heads % (self.num_kv_heads or self.num_heads):
            raise ValueError(
                f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}"
            )
        if self.norm_position not in ("pre", "post"):
            raise ValueError(f"norm_position must be 'pre' or 'post', got {self.norm_position!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")

    @property
    def kv_heads(self) -> int:
        return self.num_kv_heads or self.num_heads

    @property
    def head_size(self) -> int:
        return self.head_dim or self.width // self.num_heads

    def attention(self, rotary: RotaryEmbedding | None = None, cross=False) -> MultiHeadAttention:
        return MultiHeadAttention(
            self.width,
            self.num_heads,
            num_kv_heads=self.kv_heads,
            head_dim=self.head_size,
            bias=self.bias,
            fused_qkv=self.fused_qkv,
            rotary=None if cross else rotary,
            backend=self.backend,
        )

    def feed_forward(self) -> nn.Module:
        hidden = self.mlp_hidden or 4 * self.width
        if self.mlp == "swiglu":
            return SwiGLU(self.width, hidden, bias=self.bias)
        return MLP(self.width, hidden, self.mlp, bias=self.bias)

    def make_norm(self) -> nn.Module:
        return make_norm(self.norm, self.width, self.norm_eps)


class _Block(nn.Module):
    def __init__(self, config: BlockConfig):
        super().__init__()
        self.pre_norm = config.norm_position == "pre"
        self.dropout = nn.Dropout(config.dropout)

    def sublayer_input(self, x: Tensor, norm: nn.Module) -> Tensor:
        """What a sublayer reads: x normalized (pre-norm), or x itself (post-norm)."""
        return norm(x) if self.pre_norm else x

    def residual(self, x: Tensor, out: Tensor, norm: nn.Module) -> Tensor:
        """x plus a sublayer's output, normalized after the sum in a post-norm block."""
        x = x + self.dropout(out)
        return x if self.pre_norm else norm(x)


class EncoderBlock(_Block):
    """Bidirectional self-attention and an MLP: every word sees every word."""

    def __init__(self, config: BlockConfig, rotary: RotaryEmbedding | None = None):
        super().__init__(config)
        self.attn_norm, self.attn = config.make_norm(), config.attention(rotary)
        self.mlp_norm, self.mlp = config.make_norm(), config.feed_forward()

    def forward(
        self,
        x: Tensor,
        *,
        mask: Tensor | None = None,
        rotation: Rotation | None = None,
        record: bool = False,
    ) -> tuple[Tensor, AttentionRecord | None]:
        """x (B, T, C) -> (B, T, C), and the attention's record if asked (MultiHeadAttention).

        mask: any mask `attend` takes, e.g. key padding (B, 1, 1, T).
        """
        h = self.sublayer_input(x, self.attn_norm)
        attended, kept = self.attn(h, mask=mask, rotation=rotation, record=record)
        x = self.residual(x, attended, self.attn_norm)
        x = self.residual(x, self.mlp(self.sublayer_input(x, self.mlp_norm)), self.mlp_norm)
        return x, kept


class DecoderBlock(_Block):
    """Causal self-attention, optional cross-attention to an encoder's output, an MLP."""

    def __init__(
        self, config: BlockConfig, rotary: RotaryEmbedding | None = None, cross_attention=False
    ):
        super().__init__(config)
        self.attn_norm, self.attn = config.make_norm(), config.attention(rotary)
        self.cross_norm = self.cross_attn = None
        if cross_attention:
            self.cross_norm, self.cross_attn = config.make_norm(), config.attention(cross=True)
        self.mlp_norm, self.mlp = config.make_norm(), config.feed_forward()

    def forward(
        self,
        x: Tensor,
        context: Tensor | None = None,
        *,
        key_padding_mask: Tensor | None = None,
        context_mask: Tensor | None = None,
        rotation: Rotation | None = None,
        cache: KVCache | None = None,
        cross_cache: KVCache | None = None,
        record: bool = False,
        record_cross: bool = False,
    ) -> tuple[Tensor, AttentionRecord | None, AttentionRecord | None]:
        """x (B, T, C) -> (B, T, C), the self- and the cross-attention's records if asked.

        key_padding_mask: (B, Tk), True for the decoder's real tokens (cached ones too).
        context: the encoder's output (B, S, C), with context_mask (B, S) True for real
        tokens; needed on every step when the block has cross-attention.
        """
        h = self.sublayer_input(x, self.attn_norm)
        attended, kept = self.attn(
            h, key_padding_mask=key_padding_mask, causal=True, rotation=rotation, cache=cache,
            record=record,
        )  # fmt: skip
        x = self.residual(x, attended, self.attn_norm)
        kept_cross = None
        if self.cross_attn is not None:
            if context is None:
                raise ValueError("this decoder block has cross-attention: pass the encoder output")
            h = self.sublayer_input(x, self.cross_norm)
            attended, kept_cross = self.cross_attn(
                h, context, key_padding_mask=context_mask, cache=cross_cache, record=record_cross
            )
            x = self.residual(x, attended, self.cross_norm)
        x = self.residual(x, self.mlp(self.sublayer_input(x, self.mlp_norm)), self.mlp_norm)
        return x, kept, kept_cross
