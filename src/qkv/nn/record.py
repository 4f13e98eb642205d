"""What one attention layer computed, kept as an output of its forward pass.

A `MultiHeadAttention` asked to keep its record returns an `AttentionRecord`: the q, k and v
its backend received (after rotary positions and whatever else the layer does to them), the
mask and the causal rule it applied, the scale, the backend's output per head and, from a
fused kernel that has one, the log-sum-exp. Every number qkv shows about attention is
computed from records by the functions here: the weights (`weights`), the article's steps
for one query (`steps`), so what a learner sees cannot drift from what the model computed,
and inspection needs no hooks, no second forward pass and no lock.

>>> import torch
>>> from qkv.nn import MultiHeadAttention
>>> mha = MultiHeadAttention(width=16, num_heads=4, num_kv_heads=2)
>>> out, record = mha(torch.randn(1, 5, 16), causal=True, record=True)
>>> record.weights([0, 3]).shape  # (B, heads asked, Tq, Tk)
torch.Size([1, 2, 5, 5])
>>> record.steps(head=3, query=1).pairs[2].allowed  # the causal mask hides key 2 from query 1
False
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from qkv.attention import attention_weights, loop, loop_memory
from qkv.attention.eager import compute_dtype, weights_into
from qkv.attention.flash.weights import weights_from_lse
from qkv.attention.inputs import (
    Shape,
    allowed_keys,
    check_indices,
    heads_of,
    select_heads,
    with_chunks,
    with_window,
)
from qkv.attention.linear import Memory, check_rule, effective_weights
from qkv.nn.compressed_keys import CompressedKeys


@dataclass(frozen=True, eq=False)
class AttentionRecord:
    """One attention call of one layer, exactly as its backend ran it.

    q (B, H, Tq, D), k and v (B, Hkv, Tk, D) as `attend` received them; out (B, H, Tq, D) as
    it returned them (before the heads are concatenated and projected); mask and causal as
    it applied them (see `allowed`); scale the factor on every dot product; lse (B, H, Tq)
    the log-sum-exp of each query's scaled scores, from a backend that returns it.
    q_before_rotary (B, H, Tq, D) and k_before_rotary (B, Hkv, Tq, D): in a layer with rotary
    positions, this call's queries and keys before they were turned (k: the new tokens only).
    window, softcap, bias, chunk, chunk_start, sinks, query_scale: the layer's variants, as
    `attend` takes them (a sliding window, Gemma 2's soft-cap, a bias added to the scores such
    as T5's relative positions, Llama 4's chunks and temperatures, gpt-oss's sinks). v and out
    are Dv wide where the layer's values differ in size from its keys (latent attention).
    linear: the layer keeps a running memory instead of a softmax (Qwen3.5's Gated DeltaNet,
    Kimi's KDA; `qkv.attention.linear`): each token's write strength and fade. q and k are as
    the rule read them (normalized, the scale not yet applied), out each head's read of the
    memory; `weights()` gives the effective weights, `steps()` the memory's steps.
    made (H, Tq, Tk): every head's weights, where the layer was asked to make them with its
    output (one sequence, `MultiHeadAttention`'s record=tensor); `weights` then reads them.
    compressed: where some keys are compressed entries (DeepSeek-V4), which are words and which
    entries, and what chose and made each (`CompressedKeys`: `on_words`, `why_zero`).
    """

    q: Tensor
    k: Tensor
    v: Tensor
    out: Tensor
    mask: Tensor | None
    causal: bool
    scale: float
    backend: str
    lse: Tensor | None = None
    q_before_rotary: Tensor | None = None
    k_before_rotary: Tensor | None = None
    window: int | None = None
    softcap: float | None = None
    bias: Tensor | None = None
    made: Tensor | None = None
    sinks: Tensor | None = None
    chunk: int | None = None
    chunk_start: Tensor | None = None
    query_scale: Tensor | None = None
    # the layer whose keys and values these are, where this layer has none of its own and
    # attends over an earlier layer's (Gemma 4's shared keys); None: the layer's own
    shared_from: int | None = None
    # latent attention with absorption (DeepSeek's decoding): q, k and v are the latent ones,
    # and `out` each head's attended latent vector, before its W_uv makes the head's output
    absorbed: bool = False
    linear: Memory | None = None
    compressed: CompressedKeys | None = None
    # (B, H, Tq, Dv): what the layer multiplies each head's output by after attention, before
    # the output projection (Qwen3.5's and Qwen3-Next's output gate, sigmoid(x W_g)); `out` is
    # before it
    output_gate: Tensor | None = None
    # (B, T, C) each, kept by the block that holds this layer: what its attention (after the
    # output projection and any out-norm) and its MLP added to the residual stream
    attn_out: Tensor | None = None
    mlp_out: Tensor | None = None

    @property
    def shape(self) -> Shape:
        (B, H, Tq, D), (Hkv, Tk), Dv = self.q.shape, self.k.shape[1:3], self.v.shape[3]
        return Shape(B, H, Hkv, Tq, Tk, D, None if Dv == D else Dv)

    @property
    def plain(self) -> bool:
        """Whether the scores are plain scaled dot products under the causal rule or none: no
        mask, window, chunk, soft-cap, bias, sink or temperature, no lse, no made weights and
        no compressed entries."""
        return all(
            getattr(self, name) is None
            for name in (
                "lse",
                "mask",
                "window",
                "softcap",
                "bias",
                "made",
                "sinks",
                "chunk",
                "query_scale",
                "linear",
                "compressed",
            )
        )

    def _variants(self) -> dict:
        return {"softcap": self.softcap, "sinks": self.sinks, "query_scale": self.query_scale}

    @property
    def allowed(self) -> Tensor:
        """(B or 1, H or 1, Tq, Tk) boolean: True where a query saw a key, the mask, the
        causal rule (aligned to the end of the keys, as in cached decoding), the window and
        the chunks combined."""
        s = self.shape
        allowed = allowed_keys(self.mask, self.causal, s.Tq, s.Tk, self.q.device, self.window,
                               self.chunk, self.chunk_start)  # fmt: skip
        if allowed is None:
            return torch.ones(1, 1, s.Tq, s.Tk, dtype=torch.bool, device=self.q.device)
        return allowed.reshape((1,) * (4 - allowed.dim()) + tuple(allowed.shape))

    def weights(self, heads: Sequence[int] | None = None) -> Tensor:
        """The attention weights (B, len(heads), Tq, Tk) of query heads `heads` (all if None),
        float32 (float64 for float64 inputs): what the `eager` backend computes, whichever
        backend ran. Rows sum to 1, or to 0 for a query that saw no key, or to 1 less the
        sink's share in a layer with learned sinks (`sink_weights`)."""
        s = self.shape
        chosen = check_indices("head", heads, s.H, "this layer")
        if self.linear is not None:
            return self._effective_weights(chosen)
        if self.made is not None:  # made by eager's arithmetic with the output
            return self.made[None] if heads is None else self.made[chosen][None]
        mask = with_window(self.mask, self.window, self.causal, s.Tq, s.Tk, self.q.device)
        mask = with_chunks(mask, self.chunk, self.chunk_start, s.Tq, s.Tk, self.q.device)
        if self.lse is not None:  # a fused kernel's lse: one product and an exp per weight
            q, k, mask, lse = select_heads(chosen, self.q, self.k, mask, self.lse)
            return weights_from_lse(q, k, lse, mask=mask, causal=self.causal, scale=self.scale)
        index = torch.tensor(chosen, device=self.q.device)
        q, k, mask = select_heads(chosen, self.q, self.k, mask)
        variants = self._variants()
        if self.sinks is not None:
            variants["sinks"] = self.sinks.index_select(0, index)
        return attention_weights(q, k, mask=mask, causal=self.causal, scale=self.scale,
                                 bias=heads_of(self.bias, index), **variants)  # fmt: skip

    def _effective_weights(self, chosen: list[int]) -> Tensor:
        """A linear layer's effective weights (B, len(chosen), Tq, Tk): signed, summing to
        anything, zero above the diagonal and where a mask hid a pair; weights @ v is `out`
        less what the queries read of a memory older than the record's first token. One head
        at a time, so that the float64 work beside the result is one head's."""
        s, memory = self.shape, self.linear
        mask = self.mask
        if mask is not None:
            mask = mask.expand(s.B, s.H, -1, -1)
        out = self.q.new_empty(s.B, len(chosen), s.Tq, s.Tk, dtype=compute_dtype(self.q.dtype))
        for n, head in enumerate(chosen):
            one = slice(head, head + 1)
            out[:, n : n + 1] = effective_weights(
                self.q[:, one], self.k[:, one], beta=memory.beta[:, one],
                decay=memory.decay[:, one], scale=self.scale,
                mask=None if mask is None else mask[:, one],
            )  # fmt: skip
        return out

    def sink_weights(self, heads: Sequence[int] | None = None) -> Tensor:
        """(B, len(heads), Tq): the weight each head's learned sink took from each query (what
        the words' weights fall short of 1); zeros in a layer without sinks."""
        weights = self.weights(heads)
        if self.sinks is None:
            return weights.new_zeros(weights.shape[:3])
        return (1.0 - weights.sum(dim=-1)).clamp(min=0.0)

    def weights_in(self, out: Tensor | None = None) -> Tensor:
        """Every head's weights of one text, (H, Tq, Tk) in the compute dtype, as `weights()[0]`
        gives them, written into `out` where it is given. A plain record (no log-sum-exp, mask,
        window, soft-cap or bias, no gradient to keep) has them computed in place, by eager's
        arithmetic, with no second copy beside them; any other is computed, then copied."""
        s = self.shape
        if out is None:
            out = self.q.new_empty(s.H, s.Tq, s.Tk, dtype=compute_dtype(self.q.dtype))
        if self.plain and s.B == 1 and not (torch.is_grad_enabled() and self.q.requires_grad):
            return weights_into(out, self.q, self.k, causal=self.causal, scale=self.scale)
        out.copy_(self.weights()[0])
        return out

    def steps(
        self, head: int, query: int, batch: int = 0
    ) -> loop.QuerySteps | loop_memory.MemorySteps:
        """The article's steps for one query of one head, by the `loop` backend (float64):
        every (query, key) pair's scalar, scaled scalar, weight and scaled value vector, under
        this record's own mask and scale. A linear layer's are `loop_memory.MemorySteps`: each
        key word's write into the memory and its effective weight."""
        s = self.shape
        (head,) = check_indices("head", [head], s.H, "this layer")
        (query,) = check_indices("query", [query], s.Tq, "this record")
        (batch,) = check_indices("batch", [batch], s.B, "this record")
        if self.linear is not None:  # no softmax: the memory's writes, walked back
            memory = self.linear
            rule = check_rule(self.q, self.k, self.v, memory.beta, memory.decay, self.scale,
                              memory.state, self.mask)  # fmt: skip
            return loop_memory.steps(rule, batch, head, query)
        allowed = self.allowed.expand(s.B, s.H, s.Tq, s.Tk)[batch, head, query].tolist()
        kv_head = head // s.group  # grouped-query attention: heads share keys and values
        k, v = self.k[batch, kv_head].double(), self.v[batch, kv_head].double()  # (Tk, D)
        query_vector = self.q[batch, head, query].double()  # (D,)
        bias = sink = temperature = None
        if self.bias is not None:
            bias = self.bias.double().expand(s.B, s.H, s.Tq, s.Tk)[batch, head, query]
        if self.sinks is not None:
            sink = self.sinks[head].double()
        if self.query_scale is not None:
            temperature = self.query_scale.double().expand(s.B, s.Tq)[batch, query]
        contextualized, pairs, sink_weight = loop.contextualize(
            query_vector, k, v, allowed, self.scale, self.softcap, bias, sink, temperature
        )
        return loop.QuerySteps(batch, head, query, query_vector, pairs, contextualized,
                               sink_weight)  # fmt: skip
