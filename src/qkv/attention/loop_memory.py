"""Linear attention, literally: one token at a time, in float64, every intermediate kept.

The oracle for `qkv.attention.linear`'s fast forms, as `loop` is for softmax attention, and
the steps a learner is shown for one query word of a linear layer. There is no softmax and no
score per pair: each token writes its value into a running memory under its key, every earlier
memory fades, and the query word reads the memory once. What each key word gave the query word
is still exact: its effective weight, found by walking the writes back from the query.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from qkv.attention.linear import Rule


@dataclass(frozen=True)
class MemoryStep:
    """One key word's write into the memory, and what the query word reads of it."""

    key_index: int
    key_vector: Tensor  # (Dk,) the key word's key, which its value is written under
    value_vector: Tensor  # (Dv,) the key word's value
    # () how strongly the key word writes: beta_j (0 where a mask hides it from this query)
    write_strength: Tensor
    fade: Tensor  # () or (Dk,): what every earlier memory is multiplied by at this word, g_j
    recalled: Tensor  # (Dv,) what the faded memory already held under the key, S^T k_j
    allowed: bool  # False where a mask hides this key from this query
    effective_weight: Tensor  # () a_tj: what the query reads of this value; signed, no softmax
    scaled_value_vector: Tensor  # (Dv,) effective_weight * value_vector


@dataclass(frozen=True)
class MemorySteps:
    """Every intermediate for one query word of one linear-attention head."""

    batch: int
    head: int
    query_index: int
    query_vector: Tensor  # (Dk,) the query word's query, scaled
    pairs: list[MemoryStep]  # one per key word up to the query word, itself included
    memory: Tensor  # (Dk, Dv) the memory the query word reads, S_t
    contextualized: Tensor  # (Dv,) S_t^T q_t: the sum of the scaled values, plus from_state
    from_state: Tensor  # (Dv,) what the query reads of a memory older than the record's tokens

    @property
    def weights(self) -> Tensor:
        """(T,) every key word's effective weight for this query: signed, summing to anything
        (zero for a key after the query)."""
        T = len(self.pairs)
        return (
            torch.stack([p.effective_weight for p in self.pairs]) if T else self.memory.new_zeros(0)
        )


def remember(
    query_vector: Tensor,
    key_vectors: Tensor,
    value_vectors: Tensor,
    write_strengths: Tensor,
    fades: Tensor,
    allowed: list[bool],
    state: Tensor | None = None,
) -> tuple[Tensor, Tensor, list[MemoryStep], Tensor]:
    """One query word reads a memory written by every key word up to it. Float64 vectors:
    query_vector (Dk,) already scaled; key_vectors (T, Dk) and value_vectors (T, Dv) of the
    words up to and including the query word; write_strengths (T,) beta; fades (T,) or (T, Dk)
    the factor g (not its log); allowed: T booleans; state (Dk, Dv) the memory before the first
    word, or None for an empty one. Returns (contextualized (Dv,), the memory (Dk, Dv), each
    key word's step, from_state (Dv,))."""
    T, Dv = value_vectors.shape
    Dk = key_vectors.shape[1]
    memory = query_vector.new_zeros(Dk, Dv) if state is None else state.clone()
    strengths, recalled = [], []
    for j in range(T):
        # Every earlier memory fades by g_j (per key channel: each row of the memory its own).
        fade = fades[j]
        memory = memory * (fade[:, None] if fade.dim() else fade)
        # Ask the memory what it already holds under this key word's key ...
        held = memory.T @ key_vectors[j]
        # ... and write the difference to its value under that key, with strength beta_j.
        strength = write_strengths[j] if allowed[j] else write_strengths[j] * 0
        memory = memory + strength * torch.outer(key_vectors[j], value_vectors[j] - held)
        strengths.append(strength)
        recalled.append(held)
    # The query word reads the memory: one product, no softmax.
    contextualized = memory.T @ query_vector

    # Which key word's value is in that read, and how much: walk the writes back from the
    # query. u is what the query asks of the memory as it was just after word j.
    u, weights = query_vector, [None] * T
    for j in reversed(range(T)):
        weights[j] = strengths[j] * torch.dot(key_vectors[j], u)
        fade = fades[j]
        u = fade * (u - weights[j] * key_vectors[j])
    from_state = query_vector.new_zeros(Dv) if state is None else state.T @ u
    steps = [
        MemoryStep(j, key_vectors[j], value_vectors[j], strengths[j], fades[j], recalled[j],
                   allowed[j], weights[j], weights[j] * value_vectors[j])
        for j in range(T)
    ]  # fmt: skip
    return contextualized, memory, steps, from_state


def steps(rule: Rule, batch: int, head: int, query: int) -> MemorySteps:
    """The steps of one query word of one head, from a checked call (`linear.check_rule`)."""
    q = rule.q[batch, head].double() * rule.scale
    k, v = rule.k[batch, head].double(), rule.v[batch, head].double()
    beta, fades = rule.beta[batch, head].double(), rule.g[batch, head].double().exp()
    if fades.shape[-1] == 1:
        fades = fades[:, 0]
    allowed = [True] * (query + 1)
    if rule.mask is not None:
        allowed = rule.mask[batch, head, query, : query + 1].tolist()
    state = None if rule.state is None else rule.state[batch, head].double()
    end = query + 1
    contextualized, memory, pairs, from_state = remember(
        q[query], k[:end], v[:end], beta[:end], fades[:end], allowed, state
    )
    return MemorySteps(batch, head, query, q[query], pairs, memory, contextualized, from_state)


def forward(rule: Rule) -> tuple[Tensor, Tensor]:
    """Every query word of every head by `remember`, float64: (out (B, H, T, Dv), the memory
    after the last token (B, H, Dk, Dv), as the last word read it with nothing hidden)."""
    B, H, T, Dk = rule.k.shape
    out = rule.q.new_zeros(B, H, T, rule.v.shape[3], dtype=torch.float64)
    final = rule.q.new_zeros(B, H, Dk, rule.v.shape[3], dtype=torch.float64)
    if rule.state is not None:
        final = rule.state.double().clone()
    for b in range(B):
        for h in range(H):
            for t in range(T):
                out[b, h, t] = steps(rule, b, h, t).contextualized
            if T:
                whole = Rule(rule.q, rule.k, rule.v, rule.beta, rule.g, rule.scale, rule.state,
                             None)  # fmt: skip
                final[b, h] = steps(whole, b, h, T - 1).memory
    return out, final
