"""Gemma 4's decoder layer: what it adds to a Gemma 3 block, each part optional per layer.

- Attention with a score scale of 1 (queries and keys are RMS-normalized per head), values
  RMS-normalized per head with no gain, and on some layers no value matrix at all: the
  values are the raw key projection (`values_from_keys`, transformers' attention_k_eq_v),
  normalized without a gain while the keys get the key norm's gain and rotary positions.
- Shared keys and values (`shares_keys`): the last layers of a model have no key or value
  matrix and attend over the keys and values of an earlier layer of the same type (its
  cache, read and never written); their records say which layer's (`shared_from`).
- The full layers' "proportional" rotary positions (`ProportionalRotary`).
- A mixture of experts beside the dense MLP, with norms of its own around it.
- Per-layer inputs: a vector per token and layer (`PerLayerInputs`, made once from the token
  ids and embeddings), gated into each layer's output; then a learned scalar on the output.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from qkv.attention import attend_for_record
from qkv.nn.attention import KVCache, MultiHeadAttention, l2_norm
from qkv.nn.blocks import BlockConfig, DecoderBlock, _Block, _edited
from qkv.nn.edit import Edit
from qkv.nn.experts import ExpertRecord, Experts
from qkv.nn.linear import project
from qkv.nn.mlps import ACTIVATIONS
from qkv.nn.position import RotaryEmbedding, Rotation, positions_for
from qkv.nn.record import AttentionRecord


@dataclass(frozen=True)
class Gemma4Layer:
    """What one Gemma 4 layer adds to its BlockConfig."""

    values_from_keys: bool = False  # no value matrix: values are the raw key projection
    shares_keys: bool = False  # no key or value matrix: an earlier layer's keys and values
    experts: Experts | None = None  # a mixture of experts beside the dense MLP
    per_layer_input: int = 0  # P, the size of the layer's own input per token; 0: none


class ProportionalRotary(RotaryEmbedding):
    """Gemma 4's "proportional" rotary positions of a head of D dimensions: the first
    n = int(fraction * D // 2) frequencies are base^(-2i/D) (the exponent over the whole head),
    the other D/2 - n are 0 (their pairs do not turn), all divided by `factor`. The pairs
    (i, i + D/2) of every i < D/2 make the rotation, as in plain rotary."""

    def __init__(self, head_dim: int, base: float, fraction: float, factor: float = 1.0):
        self.fraction, self.factor = fraction, factor
        super().__init__(head_dim, base)

    def _inv_freq(self) -> Tensor:
        D = self.head_dim
        n = int(self.fraction * D // 2)
        with torch.device("cpu"):
            exponents = torch.arange(0, 2 * n, 2, dtype=torch.int64).float() / D
            freq = torch.cat([1.0 / self.base**exponents, torch.zeros(D // 2 - n)])
            freq = freq / self.factor
        return freq.to(torch.get_default_device())

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, fraction={self.fraction}, factor={self.factor}"


class PerLayerInputs(nn.Module):
    """Each token's input to each layer (B, T, L, P): a token vector of its own table, scaled
    by sqrt(P) (rounded to the weights' dtype), plus a projection of the token's scaled
    embedding, normalized over P; the two summed and scaled by 1/sqrt(2)."""

    def __init__(self, vocab_size: int, width: int, num_layers: int, size: int, eps: float):
        super().__init__()
        self.num_layers, self.size = num_layers, size
        self.tokens = nn.Embedding(vocab_size, num_layers * size)  # (V', L*P)
        self.projection = nn.Linear(width, num_layers * size, bias=False)  # (L*P, C)
        self.norm = Gemma4Norm(size, eps)

    def forward(self, input_ids: Tensor, embedded: Tensor) -> Tensor:
        """input_ids (B, T) and their scaled embeddings (B, T, C) -> (B, T, L, P)."""
        B, T = input_ids.shape
        weight = self.tokens.weight
        scale = torch.tensor(math.sqrt(self.size), dtype=torch.float32).to(weight.dtype)
        tokens = (self.tokens(input_ids) * scale).reshape(B, T, self.num_layers, self.size)
        projected = project(self.projection, embedded) * embedded.shape[-1] ** -0.5
        projected = self.norm(projected.reshape(B, T, self.num_layers, self.size))
        return (projected + tokens) * 2.0**-0.5


class Gemma4Norm(nn.Module):
    """Gemma 4's RMSNorm: x / sqrt(mean(x^2) + eps) times the gain (weight, not 1 + weight),
    all in float32 and cast once at the end; with gain=False, no weight."""

    def __init__(self, width: int, eps: float = 1e-6, gain: bool = True):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(width)) if gain else None

    def forward(self, x: Tensor) -> Tensor:
        h = x if x.dtype == torch.float64 else x.float()
        h = h * torch.pow(h.pow(2).mean(-1, keepdim=True) + self.eps, -0.5)
        if self.weight is not None:
            h = h * self.weight.to(h.dtype)
        return h.type_as(x)


class Gemma4Attention(MultiHeadAttention):
    """Self-attention of one Gemma 4 layer (see the module's list): per-head query and key
    norms before rotary positions, gainless value norm, scale from the BlockConfig (1)."""

    def __init__(self, config: BlockConfig, rotary: RotaryEmbedding, layer: Gemma4Layer):
        super().__init__(
            config.width, config.num_heads, num_kv_heads=config.kv_heads,
            head_dim=config.head_size, bias=False, rotary=rotary, backend=config.backend,
            scale=config.attn_scale, softcap=config.softcap, window=config.window,
            qk_norm="head", norm=config.norm, norm_eps=config.norm_eps,
        )  # fmt: skip
        self.q_norm = Gemma4Norm(self.head_dim, config.norm_eps)
        self.k_norm = Gemma4Norm(self.head_dim, config.norm_eps)
        self.values_from_keys, self.shares_keys = layer.values_from_keys, layer.shares_keys
        if self.values_from_keys or self.shares_keys:
            del self.v
        if self.shares_keys:
            del self.k, self.k_norm

    def forward(
        self,
        x: Tensor,
        *,
        key_padding_mask: Tensor | None = None,
        positions: Tensor | None = None,
        rotation: Rotation | None = None,
        cache: KVCache | None = None,
        shared: KVCache | None = None,
        shared_from: int | None = None,
        edit: Edit | None = None,
        record: bool = False,
        weights_into: Tensor | None = None,
    ) -> tuple[Tensor, AttentionRecord | None]:
        """x (B, T, C) -> (out (B, T, C), the AttentionRecord or None); causal.

        cache: this layer's own, appended to. shared: on a layer that shares keys, the cache
        of the layer whose keys and values it reads (already holding this step's tokens);
        shared_from: that layer's index, kept in the record. The rest as MultiHeadAttention's.
        """
        if weights_into is not None and not record:
            raise ValueError("weights_into makes the weights a record keeps: pass record=True")
        B, T, _ = x.shape
        q = self.q_norm(self.split_heads(project(self.q, x), self.num_heads))  # (B, H, T, D)
        if rotation is None:
            if positions is None:
                past = (shared.length - T) if self.shares_keys and shared else 0
                past = cache.length if cache is not None and not self.shares_keys else past
                positions = positions_for(T, past, x.device)
            rotation = self.rotary.rotation(positions, q.dtype)
        q_plain, k_plain = q, None
        q = rotation.apply(q)
        if self.shares_keys:
            if shared is None or shared.length == 0:
                raise ValueError("this layer attends over an earlier layer's keys and values: "
                                 "pass that layer's cache as shared")  # fmt: skip
            k, v = shared.stored()  # (B, Hkv, Tk, D), this step's tokens included
        else:
            k_raw = project(self.k, x)  # (B, T, Hkv*D)
            v_raw = k_raw if self.values_from_keys else project(self.v, x)
            k_plain = self.k_norm(self.split_heads(k_raw, self.num_kv_heads))  # (B, Hkv, T, D)
            v = l2_norm(self.split_heads(v_raw, self.num_kv_heads), self.norm_eps)
            k = rotation.apply(k_plain)
            if cache is not None:
                k, v = cache.update(k, v)  # (B, Hkv, Tk, D), earlier tokens first
        mask = None
        if key_padding_mask is not None:
            mask = key_padding_mask.to(torch.bool)[:, None, None, :]  # (B, 1, 1, Tk)
        if edit is not None:
            edit.refuse_per_head("a Gemma 4 attention layer")
            mask = edit.mask(mask)
        attended = attend_for_record(
            q, k, v, mask=mask, causal=True, scale=self.scale, window=self.window,
            softcap=self.softcap, backend=self.backend, weights=weights_into,
        )  # fmt: skip
        out = attended.out  # (B, H, T, D)
        kept = None
        if record:
            kept = AttentionRecord(
                q, k, v, out, mask, True, self.scale, self.backend, attended.lse, q_plain,
                k_plain, self.window, self.softcap, None, attended.made,
                shared_from=shared_from if self.shares_keys else None,
            )  # fmt: skip
        if edit is not None:
            out = edit.head_outputs(out)
        concatenated = out.transpose(1, 2).reshape(B, T, -1)  # (B, T, H*D)
        return project(self.out, concatenated), kept


class Gemma4Block(DecoderBlock):
    """One Gemma 4 decoder layer: Gemma 3's sandwich-normed attention and MLP, with the
    parts of `Gemma4Layer`, and a learned scalar on its output."""

    def __init__(self, config: BlockConfig, rotary: RotaryEmbedding, layer: Gemma4Layer):
        _Block.__init__(self, config)
        if not config.sublayer_norm or config.norm_position != "pre" or config.parallel:
            raise ValueError("a Gemma 4 block is pre-normed with sub-layer norms, not parallel")
        self.layer = layer
        self.norms(config, "attn")
        self.attn = Gemma4Attention(config, rotary, layer)
        self.cross_norm = self.cross_out_norm = self.cross_attn = None
        self.norms(config, "mlp")
        self.mlp = config.feed_forward()
        self.moe = None
        if layer.experts is not None:
            eps = config.norm_eps
            self.dense_out_norm = Gemma4Norm(config.width, eps)  # post_feedforward_layernorm_1
            self.moe_norm = Gemma4Norm(config.width, eps)  # pre_feedforward_layernorm_2
            self.moe = layer.experts.module(config.width)
            self.moe_out_norm = Gemma4Norm(config.width, eps)  # post_feedforward_layernorm_2
        self.per_layer_gate = self.per_layer_projection = self.per_layer_norm = None
        if layer.per_layer_input:
            P = layer.per_layer_input
            self.per_layer_gate = nn.Linear(config.width, P, bias=False)  # (P, C)
            self.per_layer_projection = nn.Linear(P, config.width, bias=False)  # (C, P)
            self.per_layer_norm = Gemma4Norm(config.width, config.norm_eps)
        self.activation = ACTIVATIONS[_GATE_ACTIVATION.get(config.mlp, "gelu_tanh")]
        self.scalar = nn.Parameter(torch.ones(1))  # layer_scalar

    def forward(
        self,
        x: Tensor,
        context: Tensor | None = None,
        *,
        key_padding_mask: Tensor | None = None,
        rotation: Rotation | None = None,
        positions: Tensor | None = None,
        cache: KVCache | None = None,
        shared: KVCache | None = None,
        shared_from: int | None = None,
        per_layer_input: Tensor | None = None,
        edit: Edit | None = None,
        record: bool = False,
        weights_into: Tensor | None = None,
        **unused,
    ) -> tuple[Tensor, AttentionRecord | None, None, ExpertRecord | None]:
        """x (B, T, C) -> (B, T, C), the attention's record and the experts' where `record`.

        per_layer_input (B, T, P): this layer's input per token (`PerLayerInputs`), on a
        layer that has one. shared, shared_from: as Gemma4Attention's. The rest as
        DecoderBlock's (no cross-attention)."""
        if context is not None:
            raise ValueError("a Gemma 4 block has no cross-attention")
        attended, kept = self.attn(
            self.attn_norm(x), key_padding_mask=key_padding_mask, positions=positions,
            rotation=rotation, cache=cache, shared=shared, shared_from=shared_from, edit=edit,
            record=record, weights_into=weights_into,
        )  # fmt: skip
        x = x + self.attn_out_norm(attended)
        mlp, experts = self.mlp(self.mlp_norm(x)), None
        if self.moe is not None:  # the router reads the residual stream x itself
            routed, experts = self.moe(self.moe_norm(x), record=record, route_by=x)
            mlp = self.dense_out_norm(mlp) + self.moe_out_norm(routed)
        if edit is not None:
            mlp = edit.mlp_output(mlp)
        x = x + self.mlp_out_norm(mlp)
        if self.per_layer_gate is not None:
            if per_layer_input is None:
                raise ValueError("this Gemma 4 layer reads a per-layer input: pass it")
            gated = self.activation(project(self.per_layer_gate, x)) * per_layer_input
            x = x + self.per_layer_norm(project(self.per_layer_projection, gated))
        return _edited(x * self.scalar, edit), kept, None, experts


# the gated MLP's kind -> the activation of its gate, which the per-layer input gate uses too
_GATE_ACTIVATION = {"geglu_tanh": "gelu_tanh", "geglu": "gelu", "swiglu": "silu"}
