"""The parts around attention: norms, the MLP, and the embedding of tokens."""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from qkv.nn.linear import project
from qkv.nn.position import LearnedPositions, SinusoidalPositions, SinusoidLayout

Activation = Literal["gelu", "gelu_tanh", "relu", "silu"]
NormKind = Literal["layernorm", "rmsnorm", "rmsnorm_plus1"]
# relative: T5's, a bias on the attention scores (qkv.nn.relative), nothing added here
Position = Literal["learned", "sinusoidal", "rotary", "relative", "none"]


class RMSNorm(nn.Module):
    """Scale each vector to unit root-mean-square, then by a learned gain (Llama's norm).

    Computed in float32 (float64 for float64 vectors) and cast back before the gain, as Llama
    checkpoints expect. With
    plus_one (Gemma's norm) the gain is 1 + weight, applied in float32 before the cast, and
    the stored weight starts at 0.
    """

    def __init__(self, width: int, eps: float = 1e-6, *, plus_one: bool = False):
        super().__init__()
        self.eps, self.plus_one = eps, plus_one
        self.weight = nn.Parameter(torch.zeros(width) if plus_one else torch.ones(width))

    def forward(self, x: Tensor) -> Tensor:
        h = x if x.dtype == torch.float64 else x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.plus_one:
            return (h * (1.0 + self.weight.to(h.dtype))).to(x.dtype)
        return self.weight * h.to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}" + (", plus_one" if self.plus_one else "")


NORMS = ("layernorm", "rmsnorm", "rmsnorm_plus1")


def make_norm(kind: NormKind, width: int, eps: float, bias: bool = True) -> nn.Module:
    """A norm over the last `width` dimensions; bias: LayerNorm's shift (ModernBERT has
    none). rmsnorm_plus1 is Gemma's RMSNorm, whose gain is 1 + weight."""
    if kind == "layernorm":
        return nn.LayerNorm(width, eps=eps, bias=bias)
    if kind in ("rmsnorm", "rmsnorm_plus1"):
        return RMSNorm(width, eps=eps, plus_one=kind == "rmsnorm_plus1")
    raise ValueError(f"unknown norm {kind!r}; allowed: {', '.join(map(repr, NORMS))}")


_ACTIVATIONS = {
    "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
    "silu": F.silu,
}


class MLP(nn.Module):
    """Widen, activate, narrow: C -> hidden -> C (BERT, GPT-2, the original transformer)."""

    def __init__(self, width: int, hidden: int, activation: Activation = "gelu", bias=True):
        super().__init__()
        if activation not in _ACTIVATIONS:
            raise ValueError(f"unknown activation {activation!r}; allowed: {list(_ACTIVATIONS)}")
        self.activation = _ACTIVATIONS[activation]
        self.fc_in = nn.Linear(width, hidden, bias=bias)
        self.fc_out = nn.Linear(hidden, width, bias=bias)

    def forward(self, x: Tensor) -> Tensor:
        return project(self.fc_out, self.activation(project(self.fc_in, x)))


class GatedMLP(nn.Module):
    """A gated MLP: down(act(gate(x)) * up(x)). silu is Llama's SwiGLU, tanh-gelu Gemma's
    GeGLU. fused: one Linear makes [gate; up] (Phi-3's gate_up_proj, ModernBERT's Wi)."""

    def __init__(
        self,
        width: int,
        hidden: int,
        activation: Activation = "silu",
        bias: bool = False,
        fused: bool = False,
    ):
        super().__init__()
        if activation not in _ACTIVATIONS:
            raise ValueError(f"unknown activation {activation!r}; allowed: {list(_ACTIVATIONS)}")
        self.activation = _ACTIVATIONS[activation]
        if fused:
            self.gate_up = nn.Linear(width, 2 * hidden, bias=bias)
        else:
            self.gate = nn.Linear(width, hidden, bias=bias)
            self.up = nn.Linear(width, hidden, bias=bias)
        self.down = nn.Linear(hidden, width, bias=bias)

    def forward(self, x: Tensor) -> Tensor:
        if hasattr(self, "gate_up"):
            gate, up = project(self.gate_up, x).chunk(2, dim=-1)
        else:
            gate, up = project(self.gate, x), project(self.up, x)
        return project(self.down, self.activation(gate) * up)


class SwiGLU(GatedMLP):
    """A gated MLP: down(silu(gate(x)) * up(x)), as in Llama."""

    def __init__(self, width: int, hidden: int, bias: bool = False):
        super().__init__(width, hidden, "silu", bias)


# a gated MLP's name in a BlockConfig -> the activation of its gate
GATED = {"swiglu": "silu", "geglu": "gelu", "geglu_tanh": "gelu_tanh"}


class Embeddings(nn.Module):
    """Token ids to vectors: token embedding, plus position (and segment) embeddings.

    The article: the position embedding is "added (not concatenated)". With rotary, relative
    or no positions nothing is added here; rotary and relative positions act inside
    attention instead.
    input_ids (B, T), positions (T,) or (B, T) -> (B, T, C).
    """

    def __init__(
        self,
        vocab_size: int,
        width: int,
        *,
        position: Position = "learned",
        max_positions: int = 512,
        type_vocab_size: int = 0,
        norm: NormKind | None = None,
        norm_eps: float = 1e-5,
        norm_bias: bool = True,
        scale: float = 1.0,
        round_scale: bool = False,
        dropout: float = 0.0,
        sinusoid_layout: SinusoidLayout = "interleaved",
    ):
        super().__init__()
        self.vocab_size = vocab_size
        self.tokens = nn.Embedding(vocab_size, width)
        self.positions: nn.Module | None = None
        if position == "learned":
            self.positions = LearnedPositions(max_positions, width)
        elif position == "sinusoidal":
            self.positions = SinusoidalPositions(width, layout=sinusoid_layout)
        self.types = nn.Embedding(type_vocab_size, width) if type_vocab_size else None
        self.norm = make_norm(norm, width, norm_eps, norm_bias) if norm else None
        self.scale = scale  # the original transformer multiplies token vectors by sqrt(C)
        # Gemma rounds the scale to the vectors' dtype first (sqrt(3072) is 55.5 in bfloat16)
        self.round_scale = round_scale
        self.dropout = nn.Dropout(dropout)

    def forward(
        self, input_ids: Tensor, positions: Tensor, token_type_ids: Tensor | None = None
    ) -> Tensor:
        # the check reads the ids back to Python: skipped inside a torch.compile graph
        checked = input_ids.numel() and not torch.compiler.is_compiling()
        if checked and (input_ids.min() < 0 or input_ids.max() >= self.vocab_size):
            raise ValueError(
                f"token ids must be in 0-{self.vocab_size - 1}, got "
                f"{int(input_ids.min())}-{int(input_ids.max())}"
            )
        scale = self.scale
        if self.round_scale:  # a 0-dim tensor in the weights' dtype, as Gemma's own code has it
            scale = torch.tensor(scale, dtype=torch.float32).to(self.tokens.weight.dtype)
        x = self.tokens(input_ids) * scale  # (B, T, C)
        if self.positions is not None:
            x = x + self.positions(positions).to(x.dtype)
        if self.types is not None:
            types = torch.zeros_like(input_ids) if token_type_ids is None else token_type_ids
            x = x + self.types(types)
        if self.norm is not None:
            x = self.norm(x)
        return self.dropout(x)
