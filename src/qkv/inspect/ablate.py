"""Ablate heads: what a head does, seen in what changes without it.

`ablate` silences heads (their outputs replaced by zeros or by their mean over reference
texts), each alone and all at once. It is an `Edit` the model's layers apply in their own
forward pass, on every backend, with the runs of a table resumed from the first changed layer
and batched (`qkv.inspect.runs`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar, Literal

import torch
from torch import Tensor

from qkv.attention.inputs import check_indices
from qkv.inspect.layer_heads import check_layer_head, heads_per_layer
from qkv.inspect.runs import (
    NextTokens,
    changed,
    decoder_logits,
    grid_dict,
    head_size,
    next_tokens,
    resumed,
    run,
    stack_of,
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
    """Heads ablated: their outputs replaced by zeros or by their mean over reference texts.

    `states` has every head asked ablated at once, `clean_states` none. `effect` (L, H) is
    each head ablated alone: the mean over every token of 1 - cosine between its final
    vector with and without (NaN for heads not asked, and where a layer has fewer heads
    than H, the most any layer has); `total` the same with all at once.
    """

    view: ClassVar[str] = "ablated"  # drawn by qkv.viz.notebook_interventions

    source: str
    text: str
    tokens: list[str]
    mode: str
    heads: list[tuple[int, int]]  # (layer, head), counted from 0
    states: Tensor  # (T, C)
    clean_states: Tensor  # (T, C)
    effect: Tensor  # (L, H) float64
    total: float
    next: NextTokens | None = None  # decoders: after the last token, all heads ablated
    next_by_head: Tensor | None = None  # (L, H): the change of the clean top token's log-prob

    def ranked(self) -> list[tuple[int, int, float]]:
        cells = [(n, h, float(self.effect[n, h])) for n, h in self.heads]
        return sorted(cells, key=lambda c: -c[2])

    def to_dict(self) -> dict:
        """JSON-ready (see docs/ablate.md)."""
        return {
            "source": self.source,
            "text": self.text,
            "tokens": self.tokens,
            "mode": self.mode,
            "heads": [list(h) for h in self.heads],
            "effect": grid_dict(self.effect),
            "total": self.total,
            "ranked": [{"layer": n, "head": h, "effect": e} for n, h, e in self.ranked()],
            "next": None if self.next is None else self.next.to_dict(),
            "next_by_head": None if self.next_by_head is None else grid_dict(self.next_by_head),
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


def mean_head_outputs(pretrained, stack, texts: Sequence[str]) -> list[Tensor]:
    """L tensors (H, D): each head's output averaged over every token of `texts` (D, each
    layer's head output size)."""
    if isinstance(texts, str) or not texts:
        raise ValueError("reference must be a list of texts (one at least)")
    total, count = None, 0
    with torch.inference_mode():
        for text in texts:
            outputs = run(stack, torch.tensor([pretrained.encode(text).ids])).head_outputs
            summed = [layer.double().sum(1) for layer in outputs]  # (H, D) each
            if total is not None:
                summed = [a + b for a, b in zip(total, summed, strict=True)]
            total = summed
            count += outputs[0].shape[1]
    return [layer / count for layer in total]


def ablate(
    pretrained,
    text: str,
    heads="all",
    *,
    mode: Literal["zero", "mean"] = "zero",
    reference: Sequence[str] | None = None,
) -> Ablated:
    """Ablate `heads` ((layer, head) pairs, layers meaning all their heads, or "all") in a
    run over `text`: each alone (`effect`) and all at once (`states`, `total`).

    mode "zero" replaces a head's output (before the output projection: the projection's
    bias, which belongs to no head, stays) by zeros; "mean" by that head's mean output over
    every token of `reference` (REFERENCE by default).
    """
    if mode not in ("zero", "mean"):
        raise ValueError(f"mode must be 'zero' or 'mean', got {mode!r}")
    if mode == "zero" and reference is not None:
        raise ValueError("reference texts are for mode='mean'; zero ablation reads none")
    stack = stack_of(pretrained)
    pairs = head_pairs(stack, heads, pretrained.source)
    encoded = pretrained.encode(text)
    ids = torch.tensor([encoded.ids])
    T, L, counts = ids.shape[1], stack.config.num_layers, heads_per_layer(stack)
    # each head's output, per layer (DeepSeek's: its values' size; Gemma 4's by layer type)
    values = [
        torch.zeros(H, head_size(block.attn)) for H, block in zip(counts, stack.blocks, strict=True)
    ]
    if mode == "mean":
        values = mean_head_outputs(pretrained, stack, REFERENCE if reference is None else reference)
    causal = isinstance(stack, Decoder)
    effect = torch.full((L, max(counts)), float("nan"), dtype=torch.float64)
    by_head = effect.clone() if causal else None
    with torch.inference_mode():
        clean = run(stack, ids)
        dtype = clean.states.dtype
        values = [v.to(dtype)[None, :, None, :] for v in values]  # L x (1, H, 1, D)
        clean_logprobs = clean.logits[-1].double().log_softmax(-1) if causal else None
        for layer in sorted({n for n, _ in pairs}):
            chosen = [h for n, h in pairs if n == layer]
            which = torch.zeros(len(chosen), counts[layer], 1, 1, dtype=torch.bool)
            which[range(len(chosen)), chosen] = True
            edit = Edit(heads=which, head_values=values[layer])
            states = resumed(stack, clean, layer, {layer: edit}, len(chosen))
            effect[layer, chosen] = changed(clean.states[None], states)[0].mean(-1)
            if by_head is not None:
                top = int(clean_logprobs.argmax())
                logprobs = decoder_logits(stack, states[:, -1]).double().log_softmax(-1)
                by_head[layer, chosen] = logprobs[:, top] - clean_logprobs[top]
        edits = {}
        for n, h in pairs:
            which = (
                edits[n].heads if n in edits else torch.zeros(1, counts[n], 1, 1, dtype=torch.bool)
            )
            which[0, h] = True
            edits[n] = Edit(heads=which, head_values=values[n])
        states = resumed(stack, clean, min(edits), edits, 1)
        total = float(changed(clean.states, states[0])[0].mean())
        after = decoder_logits(stack, states[0, -1]) if causal else None
    return Ablated(
        source=pretrained.source, text=text, tokens=list(encoded.tokens), mode=mode,
        heads=pairs, states=states[0], clean_states=clean.states, effect=effect, total=total,
        next=None if after is None else next_tokens(
            pretrained.tokenizer, clean.logits[-1], after, T - 1
        ),
        next_by_head=by_head,
    )  # fmt: skip
