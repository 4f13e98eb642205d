"""DeepSeek-V4's attention: a sliding window over recent words, plus compressed entries.

Every layer's queries come through a low-rank step (C -> q_rank, normed, -> H heads, each
RMS-normalized without a gain); its one key head is also its value head (K = V). Both turn by
rotary positions on the last `rope_dims` channels of a head, in interleaved pairs; the output
turns back by the query's position. Each head has a learned sink, and the heads' outputs go
out through a grouped low-rank projection (G groups of heads, each to `out_rank`, then mixed).

Beside the window's raw keys, a compressed layer attends over entries that each pool a block
of m words (`Compressor`): one every m tokens, a softmax per channel over the block's words
(with a learned bias per slot), RMS-normed, turned by the position of the block's first word.
- CSA (m = 4): entries overlap (each pools its block and the one before) and a lightning
  `Indexer` chooses the top k entries for each query; the others are masked.
- HCA (m = 128): entries do not overlap; every complete entry is attended.
A query attends an entry only once its block is complete. The record keeps which key is
which (`CompressedKeys`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from qkv.attention import attend_for_record
from qkv.nn.compressed_keys import CompressedKeys
from qkv.nn.record import AttentionRecord
from qkv.nn.rope import RopeScaling, inv_freq


def rms(x: Tensor, eps: float, weight: Tensor | None = None) -> Tensor:
    """x / sqrt(mean(x^2) + eps) (times the gain), in float32 as transformers' V4 norms (float64
    for float64 inputs)."""
    h = x if x.dtype == torch.float64 else x.float()
    if weight is None:
        return x * torch.rsqrt(h.square().mean(-1, keepdim=True) + eps).to(x.dtype)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * h).to(x.dtype)


def _precision(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


class Norm(nn.Module):
    """An RMS norm with a gain (its `weight`)."""

    def __init__(self, width: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(width))

    def forward(self, x: Tensor) -> Tensor:
        return rms(x, self.eps, self.weight)


class InterleavedRotary(nn.Module):
    """Rotary positions on the last `dims` channels of a head, turning the pairs (2i, 2i+1)
    by angle position * freq_i; the other channels are left as they are."""

    def __init__(self, dims: int, base: float, scaling: RopeScaling | None = None):
        super().__init__()
        self.dims, self.base, self.scaling = dims, base, scaling
        self.register_buffer("inv_freq", self._inv_freq(), persistent=False)

    def reset_buffers(self) -> None:
        """Compute inv_freq again: a model built on the meta device has no values in it."""
        self.inv_freq = self._inv_freq()

    def _inv_freq(self) -> Tensor:
        with torch.device("cpu"):  # as RotaryEmbedding: on the CPU, then where the model is
            freq, self.factor = inv_freq(self.dims, self.base, self.scaling)
        return freq.to(torch.get_default_device())

    def cos_sin(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """positions (..., T) -> cos, sin (..., T, dims / 2)."""
        angles = positions[..., None].float() * self.inv_freq.to(positions.device)
        return (angles.cos() * self.factor).to(dtype), (angles.sin() * self.factor).to(dtype)

    @staticmethod
    def turn(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """x (B, H, T, D) turned by cos, sin (B or 1, T, dims / 2) on its last dims channels."""
        cos = cos.repeat_interleave(2, dim=-1).unsqueeze(1)
        sin = sin.repeat_interleave(2, dim=-1).unsqueeze(1)
        dims = cos.shape[-1]
        plain, rope = x[..., :-dims], x[..., -dims:]
        pairs = torch.stack((-rope[..., 1::2], rope[..., 0::2]), dim=-1).flatten(-2)
        precision = _precision(x.dtype)
        turned = (rope.to(precision) * cos + pairs.to(precision) * sin).to(x.dtype)
        return torch.cat([plain, turned], dim=-1)


@dataclass
class CompressorState:
    """What a compressor carries from one call to the next (in a cache): the tokens of the
    block not yet complete, the last block's first series (CSA), every entry so far and its
    coefficients."""

    kv: Tensor | None = None  # (B, t, series * D) projected tokens of the incomplete block
    gate: Tensor | None = None
    last_kv: Tensor | None = None  # (B, m, D) CSA: the last complete block's first series
    last_gate: Tensor | None = None
    entries: Tensor | None = None  # (B, N, D)
    coefficients: Tensor | None = None  # (B, N, S)
    count: int = 0  # entries made so far


class Compressor(nn.Module):
    """Tokens -> compressed entries, one per complete block of `rate` tokens.

    Entry n is sum over its slots s of softmax_s(gate_s + bias_s) * kv_s, channel by channel,
    then RMS-normed and turned by the position of its block's first token. With `overlap`
    (CSA) every token projects two series: the first counts in the next entry, the second in
    its own, so entry n pools 2m slots (block n - 1's first series, then block n's second).
    """

    def __init__(self, width: int, head_dim: int, rate: int, overlap: bool, eps: float):
        super().__init__()
        series = 2 if overlap else 1
        self.head_dim, self.rate, self.overlap = head_dim, rate, overlap
        self.kv = nn.Linear(width, series * head_dim, bias=False)
        self.gate = nn.Linear(width, series * head_dim, bias=False)
        self.position_bias = nn.Parameter(torch.zeros(rate, series * head_dim))
        self.norm = Norm(head_dim, eps)

    @property
    def slots(self) -> int:
        return 2 * self.rate if self.overlap else self.rate

    def blocks(self, count: int, device=None) -> Tensor:
        """(count, S) the token position of every slot of the first `count` entries."""
        first = torch.arange(count, device=device)[:, None] * self.rate
        slots = torch.arange(self.slots, device=device)[None, :]
        positions = first + slots - (self.rate if self.overlap else 0)
        return positions.clamp(min=-1)

    def forward(self, x: Tensor, rotary: InterleavedRotary, state: CompressorState) -> Tensor:
        """x (B, T, C), the new tokens -> every entry so far (B, N, D); `state` takes the new
        entries, their coefficients and what is left for the next call."""
        B, m, D = x.shape[0], self.rate, self.head_dim
        kv, gate = self.kv(x), self.gate(x)  # (B, T, series * D)
        first = state.count * m
        if state.kv is not None and state.kv.shape[1]:
            kv, gate = torch.cat([state.kv, kv], dim=1), torch.cat([state.gate, gate], dim=1)
        usable = (kv.shape[1] // m) * m
        state.kv, state.gate = kv[:, usable:], gate[:, usable:]
        n = usable // m
        if n:
            kv = kv[:, :usable].view(B, n, m, -1)
            gate = gate[:, :usable].view(B, n, m, -1) + self.position_bias  # (B, n, m, series*D)
            if self.overlap:
                kv, gate = self._overlapped(kv, gate, state)  # (B, n, 2m, D)
            # in float32 as transformers (float64 for float64 inputs)
            precision = _precision(kv.dtype)
            weights = gate.softmax(dim=2, dtype=precision).to(kv.dtype)  # (B, n, S, D)
            new = self.norm((kv * weights).sum(dim=2))  # (B, n, D)
            positions = (torch.arange(n, device=x.device) * m + first)[None].expand(B, -1)
            cos, sin = rotary.cos_sin(positions, new.dtype)
            new = rotary.turn(new.unsqueeze(1), cos, sin).squeeze(1)
            coefficients = weights.to(precision).mean(dim=-1)  # (B, n, S)
        else:
            new = kv.new_zeros(B, 0, D)
            coefficients = kv.new_zeros(B, 0, self.slots, dtype=_precision(kv.dtype))
        state.entries = new if state.entries is None else torch.cat([state.entries, new], 1)
        state.coefficients = (
            coefficients
            if state.coefficients is None
            else torch.cat([state.coefficients, coefficients], dim=1)
        )
        state.count += n
        return state.entries

    def _overlapped(self, kv: Tensor, gate: Tensor, state: CompressorState):
        """(B, n, m, 2D) -> (B, n, 2m, D): each entry's slots, block n - 1's first series
        (from the state for the first, none at the start: gate -inf) then block n's second."""
        B, n, m, D = *kv.shape[:3], self.head_dim
        slots_kv = kv.new_zeros(B, n, 2 * m, D)
        slots_gate = gate.new_full((B, n, 2 * m, D), float("-inf"))
        slots_kv[:, :, m:], slots_gate[:, :, m:] = kv[..., D:], gate[..., D:]
        if n > 1:
            slots_kv[:, 1:, :m], slots_gate[:, 1:, :m] = kv[:, :-1, :, :D], gate[:, :-1, :, :D]
        if state.last_kv is not None:
            slots_kv[:, 0, :m], slots_gate[:, 0, :m] = state.last_kv, state.last_gate
        state.last_kv, state.last_gate = kv[:, -1, :, :D].clone(), gate[:, -1, :, :D].clone()
        return slots_kv, slots_gate


