"""What an intervention changes in one layer's forward pass: a question "what if" asked of
the model itself, not of a copy of it, and not through hooks.

A model's forward takes `edits`, a dict from a layer (counted from 0) to its `Edit`; each
layer applies its own where the article's steps happen, so an edit runs on every backend:

- `hide`: pairs a query may not attend to. It joins the layer's mask, so the softmax
  renormalizes over the remaining keys exactly as a padding mask would (and a query that
  sees no key at all gets a zero vector, as everywhere in `attend`).
- `heads` and `head_values`: head outputs replaced after attention, before the heads are
  concatenated and projected: zeros ablate a head, a mean mean-ablates it, another run's
  output patches it in.
- `positions` and `residual`: the residual stream after the block replaced at those
  positions (activation patching of the residual).
- `mlp` (and `mlp_values`): the MLP's output zeroed (or replaced) at those positions, before
  it joins the stream (what `qkv.why` removes to check an MLP's part of a score; patching of
  MLP outputs).
- `q`, `k`, `v` (`Swap`s): a head's queries, keys or values replaced as `attend` receives
  them (after norms and rotation), per query head: under grouped-query attention the shared
  key/value head is split by query head, so one query head's keys change and its group's
  others' do not.
- `weights` (a `Swap`): a head's attention weights replaced: its output is the given
  weights times its values (patching of the weights alone).
- `q_input`, `k_input`, `v_input` (B, T, H, C): added to the residual stream as each query
  head's query, key or value reads it (before the layer's norm), that head alone: path
  patching (a sender's change reaching one receiver's q, k or v only) and, as zeros with a
  gradient, edge attribution (the gradient of a metric by each head's own input).
- `head_add` (B, H, T, D) and `mlp_add` (B, T, C): added to head outputs and to the MLP's
  output: zeros with a gradient make the gradient of a metric by those activations.

The record a layer returns keeps what `attend` received and returned: a hidden pair is in
its mask (so `weights()` shows the hiding); a replaced head output is not in its `out`.

>>> import torch
>>> from qkv.nn import MultiHeadAttention
>>> mha = MultiHeadAttention(width=8, num_heads=2)
>>> hide = torch.zeros(1, 2, 3, 3, dtype=torch.bool)
>>> hide[:, :, 2, 0] = True  # query 2 may not see key 0, in both heads
>>> _, record = mha(torch.randn(1, 3, 8), edit=Edit(hide=hide), record=True)
>>> record.weights()[0, :, 2, 0].tolist()
[0.0, 0.0]
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True, eq=False)
class Swap:
    """Values replacing some of a tensor's: `where` (boolean, broadcastable to the tensor)
    True where `values` (broadcastable too) take the place of the layer's own."""

    where: Tensor
    values: Tensor

    def __post_init__(self):
        if not isinstance(self.where, Tensor) or self.where.dtype != torch.bool:
            raise ValueError("Swap.where must be a boolean tensor (True = replaced)")
        if not isinstance(self.values, Tensor):
            raise ValueError("Swap.values must be a tensor")

    def apply(self, x: Tensor) -> Tensor:
        return torch.where(self.where, self.values.to(x.dtype), x)


