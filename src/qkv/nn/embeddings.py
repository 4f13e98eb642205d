"""The embedding of tokens: token vectors, plus position (and segment) vectors."""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor, nn

from qkv.nn.norms import NormKind, make_norm
from qkv.nn.position import LearnedPositions, SinusoidalPositions, SinusoidLayout

# relative: T5's, a bias on the attention scores (qkv.nn.relative), nothing added here
Position = Literal["learned", "sinusoidal", "rotary", "relative", "none"]


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
