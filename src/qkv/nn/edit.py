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
- `mlp`: the MLP's output zeroed at those positions, before it joins the stream (what
  `qkv.why` removes to check an MLP's part of a score).

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
class Edit:
    """The interventions in one layer; every field optional (None changes nothing).

    hide: boolean, broadcastable to (B, H, Tq, Tk): True where a query may not attend to a
      key, in addition to the layer's own mask.
    heads: boolean, broadcastable to (B, H, Tq, 1): the head outputs to replace (True).
    head_values: broadcastable to (B, H, Tq, D): what replaces them; None means zeros.
    positions: boolean, broadcastable to (B, T): positions of the block's output to replace.
    residual: broadcastable to (B, T, C): what replaces them.
    mlp: boolean, broadcastable to (B, T): positions whose MLP output is zeroed (True).
    """

    hide: Tensor | None = None
    heads: Tensor | None = None
    head_values: Tensor | None = None
    positions: Tensor | None = None
    residual: Tensor | None = None
    mlp: Tensor | None = None

    def __post_init__(self):
        for name in ("hide", "heads", "positions", "mlp"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, Tensor) or value.dtype != torch.bool):
                raise ValueError(f"Edit.{name} must be a boolean tensor (True = changed)")
        if self.head_values is not None and self.heads is None:
            raise ValueError("Edit.head_values needs Edit.heads: which heads they replace")
        if (self.positions is None) != (self.residual is None):
            raise ValueError("Edit.positions and Edit.residual go together")

    def mask(self, mask: Tensor | None) -> Tensor | None:
        """The layer's mask with the hidden pairs hidden too."""
        if self.hide is None:
            return mask
        allowed = ~self.hide
        return allowed if mask is None else mask & allowed

    def head_outputs(self, out: Tensor) -> Tensor:
        """Attention's output (B, H, T, D) with the chosen heads' replaced."""
        if self.heads is None:
            return out
        values = self.head_values
        values = out.new_zeros(()) if values is None else values.to(out.dtype)
        return torch.where(self.heads, values, out)

    def mlp_output(self, out: Tensor) -> Tensor:
        """An MLP's output (B, T, C) with the chosen positions' zeroed."""
        if self.mlp is None:
            return out
        return torch.where(self.mlp[..., None], out.new_zeros(()), out)

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