@dataclass(frozen=True, eq=False)
class Edit:
    """The interventions in one layer; every field optional (None changes nothing).

    hide: boolean, broadcastable to (B, H, Tq, Tk): True where a query may not attend to a
      key, in addition to the layer's own mask.
    heads: boolean, broadcastable to (B, H, Tq, 1): the head outputs to replace (True).
    head_values: broadcastable to (B, H, Tq, D): what replaces them; None means zeros.
    positions: boolean, broadcastable to (B, T): positions of the block's output to replace.
    residual: broadcastable to (B, T, C): what replaces them.
    mlp: boolean, broadcastable to (B, T): positions whose MLP output is replaced (True).
    mlp_values: broadcastable to (B, T, C): what replaces them; None means zeros.
    q: a Swap of the queries (B, H, Tq, D) attend receives; k, v: of the keys and values per
      query head (B, H, Tk, D), the shared key/value head split by query head.
    weights: a Swap of the attention weights (B, H, Tq, Tk): those heads' outputs become
      weights @ values.
    q_input, k_input, v_input: (B, T, H, C) added to the block's input x, before the layer's
      norm, as query head h's query / key / value reads it (head h alone; self-attention).
    head_add: broadcastable to (B, H, T, D), added to the head outputs after `heads`.
    mlp_add: broadcastable to (B, T, C), added to the MLP's output after `mlp`.
    """

    hide: Tensor | None = None
    heads: Tensor | None = None
    head_values: Tensor | None = None
    positions: Tensor | None = None
    residual: Tensor | None = None
    mlp: Tensor | None = None
    mlp_values: Tensor | None = None
    q: Swap | None = None
    k: Swap | None = None
    v: Swap | None = None
    weights: Swap | None = None
    q_input: Tensor | None = None
    k_input: Tensor | None = None
    v_input: Tensor | None = None
    head_add: Tensor | None = None
    mlp_add: Tensor | None = None

    def __post_init__(self):
        for name in ("hide", "heads", "positions", "mlp"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, Tensor) or value.dtype != torch.bool):
                raise ValueError(f"Edit.{name} must be a boolean tensor (True = changed)")
        if self.head_values is not None and self.heads is None:
            raise ValueError("Edit.head_values needs Edit.heads: which heads they replace")
        if (self.positions is None) != (self.residual is None):
            raise ValueError("Edit.positions and Edit.residual go together")
        if self.mlp_values is not None and self.mlp is None:
            raise ValueError("Edit.mlp_values needs Edit.mlp: which positions they replace")
        for name in ("q", "k", "v", "weights"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, Swap):
                raise ValueError(f"Edit.{name} is a Swap(where, values), not {type(value)}")
        for name in ("q_input", "k_input", "v_input"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, Tensor) or value.dim() != 4):
                raise ValueError(f"Edit.{name} must be a tensor (B, T, H, C)")

    @property
    def per_head(self) -> tuple[str, ...]:
        """The fields that change a head's own queries, keys, values, weights or inputs: what a
        layer must compute head by head (a layer that cannot refuses them by name)."""
        names = ("q", "k", "v", "weights", "q_input", "k_input", "v_input")
        return tuple(name for name in names if getattr(self, name) is not None)

    @property
    def inputs(self) -> dict[str, Tensor]:
        """The per-head input additions asked for: {"q" | "k" | "v": (B, T, H, C)}."""
        found = {"q": self.q_input, "k": self.k_input, "v": self.v_input}
        return {name: add for name, add in found.items() if add is not None}

    def refuse_per_head(self, layer: str) -> None:
        """Raise where a layer that computes no head's inputs apart is asked to."""
        if self.per_head:
            raise ValueError(
                f"{layer} does not take edits of a head's own queries, keys, values, weights or "
                f"inputs ({', '.join(self.per_head)}): only softmax attention layers with their "
                "own q, k and v projections (MultiHeadAttention) do"
            )

    def mask(self, mask: Tensor | None) -> Tensor | None:
        """The layer's mask with the hidden pairs hidden too."""
        if self.hide is None:
            return mask
        allowed = ~self.hide
        return allowed if mask is None else mask & allowed

    def head_outputs(self, out: Tensor) -> Tensor:
        """Attention's output (B, H, T, D) with the chosen heads' replaced, then head_add."""
        if self.heads is not None:
            values = self.head_values
            values = out.new_zeros(()) if values is None else values.to(out.dtype)
            out = torch.where(self.heads, values, out)
        return out if self.head_add is None else out + self.head_add.to(out.dtype)

    def mlp_output(self, out: Tensor) -> Tensor:
        """An MLP's output (B, T, C) with the chosen positions' replaced (zeroed by default),
        then mlp_add."""
        if self.mlp is not None:
            values = self.mlp_values
            values = out.new_zeros(()) if values is None else values.to(out.dtype)
            out = torch.where(self.mlp[..., None], values, out)
        return out if self.mlp_add is None else out + self.mlp_add.to(out.dtype)

    def block_output(self, x: Tensor) -> Tensor:
        """A block's output (B, T, C) with the chosen positions' replaced."""
        if self.positions is None:
            return x
        return torch.where(self.positions[..., None], self.residual.to(x.dtype), x)


Edits = dict[int, Edit]  # layer (counted from 0) -> what changes there


def check_edits(edits: Edits | None, num_layers: int) -> Edits:
    """The edits, each at a layer the model has; an empty dict for None."""
    if not edits:
        return {}
    for layer, edit in edits.items():
        if type(layer) is not int or not 0 <= layer < num_layers:
            raise ValueError(
                f"an edit is at layer {layer!r}; the model has layers 0 to {num_layers - 1}"
            )
        if not isinstance(edit, Edit):
            raise ValueError(f"the edit at layer {layer} is a {type(edit).__name__}, not an Edit")
    return edits
