"""Encoder and decoder blocks: attention, then an MLP, each inside a residual connection.

The article's "several layers" are these blocks stacked: each takes contextualized
vectors and adds context to them again. Pre-norm blocks (GPT-2, Llama) normalize the
input of each sub-layer; post-norm blocks (the original transformer, BERT) normalize
after each residual sum. Some families also normalize each sub-layer's output before the
sum (`sublayer_norm`: Gemma 2 and 3 beside pre-norms, OLMo 2 instead of them), and some
run attention and the MLP side by side on the same input (`parallel`: GPT-NeoX).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

from torch import Tensor, nn

from qkv.nn.attention import KVCache, MultiHeadAttention
from qkv.nn.delta import DeltaConfig, GatedDeltaNet
from qkv.nn.edit import Edit
from qkv.nn.experts import ExpertRecord, Experts, MoE
from qkv.nn.latent import LatentAttention, LatentConfig
from qkv.nn.mlps import GATED, MLP, Activation, GatedMLP
from qkv.nn.norms import NormKind, make_norm
from qkv.nn.position import RotaryEmbedding, Rotation, Temperature
from qkv.nn.record import AttentionRecord


@dataclass(frozen=True)
class BlockConfig:
    """The shape of one transformer block; every block of a stack shares it."""

    width: int  # C, the size of every token's vector between blocks
    num_heads: int  # H
    num_kv_heads: int | None = None  # Hkv; None means H (no sharing)
    head_dim: int | None = None  # D; None means C / H, so concatenated heads are C wide
    mlp_hidden: int | None = None  # None means 4 * C, the original paper's ratio
    # an activation (widen, activate, narrow) or a gated MLP: swiglu (silu, Llama), geglu
    # (gelu, ModernBERT), geglu_tanh (tanh-approximated gelu, Gemma)
    mlp: Activation | Literal["swiglu", "geglu", "geglu_tanh"] = "gelu"
    norm: NormKind = "layernorm"
    norm_eps: float = 1e-5
    norm_bias: bool = True  # LayerNorm's shift (ModernBERT's norms have none)
    # where each sub-layer's norm sits: before it (pre), after the residual sum (post), or
    # nowhere (none: OLMo 2, which only normalizes sub-layer outputs)
    norm_position: Literal["pre", "post", "none"] = "pre"
    sublayer_norm: bool = False  # a norm on each sub-layer's output, before the residual sum
    parallel: bool = False  # x + attention(norm(x)) + mlp(norm'(x)) (GPT-NeoX)
    bias: bool = True  # biases on the attention and MLP projections
    qkv_bias: bool | None = None  # biases on the query, key, value projections; None: bias
    fused_qkv: bool = False  # one Linear for the query, key and value matrices
    fused_mlp: bool = False  # a gated MLP's gate and up matrices in one Linear (Phi-3)
    attn_scale: float | None = None  # on every dot product; None: 1/sqrt(head size)
    softcap: float | None = None  # scores capped to softcap * tanh(score / softcap)
    window: int | None = None  # keys this many positions away or more are hidden
    # a norm on queries and keys: per head or over all heads before rotary (Qwen3, OLMo 2), or
    # "l2", weightless after rotary, on layers with rotary positions (Llama 4)
    qk_norm: Literal["head", "full", "l2"] | None = None
    chunk: int | None = None  # a query sees only its own chunk of this many positions (Llama 4)
    sinks: bool = False  # one learned score per head in every query's softmax (gpt-oss)
    # each query's scores times a temperature of its position (Ministral 3), on every layer or,
    # with temperature_where="nope", only on layers without rotary positions (Llama 4)
    temperature: Temperature | None = None
    temperature_where: Literal["all", "nope"] = "all"
    # the heads' outputs times a sigmoid gate made from x before the output projection
    # (Qwen3.5, Qwen3-Next: attn_output_gate)
    output_gate: bool = False
    # the MLP is a mixture of experts (Mixtral, Qwen3-MoE, gpt-oss, DeepSeek-V3, Llama 4)
    experts: Experts | None = None
    # the attention is DeepSeek's multi-head latent attention (keys and values made from one
    # compressed vector per token), not MultiHeadAttention; its sizes are the LatentConfig's
    latent: LatentConfig | None = None
    # the attention is linear: a running memory per head instead of a softmax (Qwen3.5's Gated
    # DeltaNet, Kimi's KDA); its sizes are the DeltaConfig's. In a stack with layer_types, only
    # the "linear" layers have it
    linear: DeltaConfig | None = None
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
        if self.norm_position not in ("pre", "post", "none"):
            raise ValueError(
                f"norm_position must be 'pre', 'post' or 'none', got {self.norm_position!r}"
            )
        if self.parallel and (self.norm_position != "pre" or self.sublayer_norm):
            raise ValueError("a parallel block normalizes before its sub-layers only (pre)")
        if self.fused_mlp and self.mlp not in GATED:
            raise ValueError(f"fused_mlp needs a gated mlp ({', '.join(GATED)}), got {self.mlp!r}")
        for name in ("window", "chunk"):
            value = getattr(self, name)
            if value is not None and (type(value) is not int or value < 1):
                raise ValueError(f"{name} must be a whole number >= 1 or None, got {value!r}")
        if self.temperature_where not in ("all", "nope"):
            raise ValueError(f"temperature_where must be 'all' or 'nope', got "
                             f"{self.temperature_where!r}")  # fmt: skip
        for name in ("attn_scale", "softcap"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be positive or None, got {value!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")

    @property
    def kv_heads(self) -> int:
        return self.num_kv_heads or self.num_heads

    @property
    def head_size(self) -> int:
        return self.head_dim or self.width // self.num_heads

    @property
    def rotary_size(self) -> int:
        """How many dimensions of a head its rotary embedding turns (latent attention's rope
        slice; else the head size, of which a stack's rope_dims may turn a part)."""
        return self.head_size if self.latent is None else self.latent.qk_rope_head_dim

    def attention(self, rotary: RotaryEmbedding | None = None, cross=False) -> nn.Module:
        if self.linear is not None:
            if cross:
                raise ValueError("linear attention is self-attention (a memory of the text)")
            return GatedDeltaNet(self.linear, backend=self.backend)
        if self.latent is not None:
            if cross:  # without rotary positions nothing turns (Kimi Linear's layers)
                raise ValueError("latent attention is self-attention")
            return LatentAttention(self.latent, rotary, backend=self.backend)
        return MultiHeadAttention(
            self.width,
            self.num_heads,
            num_kv_heads=self.kv_heads,
            head_dim=self.head_size,
            bias=self.bias if self.qkv_bias is None else self.qkv_bias,
            out_bias=self.bias,
            fused_qkv=self.fused_qkv,
            rotary=None if cross else rotary,
            backend=self.backend,
            scale=self.attn_scale,
            softcap=self.softcap,
            window=None if cross else self.window,
            qk_norm=self.qk_norm,
            norm=self.norm,
            norm_eps=self.norm_eps,
            chunk=None if cross else self.chunk,
            sinks=self.sinks and not cross,
            temperature=None if cross else self.temperature,
            output_gate=self.output_gate and not cross,
        )

    def feed_forward(self) -> nn.Module:
        if self.experts is not None:
            return self.experts.module(self.width)
        hidden = self.mlp_hidden or 4 * self.width
        if self.mlp in GATED:
            return GatedMLP(self.width, hidden, GATED[self.mlp], self.bias, self.fused_mlp)
        return MLP(self.width, hidden, self.mlp, bias=self.bias)

    def make_norm(self) -> nn.Module:
        return make_norm(self.norm, self.width, self.norm_eps, self.norm_bias)


class _Block(nn.Module):
    def __init__(self, config: BlockConfig):
        super().__init__()
        self.position = config.norm_position
        self.parallel = config.parallel
        self.dropout = nn.Dropout(config.dropout)

    def norms(self, config: BlockConfig, name: str) -> None:
        """A sub-layer's norms: `{name}_norm` where norm_position puts one, and
        `{name}_out_norm` on its output with sublayer_norm."""
        setattr(self, f"{name}_norm", None if self.position == "none" else config.make_norm())
        setattr(self, f"{name}_out_norm", config.make_norm() if config.sublayer_norm else None)

    def sublayer_input(self, x: Tensor, norm: nn.Module | None) -> Tensor:
        """What a sublayer reads: x normalized (pre-norm), or x itself."""
        return norm(x) if self.position == "pre" else x

    def head_inputs(self, x: Tensor, edit: Edit | None) -> dict:
        """The attention's `head_inputs` keyword where `edit` adds to a head's own input
        (q_input, k_input, v_input: (B, T, H, C)): x plus each, through the attention's norm,
        one input per head; {} otherwise. A layer that computes no head apart refuses."""
        if edit is None or not edit.inputs:
            return {}
        if not isinstance(self.attn, MultiHeadAttention):
            edit.refuse_per_head(type(self.attn).__name__)
        made = {
            name: self.sublayer_input(x[:, :, None, :] + add.to(x.dtype), self.attn_norm)
            for name, add in edit.inputs.items()
        }  # (B, T, H, C) each
        return {"head_inputs": made}

    def residual(
        self, x: Tensor, out: Tensor, norm: nn.Module | None, out_norm: nn.Module | None = None
    ) -> Tensor:
        """x plus a sublayer's output (normalized first with out_norm), normalized after the
        sum in a post-norm block."""
        if out_norm is not None:
            out = out_norm(out)
        x = x + self.dropout(out)
        return norm(x) if self.position == "post" else x

    def feed_forward(
        self, x: Tensor, attended: Tensor | None = None, edit: Edit | None = None
    ) -> Tensor:
        """The MLP's part of the block. A parallel block passes its input x and attention's
        output `attended`, not yet added: both sub-layers read x and add to it. edit: its
        `mlp` replaces the MLP's output at those positions."""
        return self.feed_forward_recorded(x, attended, edit=edit)[0]

    def feed_forward_recorded(
        self, x: Tensor, attended: Tensor | None = None, record: bool = False,
        edit: Edit | None = None,
    ) -> tuple[Tensor, ExpertRecord | None, Tensor]:  # fmt: skip
        """`feed_forward`, the experts' record where the MLP is a mixture of experts and
        `record` asks for it (None otherwise), and the MLP's output (B, T, C) as it joins the
        stream (after its out-norm, where the block has one)."""
        if self.parallel:
            mlp, kept = self._mlp(self.mlp_norm(x), record)
            mlp = mlp if edit is None else edit.mlp_output(mlp)
            return x + self.dropout(attended) + self.dropout(mlp), kept, mlp
        h = self.sublayer_input(x, self.mlp_norm)
        mlp, kept = self._mlp(h, record)
        mlp = mlp if edit is None else edit.mlp_output(mlp)
        if self.mlp_out_norm is not None:
            mlp = self.mlp_out_norm(mlp)
        return self.residual(x, mlp, self.mlp_norm), kept, mlp

    def _mlp(self, h: Tensor, record: bool) -> tuple[Tensor, ExpertRecord | None]:
        if isinstance(self.mlp, MoE):
            return self.mlp(h, record=record)
        return self.mlp(h), None


class EncoderBlock(_Block):
    """Bidirectional self-attention and an MLP: every word sees every word."""

    def __init__(self, config: BlockConfig, rotary: RotaryEmbedding | None = None):
        super().__init__(config)
        self.norms(config, "attn")
        self.attn = config.attention(rotary)
        self.norms(config, "mlp")
        self.mlp = config.feed_forward()

    def forward(
        self,
        x: Tensor,
        *,
        mask: Tensor | None = None,
        rotation: Rotation | None = None,
        bias: Tensor | None = None,
        edit: Edit | None = None,
        record: bool = False,
        weights_into: Tensor | None = None,
    ) -> tuple[Tensor, AttentionRecord | None]:
        """x (B, T, C) -> (B, T, C), and the attention's record if asked (MultiHeadAttention).

        mask: any mask `attend` takes, e.g. key padding (B, 1, 1, T).
        edit: an intervention in this block (`qkv.nn.edit.Edit`).
        record, weights_into: as MultiHeadAttention's.
        """
        h = self.sublayer_input(x, self.attn_norm)
        if isinstance(self.attn, GatedDeltaNet):  # a memory read left to right: causal
            padding = None if mask is None else mask[:, 0, 0, :]  # (B, 1, 1, T) -> (B, T)
            attended, kept = self.attn(h, key_padding_mask=padding, edit=edit, record=record)
        else:
            attended, kept = self.attn(
                h, mask=mask, rotation=rotation, bias=bias, edit=edit, record=record,
                weights_into=weights_into, **self.head_inputs(x, edit),
            )  # fmt: skip
        if self.parallel:
            x, _, mlp = self.feed_forward_recorded(x, attended, edit=edit)
            return _edited(x, edit), _sublayers(kept, attended, mlp)
        if self.attn_out_norm is not None:
            attended = self.attn_out_norm(attended)
        x = self.residual(x, attended, self.attn_norm)
        x, _, mlp = self.feed_forward_recorded(x, edit=edit)
        return _edited(x, edit), _sublayers(kept, attended, mlp)


class DecoderBlock(_Block):
    """Causal self-attention, optional cross-attention to an encoder's output, an MLP."""

    def __init__(
        self, config: BlockConfig, rotary: RotaryEmbedding | None = None, cross_attention=False
    ):
        super().__init__(config)
        if config.parallel and cross_attention:
            raise ValueError("a parallel block has no cross-attention")
        self.norms(config, "attn")
        self.attn = config.attention(rotary)
        self.cross_norm = self.cross_out_norm = self.cross_attn = None
        if cross_attention:
            self.norms(config, "cross")
            self.cross_attn = config.attention(cross=True)
        self.norms(config, "mlp")
        self.mlp = config.feed_forward()

    def forward(
        self,
        x: Tensor,
        context: Tensor | None = None,
        *,
        key_padding_mask: Tensor | None = None,
        context_mask: Tensor | None = None,
        rotation: Rotation | None = None,
        positions: Tensor | None = None,
        cache: KVCache | None = None,
        cross_cache: KVCache | None = None,
        bias: Tensor | None = None,
        cross_bias: Tensor | None = None,
        edit: Edit | None = None,
        record: bool = False,
        weights_into: Tensor | None = None,
        record_cross: bool = False,
    ) -> tuple[Tensor, AttentionRecord | None, AttentionRecord | None, ExpertRecord | None]:
        """x (B, T, C) -> (B, T, C), the self- and the cross-attention's records if asked, and
        the experts' record where the MLP is a mixture of experts and `record` asks.

        key_padding_mask: (B, Tk), True for the decoder's real tokens (cached ones too).
        context: the encoder's output (B, S, C), with context_mask (B, S) True for real
        tokens; needed on every step when the block has cross-attention.
        edit: an intervention in this block's self-attention and output (`Edit`).
        record, weights_into: as MultiHeadAttention's, for the self-attention.
        """
        h = self.sublayer_input(x, self.attn_norm)
        attended, kept = self.attn(
            h, key_padding_mask=key_padding_mask, causal=True, rotation=rotation,
            positions=positions, cache=cache, bias=bias, edit=edit, record=record,
            weights_into=weights_into, **self.head_inputs(x, edit),
        )  # fmt: skip
        if self.parallel:
            x, experts, mlp = self.feed_forward_recorded(x, attended, record, edit)
            return _edited(x, edit), _sublayers(kept, attended, mlp), None, experts
        if self.attn_out_norm is not None:
            attended = self.attn_out_norm(attended)
        x = self.residual(x, attended, self.attn_norm)
        attn_out = attended
        kept_cross = None
        if self.cross_attn is not None:
            if context is None:
                raise ValueError("this decoder block has cross-attention: pass the encoder output")
            h = self.sublayer_input(x, self.cross_norm)
            attended, kept_cross = self.cross_attn(
                h, context, key_padding_mask=context_mask, cache=cross_cache, bias=cross_bias,
                record=record_cross,
            )  # fmt: skip
            x = self.residual(x, attended, self.cross_norm, self.cross_out_norm)
        x, experts, mlp = self.feed_forward_recorded(x, record=record, edit=edit)
        return _edited(x, edit), _sublayers(kept, attn_out, mlp), kept_cross, experts


def _sublayers(kept: AttentionRecord | None, attn_out: Tensor, mlp_out: Tensor):
    """The record with what its block's attention and MLP added to the stream (B, T, C)."""
    return None if kept is None else replace(kept, attn_out=attn_out, mlp_out=mlp_out)


def _edited(x: Tensor, edit: Edit | None) -> Tensor:
    return x if edit is None else edit.block_output(x)
