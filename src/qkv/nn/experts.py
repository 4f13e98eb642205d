"""Mixture-of-experts MLPs: a router sends each token to k of E gated MLPs (the experts), and
the token's output is their outputs, weighted, summed, plus a shared expert's where there is
one. Asked to keep its record, `MoE` returns an `ExpertRecord`: which experts each token went
to, with what weight, and what the router thought of every expert.

Only the experts that received tokens run, each on its own tokens (as transformers does), so
a model with 64 experts does not run 64 MLPs on every token.

The tensors, as a loader fills them (E experts, C the width, I an expert's hidden size, S the
shared expert's; gate and up are stacked as F.linear takes them, gate rows first):

    router.weight (E, C), router.bias (E,), router.correction_bias (E,) float32,
    router.input_scale (C,), router.expert_scale (E,)       (see `Router`)
    gate_up (E, 2I, C): gate_up[e, :I] expert e's gate, gate_up[e, I:] its up
    gate_up_bias (E, 2I), down (E, C, I), down_bias (E, C)  (biases: gpt-oss only)
    shared.gate.weight (S, C), shared.up.weight (S, C), shared.down.weight (C, S)
    shared_gate.weight (1, C)                               (with `shared_gate`)

Where each comes from, in a transformers checkpoint (`save_pretrained`'s keys, which are the
hub's; `layers.{n}` prefixes left off):

    Mixtral      block_sparse_moe.gate.weight -> router.weight;
                 block_sparse_moe.experts.{e}.w1.weight (I, C) -> gate_up[e, :I],
                 .w3.weight (I, C) -> gate_up[e, I:], .w2.weight (C, I) -> down[e]
    Qwen3-MoE    mlp.gate.weight -> router.weight; mlp.experts.{e}.gate_proj.weight ->
                 gate_up[e, :I], .up_proj.weight -> gate_up[e, I:], .down_proj.weight -> down[e]
    DeepSeek-V3  as Qwen3-MoE, and mlp.gate.e_score_correction_bias -> router.correction_bias,
                 mlp.shared_experts.{gate,up,down}_proj.weight -> shared.{gate,up,down}.weight
    gpt-oss      mlp.router.{weight,bias} -> router.{weight,bias};
                 mlp.experts.gate_up_proj (E, C, 2I), gate and up interleaved (columns 0, 2, 4...
                 the gate) -> gate_up = cat([w[..., 0::2], w[..., 1::2]], -1).transpose(1, 2);
                 gate_up_proj_bias (E, 2I) -> gate_up_bias = cat([b[:, 0::2], b[:, 1::2]], -1);
                 down_proj (E, I, C) -> down = transpose(1, 2); down_proj_bias -> down_bias
    Llama 4      feed_forward.router.weight -> router.weight;
                 feed_forward.experts.gate_up_proj (E, C, 2I) -> gate_up = transpose(1, 2);
                 feed_forward.experts.down_proj (E, I, C) -> down = transpose(1, 2);
                 feed_forward.shared_expert.{gate,up,down}_proj.weight -> shared.*.weight
    Gemma 4      router.proj.weight -> router.weight, router.scale -> router.input_scale,
                 router.per_expert_scale -> router.expert_scale; experts.gate_up_proj (E, 2I, C)
                 -> gate_up, experts.down_proj (E, C, I) -> down (the dense mlp and the norms
                 around the experts are the decoder layer's)
    Qwen3-Next   as Qwen3-MoE, and mlp.shared_expert.{gate,up,down}_proj.weight ->
                 shared.*.weight, mlp.shared_expert_gate.weight -> shared_gate.weight
                 (Qwen3.5-MoE: the experts stacked, mlp.experts.gate_up_proj and down_proj)

>>> moe = MoE(width=16, hidden=8, routing=Routing(num_experts=4, top_k=2))
>>> out, record = moe(torch.randn(1, 5, 16), record=True)
>>> out.shape, record.experts.shape  # (B, T, C), (B, T, k)
(torch.Size([1, 5, 16]), torch.Size([1, 5, 2]))
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor, nn

from qkv.attention.inputs import check_indices
from qkv.nn.linear import linear, project
from qkv.nn.mlps import ACTIVATIONS, GatedMLP
from qkv.nn.routing import Router, Routing

ExpertActivation = Literal["gelu", "gelu_tanh", "relu", "silu", "clamped_swiglu"]


@dataclass(frozen=True)
class Experts:
    """A block's mixture of experts, as a config says it (`BlockConfig.experts`): the routing,
    each expert's hidden size, its activation ("clamped_swiglu": gpt-oss's), whether experts
    have biases, a shared expert's hidden size (None: none), whether the shared expert's
    output is multiplied by a sigmoid gate of the token (Qwen3-Next), and gpt-oss's clamp."""

    routing: Routing
    hidden: int
    activation: ExpertActivation = "silu"
    bias: bool = False
    shared_hidden: int | None = None
    limit: float = 7.0
    alpha: float = 1.702
    shared_gate: bool = False

    def module(self, width: int) -> MoE:
        return MoE(width, self.hidden, self.routing, self.activation, self.bias,
                   self.shared_hidden, self.limit, self.alpha, self.shared_gate)  # fmt: skip


