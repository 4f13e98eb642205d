"""The article, literally: one (query word, key word) pair at a time, in float64.

Slow on purpose. Every other backend is tested against this one, and a reader can put
the article beside `contextualize` and find each of its steps, in order. The projections
("multiply the embedding vector by the query matrix") happen in the layer that calls
`attend`; here the query, key and value vectors arrive already made.

Everything is a float64 torch operation, so autograd through this loop is the trusted
gradient too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Unpack

import torch
from torch import Tensor

from qkv.attention.inputs import Call, Options, Shape, Variants, allowed_keys, check_call


@dataclass(frozen=True)
class PairStep:
    """One (query word, key word) pair: what the article computes for it, in order."""

    key_index: int
    key_vector: Tensor  # (D,) "multiply the key word's embedding by the key matrix"
    attention_scalar: Tensor  # () "dot product query vector and key vector"
    scaled_scalar: Tensor  # () "divide ... by the square root of the number of dimensions"
    # () what the softmax reads: the scaled scalar, times the query's temperature, soft-capped
    # and plus a bias where the model has them (Llama 4's temperature, Gemma 2's cap, T5's
    # relative positions); else the scaled scalar itself
    score: Tensor
    allowed: bool  # False where a mask hides this key from this query
    normalized_weight: Tensor  # () "normalize ... so that the attention scalars sum to 1"
    value_vector: Tensor  # (Dv,) "multiply the key word's embedding by the value matrix"
    scaled_value_vector: Tensor  # (Dv,) "multiply value vector by (normalized) attention scalar"


@dataclass(frozen=True)
class QuerySteps:
    """Every intermediate for one query word of one head: the article's steps 1-7."""

    batch: int
    head: int
    query_index: int
    query_vector: Tensor  # (D,) "multiply the query word's embedding by the query matrix"
    pairs: list[PairStep]  # one per key word, the query word itself included
    contextualized: Tensor  # (Dv,) "add all of the scaled value vectors together"
    # () the weight a learned sink took from this query (gpt-oss), None in a head without one:
    # the words' weights then sum to 1 - sink_weight
    sink_weight: Tensor | None = None

    @property
    def weights(self) -> Tensor:
        """(Tk,) the normalized weights of this query over every key; they sum to 1 (or 0), or
        to 1 - sink_weight in a head with a sink."""
        return torch.stack([p.normalized_weight for p in self.pairs])


def contextualize(
    query_vector: Tensor,
    key_vectors: Tensor,
    value_vectors: Tensor,
    allowed: list[bool],
    scale: float,
    softcap: float | None = None,
    bias: Tensor | None = None,
    sink: Tensor | None = None,
    temperature: Tensor | None = None,
) -> tuple[Tensor, list[PairStep], Tensor | None]:
    """One query word gets context from every key word. Vectors are float64.

    query_vector (D,), key_vectors (Tk, D) and value_vectors (Tk, Dv), allowed: Tk booleans.
    temperature (): each scaled scalar is multiplied by it; softcap: each score s becomes
    softcap * tanh(s / softcap); bias (Tk,): added to each score after that; sink (): one
    more score in the softmax. Returns the contextualized vector (Dv,), the steps of each
    pair, and the weight the sink took (None without one).
    """
    Tk, Dv = value_vectors.shape
    # Steps 1-3, for every key word (the query word itself included).
    attention_scalars = [torch.dot(query_vector, key_vectors[j]) for j in range(Tk)]
    # Side note: "divide each attention scalar by the square root of the number of
    # dimensions" (scale is 1/sqrt(D) unless the caller chose another).
    scaled_scalars = [s * scale for s in attention_scalars]
    # What some models do to a score before the softmax: warm or cool it by the query's
    # temperature, cap it, add a bias to it.
    scores = scaled_scalars
    if temperature is not None:
        scores = [s * temperature for s in scores]
    if softcap is not None:
        scores = [torch.tanh(s / softcap) * softcap for s in scores]
    if bias is not None:
        scores = [s + bias[j] for j, s in enumerate(scores)]

    # Step 4: normalize so the scalars of this query sum to 1 (softmax). Subtracting the
    # largest scalar first changes nothing mathematically and keeps exp() from overflowing.
    # A learned sink is one more score in the softmax, with no value behind it: it takes
    # its share of the weight, and the words share what is left.
    scalars_allowed = list(zip(scores, allowed, strict=True))
    visible = [s for s, ok in scalars_allowed if ok]
    zero = query_vector.new_zeros(())
    sink_weight = None
    if visible or sink is not None:
        largest = torch.stack(visible + ([] if sink is None else [sink])).max()
        exps = [torch.exp(s - largest) if ok else zero for s, ok in scalars_allowed]
        sink_exp = zero if sink is None else torch.exp(sink - largest)
        total = sum(exps) + sink_exp
        weights = [e / total for e in exps]
        sink_weight = None if sink is None else sink_exp / total
    else:  # a query that may see no key gets nothing: zeros, not 0/0
        weights = [zero for _ in range(Tk)]

    # Steps 5-6: value vector, scaled by the normalized weight.
    pairs = []
    for j in range(Tk):
        value_vector = value_vectors[j]
        pairs.append(
            PairStep(
                key_index=j,
                key_vector=key_vectors[j],
                attention_scalar=attention_scalars[j],
                scaled_scalar=scaled_scalars[j],
                score=scores[j],
                allowed=allowed[j],
                normalized_weight=weights[j],
                value_vector=value_vector,
                scaled_value_vector=weights[j] * value_vector,
            )
        )
    # Step 7: add the scaled value vectors together, and nothing else (not the original
    # embedding): this sum is the contextualized vector.
    contextualized = query_vector.new_zeros(Dv)
    for pair in pairs:
        contextualized = contextualized + pair.scaled_value_vector
    return contextualized, pairs, sink_weight


