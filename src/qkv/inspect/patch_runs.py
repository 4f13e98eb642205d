"""What `patch` and `path_patch` share: pairs of texts read and checked, run in padded batches,
and scored at each row's last real token.

A pair set (`qkv.inspect.prompts.pairs_of`) is grouped by length into batches within a
budget (`prompts.groups`); each batch's texts are right-padded. A causal decoder's real
tokens never see the padding after them, so a padded row needs no mask and computes its real
tokens exactly as alone; the metric is read at each row's last real position. Every patched
run of a batch is one row per (cell, prompt), cell-major: row p * B + b is cell p of prompt b.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor

from qkv.inspect.metrics import Metric
from qkv.inspect.prompts import Pair, groups, metrics_for, padded, pairs_of
from qkv.inspect.records import check_head_outputs
from qkv.inspect.runs import MASK_BUDGET, decoder_logits, stack_of
from qkv.models import Decoder
from qkv.nn.attention import KVCache, MultiHeadAttention
from qkv.nn.edit import Edits


@dataclass
class PairText:
    """One pair as the model reads it: its texts, tokens (of equal length) and metric."""

    clean_text: str
    corrupt_text: str
    clean_tokens: list[str]
    corrupt_tokens: list[str]
    clean_ids: list[int]
    corrupt_ids: list[int]
    metric: Metric
    metric_ids: list[int]

    def to_dict(self) -> dict:
        return {
            "clean_text": self.clean_text,
            "corrupt_text": self.corrupt_text,
            "clean_tokens": self.clean_tokens,
            "corrupt_tokens": self.corrupt_tokens,
            "metric": self.metric.to_dict(),
        }


def read_pairs(pretrained, clean, corrupt, metric, verb: str) -> tuple[Decoder, list[PairText]]:
    """The decoder and the pairs: clean and corrupt are two texts, two lists paired by
    position, or a file of pairs (`pathlib.Path`, corrupt None). metric: one for every pair,
    a `list` of one per pair, or None where the file gives each line's (a line's own metric
    wins over the call's)."""
    stack = stack_of(pretrained)
    if not isinstance(stack, Decoder):
        raise ValueError(
            f"{verb} scores the next token, so it needs a decoder; {pretrained.source} is "
            f"{pretrained.family.name}"
        )
    pairs = pairs_of(clean, corrupt)
    given = metrics_for(metric, len(pairs))
    found = []
    for n, (pair, default) in enumerate(zip(pairs, given, strict=True)):
        found.append(_pair_text(pretrained, pair, default, n if len(pairs) > 1 else None))
    return stack, found


def _pair_text(pretrained, pair: Pair, default, n: int | None) -> PairText:
    which = "" if n is None else f"pair {n}: "
    spec = pair.metric if pair.metric is not None else default
    if spec is None:
        raise ValueError(f"{which}no metric: give metric= (e.g. 'diff: Mary, John'), or one "
                         "per line of the file (a third column, or a 'metric' field)")  # fmt: skip
    chosen = Metric.parse(spec)
    metric_ids = chosen.ids(pretrained.tokenizer)
    clean, corrupt = pretrained.encode(pair.clean), pretrained.encode(pair.corrupt)
    if len(clean.ids) != len(corrupt.ids):
        raise ValueError(
            f"{which}the clean text has {len(clean.ids)} tokens and the corrupted text "
            f"{len(corrupt.ids)}; patching copies positions into the same positions, "
            f"so give texts of equal token length (clean: {list(clean.tokens)}, "
            f"corrupted: {list(corrupt.tokens)})"
        )
    return PairText(pair.clean, pair.corrupt, list(clean.tokens), list(corrupt.tokens),
                    list(clean.ids), list(corrupt.ids), chosen, metric_ids)  # fmt: skip


@dataclass
class Batch:
    """Some of the pairs, right-padded to one length T."""

    index: list[int]  # each row's pair, in the call's order
    clean: Tensor  # (B, T) ids
    corrupt: Tensor  # (B, T)
    lengths: Tensor  # (B,) real tokens
    pairs: list[PairText]

    @property
    def last(self) -> Tensor:
        return self.lengths - 1  # (B,) where each row's metric is read

    @property
    def differ(self) -> Tensor:
        """(B,) each pair's first position whose token differs (its length where none does):
        before it the clean and corrupted runs are the same run, every activation equal."""
        same = (self.clean == self.corrupt).long().cumprod(dim=1)  # 1 until the first change
        return torch.minimum(same.sum(dim=1), self.lengths)

    @property
    def start(self) -> int:
        """The first position a patch can change in any row: the batch's runs keep the
        corrupted run's vectors, keys and values before it (at least the last token runs)."""
        return int(torch.minimum(self.differ, self.last).min())


def record_size(stack: Decoder) -> int:
    """About the elements one token of one row keeps in a forward that records every layer:
    its q, k, v and head outputs, what attention and the MLP added, the stream (8 C a layer)."""
    return 8 * stack.config.num_layers * stack.config.block.width


