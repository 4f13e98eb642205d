"""torch's fused scaled_dot_product_attention, wrapped to keep qkv's contract.

Two things torch does not promise are made true here: causal attention with fewer
queries than keys is aligned to the end of the keys (torch aligns it to the start), and
a query whose keys are all hidden gets zeros, forward and backward, on every torch
version and device. A score bias (T5's relative positions) goes in as a float mask; a
soft-cap torch's function cannot apply, so the registry does not send one here.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor

from qkv.attention.inputs import Shape, allowed_keys


def forward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    mask,
    causal: bool,
    scale: float,
    shape: Shape,
    bias: Tensor | None = None,
) -> Tensor:
    """Backend entry for the registry: inputs already checked (a window already in mask)."""
    gqa = shape.Hkv != shape.H
    if bias is not None:
        return _with_bias(q, k, v, mask, causal, scale, shape, bias)
    if mask is None and (not causal or shape.Tq == shape.Tk):
        # torch's own causal flag is correct when the queries and keys line up.
        return F.scaled_dot_product_attention(
            q, k, v, is_causal=causal, scale=scale, enable_gqa=gqa
        )
    if mask is None and shape.Tq == 1:
        # A single query aligned to the last key sees every key: decoding's common case.
        return F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=gqa)
    allowed = allowed_keys(mask, causal, shape.Tq, shape.Tk, q.device)
    sees_some_key = allowed.any(dim=-1, keepdim=True)  # (…, Tq, 1)
    # A row with no visible key would be 0/0 inside the kernel: let it see every key, so
    # the kernel stays finite, then zero its output (which also zeroes its gradient).
    allowed = allowed | ~sees_some_key
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale, enable_gqa=gqa)
    return out.masked_fill(~sees_some_key, 0.0)


def _with_bias(q, k, v, mask, causal, scale, shape: Shape, bias: Tensor) -> Tensor:
    """The bias as a float mask, hidden keys at -inf; a row with no visible key gets zeros."""
    allowed = allowed_keys(mask, causal, shape.Tq, shape.Tk, q.device)
    scores = bias.to(q.dtype)
    if allowed is None:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=scores, scale=scale, enable_gqa=shape.Hkv != shape.H
        )
    sees_some_key = allowed.any(dim=-1, keepdim=True)
    scores = scores.masked_fill(~(allowed | ~sees_some_key), float("-inf"))
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=scores, scale=scale, enable_gqa=shape.Hkv != shape.H
    )
    return out.masked_fill(~sees_some_key, 0.0)