class Indexer(nn.Module):
    """The lightning indexer: scores every compressed entry for every query and keeps the top
    k. It compresses the tokens itself (a compressor of its own, CSA's overlapping kind, of
    head size `head_dim`); a query's score of entry n is sum over the indexer's heads h of
    w_h * relu(q_h . k_n) / sqrt(head_dim), w = a projection of the token / sqrt(heads)."""

    def __init__(self, width: int, q_rank: int, heads: int, head_dim: int, rate: int,
                 top_k: int, eps: float):  # fmt: skip
        super().__init__()
        self.heads, self.head_dim, self.rate, self.top_k = heads, head_dim, rate, top_k
        self.compressor = Compressor(width, head_dim, rate, overlap=True, eps=eps)
        self.q = nn.Linear(q_rank, heads * head_dim, bias=False)
        self.head_weights = nn.Linear(width, heads, bias=False)

    def forward(self, x: Tensor, q_low: Tensor, positions: Tensor, rotary: InterleavedRotary,
                state: CompressorState) -> tuple[Tensor, Tensor]:  # fmt: skip
        """x (B, T, C), q_low (B, T, q_rank), positions (1, T) -> scores (B, T, N), -inf where
        an entry is not complete at the query, and the chosen entries (B, T, k), -1 where
        fewer than k are complete. transformers' steps, in its order."""
        B, T, _ = x.shape
        keys = self.compressor(x, rotary, state)  # (B, N, Dh)
        cos, sin = rotary.cos_sin(positions, x.dtype)
        q = self.q(q_low).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, Hi, T, Dh)
        q = rotary.turn(q, cos, sin).transpose(1, 2)  # (B, T, Hi, Dh)
        scores = torch.matmul(q.float(), keys.transpose(-1, -2).float().unsqueeze(1))
        scores = F.relu(scores) * self.head_dim**-0.5  # (B, T, Hi, N)
        weights = self.head_weights(x).float() * self.heads**-0.5  # (B, T, Hi)
        scores = (scores * weights.unsqueeze(-1)).sum(dim=2)  # (B, T, N)
        N = keys.shape[1]
        k = min(self.top_k, N)
        if not N:
            return scores, scores.topk(k, dim=-1).indices
        complete = (positions + 1) // self.rate  # (1, T): entries complete at each query
        future = torch.arange(N, device=x.device).view(1, 1, -1) >= complete.unsqueeze(-1)
        scores = scores.masked_fill(future, float("-inf"))
        top = scores.topk(k, dim=-1).indices  # (B, T, k)
        return scores, torch.where(top >= complete.unsqueeze(-1), -1, top)


