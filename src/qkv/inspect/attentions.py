"""What the attention of each layer computed over one text, read from the layers' records:
`Attentions`, what `Pretrained.attentions` (and `qkv.hf`'s) return, and the forward pass
that makes it.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import ClassVar

import torch
from torch import Tensor, nn

from qkv.attention.eager import compute_dtype
from qkv.inspect.layer_heads import heads_per_layer, weights_of
from qkv.inspect.records import SCORE_RULES, why_not_redone
from qkv.inspect.words import key_words, on_words
from qkv.models import Decoder, Encoder
from qkv.models.deepseek_v4 import DeepseekV4Decoder
from qkv.nn import AttentionRecord, ExpertRecord
from qkv.views import Shown


@dataclass(eq=False, repr=False)
class Attentions(Shown):
    """One forward pass over one text, and what the attention of each layer asked computed.

    Or an encoder-decoder's cross-attention, from a target text's tokens (the queries) to the
    source text's (the keys). Every number is read from the layers' records (AttentionRecord):
    q, k, v, mask and scale as the model's backend received them.
    """

    view: ClassVar[str] = "attentions"  # drawn by qkv.viz.notebook

    records: dict[int, AttentionRecord]  # layer -> what its attention computed
    tokens: list[str]  # the key tokens: the text's, the source's for cross-attention
    encoded: object  # the tokenizer's Encoded of `tokens`: offsets, words, find("bank#2")
    heads: list[int]  # the query heads `weights` shows, counted from 0
    query_tokens: list[str] | None = None  # cross-attention: the decoder's, start token first
    made: Tensor | None = None  # (L', H, Tq, Tk): the weights the forward pass made, if any
    # layer -> its mixture of experts' record (which experts each token went to), for the
    # recorded layers whose MLP is one
    experts: dict[int, ExpertRecord] = field(default_factory=dict)

    @property
    def layers(self) -> list[int]:
        """The layers recorded, counted from 0, in the order `weights` stacks them."""
        return sorted(self.records)

    @property
    def pieces(self) -> list[str]:
        """The key tokens as people read them, what pages and plots show (`Encoded.pieces`:
        " river", not "Ġriver"; a byte of a character split over tokens as <0xE6>, never
        U+FFFD), where the tokenizer tells them; the vocabulary's names otherwise."""
        return getattr(self.encoded, "pieces", None) or list(self.tokens)

    @functools.cached_property
    def weights(self) -> Tensor:
        """(L', H', Tq, Tk) float32 for `layers` and `heads`: row i is query token i's
        attention over the keys (T x T over one text); NaN in a layer with fewer heads
        than the head asked (`qkv.inspect.layer_heads`). A layer of compressed attention's are
        on the words, its entries' weights spread over their words (`qkv.inspect.words`)."""
        out = self.made  # filled a layer at a time: never two copies of the weights at once
        for i, layer in enumerate(self.layers):
            record = self.records[layer]
            if record.made is not None:
                continue  # made in out[i] by the forward pass
            if out is None:
                s = record.shape
                out = record.q.new_empty(len(self.layers), len(self.heads), s.Tq, key_words(record),
                                         dtype=compute_dtype(record.q.dtype))  # fmt: skip
            if record.compressed is not None:  # over its keys (words, then entries): on words
                out[i] = on_words(record, self.heads)[0]
            elif record.shape.B == 1 and self.heads == list(range(record.shape.H)):
                record.weights_in(out[i])  # in place where the record is plain
            else:  # NaN for heads this layer lacks (layers may differ: Qwen3.5's)
                out[i] = weights_of(record, self.heads)  # (H', Tq, Tk)
        return out

    @property
    def scale(self) -> float:
        """The factor every recorded layer put on its dot products (1/sqrt(D) in the article)."""
        return self._same("scale")

    @property
    def causal(self) -> bool:
        """Whether every recorded layer hid the keys after each query (a decoder)."""
        return self._same("causal")

    def _same(self, name: str):
        found = {getattr(record, name) for record in self.records.values()}
        if len(found) != 1:
            raise ValueError(f"the layers differ in {name} ({sorted(found)}); ask one layer's")
        return found.pop()

    def vectors(self) -> tuple[Tensor, Tensor, Tensor]:
        """Every recorded layer's and head's q, k and v over the text: (L', H, T, D) each.

        The vectors attention received (after rotary rotation), with grouped key/value heads
        repeated so that query head h sits beside the key/value head it reads: any pair's
        steps can be redone from them (weights = softmax(q k^T * scale), masked as `allowed`).
        A layer whose scores are more than that (a soft-cap, a score bias) is refused by name:
        its pairs are `record.steps()`.
        """
        beyond = [n for n in self.layers if self.records[n].softcap is not None
                  or self.records[n].bias is not None]  # fmt: skip
        if beyond:
            raise ValueError(
                f"layer {beyond[0]} caps its scores or adds a bias to them, so q, k and v alone "
                "do not redo its pairs; use records[layer].steps(head, query)"
            )
        late = why_not_redone({n: self.records[n] for n in self.layers}, applies=SCORE_RULES)
        if late is not None:
            raise ValueError(f"{late}, so q, k and v alone do not redo its pairs; use "
                             "records[layer].steps(head, query)")  # fmt: skip
        qs, ks, vs = [], [], []
        for layer in self.layers:
            record = self.records[layer]
            group = record.shape.group
            qs.append(record.q[0])  # (H, T, D)
            ks.append(record.k[0].repeat_interleave(group, dim=0))  # query head h reads h // group
            vs.append(record.v[0].repeat_interleave(group, dim=0))
        return torch.stack(qs), torch.stack(ks), torch.stack(vs)


