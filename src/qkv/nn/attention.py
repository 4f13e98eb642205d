"""Multi-head attention: the article's query, key and value matrices, several heads at once.

Each head has its own query, key and value matrices; they are stored side by side in one
Linear per role (or one fused Linear for all three), so that one matrix product makes
every head's vectors for every word. The heads' contextualized vectors are concatenated
and mixed by an output projection.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from qkv.attention import attend_for_record, backend_names
from qkv.nn import head_edits
from qkv.nn.edit import Edit
from qkv.nn.linear import linear, project
from qkv.nn.norms import NormKind, make_norm
from qkv.nn.position import RotaryEmbedding, Rotation, Temperature, positions_for
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

    @classmethod
    def holding(cls, keys: Tensor, values: Tensor) -> KVCache:
        """A cache that already holds these keys and values (B, Hkv, T, D), as if their tokens
        had been run: appending copies them into storage of its own, never writes to them."""
        cache = cls()
        cache.keys, cache.values, cache.length = keys, values, keys.shape[2]
        return cache

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

    What some model families change, each optional: `scale` on every dot product (1/sqrt(D)
    by default; Gemma 2 uses 1/sqrt(query_pre_attn_scalar), T5 uses 1); `softcap` on every
    score; `window`, a key this many positions away or more is hidden; `chunk`, a query sees
    only the keys of its own chunk of positions (Llama 4); `sinks`, one learned score per head
    in every query's softmax (gpt-oss); `temperature`, each query's scores times a factor of
    its position (Llama 4, Ministral 3); `qk_norm`, a norm on the queries and keys before
    rotary positions, "head" for one per head (Qwen3, Gemma 3) or "full" over all heads at
    once (OLMo 2), of kind `norm` with `norm_eps`, or "l2" after rotary positions, with no
    weight (Llama 4); `output_gate`, the heads' concatenated outputs times sigmoid(x W_g)
    before the output projection, W_g a matrix of its own (`gate`, as wide as the queries:
    Qwen3.5 and Qwen3-Next, whose q_proj holds it beside each head's query matrix).

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
        scale: float | None = None,
        softcap: float | None = None,
        window: int | None = None,
        qk_norm: str | None = None,
        norm: NormKind = "rmsnorm",
        norm_eps: float = 1e-6,
        chunk: int | None = None,
        sinks: bool = False,
        temperature: Temperature | None = None,
        output_gate: bool = False,
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
        if qk_norm not in (None, "head", "full", "l2"):
            raise ValueError(f"qk_norm must be None, 'head', 'full' or 'l2', got {qk_norm!r}")
        if chunk is not None and (type(chunk) is not int or chunk < 1):
            raise ValueError(f"chunk must be a whole number of tokens >= 1 or None, got {chunk!r}")
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.backend = backend
        self.rotary = rotary
        # the article's side note: divide by sqrt(D), unless the model says otherwise
        self.scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
        self.softcap, self.window, self.chunk, self.temperature = (
            softcap,
            window,
            chunk,
            temperature,
        )
        # gpt-oss: one learned score per head, one more entry in every query's softmax
        self.sinks = nn.Parameter(torch.zeros(num_heads)) if sinks else None
        q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
        self.qk_norm, self.norm_eps = qk_norm, norm_eps
        if qk_norm in ("head", "full"):
            q_width, k_width = (head_dim, head_dim) if qk_norm == "head" else (q_size, kv_size)
            self.q_norm = make_norm(norm, q_width, norm_eps)
            self.k_norm = make_norm(norm, k_width, norm_eps)
        self.sizes = (q_size, kv_size, kv_size)
        if fused_qkv:
            # one matrix: rows [query matrix; key matrix; value matrix] of every head
            self.qkv = nn.Linear(width, q_size + 2 * kv_size, bias=bias)
        else:
            self.q = nn.Linear(width, q_size, bias=bias)
            self.k = nn.Linear(context_width, kv_size, bias=bias)
            self.v = nn.Linear(context_width, kv_size, bias=bias)
        self.out = nn.Linear(q_size, width, bias=bias if out_bias is None else out_bias)
        # Qwen3.5: how much of each head's output passes, a sigmoid of x per channel
        self.gate = nn.Linear(width, q_size, bias=bias) if output_gate else None

    @property
    def value_size(self) -> int:
        """The size of each head's output (its values'): the head size."""
        return self.head_dim

    def _normed(self, q: Tensor, k: Tensor | None) -> tuple[Tensor, Tensor | None]:
        """Queries (B, T, H*D) and keys (B, S, Hkv*D) or None -> (B, H, T, D) and
        (B, Hkv, S, D), each normalized where the model has a QK-norm."""
        if self.qk_norm == "full":
            q, k = self.q_norm(q), None if k is None else self.k_norm(k)
        q = self.split_heads(q, self.num_heads)
        k = None if k is None else self.split_heads(k, self.num_kv_heads)
        if self.qk_norm == "head":
            q, k = self.q_norm(q), None if k is None else self.k_norm(k)
        return q, k

    def normed_keys(self, k: Tensor) -> Tensor:
        """Keys (B, S, Hkv*D) -> (B, Hkv, S, D), normalized where the model has a QK-norm."""
        if self.qk_norm == "full":
            k = self.k_norm(k)
        k = self.split_heads(k, self.num_kv_heads)
        return self.k_norm(k) if self.qk_norm == "head" else k

    def _fused_weights(self, part: slice) -> tuple[Tensor, Tensor | None]:
        bias = None if self.qkv.bias is None else self.qkv.bias[part]
        return self.qkv.weight[part], bias

    def queries(self, x: Tensor) -> Tensor:
        """The article's step 1 for every word and head: x times the query matrix (B, T, H*D)."""
        if hasattr(self, "qkv"):
            return linear(x, *self._fused_weights(slice(0, self.sizes[0])))
        return project(self.q, x)

    def keys_values(self, source: Tensor) -> tuple[Tensor, Tensor]:
        """Steps 2 and 5: source times the key and the value matrix, (B, S, Hkv*D) each."""
        if hasattr(self, "qkv"):
            kv = linear(source, *self._fused_weights(slice(self.sizes[0], None)))
            return kv.split(self.sizes[1:], dim=-1)
        return project(self.k, source), project(self.v, source)

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
        bias: Tensor | None = None,
        edit: Edit | None = None,
        record: bool = False,
        weights_into: Tensor | None = None,
        head_inputs: dict[str, Tensor] | None = None,
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
        bias: a float tensor added to every score, broadcastable to (B, H, T, Tk) (T5's
          relative positions, made once by the model and shared by its layers).
        edit: an intervention (`qkv.nn.edit.Edit`): pairs hidden (joined to the mask, so
          on every backend) and head outputs replaced before the projection.
        record: also return what attention received and computed (see AttentionRecord).
        weights_into: with record, a tensor (H, T, Tk) of the weights' dtype (float32, float64
          for float64) to make every head's weights in as well, with the output in one pass
          (eager's arithmetic, `attend_into`) where this call is one causal sequence of plain
          scores on the "auto" or "eager" backend with no gradient to keep
          (`qkv.attention.eager.takes_into`); the record's `made` is then that tensor. A call
          that is not such leaves the tensor alone and records as without it.
        head_inputs: {"q" | "k" | "v": (B, T, H, C)}, each query head's own input to its
          query, key or value, already normalized (the block makes them from `edit`'s
          q_input, k_input, v_input: `qkv.nn.head_edits`). Self-attention only.
        """
        if weights_into is not None and not record:
            raise ValueError("weights_into makes the weights a record keeps: pass record=True")
        B, T, _ = x.shape
        q_plain = k_plain = None
        if context is None:  # self-attention: queries, keys and values all from x
            if hasattr(self, "qkv"):
                q, k, v = project(self.qkv, x).split(self.sizes, dim=-1)  # one product for all
            else:
                q, k, v = project(self.q, x), project(self.k, x), project(self.v, x)
            q, k = self._normed(q, k)  # (B, H, T, D), (B, Hkv, T, D)
            v = self.split_heads(v, self.num_kv_heads)
            if head_inputs:
                if cache is not None and ("k" in head_inputs or "v" in head_inputs):
                    raise ValueError(
                        "an edit of a head's key or value input splits the keys by query head, "
                        "which a KV cache does not hold: run it without a cache"
                    )
                q, k, v = head_edits.from_head_inputs(self, head_inputs, q, k, v)
            turned_here = self.rotary is not None and rotation is None
            if positions is None and (self.temperature is not None or turned_here):
                positions = positions_for(T, cache.length if cache else 0, x.device)
            if self.rotary is not None:
                if rotation is None:
                    rotation = self.rotary.rotation(positions, q.dtype)
                q_plain, k_plain = q, k
                q, k = rotation.apply(q), rotation.apply(k)
            if self.qk_norm == "l2":  # Llama 4: after the rotation, with no weight
                q, k = l2_norm(q, self.norm_eps), l2_norm(k, self.norm_eps)
            if cache is not None:
                k, v = cache.update(k, v)  # (B, Hkv, Tk, D), earlier tokens first
        else:  # cross-attention: queries from x, keys and values from the context
            if head_inputs or (edit is not None and edit.per_head):
                raise ValueError("edits of a head's own q, k, v, weights or inputs are for "
                                 "self-attention; this is cross-attention")  # fmt: skip
            if cache is not None and cache.length:
                q, _ = self._normed(self.queries(x), None)
                k, v = cache.stored()  # the context does not change while decoding
            else:
                k, v = self.keys_values(context)
                q, k = self._normed(self.queries(x), k)
                v = self.split_heads(v, self.num_kv_heads)
                if cache is not None:
                    cache.update(k, v)
        if key_padding_mask is not None:
            padding = key_padding_mask.to(torch.bool)[:, None, None, :]  # (B, 1, 1, Tk)
            mask = padding if mask is None else mask & padding
        if edit is not None:
            mask = edit.mask(mask)
            q, k, v = head_edits.swapped(edit, q, k, v)
        # a window and chunks apply to self-attention only (cross-attention reads the context)
        window = self.window if context is None else None
        chunk = self.chunk if context is None else None
        start = None  # where each row's chunks begin: its first real key, past left padding
        if chunk is not None and key_padding_mask is not None:
            start = (key_padding_mask.to(torch.long).cumsum(-1) == 0).sum(-1)
        query_scale = None
        if self.temperature is not None and context is None:
            query_scale = self.temperature.of(positions).to(q.dtype).reshape(-1, T)
        attended = attend_for_record(
            q, k, v, mask=mask, causal=causal, scale=self.scale, window=window, chunk=chunk,
            chunk_start=start, softcap=self.softcap, bias=bias, sinks=self.sinks,
            query_scale=query_scale, backend=self.backend, weights=weights_into,
        )  # fmt: skip
        out = attended.out
        gate = None  # (B, T, H*D): what the layer multiplies its heads' outputs by (Qwen3.5)
        if self.gate is not None:
            gate = torch.sigmoid(project(self.gate, x))
        kept = None  # (B, H, T, D) out, and the rest, as attend saw them
        if record:
            kept = AttentionRecord(
                q, k, v, out, mask, causal, self.scale, self.backend, attended.lse, q_plain,
                k_plain, window, self.softcap, bias, attended.made, _detached(self.sinks),
                chunk, start, query_scale,
                output_gate=None if gate is None else self.split_heads(gate, self.num_heads),
            )  # fmt: skip
        if edit is not None:  # the record keeps what attend returned; the edits come after
            out = edit.head_outputs(head_edits.with_weights(edit, out, v))
        concatenated = out.transpose(1, 2).reshape(B, T, -1)  # heads side by side (B, T, H*D)
        if gate is not None:  # after an edit: the gate is the layer's, not the head's
            concatenated = concatenated * gate
        out = project(self.out, concatenated)  # (B, T, C)
        return out, kept


def l2_norm(x: Tensor, eps: float) -> Tensor:
    """x / sqrt(mean(x^2) + eps) over the last dimension, computed in float32, with no weight
    (Llama 4's QK-norm)."""
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).type_as(x)


def _detached(t: Tensor | None) -> Tensor | None:
    """A parameter as a record keeps it: its values, not its gradient's graph."""
    return None if t is None else t.detach()
