"""Edits of one head's own queries, keys, values, weights or inputs (`Edit.q`, `.k`, `.v`,
`.weights`, `.q_input`, `.k_input`, `.v_input`), as `MultiHeadAttention` applies them.

A layer makes every head's queries in one product; an edit of one head's input makes that
head's from another input. Each head's input is run through the layer's whole chain (the
norm, the projection and a QK-norm over all heads where the layer has one) as a batch of its
own, and the head's own slice kept: (B, T, H, C) -> (B, H, T, D), the chain's arithmetic
exactly. Keys and values are per query head then: under grouped-query attention the shared
key/value head is split by query head (each query head's copy of its group's head), so
an edit reaches one query head's keys and not its group's others'.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from qkv.nn.edit import Edit


def per_query_head(t: Tensor, num_heads: int) -> Tensor:
    """Keys or values (B, Hkv, T, D) -> (B, H, T, D), each query head's copy of its group's."""
    return t if t.shape[1] == num_heads else t.repeat_interleave(num_heads // t.shape[1], 1)


def from_head_inputs(attn, inputs: dict[str, Tensor], q: Tensor, k: Tensor, v: Tensor):
    """q (B, H, T, D), k and v (B, Hkv, T, D) with the heads asked for made from their own
    inputs {"q" | "k" | "v": (B, T, H, C), the norm already applied}: q, and k and v split
    by query head (B, H, T, D) where an input of theirs is given."""
    B, H, T, _ = q.shape
    Hkv = attn.num_kv_heads
    diagonal = torch.arange(H)
    group = diagonal // (H // Hkv)  # each query head's key/value head

    def batched(x: Tensor) -> Tensor:  # (B, T, H, C) -> (B * H, T, C): a run per head
        return x.permute(0, 2, 1, 3).reshape(B * H, T, x.shape[-1])

    made = {}
    for role, x in inputs.items():
        own = _own_slices(attn, role, group)
        if own is not None:  # each head's input times its own rows of the matrix only
            weight, bias = own  # (H, D, C), (H, D) or None
            out = torch.einsum("bthc,hdc->bhtd", x, weight.to(x.dtype))  # (B, H, T, D)
            out = out if bias is None else out + bias.to(x.dtype)[None, :, None, :]
            if role != "v" and attn.qk_norm == "head":
                out = (attn.q_norm if role == "q" else attn.k_norm)(out)
            made[role] = out
        elif role == "q":  # the whole chain per head, its own slice kept (H times the work)
            q_all, _ = attn._normed(attn.queries(batched(x)), None)  # (B*H, H, T, D)
            made[role] = q_all.view(B, H, H, T, -1)[:, diagonal, diagonal]
        else:
            keys, values = attn.keys_values(batched(x))  # (B*H, T, Hkv*D) each
            heads = attn.normed_keys(keys) if role == "k" else attn.split_heads(values, Hkv)
            made[role] = heads.view(B, H, Hkv, T, -1)[:, diagonal, group]  # (B, H, T, D)
    q, k, v = made.get("q", q), made.get("k", k), made.get("v", v)
    if k.shape[1] != v.shape[1]:  # one of them split by query head: both are
        k, v = per_query_head(k, H), per_query_head(v, H)
    return q, k, v


def _own_slices(attn, role: str, group: Tensor) -> tuple[Tensor, Tensor | None] | None:
    """Each query head's rows of the layer's query, key or value matrix, (H, D, C), and its
    bias (H, D): the key and value heads' repeated for the query heads that share them. None
    where a head's part is not its own rows (a QK-norm over all heads, a quantized matrix)."""
    if role != "v" and attn.qk_norm == "full":
        return None
    sizes = attn.sizes  # (H*D, Hkv*D, Hkv*D)
    if hasattr(attn, "qkv"):
        if type(attn.qkv) is not nn.Linear:
            return None
        start = {"q": 0, "k": sizes[0], "v": sizes[0] + sizes[1]}[role]
        size = sizes[("q", "k", "v").index(role)]
        weight, bias = attn._fused_weights(slice(start, start + size))
    else:
        module = getattr(attn, role)
        if type(module) is not nn.Linear:
            return None
        weight, bias = module.weight, module.bias
    D = attn.head_dim
    weight = weight.view(-1, D, weight.shape[-1])  # (H or Hkv, D, C)
    bias = None if bias is None else bias.view(-1, D)
    if role != "q":
        weight = weight[group]  # (H, D, C): each query head's key/value head
        bias = None if bias is None else bias[group]
    return weight, bias


def swapped(edit: Edit, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """q, k, v as attend will receive them, with the edit's Swaps applied: k and v split by
    query head where either is swapped."""
    H = q.shape[1]
    if edit.q is not None:
        q = edit.q.apply(q)
    if edit.k is not None or edit.v is not None:
        k, v = per_query_head(k, H), per_query_head(v, H)
        k = k if edit.k is None else edit.k.apply(k)
        v = v if edit.v is None else edit.v.apply(v)
    return q, k, v


def with_weights(edit: Edit, out: Tensor, v: Tensor) -> Tensor:
    """Head outputs (B, H, Tq, Dv) where the edit's `weights` swap gives those heads' weights
    (B, H, Tq, Tk): weights @ values, the article's step 5 with the given weights."""
    if edit.weights is None:
        return out
    given = edit.weights.values.to(v.dtype) @ per_query_head(v, out.shape[1])  # (B, H, Tq, Dv)
    return torch.where(edit.weights.where, given, out)