MADE_MAX_BYTES = 2**31  # the most `attentions(weights=None)` makes in the forward pass


def check_weights_option(weights) -> None:
    """`attentions(weights=...)` takes True, False or None; anything else is refused."""
    if weights is not None and type(weights) is not bool:
        raise ValueError(f"weights must be True, False or None (made up to "
                         f"{MADE_MAX_BYTES // 2**30} GiB), not {weights!r}")  # fmt: skip


def made_for(stack: nn.Module, weights: bool | None, L: int, heads: list[int],
             T: int) -> Tensor | None:  # fmt: skip
    """The (L, H, T, T) tensor a decoder's forward pass makes its weights in for
    `attentions`, or None: where weights are not wanted (or not by default at this size),
    some heads only are asked, or the model is not a decoder on the CPU (see `attentions`)."""
    first = next(stack.parameters())
    dtype, H = compute_dtype(first.dtype), len(heads)
    if not isinstance(stack, Decoder) or first.device.type != "cpu" or weights is False:
        return None
    if isinstance(stack, DeepseekV4Decoder):  # its keys are words and compressed entries
        return None
    if any(heads != list(range(H)) for H in heads_per_layer(stack)):
        return None  # some heads only, or layers of different head counts
    size = L * H * T * T * torch.finfo(dtype).bits // 8
    if weights is None and size > MADE_MAX_BYTES:
        return None
    return torch.empty(L, H, T, T, dtype=dtype)


def self_attentions(stack: Encoder | Decoder, encoded, layers: list[int], heads: list[int],
                    weights: bool | None) -> Attentions:  # fmt: skip
    """One forward pass of `stack` over `encoded` (a tokenizer's Encoded), recording `layers`;
    a decoder's weights made in the pass where `weights` asks (see `made_for`)."""
    ids = torch.tensor([encoded.ids])  # (1, T)
    # made outside inference mode, so that `.weights` may fill a layer the pass did not
    made = made_for(stack, weights, len(layers), heads, ids.shape[1])
    with torch.inference_mode():
        if made is not None:
            out = stack(ids, layers=layers, logits=False, weights=made)
        else:
            out = stack(ids, layers=layers, logits=False)
    experts = getattr(out, "experts", {})  # a decoder's mixtures of experts
    return Attentions(out.records, list(encoded.tokens), encoded, heads, made=made,
                      experts=experts)  # fmt: skip
