"""Ablate heads: what a head does, seen in what changes without it.

`ablate` silences heads (their outputs replaced by zeros or by their mean over reference
texts), each alone and all at once. It is an `Edit` the model's layers apply in their own
forward pass, on every backend, with the runs of a table resumed from the first changed layer
and batched (`qkv.inspect.runs`). Many prompts run in padded batches, each one's values kept
with their mean and interval; compare=False is one knockout, one forward pass.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar, Literal

import torch
from torch import Tensor

from qkv.attention.inputs import check_indices
from qkv.inspect.layer_heads import check_layer_head, heads_per_layer
from qkv.inspect.prompts import Spread
from qkv.inspect.runs import (
    NextTokens,
    Token,
    batches,
    changed,
    decoder_logits,
    encoded_prompts,
    forward_rows,
    grid_dict,
    head_size,
    next_tokens,
    number,
    padded_ids,
    prompt_groups,
    resumed_rows,
    run_rows,
    spreads_dict,
    spreads_of,
    stack_of,
    top_tokens,
)
from qkv.models import Decoder
from qkv.nn.edit import Edit
from qkv.views import Shown

# texts whose mean head outputs mean-ablation puts in a head's place, by default
REFERENCE = (
    "The bank of the river was muddy after the rain.",
    "She deposited her savings at the bank on Monday.",
    "A cat sat on the warm windowsill and watched the birds.",
    "The committee will announce its decision next week.",
    "He poured the coffee, opened the paper and read the news.",
    "Rivers carry water from the mountains to the sea.",
    "The old library keeps maps, letters and rare books.",
    "Prices rose again this year, and wages did not keep up.",
)


@dataclass(repr=False)
class Ablated(Shown):
    """Heads ablated: their outputs replaced by zeros or by their mean over reference texts,
    in one prompt or in each of several (the mean over them, with a bootstrap 95% interval).

    `states` has every head asked ablated at once, `clean_states` none (the first prompt's,
    (T, C)). `effect` (L, H) is each head ablated alone: the mean over every token of
    1 - cosine between its final vector with and without (NaN for heads not asked, and where
    a layer has fewer heads than H, the most any layer has), over several prompts the mean of
    each prompt's; `total` the same with all at once. `spreads` holds, by those names, each
    prompt's values, their mean and interval (`qkv.inspect.prompts.Spread`).

    compare=False (one knockout, no clean run): `clean_states` is None, `effect` and `total`
    are NaN, `spreads` is empty and `next` is None; `after` still holds the changed run's
    next tokens.
    """

    view: ClassVar[str] = "ablated"  # drawn by qkv.viz.notebook_interventions

    source: str
    text: str  # the first prompt
    tokens: list[str]  # its tokens
    mode: str
    heads: list[tuple[int, int]]  # (layer, head), counted from 0
    states: Tensor  # (T, C)
    clean_states: Tensor | None  # (T, C); None without the comparison
    effect: Tensor  # (L, H) float64
    total: float
    next: NextTokens | None = None  # decoders: after the last token, all heads ablated
    next_by_head: Tensor | None = None  # (L, H): the change of the clean top token's log-prob
    texts: list[str] = field(default_factory=list)  # every prompt
    # per-prompt values, mean and interval of effect, total, next_by_head and top_change
    spreads: dict[str, Spread] = field(default_factory=dict)
    after: list[Token] | None = None  # decoders: the first prompt's next tokens, heads ablated

    def ranked(self) -> list[tuple[int, int, float]]:
        cells = [(n, h, float(self.effect[n, h])) for n, h in self.heads]
        return sorted((c for c in cells if c[2] == c[2]), key=lambda c: -c[2])

    def to_dict(self) -> dict:
        """JSON-ready (see docs/ablate.md)."""
        return {
            "source": self.source,
            "text": self.text,
            "texts": self.texts,
            "tokens": self.tokens,
            "mode": self.mode,
            "heads": [list(h) for h in self.heads],
            "effect": grid_dict(self.effect),
            "total": number(self.total),
            "ranked": [{"layer": n, "head": h, "effect": e} for n, h, e in self.ranked()],
            "next": None if self.next is None else self.next.to_dict(),
            "next_by_head": None if self.next_by_head is None else grid_dict(self.next_by_head),
            "after": None if self.after is None else [vars(t) for t in self.after],
            # several prompts: each one's values, their mean and interval
            **({"spreads": spreads_dict(self.spreads)} if len(self.texts) > 1 else {}),
        }


def head_pairs(stack, heads, source: str) -> list[tuple[int, int]]:
    """(layer, head) pairs from "all", a list of pairs, or a list of layers (all their heads)."""
    L, counts = stack.config.num_layers, heads_per_layer(stack)  # each layer's own count
    if isinstance(heads, str):
        if heads != "all":
            raise ValueError(f"heads must be 'all' or (layer, head) pairs, got {heads!r}")
        return [(n, h) for n in range(L) for h in range(counts[n])]
    pairs = []
    for item in heads:
        if isinstance(item, int):
            (n,) = check_indices("layer", [item], L, source)
            pairs.extend((n, h) for h in range(counts[n]))
            continue
        if not isinstance(item, Sequence) or len(item) != 2:
            raise ValueError(f"a head is a (layer, head) pair, got {item!r}")
        (n,) = check_indices("layer", [item[0]], L, source)
        pairs.append((n, check_layer_head(n, item[1], counts, source)))
    pairs = sorted(set(pairs))
    if not pairs:
        raise ValueError("no head asked for; give (layer, head) pairs, or 'all'")
    return pairs


def mean_head_outputs(pretrained, stack, texts) -> list[Tensor]:
    """L tensors (H, D): each head's output averaged over every token of `texts` (a list of
    texts or a file, `texts_of`; D, each layer's head output size), in padded batches."""
    if isinstance(texts, str):
        raise ValueError("reference must be a list of texts (one at least), or a file")
    texts, encoded = encoded_prompts(pretrained, texts, "reference")
    lengths = [len(e.ids) for e in encoded]
    total: list[Tensor] = []
    with torch.inference_mode():
        for group in prompt_groups(stack, lengths):
            ids, mask = padded_ids(pretrained, stack, [encoded[p].ids for p in group])
            real = ids.new_zeros(ids.shape, dtype=torch.float64)  # (B, T): 1 at real tokens
            for row, p in enumerate(group):
                real[row, : lengths[p]] = 1
            clean = run_rows(stack, ids, mask, [lengths[p] for p in group], records=True)
            # (B, H, T, D) -> (H, D), real tokens only
            summed = [torch.einsum("bhtd,bt->hd", out.double(), real) for out in clean.head_outputs]
            total = summed if not total else [a + b for a, b in zip(total, summed, strict=True)]
    return [layer / sum(lengths) for layer in total]


