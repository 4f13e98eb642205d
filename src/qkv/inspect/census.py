"""A census of heads: what each layer's heads do on built-in prompts, read from the records.

Every (layer, head) gets six scores, each a mean over query tokens i >= 1 (query 0 is left
out: in a decoder it can attend to nothing but itself):

- previous_token: the weight from query i on key i - 1, on short English sentences;
- induction: on rows of random tokens repeated twice (x_0 .. x_n-1 x_0 .. x_n-1), the weight
  from a second-half position on the key just after the earlier occurrence of its token
  (query n + k on key k + 1): the head that completes "A B ... A -> B";
- first_token: the weight on key 0 (an "attention sink": a head parked on the first token);
- self: the weight on the query's own position (the diagonal);
- entropy: the entropy of the query's row, in nats (0: one key; log(keys): uniform);
- window_use (layers with a sliding window only): the mean distance |i - j| the weight goes,
  as a share of the farthest key the query could see (1: all on the farthest key).

A linear layer (a running memory, no softmax: `qkv.attention.linear`) has effective weights,
signed and not summing to 1: its scores are read on each row's shares of the absolute
effective weight, |w| / sum |w| (`shares`), and `effective` marks those layers. A layer of
compressed attention (DeepSeek-V4's) is read on the words, each entry's weight spread over its
block by the compressor's coefficients averaged over channels (an attribution), and
`compressed` marks those layers.

`rollout` and `flow` are Abnar and Zuidema's (2020) "Quantifying Attention Flow in
Transformers": how much each output token draws on each input token across all layers.

>>> import qkv
>>> census = heads(qkv.load("minilm"), prompts=["The bank of the river."], rows=1, length=8)
>>> census.previous_token.shape  # (L, H)
torch.Size([6, 12])
>>> census.top("previous_token", 1)[0][:2]  # (layer, head): MiniLM reads the token before
(0, 2)
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import torch
from torch import Tensor

from qkv.inspect.layer_heads import heads_per_layer, nan_grid
from qkv.inspect.prompts import Spread, groups, padded
from qkv.inspect.rollout import (  # noqa: F401 (the census's, re-exported under its names)
    FLOW_MAX_TOKENS,
    TextRollout,
    flow,
    rollout,
    text_rollout,
)
from qkv.inspect.runs import MASK_BUDGET, encoded_prompts, prompt_name, spreads_dict, spreads_of
from qkv.inspect.words import on_words
from qkv.models import Decoder, self_attention_stack
from qkv.views import Shown

# Short natural sentences: previous-token, sink, self, entropy and window use are read here.
PROMPTS = (
    "The bank on the side of the river was covered in soft green grass.",
    "She paid the money into her account at the bank on Monday morning.",
    "A small boat drifted slowly down the wide river towards the sea.",
    "The children laughed as the dog chased a red ball across the park.",
    "After the storm, the old bridge over the stream had to be closed.",
    "He read the letter twice before he finally put it back in the drawer.",
)
SCORES = ("previous_token", "induction", "first_token", "self", "entropy", "window_use")


@dataclass(repr=False)
class Census(Shown):
    """Per (layer, head) scores (L, H), float64, layers and heads counted from 0; H is the
    most heads any layer has, and a layer with fewer has NaN in the rest (None in JSON).
    Each score is the mean over the prompts of each prompt's own mean over its queries
    (induction: over the random rows), with each prompt's in `spreads`."""

    view: ClassVar[str] = "census"  # drawn by qkv.viz.notebook_interventions

    source: str
    prompts: list[str]  # the sentences, or "ids 0", "ids 1", ... for token ids given directly
    induction_rows: int  # how many rows of repeated random tokens
    induction_length: int  # n: each row is n random tokens, then the same n again
    seed: int | None  # the random tokens' seed, None for ids given directly
    previous_token: Tensor  # (L, H) mean weight on key i - 1
    induction: Tensor  # (L, H) mean weight on key i - n + 1 in the repeated half
    first_token: Tensor  # (L, H) mean weight on key 0
    self_attention: Tensor  # (L, H) mean weight on key i
    entropy: Tensor  # (L, H) mean row entropy, nats
    windows: list[int | None]  # each layer's sliding window, None for a full layer
    window_use: list[Tensor | None]  # per layer (H,) for windowed layers, else None
    # per layer, True where its scores are read on effective weights (linear attention): shares
    # of each row's absolute effective weight, |w| / sum |w|, not a softmax's weights
    effective: list[bool] | None = None
    # per layer, True where its scores are read on the words through the compressor (DeepSeek-V4)
    compressed: list[bool] | None = None
    # each prompt's scores (N, L, H) (induction: each random row's), their mean (the grids
    # above) and a bootstrap 95% interval, by score name (window_use: (N, L, H), NaN in
    # layers without a window)
    spreads: dict[str, Spread] = field(default_factory=dict)

    @property
    def sink_per_layer(self) -> Tensor:
        """(L,) each layer's first-token mass, the mean over its heads."""
        return self.first_token.nanmean(1)

    def effective_words(self) -> str | None:
        """Which layers' scores are read on effective weights, in words; None where none."""
        said = []
        layers = [n for n, linear in enumerate(self.effective or []) if linear]
        if layers:
            named = ", ".join(str(n) for n in layers)
            said.append(
                f"layer{'s' if len(layers) > 1 else ''} {named}: effective weights "
                "(linear attention), scores read on each row's shares |w| / sum |w|"
            )
        layers = [n for n, compressed in enumerate(self.compressed or []) if compressed]
        if layers:
            named = ", ".join(str(n) for n in layers)
            said.append(
                f"layer{'s' if len(layers) > 1 else ''} {named}: compressed entries' "
                "weights read on their words by the compressor's coefficients, averaged "
                "over channels (an attribution)"
            )
        return "; ".join(said) or None

    def scores(self, name: str) -> Tensor:
        """One score's (L, H) grid; window_use is NaN in layers without a window."""
        if name not in SCORES:
            raise ValueError(f"unknown score {name!r}; the scores are {', '.join(SCORES)}")
        if name == "window_use":
            H = self.previous_token.shape[1]
            rows = [torch.full((H,), math.nan, dtype=torch.float64) if use is None else use
                    for use in self.window_use]  # fmt: skip
            return torch.stack(rows)
        return getattr(self, "self_attention" if name == "self" else name)

    def top(self, name: str, k: int = 5) -> list[tuple[int, int, float]]:
        """The k heads that score highest on `name` (lowest for entropy: the most focused),
        as (layer, head, score), best first; layers without a window are left out of
        window_use."""
        if not isinstance(k, int) or k < 1:
            raise ValueError(f"k must be a whole number >= 1, got {k!r}")
        grid = self.scores(name)
        H = grid.shape[1]
        flat = grid.flatten()
        keep = torch.nonzero(~flat.isnan()).flatten()
        order = flat[keep].argsort(descending=name != "entropy", stable=True)[:k]
        return [(*divmod(int(keep[i]), H), float(flat[keep[i]])) for i in order]

    def to_dict(self, k: int = 5) -> dict:
        """JSON-ready (see docs/heads.md): lists of floats, None for a layer without a window."""
        L, H = self.previous_token.shape
        return {
            "source": self.source,
            "layers": L,
            "heads": H,
            "heads_per_layer": [int((~row.isnan()).sum()) for row in self.previous_token],
            "prompts": list(self.prompts),
            "induction": {
                "rows": self.induction_rows,
                "length": self.induction_length,
                "seed": self.seed,
            },
            "windows": list(self.windows),
            "scores": {
                "previous_token": _listed(self.previous_token),
                "induction": _listed(self.induction),
                "first_token": _listed(self.first_token),
                "self": _listed(self.self_attention),
                "entropy": _listed(self.entropy),
                "window_use": [None if use is None else _listed(use) for use in self.window_use],
            },
            "effective_weights": list(self.effective or [False] * L),
            "spreads": spreads_dict(self.spreads),
            "first_token_per_layer": self.sink_per_layer.tolist(),
            "top": {
                name: [{"layer": lh[0], "head": lh[1], "score": lh[2]} for lh in self.top(name, k)]
                for name in SCORES
            },
        }


