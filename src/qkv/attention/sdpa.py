"""torch's fused scaled_dot_product_attention, wrapped to keep qkv's contract.

Two things torch does not promise are made true here: causal attention with fewer
queries than keys is aligned to the end of the keys (torch aligns it to the start), and
a query whose keys are all hidden gets zeros, forward and backward, on every torch
version and device. A score bias (T5's relative positions) goes in as a float mask; a query's
temperature (Llama 4) multiplies its query vector, which multiplies its scores; a learned sink
(gpt-oss) is one more key column, a key of zeros whose score is the sink and whose value is
zeros. A soft-cap torch's function cannot apply, so the registry does not send one here.
"""

from __future__ import annotations

import torch
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
    sinks: Tensor | None = None,
    query_scale: Tensor | None = None,
) -> Tensor:
    """Backend entry for the registry: inputs already checked (a window and chunks already in
    mask)."""
    gqa = shape.Hkv != shape.H
    if query_scale is not None:  # (B?, Tq): each query's scores times its temperature
        q = q * query_scale.to(q.dtype).expand(shape.B, shape.Tq)[:, None, :, None]
    if sinks is not None:
        return _with_sinks(q, k, v, mask, causal, scale, shape, bias, sinks)
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
    if q.device.type == "cpu" and bool(sees_some_key.all()):  # asking costs a GPU a sync
        # the common case (a knockout hides some keys, never all): no row to zero, and the
        # zeroing costs a 100-token layer 60 us, 2% of its attention
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=allowed, scale=scale, enable_gqa=gqa
        )
    # A row with no visible key would be 0/0 inside the kernel: let it see every key, so
    # the kernel stays finite, then zero its output (which also zeroes its gradient).
    allowed = allowed | ~sees_some_key
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale, enable_gqa=gqa)
    return out.masked_fill(~sees_some_key, 0.0)


def _with_sinks(q, k, v, mask, causal, scale, shape: Shape, bias, sinks: Tensor) -> Tensor:
    """One more key per head: zeros, so its score is the bias given it, the sink, and its
    value zeros, so it takes weight and adds nothing. A query seeing no word sees the sink."""
    B, Hkv, Tk = shape.B, shape.Hkv, shape.Tk
    k = torch.cat([k, k.new_zeros(B, Hkv, 1, k.shape[-1])], dim=2)
    v = torch.cat([v, v.new_zeros(B, Hkv, 1, v.shape[-1])], dim=2)
    scores = q.new_zeros(B, shape.H, shape.Tq, Tk) if bias is None else bias.to(q.dtype)
    scores = scores.expand(B, shape.H, shape.Tq, Tk)
    allowed = allowed_keys(mask, causal, shape.Tq, Tk, q.device)
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))
    column = sinks.to(q.dtype).view(1, -1, 1, 1).expand(B, shape.H, shape.Tq, 1)
    scores = torch.cat([scores, column], dim=-1)
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=scores, scale=scale, enable_gqa=shape.Hkv != shape.H
    )


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
