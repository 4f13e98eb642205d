"""The words every view of a trace shares, said once: what the query, key and value matrices
multiply, why cross-attention looks shifted, which token stands for a word of several.

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
    'its vector out of the encoder (the same in every layer)'
    """
    if role not in ("query", "key", "value"):
        raise ValueError(f"role must be 'query', 'key' or 'value', not {role!r}")
    if isinstance(layer, bool) or not isinstance(layer, int) or layer < 0:
        raise ValueError(f"layer must be a whole number from 0, not {layer!r}")
    if cross and role != "query":  # keys and values come from the encoder's last layer
        return f"{whose} vector out of the encoder (the same in every layer)"
    if cross:  # the decoder's cross-attention reads its stream after the layer's self-attention
        return f"{whose} vector in the decoder's layer {layer}, after that layer's self-attention"
    reader = f"{whose} vector"
    if layer == 0:
        return f"{reader} entering layer 0 (its embedding: the first layer)"
    before = "layer 0" if layer == 1 else f"layers 0-{layer - 1}"
    return f"{reader} entering layer {layer} (its embedding changed by {before})"


def multiplied_by_layer(num_layers: int, *, cross: bool = False) -> dict[str, list[str]]:
    """`multiplied` for every layer and role, as a page's data carries it: {role: [layer...]}."""
    return {r: [multiplied(r, layer, cross=cross) for layer in range(num_layers)] for r in ROLES}


def shifted_right(query_tokens: list[str]) -> str:
    """Why an encoder-decoder's cross-attention looks shifted by one: the decoder reads the
    target after its start token, and each row is where it writes the next token.

    >>> said = shifted_right(["</s>", "g", "f", "e"])
    >>> said[:64]
    'The decoder reads the target shifted right by one: row 0 is its '
    >>> said[said.index("(") :][:34]
    '(the row of "g" writes "f"), so a '
    """
    if len(query_tokens) < 2:
        raise ValueError("cross-attention's rows are the start token and the target's tokens: "
                         f"got {len(query_tokens)} row(s)")  # fmt: skip
    example = ""
    if len(query_tokens) >= 3:
        example = f' (the row of "{query_tokens[1]}" writes "{query_tokens[2]}")'
    return (
        f"The decoder reads the target shifted right by one: row 0 is its start token "
        f'"{query_tokens[0]}", and each row is where it writes the next target token{example}, '
        "so a row's weight falls on the source token of the word it is about to write, one "
        "place on from its own."
    )


def split_words(trace) -> list[str]:
    """A line for each word of several tokens in a trace (`qkv.inspect.trace.Trace`):
    which of its tokens stands for it ("riverbank" is traced at 'river')."""
    lines = []
    for role, word, span in (("query", trace.query, trace.query_span),
                             ("key", trace.key, trace.key_span)):  # fmt: skip
        if span is None or span[1] - span[0] < 2:
            continue
        tokens = trace.query_tokens if role == "query" and trace.query_tokens else trace.tokens
        parts = " ".join(repr(t) for t in tokens[span[0] : span[1]])
        lines.append(f'"{word}" is {span[1] - span[0]} tokens ({parts}, tokens {span[0]}-'
                     f"{span[1] - 1}): the {role} is its first, {tokens[span[0]]!r}, token "
                     f"{span[0]}.")  # fmt: skip
    return lines
