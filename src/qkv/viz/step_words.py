"""What the query, key and value matrices multiply, in words: said once, read by every view.

The article's step 1 multiplies "the embedding" by the query matrix; in a stack of layers that
is only so in the first layer. After it, a layer's matrices multiply the vector entering that
layer: the embedding changed by every layer before. The CLI (`narrate`), the server's trace,
the report page and the notebook all take their words from `multiplied`, so none can say
"embedding" where the model read something else.
"""

from __future__ import annotations

from typing import Literal

Role = Literal["query", "key", "value"]
ROLES: tuple[Role, ...] = ("query", "key", "value")


def multiplied(role: Role, layer: int, *, cross: bool = False, whose: str = "its") -> str:
    """What layer `layer`'s `role` matrix multiplies, for a word called `whose`.

    >>> multiplied("query", 0)
    'its vector entering layer 0 (its embedding: the first layer)'
    >>> multiplied("key", 3, whose='"river"\\'s')
    '"river"\\'s vector entering layer 3 (its embedding changed by layers 0-2)'
    >>> multiplied("value", 2, cross=True)
    "the encoder's output for it (the same in every layer)"
    """
    if role not in ("query", "key", "value"):
        raise ValueError(f"role must be 'query', 'key' or 'value', not {role!r}")
    if isinstance(layer, bool) or not isinstance(layer, int) or layer < 0:
        raise ValueError(f"layer must be a whole number from 0, not {layer!r}")
    if cross and role != "query":  # keys and values come from the encoder's last layer
        return "the encoder's output for it (the same in every layer)"
    if cross:  # the decoder's cross-attention reads its stream after the layer's self-attention
        return f"the decoder's vector for it in layer {layer}, after that layer's self-attention"
    reader = f"{whose} vector"
    if layer == 0:
        return f"{reader} entering layer 0 (its embedding: the first layer)"
    before = "layer 0" if layer == 1 else f"layers 0-{layer - 1}"
    return f"{reader} entering layer {layer} (its embedding changed by {before})"


def multiplied_by_layer(num_layers: int, *, cross: bool = False) -> dict[str, list[str]]:
    """`multiplied` for every layer and role, as a page's data carries it: {role: [layer...]}."""
    return {r: [multiplied(r, layer, cross=cross) for layer in range(num_layers)] for r in ROLES}