@dataclass(frozen=True, eq=False)
class ExpertRecord:
    """Where one MoE layer sent each token, exactly as its forward pass did it.

    experts (B, T, k) long: the experts each token went to, largest weight first.
    weights (B, T, k): the weight each of those experts' output was multiplied by (its input,
        with `routing.scale_input`), in the dtype the layer used it.
    logits (B, T, E): the router's logits for every expert.
    scores (B, T, E): what the router thought of every expert: the softmax over all experts
        or the sigmoid of each. A router that chooses by logits (gpt-oss, Llama 4) scores
        only the chosen ones; these are then the same function over all E, for the reader.
    routing: the `Routing` that chose them.
    """

    experts: Tensor
    weights: Tensor
    logits: Tensor
    scores: Tensor
    routing: Routing

    def describe(self, batch: int = 0, token: int = 0) -> str:
        """Words for one token's routing, e.g. "went to experts 3 and 7 (62% / 38%)".

        Weights that are normalized are given as shares of their sum; sigmoid scores and
        softmax probabilities that are not renormalized are given as they are, and said so.
        """
        B, T, _ = self.experts.shape
        (batch,) = check_indices("batch", [batch], B, "this record")
        (token,) = check_indices("token", [token], T, "this record")
        r = self.routing
        chosen = self.experts[batch, token].tolist()
        weights = self.weights[batch, token].double().tolist()
        names = ("expert " if len(chosen) == 1 else "experts ") + _join(map(str, chosen))
        values = _join(f"{w:.3g}" for w in weights)
        total = sum(weights)
        if r.sums_to_one and total != 0:
            shares = " / ".join(f"{100 * w / total:.0f}%" for w in weights)
            if r.expert_scale:
                text = f"{shares}: weights {values}, each times its expert's learned scale"
            elif r.scaling != 1.0:
                text = f"{shares}: weights {values}, which sum to {r.scaling:g}"
            else:
                text = shares
        else:
            kind = "sigmoid scores" if r.score == "sigmoid" else (
                f"softmax probabilities over all {r.num_experts} experts, not renormalized"
            )  # fmt: skip
            if r.scaling != 1.0:
                kind += f", times {r.scaling:g}"
            if r.expert_scale:
                kind += ", each times its expert's learned scale"
            text = f"weights {values}: {kind}; they need not sum to 1"
        if r.scale_input:
            text += "; each weight multiplies its expert's input, not its output"
        return f"went to {names} ({text})"


