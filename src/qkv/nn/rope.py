"""Rotary frequencies, with the scalings that stretch a model past its trained context.

Plain rotary turns the pair of dimensions (i, i + d/2) of a query or key at position p by
p * base^(-2i/d). A scaled rotary changes those frequencies (and, for YaRN and LongRoPE,
multiplies cos and sin by an attention factor), exactly as the reference code of each
checkpoint family does:

- linear: every frequency divided by `factor` (positions interpolated);
- dynamic: the base grows with the text's length once it passes max_positions (NTK);
- llama3: long wavelengths divided by `factor`, short ones kept, a smooth ramp between;
- yarn: interpolation and extrapolation blended per frequency, cos and sin scaled;
- longrope: one factor per frequency, `short_factor` within the trained context and
  `long_factor` past it (Phi-3), cos and sin scaled.

>>> scaling = RopeScaling("linear", factor=2.0)
>>> inv_freq(4, 10000.0, scaling)[0].tolist()
[0.5, 0.004999999888241291]
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

KINDS = ("linear", "dynamic", "llama3", "yarn", "longrope")


@dataclass(frozen=True)
class RopeScaling:
    """One rotary scaling, with the values its kind reads (see the module's list)."""

    kind: str
    factor: float = 1.0
    original_max_positions: int | None = None  # the context the model was trained on
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    mscale: float | None = None  # yarn (DeepSeek's form of the attention factor)
    mscale_all_dim: float | None = None  # yarn
    truncate: bool = True  # yarn: round the correction range to whole dimensions
    attention_factor: float | None = None  # yarn, longrope: None computes it from factor
    short_factor: tuple[float, ...] = ()  # longrope, one per frequency
    long_factor: tuple[float, ...] = ()  # longrope
    max_positions: int | None = None  # dynamic: where the growth starts

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"rope scaling {self.kind!r} is not supported; supported: {KINDS}")

    @property
    def depends_on_length(self) -> bool:
        """Whether the frequencies change with the text's length (dynamic, longrope)."""
        return self.kind in ("dynamic", "longrope")


def _plain(dims: int, base: float) -> Tensor:
    # as the reference code computes it (int64 arange, then float32), so angles match exactly
    return 1.0 / (base ** (torch.arange(0, dims, 2, dtype=torch.int64).float() / dims))


def inv_freq(
    dims: int, base: float, scaling: RopeScaling | None = None, length: int | None = None
) -> tuple[Tensor, float]:
    """(dims / 2,) inverse frequencies on the CPU in float32, and the factor on cos and sin.

    length: how many positions the text spans (the largest position + 1), read by the
    scalings whose frequencies depend on it.
    """
    if scaling is None:
        return _plain(dims, base), 1.0
    kind, factor = scaling.kind, scaling.factor
    if kind == "linear":
        return _plain(dims, base) / factor, 1.0
    if kind == "dynamic":
        trained = scaling.max_positions
        length = max(length or trained, trained)
        base = base * ((factor * length / trained) - (factor - 1)) ** (dims / (dims - 2))
        return _plain(dims, base), 1.0
    if kind == "llama3":
        return _llama3(dims, base, scaling), 1.0
    if kind == "yarn":
        return _yarn(dims, base, scaling)
    return _longrope(dims, base, scaling, length)


def _llama3(dims: int, base: float, s: RopeScaling) -> Tensor:
    freq = _plain(dims, base)
    old = s.original_max_positions
    low_wavelen, high_wavelen = old / s.low_freq_factor, old / s.high_freq_factor
    wavelen = 2 * math.pi / freq
    scaled = torch.where(wavelen > low_wavelen, freq / s.factor, freq)
    smooth = (old / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(dims: int, base: float, s: RopeScaling) -> tuple[Tensor, float]:
    factor, attention = s.factor, s.attention_factor
    if attention is None:
        if s.mscale and s.mscale_all_dim:
            attention = _yarn_mscale(factor, s.mscale) / _yarn_mscale(factor, s.mscale_all_dim)
        else:
            attention = _yarn_mscale(factor)

    def correction_dim(rotations: float) -> float:
        return (dims * math.log(s.original_max_positions / (rotations * 2 * math.pi))) / (
            2 * math.log(base)
        )

    low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dims - 1)
    if low == high:
        high += 0.001  # the reference's guard against a zero-width ramp
    ramp = ((torch.arange(dims // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dims, 2).float() / dims)
    extrapolated, interpolated = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    keep = 1 - ramp  # 1: the frequency is kept (extrapolated), 0: interpolated
    return interpolated * (1 - keep) + extrapolated * keep, float(attention)


def _longrope(dims: int, base: float, s: RopeScaling, length: int | None) -> tuple[Tensor, float]:
    trained = s.original_max_positions
    attention = s.attention_factor
    if attention is None:
        factor = s.factor
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(trained))
    long = length is not None and length > trained
    factors = torch.tensor(s.long_factor if long else s.short_factor, dtype=torch.float32)
    shape = torch.arange(0, dims, 2, dtype=torch.int64).float() / dims
    return 1.0 / (factors * base**shape), float(attention)
