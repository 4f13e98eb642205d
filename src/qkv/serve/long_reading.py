"""Reading one long text: its forward pass, its records kept for weights, its summaries.

The work a model's long-text worker (`qkv.serve.long_texts`) does for each text, the way
`qkv show` reads one (docs/long.md): one forward pass keeps each layer's record (q, k, v:
linear in T), less what weights do not read (`weights_only`); then `summarize` computes each
(layer, head)'s summaries a chunk of queries at a time (entropy, first-token mass, top keys of
each query, attention received per key, a max-downsampled heatmap), a layer at a time so that
a reading nobody waits for stops at its next layer; `table` is the /api/long answer.
"""

from __future__ import annotations

import dataclasses
import logging
import traceback

import torch

# the module, not its functions: a test may replace `summaries.summarize` to hold a reading
from qkv.inspect import summaries
from qkv.serve.limits import Cancelled
from qkv.serve.long_texts import LongRun, without_traceback

RECEIVED = 3  # keys per head in the table: those that receive the most attention
TOP_K = 5  # keys kept per query
log = logging.getLogger("qkv.serve")


def read(pretrained, run: LongRun, going) -> None:
    """Read run.text: run.table, run.records and run.summaries, or run.error (without its
    traceback: its frames would hold the records). going(): Cancelled when it must stop."""
    try:
        going()
        seen = pretrained.attentions(run.text, weights=False)  # summaries alone
        tokens, heads = seen.pieces, seen.heads  # the tokens as pages show them
        records = {layer: weights_only(r) for layer, r in seen.records.items()}
        del seen  # the forward pass's full records: only what weights read is kept
        parts = []
        for layer, record in records.items():  # a layer at a time: it can stop
            going()
            parts.append(summaries.summarize({layer: record}, heads=heads, top_k=TOP_K))
            run.layers_done += 1
        summarized = joined(parts, tokens)
        run.table, run.records, run.summaries = table(summarized), records, summarized
    except Exception as error:  # told to the requests for this text
        if not isinstance(error, Cancelled | ValueError):  # as text: a record keeps no frame
            trace = "".join(traceback.format_exception(error)).rstrip()
            log.error("reading a long text of %d tokens failed\n%s", run.T, trace)
        run.error = without_traceback(error)


def weights_only(record):
    """The record with what `weights()` reads (q, k, the mask, lse, the score variants) and
    nothing else: v and out emptied (D = 0), no copies from before the rotary turn. Of 4,096
    tokens of SmolLM2 that keeps 13 MB of each layer's 38."""

    def empty(t):  # (B, H, T, 0): a tensor of its own, not a view that keeps t alive
        return t.new_empty(*t.shape[:-1], 0)

    return dataclasses.replace(record, v=empty(record.v), out=empty(record.out),
                               q_before_rotary=None, k_before_rotary=None, made=None)  # fmt: skip


def joined(parts: list, tokens: list[str]):
    """One `Summaries` of every layer from summaries of one layer each: the same numbers as
    `summarize` of every layer at once (each layer is summarized on its own either way)."""
    first = parts[0]
    stacked = {
        name: torch.cat([getattr(p, name) for p in parts])
        for name in ("entropy", "first_token_mass", "top_keys", "top_weights", "received",
                     "heatmap")
    }  # fmt: skip
    layers = [layer for p in parts for layer in p.layers]
    return summaries.Summaries(layers, first.heads, tokens, query_bin=first.query_bin,
                               key_bin=first.key_bin, **stacked)  # fmt: skip


def table(summarized) -> dict:
    """The per-head table: mean entropy, mean first-token mass, the most received keys."""
    received = summarized.received  # (L, H, T) float64
    most = received.topk(min(RECEIVED, received.shape[-1]), dim=-1)  # (L, H, 3)
    return {
        "tokens": summarized.tokens,
        "layers": summarized.layers,
        "heads": summarized.heads,
        "query_bin": summarized.query_bin,
        "key_bin": summarized.key_bin,
        "top_k": summarized.top_keys.shape[-1],
        "mean_entropy": summarized.entropy.mean(-1).tolist(),
        "mean_first_token_mass": summarized.first_token_mass.mean(-1).tolist(),
        "most_received_keys": most.indices.tolist(),
        "most_received": most.values.tolist(),
    }
