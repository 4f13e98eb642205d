"""Batches for the three objectives, each a pure function of (seed, step, micro-batch).

Nothing here keeps a cursor: the batch of optimizer step s, micro-batch m is computed from
the seed and (s, m) alone. So the data position of a run is its step, a resumed run reads
exactly the batches an uninterrupted one would have, and every process of a distributed
run builds the same global batch and takes its own rows of it.

A batch is a dict of tensors; `labels` holds the token to predict at each position, or
IGNORE where there is nothing to predict (padding, unmasked tokens).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from qkv.io.run_config import RunConfig

IGNORE = -100  # a label that no loss counts, as in torch's cross_entropy


def generator(seed: int, *parts: int) -> torch.Generator:
    """A generator seeded from the run's seed and a position such as (step, micro)."""
    value = seed & 0xFFFF
    for part in parts:
        value = (value * 1_000_003 + part + 1) % (1 << 62)
    return torch.Generator().manual_seed(value)


@dataclass
class Examples:
    """Tokenized examples of a generated corpus: the inputs (and targets, for seq2seq)."""

    inputs: list[list[int]]
    targets: list[list[int]] | None = None  # seq2seq: the target sequences
    # masked objective: {position: label} always predicted, with the input left as it is
    fixed_labels: list[dict[int, int]] | None = None


