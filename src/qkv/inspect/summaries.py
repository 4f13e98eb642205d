"""Per-head summaries of a long text's attention, computed in chunks of queries.

A 4,096-token text on SmolLM2 has 30 x 9 x 4096^2 weights: 18 GB in float32, more than a
laptop holds, and more than a page can draw. Yet most questions a reader asks of a head need
far less: how spread out each query's attention is (its entropy), how much of it goes to the
first token (the "attention sink"), which keys each query attends to most, how much attention
each key receives, and a picture of the whole matrix. `summarize` computes all of them from
the layers' records (`AttentionRecord`), a chunk of query rows at a time: the weights of one
chunk, (H, chunk, Tk), are recomputed from q and k exactly as `record.weights` gives them,
summarized and dropped. Memory grows with T (times the chunk), never with L x H x T^2.

The picture is the heatmap downsampled by taking the MAXIMUM of each block (not the mean),
so a strong weight never disappears in a block of weak ones; `region` opens any rectangle
of queries x keys at full resolution.

>>> import qkv
>>> seen = qkv.load("minilm").attentions("The bank of the river")  # 7 tokens
>>> summary = summarize(seen, bins=4)  # blocks of 2 x 2 tokens
>>> summary.entropy.shape, summary.heatmap.shape  # (L, H, T) and (L, H, R, R)
(torch.Size([6, 12, 7]), torch.Size([6, 12, 4, 4]))
>>> region(seen.records[0], queries=(2, 5), keys=(0, 3)).shape  # (H, 3 queries, 3 keys)
torch.Size([12, 3, 3])
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from qkv.attention.inputs import check_indices
from qkv.nn.record import AttentionRecord

CHUNK = 256  # query rows whose weights exist at once: (H, 256, Tk) floats per layer
BINS = 256  # the downsampled heatmap's cells a side


@dataclass
class Summaries:
    """What each (layer, head) of one forward pass did, summarized per query and per key.

    Indexed [l, h] for layers[l] and heads[h] (both counted from 0). Over Tq queries and Tk
    keys (Tq = Tk = T over one text). The heatmap's cell (i, j) is the largest weight of
    queries i*query_bin .. (i+1)*query_bin - 1 over keys j*key_bin .. (j+1)*key_bin - 1 (the
    last cell of a side may be smaller); a bin of 1 is the full matrix.
    """

    layers: list[int]
    heads: list[int]
    tokens: list[str] | None  # the key tokens, where known
    entropy: Tensor  # (L, H, Tq) -sum_j w_ij log w_ij of each query's row, in nats (0 log 0 = 0)
    first_token_mass: Tensor  # (L, H, Tq) the weight of each query on key 0
    top_keys: Tensor  # (L, H, Tq, k) long: each query's k most attended keys, strongest first
    top_weights: Tensor  # (L, H, Tq, k) their weights
    received: Tensor  # (L, H, Tk) float64: the attention each key receives, summed over queries
    heatmap: Tensor  # (L, H, Rq, Rk) the maximum weight of each block
    query_bin: int  # queries per heatmap row
    key_bin: int  # keys per heatmap column

    def to_dict(self) -> dict:
        """JSON-ready: tensors become lists (see docs/long.md)."""
        out = {}
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            out[field.name] = value.tolist() if isinstance(value, Tensor) else value
        return out


def summarize(
    attentions,
    *,
    heads: Sequence[int] | None = None,
    top_k: int = 5,
    bins: int = BINS,
    chunk: int = CHUNK,
) -> Summaries:
    """Summaries of every recorded layer of one text: an `Attentions` (its heads by default)
    or a dict {layer: AttentionRecord} (every head by default).

    top_k: keys kept per query (at most Tk); bins: the heatmap's cells a side (at most T:
    a text of up to `bins` tokens keeps every weight); chunk: query rows computed at once.
    """
    records, tokens = _records_of(attentions)
    if heads is None:
        heads = getattr(attentions, "heads", None)
    layers = sorted(records)
    first = records[layers[0]].shape
    heads = check_indices("head", heads, first.H, "the model")
    for name, value in (("top_k", top_k), ("bins", bins), ("chunk", chunk)):
        if type(value) is not int or value < 1:
            raise ValueError(f"{name} must be a whole number >= 1, got {value!r}")
    Tq, Tk = first.Tq, first.Tk
    k = min(top_k, Tk)
    query_bin, key_bin = math.ceil(Tq / min(bins, Tq)), math.ceil(Tk / min(bins, Tk))
    Rq, Rk = math.ceil(Tq / query_bin), math.ceil(Tk / key_bin)
    L, H = len(layers), len(heads)
    # float32 (of any lower precision too), float64 for a float64 model
    dtype = torch.float64 if records[layers[0]].q.dtype == torch.float64 else torch.float32
    entropy, first_mass = torch.empty(L, H, Tq, dtype=dtype), torch.empty(L, H, Tq, dtype=dtype)
    top_keys = torch.empty(L, H, Tq, k, dtype=torch.long)
    top_weights = torch.empty(L, H, Tq, k, dtype=dtype)
    received = torch.zeros(L, H, Tk, dtype=torch.float64)
    heatmap = torch.zeros(L, H, Rq, Rk, dtype=dtype)
    with torch.inference_mode():
        for n, layer in enumerate(layers):
            record = records[layer]
            if record.shape.Tq != Tq or record.shape.Tk != Tk:
                raise ValueError(f"layer {layer} has {record.shape.Tq} x {record.shape.Tk} "
                                 f"queries x keys, layer {layers[0]} {Tq} x {Tk}: summarize "
                                 "one text's records")  # fmt: skip
            for start, w in chunk_weights(record, heads, chunk=chunk):  # w: (H, c, K <= Tk)
                w = w.to(dtype)
                rows, K = slice(start, start + w.shape[1]), w.shape[2]
                stats = row_summaries(w, k)
                entropy[n, :, rows], first_mass[n, :, rows] = stats[0], stats[1]
                top_keys[n, :, rows], top_weights[n, :, rows] = stats[2], stats[3]
                received[n, :, :K] += w.sum(1)  # each chunk in float32, the total in float64
                cells = block_max(w, key_bin)  # (H, c, ceil(K / key_bin)): each row's maxima
                bins_of_rows = (torch.arange(rows.start, rows.stop) // query_bin)[None, :, None]
                heatmap[n, :, :, : cells.shape[2]].scatter_reduce_(
                    1, bins_of_rows.expand_as(cells), cells, "amax")  # fmt: skip
    return Summaries(layers, heads, tokens, entropy, first_mass, top_keys, top_weights,
                     received, heatmap, query_bin, key_bin)  # fmt: skip


def row_summaries(w: Tensor, k: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Of weights w (..., K), each row's entropy (...), weight on key 0 (...), and its k
    strongest keys and their weights (..., k), strongest first; where k > K the keys past K
    (ones no row may see) fill the list with weight 0.

    >>> row_summaries(torch.tensor([[0.25, 0.75]]), 3)[2:]
    (tensor([[1, 0, 2]]), tensor([[0.7500, 0.2500, 0.0000]]))
    """
    K = w.shape[-1]
    wide = torch.nn.functional.pad(w, (0, k - K)) if k > K else w  # hidden keys: 0
    top = wide.topk(k, dim=-1)
    return torch.special.entr(w).sum(-1), w[..., 0], top.indices, top.values


