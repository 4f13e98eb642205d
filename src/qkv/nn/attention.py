"""Multi-head attention: the article's query, key and value matrices, several heads at once.

Each head has its own query, key and value matrices; they are stored side by side in one
Linear per role (or one fused Linear for all three), so that one matrix product makes
every head's vectors for every word. The heads' contextualized vectors are concatenated
and mixed by an output projection.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from qkv.attention import attend, backend_names, flash
from qkv.nn.position import RotaryEmbedding, Rotation, positions_for
from qkv.nn.record import AttentionRecord


class KVCache:
    """The keys and values of tokens already seen by one attention layer.

    Decoding one token at a time, each step computes the new token's key and value only
    and reads the earlier ones from here. Storage grows by doubling, so appending is
    amortized O(1) rather than a copy of everything per token. Inference only: the
    buffers are written in place.
    """

    def __init__(self) -> None:
        self.keys: Tensor | None = None  # (B, Hkv, capacity, D)
        self.values: Tensor | None = None
        self.length = 0

    def update(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Append k, v (B, Hkv, T, D); return all keys and values so far (B, Hkv, length, D)."""
        T = k.shape[2]
        if self.keys is None or self.length + T > self.keys.shape[2]:
            capacity = max(16, 2 * (self.length + T))
            keys = k.new_empty(*k.shape[:2], capacity, k.shape[3])
            values = v.new_empty(*v.shape[:2], capacity, v.shape[3])
            if self.keys is not None:
                keys[:, :, : self.length] = self.keys[:, :, : self.length]
                values[:, :, : self.length] = self.values[:, :, : self.length]
            self.keys, self.values = keys, values
        self.keys[:, :, self.length : self.length + T] = k
        self.values[:, :, self.length : self.length + T] = v
        self.length += T
        return self.keys[:, :, : self.length], self.values[:, :, : self.length]

    def stored(self) -> tuple[Tensor, Tensor]:
        """What is cached, without appending (cross-attention's encoder keys and values)."""
        assert self.keys is not None and self.values is not None
        return self.keys[:, :, : self.length], self.values[:, :, : self.length]


