"""torch's fused scaled_dot_product_attention, wrapped to keep qkv's contract.

Two things torch does not promise are made true here: causal attention with fewer
queries than keys is aligned to the end of the keys (torch aligns it to the start), and
a query whose keys are all hidden gets zeros, forward and backward, on every torch
version and device.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor

from qkv.attention.inputs import Shape, allowed_keys, check_inputs


def forward(
    q: Tensor, k: Tensor, v: Tensor, *, mask, causal: bool, scale: float, shape: Shape
) -> Tensor:
    """Backend entry for the registry: inputs already checked."""
    gqa = shape.Hkv != shape.H
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


def attend(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    mask: Tensor | None = None,
    causal: bool = False,
    scale: float | None = None,
) -> Tensor:
    """Attention with the `sdpa` backend. Shapes as in `qkv.attend`."""
    shape, scale = check_inputs(q, k, v, mask, scale)
    return forward(q, k, v, mask=mask, causal=causal, scale=scale, shape=shape)