def ablate(
    pretrained,
    text: str | Sequence[str] | Path,
    heads="all",
    *,
    mode: Literal["zero", "mean"] = "zero",
    reference: Sequence[str] | Path | None = None,
    compare: bool = True,
) -> Ablated:
    """Ablate `heads` ((layer, head) pairs, layers meaning all their heads, or "all") in a
    run over `text`: each alone (`effect`) and all at once (`states`, `total`).

    text: one text, a list of texts, or a file (`Path`: text lines, TSV or JSONL), run in
    padded batches. mode "zero" replaces a head's output (before the output projection: the
    projection's bias, which belongs to no head, stays) by zeros; "mean" by that head's mean
    output over every token of `reference` (REFERENCE by default; a list or a file).
    compare=False skips the clean run and the table: one forward pass with every head asked
    ablated, the result without any before/after comparison.
    """
    if mode not in ("zero", "mean"):
        raise ValueError(f"mode must be 'zero' or 'mean', got {mode!r}")
    if mode == "zero" and reference is not None:
        raise ValueError("reference texts are for mode='mean'; zero ablation reads none")
    stack = stack_of(pretrained)
    pairs = head_pairs(stack, heads, pretrained.source)
    texts, encoded = encoded_prompts(pretrained, text)
    N, L, counts = len(texts), stack.config.num_layers, heads_per_layer(stack)
    # each head's output, per layer (DeepSeek's: its values' size; Gemma 4's by layer type)
    values = [
        torch.zeros(H, head_size(block.attn)) for H, block in zip(counts, stack.blocks, strict=True)
    ]
    if mode == "mean":
        values = mean_head_outputs(pretrained, stack, REFERENCE if reference is None else reference)
    causal = isinstance(stack, Decoder)
    nan = torch.full((N, L, max(counts)), float("nan"), dtype=torch.float64)
    effect, by_head = nan.clone(), nan.clone()
    total, top_change = torch.full((N,), float("nan"), dtype=torch.float64), nan[:, 0, 0].clone()
    lengths = [len(e.ids) for e in encoded]
    first: dict = {}
    with torch.inference_mode():
        dtype = next(stack.parameters()).dtype
        values = [v.to(dtype)[None, :, None, :] for v in values]  # L x (1, H, 1, D)
        everywhere = {}
        for n, h in pairs:
            which = everywhere[n].heads if n in everywhere else torch.zeros(
                1, counts[n], 1, 1, dtype=torch.bool)  # fmt: skip
            which[0, h] = True
            everywhere[n] = Edit(heads=which, head_values=values[n])
        for group in prompt_groups(stack, lengths):
            ids, mask = padded_ids(pretrained, stack, [encoded[p].ids for p in group])
            own = [lengths[p] for p in group]
            if not compare:  # one forward pass from the embeddings, every head asked ablated
                states = forward_rows(stack, ids, mask, everywhere).hidden
                _keep(first, group, states, None, None, stack, pretrained.tokenizer, own)
                continue
            clean = run_rows(stack, ids, mask, own, records=True)  # refuses absorbed records
            clean_logprobs = None
            if causal:
                last = decoder_logits(stack, clean.states[range(len(group)), [n - 1 for n in own]])
                clean_logprobs = last.double().log_softmax(-1)  # (B, vocab)

            def measure(rows: list[int], states: Tensor, clean=clean, own=own) -> Tensor:
                """(R,) the mean change of each row's real tokens' final vectors."""
                return torch.stack([changed(clean.states[row, : own[row]], states[r, : own[row]])[0]
                                    .mean() for r, row in enumerate(rows)])  # fmt: skip

            def moved(rows: list[int], states: Tensor, own=own, clean_logprobs=clean_logprobs):
                """(R,) the change of each row's clean top next token's log-probability."""
                at = [own[row] - 1 for row in rows]
                logprobs = decoder_logits(stack, states[range(len(rows)), at])
                logprobs = logprobs.double().log_softmax(-1)  # (R, vocab)
                clean_rows = clean_logprobs[rows]
                top = clean_rows.argmax(-1, keepdim=True)  # (R, 1)
                return (logprobs.gather(-1, top) - clean_rows.gather(-1, top))[:, 0]

            every = list(range(len(group)))
            states = resumed_rows(stack, clean, min(everywhere), everywhere, torch.tensor(every))
            total[group] = measure(every, states)
            if causal:
                top_change[group] = moved(every, states)
            _keep(first, group, states, clean, clean_logprobs, stack, pretrained.tokenizer, own)
            if len(pairs) == 1:  # the one head alone is all of them at once
                (n, h), prompt_index = pairs[0], list(group)
                effect[prompt_index, n, h] = total[group]
                by_head[prompt_index, n, h] = top_change[group]
                continue
            for layer in sorted({n for n, _ in pairs}):
                cells = [(row, h) for row in every for n, h in pairs if n == layer]
                T, C = ids.shape[1], stack.config.block.width
                for part in batches(len(cells), 4 * T * C):
                    rows, chosen = [r for r, _ in cells[part]], [h for _, h in cells[part]]
                    which = torch.zeros(len(rows), counts[layer], 1, 1, dtype=torch.bool)
                    which[range(len(rows)), chosen] = True
                    edit = Edit(heads=which, head_values=values[layer])
                    states = resumed_rows(stack, clean, layer, {layer: edit}, torch.tensor(rows))
                    prompt_index = [group[r] for r in rows]
                    effect[prompt_index, layer, chosen] = measure(rows, states)
                    if causal:
                        by_head[prompt_index, layer, chosen] = moved(rows, states)
    spreads = {}
    if compare:
        found = {"effect": effect, "total": total}
        if causal:
            found |= {"next_by_head": by_head, "top_change": top_change}
        spreads = spreads_of(found)
    return Ablated(
        source=pretrained.source, text=texts[0], tokens=list(encoded[0].tokens), mode=mode,
        heads=pairs, states=first["states"], clean_states=first["clean"],
        effect=spreads["effect"].mean if compare else nan[0],
        total=float(spreads["total"].mean) if compare else float("nan"),
        next=first.get("next"),
        next_by_head=spreads["next_by_head"].mean if compare and causal else None,
        texts=texts, spreads=spreads, after=first.get("after"),
    )  # fmt: skip


def _keep(first: dict, group, states, clean, clean_logprobs, stack, tokenizer, own) -> None:
    """The first prompt's vectors and next tokens, from the batch that holds it."""
    if 0 not in group:
        return
    row = group.index(0)
    T = own[row]
    first["states"] = states[row, :T].clone()
    first["clean"] = None if clean is None else clean.states[row, :T].clone()
    if isinstance(stack, Decoder):
        after = decoder_logits(stack, states[row, T - 1])
        first["after"] = top_tokens(tokenizer, after.double().log_softmax(-1))
        if clean_logprobs is not None:
            first["next"] = next_tokens(tokenizer, clean_logprobs[row], after, T - 1)
