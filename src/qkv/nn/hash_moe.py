"""DeepSeek-V4's mixture of experts: experts chosen by a table of token ids (hash routing) or
by the router's top k, each a SwiGLU with its gate and up clamped, beside a shared expert.

Both routers score every expert from the token's vector (sqrt(softplus(logit)), or a sigmoid)
and weight the chosen ones by their scores, renormalized to sum to 1 and scaled.
- hashed: the experts are `token_experts[token id]`, a fixed table (the first layers).
- top k: the k best scores plus a correction bias (for choosing only).
Every expert and the shared one compute down(silu(min(gate x, limit)) * clamp(up x, +-limit)).
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

Score = Literal["sqrtsoftplus", "sigmoid"]
SCORES = {"sqrtsoftplus": lambda x: F.softplus(x).sqrt(), "sigmoid": torch.sigmoid}


def clamped_swiglu(gate: Tensor, up: Tensor, limit: float) -> Tensor:
    return F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)


class SharedExpert(nn.Module):
    """The expert every token goes to: gate, up (I, C) and down (C, I) matrices."""

    def __init__(self, width: int, hidden: int, limit: float):
        super().__init__()
        self.limit = limit
        self.gate = nn.Linear(width, hidden, bias=False)
        self.up = nn.Linear(width, hidden, bias=False)
        self.down = nn.Linear(hidden, width, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down(clamped_swiglu(self.gate(x), self.up(x), self.limit))


class HashMoE(nn.Module):
    """x (B, T, C) and the token ids (B, T) -> (B, T, C): the chosen experts' outputs,
    weighted, plus the shared expert's. Tensors: router (E, C); gate_up (E, 2I, C), each
    expert's gate rows above its up rows; down (E, C, I); token_experts (vocab, k), the hash
    table, where hashed; correction_bias (E,) float32, where not."""

    def __init__(self, width: int, num_experts: int, top_k: int, hidden: int, *, hashed: bool,
                 vocab_size: int, score: Score = "sqrtsoftplus", scaling: float = 1.0,
                 limit: float = 10.0):  # fmt: skip
        super().__init__()
        if score not in SCORES:
            raise ValueError(f"unknown expert score {score!r}; qkv computes {sorted(SCORES)}")
        self.top_k, self.hashed, self.score, self.scaling, self.limit = (
            top_k, hashed, score, scaling, limit)  # fmt: skip
        self.router = nn.Parameter(torch.zeros(num_experts, width))
        self.gate_up = nn.Parameter(torch.zeros(num_experts, 2 * hidden, width))
        self.down = nn.Parameter(torch.zeros(num_experts, width, hidden))
        self.shared = SharedExpert(width, hidden, limit)
        table = torch.zeros(vocab_size, top_k, dtype=torch.long) if hashed else None
        self.register_buffer("token_experts", table)
        bias = None if hashed else torch.zeros(num_experts, dtype=torch.float32)
        self.register_buffer("correction_bias", bias)

    def route(self, x: Tensor, input_ids: Tensor) -> tuple[Tensor, Tensor]:
        """x (N, C), ids (N,) -> the chosen experts (N, k) and their weights (N, k)."""
        scores = SCORES[self.score](F.linear(x, self.router))  # (N, E)
        if self.hashed:
            experts = self.token_experts[input_ids].long()
        else:
            choice = scores + self.correction_bias
            experts = torch.topk(choice, self.top_k, dim=-1, sorted=False).indices
        weights = scores.gather(1, experts)
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return experts, weights * self.scaling

    def forward(self, x: Tensor, input_ids: Tensor) -> Tensor:
        B, T, C = x.shape
        flat = x.reshape(-1, C)  # (N, C)
        experts, weights = self.route(flat, input_ids.reshape(-1))
        out = torch.zeros_like(flat)
        for expert in experts.unique().tolist():
            token, slot = torch.where(experts == expert)
            gate, up = F.linear(flat[token], self.gate_up[expert]).chunk(2, dim=-1)
            y = F.linear(clamped_swiglu(gate, up, self.limit), self.down[expert])
            out.index_add_(0, token, y * weights[token, slot, None])
        return out.view(B, T, C) + self.shared(x)
