"""What every backend may assume: checked shapes, and one way to build the mask.

`check_inputs` turns a wrong call into a `ValueError` that names the fault and what is
allowed, so backends can trust their inputs. `allowed_keys` combines a boolean mask and
the causal rule into one (…, Tq, Tk) tensor, True where a query may attend to a key.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class Shape:
    """The sizes of one attention call: q (B, H, Tq, D), k and v (B, Hkv, Tk, D)."""

    B: int
    H: int
    Hkv: int
    Tq: int
    Tk: int
    D: int

    @property
    def group(self) -> int:
        """How many query heads share one key/value head (query head h uses h // group)."""
        return self.H // self.Hkv


def check_inputs(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float | None
) -> tuple[Shape, float]:
    """Validate one call of `attend`; return its sizes and the scale to use.

    >>> q = torch.zeros(1, 4, 3, 8); k = v = torch.zeros(1, 2, 5, 8)
    >>> shape, scale = check_inputs(q, k, v, None, None)
    >>> shape.group, round(scale, 4)
    (2, 0.3536)
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(
                f"{name} must have 4 dimensions (B, heads, T, D), got shape {tuple(t.shape)}"
            )
        if t.dtype not in DTYPES:
            raise ValueError(f"{name} has dtype {t.dtype}; allowed: {', '.join(map(str, DTYPES))}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    B, H, Tq, D = q.shape
    if k.shape != v.shape:
        raise ValueError(
            f"k and v must have the same shape (B, Hkv, Tk, D), got {tuple(k.shape)} "
            f"and {tuple(v.shape)}"
        )
    Bk, Hkv, Tk, Dk = k.shape
    if Bk != B:
        raise ValueError(f"q has batch size {B} but k and v have {Bk}; they must match")
    if Dk != D:
        raise ValueError(f"q has head size D={D} but k and v have D={Dk}; they must match")
    if min(B, H, Hkv, Tq, Tk, D) == 0:
        raise ValueError(
            f"every size must be at least 1, got B={B}, H={H}, Hkv={Hkv}, Tq={Tq}, Tk={Tk}, D={D}"
        )
    if H % Hkv != 0:
        raise ValueError(
            f"q has H={H} heads, which is not a multiple of k and v's Hkv={Hkv} heads; "
            f"allowed Hkv for H={H}: {[n for n in range(1, H + 1) if H % n == 0]}"
        )
    if mask is not None:
        if not isinstance(mask, Tensor) or mask.dtype != torch.bool:
            kind = mask.dtype if isinstance(mask, Tensor) else type(mask).__name__
            raise ValueError(f"mask must be a boolean tensor (True = may attend), got {kind}")
        if mask.device != q.device:
            raise ValueError(f"mask is on {mask.device} but q is on {q.device}")
        target = (B, H, Tq, Tk)
        try:
            broadcast = torch.broadcast_shapes(mask.shape, target)
        except RuntimeError:
            broadcast = None
        if mask.dim() > 4 or broadcast != torch.Size(target):
            raise ValueError(
                f"mask of shape {tuple(mask.shape)} does not broadcast to (B, H, Tq, Tk) = "
                f"{target}; a key-padding mask is ({B}, 1, 1, {Tk})"
            )
    if scale is None:
        scale = 1.0 / math.sqrt(D)
    elif not (isinstance(scale, int | float) and math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale must be a positive finite number or None, got {scale!r}")
    return Shape(B, H, Hkv, Tq, Tk, D), float(scale)


def causal_mask(Tq: int, Tk: int, device: torch.device | str | None = None) -> Tensor:
    """(Tq, Tk) boolean: query i may see key j when j <= i + Tk - Tq.

    The queries are aligned to the end of the keys, as in decoding with a cache, where the
    new queries are the last Tq of Tk positions.

    >>> causal_mask(2, 3).int().tolist()
    [[1, 1, 0], [1, 1, 1]]
    """
    return torch.ones(Tq, Tk, dtype=torch.bool, device=device).tril(diagonal=Tk - Tq)


def allowed_keys(mask: Tensor | None, causal: bool, Tq: int, Tk: int, device) -> Tensor | None:
    """The mask and the causal rule combined, broadcastable to (B, H, Tq, Tk); None if neither."""
    if not causal:
        return mask
    tri = causal_mask(Tq, Tk, device)  # (Tq, Tk)
    return tri if mask is None else mask & tri
