"""Long texts on the server: their forward passes, read as summaries.

/api/attention sends every weight, so it stops at `Limits.max_tokens`: a 4,096-token text on
SmolLM2 has 4.5 billion of them. /api/long reads such a text the way `qkv show` does
(docs/long.md): one forward pass keeps each layer's record (q, k, v: linear in T), then
`summarize` computes every (layer, head)'s summaries a chunk of queries at a time (entropy,
first-token mass, top keys of each query, attention received per key, a max-downsampled
heatmap). A head's summaries (/api/long/head) are read from them, and a rectangle of
weights at full resolution (/api/long/region) is `region` of the kept record.

That takes longer than a request may wait (about 30 s for 4,096 tokens of SmolLM2 on two
cores), so each model reads its long texts in a thread of its own, one after another in the
order they came (`qkv.serve.long_texts`: the queue, what is kept, what is dropped); a
request for a text waits up to half of timeout_s on the event loop (holding no worker), then
is told 202 with how far the text has got and how many are ahead of it (ask again).
"""

from __future__ import annotations

import copy
import logging
import threading
import traceback

import torch

from qkv.serve.limits import Busy, Cancelled, Limits
from qkv.serve.long_texts import LongRun, without_traceback

RECEIVED = 3  # keys per head in the table: those that receive the most attention
TOP_K = 5  # keys kept per query
log = logging.getLogger("qkv.serve")


class NotComputed(Exception):
    """A head or a region of a text that is not one of the model's long texts: HTTP 409."""


def read(pretrained, run: LongRun, going) -> None:
    """Read run.text: run.table, run.records and run.summaries, or run.error (without its
    traceback: its frames would hold the records). going(): Cancelled when it must stop."""
    from qkv.inspect.summaries import summarize

    try:
        going()
        seen = pretrained.attentions(run.text, weights=False)  # summaries alone
        tokens, heads = seen.pieces, seen.heads  # the tokens as pages show them
        records = {layer: weights_only(r) for layer, r in seen.records.items()}
        del seen  # the forward pass's full records: only what weights read is kept
        parts = []
        for layer, record in records.items():  # a layer at a time: it can stop
            going()
            parts.append(summarize({layer: record}, heads=heads, top_k=TOP_K))
            run.layers_done += 1
        summaries = joined(parts, tokens)
        run.table, run.records, run.summaries = table(summaries), records, summaries
    except Exception as error:  # told to the requests for this text
        if not isinstance(error, Cancelled | ValueError):  # as text: a record keeps no frame
            trace = "".join(traceback.format_exception(error)).rstrip()
            log.error("reading a long text of %d tokens failed\n%s", run.T, trace)
        run.error = without_traceback(error)


def weights_only(record):
    """The record with what `weights()` reads (q, k, the mask, lse, the score variants) and
    nothing else: v and out emptied (D = 0), no copies from before the rotary turn. Of 4,096
    tokens of SmolLM2 that keeps 13 MB of each layer's 38."""
    import dataclasses

    def empty(t):  # (B, H, T, 0): a tensor of its own, not a view that keeps t alive
        return t.new_empty(*t.shape[:-1], 0)

    return dataclasses.replace(record, v=empty(record.v), out=empty(record.out),
                               q_before_rotary=None, k_before_rotary=None, made=None)  # fmt: skip


def joined(parts: list, tokens: list[str]):
    """One `Summaries` of every layer from summaries of one layer each: the same numbers as
    `summarize` of every layer at once (each layer is summarized on its own either way)."""
    from qkv.inspect.summaries import Summaries

    first = parts[0]
    stacked = {
        name: torch.cat([getattr(p, name) for p in parts])
        for name in ("entropy", "first_token_mass", "top_keys", "top_weights", "received",
                     "heatmap")
    }  # fmt: skip
    layers = [layer for p in parts for layer in p.layers]
    return Summaries(layers, first.heads, tokens, query_bin=first.query_bin,
                     key_bin=first.key_bin, **stacked)  # fmt: skip


def table(summaries) -> dict:
    """The per-head table: mean entropy, mean first-token mass, the most received keys."""
    received = summaries.received  # (L, H, T) float64
    most = received.topk(min(RECEIVED, received.shape[-1]), dim=-1)  # (L, H, 3)
    return {
        "tokens": summaries.tokens,
        "layers": summaries.layers,
        "heads": summaries.heads,
        "query_bin": summaries.query_bin,
        "key_bin": summaries.key_bin,
        "top_k": summaries.top_keys.shape[-1],
        "mean_entropy": summaries.entropy.mean(-1).tolist(),
        "mean_first_token_mass": summaries.first_token_mass.mean(-1).tolist(),
        "most_received_keys": most.indices.tolist(),
        "most_received": most.values.tolist(),
    }


def encode(served, limits: Limits, text: str):
    """The tokens of a long text: over max_long_tokens is 413 (whatever the model reads),
    then over the model's context window 422 (Pretrained.encode)."""
    from qkv.serve.compute import within

    return within(served, text, limits.check_long_tokens)


def ask(served, limits: Limits, text: str, stop: threading.Event | None = None) -> LongRun:
    """POST /api/long's work in a worker: the text's run, which joins the model's queue if it
    is not there (Busy, 503, when max_long_waiting texts wait already)."""
    T = len(encode(served, limits, text).ids)
    return served.long.ask(served, limits, text, T, start=True)


