"""Attention rollout and attention flow (Abnar and Zuidema, 2020, "Quantifying Attention Flow
in Transformers"): how much each output token draws on each input token across all layers,
from each layer's weights averaged over heads with the residual connection added. Part of the
census of heads (`qkv.inspect.census`, docs/heads.md), which re-exports these names.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from qkv.models import self_attention_stack

FLOW_MAX_TOKENS = 16  # flow is T^2 max-flows over an (L+1) x T graph: 16 tokens take seconds


def _with_residual(weights: Tensor) -> Tensor:
    """(L, T, T) or (L, H, T, T) weights -> (L, T, T) float64: heads averaged, then 0.5 W +
    0.5 I with each row renormalized, as in Abnar and Zuidema (2020)."""
    if not isinstance(weights, Tensor) or weights.dim() not in (3, 4):
        raise ValueError("weights must be (L, T, T) or (L, H, T, T) attention weights")
    W = weights.double()
    W = W.nanmean(1) if W.dim() == 4 else W  # (L, T, T); NaN: heads a layer lacks
    if W.shape[-1] != W.shape[-2]:
        raise ValueError(f"weights must be square (self-attention), got {tuple(W.shape[-2:])}")
    A = 0.5 * W + 0.5 * torch.eye(W.shape[-1], dtype=W.dtype)
    return A / A.sum(-1, keepdim=True)


def rollout(weights: Tensor) -> Tensor:
    """Attention rollout (T, T): A_{L-1} ... A_1 A_0 with A = 0.5 W + 0.5 I renormalized;
    row i is how much the last layer's token i draws on each input token.

    >>> rollout(torch.eye(2).expand(3, 2, 2)).tolist()  # every token keeps to itself
    [[1.0, 0.0], [0.0, 1.0]]
    """
    A = _with_residual(weights)
    out = A[0]
    for layer in A[1:]:  # the first layer applied first
        out = layer @ out
    return out


def flow(weights: Tensor) -> Tensor:
    """Attention flow (T, T): the maximum flow from output token i (after the last layer) to
    input token j in the layered graph whose edge from token i at layer l + 1 to token j at
    layer l has capacity A_l[i, j] (A as in `rollout`). T^2 max-flows (networkx): refused
    above FLOW_MAX_TOKENS tokens.

    >>> flow(torch.tensor([[[1.0, 0.0], [0.5, 0.5]]] * 2)).tolist()
    [[1.0, 0.0], [0.5, 0.75]]
    """
    A = _with_residual(weights)
    L, T, _ = A.shape
    if T > FLOW_MAX_TOKENS:
        raise ValueError(
            f"attention flow is {T}^2 max-flows over {L + 1} x {T} nodes; it computes "
            f"{FLOW_MAX_TOKENS} tokens at most (rollout has no limit)"
        )
    import networkx as nx  # an optional dependency, loaded only when flow is asked for
    from networkx.algorithms.flow import shortest_augmenting_path

    graph = nx.DiGraph()
    graph.add_nodes_from((layer, t) for layer in range(L + 1) for t in range(T))
    for layer in range(L):
        for i, j in torch.nonzero(A[layer] > 0).tolist():
            graph.add_edge((layer + 1, i), (layer, j), capacity=float(A[layer, i, j]))
    out = torch.zeros(T, T, dtype=torch.float64)
    for i in range(T):
        for j in range(T):
            out[i, j] = nx.maximum_flow_value(
                graph, (L, i), (0, j), flow_func=shortest_augmenting_path
            )
    return out


@dataclass
class TextRollout:
    """Rollout and flow over one text: row i is output token i, column j input token j."""

    tokens: list[str]
    rollout: Tensor  # (T, T)
    flow: Tensor | None  # (T, T); None when not asked for

    def to_dict(self) -> dict:
        return {"tokens": list(self.tokens), "rollout": self.rollout.tolist(),
                "flow": None if self.flow is None else self.flow.tolist()}  # fmt: skip


def text_rollout(pretrained, text: str, *, with_flow: bool = True) -> TextRollout:
    """Attention rollout and flow of `pretrained` over `text`, from one forward's records
    (an encoder-decoder's encoder). with_flow=False skips flow (and its token limit)."""
    self_attention_stack(pretrained.model, "the census", pretrained.source)
    if with_flow:  # refused before the forward, from the token count alone
        count = len(pretrained.encode(text).ids)
        if count > FLOW_MAX_TOKENS:
            raise ValueError(
                f"the text has {count} tokens; attention flow computes {FLOW_MAX_TOKENS} at "
                "most (ask for rollout alone above that)"
            )
    seen = pretrained.attentions(text)  # (L, H, T, T) weights
    for layer, record in sorted(seen.records.items()):
        if record.linear is not None:
            raise ValueError(
                f"rollout and flow read each layer's weights as shares that sum to 1; layer "
                f"{layer} keeps a running memory (linear attention), whose effective weights are "
                "signed and sum to anything"
            )
    weights = seen.weights
    return TextRollout(seen.tokens, rollout(weights), flow(weights) if with_flow else None)
