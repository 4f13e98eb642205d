"""The pairs a page takes apart ahead (`qkv.why`), for its "why" panel.

A page is one file with no server behind it, so it can only show a `Why` computed when it
was written. Each costs a forward pass and its checks' reruns (about 0.1-0.5 s on MiniLM), so
a page holds a bounded set: in the head it opens on, each of the first PAGE_WHYS query tokens
with the key it attends to most, each with PAGE_CHECKS parts of each side removed for real.
Any other pair's panel says it was not taken apart and lists those that were (`qkv serve`
takes any pair apart on click).

Example, with a real model::

    minilm = qkv.load("minilm")
    seen = minilm.attentions("The bank on the side of the river")
    whys = page_whys(minilm.model, seen, (2, 11))   # the page's `whys=`
"""

from __future__ import annotations

from qkv.inspect.why import encoded_why

PAGE_WHYS = 12  # query tokens a page takes apart ahead, each with its strongest key
PAGE_CHECKS = 1  # parts of each side removed for real, per pair
SHOWN_PARTS = 5  # each side's largest parts the panel lists
TOP_TERMS = 10  # the largest terms the panel lists


def page_whys(
    model, seen, head: tuple[int, int], *, count: int = PAGE_WHYS, checks: int = PAGE_CHECKS
) -> dict:
    """The page's "whys": {"layer", "head" (the page's, counted in the layers and heads it
    holds), "count", "checks", "pairs": each `Why.to_dict` without what the page holds already
    (the tokens, the parts' names, the grid of terms), "refused": why none could be taken
    apart (a linear layer computes no score), or None}.

    model: the Encoder or Decoder that made `seen` (an `Attentions` over one text); head:
    (layer, head) of the page, where each of the first `count` query tokens is taken apart
    with the key it attends to most there.
    """
    layer, shown = head
    weights = seen.weights[layer, shown]  # (T, T)
    pairs, refused = [], None
    for query in range(min(count, weights.shape[0])):
        key = int(weights[query].nan_to_num(-1.0).argmax())
        try:
            found = encoded_why(model, seen.encoded, query, key, layer=seen.layers[layer],
                                head=seen.heads[shown], checks=checks)  # fmt: skip
        except ValueError as error:  # e.g. a linear layer: no score between two words
            pairs, refused = [], str(error)
            break
        pairs.append(_compact(found.to_dict(TOP_TERMS)))
    return {"layer": layer, "head": shown, "count": count, "checks": checks, "pairs": pairs,
            "refused": refused}  # fmt: skip


def _compact(answer: dict) -> dict:
    """What the panel reads of one `Why.to_dict`: not the tokens and names the page holds."""
    for name in ("terms", "tokens", "query_tokens", "parts_q", "parts_k", "text", "source"):
        answer.pop(name)
    answer["by_query_part"] = answer["by_query_part"][:SHOWN_PARTS]
    answer["by_key_part"] = answer["by_key_part"][:SHOWN_PARTS]
    return answer