class Batches:
    """The training and validation batches of a run.

    micro: sequences in one global micro-batch (batch_size / accumulate). For kind "text"
    `train`/`val` are TokenShards; for generated kinds, Examples.
    """

    def __init__(self, config: RunConfig, tokenizer, train, val):
        self.config, self.tokenizer = config, tokenizer
        self.train_data, self.val_data = train, val
        self.micro = config.train.batch_size // config.train.accumulate
        self.objective = config.objective
        self._epoch: tuple[int, Tensor] | None = None  # the current epoch's order, cached
        # markers ([CLS], [SEP], padding...) are never masked nor drawn as random tokens
        self.special_ids = torch.tensor(sorted(tokenizer.special_ids), dtype=torch.long)
        everything = torch.arange(tokenizer.vocab_size)
        self.ordinary_ids = everything[~torch.isin(everything, self.special_ids)]
        mask_token = tokenizer.special_tokens.get("mask_token")
        self.mask_id = None if mask_token is None else tokenizer.token_to_id(mask_token)
        self.pad_id = tokenizer.pad_id if tokenizer.pad_id is not None else 0

    # ------------------------------------------------------------------ public

    def train(self, step: int, micro: int) -> dict[str, Tensor]:
        """The global micro-batch `micro` of optimizer step `step` (both from 0)."""
        g = generator(self.config.train.seed, step, micro)
        if self.config.data.kind == "text":
            return self._from_shards(self.train_data, g)
        index = (step * self.config.train.accumulate + micro) * self.micro
        rows = self._order(range(index, index + self.micro))
        return self._from_examples(self.train_data, rows, g)

    def val(self, i: int) -> dict[str, Tensor]:
        """Validation batch i: the same batch every time it is asked for."""
        g = generator(self.config.train.seed, -1, i)
        if self.config.data.kind == "text":
            return self._from_shards(self.val_data, g)
        n = len(self.val_data.inputs)
        rows = [(i * self.micro + r) % n for r in range(self.micro)]
        return self._from_examples(self.val_data, rows, g)

    def val_batches(self) -> int:
        if self.config.data.kind == "text":
            return self.config.train.eval_batches
        n = len(self.val_data.inputs)
        return min(self.config.train.eval_batches, -(-n // self.micro))

    # ------------------------------------------------------------------ sources

    def _order(self, indices: range) -> list[int]:
        """Example indices for positions of the endless stream of shuffled epochs."""
        n = len(self.train_data.inputs)
        rows = []
        for position in indices:
            epoch, offset = divmod(position, n)
            if self._epoch is None or self._epoch[0] != epoch:
                order = torch.randperm(n, generator=generator(self.config.train.seed, -2, epoch))
                self._epoch = (epoch, order)
            rows.append(int(self._epoch[1][offset]))
        return rows

    def _from_shards(self, shards, g: torch.Generator) -> dict[str, Tensor]:
        context = self.config.model.context
        if self.objective == "causal":
            tokens = shards.sample(g, self.micro, context + 1)  # (B, T + 1)
            return {"input_ids": tokens[:, :-1], "labels": tokens[:, 1:].clone()}
        tokens = shards.sample(g, self.micro, context)  # (B, T)
        return self._masked(tokens, torch.ones_like(tokens, dtype=torch.bool), g)

    def _from_examples(self, data: Examples, rows: list[int], g) -> dict[str, Tensor]:
        ids, mask = _pad([data.inputs[r] for r in rows], self.pad_id)
        if self.objective == "masked":
            fixed = None if data.fixed_labels is None else [data.fixed_labels[r] for r in rows]
            return self._masked(ids, mask, g, fixed)
        if self.objective == "causal":
            labels = ids[:, 1:].masked_fill(~mask[:, 1:], IGNORE)
            return {"input_ids": ids[:, :-1], "attention_mask": mask[:, :-1], "labels": labels}
        # seq2seq: the decoder reads [start] + target and predicts target + [end]
        start = self.tokenizer.eos_id
        targets, target_mask = _pad([[start, *data.targets[r]] for r in rows], self.pad_id)
        ends, _ = _pad([[*data.targets[r], self.tokenizer.eos_id] for r in rows], self.pad_id)
        return {
            "source_ids": ids,
            "source_mask": mask,
            "target_ids": targets,
            "target_mask": target_mask,
            "labels": ends.masked_fill(~target_mask, IGNORE),
        }

    def _masked(
        self, ids: Tensor, mask: Tensor, g: torch.Generator, fixed: list[dict] | None = None
    ) -> dict[str, Tensor]:
        """BERT's masking: choose mask_prob of the real tokens to predict; of those, 80%
        become [MASK], 10% a random token, 10% stay as they are. `fixed` {position: label}
        per row: labels always predicted there, from the unchanged input."""
        if self.mask_id is None:
            raise ValueError("the masked objective needs a tokenizer with a mask token")
        candidates = mask & ~torch.isin(ids, self.special_ids)
        chosen = candidates & (torch.rand(ids.shape, generator=g) < self.config.data.mask_prob)
        labels = ids.masked_fill(~chosen, IGNORE)
        for row, positions in enumerate(fixed or ()):
            for position, label in positions.items():
                chosen[row, position], labels[row, position] = False, label
        fate = torch.rand(ids.shape, generator=g)
        pick = torch.randint(len(self.ordinary_ids), ids.shape, generator=g)
        random_ids = self.ordinary_ids[pick]
        inputs = torch.where(chosen & (fate < 0.8), self.mask_id, ids)
        inputs = torch.where(chosen & (fate >= 0.8) & (fate < 0.9), random_ids, inputs)
        return {"input_ids": inputs, "attention_mask": mask, "labels": labels}


def shard(batch: dict[str, Tensor], rank: int, world: int) -> dict[str, Tensor]:
    """This process's rows of a global batch: a contiguous 1/world of them."""
    if world == 1:
        return batch
    rows = next(iter(batch.values())).shape[0]
    if rows % world:
        raise ValueError(f"a micro-batch of {rows} sequences does not split over {world} processes")
    size = rows // world
    return {k: v[rank * size : (rank + 1) * size] for k, v in batch.items()}


def _pad(rows: list[list[int]], pad_id: int) -> tuple[Tensor, Tensor]:
    """Right-padded ids (B, T) and a mask (B, T), True for real tokens."""
    longest = max(len(r) for r in rows)
    ids = torch.full((len(rows), longest), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), longest), dtype=torch.bool)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = torch.tensor(row, dtype=torch.long)
        mask[i, : len(row)] = True
    return ids, mask
