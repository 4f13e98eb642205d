"""Hyper-connections (DeepSeek-V4's manifold-constrained ones): the residual stream kept as n
parallel streams that each block reads a mix of and writes back into.

Before a block, a small projection of the n streams (flattened and RMS-normalized) gives
three mixes for each token: `pre` (n) collapses the streams into the block's input, `post`
(n) spreads the block's output back over them, `comb` (n x n) mixes the streams into each
other, projected to a doubly stochastic matrix (rows and columns summing to 1) by Sinkhorn's
alternating normalizations. After the block:
    streams = post * output + comb^T @ streams.
At the end of the stack, `HyperHead` collapses the streams into one vector per token.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def _flat_normed(streams: Tensor, eps: float) -> Tensor:
    """(B, T, n, C) -> (B, T, n * C) in float32, RMS-normalized without a gain."""
    flat = streams.flatten(2).float()
    return flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + eps)


class HyperConnection(nn.Module):
    """The mixes around one block: fn ((2 + n) n, n C), base ((2 + n) n) and scale (3,), the
    projection that makes pre, post and comb from the streams."""

    def __init__(self, width: int, streams: int, iterations: int, eps: float, norm_eps: float):
        super().__init__()
        self.streams, self.iterations, self.eps, self.norm_eps = streams, iterations, eps, norm_eps
        n = streams
        self.fn = nn.Parameter(torch.zeros((2 + n) * n, n * width))
        self.base = nn.Parameter(torch.zeros((2 + n) * n))
        self.scale = nn.Parameter(torch.ones(3))

    def forward(self, streams: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """streams (B, T, n, C) -> post (B, T, n), comb (B, T, n, n) and the block's input
        (B, T, C), the streams collapsed by pre."""
        n = self.streams
        mixes = F.linear(_flat_normed(streams, self.norm_eps), self.fn.float())  # (B, T, (2+n)n)
        pre, post, comb = mixes.split([n, n, n * n], dim=-1)
        pre_b, post_b, comb_b = self.base.split([n, n, n * n])
        pre_s, post_s, comb_s = self.scale.unbind(0)
        pre = torch.sigmoid(pre * pre_s + pre_b) + self.eps  # (B, T, n)
        post = 2 * torch.sigmoid(post * post_s + post_b)  # (B, T, n)
        comb = comb.view(*comb.shape[:-1], n, n) * comb_s + comb_b.view(n, n)
        comb = torch.softmax(comb, dim=-1) + self.eps  # (B, T, n, n)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + self.eps)
        for _ in range(self.iterations - 1):  # Sinkhorn: rows, then columns, to sum to 1
            comb = comb / (comb.sum(dim=-1, keepdim=True) + self.eps)
            comb = comb / (comb.sum(dim=-2, keepdim=True) + self.eps)
        collapsed = (pre.unsqueeze(-1) * streams).sum(dim=2).to(streams.dtype)  # (B, T, C)
        return post, comb, collapsed

    @staticmethod
    def merge(streams: Tensor, post: Tensor, comb: Tensor, output: Tensor) -> Tensor:
        """The streams after the block: post * output + comb^T @ streams, (B, T, n, C)."""
        dtype = streams.dtype
        mixed = torch.matmul(comb.to(dtype).transpose(-1, -2), streams)
        return post.to(dtype).unsqueeze(-1) * output.unsqueeze(-2) + mixed


class HyperHead(nn.Module):
    """The last collapse: streams (B, T, n, C) -> (B, T, C), weighted by sigmoid mixes of
    their own (fn (n, n C), base (n,), scale (1,))."""

    def __init__(self, width: int, streams: int, eps: float, norm_eps: float):
        super().__init__()
        self.eps, self.norm_eps = eps, norm_eps
        self.fn = nn.Parameter(torch.zeros(streams, streams * width))
        self.base = nn.Parameter(torch.zeros(streams))
        self.scale = nn.Parameter(torch.ones(1))

    def forward(self, streams: Tensor) -> Tensor:
        mixes = F.linear(_flat_normed(streams, self.norm_eps), self.fn.float())  # (B, T, n)
        pre = torch.sigmoid(mixes * self.scale.float() + self.base.float()) + self.eps
        return (pre.unsqueeze(-1) * streams).sum(dim=2).to(streams.dtype)
