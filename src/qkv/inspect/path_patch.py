"""Path patching: a sender head's effect through chosen receivers only.

Ordinary patching of a head (`qkv.patch`) changes everything after it: every later head and
MLP reads the changed residual stream, and so does the final readout. Path patching asks how
much of that effect goes through some of them: the sender's change in the stream,

    delta (B, T, C) = what the sender's attention layer adds to the stream with the sender's
                      output patched in, minus what it adds in the corrupted run
                    = W_O[:, sender's slice] (clean_z - corrupt_z)  (no gate, no out-norm),

is added, in the corrupted run, to the input of each receiver only, everything else computed
normally: a receiver head's query, key or value input (`Edit(q_input=...)`: that head alone,
before the layer's norm; under grouped-query attention a receiver's keys and values are its
own, the shared key/value head split by query head), an MLP's input, or the final readout
("logits": the final norm and LM head read x + delta). Through every receiver (each later
head's q, k and v, each MLP from the sender's layer on, the logits) it is ordinary patching
of the sender, up to float rounding; through none it is the corrupted run.

An MLP receiver is computed layer by layer: the run goes block by block from the sender's
layer, and a receiver MLP's output is the block's own MLP on its stream plus delta.

Refused by name: post-norm blocks (the stream is normalized after each sublayer, so a change
does not travel additively), a receiver layer whose heads' outputs pass a gate made from the
stream (Qwen3.5: the gate would be one more receiver), receiver heads in layers without their
own q, k, v projections (latent, linear attention), layers that read an earlier layer's keys
(Gemma 4), and encoders.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from qkv.inspect.layer_heads import check_layer_head, heads_per_layer
from qkv.inspect.metrics import Metric
from qkv.inspect.patch import listed
from qkv.inspect.patch_runs import (
    Batch,
    PairText,
    batches_of,
    final_logits,
    forward,
    own_heads,
    read_pairs,
    record_size,
    scores,
)
from qkv.inspect.prompts import Spread
from qkv.models import Decoder
from qkv.nn.edit import Edit
from qkv.views import Shown

VIAS = ("q", "k", "v")
Receiver = tuple[int, int] | tuple[int, str] | str  # (layer, head), (layer, "mlp"), "logits"


@dataclass(repr=False)
class PathPatched(Shown):
    """The metric with the sender's change reaching the receivers only (`spread`: per pair,
    mean, 95% interval), beside the clean and corrupted runs' (`clean_spread`,
    `corrupt_spread`). `restored` is (value - corrupt) / (clean - corrupt)."""

    view: ClassVar[str] = "patched"  # drawn by qkv.viz.notebook_interventions

    source: str
    pairs: list[PairText]
    sender: tuple[int, int]
    receivers: list[Receiver]
    via: tuple[str, ...]
    spread: Spread  # (N,)
    clean_spread: Spread
    corrupt_spread: Spread

    @property
    def value(self) -> float:
        return float(self.spread.mean)

    @property
    def clean(self) -> float:
        return float(self.clean_spread.mean)

    @property
    def corrupt(self) -> float:
        return float(self.corrupt_spread.mean)

    @property
    def metric(self) -> Metric:
        return self.pairs[0].metric

    @property
    def restored(self) -> float:
        gap = self.clean - self.corrupt
        return float("nan") if gap == 0 else (self.value - self.corrupt) / gap

    def to_dict(self) -> dict:
        """JSON-ready (see docs/path_patch.md)."""
        return {
            "source": self.source,
            "sender": list(self.sender),
            "receivers": [r if isinstance(r, str) else list(r) for r in self.receivers],
            "via": list(self.via),
            "metric": self.metric.to_dict(),
            "pairs": [p.to_dict() for p in self.pairs],
            "value": self.value,
            "clean": self.clean,
            "corrupt": self.corrupt,
            "restored": listed(torch.tensor(self.restored)),
            "spread": self.spread.to_dict(),
            "clean_spread": self.clean_spread.to_dict(),
            "corrupt_spread": self.corrupt_spread.to_dict(),
        }


def path_patch(pretrained, clean, corrupt=None, metric=None, *, sender: tuple[int, int],
               receivers="all", via="q", seed: int = 0) -> PathPatched:  # fmt: skip
    """The metric of the corrupted run in which the sender head's change (its clean output
    in place of its corrupted one) reaches only `receivers`, through `via`.

    clean, corrupt, metric: as `qkv.patch` takes them (texts, lists of pairs, a file).
    sender: (layer, head). receivers: "all", or a list of (layer, head) (layers after the
    sender's), (layer, "mlp") (from the sender's layer on: its own MLP reads its change) and
    "logits". via: "q", "k" or "v", or a list of them: which inputs of the receiver heads
    read the change. seed: the bootstrap interval's.
    """
    stack, pairs = read_pairs(pretrained, clean, corrupt, metric, "path_patch")
    counts = heads_per_layer(stack)
    layer, head = _check_sender(sender, counts, pretrained.source)
    vias = _check_via(via)
    chosen = _check_receivers(stack, receivers, layer, counts, pretrained.source)
    _check_model(stack, layer, pretrained.source)
    N = len(pairs)
    values, clean_scores, corrupt_scores = (torch.empty(N, dtype=torch.float64) for _ in "abc")
    H, C = max(counts), stack.config.block.width
    with torch.inference_mode():
        for batch in batches_of(stack, pairs, per_token=record_size(stack) + H * C):
            index = torch.tensor(batch.index)
            got = _path_batch(stack, batch, (layer, head), chosen, vias)
            for target, found in zip((values, clean_scores, corrupt_scores), got, strict=True):
                target[index] = found
    return PathPatched(pretrained.source, pairs, (layer, head), chosen, vias,
                       Spread.of(values, seed), Spread.of(clean_scores, seed),
                       Spread.of(corrupt_scores, seed))  # fmt: skip


def _path_batch(stack: Decoder, batch: Batch, sender: tuple[int, int], receivers, vias):
    """(path-patched, clean, corrupted) metrics (B,) of one batch."""
    clean = forward(stack, batch.clean, batch.last, "path_patch")
    corrupt = forward(stack, batch.corrupt, batch.last, "path_patch")
    layer, head = sender
    H = clean.records[layer].out.shape[1]
    which = torch.zeros(1, H, 1, 1, dtype=torch.bool)
    which[0, head] = True  # the sender alone, every position
    patched = Edit(heads=which, head_values=clean.records[layer].out)
    sent = stack(batch.corrupt, resume=(layer, corrupt.inputs[layer]), stop=layer + 1,
                 layers=[layer], edits={layer: patched}, logits=False)  # fmt: skip
    delta = sent.records[layer].attn_out - corrupt.records[layer].attn_out  # (B, T, C)
    x = corrupt.inputs[layer]
    parts = [r for r in receivers if r != "logits"]
    heads_at = {n: [h for (m, h) in parts if m == n and h != "mlp"]
                for n in range(layer, stack.config.num_layers)}  # fmt: skip
    for n, heads in heads_at.items():
        x = _block(stack, batch, n, x, delta, heads, (n, "mlp") in receivers, vias)
    if "logits" in receivers:
        x = x + delta
    hidden = x if stack.norm is None else stack.norm(x)
    logits = final_logits(stack, hidden, batch.last)  # (B, vocab)
    return tuple(scores(batch, found, clean.logits)[0] for found in (logits, clean.logits,
                                                                    corrupt.logits))  # fmt: skip


def _block(stack: Decoder, batch: Batch, layer: int, x: Tensor, delta: Tensor, heads: list[int],
           mlp: bool, vias: tuple[str, ...]) -> Tensor:  # fmt: skip
    """Block `layer` on the stream x (B, T, C), its receiver heads' `vias` inputs reading
    x + delta, its MLP too where it is a receiver: the block's output (B, T, C)."""
    edits = {}
    if heads:
        B, T, C = x.shape
        added = x.new_zeros(B, T, stack.blocks[layer].attn.num_heads, C)  # (B, T, H, C)
        added[:, :, heads] = delta[:, :, None, :]
        edits[layer] = Edit(**{f"{name}_input": added for name in vias})
    out = stack(batch.corrupt, resume=(layer, x), stop=layer + 1, edits=edits,
                layers=[layer] if mlp else None, logits=False)  # fmt: skip
    if not mlp:
        return out.hidden
    block, attn_out = stack.blocks[layer], out.records[layer].attn_out
    if block.parallel:  # both sub-layers read the block's input
        made = block.feed_forward_recorded(x + delta, attn_out)[2]
    else:
        made = block.feed_forward_recorded(x + attn_out + delta)[2]
    return (x + attn_out) + made  # the block's sum, in its order, with the receiver's MLP


