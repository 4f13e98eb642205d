"""MLPs: widen, activate, narrow (BERT, GPT-2), and the gated ones (Llama's SwiGLU, Gemma's
GeGLU)."""

from __future__ import annotations

from typing import Literal

import torch.nn.functional as F
from torch import Tensor, nn

from qkv.nn.linear import project

Activation = Literal["gelu", "gelu_tanh", "relu", "silu"]

ACTIVATIONS = {
    "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
    "silu": F.silu,
}


class MLP(nn.Module):
    """Widen, activate, narrow: C -> hidden -> C (BERT, GPT-2, the original transformer)."""

    def __init__(self, width: int, hidden: int, activation: Activation = "gelu", bias=True):
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"unknown activation {activation!r}; allowed: {list(ACTIVATIONS)}")
        self.activation = ACTIVATIONS[activation]
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
        if activation not in ACTIVATIONS:
            raise ValueError(f"unknown activation {activation!r}; allowed: {list(ACTIVATIONS)}")
        self.activation = ACTIVATIONS[activation]
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