class MultiHeadAttention(nn.Module):
    """Self- or cross-attention with H query heads sharing Hkv key/value heads.

    x (B, T, C) -> (B, T, C). With `context` (B, S, Cc), the queries come from x and the
    keys and values from context: cross-attention. `backend` picks the `attend` backend.

    >>> mha = MultiHeadAttention(width=16, num_heads=4)
    >>> out, record = mha(torch.randn(2, 5, 16), record=True)
    >>> out.shape, record.weights([0, 3]).shape
    (torch.Size([2, 5, 16]), torch.Size([2, 2, 5, 5]))
    """

    def __init__(
        self,
        width: int,
        num_heads: int,
        *,
        num_kv_heads: int | None = None,
        head_dim: int | None = None,
        context_width: int | None = None,
        bias: bool = True,
        out_bias: bool | None = None,
        fused_qkv: bool = False,
        rotary: RotaryEmbedding | None = None,
        backend: str = "auto",
    ):
        super().__init__()
        num_kv_heads = num_kv_heads or num_heads
        if head_dim is None:
            if width % num_heads:
                raise ValueError(
                    f"width {width} is not divisible by {num_heads} heads; pass head_dim"
                )
            head_dim = width // num_heads
        if num_heads % num_kv_heads:
            raise ValueError(
                f"{num_heads} query heads cannot share {num_kv_heads} key/value heads evenly"
            )
        if backend not in backend_names():
            raise ValueError(f"unknown attention backend {backend!r}; allowed: {backend_names()}")
        context_width = context_width or width
        if fused_qkv and context_width != width:
            raise ValueError("fused_qkv needs the context to be as wide as x")
        if rotary is not None and rotary.head_dim != head_dim:
            raise ValueError(f"rotary head size {rotary.head_dim} != head size {head_dim}")
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.backend = backend
        self.rotary = rotary
        self.scale = 1.0 / math.sqrt(head_dim)  # the article's side note: divide by sqrt(D)
        q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
        self.sizes = (q_size, kv_size, kv_size)
        if fused_qkv:
            # one matrix: rows [query matrix; key matrix; value matrix] of every head
            self.qkv = nn.Linear(width, q_size + 2 * kv_size, bias=bias)
        else:
            self.q = nn.Linear(width, q_size, bias=bias)
            self.k = nn.Linear(context_width, kv_size, bias=bias)
            self.v = nn.Linear(context_width, kv_size, bias=bias)
        self.out = nn.Linear(q_size, width, bias=bias if out_bias is None else out_bias)

    def _fused_weights(self, part: slice) -> tuple[Tensor, Tensor | None]:
        bias = None if self.qkv.bias is None else self.qkv.bias[part]
        return self.qkv.weight[part], bias

    def queries(self, x: Tensor) -> Tensor:
        """The article's step 1 for every word and head: x times the query matrix (B, T, H*D)."""
        if hasattr(self, "qkv"):
            return F.linear(x, *self._fused_weights(slice(0, self.sizes[0])))
        return self.q(x)

    def keys_values(self, source: Tensor) -> tuple[Tensor, Tensor]:
        """Steps 2 and 5: source times the key and the value matrix, (B, S, Hkv*D) each."""
        if hasattr(self, "qkv"):
            kv = F.linear(source, *self._fused_weights(slice(self.sizes[0], None)))
            return kv.split(self.sizes[1:], dim=-1)
        return self.k(source), self.v(source)

    def split_heads(self, x: Tensor, num_heads: int) -> Tensor:
        B, T, _ = x.shape
        return x.view(B, T, num_heads, self.head_dim).transpose(1, 2)  # (B, num_heads, T, D)

    def forward(
        self,
        x: Tensor,
        context: Tensor | None = None,
        *,
        mask: Tensor | None = None,
        key_padding_mask: Tensor | None = None,
        causal: bool = False,
        positions: Tensor | None = None,
        rotation: Rotation | None = None,
        cache: KVCache | None = None,
        record: bool = False,
    ) -> tuple[Tensor, AttentionRecord | None]:
        """Contextualize x; return (out (B, T, C), this call's AttentionRecord or None).

        mask: boolean, True = may attend, broadcastable to (B, H, T, Tk).
        key_padding_mask: (B, Tk), True where the key is a real token (not padding);
          with a cache, Tk counts the cached tokens too.
        causal: each word sees only itself and the words before it.
        positions: (T,) or (B, T) positions of x's tokens for rotary embeddings; by
          default they follow the tokens already in the cache.
        rotation: the rotary cos and sin of those positions, made once per forward pass by
          the model (`RotaryEmbedding.rotation`) and shared by every layer; overrides positions.
        cache: self-attention appends this step's keys and values and attends to all of
          them; cross-attention computes the context's keys and values once and reuses them.
        record: also return what attention received and computed (see AttentionRecord).
        """
        B, T, _ = x.shape
        q_plain = k_plain = None
        if context is None:  # self-attention: queries, keys and values all from x
            if hasattr(self, "qkv"):
                q, k, v = self.qkv(x).split(self.sizes, dim=-1)  # one matmul for all three
            else:
                q, k, v = self.q(x), self.k(x), self.v(x)
            q = self.split_heads(q, self.num_heads)  # (B, H, T, D)
            k = self.split_heads(k, self.num_kv_heads)  # (B, Hkv, T, D)
            v = self.split_heads(v, self.num_kv_heads)
            if self.rotary is not None:
                if rotation is None:
                    if positions is None:
                        positions = positions_for(T, cache.length if cache else 0, x.device)
                    rotation = self.rotary.rotation(positions, q.dtype)
                q_plain, k_plain = q, k
                q, k = rotation.apply(q), rotation.apply(k)
            if cache is not None:
                k, v = cache.update(k, v)  # (B, Hkv, Tk, D), earlier tokens first
        else:  # cross-attention: queries from x, keys and values from the context
            q = self.split_heads(self.queries(x), self.num_heads)
            if cache is not None and cache.length:
                k, v = cache.stored()  # the context does not change while decoding
            else:
                k, v = (self.split_heads(t, self.num_kv_heads) for t in self.keys_values(context))
                if cache is not None:
                    cache.update(k, v)
        if key_padding_mask is not None:
            padding = key_padding_mask.to(torch.bool)[:, None, None, :]  # (B, 1, 1, Tk)
            mask = padding if mask is None else mask & padding
        lse = None
        if record and self.backend == "flash":
            # the kernel's log-sum-exp turns q and k into any head's weights directly
            out, lse = flash.flash_attention(q, k, v, mask=mask, causal=causal, scale=self.scale)
        else:
            out = attend(q, k, v, mask=mask, causal=causal, scale=self.scale, backend=self.backend)
        kept = None  # (B, H, T, D) out, and the rest, as attend saw them
        if record:
            kept = AttentionRecord(
                q, k, v, out, mask, causal, self.scale, self.backend, lse, q_plain, k_plain
            )
        out = self.out(out.transpose(1, 2).reshape(B, T, -1))  # concatenate heads, (B, T, C)
        return out, kept
