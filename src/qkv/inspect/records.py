"""Can a text's attention weights be redone from its layers' records? qkv's one rule.

Three readers redo weights from what a record keeps (q, k, v, the scale, the causal rule, the
score rules): `attention_vectors` with softmax(q k^T * scale) alone, `Attentions.vectors` with
the window too, and the `qkv show` page's script with every score rule. Each asks
`why_not_redone`, naming the score rules it applies, rather than keeping a list of its own.
"""

from __future__ import annotations

from collections.abc import Collection

# what a layer does to a pair's scaled scalar beyond the article, as a record names it: keys
# `window` or more tokens away hidden, Gemma 2's soft-cap, a bias such as T5's distances
SCORE_RULES = ("window", "softcap", "bias")


def why_not_redone(
    records: dict, *, cross: bool = False, applies: Collection[str] = SCORE_RULES
) -> str | None:
    """Why the weights of `records` (layer -> `AttentionRecord`) cannot be redone from their
    q, k, v and scale by a reader that knows the causal rule and the score rules in
    `applies` (of SCORE_RULES), or None where they can.

    No reader knows a mask (a padded batch) or more than one text. Without `cross` the
    records must be one text's self-attention; with it, one target's cross-attention over one
    source, which no causal rule or window hides (a reader would not know where a query sits
    among the keys).

    >>> why_not_redone({})
    """
    unknown = set(applies) - set(SCORE_RULES)
    assert not unknown, f"score rules are {SCORE_RULES}, not {sorted(unknown)}"
    for layer, record in sorted(records.items()):
        s = record.shape
        if getattr(record, "compressed", None) is not None:  # its mask is the indexer's too
            return f"layer {layer} {_late_rule(record)}"
        if record.mask is not None:
            return f"layer {layer} masks keys beyond the causal rule and the window"
        if s.B != 1:
            return f"layer {layer} holds {s.B} texts, not one"
        if not cross and s.Tq != s.Tk:
            return f"layer {layer} is not one text's self-attention"
        if cross and (record.causal or record.window is not None):
            return f"layer {layer} hides keys by position, which cross-attention does not"
        if record.softcap is not None and "softcap" not in applies:
            return f"layer {layer} caps its scores ({record.softcap:g} tanh(s/{record.softcap:g}))"
        if record.window is not None and "window" not in applies:
            return f"layer {layer} hides keys {record.window} or more tokens away (a window)"
        if record.bias is not None and "bias" not in applies:
            return f"layer {layer} adds a bias to its scores"
        beyond = _late_rule(record)
        if beyond is not None:
            return f"layer {layer} {beyond}"
    return None


def _late_rule(record) -> str | None:
    """What a record's layer does that no reader of q, k, v redoes: a learned sink, chunks,
    a temperature per query, a running memory instead of a softmax (each is in the record's own
    `weights()` and `steps()`), keys that are compressed entries (DeepSeek-V4's, in
    `compressed`)."""
    if getattr(record, "linear", None) is not None:
        return ("keeps a running memory (linear attention): its weights are effective weights, "
                "what the query reads of each value, not a softmax of q k^T")  # fmt: skip
    compressed = getattr(record, "compressed", None)
    if compressed is not None:
        if compressed.chosen is not None:
            return "attends over compressed entries chosen by an indexer"
        return "attends over compressed entries of its words"
    if getattr(record, "sinks", None) is not None:
        return "gives part of each query's weight to a learned sink"
    if getattr(record, "chunk", None) is not None:
        return f"hides keys outside each query's chunk of {record.chunk} tokens"
    if getattr(record, "query_scale", None) is not None:
        return "multiplies each query's scores by a temperature of its position"
    return None


def check_head_outputs(records: dict, what: str) -> None:
    """Refuse, by name, records whose `out` is not each head's output: absorbed latent
    attention's (its out is the attended latent vector, before the head's W_uv)."""
    for layer, record in sorted(records.items()):
        if getattr(record, "absorbed", False):
            raise ValueError(
                f"{what} reads each head's output, but layer {layer}'s record is of absorbed "
                "latent attention (its out is the attended latent vector, before W_uv); run "
                "the model with absorb=False on its latent layers"
            )
