"""The attention a generation ran on, recorded as it decodes: what `Pretrained.generate(...,
record=...)` keeps and returns.

`decode_steps` hands every forward pass's records to a keeper (`RowKeeper`: the weights'
rows; `SummaryKeeper`: a few numbers per row) and drops them; `GenerationAttention` is the
generation with the rows that chose each of its tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from qkv.attention.inputs import check_indices
from qkv.attention.linear import compute_dtype, effective_row
from qkv.generate import Sampling, continuations, decode_steps
from qkv.inspect import summaries
from qkv.inspect.layer_heads import check_heads, heads_per_layer, weights_of
from qkv.models.deepseek_v4 import DeepseekV4Decoder
from qkv.nn import AttentionRecord
from qkv.views import Shown

# The most bytes of weights `Pretrained.generate(record=...)` may keep: the prompt's rows
# (L', H', P, P) and one row (L', H', Tk) per generated token, counted for max_new_tokens
# before any step runs. 1 GiB: SmolLM2's 30 layers x 9 heads over a 100-token prompt and 500
# new tokens keep about 0.4 GiB.
RECORD_MAX_BYTES = 2**30


@dataclass(frozen=True)
class Recording:
    """What `Pretrained.generate(..., record=...)` keeps of the attention while it generates.

    layers: the layers whose self-attention is kept ("all", or indices counted from 0); heads:
    their query heads kept (all if None); summaries: keep each row's summaries (its entropy,
    its weight on token 0, its top_k keys and their weights: `GenerationSummaries`) instead
    of its weights, so that a long prompt or generation keeps a few numbers per row, not
    every weight. generate also takes "all" for Recording(), "summaries" for
    Recording(summaries=True), a list of layers for Recording(layers=...), and a dict of
    these fields ({"layers": [...], "heads": [...], "summaries": True}).

    >>> Recording.of([0, 2]), Recording.of({"heads": [1]}).heads, Recording.of("summaries").top_k
    (Recording(layers=[0, 2], heads=None, summaries=False, top_k=5), [1], 5)
    """

    layers: str | Sequence[int] = "all"
    heads: Sequence[int] | None = None
    summaries: bool = False
    top_k: int = 5  # keys kept per row, with summaries

    @classmethod
    def of(cls, record) -> Recording:
        """A Recording from what generate's `record` takes; a clear error for anything else."""
        if isinstance(record, Recording):
            return record
        if isinstance(record, str):
            if record not in ("all", "summaries"):
                raise ValueError(f"record takes 'all', 'summaries', a list of layers or a "
                                 f"Recording, not {record!r}")  # fmt: skip
            return cls(summaries=record == "summaries")
        if isinstance(record, dict):
            unknown = sorted(set(record) - {"layers", "heads", "summaries", "top_k"})
            if unknown:
                raise ValueError(f"record's keys are 'layers', 'heads', 'summaries' and "
                                 f"'top_k', not {unknown[0]!r}")  # fmt: skip
            return cls(**record)
        return cls(layers=list(record) if isinstance(record, Sequence | range) else record)

    def resolve(self, num_layers: int, num_heads: int | Sequence[int],
                owner: str) -> tuple[list[int], list[int]]:  # fmt: skip
        """The layers and heads asked, sorted, each checked against the model's counts:
        num_heads, or each layer's own (`heads_per_layer`: a head some layer asked has)."""
        every = isinstance(self.layers, str) and self.layers == "all"
        if isinstance(self.layers, str) and not every:
            raise ValueError(f"record's layers are 'all' or indices, not {self.layers!r}")
        layers = check_indices("layer", None if every else self.layers, num_layers, owner)
        if isinstance(num_heads, int):
            heads = check_indices("head", self.heads, num_heads, owner)
        else:  # layers of different head counts (Qwen3.5's)
            heads = check_heads(self.heads, layers, num_heads, owner) if layers else []
        if type(self.summaries) is not bool:
            raise ValueError(f"record's summaries is True or False, not {self.summaries!r}")
        if type(self.top_k) is not int or self.top_k < 1:
            raise ValueError(f"record's top_k must be a whole number >= 1, got {self.top_k!r}")
        if not layers or not heads:
            raise ValueError("record asks no layer or no head; leave layers or heads out for all")
        return sorted(set(layers)), sorted(set(heads))


