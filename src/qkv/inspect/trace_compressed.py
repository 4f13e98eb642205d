"""A trace's steps in a DeepSeek-V4 layer: what the query attended to (the window's words, the
compressed entries the indexer chose, each standing for a block of words, and the sink), and
why a word it gave no weight got none.

The layer's softmax runs over its keys: the words of a sliding window, then (CSA and HCA
layers) the compressed entries. Steps 2-6 show one of those keys: the key word's own where it
is in the query's window, else the entry that holds the most of it among those the query
attended. The trace's weights are on the words (`qkv.inspect.words`): an entry's weight spread
over its block by the compressor's coefficients, averaged over channels, an attribution.
What each word added to the head's output is its share of the attended keys' scaled values,
turned back by the query's position and through the layer's grouped output projection, as
the layer does; the words' shares sum to the head's output.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from qkv.inspect.words import on_words
from qkv.nn.compressed_keys import CompressedKeys


@dataclass
class EntryStep:
    """One compressed entry, as one query of one head saw it."""

    entry: int
    first: int  # the first and last words of the block it pools
    last: int
    weight: float  # the softmax's weight on the entry (0 where the query did not attend it)
    attended: bool  # chosen by the indexer (CSA), or complete at the query (HCA)
    rank: int | None  # the indexer's rank of it among the entries complete at the query
    key_share: float  # the key word's coefficient in the entry (0 where it is not in the block)


@dataclass
class CompressedStep:
    """What a compressed layer's query attended to, and where the key word's weight came from."""

    kind: str  # "CSA" (overlapping entries, an indexer's top k) or "HCA" (every complete entry)
    rate: int  # the words each entry advances by
    window: int  # the query sees the words at most window - 1 before it, one key each
    top_k: int | None  # the indexer's k (CSA)
    complete: int  # the entries whose block is complete at the query
    window_first: int  # the first word of the query's window
    window_weight: float  # the softmax's weight on the window's words together
    # the entries the query attended, largest weight first, then those that hold the key word
    # and were not attended
    entries: list[EntryStep] = field(default_factory=list)
    key_entry: int | None = None  # the entry steps 2-6 show; None: the key word's own key
    key_weight: float = 0.0  # the softmax's weight on the key steps 2-6 show
    from_window: float = 0.0  # the key word's weight as a word of the window
    from_entries: float = 0.0  # its shares of the entries the query attended
    why_zero: str | None = None  # why the key word has no weight, where it has none


def head_output_matrix(attn, head: int) -> Tensor:
    """(C, D) float64: the columns of DeepSeek-V4's grouped output projection that one head's
    output (turned back by its position) goes through: out_b's block of the head's group,
    times the head's columns of the group's out_a."""
    H, G = attn.num_heads, attn.groups
    per_group, (rank, D) = H // G, (attn.out_a.weight.shape[0] // G, attn.head_dim)
    g, within = divmod(head, per_group)
    a = attn.out_a.weight.view(G, rank, -1)[g][:, within * D : (within + 1) * D]  # (r, D)
    b = attn.out_b.weight[:, g * rank : (g + 1) * rank]  # (C, r)
    return b.double() @ a.double()


def turned_back(rotary, vectors: Tensor, position: int) -> Tensor:
    """vectors (n, D) turned back by the query's position, as the layer turns its output."""
    cos, sin = rotary.cos_sin(torch.tensor([[position]]), torch.float64)
    return rotary.turn(vectors[None, None], cos, -sin)[0, 0]