class MoE(nn.Module):
    """A mixture of experts: x (B, T, C) -> (B, T, C), each token through the top k of E
    gated MLPs its router chose, weighted and summed, plus a shared gated MLP if asked.

    width C, hidden I: each expert's sizes. routing: how the router chooses (`Routing`).
    activation: the gate's, as in `GatedMLP` ("silu": SwiGLU), or "clamped_swiglu", gpt-oss's:
        gate clamped to at most `limit`, up to [-limit, limit], then
        (up + 1) * gate * sigmoid(alpha * gate).
    bias: the experts have biases (gpt-oss). shared_hidden S: a shared expert, a `GatedMLP`
    of hidden size S every token goes through (DeepSeek-V3, Llama 4). shared_gate: the shared
    expert's output times sigmoid(x . w), w (C,) learned (`shared_gate`, Qwen3-Next). The
    tensors' names and shapes are in this module's docstring, with the transformers keys they
    are loaded from.
    """

    def __init__(
        self,
        width: int,
        hidden: int,
        routing: Routing,
        activation: ExpertActivation = "silu",
        bias: bool = False,
        shared_hidden: int | None = None,
        limit: float = 7.0,
        alpha: float = 1.702,
        shared_gate: bool = False,
    ):
        super().__init__()
        if activation != "clamped_swiglu" and activation not in ACTIVATIONS:
            allowed = [*ACTIVATIONS, "clamped_swiglu"]
            raise ValueError(f"unknown activation {activation!r}; allowed: {allowed}")
        if activation == "clamped_swiglu" and shared_hidden is not None:
            raise ValueError("a shared expert takes a plain activation, not clamped_swiglu")
        if shared_gate and shared_hidden is None:
            raise ValueError("shared_gate gates a shared expert: give its shared_hidden")
        for name, size in (("width", width), ("hidden", hidden), ("shared_hidden", shared_hidden)):
            if size is not None and (not isinstance(size, int) or size < 1):
                raise ValueError(f"{name} must be a whole number of at least 1, not {size!r}")
        self.routing, self.activation = routing, activation
        self.limit, self.alpha = limit, alpha
        E = routing.num_experts
        self.router = Router(width, routing)
        self.gate_up = nn.Parameter(_uniform((E, 2 * hidden, width), width))
        self.down = nn.Parameter(_uniform((E, width, hidden), hidden))
        self.gate_up_bias = nn.Parameter(_uniform((E, 2 * hidden), width)) if bias else None
        self.down_bias = nn.Parameter(_uniform((E, width), hidden)) if bias else None
        self.shared = None
        if shared_hidden is not None:
            self.shared = GatedMLP(width, shared_hidden, activation)  # type: ignore[arg-type]
        self.shared_gate = nn.Linear(width, 1, bias=False) if shared_gate else None

    def forward(
        self, x: Tensor, record: bool = False, route_by: Tensor | None = None
    ) -> tuple[Tensor, ExpertRecord | None]:
        """x (B, T, C) -> (B, T, C), and the `ExpertRecord` where `record`. route_by (B, T, C):
        what the router reads, where it is not x (Gemma 4 routes by the residual stream and
        runs its experts on a separately normalized copy of it)."""
        B, T, C = x.shape
        if route_by is not None and route_by.shape != x.shape:
            raise ValueError(f"route_by has shape {tuple(route_by.shape)}; x has {(B, T, C)}")
        flat = x.reshape(B * T, C)  # (N, C)
        by = flat if route_by is None else route_by.reshape(B * T, C)
        logits, scores, experts, weights = self.router(by)  # (N, E), (N, E), (N, k), (N, k)
        out = self._combine(flat, experts, weights)  # (N, C)
        if self.shared is not None:
            shared = self.shared(flat)  # (N, C)
            if self.shared_gate is not None:
                shared = torch.sigmoid(project(self.shared_gate, flat)) * shared
            out = out + shared
        out = out.reshape(B, T, C)
        if not record:
            return out, None
        order = weights.argsort(dim=-1, descending=True, stable=True)  # (N, k)
        kept = ExpertRecord(
            experts=experts.gather(-1, order).reshape(B, T, -1),
            weights=weights.gather(-1, order).reshape(B, T, -1),
            logits=logits.reshape(B, T, -1),
            scores=scores.reshape(B, T, -1),
            routing=self.routing,
        )
        return out, kept

    def expert(self, index: int, x: Tensor) -> Tensor:
        """Expert `index` alone on x (n, C) -> (n, C), before any weight."""
        gate_up = linear(x, self.gate_up[index])  # (n, 2I)
        if self.gate_up_bias is not None:  # added after the product, as gpt-oss adds it
            gate_up = gate_up + self.gate_up_bias[index]
        gate, up = gate_up.chunk(2, dim=-1)  # (n, I) each
        if self.activation == "clamped_swiglu":  # gpt-oss's, in its order of operations
            gate = gate.clamp(min=None, max=self.limit)
            up = up.clamp(min=-self.limit, max=self.limit)
            hidden = (up + 1) * (gate * torch.sigmoid(gate * self.alpha))
        else:
            hidden = ACTIVATIONS[self.activation](gate) * up
        out = linear(hidden, self.down[index])  # (n, C)
        return out if self.down_bias is None else out + self.down_bias[index]

    def _combine(self, x: Tensor, experts: Tensor, weights: Tensor) -> Tensor:
        """The routed experts' weighted outputs (N, C), summed: each expert that received
        tokens runs once on them, in ascending order as transformers adds them."""
        out = torch.zeros_like(x)
        by_slot = experts.t()  # (k, N): transformers' (slot, token) order of the tokens
        for index in torch.unique(experts).tolist():
            slot, token = torch.where(by_slot == index)  # (n,): each token at most once
            weight = weights[token, slot, None]  # (n, 1)
            if self.routing.scale_input:  # Llama 4: the weight scales the expert's input
                done = self.expert(index, (x[token] * weight).to(x.dtype))
            else:
                done = self.expert(index, x[token]) * weight
            out.index_add_(0, token, done.to(out.dtype))
        return out


def _uniform(shape: tuple[int, ...], fan_in: int) -> Tensor:
    """nn.Linear's initialization, for stacked experts: uniform in +-1/sqrt(fan_in)."""
    bound = 1 / math.sqrt(fan_in)
    return torch.empty(shape).uniform_(-bound, bound)


def _join(words) -> str:
    """'3', '3 and 7', '3, 7 and 9'."""
    words = list(words)
    return words[0] if len(words) == 1 else ", ".join(words[:-1]) + " and " + words[-1]