def batches_of(stack: Decoder, pairs: list[PairText], per_token: int) -> Iterator[Batch]:
    """The pairs in padded batches of (rows x longest x per_token) <= MASK_BUDGET."""
    lengths = [len(p.clean_ids) for p in pairs]
    for index in groups(lengths, per_token, MASK_BUDGET):
        chosen = [pairs[i] for i in index]
        clean, found = padded([p.clean_ids for p in chosen])
        corrupt, _ = padded([p.corrupt_ids for p in chosen])
        yield Batch(index, clean, corrupt, found, chosen)


@dataclass
class Forward:
    """One batched forward pass: the residual stream at every block's input and after the
    last (L + 1 tensors (B, T, C)), every layer's record, the logits at each row's last real
    token (B, vocab)."""

    inputs: list[Tensor]
    records: dict
    logits: Tensor


def forward(stack: Decoder, ids: Tensor, last: Tensor, verb: str) -> Forward:
    out = stack(ids, logits=False, layers="all", hidden_states=True)
    check_head_outputs(out.records, verb)
    rows = torch.arange(ids.shape[0])
    return Forward(out.hidden_states, out.records, decoder_logits(stack, out.hidden[rows, last]))


def final_logits(stack: Decoder, hidden: Tensor, last: Tensor) -> Tensor:
    """Logits (R, vocab) at each row's last real token of final vectors hidden (R, T, C)."""
    return decoder_logits(stack, hidden[torch.arange(hidden.shape[0]), last])


def scores(batch: Batch, logits: Tensor, clean: Tensor) -> Tensor:
    """Each pair's metric of logits (P * B, vocab), rows cell-major -> (P, B) float64.
    clean (B, vocab): the clean run's logits, for "kl"."""
    B = len(batch.index)
    per_cell = logits.view(-1, B, logits.shape[-1])  # (P, B, vocab)
    out = torch.empty(per_cell.shape[:2], dtype=torch.float64)
    for b, pair in enumerate(batch.pairs):
        out[:, b] = pair.metric.score(per_cell[:, b], pair.metric_ids, clean=clean[b])
    return out


def resumed_rows(stack: Decoder, batch: Batch, run: Forward, layer: int, edits: Edits,
                 cells: int) -> Tensor:  # fmt: skip
    """Final vectors (cells * B, T - start, C) at positions batch.start.. of `cells` copies
    of the batch's corrupted runs from `layer` on, with `edits` (row p * B + b: cell p of
    prompt b; their masks and vectors cover positions start.. only).

    A decoder's positions before `start` are the same in every patched run as in the
    corrupted one (no patch changes them: clean and corrupted runs agree there), so they are
    not run again: their keys and values come from the corrupted run's records, in the cache.
    """
    start, B = batch.start, batch.corrupt.shape[0]
    ids = batch.corrupt.repeat(cells, 1)  # (cells * B, T)
    if start == 0:
        begin = stack.resume_from(layer)  # a layer may read an earlier one's keys (Gemma 4)
        x = run.inputs[begin].repeat(cells, 1, 1)
        return stack(ids, edits=edits, resume=(begin, x), logits=False).hidden
    cache = stack.new_cache()
    if all(type(c) is KVCache for c in cache.layers):
        for n, record in run.records.items():  # layers before `layer` are not read: one row
            keys, values = (t[:, :, :start] for t in (record.k, record.v))  # (B, Hkv, start, D)
            if n < layer:
                keys, values = keys[:1].expand(cells * B, -1, -1, -1), values[:1].expand_as(keys)
            else:
                keys, values = per_cell(keys, cells), per_cell(values, cells)
            cache.layers[n] = KVCache.holding(keys, values)
    else:  # a latent or linear layer caches what no record keeps: the prefix is run again
        stack(ids[:, :start], cache=cache, logits=False)
    x = run.inputs[layer][:, start:].repeat(cells, 1, 1)  # (cells * B, T - start, C)
    return stack(ids[:, start:], edits=edits, resume=(layer, x), cache=cache, logits=False).hidden


def per_cell(values: Tensor, cells: int) -> Tensor:
    """A batch's tensor (B, ...) repeated for `cells` cells: (cells * B, ...), cell-major."""
    return values.repeat(cells, *([1] * (values.dim() - 1)))


def own_heads(stack: Decoder, what: str, layers) -> None:
    """Refuse, by name, layers whose heads have no queries, keys and values of their own that
    an edit can reach (latent and linear attention): `what` needs them."""
    lacking = [n for n in layers if not isinstance(stack.blocks[n].attn, MultiHeadAttention)]
    if lacking:
        kinds = sorted({type(stack.blocks[n].attn).__name__ for n in lacking})
        raise ValueError(
            f"{what} edits each head's own queries, keys, values or inputs, which only softmax "
            f"attention with its own q, k and v projections has; layers {lacking} are "
            f"{', '.join(kinds)}"
        )