def compressed_steps(model, record, layer: int, head: int, query: int, key: int,
                     steps) -> dict:  # fmt: skip
    """The Trace fields of a DeepSeek-V4 layer's pair beyond the query's vector: the key
    steps 2-6 show, the weights on the words, what each word added, the sink's share and,
    in a compressed layer, `compressed` (a CompressedStep)."""
    attn = model.blocks[layer].attn
    kind = model.config.attention_types[layer]
    rotary = model.rotary if kind == "sliding" else model.compress_rotary
    keys: CompressedKeys | None = record.compressed
    s = record.shape
    R = s.Tk if keys is None else keys.word_positions.numel()
    positions = torch.arange(R) if keys is None else keys.word_positions.cpu()
    words = on_words(record, [head])[0, 0, query].double()  # (T,) on the words
    weights = steps.weights.double()  # (R + N,) the softmax over the keys
    # what each word added: its shares of the keys' scaled values, through the projection
    spread = on_words_of(record, torch.eye(s.Tk, dtype=torch.float64))  # (Tk, T)
    scaled = torch.stack([p.scaled_value_vector for p in steps.pairs])  # (Tk, D)
    per_word = turned_back(rotary, spread.T @ scaled, query)  # (T, D)
    sizes = (per_word @ head_output_matrix(attn, head).T).norm(dim=-1)  # (T,)
    own = (positions == key).nonzero().flatten().tolist()
    column = own[0] if own else None
    found: dict = {"window": attn.window, "sink": float(record.sinks[head]),
                   "sink_weight": float(steps.sink_weight)}  # fmt: skip
    if keys is not None:
        found["compressed"], entry = _compressed(keys, weights, R, query, key, column)
        if entry is not None:
            column = R + entry
    pair = steps.pairs[column]
    found |= dict(
        key_vector=pair.key_vector, attention_scalar=float(pair.attention_scalar),
        scaled_scalar=float(pair.scaled_scalar), score=float(pair.score),
        value_vector=pair.value_vector, scaled_value_vector=pair.scaled_value_vector,
        weights=words.float(), masked=bool(words[key] == 0),
        outside_window=query - key >= attn.window,
        contributions=list(zip(words.tolist(), sizes.tolist(), strict=True)),
    )  # fmt: skip
    return found


def on_words_of(record, weights: Tensor) -> Tensor:
    """Rows of weights over a record's keys (n, Tk) -> over its words (n, T)."""
    if record.compressed is None:
        return weights
    return record.compressed.on_words(weights[None, None])[0, 0]


def _compressed(keys: CompressedKeys, weights: Tensor, R: int, query: int, key: int,
                column: int | None) -> tuple[CompressedStep, int | None]:  # fmt: skip
    """The CompressedStep of one query, and the entry steps 2-6 show (None: the key word's
    own key in the window)."""
    N = keys.blocks.shape[0]
    attended = keys.ready[query] if keys.chosen is None else keys.chosen[0, query]
    coefficients = keys.coefficients[0].double()  # (N, S)
    share = torch.where(keys.blocks == key, coefficients, 0.0).sum(-1)  # (N,)
    at = int(keys.query_positions[query])
    entries = []
    order = sorted(range(N), key=lambda n: -float(weights[R + n]))
    for n in [n for n in order if attended[n]] + [n for n in range(N)
                                                  if not attended[n] and share[n] > 0]:  # fmt: skip
        block = keys.blocks[n][keys.blocks[n] >= 0]
        rank = None
        if keys.scores is not None and bool(keys.ready[query, n]):
            rank = keys.rank(query, n)[0]
        entries.append(EntryStep(n, int(block.min()), int(block.max()), float(weights[R + n]),
                                 bool(attended[n]), rank, float(share[n])))  # fmt: skip
    in_window = column is not None and bool(weights[column] > 0)
    from_entries = float((weights[R:] * share).sum())
    holding = [n for n in range(N) if attended[n] and share[n] > 0]
    entry = None
    if not in_window and holding:  # the attended entry that holds the most of the key word
        entry = max(holding, key=lambda n: float(weights[R + n] * share[n]))
    step = CompressedStep(
        kind="HCA" if keys.chosen is None else "CSA", rate=keys.rate, window=keys.window,
        top_k=keys.top_k, complete=int(keys.ready[query].sum()),
        window_first=max(at - keys.window + 1, 0), window_weight=float(weights[:R].sum()),
        entries=entries, key_entry=entry,
        key_weight=float(weights[R + entry] if entry is not None else
                         weights[column] if column is not None else 0.0),
        from_window=float(weights[column]) if in_window else 0.0, from_entries=from_entries,
        why_zero=keys.why_zero(query, key),
    )  # fmt: skip
    return step, entry