def chunk_weights(
    record: AttentionRecord, heads: Sequence[int] | None = None, *, chunk: int = CHUNK
) -> Iterator[tuple[int, Tensor]]:
    """(first query, weights (len(heads), c, K)) for query rows of one text in chunks of at
    most `chunk`, never all at once: chunk by chunk, `record.weights(heads)[0]`, where the
    keys K.. that none of the chunk's queries may see (in a causal model, the later ones)
    are left out: their weights are all 0.

    Each chunk is `record.weights` of the record cut to those queries, its causal rule and
    window turned into the mask they give those rows (so the queries keep their positions).
    """
    s = record.shape
    if s.B != 1:
        raise ValueError(f"the record holds {s.B} texts; summaries are of one text (B = 1)")
    _refuse_linear(record, "summaries")
    for start in range(0, s.Tq, chunk):
        stop = min(start + chunk, s.Tq)
        # a causal query i sees keys up to i + Tk - Tq: the chunk's last query sees the most
        keys = min(s.Tk, stop + s.Tk - s.Tq) if record.causal else s.Tk
        yield start, rows_of(record, start, stop, keys=keys).weights(heads)[0]


def _refuse_linear(record: AttentionRecord, what: str) -> None:
    """A linear layer's effective weights of some query rows need every earlier write, and a
    compressed layer's keys are words and entries: no cut of either record gives the rows on
    the words, so a reader of rows refuses them by name."""
    if record.linear is not None:
        raise ValueError(
            f"{what} of a long text read the weights a chunk of query rows at a time; this layer "
            "keeps a running memory (linear attention), whose effective weights for a query need "
            "every write before it: show a text of at most a few hundred tokens, or trace a pair "
            "(qkv explain)"
        )
    if record.compressed is not None:
        raise ValueError(
            f"{what} of a long text cut a record into chunks of query rows; this layer attends "
            "over compressed entries (DeepSeek-V4), whose weights on the words are spread "
            "through the compressor over the whole record, which no cut of it keeps: show a "
            "text of at most 512 tokens, or trace a pair (qkv explain)"
        )


