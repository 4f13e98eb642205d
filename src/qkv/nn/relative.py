"""T5's relative positions: a learned number per head for how far a key is from its query.

Where learned and sinusoidal positions are added to the token vectors and rotary ones turn
the queries and keys, T5 adds to each attention score (query i, key j) a number read from a
small table: one column per head, one row per *bucket* of the distance j - i. Near
distances get a bucket each; farther ones share buckets whose width grows logarithmically
up to `max_distance`, past which every distance is the same bucket. An encoder tells
"before" from "after" (half the buckets each way); a decoder sees only keys before its
query, so all its buckets measure how far back.

The table lives in a stack's first layer in T5 checkpoints, but every layer of the stack
adds the same bias: the stack makes it once per forward pass and hands it to each block.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn


def relative_buckets(
    relative: Tensor, *, bidirectional: bool, num_buckets: int = 32, max_distance: int = 128
) -> Tensor:
    """The bucket (0 .. num_buckets-1) of each distance key - query, as Mesh TensorFlow's T5.

    >>> relative_buckets(torch.tensor([-3, -1, 0, 1, 3]), bidirectional=True, num_buckets=8,
    ...                  max_distance=16).tolist()
    [2, 1, 0, 5, 6]
    >>> relative_buckets(torch.tensor([-20, -3, 0, 2]), bidirectional=False, num_buckets=8,
    ...                  max_distance=16).tolist()  # a decoder: keys after the query are 0
    [7, 3, 0, 0]
    """
    buckets = torch.zeros_like(relative)
    if bidirectional:
        num_buckets //= 2
        buckets = buckets + (relative > 0).long() * num_buckets  # keys after: the upper half
        distance = relative.abs()
    else:
        distance = (-relative).clamp(min=0)  # how far back; keys after the query count as 0
    exact = num_buckets // 2  # half the buckets are one distance each
    # the other half: logarithmically wider bins up to max_distance (written as T5's code
    # does, in float32, so a distance lands in the same bucket as there)
    log_ratio = torch.log(distance.float() / exact) / math.log(max_distance / exact)
    far = exact + (log_ratio * (num_buckets - exact)).long()
    far = far.clamp(max=num_buckets - 1)
    return buckets + torch.where(distance < exact, distance, far)


class RelativePositionBias(nn.Module):
    """The score bias (1, H, Tq, Tk) of T5's relative positions, from a (num_buckets, H)
    table: for query i (after `offset` cached tokens) and key j, table[bucket(j - i)].

    >>> bias = RelativePositionBias(num_heads=4, bidirectional=True)
    >>> bias(3, 5, offset=2).shape
    torch.Size([1, 4, 3, 5])
    """

    def __init__(
        self, num_heads: int, *, bidirectional: bool, num_buckets: int = 32,
        max_distance: int = 128,
    ):  # fmt: skip
        super().__init__()
        if num_buckets < (4 if bidirectional else 2) or max_distance < 1:
            raise ValueError(
                f"relative positions need at least {4 if bidirectional else 2} buckets and a "
                f"max_distance >= 1, got {num_buckets} and {max_distance}"
            )
        self.bidirectional = bidirectional
        self.num_buckets, self.max_distance = num_buckets, max_distance
        self.table = nn.Embedding(num_buckets, num_heads)

    def forward(self, query_length: int, key_length: int, offset: int = 0) -> Tensor:
        """(1, H, Tq, Tk): queries are tokens offset .. offset+Tq-1, keys 0 .. Tk-1."""
        device = self.table.weight.device
        queries = torch.arange(offset, offset + query_length, device=device)[:, None]  # (Tq, 1)
        keys = torch.arange(key_length, device=device)[None, :]  # (1, Tk)
        buckets = relative_buckets(
            keys - queries, bidirectional=self.bidirectional, num_buckets=self.num_buckets,
            max_distance=self.max_distance,
        )  # fmt: skip
        return self.table(buckets).permute(2, 0, 1)[None]  # (Tq, Tk, H) -> (1, H, Tq, Tk)

    def extra_repr(self) -> str:
        kind = "bidirectional" if self.bidirectional else "causal"
        return f"{kind}, num_buckets={self.num_buckets}, max_distance={self.max_distance}"