def heads(
    pretrained,
    *,
    prompts: Sequence[str] | Path | None = None,
    rows: int = 4,
    length: int = 20,
    seed: int = 0,
) -> Census:
    """The census of `pretrained`'s heads: `PROMPTS` (or `prompts`: a list of texts or a file,
    text lines, TSV or JSONL) and `rows` rows of `length` random tokens repeated twice
    (seeded), in padded batches, every layer recorded. An encoder-decoder's encoder is
    counted.
    """
    stack = self_attention_stack(pretrained.model, "the census", pretrained.source)
    texts, encoded = encoded_prompts(pretrained, list(PROMPTS) if prompts is None else prompts,
                                     "prompts")  # fmt: skip
    ids = []
    for i, (text, found) in enumerate(zip(texts, encoded, strict=True)):
        if len(found.ids) < 2:
            raise ValueError(f"{prompt_name(i, text)} has {len(found.ids)} token; give 2 or more")
        ids.append(found.ids)
    marked = pretrained.tokenizer.encode("a")  # the model's own markers, e.g. [CLS] a [SEP]
    first = marked.special.index(False)
    last = len(marked.ids) - marked.special[::-1].index(False)
    prefix, suffix = marked.ids[:first], marked.ids[last:]
    if len(prefix) + 2 * length + len(suffix) > pretrained.context_window:
        raise ValueError(
            f"2 x {length} random tokens exceed {pretrained.source}'s context window of "
            f"{pretrained.context_window}; give a smaller length"
        )
    pool = ordinary_ids(pretrained.tokenizer, stack.config.vocab_size)
    repeated = induction_ids(pool, rows, length, seed, prefix=prefix, suffix=suffix)
    census = census_of(stack, ids, repeated, start=len(prefix), length=length,
                       source=pretrained.source)  # fmt: skip
    census.prompts, census.seed = texts, seed
    return census


