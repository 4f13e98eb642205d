"""Vectorized attention: matmul, softmax, matmul. It can hand back the weights.

All query words and all key words at once, the article's "parallel computation": one
matrix product gives every attention scalar, one softmax normalizes each query's row,
one more product scales and sums the value vectors. Half-precision inputs are computed
in float32 and the result cast back, as fused kernels do internally.
"""

from __future__ import annotations

from typing import Unpack

import torch
from torch import Tensor

from qkv.attention.inputs import NONE, Options, Shape, Variants, allowed_keys, capped, check_call


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 stays float64; everything narrower is computed in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def weights_from_scores(
    scores: Tensor, allowed: Tensor | None, sinks: Tensor | None = None
) -> Tensor:
    """Softmax over keys, with hidden keys at exactly 0 and fully hidden rows all 0.

    A hidden key gets the most negative finite score rather than -inf, so its exp() is
    exactly 0 beside any visible key, and a row with every key hidden softmaxes to a
    finite uniform row (no NaN reaches the gradient), which is then set to zeros.
    sinks (H,): one more score per head in every row's softmax (gpt-oss), whose weight is
    dropped after it: the row then sums to less than 1.
    """
    if allowed is not None:
        scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
    if sinks is not None:
        column = sinks.to(scores.dtype).view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
        return torch.cat([scores, column], dim=-1).softmax(dim=-1)[..., :-1]
    weights = scores.softmax(dim=-1)
    if allowed is None:
        return weights
    blind = ~allowed.any(dim=-1, keepdim=True)  # (…, Tq, 1): queries that see no key
    return weights.masked_fill(blind, 0.0) if blind.any() else weights


def scores_of(q: Tensor, k: Tensor, scale: float, shape: Shape, variants: Variants = NONE):
    """Every query's scores over every key (B, H, Tq, Tk) in the compute dtype: the scaled
    dot products, times each query's temperature, soft-capped, plus the bias."""
    B, H, Hkv, Tq, Tk, D = shape.B, shape.H, shape.Hkv, shape.Tq, shape.Tk, shape.D
    dtype = compute_dtype(q.dtype)
    q = q.to(dtype) * scale
    if variants.query_scale is not None:  # (B?, Tq): a temperature per query
        q = q * variants.query_scale.to(dtype).expand(B, Tq)[:, None, :, None]
    # Query head h reads key head h // group: view the queries as (B, Hkv, group, Tq, D)
    # so each key head is multiplied once, without copying it group times.
    q = q.reshape(B, Hkv, shape.group, Tq, D)
    k = k.to(dtype).unsqueeze(2)  # (B, Hkv, 1, Tk, D)
    scores = (q @ k.transpose(-1, -2)).reshape(B, H, Tq, Tk)  # every query . every key
    scores = capped(scores, variants.softcap)
    if variants.bias is not None:
        scores = scores + variants.bias.to(dtype)
    return scores


def _weights(q: Tensor, k: Tensor, mask, causal, scale: float, shape: Shape,
             variants: Variants = NONE) -> Tensor:  # fmt: skip
    allowed = allowed_keys(mask, causal, shape.Tq, shape.Tk, q.device)
    return weights_from_scores(scores_of(q, k, scale, shape, variants), allowed, variants.sinks)