def recorded_bytes(layers: int, heads: int, prompt: int, new: int, itemsize: int = 4) -> int:
    """What recording `layers` x `heads` while generating `new` tokens after `prompt` keeps:
    the prompt's (P, P) rows, then one row of P + j weights for each generated token j >= 1.

    >>> recorded_bytes(1, 1, 3, 2)  # 9 weights for the prompt, 4 for the second new token
    52
    """
    weights = prompt * prompt + (new - 1) * prompt + new * (new - 1) // 2
    return layers * heads * weights * itemsize


def check_recording_size(layers: int, heads: int, prompt: int, new: int, itemsize: int = 4):
    """Refuse, by name, a recording larger than RECORD_MAX_BYTES."""
    size = recorded_bytes(layers, heads, prompt, new, itemsize)
    if size > RECORD_MAX_BYTES:
        raise ValueError(
            f"recording {layers} layers x {heads} heads over {prompt} prompt tokens and "
            f"{new} new ones keeps up to {_bytes(size)} of weights, more than the "
            f"{_bytes(RECORD_MAX_BYTES)} limit (qkv.inspect.generation.RECORD_MAX_BYTES); record "
            "fewer layers or heads, or generate fewer tokens"
        )


def _bytes(size: int) -> str:
    """1073741824 -> '1.0 GiB', 2097152 -> '2.0 MiB', 144 -> '144 bytes'."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if size >= scale:
            return f"{size / scale:.1f} {unit}"
    return f"{size} bytes"


class RowKeeper:
    """The `keep` of decode_steps: reads the weights of each forward pass's records as they
    come and drops the records, so what stays is the prompt's rows (L', H', P, P) and, for
    each fed-back token, its one row (L', H', Tk)."""

    def __init__(self, layers: list[int], heads: list[int]):
        self.layers, self.heads = layers, heads
        self.prompt: Tensor | None = None
        self.steps: list[Tensor] = []
        # a linear layer's record while decoding holds the new token alone (the rest is in its
        # memory): its keys, write strengths and fades so far, to walk each new row back over
        self.written: dict[int, tuple[Tensor, Tensor, Tensor]] = {}

    def __call__(self, records: dict[int, AttentionRecord]) -> None:
        rows = torch.stack([self._rows(n, records[n]) for n in self.layers])
        if self.prompt is None:
            self.prompt = rows  # (L', H', P, P)
        else:
            self.steps.append(rows[:, :, -1])  # (L', H', Tk): the fed-back token's row

    def _rows(self, layer: int, record: AttentionRecord) -> Tensor:
        """(H', Tq, Tk): the layer's rows of this forward pass over every token so far."""
        if record.linear is None:
            return weights_of(record, self.heads)  # NaN for a head the layer lacks
        have = [i for i, h in enumerate(self.heads) if h < record.shape.H]
        index = torch.tensor([self.heads[i] for i in have], device=record.q.device)
        k, beta, decay = (t.index_select(1, index) for t in
                          (record.k, record.linear.beta, record.linear.decay))  # fmt: skip
        if layer in self.written:
            k, beta, decay = (
                torch.cat([old, new], dim=2)
                for old, new in zip(self.written[layer], (k, beta, decay), strict=True)
            )
        self.written[layer] = (k, beta, decay)  # every token's so far, of the heads it has
        if self.prompt is None:  # the prompt's forward pass: its record has every row
            return weights_of(record, self.heads)
        q = record.q.index_select(1, index)[:, :, -1]  # (B, H'', Dk): the newest token's
        row = effective_row(q, k, beta=beta, decay=decay, scale=record.scale)  # (B, H'', Tk)
        out = row.new_full((len(self.heads), 1, row.shape[-1]), float("nan"))
        out[have] = row[0, :, None, :]
        return out.to(compute_dtype(record.q.dtype))


class SummaryKeeper:
    """The `keep` of decode_steps for Recording(summaries=True): each row's summaries, never
    its weights beyond the moment they are read. The prompt's rows are summarized a chunk of
    queries at a time (`qkv.inspect.summaries.summarize`), each fed-back token's from its one
    row, so what stays grows with the rows times top_k, not with their length."""

    def __init__(self, layers: list[int], heads: list[int], top_k: int):
        self.layers, self.heads, self.top_k = layers, heads, top_k
        self.parts: list[tuple[Tensor, Tensor, Tensor, Tensor]] = []

    def __call__(self, records: dict[int, AttentionRecord]) -> None:
        if not self.parts:  # the prompt's forward pass: P rows, a chunk at a time
            s = summaries.summarize({n: records[n] for n in self.layers}, heads=self.heads,
                                    top_k=self.top_k, bins=1, chunk=summaries.CHUNK)  # fmt: skip
            self.k = s.top_keys.shape[-1]  # min(top_k, P): every later row has more keys
            self.parts.append((s.entropy, s.first_token_mass, s.top_keys, s.top_weights))
        else:  # (L', H', 1, Tk): the fed-back token's row
            rows = torch.stack([records[n].weights(self.heads)[0, :, -1:] for n in self.layers])
            entropy, first, keys, weights = summaries.row_summaries(rows, self.k)
            self.parts.append((entropy, first, keys, weights))

    def summaries(self) -> GenerationSummaries:
        columns = zip(*self.parts, strict=True)  # entropy, first_token_mass, keys, weights
        return GenerationSummaries(*(torch.cat(column, dim=2) for column in columns))


@dataclass(eq=False)
class GenerationSummaries:
    """The summaries of every row a generation's attention computed (docs/long.md): row i is
    the query at position i, the prompt's P rows from its one forward pass and then each
    fed-back token's; generated token j was chosen by row P - 1 + j. Each row's weights
    are the ones `weights` of a recording without summaries holds, over keys 0..i."""

    entropy: Tensor  # (L', H', R) -sum w log w of each row's weights, in nats
    first_token_mass: Tensor  # (L', H', R) each row's weight on token 0
    top_keys: Tensor  # (L', H', R, k) long: each row's k strongest keys, strongest first
    top_weights: Tensor  # (L', H', R, k) their weights

    def to_dict(self) -> dict:
        return {name: getattr(self, name).tolist() for name in
                ("entropy", "first_token_mass", "top_keys", "top_weights")}  # fmt: skip

    def first(self, rows: int) -> GenerationSummaries:
        """The summaries of rows 0..rows-1 alone (a generation cut at a stop string)."""
        kept = (self.entropy, self.first_token_mass, self.top_keys, self.top_weights)
        return GenerationSummaries(*(column[:, :, :rows] for column in kept))


@dataclass(eq=False, repr=False)
class GenerationAttention(Shown):
    """A generation and the attention it ran on, read from the layers' records as it decoded.

    The final sequence is the prompt's P tokens, then every token generated up to the end of
    `text` (what generate returns without `record`): an end-of-sequence token is included
    (its row is why the generation ended), a stop string's tokens are not, nor a token that
    the cut at the stop string splits. Generated token j (counted from 0, at position P + j)
    was chosen by the query at position P + j - 1, the token before it: `row(j)`
    (L', H', P + j) is that query's attention over every token before token j, as
    `transformers` keeps it in `generate(output_attentions=True)`. `weights`
    (L', H', T - 1, T - 1) holds every row the model computed for it, the prompt's from its
    one forward pass: it equals, to float rounding, one forward pass over the final sequence
    without its last token, which the model chose but never read.
    """

    view: ClassVar[str] = "generation"  # drawn by qkv.viz.notebook

    text: str
    ids: list[int]  # (T,) the final sequence: the prompt's tokens, then the generated ones
    tokens: list[str]  # the tokens' names in the vocabulary
    pieces: list[str]  # each token's own text, as the page shows it
    prompt_length: int  # P
    layers: list[int]  # counted from 0, the order of the weights' first axis
    heads: list[int]  # counted from 0, the order of their second axis
    prompt: Tensor | None  # (L', H', P, P) the prompt's rows, from the forward pass that read it
    steps: list[Tensor]  # (L', H', P + j) for j = 1 .. generated - 1: each fed-back token's row
    # with Recording(summaries=True): the rows' summaries, and no prompt or steps
    summaries: GenerationSummaries | None = None

    @property
    def generated(self) -> int:
        """How many tokens were generated."""
        return len(self.ids) - self.prompt_length

    def row(self, token: int) -> Tensor:
        """(L', H', P + token): the attention that chose generated token `token` (from 0)."""
        (token,) = check_indices("generated token", [token], self.generated, "this generation")
        self._rows_kept()
        return self.prompt[:, :, -1] if token == 0 else self.steps[token - 1]

    def summary(self, token: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Of the row that chose generated token `token` (from 0), with summaries: its
        entropy (L', H'), weight on token 0 (L', H'), top keys and their weights (L', H', k)."""
        (token,) = check_indices("generated token", [token], self.generated, "this generation")
        if self.summaries is None:
            raise ValueError("this generation kept its rows, not summaries: record with "
                             "Recording(summaries=True) for them, or read row(j)")  # fmt: skip
        s, i = self.summaries, self.prompt_length - 1 + token
        return (s.entropy[:, :, i], s.first_token_mass[:, :, i], s.top_keys[:, :, i],
                s.top_weights[:, :, i])  # fmt: skip

    def _rows_kept(self) -> None:
        if self.prompt is None:
            raise ValueError(
                "this generation kept summaries (record=Recording(summaries=True)), not its "
                "weights: read .summary(j), or record without summaries"
            )

    @property
    def weights(self) -> Tensor:
        """(L', H', T - 1, T - 1): row i is token i's attention over tokens 0..i (0 after)."""
        self._rows_kept()
        P, T = self.prompt_length, len(self.ids)
        n = P + len(self.steps)  # T - 1, or P when a stop string left no generated token
        out = self.prompt.new_zeros(*self.prompt.shape[:2], n, n)
        out[:, :, :P, :P] = self.prompt
        for j, row in enumerate(self.steps, start=1):
            out[:, :, P + j - 1, : P + j] = row
        return out[:, :, : T - 1, : T - 1]

    def to_dict(self) -> dict:
        """Every number, for JSON: rows[j][l][h] is row(j) of layer layers[l], head heads[h]."""
        return {
            "text": self.text, "ids": self.ids, "tokens": self.tokens, "pieces": self.pieces,
            "prompt_length": self.prompt_length, "layers": self.layers, "heads": self.heads,
            **({"summaries": self.summaries.to_dict()} if self.summaries is not None else {
                "prompt": self.prompt.tolist(),
                "rows": [self.row(j).tolist() for j in range(self.generated)]}),
        }  # fmt: skip


def generate_recorded(
    model,
    ids: Tensor,
    recording: Recording,
    sampling: Sampling,
    max_new_tokens: int,
    *,
    tokenizer,
    eos: set[int],
    stop: list[str],
    stream: Callable[[int, str], None] | None,
    source: str,
) -> GenerationAttention:
    """`Pretrained.generate` for one prompt ids (1, P) of a decoder, keeping the attention rows
    `recording` asks as it decodes (no second forward pass); eos: the tokens that end it."""
    cfg = model.config
    if isinstance(model, DeepseekV4Decoder):
        raise ValueError(
            "recording the attention while generating keeps each step's row over every token "
            "so far; a DeepSeek-V4 layer's cache keeps only its window's last words and its "
            "compressed entries, so a step's record has no column for most words: generate "
            "without record, then read the whole text's attentions() (on its words)"
        )
    layers, heads = recording.resolve(cfg.num_layers, heads_per_layer(model), source)
    if recording.summaries:  # a few numbers per row: the prompt's are summarized in chunks
        keeper = SummaryKeeper(layers, heads, recording.top_k)
    else:
        itemsize = 8 if next(model.parameters()).dtype == torch.float64 else 4
        check_recording_size(len(layers), len(heads), ids.shape[1], max_new_tokens, itemsize)
        keeper = RowKeeper(layers, heads)
    chosen = []

    def steps():
        for token in decode_steps(model, ids, None, sampling, max_new_tokens,
                                  layers=layers, keep=keeper):  # fmt: skip
            chosen.append(int(token[0]))
            yield token

    (continuation,) = continuations(steps(), tokenizer, eos, stop, stream, 1)
    if continuation.within is not None:  # a stop string: the text's tokens, none after
        del chosen[continuation.within :]
    every = ids[0].tolist() + chosen
    P = ids.shape[1]
    return GenerationAttention(
        continuation.text, every, [tokenizer.id_to_token(i) or str(i) for i in every],
        tokenizer.pieces(every), P, layers, heads, *(
            (None, [], keeper.summaries().first(P - 1 + len(chosen)))
            if recording.summaries else (keeper.prompt, keeper.steps[: len(chosen) - 1])),
    )  # fmt: skip