def _check_sender(sender, counts: list[int], source: str) -> tuple[int, int]:
    if not (isinstance(sender, tuple | list) and len(sender) == 2
            and all(type(v) is int for v in sender)):  # fmt: skip
        raise ValueError(f"sender is (layer, head), two whole numbers; got {sender!r}")
    layer, head = sender
    if not 0 <= layer < len(counts):
        raise ValueError(f"the sender's layer {layer} is out of range: {source} has layers 0 to "
                         f"{len(counts) - 1}")  # fmt: skip
    return layer, check_layer_head(layer, head, counts, source)


def _check_via(via) -> tuple[str, ...]:
    names = (via,) if isinstance(via, str) else tuple(via)
    if not names or any(name not in VIAS for name in names):
        raise ValueError(f"via is 'q', 'k' or 'v', or a list of them; got {via!r}")
    return tuple(dict.fromkeys(names))


def _check_receivers(stack: Decoder, receivers, sender: int, counts: list[int],
                     source: str) -> list[Receiver]:  # fmt: skip
    L = len(counts)
    if isinstance(receivers, str) and receivers == "all":
        heads = [(n, h) for n in range(sender + 1, L) for h in range(counts[n])]
        mlps = [(n, "mlp") for n in range(sender, L) if _reads_sender_mlp(stack, n, sender)]
        receivers = [*heads, *mlps, "logits"]
    if isinstance(receivers, str) or not isinstance(receivers, list | tuple):
        raise ValueError("receivers is 'all' or a list of (layer, head), (layer, 'mlp') and "
                         f"'logits'; got {receivers!r}")  # fmt: skip
    chosen: list[Receiver] = []
    for receiver in receivers:
        if receiver == "logits":
            chosen.append("logits")
            continue
        if not (isinstance(receiver, tuple | list) and len(receiver) == 2
                and type(receiver[0]) is int):  # fmt: skip
            raise ValueError(f"a receiver is (layer, head), (layer, 'mlp') or 'logits'; got "
                             f"{receiver!r}")  # fmt: skip
        layer, part = receiver
        if not 0 <= layer < L:
            raise ValueError(f"receiver {receiver!r}: {source} has layers 0 to {L - 1}")
        if part == "mlp":
            if not _reads_sender_mlp(stack, layer, sender):
                raise ValueError(f"receiver {receiver!r}: an MLP reads the sender's change from "
                                 f"the sender's layer {sender} on (a parallel block's own MLP "
                                 "does not: it reads the block's input)")  # fmt: skip
        elif type(part) is int:
            if layer <= sender:
                raise ValueError(f"receiver {receiver!r}: a receiver head is in a layer after "
                                 f"the sender's ({sender})")  # fmt: skip
            check_layer_head(layer, part, counts, source)
            own_heads(stack, f"receiver {receiver!r}", [layer])
            if stack.blocks[layer].attn.gate is not None:
                raise ValueError(
                    f"receiver {receiver!r}: layer {layer}'s heads' outputs pass a gate made "
                    "from the stream (an output gate), which would be one more receiver; path "
                    "patching reaches a head's q, k and v only"
                )
        else:
            raise ValueError(f"a receiver is (layer, head), (layer, 'mlp') or 'logits'; got "
                             f"{receiver!r}")  # fmt: skip
        chosen.append((layer, part))
    return list(dict.fromkeys(chosen))


def _reads_sender_mlp(stack: Decoder, layer: int, sender: int) -> bool:
    return layer > sender or (layer == sender and not stack.blocks[layer].parallel)


def _check_model(stack: Decoder, sender: int, source: str) -> None:
    for n in range(sender, stack.config.num_layers):
        if stack.blocks[n].position == "post":
            raise ValueError(
                f"path patching adds the sender's change to its receivers' inputs, but {source}'s "
                "blocks are post-norm: the stream is normalized after each sublayer, so a change "
                "does not reach later layers additively"
            )
        if stack.resume_from(n) != n:
            raise ValueError(f"path patching runs block by block from the sender's layer; layer "
                             f"{n} of {source} reads an earlier layer's keys")  # fmt: skip