def weights_into(out: Tensor, q: Tensor, k: Tensor, *, causal: bool, scale: float) -> Tensor:
    """`attention_weights(q, k, causal=causal, scale=scale)[0]` of one sequence, q (1, H, Tq,
    D) and k (1, Hkv, Tk, D), computed in `out` (H, Tq, Tk, the compute dtype): the same
    products, hidden-key score and softmax, with no other tensor of out's size beside it
    (`Attentions.weights` fills every layer's this way: 1.1 GB for SmolLM2 at 1,024 tokens).
    One matrix product per key head, not per query head, so a weight may differ from
    attention_weights' in its last bit (the products summed in another blocking).

    Causal weights are made a block of query rows at a time (`_causal_into`), each block's
    in a small tensor the CPU's cache holds, then copied into `out` once.
    """
    _, H, Tq, D = q.shape
    Hkv, Tk = k.shape[1], k.shape[2]
    dtype = compute_dtype(q.dtype)
    if out.shape != (H, Tq, Tk) or out.dtype != dtype or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous ({H}, {Tq}, {Tk}) {dtype} tensor")
    if causal and Tk >= Tq:
        return _causal_into(out, q[0].to(dtype) * scale, k[0].to(dtype))
    # (Hkv, group * Tq, D): query head h = kv * group + g reads key head kv, as in _weights
    queries = (q[0].to(dtype) * scale).reshape(Hkv, H // Hkv * Tq, D)
    torch.bmm(queries, k[0].to(dtype).transpose(-1, -2), out=out.view(Hkv, -1, Tk))
    allowed = allowed_keys(None, causal, Tq, Tk, q.device)
    if allowed is not None:
        out.masked_fill_(~allowed, torch.finfo(dtype).min)
    torch.softmax(out, dim=-1, out=out)
    if allowed is not None:
        blind = ~allowed.any(dim=-1, keepdim=True)  # (Tq, 1): queries that see no key
        if blind.any():
            out.masked_fill_(blind, 0.0)
    return out


CACHED_BLOCK = 2**20  # bytes of one block's scores: well inside a core's share of the cache


def takes_into(q: Tensor, k: Tensor, v: Tensor, *, mask=None, causal=False, **others) -> bool:
    """Whether `attend_into` computes what `attend` would for this call: one causal sequence
    of plain scores (no mask, window, chunk, soft-cap, bias, sink or temperature), at least as
    many keys as queries, values of the keys' shape, and no gradient to keep (its softmax is
    taken in place). others: the other options of `attend`, all None to be plain."""
    plain = causal and mask is None and all(value is None for value in others.values())
    return (plain and q.shape[0] == 1 and k.shape[2] >= q.shape[2] and v.shape == k.shape
            and not (torch.is_grad_enabled() and q.requires_grad))  # fmt: skip


def attend_into(weights: Tensor, q: Tensor, k: Tensor, v: Tensor, *, scale: float) -> Tensor:
    """Causal attention of one sequence whose weights are wanted too: the output (1, H, Tq,
    D) of q (1, H, Tq, D) over k, v (1, Hkv, Tk, D), Tk >= Tq (aligned to the end of the keys,
    as in cached decoding), the weights written into `weights` (H, Tq, Tk, the compute
    dtype). Eager's arithmetic (the weights, then their products with the values), a block
    of query rows at a time while its weights are in the CPU's cache: where the weights are
    asked for anyway, cheaper than a fused kernel's pass followed by the weights' own."""
    _, H, Tq, D = q.shape
    Tk = k.shape[2]
    dtype = compute_dtype(q.dtype)
    if weights.shape != (H, Tq, Tk) or weights.dtype != dtype or not weights.is_contiguous():
        raise ValueError(f"weights must be a contiguous ({H}, {Tq}, {Tk}) {dtype} tensor")
    if Tk < Tq or v.shape != k.shape:
        raise ValueError(f"attend_into takes at least as many keys as queries ({Tk} < {Tq}) "
                         "and values of the keys' shape")  # fmt: skip
    out = q.new_empty(H, Tq, D, dtype=dtype)
    _causal_into(weights, q[0].to(dtype) * scale, k[0].to(dtype), v[0].to(dtype), out)
    return out[None].to(q.dtype)


def forward_into(weights: Tensor, q: Tensor, k: Tensor, v: Tensor, *, scale: float, mask=None,
                 causal=False, **others) -> Tensor | None:  # fmt: skip
    """Registry entry for the weights made with the output: `attend_into`'s output where it
    computes exactly what `attend` would for this call (`takes_into`) and `weights` is the
    tensor it writes (H, Tq, Tk, contiguous, the compute dtype, on q's device); else None.
    others: the other options of `attend` (window, chunk, softcap, ...)."""
    fits = (weights.shape == q.shape[1:3] + k.shape[2:3] and weights.is_contiguous()
            and weights.dtype == compute_dtype(q.dtype)
            and weights.device == q.device)  # fmt: skip
    plain = takes_into(q, k, v, mask=mask, causal=causal, **others)
    return attend_into(weights, q, k, v, scale=scale) if fits and plain else None


def _causal_into(out: Tensor, q: Tensor, k: Tensor, v: Tensor | None = None,
                 attended: Tensor | None = None) -> Tensor:  # fmt: skip
    """Causal weights (H, Tq, Tk) into out from scaled queries q (H, Tq, D) and keys k (Hkv,
    Tk, D), Tk >= Tq (query i sees keys up to i + Tk - Tq): every query sees a key. With
    values v (Hkv, Tk, D), their weighted sums too, into attended (H, Tq, D).

    A block of query rows [a, b) sees keys [0, b + Tk - Tq) only: its scores are a product
    over those keys (the whole square's, less the hidden corner: about half the arithmetic
    over a long text), hidden keys filled in its last (b - a) columns, the softmax taken in
    place (and the values summed while it is in the cache); then the block is copied into out
    once and the rest of its rows set to 0 (a hidden key's weight, as softmax gives it). The
    whole (H, Tq, Tk) is written once, where a product, a fill and a softmax over it read and
    wrote it three times or more.
    """
    H, Tq, D = q.shape
    Hkv, Tk = k.shape[0], k.shape[1]
    group, shift = H // Hkv, Tk - Tq
    rows = max(16, min(Tq, CACHED_BLOCK // (H * Tk * out.element_size())))
    keys = k.transpose(-1, -2)  # (Hkv, D, Tk)
    floor = torch.finfo(out.dtype).min
    hidden = torch.ones(rows, rows, dtype=torch.bool, device=q.device).triu_(1)
    for a in range(0, Tq, rows):
        b = min(a + rows, Tq)
        n, seen = b - a, b + shift  # this block's rows, and the keys its last row sees
        block = torch.bmm(q[:, a:b].reshape(Hkv, group * n, D), keys[:, :, :seen])
        block = block.view(H, n, seen)
        block[:, :, seen - n :].masked_fill_(hidden[:n, :n], floor)  # row i: keys after i
        torch.softmax(block, dim=-1, out=block)
        if v is not None:  # query head h = kv * group + g reads key head kv
            summed = torch.bmm(block.view(Hkv, group * n, seen), v[:, :seen])
            attended[:, a:b] = summed.view(H, n, D)
        out[:, a:b, :seen] = block
        out[:, a:b, seen:] = 0.0
    return out


def forward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    mask,
    causal: bool,
    scale: float,
    shape: Shape,
    **variants,
) -> Tensor:
    """Backend entry for the registry: inputs already checked (a window and chunks already in
    mask); variants: softcap, bias, sinks, query_scale, as `Variants` holds them."""
    return _forward(q, k, v, mask, causal, scale, shape, Variants(**variants))[0]


def _forward(
    q, k, v, mask, causal, scale, shape: Shape, variants: Variants = NONE
) -> tuple[Tensor, Tensor]:
    weights = _weights(q, k, mask, causal, scale, shape, variants)  # (B, H, Tq, Tk)
    grouped = weights.reshape(shape.B, shape.Hkv, shape.group, shape.Tq, shape.Tk)
    v = v.to(weights.dtype).unsqueeze(2)  # (B, Hkv, 1, Tk, Dv)
    out = (grouped @ v).reshape(shape.B, shape.H, shape.Tq, shape.value_size)  # weighted sum
    return out.to(q.dtype), weights


def attend(
    q: Tensor, k: Tensor, v: Tensor, *, return_weights: bool = False, **options: Unpack[Options]
) -> Tensor | tuple[Tensor, Tensor]:
    """Attention with the `eager` backend; optionally also the weights.

    Arguments as in `qkv.attend`. With return_weights, returns (out, weights) where weights
    is (B, H, Tq, Tk) in float32 (float64 for float64 inputs); each row sums to 1, or to 0
    for a query that may see no key.
    """
    call = check_call(q, k, v, **options)
    out, weights = _forward(q, k, v, call.mask, call.causal, call.scale, call.shape, call.variants)
    return (out, weights) if return_weights else out


def attention_weights(
    q: Tensor,
    k: Tensor,
    *,
    mask: Tensor | None = None,
    causal: bool = False,
    scale: float | None = None,
    window: int | None = None,
    chunk: int | None = None,
    chunk_start: Tensor | None = None,
    softcap: float | None = None,
    bias: Tensor | None = None,
    sinks: Tensor | None = None,
    query_scale: Tensor | None = None,
) -> Tensor:
    """The normalized attention weights (B, H, Tq, Tk) of queries q over keys k.

    These are the weights `eager` uses, so any backend's layer can recompute them from its
    q and k and report exactly what `eager` would. window, chunk, chunk_start, softcap, bias,
    sinks, query_scale: as in `qkv.attend` (with sinks, a row sums to 1 less the sink's share).

    >>> q = k = torch.eye(2).view(1, 1, 2, 2)
    >>> attention_weights(q, k, causal=True).squeeze()
    tensor([[1.0000, 0.0000],
            [0.3302, 0.6698]])
    """
    call = check_call(
        q, k, k, mask=mask, causal=causal, scale=scale, window=window, chunk=chunk,
        chunk_start=chunk_start, softcap=softcap, bias=bias, sinks=sinks, query_scale=query_scale,
    )  # fmt: skip
    return _weights(q, k, call.mask, causal, call.scale, call.shape, call.variants)
