"""Attention sinks, named where they show: a query's largest weight on the first token or a
special token ([CLS], [SEP], <s>, <|im_start|>).

Many heads of trained models put most of a query's weight on such a token when they have
nothing better to attend to: its value vector is small and carries little of the sentence, so
the weight is parked there, not used. A learner who sees "[CLS] 62%" should be told so; the
sentence is said only when the numbers show it (the top key is that token).
"""

from __future__ import annotations

import re
from collections.abc import Sequence

SPECIAL = re.compile(r"^(\[[A-Z]+\]|<[^<>\s]+>|<\|[^|]+\|>)$")  # [CLS], </s>, <|im_start|>
SAID = ("{token} (token {index}) takes {query}'s largest weight here, {weight}: an attention "
        "sink, a place heads park weight they do not need (the first or a special token, whose "
        "value carries little of the text)")  # fmt: skip


def is_sink(tokens: Sequence[str], index: int) -> bool:
    """The first token, or a special token by its name."""
    return index == 0 or bool(SPECIAL.match(tokens[index].strip()))


def sink_indices(tokens: Sequence[str]) -> list[int]:
    """Every position that counts as a sink: the first token and each special token."""
    return [i for i in range(len(tokens)) if is_sink(tokens, i)]


def sink_sentence(tokens: Sequence[str], weights: Sequence[float], query: str) -> str | None:
    """The sentence that names the sink where a query's largest weight is on one; None where
    the largest weight is on another token.

    >>> said = sink_sentence(["[CLS]", "the", "bank", "[SEP]"], [0.62, 0.1, 0.2, 0.08], '"bank"')
    >>> print(said[:60])
    "[CLS]" (token 0) takes "bank"'s largest weight here, 62.00%
    >>> sink_sentence(["[CLS]", "the", "bank"], [0.2, 0.5, 0.3], '"bank"') is None
    True
    """
    values = [float(w) for w in weights]
    if len(values) != len(tokens):
        raise ValueError(f"{len(values)} weights for {len(tokens)} tokens: give one each")
    top = max(range(len(values)), key=values.__getitem__)
    if not is_sink(tokens, top):
        return None
    return SAID.format(token=f'"{tokens[top]}"', index=top, query=query,
                       weight=f"{100 * values[top]:.2f}%")  # fmt: skip
