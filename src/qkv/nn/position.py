"""Where a token is: learned and sinusoidal embeddings (added), rotary (rotating q and k).

The article: "a position embedding that is added (not concatenated) ... so that the
attention mechanism can take into account where words are in the sentence". Learned and
sinusoidal embeddings are added to the token embeddings; rotary embeddings instead turn
each query and key vector by an angle that grows with its position, so that their dot
product depends on how far apart the two words are.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, NamedTuple

import torch
from torch import Tensor, nn

from qkv.nn.rope import RopeScaling, inv_freq

SinusoidLayout = Literal["interleaved", "halves"]


def positions_for(length: int, offset: int = 0, device=None) -> Tensor:
    """(T,) positions offset, offset+1, ... of T new tokens after `offset` earlier ones."""
    return torch.arange(offset, offset + length, device=device)


class LearnedPositions(nn.Module):
    """One trained vector per position, as in BERT and GPT-2: (…, T) -> (…, T, C)."""

    def __init__(self, max_positions: int, width: int):
        super().__init__()
        self.max_positions = max_positions
        self.embedding = nn.Embedding(max_positions, width)

    def forward(self, positions: Tensor) -> Tensor:
        checked = positions.numel() and not torch.compiler.is_compiling()  # see Embeddings
        if checked and int(positions.max()) >= self.max_positions:
            raise ValueError(
                f"position {int(positions.max())} is past this model's {self.max_positions} "
                f"learned positions (0-{self.max_positions - 1}); use a shorter text"
            )
        return self.embedding(positions)


class SinusoidalPositions(nn.Module):
    """The original transformer's fixed embedding: sin on even dimensions, cos on odd.

    PE(pos, 2i) = sin(pos / base^(2i/C)),  PE(pos, 2i+1) = cos(pos / base^(2i/C)).

    layout "halves" keeps the same angles but puts every sin in the first half of the
    vector and every cos in the second (Marian's checkpoints), computed in float64 and
    rounded once, as Marian's table is.

    >>> SinusoidalPositions(4)(torch.tensor([0]))[0].tolist()
    [0.0, 1.0, 0.0, 1.0]
    >>> SinusoidalPositions(4, layout="halves")(torch.tensor([0]))[0].tolist()
    [0.0, 0.0, 1.0, 1.0]
    """

    def __init__(self, width: int, base: float = 10000.0, layout: SinusoidLayout = "interleaved"):
        super().__init__()
        if width % 2:
            raise ValueError(f"sinusoidal positions need an even width, got {width}")
        if layout not in ("interleaved", "halves"):
            raise ValueError(f"layout must be 'interleaved' or 'halves', got {layout!r}")
        self.width, self.base, self.layout = width, base, layout
        self.register_buffer("inv_freq", self._inv_freq(), persistent=False)

    def reset_buffers(self) -> None:
        """Compute inv_freq again: a model built on the meta device has no values in it."""
        self.inv_freq = self._inv_freq()

    def _inv_freq(self) -> Tensor:
        with torch.device("cpu"):  # see RotaryEmbedding._inv_freq
            exponents = torch.arange(0, self.width, 2, dtype=torch.float64) / self.width
            inv_freq = (self.base**-exponents).float()
        return inv_freq.to(torch.get_default_device())

    def forward(self, positions: Tensor) -> Tensor:
        if self.layout == "halves":  # (…, T, C): [sin of every angle, cos of every angle]
            # float64 from the start (not the float32 buffer, which a cast of the model
            # would round further): Marian's table is float64 rounded once
            exponents = torch.arange(0, self.width, 2, dtype=torch.float64, device=positions.device)
            angles = positions.double()[..., None] * self.base ** -(exponents / self.width)
            return torch.cat([angles.sin(), angles.cos()], dim=-1).float()  # (…, T, C)
        angles = positions.float()[..., None] * self.inv_freq  # (…, T, C/2)
        # interleave: (…, T, C/2, 2) -> (…, T, C) with sin at 2i and cos at 2i+1
        return torch.stack([angles.sin(), angles.cos()], dim=-1).flatten(-2)


def rotate_half(x: Tensor) -> Tensor:
    """(x1, x2) -> (-x2, x1) on the two halves of the last dimension."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


@dataclass(frozen=True)
class Temperature:
    """A query's scores multiplied by a temperature that grows with its position, so that far
    into a long text a query's weights do not flatten out over the many keys it sees:

        temperature(p) = 1 + strength * log(1 + floor((p + shift) / every))

    Llama 4's layers without rotary positions: strength attn_scale, every floor_scale, shift 1.
    Ministral 3's every layer: strength llama_4_scaling_beta, every the trained context
    (original_max_position_embeddings), shift 0. It is 1 for every position below every - shift.

    >>> Temperature(0.1, 4).of(torch.tensor([0, 3, 4, 12])).tolist()  # doctest: +ELLIPSIS
    [1.0, 1.0, 1.069..., 1.138...]
    """

    strength: float
    every: float
    shift: float = 0.0

    def __post_init__(self):
        if not (math.isfinite(self.strength) and math.isfinite(self.shift)):
            raise ValueError(f"a temperature's strength and shift must be finite, got {self}")
        if not (math.isfinite(self.every) and self.every > 0):
            raise ValueError(f"a temperature's every must be > 0, got {self.every!r}")

    def of(self, positions: Tensor) -> Tensor:
        """The temperature of each position, float32, positions' shape."""
        steps = torch.floor((positions.float() + self.shift) / self.every)
        return 1.0 + self.strength * torch.log1p(steps)


class Rotation(NamedTuple):
    """The cos and sin of every position's angles, made once per forward pass and applied to
    the queries and keys of every layer: (T, d) for positions (T,), (B, 1, T, d) for (B, T).
    d is the rotated part of each head (all of it, or its first d dimensions where a model
    rotates only part: GPT-NeoX, Phi-3)."""

    cos: Tensor
    sin: Tensor

    def apply(self, x: Tensor) -> Tensor:
        """Rotate x (B, H, T, D); computed in x's dtype."""
        cos, sin = self.cos.to(x.dtype), self.sin.to(x.dtype)  # no-ops unless under autocast
        d = cos.shape[-1]
        if d == x.shape[-1]:
            return x * cos + rotate_half(x) * sin
        turned, kept = x[..., :d], x[..., d:]  # partial rotary: the rest passes unturned
        return torch.cat([turned * cos + rotate_half(turned) * sin, kept], dim=-1)


class RotaryEmbedding(nn.Module):
    """Rotary positions in the half-rotation layout of Llama-family checkpoints.

    Dimension i of the first half pairs with dimension i of the second half, and the pair
    turns by position * base^(-2i/d). No parameters: nothing here is learned. dims: how many
    of each head's dimensions turn (d; the rest pass unturned), all by default. scaling: a
    `RopeScaling` of the frequencies (Llama 3's, YaRN, LongRoPE, ...), none by default.
    """

    def __init__(
        self,
        head_dim: int,
        base: float = 10000.0,
        *,
        dims: int | None = None,
        scaling: RopeScaling | None = None,
    ):
        super().__init__()
        dims = head_dim if dims is None else dims
        if dims % 2 or not 0 < dims <= head_dim:
            raise ValueError(
                f"rotary embeddings turn an even number of a head's {head_dim} dimensions, "
                f"got {dims}"
            )
        self.head_dim, self.base, self.dims, self.scaling = head_dim, base, dims, scaling
        self.attention_factor = 1.0  # on cos and sin: YaRN's and LongRoPE's
        self.register_buffer("inv_freq", self._inv_freq(), persistent=False)

    def reset_buffers(self) -> None:
        """Compute inv_freq again: a model built on the meta device has no values in it."""
        self.inv_freq = self._inv_freq()

    def _inv_freq(self) -> Tensor:
        # computed as Llama checkpoints' reference code does (on the CPU), so the angles match
        # exactly; then put where the model is being built. On the meta device (loading) the
        # arithmetic itself would run through torch's Python reference kernels, whose first
        # use imports torch._dynamo (about 1.5 s); the loader computes the buffer again after.
        with torch.device("cpu"):
            freq, self.attention_factor = inv_freq(self.dims, self.base, self.scaling)
        return freq.to(torch.get_default_device())

    def cos_sin(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """cos and sin, (…, T, d), for positions (T,) or (B, T); made in float32."""
        freq, factor = self.inv_freq, self.attention_factor
        if self.scaling is not None and self.scaling.depends_on_length and positions.numel():
            # dynamic NTK and LongRoPE choose their frequencies by the text's length, as
            # their reference code does on each forward pass (the largest position + 1)
            with torch.device("cpu"):
                freq, factor = inv_freq(
                    self.dims, self.base, self.scaling, int(positions.max()) + 1
                )
            freq = freq.to(positions.device)
        angles = positions.float()[..., None] * freq  # (…, T, d/2)
        angles = torch.cat([angles, angles], dim=-1)  # (…, T, d)
        cos, sin = angles.cos(), angles.sin()
        if factor != 1.0:
            cos, sin = cos * factor, sin * factor
        return cos.to(dtype), sin.to(dtype)

    def rotation(self, positions: Tensor, dtype: torch.dtype) -> Rotation:
        """The rotation of positions (T,) or (B, T), for q and k of every layer alike."""
        cos, sin = self.cos_sin(positions, dtype)
        if cos.dim() == 3:  # (B, T, D): one row of positions per sequence
            cos, sin = cos[:, None], sin[:, None]  # (B, 1, T, D)
        return Rotation(cos, sin)

    def forward(self, x: Tensor, positions: Tensor) -> Tensor:
        """Rotate x (B, H, T, D) by its positions, (T,) or (B, T)."""
        return self.rotation(positions, x.dtype).apply(x)

    def extra_repr(self) -> str:
        parts = [f"head_dim={self.head_dim}", f"base={self.base}"]
        if self.dims != self.head_dim:
            parts.append(f"dims={self.dims}")
        if self.scaling is not None:
            parts.append(f"scaling={self.scaling.kind}")
        return ", ".join(parts)