def census_of(
    model,
    prompts: Sequence[Sequence[int]],
    repeated: Tensor,
    *,
    start: int = 0,
    length: int | None = None,
    source: str = "the model",
) -> Census:
    """The census from token ids, no tokenizer needed: `prompts`, one list of ids per
    prompt (2 tokens at least), and `repeated` (B, T) rows whose tokens start..start+length
    are repeated at start+length..start+2*length (length: (T - start) // 2 by default).

    >>> from qkv.models import DecoderConfig
    >>> from qkv.nn import BlockConfig
    >>> toy = Decoder(DecoderConfig(vocab_size=20, num_layers=2, block=BlockConfig(8, 2)))
    >>> rows = induction_ids(range(20), rows=2, length=5, seed=0)
    >>> census_of(toy, [[1, 2, 3]], rows).induction.shape
    torch.Size([2, 2])
    """
    stack = self_attention_stack(model, "the census", source)
    if not isinstance(repeated, Tensor) or repeated.dim() != 2:
        raise ValueError("repeated must be a (B, T) tensor of token ids")
    T = repeated.shape[1]
    length = (T - start) // 2 if length is None else length
    if length < 2 or start < 0 or start + 2 * length > T:
        raise ValueError(
            f"repeated rows of {T} tokens cannot hold 2 x {length} tokens from position {start}"
        )
    first, second = repeated[:, start : start + length], repeated[:, start + length :]
    if not (first == second[:, :length]).all():
        raise ValueError("the second half of each repeated row must equal its first half")
    if isinstance(prompts, Tensor | str) or not prompts:
        raise ValueError("prompts must be a non-empty list of token id lists")
    for i, row in enumerate(prompts):
        if len(row) < 2:
            raise ValueError(f"prompt {i} has {len(row)} token; give 2 or more")
    L, counts = stack.config.num_layers, heads_per_layer(stack)  # each layer's own count
    N, H = len(prompts), max(counts)
    # each prompt's scores, NaN where a layer has fewer heads (and window use where no window)
    values = {name: nan_grid(counts).expand(N, L, H).clone() for name in SCORES}
    values["window_use"].fill_(math.nan)  # filled in the layers with a window only
    windows: list[int | None] = [None] * L
    effective, compressed = [False] * L, [False] * L
    lengths = [len(row) for row in prompts]
    pad = getattr(stack.config, "position_padding", None) or 0  # RoBERTa's positions skip it
    with torch.inference_mode():
        # a token's share of a batch: every layer's record (q, k, v, out) and a layer's weights
        per_token = 4 * L * stack.config.block.width + 2 * H * max(lengths)
        for group in groups(lengths, per_token, MASK_BUDGET):
            ids, own = padded([prompts[i] for i in group], pad)  # (B, T) right-padded
            mask = None
            if not isinstance(stack, Decoder) and bool((own < ids.shape[1]).any()):
                mask = (torch.arange(ids.shape[1])[None] < own[:, None]).long()  # (B, T)
            for layer, record in _records(stack, ids, mask).items():
                W = _weights(record)  # (B, H_layer, T, T)
                heads_of = slice(0, W.shape[1])  # the layer's heads
                windows[layer] = record.window
                effective[layer] = record.linear is not None
                compressed[layer] = record.compressed is not None
                for b, p in enumerate(group):
                    n = int(own[b])
                    allowed = record.allowed
                    allowed = allowed[b if allowed.shape[0] > 1 else 0, ..., :n, :n]
                    scores = _scores(W[b, :, :n, :n], allowed, record.window)
                    for name, score in scores.items():
                        values[name][p, layer, heads_of] = score
        q = torch.arange(start + length, start + 2 * length)  # the second half's queries
        values["induction"] = nan_grid(counts).expand(len(repeated), L, H).clone()
        for layer, record in _records(stack, repeated).items():
            W = _weights(record)  # (B, H_layer, T, T)
            values["induction"][:, layer, : W.shape[1]] = W[:, :, q, q - length + 1].mean(2)
    spreads = spreads_of(values)
    mean = {name: spread.mean for name, spread in spreads.items()}
    # a window of 1 lets each query see only itself: no distance to use, so None as well
    use = [None if windows[n] is None or bool(mean["window_use"][n].isnan().all())
           else mean["window_use"][n] for n in range(L)]  # fmt: skip
    return Census(
        source=source,
        prompts=[f"ids {i}" for i in range(len(prompts))],
        induction_rows=repeated.shape[0],
        induction_length=length,
        seed=None,
        previous_token=mean["previous_token"],
        induction=mean["induction"],
        first_token=mean["first_token"],
        self_attention=mean["self"],
        entropy=mean["entropy"],
        windows=windows,
        window_use=use,
        effective=effective,
        compressed=compressed,
        spreads=spreads,
    )