def steps(q: Tensor, k: Tensor, v: Tensor, **options: Unpack[Options]) -> list[QuerySteps]:
    """Run the article over every (batch, head, query) and keep every intermediate.

    Arguments as in `attend`. Returns B * H * Tq steps in (batch, head, query) order. (A real
    model's steps for one word pair are `qkv.trace`, which runs this on a layer's record.)

    >>> q = k = v = torch.eye(2).view(1, 1, 2, 2)
    >>> [round(w, 3) for w in steps(q, k, v)[0].weights.tolist()]
    [0.67, 0.33]
    """
    return _steps(q, k, v, check_call(q, k, v, **options))


def _steps(q: Tensor, k: Tensor, v: Tensor, call: Call) -> list[QuerySteps]:
    shape, variants = call.shape, call.variants
    allowed = allowed_keys(call.mask, call.causal, shape.Tq, shape.Tk, q.device)
    if allowed is None:
        allowed = torch.ones(1, 1, 1, 1, dtype=torch.bool, device=q.device)
    allowed = allowed.expand(shape.B, shape.H, shape.Tq, shape.Tk).tolist()
    q, k, v = q.double(), k.double(), v.double()
    bias, sinks, temperature = variants.bias, variants.sinks, variants.query_scale
    if bias is not None:
        bias = bias.double().expand(shape.B, shape.H, shape.Tq, shape.Tk)
    if temperature is not None:
        temperature = temperature.double().expand(shape.B, shape.Tq)
    found = []
    for b in range(shape.B):
        for h in range(shape.H):
            kv_head = h // shape.group  # grouped-query attention: heads share keys and values
            sink = None if sinks is None else sinks[h].double()
            for i in range(shape.Tq):
                contextualized, pairs, sink_weight = contextualize(
                    q[b, h, i], k[b, kv_head], v[b, kv_head], allowed[b][h][i], call.scale,
                    variants.softcap, None if bias is None else bias[b, h, i], sink,
                    None if temperature is None else temperature[b, i],
                )  # fmt: skip
                found.append(QuerySteps(b, h, i, q[b, h, i], pairs, contextualized, sink_weight))
    return found


def _contextualized(q: Tensor, v: Tensor, every: list[QuerySteps]) -> Tensor:
    B, H, Tq, _ = q.shape
    Dv = v.shape[-1]
    return torch.stack([s.contextualized for s in every]).view(B, H, Tq, Dv).to(q.dtype)


def forward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    mask: Tensor | None,
    causal: bool,
    scale: float,
    shape: Shape,
    **variants,
) -> Tensor:
    """Backend entry for the registry: inputs already checked (a window and chunks already in
    mask); variants: softcap, bias, sinks, query_scale, as `Variants` holds them."""
    call = Call(shape, scale, mask, causal, Variants(**variants))
    return _contextualized(q, v, _steps(q, k, v, call))


def attend(q: Tensor, k: Tensor, v: Tensor, **options: Unpack[Options]) -> Tensor:
    """The `loop` backend: (B, H, Tq, Dv) out, computed in float64, returned in q's dtype.
    Options as in `qkv.attend`."""
    return _contextualized(q, v, steps(q, k, v, **options))