def rows_of(
    record: AttentionRecord, start: int, stop: int, *, keys: int | None = None
) -> AttentionRecord:
    """The record of queries start..stop-1 only, with the mask those rows saw: its
    `weights()` are rows start..stop-1 of the whole record's. keys: keep only the first
    `keys` keys, for queries that see none of the others (their weights would be 0)."""
    s = record.shape
    rows, cols = slice(start, stop), slice(0, s.Tk if keys is None else keys)
    cut = None if record.lse is None else record.lse[:, :, rows]
    made = None if record.made is None else record.made[:, rows, cols]
    mask, bias = _allowed_rows(record, start, stop), _rows_of(record.bias, rows, s.Tq)
    return dataclasses.replace(
        record, q=record.q[:, :, rows], out=record.out[:, :, rows], lse=cut,
        k=record.k[:, :, cols], v=record.v[:, :, cols],
        mask=None if mask is None else mask[..., cols], causal=False, window=None,
        bias=None if bias is None else bias[..., cols], q_before_rotary=None,
        k_before_rotary=None, made=made,
    )  # fmt: skip


def region(
    record: AttentionRecord,
    *,
    queries: tuple[int, int],
    keys: tuple[int, int],
    heads: Sequence[int] | None = None,
) -> Tensor:
    """The weights (len(heads), q1 - q0, k1 - k0) of queries q0..q1-1 over keys k0..k1-1 at
    full resolution: the slice [:, q0:q1, k0:k1] of `record.weights(heads)[0]`, computed from
    those query rows only."""
    s = record.shape
    (q0, q1), (k0, k1) = (_span("queries", queries, s.Tq), _span("keys", keys, s.Tk))
    if s.B != 1:
        raise ValueError(f"the record holds {s.B} texts; a region is of one text (B = 1)")
    _refuse_linear(record, "a region")
    parts = []
    for start in range(q0, q1, CHUNK):
        parts.append(rows_of(record, start, min(start + CHUNK, q1)).weights(heads)[0, :, :, k0:k1])
    return torch.cat(parts, dim=1)


def block_max(w: Tensor, size: int) -> Tensor:
    """(…, ceil(Tk / size)): the maximum of each run of `size` columns of w (…, Tk), the last
    run shorter where size does not divide Tk. Weights are >= 0, so zeros pad it.

    >>> block_max(torch.tensor([[0.1, 0.7, 0.2, 0.0, 0.3]]), 2)
    tensor([[0.7000, 0.2000, 0.3000]])
    """
    Tk = w.shape[-1]
    pad = -Tk % size
    if pad:
        w = torch.nn.functional.pad(w, (0, pad))
    return w.reshape(*w.shape[:-1], -1, size).amax(-1)


def _span(name: str, span, count: int) -> tuple[int, int]:
    try:
        first, last = (int(end) for end in span)
    except (TypeError, ValueError):
        raise ValueError(f"{name} are a range (first, last + 1) counted from 0, "
                         f"got {span!r}") from None  # fmt: skip
    if not 0 <= first < last <= count:
        raise ValueError(
            f"{name} {first}:{last} is not a range within 0:{count} (first < last, from 0)"
        )
    return first, last


def _records_of(attentions) -> tuple[dict[int, AttentionRecord], list[str] | None]:
    if isinstance(attentions, dict):
        records, tokens = attentions, None
    else:
        records = attentions.records  # the tokens as pages show them
        tokens = list(getattr(attentions, "pieces", None) or attentions.tokens)
    if not records:
        raise ValueError("no layer recorded; record at least one layer")
    return records, tokens


def _rows_of(t: Tensor | None, rows: slice, Tq: int) -> Tensor | None:
    """Rows `rows` of a mask or a score bias broadcastable to (B, H, Tq, Tk)."""
    if t is None:
        return None
    t = t.reshape((1,) * (4 - t.dim()) + tuple(t.shape))  # (B?, H?, Tq?, Tk)
    return t[:, :, rows] if t.shape[2] == Tq and Tq > 1 else t


def _allowed_rows(record: AttentionRecord, start: int, stop: int) -> Tensor | None:
    """(B?, H?, stop - start, Tk) boolean: the record's mask, causal rule and window for
    queries start..stop-1 (query i at position i + Tk - Tq, as `causal_mask` aligns them)."""
    s = record.shape
    device = record.q.device
    at = torch.arange(start, stop, device=device)[:, None] + (s.Tk - s.Tq)  # (c, 1)
    distance = at - torch.arange(s.Tk, device=device)[None, :]  # (c, Tk) > 0: the key is earlier
    allowed = distance >= 0 if record.causal else None
    if record.window is not None:
        near = distance < record.window
        near = near if record.causal else near & (-distance < record.window)
        allowed = near if allowed is None else allowed & near
    mask = _rows_of(record.mask, slice(start, stop), s.Tq)
    if mask is None:
        return None if allowed is None else allowed[None, None]
    return mask if allowed is None else mask & allowed
