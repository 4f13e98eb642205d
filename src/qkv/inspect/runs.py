"""What every intervention shares: one forward pass of a stack kept whole (`Run`), runs
resumed from one layer with `Edit`s, batched within a memory budget, the change they make, and
the next tokens a decoder predicts before and after (`hide`, `ablate` and `patch` are built on
these, in `qkv.inspect.hide`, `qkv.inspect.ablate` and `qkv.inspect.patch`).

Many prompts run as padded rows (`Rows`, `run_rows`, `resumed_rows`): right-padded, so a
decoder's real tokens never see the padding, and an encoder's is masked as keys.

A table over every (layer, head) reuses one clean forward: each layer's run resumes from the
clean residual stream at that layer, the heads of a layer run side by side as one batch, one
head edited per row, and in a decoder only the positions from the first changed one on are
computed (the earlier ones never see it; their keys and values come from the clean run's
cache).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor

from qkv.attention.inputs import check_indices
from qkv.inspect.layer_heads import check_heads, heads_per_layer
from qkv.inspect.prompts import Spread, groups, texts_of
from qkv.inspect.records import check_head_outputs
from qkv.models import Decoder, Encoder, self_attention_stack
from qkv.models.deepseek_v4 import DeepseekV4Decoder
from qkv.nn.attention import KVCache
from qkv.nn.delta import GatedDeltaNet
from qkv.nn.edit import Edits

# the most (rows x heads x queries x keys) mask elements one batched run builds (64 Mi
# booleans): a long text runs its heads in smaller batches instead of taking more memory
MASK_BUDGET = 1 << 26
TOP = 5  # next tokens shown before and after


# ---------------------------------------------------------------------------- the model


def stack_of(pretrained) -> Encoder | Decoder:
    """The stack interventions run on: an encoder's or a decoder's, an encoder-decoder's
    encoder (what `attentions` shows without a target)."""
    stack = self_attention_stack(pretrained.model, "an intervention", pretrained.source)
    if isinstance(stack, DeepseekV4Decoder):
        raise ValueError(
            f"hide, ablate and patch resume a run from one layer's vector per token and edit its "
            f"heads; {pretrained.source} is a DeepSeek-V4 decoder, which keeps n streams per "
            "token between layers (hyper-connections) and whose layers take no edits (hiding a "
            "word inside a compressed entry would also need the entry pooled again without it)"
        )
    return stack


@dataclass
class Run:
    """One forward pass of a stack over ids (1, T): the residual stream at every block's
    input (`inputs[l]`, then the last block's output), the final vectors, every layer's head
    outputs (L, H, T, D) and, in a decoder, its keys and values, as the records keep them."""

    ids: Tensor  # (1, T)
    inputs: list[Tensor]  # L + 1 tensors (1, T, C)
    states: Tensor  # (T, C) after the final norm
    head_outputs: list[Tensor]  # L tensors (H, T, D): D may differ by layer (Gemma 4's)
    logits: Tensor | None  # (T, vocab), decoders
    keys: list[Tensor] = field(default_factory=list)  # decoders: L tensors (1, Hkv, T, D)
    values: list[Tensor] = field(default_factory=list)


def run(stack: Encoder | Decoder, ids: Tensor, edits: Edits | None = None) -> Run:
    out = _forward(stack, ids, edits, layers="all", hidden_states=True)
    records = [out.records[n] for n in range(len(stack.blocks))]
    check_head_outputs(out.records, "an intervention")
    heads = [record.out[0] for record in records]
    if not isinstance(stack, Decoder):
        return Run(ids, out.hidden_states, out.hidden[0], heads, None)
    logits = decoder_logits(stack, out.hidden[0])
    keys, values = [r.k for r in records], [r.v for r in records]
    return Run(ids, out.hidden_states, out.hidden[0], heads, logits, keys, values)


def _forward(stack, ids: Tensor, edits: Edits | None, **kwargs):
    if isinstance(stack, Decoder):
        return stack(ids, edits=edits, logits=False, **kwargs)
    return stack(ids, edits=edits, **kwargs)


def decoder_logits(stack: Decoder, hidden: Tensor) -> Tensor:
    return stack.project(hidden).float()


def resumed(stack, clean: Run, layer: int, edits: Edits, rows: int, start: int = 0) -> Tensor:
    """The final vectors (rows, T, C) of `rows` runs from `layer` on, each starting from the
    clean residual stream there, with `edits` (batched: row b's edit in row b).

    start (decoders): the first position an edit can change. A decoder's earlier positions
    never see a later one, so they keep the clean run's vectors, and their keys and values
    come from the clean run's cache: only positions start.. are computed, and the edits'
    masks and vectors cover those positions only (hide: (rows, H, T - start, T)).
    """
    if start == 0:
        ids = clean.ids.expand(rows, -1)
        if isinstance(stack, Decoder):  # a layer may read an earlier one's keys (Gemma 4)
            layer = stack.resume_from(layer)
        return _forward(stack, ids, edits, resume=(layer, clean.inputs[layer])).hidden
    assert isinstance(stack, Decoder), "only a decoder's earlier positions are left as they were"
    cache = stack.new_cache()
    if all(type(c) is KVCache for c in cache.layers):
        for n, (keys, values) in enumerate(zip(clean.keys, clean.values, strict=True)):
            prefix = (t[:, :, :start].expand(rows, -1, -1, -1) for t in (keys, values))
            cache.layers[n] = KVCache.holding(*prefix)
    else:  # a latent layer (DeepSeek's) caches compressed vectors, which no record keeps: the
        # clean prefix is run again into the cache (its tokens never see later ones)
        stack(clean.ids[:, :start].expand(rows, -1), cache=cache, logits=False)
    ids = clean.ids[:, start:].expand(rows, -1)
    x = clean.inputs[layer][:, start:]
    after = stack(ids, edits=edits, resume=(layer, x), cache=cache, logits=False).hidden
    before = clean.states[None, :start].expand(rows, -1, -1)
    return torch.cat([before, after], dim=1)


def linear_layers(stack) -> list[int]:
    """The layers that keep a running memory (linear attention) instead of a softmax."""
    return [n for n, block in enumerate(stack.blocks) if isinstance(block.attn, GatedDeltaNet)]


def head_size(attn) -> int:
    """The size of each head's output, as the layer's record keeps it: its values' (a linear
    layer's: each head's read of its memory, before the gated norm)."""
    return attn.config.value_size if isinstance(attn, GatedDeltaNet) else attn.value_size


def batches(count: int, per_row: int) -> Iterator[slice]:
    """Slices of `count` rows, each batch within MASK_BUDGET elements at `per_row` a row."""
    size = max(1, min(count, MASK_BUDGET // max(per_row, 1)))
    for start in range(0, count, size):
        yield slice(start, min(start + size, count))


def changed(before: Tensor, after: Tensor) -> tuple[Tensor, Tensor]:
    """1 - cosine and Euclidean distance between vectors (…, C), float64."""
    before, after = before.double(), after.double()
    return 1 - F.cosine_similarity(before, after, dim=-1), (after - before).norm(dim=-1)


def layers_heads(stack, layers, heads, source: str) -> tuple[list[int], list[int]]:
    """The layers and heads asked for (every one for None), each checked, neither empty: a
    head is one that some layer asked has (each layer's own count, `heads_per_layer`)."""
    layers = check_indices("layer", layers, stack.config.num_layers, source)
    heads = check_heads(heads, layers, heads_per_layer(stack), source) if layers else []
    if not layers or not heads:
        raise ValueError("no layer or no head asked for; leave layers and heads out for all")
    return layers, heads


# ---------------------------------------------------------------------------- tokens


@dataclass
class Token:
    token: str
    id: int
    logprob: float


@dataclass
class NextTokens:
    """A decoder's next-token log-probabilities at one position, before and after a change."""

    position: int
    before: list[Token]  # the top tokens of the clean run
    after: list[Token]  # the top tokens of the changed run
    # the clean run's top token: its log-probability after the change minus before
    top_change: float

    def to_dict(self) -> dict:
        return {
            "position": self.position,
            "before": [vars(t) for t in self.before],
            "after": [vars(t) for t in self.after],
            "top_change": self.top_change,
        }


def top_tokens(tokenizer, logprobs: Tensor, k: int = TOP) -> list[Token]:
    values, ids = logprobs.topk(min(k, logprobs.numel()))
    return [
        Token(tokenizer.id_to_token(i) or str(i), i, float(v))
        for v, i in zip(values.tolist(), ids.tolist(), strict=True)
    ]


def next_tokens(tokenizer, before: Tensor, after: Tensor, position: int) -> NextTokens:
    """From logits (vocab,) of the clean and the changed run at `position`."""
    before, after = before.double().log_softmax(-1), after.double().log_softmax(-1)
    top = int(before.argmax())
    change = float(after[top] - before[top])
    return NextTokens(position, top_tokens(tokenizer, before), top_tokens(tokenizer, after), change)


def word_span(encoded, word: str, what: str) -> tuple[int, int]:
    """A word's token span [start, end) ("bank", "bank#2"): a word that occurs twice must
    say which."""
    try:
        return encoded.find(word)
    except ValueError as error:
        raise ValueError(f"{what}: {error}") from None


def grid_dict(grid: Tensor) -> list[list[float | None]]:
    """An (L, H) grid as lists, None where it was not computed (NaN)."""
    return [[None if v != v else float(v) for v in row] for row in grid.tolist()]


# ---------------------------------------------------------------------------- prompts


def encoded_prompts(pretrained, texts, what: str = "texts") -> tuple[list[str], list]:
    """The prompts (a text, a list of texts, or a `Path`: `qkv.inspect.prompts.texts_of`) and
    each one's tokens; a prompt the model cannot read is refused by its number and text."""
    texts = texts_of(texts, what)
    encoded = []
    for n, text in enumerate(texts):
        try:
            encoded.append(pretrained.encode(text))
        except ValueError as error:
            if len(texts) == 1:
                raise
            raise ValueError(f"{prompt_name(n, text)}: {error}") from None
    return texts, encoded


def prompt_name(n: int, text: str) -> str:
    """How an error names prompt n: 'prompt 3 ("The bank of the …")'."""
    line = " ".join(text.split())
    return f"prompt {n} ({line if len(line) <= 40 else line[:39] + '…'!r})"


def prompt_groups(stack, lengths: list[int], per_token: int = 0):
    """Prompt indices in padded batches of similar lengths, each batch's clean run (every
    layer's input, head outputs, keys and values: about 6 (L + 1) C numbers a token) within
    MASK_BUDGET numbers (`qkv.inspect.prompts.groups`). per_token: what else a token costs."""
    C, L = stack.config.block.width, stack.config.num_layers
    return groups(lengths, 6 * (L + 1) * C + per_token, MASK_BUDGET)


@dataclass
class Rows:
    """One forward pass of a stack over B prompts right-padded to T tokens (`run`'s batch):
    a decoder's real tokens never see the padding after them, an encoder's are kept from it
    by `mask`. Read each row at its real positions only (`lengths`)."""

    ids: Tensor  # (B, T)
    lengths: list[int]
    mask: Tensor | None  # (B, T) 1 = real token: an encoder's key padding; None for a decoder
    inputs: list[Tensor]  # L + 1 tensors (B, T, C)
    states: Tensor  # (B, T, C) after the final norm
    head_outputs: list[Tensor] = field(default_factory=list)  # L tensors (B, H, T, D)
    keys: list[Tensor] = field(default_factory=list)  # decoders: L tensors (B, Hkv, T, D)
    values: list[Tensor] = field(default_factory=list)


def padded_ids(pretrained, stack, rows: list[list[int]]) -> tuple[Tensor, Tensor | None]:
    """ids (B, T) right-padded with the tokenizer's pad id (RoBERTa's positions skip it), and
    an encoder's key-padding mask (B, T), None where no row is padded or for a decoder."""
    ids, mask = pretrained.tokenizer.pad(rows, padding_side="right")
    if isinstance(stack, Decoder) or bool(mask.all()):
        return ids, None
    return ids, mask


def forward_rows(stack, ids: Tensor, mask: Tensor | None, edits: Edits | None = None, **kwargs):
    """The stack's forward over padded rows: a decoder's with no mask and no LM head."""
    if isinstance(stack, Decoder):
        return stack(ids, edits=edits, logits=False, **kwargs)
    return stack(ids, attention_mask=mask, edits=edits, **kwargs)


def run_rows(stack, ids: Tensor, mask: Tensor | None, lengths: list[int], records: bool) -> Rows:
    """The clean run over padded rows; records: keep every layer's head outputs (and a
    decoder's keys and values, which a resumed run's cache reads)."""
    out = forward_rows(stack, ids, mask, layers="all" if records else None, hidden_states=True)
    found = Rows(ids, lengths, mask, out.hidden_states, out.hidden)
    if records:
        kept = [out.records[n] for n in range(len(stack.blocks))]
        check_head_outputs(out.records, "an intervention")
        found.head_outputs = [record.out for record in kept]
        if isinstance(stack, Decoder):
            found.keys, found.values = [r.k for r in kept], [r.v for r in kept]
    return found


def resumed_rows(
    stack, clean: Rows, layer: int, edits: Edits, index: Tensor, start: int = 0
) -> Tensor:
    """`resumed` over padded rows: the final vectors (R, T, C) of runs from `layer` on, row r
    starting from clean row index[r]'s residual stream there, with `edits` (row r's in row r).
    start (decoders): the first position any row's edit can change (see `resumed`)."""
    ids = clean.ids[index]  # (R, T)
    if start == 0:
        mask = None if clean.mask is None else clean.mask[index]
        if isinstance(stack, Decoder):  # a layer may read an earlier one's keys (Gemma 4)
            layer = stack.resume_from(layer)
        return forward_rows(
            stack, ids, mask, edits, resume=(layer, clean.inputs[layer][index])
        ).hidden
    assert isinstance(stack, Decoder), "only a decoder's earlier positions are left as they were"
    rows = len(index)
    cache = stack.new_cache()
    if all(type(c) is KVCache for c in cache.layers):
        for n, (keys, values) in enumerate(zip(clean.keys, clean.values, strict=True)):
            cache.layers[n] = KVCache.holding(keys[index, :, :start], values[index, :, :start])
    else:  # a latent layer caches compressed vectors, which no record keeps: run the prefix
        stack(ids[:, :start], cache=cache, logits=False)
    x = clean.inputs[layer][index, start:]
    after = stack(ids[:, start:], edits=edits, resume=(layer, x), cache=cache, logits=False).hidden
    before = clean.states[index, :start]
    assert before.shape[0] == rows
    return torch.cat([before, after], dim=1)


# ---------------------------------------------------------------------------- statistics


def spreads_of(values: dict[str, Tensor]) -> dict[str, Spread]:
    """Per-prompt values (N, *cell) by name -> their `Spread`s (mean, seeded bootstrap 95%
    interval), the names kept."""
    return {name: Spread.of(v) for name, v in values.items()}


def spreads_dict(spreads: dict[str, Spread]) -> dict:
    """JSON-ready: each name's per-prompt values, mean and interval (None where NaN)."""
    return {name: spread.to_dict() for name, spread in spreads.items()}


def number(x: float) -> float | None:
    """A float for JSON: None where it is NaN (not computed)."""
    return None if x != x else float(x)
