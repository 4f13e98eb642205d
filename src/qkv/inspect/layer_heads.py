"""How many heads each layer has. Layers may differ: Qwen3.5's linear layers have 32 value
heads where its full-attention layers have 16, so every view reads each layer's own count
from here, and its (layer, head) tables are (L, Hmax) with NaN where a layer has fewer.

>>> from qkv.models import Decoder, DecoderConfig
>>> from qkv.nn import BlockConfig
>>> heads_per_layer(Decoder(DecoderConfig(vocab_size=9, num_layers=2, block=BlockConfig(8, 2))))
[2, 2]
>>> check_layer_head(3, 20, [32, 32, 32, 16], "qwen")
Traceback (most recent call last):
...
ValueError: head 20 is out of range: layer 3 of qwen has 16 heads (0-15)
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from qkv.attention.eager import compute_dtype
from qkv.attention.inputs import check_indices
from qkv.nn.delta import GatedDeltaNet
from qkv.nn.latent import LatentAttention


def attention_heads(attn) -> int:
    """The number of (query, or a linear layer's value) heads of one attention module."""
    if isinstance(attn, GatedDeltaNet):
        return attn.config.heads
    if isinstance(attn, LatentAttention):
        return attn.config.num_heads
    return attn.num_heads


def heads_per_layer(stack) -> list[int]:
    """Each layer's number of heads, read from its block's attention module."""
    return [attention_heads(block.attn) for block in stack.blocks]


def check_layer_head(layer: int, head, counts: Sequence[int], source: str) -> int:
    """`head` checked against `layer`'s own count (`counts[layer]`), refused by name."""
    try:
        (head,) = check_indices("head", [head], counts[layer], source)
    except ValueError as error:
        if "out of range" not in str(error):
            raise
        H = counts[layer]
        raise ValueError(f"head {head} is out of range: layer {layer} of {source} has {H} "
                         f"heads (0-{H - 1})") from None  # fmt: skip
    return head


def check_heads(heads, layers: Sequence[int], counts: Sequence[int], source: str) -> list[int]:
    """The heads asked of `layers` (every head of the layer with most for None), each of
    which one of the layers at least has: a head no asked layer has is refused by name."""
    most = max(counts[n] for n in layers)
    if heads is None:
        return list(range(most))
    chosen = check_indices("head", heads, max(counts), source)
    for head in chosen:
        if head >= most:
            which = layers[0] if len(layers) == 1 else max(layers, key=lambda n: counts[n])
            check_layer_head(which, head, counts, source)
    return chosen


def nan_grid(counts: Sequence[int], dtype=torch.float64) -> Tensor:
    """An (L, Hmax) table of zeros, NaN where a layer has fewer heads than Hmax."""
    H = max(counts)
    grid = torch.zeros(len(counts), H, dtype=dtype)
    for layer, count in enumerate(counts):
        grid[layer, count:] = float("nan")
    return grid


def weights_of(record, heads: Sequence[int]) -> Tensor:
    """The record's weights (H', Tq, Tk) of `heads` (first row of the batch), NaN planes for
    the heads the layer does not have."""
    H = record.shape.H
    have = [h for h in heads if h < H]
    if len(have) == len(heads):
        return record.weights(list(heads))[0]
    some = record.weights(have)[0] if have else None
    s = record.shape
    out = torch.full((len(heads), s.Tq, s.Tk), float("nan"), dtype=compute_dtype(record.q.dtype))
    if some is not None:
        out[[i for i, h in enumerate(heads) if h < H]] = some.to(out.dtype)
    return out
