"""Patch one run into another: where a difference between two texts lives.

`patch` copies the clean run's head outputs, or its residual stream at one layer and
position, into a corrupted run, one at a time, and scores the next token. Each patch is an
`Edit` the model's layers apply in their own forward pass, on every backend, with the runs
of a table resumed from the patched layer and batched (`qkv.inspect.runs`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch
from torch import Tensor

from qkv.inspect.layer_heads import heads_per_layer, nan_grid
from qkv.inspect.metrics import Metric
from qkv.inspect.runs import (
    Token,
    batches,
    decoder_logits,
    grid_dict,
    resumed,
    run,
    stack_of,
    top_tokens,
)
from qkv.models import Decoder
from qkv.nn.edit import Edit
from qkv.views import Shown


@dataclass(repr=False)
class Patched(Shown):
    """Activation patching: the clean run's activations copied, one at a time, into the
    corrupted run, and the metric of the corrupted run's next token measured.

    `heads` (L, H): the metric with that head's output patched in (NaN where a layer has
    fewer heads than H, the most any layer has); `residual` (L, T): with
    the residual stream after that layer's block patched in at that position. `clean` and
    `corrupt` are the metric unpatched; `restored(grid)` is (metric - corrupt) / (clean -
    corrupt): 1 where a patch restores the clean metric, 0 where it changes nothing.
    """

    view: ClassVar[str] = "patched"  # drawn by qkv.viz.notebook_interventions

    source: str
    clean_text: str
    corrupt_text: str
    clean_tokens: list[str]
    corrupt_tokens: list[str]
    metric: Metric
    clean: float
    corrupt: float
    heads: Tensor  # (L, H) float64
    residual: Tensor  # (L, T) float64
    clean_next: list[Token] = field(default_factory=list)
    corrupt_next: list[Token] = field(default_factory=list)

    def restored(self, grid: Tensor) -> Tensor:
        gap = self.clean - self.corrupt
        if gap == 0:
            return torch.full_like(grid, float("nan"))
        return (grid - self.corrupt) / gap

    def to_dict(self) -> dict:
        """JSON-ready (see docs/patch.md)."""
        return {
            "source": self.source,
            "clean_text": self.clean_text,
            "corrupt_text": self.corrupt_text,
            "clean_tokens": self.clean_tokens,
            "corrupt_tokens": self.corrupt_tokens,
            "metric": self.metric.to_dict(),
            "clean": self.clean,
            "corrupt": self.corrupt,
            "heads": grid_dict(self.heads),
            "residual": grid_dict(self.residual),
            "heads_restored": grid_dict(self.restored(self.heads)),
            "residual_restored": grid_dict(self.restored(self.residual)),
            "clean_next": [vars(t) for t in self.clean_next],
            "corrupt_next": [vars(t) for t in self.corrupt_next],
        }


def patch(pretrained, clean: str, corrupt: str, metric) -> Patched:
    """Patch `clean`'s head outputs (per layer and head) and residual stream (per layer and
    position) into the run over `corrupt`, one at a time, and score the next token after
    the last position with `metric` (a `Metric`, or its text: "diff: Mary, John").

    Decoders only; the two texts must have the same number of tokens (positions are
    patched into the same positions).
    """
    stack = stack_of(pretrained)
    if not isinstance(stack, Decoder):
        raise ValueError(
            f"patch scores the next token, so it needs a decoder; {pretrained.source} is "
            f"{pretrained.family.name}"
        )
    metric = Metric.parse(metric)
    ids_of_metric = metric.ids(pretrained.tokenizer)
    clean_encoded, corrupt_encoded = pretrained.encode(clean), pretrained.encode(corrupt)
    if len(clean_encoded.ids) != len(corrupt_encoded.ids):
        raise ValueError(
            f"the clean text has {len(clean_encoded.ids)} tokens and the corrupted text "
            f"{len(corrupt_encoded.ids)}; patching copies positions into the same positions, "
            f"so give texts of equal token length (clean: {list(clean_encoded.tokens)}, "
            f"corrupted: {list(corrupt_encoded.tokens)})"
        )
    L, counts = stack.config.num_layers, heads_per_layer(stack)  # each layer's own count
    T = len(clean_encoded.ids)
    heads = nan_grid(counts)  # NaN where a layer has fewer heads than the most
    residual = torch.empty(L, T, dtype=torch.float64)
    with torch.inference_mode():
        source = run(stack, torch.tensor([clean_encoded.ids]))
        target = run(stack, torch.tensor([corrupt_encoded.ids]))

        def scored(states: Tensor) -> Tensor:
            return metric.score(decoder_logits(stack, states[:, -1]), ids_of_metric)

        for layer in range(L):
            H = counts[layer]
            values = source.head_outputs[layer][None]  # (1, H, T, D)
            for part in batches(H, H * T * T):
                which = torch.eye(H, dtype=torch.bool)[part, :, None, None]  # row h: head h
                edit = Edit(heads=which, head_values=values)
                states = resumed(stack, target, layer, {layer: edit}, which.shape[0])
                heads[layer, part] = scored(states)
            for part in batches(T, H * T * T):
                where = torch.eye(T, dtype=torch.bool)[part]  # row p patches position p
                edit = Edit(positions=where, residual=source.inputs[layer + 1])
                states = resumed(stack, target, layer, {layer: edit}, where.shape[0])
                residual[layer, part] = scored(states)
        clean_score = float(metric.score(source.logits[-1], ids_of_metric))
        corrupt_score = float(metric.score(target.logits[-1], ids_of_metric))
    tokenizer = pretrained.tokenizer
    return Patched(
        source=pretrained.source, clean_text=clean, corrupt_text=corrupt,
        clean_tokens=list(clean_encoded.tokens), corrupt_tokens=list(corrupt_encoded.tokens),
        metric=metric, clean=clean_score, corrupt=corrupt_score, heads=heads, residual=residual,
        clean_next=top_tokens(tokenizer, source.logits[-1].double().log_softmax(-1)),
        corrupt_next=top_tokens(tokenizer, target.logits[-1].double().log_softmax(-1)),
    )  # fmt: skip