def _scores(W: Tensor, allowed: Tensor, window: int | None) -> dict[str, Tensor]:
    """One prompt's scores (H,) from its weights W (H, n, n) float64: each the mean over
    queries 1..n-1 (window use: over those that could see another key; NaN where none)."""
    rows = W[:, 1:]  # (H, n-1, n): queries 1..n-1
    queries = W.shape[-1] - 1
    found = {
        "previous_token": W.diagonal(-1, -2, -1).sum(-1) / queries,
        "first_token": rows[..., 0].sum(-1) / queries,
        "self": W.diagonal(0, -2, -1)[:, 1:].sum(-1) / queries,
        "entropy": -torch.special.xlogy(rows, rows).sum((-1, -2)) / queries,
    }
    if window is not None:
        use, counted = _window_use(W, allowed)
        found["window_use"] = torch.where(counted > 0, use / counted.clamp(min=1), math.nan)
    return found


def _listed(scores: Tensor) -> list:
    """Scores as lists, None where a layer has no such head (NaN)."""
    return [_listed(row) for row in scores] if scores.dim() > 1 else [
        None if v != v else v for v in scores.tolist()]  # fmt: skip


def shares(weights: Tensor) -> Tensor:
    """Each row's shares of its absolute weight, |w| / sum |w| (a row of zeros stays zeros):
    how a census reads a linear layer's signed effective weights.

    >>> shares(torch.tensor([[0.5, -1.5, 0.0]])).tolist()
    [[0.25, 0.75, 0.0]]
    """
    size = weights.abs()
    total = size.sum(-1, keepdim=True)
    return torch.where(total > 0, size / total.clamp(min=torch.finfo(size.dtype).tiny), 0.0)