def progress(served, run: LongRun) -> dict:
    """The 202's answer: how far `run` has got, and how many texts are read before it."""
    ahead = served.long.ahead(run)
    if not run.started:
        where = f"waiting for its turn: {ahead} long text{'s' * (ahead != 1)} before it"
    elif run.layers_done == 0:
        where = "the forward pass"
    else:
        where = f"{run.layers_done} of {run.num_layers} layers summarized"
    return {
        "model": served.name,
        "detail": f"{served.name} is reading this text of {run.T:,} tokens ({where}); ask again",
        "tokens": run.T,
        "ahead": ahead,
        "layers_done": run.layers_done,
        "num_layers": run.num_layers,
    }


def finished(served, run: LongRun) -> LongRun:
    """The run, if it was read; its error if not (a copy, so that the traceback it gets on
    its way to the client holds nothing of the run)."""
    served.long.told(run)
    if run.error is None:
        return run
    if isinstance(run.error, Cancelled):
        raise Busy(
            f"{served.name} stopped reading this text: nobody had asked about it for its last "
            "long_idle_s; ask again to read it again"
        )
    try:
        error = copy.copy(run.error)
    except Exception:  # an error that cannot be made again from its arguments
        error = RuntimeError(f"{type(run.error).__name__}: {run.error}")
    raise error


def summaries_of(served, run: LongRun, stop: threading.Event | None = None) -> dict:
    """POST /api/long's answer once `run` is done: the per-head table of its text."""
    return {"model": served.name, **finished(served, run).table}


def kept(served, limits: Limits, text: str) -> LongRun:
    """The model's long text `text`, read and kept: NotComputed (409) if it is not kept (never
    asked for, dropped or evicted), Busy (503) while it waits or is being read."""
    T = len(encode(served, limits, text).ids)
    run = served.long.ask(served, limits, text, T, start=False)
    if run is not None and not run.done.is_set():
        raise Busy(progress(served, run)["detail"])
    if run is None or (run.error is None and run.records is None):
        raise NotComputed(
            f"{served.name} does not keep this long text (it keeps those read and used last, "
            "within max_long_kept_bytes): POST /api/long with it again"
        )
    return finished(served, run)


def head_of(
    served, limits: Limits, text: str, layer: int, head: int, fmt: str,
    stop: threading.Event | None = None,
) -> dict:  # fmt: skip
    """POST /api/long/head: one head's max-downsampled heatmap and per-query summaries."""
    from qkv.serve.compute import pack_float32

    served.check_index("layer", layer)
    served.check_index("head", head)
    s = kept(served, limits, text).summaries
    n, h = s.layers.index(layer), s.heads.index(head)
    heatmap = s.heatmap[n, h]  # (Rq, Rk)
    return {
        "model": served.name,
        "layer": layer,
        "head": head,
        "num_tokens": s.entropy.shape[-1],
        "query_bin": s.query_bin,
        "key_bin": s.key_bin,
        "shape": list(heatmap.shape),
        "format": fmt,
        "heatmap": pack_float32(heatmap.numpy()) if fmt == "base64" else heatmap.tolist(),
        "entropy": s.entropy[n, h].tolist(),
        "first_token_mass": s.first_token_mass[n, h].tolist(),
        "top_keys": s.top_keys[n, h].tolist(),
        "top_weights": s.top_weights[n, h].tolist(),
        "received": s.received[n, h].tolist(),
    }


def region_of(
    served, limits: Limits, text: str, layer: int, head: int, queries: list[int],
    keys: list[int], fmt: str, stop: threading.Event | None = None,
) -> dict:  # fmt: skip
    """POST /api/long/region: every weight of queries q0..q1-1 over keys k0..k1-1 of one head,
    `region` of the kept record; at most max_region weights, checked before any work."""
    from qkv.inspect.summaries import region
    from qkv.serve.compute import pack_float32
    from qkv.serve.limits import TooLarge

    served.check_index("layer", layer)
    served.check_index("head", head)
    run = kept(served, limits, text)
    (q0, q1), (k0, k1) = queries, keys
    ranges = 0 <= q0 < q1 <= run.T and 0 <= k0 < k1 <= run.T  # else `region` says which
    if ranges and (q1 - q0) * (k1 - k0) > limits.max_region:
        raise TooLarge(
            f"queries {q0}:{q1} x keys {k0}:{k1} are {(q1 - q0) * (k1 - k0):,} weights; this "
            f"server sends at most {limits.max_region:,} in one region (max_region)",
            limit="max_region",
        )
    weights = region(run.records[layer], queries=(q0, q1), keys=(k0, k1), heads=[head])[0]
    tokens = run.summaries.tokens
    return {
        "model": served.name,
        "layer": layer,
        "head": head,
        "queries": [q0, q1],
        "keys": [k0, k1],
        "shape": list(weights.shape),
        "format": fmt,
        "weights": pack_float32(weights.numpy()) if fmt == "base64" else weights.tolist(),
        "query_tokens": tokens[q0:q1],
        "key_tokens": tokens[k0:k1],
    }
