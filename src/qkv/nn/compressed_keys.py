"""What a record of compressed attention attended over: recent words, and entries that each
stand for a block of words, chosen or not by an indexer (DeepSeek-V4's CSA and HCA).

A layer of compressed attention attends over R raw keys (the words of its sliding window,
one column each) and then N compressed entries: entry n pools a block of words into one key
and value by the layer's compressor, a softmax per channel over the block's slots. In CSA a
"lightning indexer" scores every entry for every query and keeps its top k; the others are
masked. `CompressedKeys` keeps which record column is which, each entry's block and the
compressor's coefficients, and the indexer's scores and choice, so that a weight on an entry
can be spread over its words (`on_words`) and a word with no weight can say why (`why_zero`).

>>> import torch
>>> keys = CompressedKeys(word_positions=torch.tensor([2, 3]), query_positions=torch.tensor([3]),
...     blocks=torch.tensor([[0, 1]]), coefficients=torch.tensor([[[0.25, 0.75]]]), rate=2,
...     window=2)
>>> keys.on_words(torch.tensor([[[[0.25, 0.25, 0.5]]]])).tolist()  # (B, H, Tq, words)
[[[[0.125, 0.375, 0.25, 0.25]]]]
>>> keys.why_zero(query=0, word=1) is None  # it has weight, through entry 0
True
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True, eq=False)
class CompressedKeys:
    """Which of a record's key columns are words and which compressed entries.

    word_positions (R,): the token position of each of the first R key columns (raw words).
    query_positions (Tq,): the token position of each query.
    blocks (N, S): the token positions entry n pooled, slot by slot (S = the rate m, or 2m
      where entries overlap, CSA's: the block before, then the entry's own); -1 for a slot
      with no token (entry 0's first half in CSA).
    coefficients (B, N, S): the compressor's weight of each slot in its entry. It takes a
      softmax over the slots for each channel of the entry; this is their mean over the
      channels, which sums to 1 over the slots as each channel's does (0 on a slot with no
      token).
    rate: m, the tokens between two entries. window: how many recent words the raw keys cover
      (a query sees the words at most window - 1 before it).
    scores (B, Tq, N): the indexer's score of every entry for every query, -inf where the
      entry's block is not complete at the query; None where there is no indexer (HCA: every
      complete entry is attended).
    chosen (B, Tq, N) bool: the entries the indexer chose for each query (its top k).
    top_k: the indexer's k; None without an indexer.
    """

    word_positions: Tensor
    query_positions: Tensor
    blocks: Tensor
    coefficients: Tensor
    rate: int
    window: int
    scores: Tensor | None = None
    chosen: Tensor | None = None
    top_k: int | None = None

    @property
    def num_words(self) -> int:
        """How many words the keys reach: every word up to the last query."""
        return int(self.query_positions.max()) + 1

    @property
    def ready(self) -> Tensor:
        """(Tq, N) bool: whether entry n's block is complete at each query (its last token
        at or before the query), so the query may attend to it."""
        entries = torch.arange(self.blocks.shape[0], device=self.blocks.device)
        return entries[None, :] < ((self.query_positions + 1) // self.rate)[:, None]

    def on_words(self, weights: Tensor) -> Tensor:
        """Weights over the record's keys (B, H, Tq, R + N) -> over the words (B, H, Tq, L):
        a raw key's weight goes to its word, an entry's is spread over its block by the
        compressor's coefficients. The words' weights sum to the keys' weights."""
        B, H, Tq, Tk = weights.shape
        R, (N, S) = self.word_positions.numel(), self.blocks.shape
        if Tk != R + N:
            raise ValueError(f"weights over {Tk} keys; this record has {R} words and {N} entries")
        out = weights.new_zeros(B, H, Tq, self.num_words)
        index = self.word_positions.to(weights.device).expand(B, H, Tq, R)
        out.scatter_add_(-1, index, weights[..., :R])
        if N:
            coefficients = self.coefficients.to(weights.dtype)[:, None, None]  # (B, 1, 1, N, S)
            spread = weights[..., R:, None] * coefficients  # (B, H, Tq, N, S)
            blocks = self.blocks.to(weights.device)
            real = (blocks >= 0).reshape(-1)
            index = blocks.reshape(-1)[real].expand(B, H, Tq, -1)
            out.scatter_add_(-1, index, spread.reshape(B, H, Tq, N * S)[..., real])
        return out

    def rank(self, query: int, entry: int, batch: int = 0) -> tuple[int, int]:
        """(r, n): entry's rank by the indexer's score among the n entries complete at the
        query (1 is the best)."""
        if self.scores is None:
            raise ValueError("this layer has no indexer: it attends every complete entry")
        row = self.scores[batch, query]
        ready = self.ready[query]
        better = (row[ready] > row[entry]).sum()
        return int(better) + 1, int(ready.sum())

    def why_zero(self, query: int, word: int, batch: int = 0) -> str | None:
        """Why the query gives the word no weight in this layer, in words; None where it
        does give it weight (in the window, or through an entry it attends)."""
        at = int(self.query_positions[query])
        if word > at:
            return f"word {word} comes after the query (position {at})"
        if at - word < self.window and bool((self.word_positions == word).any()):
            return None
        reasons = [f"word {word} is outside the window of {self.window} words before {at}"]
        entries = ((self.blocks == word) & (self.coefficients[batch] > 0)).any(-1).nonzero()
        if not entries.numel():
            return reasons[0] + " and in no compressed entry"
        for n in entries.flatten().tolist():
            first, last = self._span(n)
            block = f"entry {n} (words {first}..{last})"
            if not bool(self.ready[query, n]):
                reasons.append(f"{block} is not complete at the query")
            elif self.chosen is not None and not bool(self.chosen[batch, query, n]):
                r, of = self.rank(query, n, batch)
                reasons.append(f"{block} was not chosen by the indexer (rank {r} of {of}, "
                               f"top {self.top_k} chosen)")  # fmt: skip
            else:
                return None  # attended through this entry
        return "; ".join(reasons)

    def _span(self, entry: int) -> tuple[int, int]:
        block = self.blocks[entry]
        block = block[block >= 0]
        return int(block.min()), int(block.max())
