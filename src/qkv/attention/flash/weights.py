"""The weights a fused kernel never stored, recomputed exactly from q, k and its lse.

A fused kernel keeps no T x T matrix, but it returns each query's log-sum-exp, the log of
the softmax denominator. With it, any head's weights are one product away:
weight_ij = exp(scale * q_i . k_j - lse_i). That is how a model run on `flash` still
answers "what did head 3 of layer 2 look at", at the cost of only the heads asked for.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from qkv.attention.inputs import allowed_keys, check_indices, check_inputs, select_heads


def attention_weights_from_lse(
    q: Tensor,
    k: Tensor,
    lse: Tensor,
    *,
    heads: Sequence[int] | None = None,
    mask: Tensor | None = None,
    causal: bool = False,
    scale: float | None = None,
) -> Tensor:
    """The softmax weights (B, len(heads), Tq, Tk), float32, of the query heads `heads`.

    q (B, H, Tq, D), k (B, Hkv, Tk, D), mask, causal and scale as given to the kernel;
    lse (B, H, Tq) as it returned. Hidden keys get exactly 0; a query that saw no key
    (lse = -inf) a row of zeros. Each row sums to 1 up to the kernel's rounding.

    >>> q = k = torch.eye(2).view(1, 1, 2, 2)
    >>> lse = torch.logsumexp(q @ k.mT / 2**0.5, dim=-1)  # (B, H, Tq), as the kernel gives
    >>> attention_weights_from_lse(q, k, lse)[0, 0, 0].tolist()  # doctest: +ELLIPSIS
    [0.66..., 0.33...]
    """
    shape, scale = check_inputs(q, k, k, mask, scale)
    if lse.shape != (shape.B, shape.H, shape.Tq):
        raise ValueError(
            f"lse must be (B, H, Tq) = {(shape.B, shape.H, shape.Tq)}, got {tuple(lse.shape)}"
        )
    chosen = check_indices("head", heads, shape.H, "q")
    q, k, mask, lse = select_heads(chosen, q, k, mask, lse)  # (B, n, …) each
    return weights_from_lse(q, k, lse, mask=mask, causal=causal, scale=scale)


def weights_from_lse(
    q: Tensor, k: Tensor, lse: Tensor, *, mask: Tensor | None, causal: bool, scale: float
) -> Tensor:
    """The weights (B, n, Tq, Tk), float32, of n query heads q (B, n, Tq, D) over the keys
    k (B, n, Tk, D) each reads, given their lse (B, n, Tq) and the mask they saw."""
    Tq, Tk = q.shape[2], k.shape[2]
    scores = (q.float() @ k.float().transpose(-1, -2)) * scale  # (B, n, Tq, Tk)
    allowed = allowed_keys(mask, causal, Tq, Tk, q.device)
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))
    lse = lse.float()
    seen = torch.isfinite(lse)[..., None]  # (B, n, Tq, 1)
    # exp(-inf - lse) is 0 for a hidden key; a blind row's lse of -inf is replaced by 0 so
    # its hidden keys give exp(-inf) = 0 too rather than NaN
    weights = torch.exp(scores - torch.where(seen, lse[..., None], 0.0))
    return weights.masked_fill(~seen, 0.0)