def _weights(record) -> Tensor:
    """A record's weights (B, H, T, T) float64 on the words (a compressed layer's entries
    spread over their blocks, `qkv.inspect.words`); a linear layer's as `shares` of its
    effective weights."""
    W = on_words(record).double()
    return shares(W) if record.linear is not None else W


def _records(stack, ids: Tensor, mask: Tensor | None = None) -> dict:
    """Every layer's record over ids (B, T): a decoder's right padding needs no mask (its
    real tokens never see it), an encoder's its key-padding mask (B, T)."""
    if isinstance(stack, Decoder):
        return stack(ids, layers="all", logits=False).records
    return stack(ids, layers="all", attention_mask=mask).records


def _window_use(W: Tensor, allowed: Tensor) -> tuple[Tensor, Tensor]:
    """Summed window use over queries i >= 1 that could see a key other than themselves, and
    how many there were. W (H, T, T); allowed (H or 1, T, T), True where a query saw a key.
    A query's use: sum_j W[i, j] |i - j| over the largest |i - j| it was allowed."""
    T = W.shape[-1]
    distance = (torch.arange(T)[:, None] - torch.arange(T)[None]).abs().double()  # (T, T)
    farthest = (distance * allowed).amax(-1).expand(W.shape[0], T)  # (H, T)
    attended = (W * distance).sum(-1)  # (H, T)
    counted = farthest[:, 1:] > 0
    use = torch.where(counted, attended[:, 1:] / farthest[:, 1:].clamp(min=1), 0.0)
    return use.sum(-1), counted.sum(-1).double()


def ordinary_ids(tokenizer, vocab_size: int) -> list[int]:
    """Token ids below vocab_size that are neither special nor placeholders ("[unused3]",
    "<|endoftext|>"): the pool random rows are drawn from."""
    special = tokenizer.special_ids
    pool = []
    for i in range(min(vocab_size, tokenizer.vocab_size)):
        token = tokenizer.id_to_token(i) or ""
        marker = (token[:1], token[-1:]) in (("[", "]"), ("<", ">")) and len(token) > 2
        if i not in special and token and not marker:
            pool.append(i)
    return pool


def induction_ids(
    pool: Sequence[int], rows: int, length: int, seed: int, *,
    prefix: Sequence[int] = (), suffix: Sequence[int] = (),
) -> Tensor:  # fmt: skip
    """(rows, P + 2 * length + S) token ids: `prefix`, `length` ids drawn from `pool`
    (seeded, with replacement), the same ids again, `suffix`.

    >>> induction_ids(range(100), rows=1, length=3, seed=0, prefix=[7])[0, 1:].tolist()[:3] \\
    ...     == induction_ids(range(100), rows=1, length=3, seed=0, prefix=[7])[0, 4:].tolist()
    True
    """
    if not isinstance(rows, int) or rows < 1 or not isinstance(length, int) or length < 2:
        raise ValueError(f"rows must be >= 1 and length >= 2, got rows={rows!r}, length={length!r}")
    pool = torch.as_tensor(list(pool))
    if len(pool) < 2:
        raise ValueError("the pool of token ids to draw from has fewer than 2 ids")
    generator = torch.Generator().manual_seed(seed)
    half = pool[torch.randint(len(pool), (rows, length), generator=generator)]  # (B, n)
    ends = [torch.tensor([list(end)] * rows, dtype=torch.long).reshape(rows, -1)
            for end in (prefix, suffix)]  # fmt: skip
    return torch.cat([ends[0], half, half, ends[1]], dim=1)  # (B, P + 2n + S)
