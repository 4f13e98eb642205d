"""Any record's weights on the words of its text: what every view that labels its columns by
tokens reads (`Attentions.weights`, the trace, the census, the pages).

A record's own `weights()` are over its keys. Most layers' keys are the words, one column
each; a layer of compressed attention (DeepSeek-V4's CSA and HCA, `record.compressed`) attends
over the words of its window and then over compressed entries, each pooling a block of words.
`on_words` gives such a record's weights on the words: an entry's weight spread over its
block by the compressor's coefficients. The compressor takes a softmax per channel, so a
word's share of an entry is its coefficient averaged over the channels: an attribution, not a
weight the layer computed, and every view that shows it says so (`compressed_words`).

>>> import torch
>>> from qkv.nn import MultiHeadAttention
>>> _, record = MultiHeadAttention(width=8, num_heads=2)(torch.randn(1, 3, 8), record=True)
>>> torch.equal(on_words(record), record.weights())  # keys that are words: as they are
True
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor


def on_words(record, heads: Sequence[int] | None = None) -> Tensor:
    """The weights (B, len(heads), Tq, words) of query heads `heads` (all if None) on the
    words: `record.weights(heads)`, with a compressed layer's entries spread over their
    words (`CompressedKeys.on_words`); a word's weight is then its own in the window plus its
    shares of the entries the query attended."""
    weights = record.weights(heads)
    compressed = getattr(record, "compressed", None)
    return weights if compressed is None else compressed.on_words(weights)


def key_words(record) -> int:
    """How many words `on_words` gives a column each (the record's keys where they are
    words)."""
    compressed = getattr(record, "compressed", None)
    return record.shape.Tk if compressed is None else compressed.num_words


def compressed_layers(records: dict) -> list[int]:
    """The layers (of layer -> record) that attend over compressed entries."""
    return [n for n, r in sorted(records.items()) if getattr(r, "compressed", None) is not None]


def compressed_words(records: dict) -> str | None:
    """What a view of `records`' weights on words says of its compressed layers; None where
    it has none."""
    layers = compressed_layers(records)
    if not layers:
        return None
    named = ", ".join(str(n) for n in layers)
    return (
        f"layer{'s' if len(layers) > 1 else ''} {named} attend over the words of a window and "
        "over compressed entries, each pooling a block of words: an entry's weight is shown on "
        "its words by the compressor's coefficients, averaged over channels (the compressor's "
        "softmax is per channel), an attribution; each entry's own weight is in the records' "
        "weights() and qkv explain"
    )