@dataclass(frozen=True)
class Compression:
    """How a layer compresses its keys: blocks of `rate` tokens; with `top_k` (CSA), entries
    overlap and an indexer of `index_heads` heads of `index_head_dim` keeps k per query;
    without (HCA), entries do not overlap and every complete one is attended."""

    rate: int
    top_k: int | None = None
    index_heads: int = 0
    index_head_dim: int = 0


@dataclass
class CompressedCache:
    """One layer's cache: the window's last keys (the token before the next is the
    window's newest), and each compressor's state."""

    keys: Tensor | None = None  # (B, 1, <= window - 1, D)
    positions: Tensor | None = None  # (<= window - 1,) their token positions
    length: int = 0
    compressor: CompressorState = field(default_factory=CompressorState)
    indexer: CompressorState = field(default_factory=CompressorState)


class CompressedAttention(nn.Module):
    """DeepSeek-V4's attention (see the module's docstring): x (B, T, C) -> (B, T, C)."""

    def __init__(self, width: int, num_heads: int, head_dim: int, q_rank: int, out_groups: int,
                 out_rank: int, window: int, eps: float, compression: Compression | None = None,
                 backend: str = "auto"):  # fmt: skip
        super().__init__()
        if num_heads % out_groups:
            raise ValueError(f"o_groups ({out_groups}) must divide the {num_heads} heads")
        self.num_heads, self.head_dim, self.window, self.eps = num_heads, head_dim, window, eps
        self.groups, self.compression, self.backend = out_groups, compression, backend
        self.q_a = nn.Linear(width, q_rank, bias=False)
        self.q_a_norm = Norm(q_rank, eps)
        self.q_b = nn.Linear(q_rank, num_heads * head_dim, bias=False)
        self.kv = nn.Linear(width, head_dim, bias=False)
        self.kv_norm = Norm(head_dim, eps)
        self.out_a = nn.Linear(num_heads * head_dim // out_groups, out_groups * out_rank,
                               bias=False)  # fmt: skip
        self.out_b = nn.Linear(out_groups * out_rank, width, bias=False)
        self.sinks = nn.Parameter(torch.zeros(num_heads))
        self.compressor = self.indexer = None
        if compression is not None:
            c = compression
            self.compressor = Compressor(width, head_dim, c.rate, c.top_k is not None, eps)
            if c.top_k is not None:
                self.indexer = Indexer(width, q_rank, c.index_heads, c.index_head_dim, c.rate,
                                       c.top_k, eps)  # fmt: skip

    def forward(self, x: Tensor, rotary: InterleavedRotary, positions: Tensor,
                cache: CompressedCache | None = None, record: bool = False
                ) -> tuple[Tensor, AttentionRecord | None]:  # fmt: skip
        """x (B, T, C) the new tokens at `positions` (T,), after the cache's -> (B, T, C) and
        the record of the call where asked."""
        B, T, _ = x.shape
        H, D = self.num_heads, self.head_dim
        at = positions[None]  # (1, T)
        cos, sin = rotary.cos_sin(at, x.dtype)
        q_low = self.q_a_norm(self.q_a(x))  # (B, T, q_rank)
        q = rms(self.q_b(q_low).view(B, T, H, D).transpose(1, 2), self.eps)  # (B, H, T, D)
        q = rotary.turn(q, cos, sin)
        kv = rotary.turn(self.kv_norm(self.kv(x)).view(B, T, 1, D).transpose(1, 2), cos, sin)
        state = cache if cache is not None else CompressedCache()
        word_positions = positions
        if state.keys is not None:
            kv = torch.cat([state.keys, kv], dim=2)  # (B, 1, Tk, D)
            word_positions = torch.cat([state.positions, positions])
        if cache is not None:
            first = max(kv.shape[2] - (self.window - 1), 0)  # what a later query can see
            cache.keys, cache.positions = kv[:, :, first:], word_positions[first:]
            cache.length += T
        distance = positions[:, None] - word_positions[None, :]  # (T, R)
        mask = ((distance >= 0) & (distance < self.window))[None, None]  # (1, 1, T, R)
        compressed = None
        if self.compressor is not None:
            entries, entry_mask, compressed = self._compressed(x, q_low, at, rotary, state)
            compressed = CompressedKeys(word_positions, positions, **compressed)
            kv = torch.cat([kv, entries.unsqueeze(1)], dim=2)  # (B, 1, R + N, D)
            mask = torch.cat([mask.expand(B, 1, T, -1), entry_mask], dim=-1)
        attended = attend_for_record(q, kv, kv, mask=mask, scale=D**-0.5, sinks=self.sinks,
                                     backend=self.backend)  # fmt: skip
        out = attended.out  # (B, H, T, D)
        kept = None
        if record:
            kept = AttentionRecord(q, kv, kv, out, mask, False, D**-0.5, self.backend,
                                   attended.lse, sinks=self.sinks.detach(),
                                   compressed=compressed)  # fmt: skip
        out = rotary.turn(out, cos, -sin).transpose(1, 2)  # (B, T, H, D): positions undone
        grouped = out.reshape(B, T, self.groups, -1)  # (B, T, G, H * D / G)
        weight = self.out_a.weight.view(self.groups, -1, grouped.shape[-1])  # (G, r, H*D/G)
        grouped = torch.einsum("btgi,gri->btgr", grouped, weight).flatten(2)  # (B, T, G * r)
        return self.out_b(grouped), kept

    def _compressed(self, x: Tensor, q_low: Tensor, at: Tensor, rotary: InterleavedRotary,
                    state: CompressedCache) -> tuple[Tensor, Tensor, dict]:  # fmt: skip
        """Every entry so far (B, N, D), which each query attends (B, 1, T, N), and what the
        record keeps of them."""
        c, compressor = self.compression, self.compressor
        entries = compressor(x, rotary, state.compressor)  # (B, N, D)
        B, N, T = entries.shape[0], entries.shape[1], at.shape[1]
        kept = dict(blocks=compressor.blocks(N, x.device), rate=c.rate, window=self.window,
                    coefficients=state.compressor.coefficients)  # fmt: skip
        if self.indexer is None:  # HCA: every entry whose block is complete at the query
            complete = (at[0] + 1) // c.rate  # (T,)
            mask = torch.arange(N, device=x.device)[None, :] < complete[:, None]  # (T, N)
            return entries, mask[None, None].expand(B, 1, T, N), kept
        scores, top = self.indexer(x, q_low, at, rotary, state.indexer)  # (B, T, N), (B, T, k)
        chosen = torch.zeros(B, T, N + 1, dtype=torch.bool, device=x.device)
        chosen.scatter_(-1, torch.where(top >= 0, top, N), True)
        chosen = chosen[..., :N]
        kept |= dict(scores=scores, chosen=chosen, top_k=c.top_k)
        return entries, chosen[:, None], kept
