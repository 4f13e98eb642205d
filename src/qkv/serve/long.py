"""Long texts on the server: the work behind /api/long, /api/long/head and /api/long/region.

/api/attention sends every weight, so it stops at `Limits.max_tokens`: a 4,096-token text on
SmolLM2 has 4.5 billion of them. /api/long reads such a text the way `qkv show` does
(docs/long.md): one forward pass keeps each layer's record, then every (layer, head)'s
summaries are computed from them (`qkv.serve.long_reading`). A head's summaries
(/api/long/head) are read from them, and a rectangle of weights at full resolution
(/api/long/region) is `region` of the kept record.

That takes longer than a request may wait (about 30 s for 4,096 tokens of SmolLM2 on two
cores), so each model reads its long texts in a thread of its own, one after another in the
order they came (`qkv.serve.long_texts`: the queue, what is kept, what is dropped); a
request for a text waits up to half of timeout_s on the event loop (holding no worker), then
is told 202 with how far the text has got and how many are ahead of it (ask again).
"""

from __future__ import annotations

import copy
import threading

from qkv.inspect.summaries import region
from qkv.serve.compute import pack_float32, within
from qkv.serve.limits import Busy, Cancelled, Limits, NotComputed, TooLarge
from qkv.serve.long_texts import LongRun


def encode(served, limits: Limits, text: str):
    """The tokens of a long text: over max_long_tokens is 413 (whatever the model reads),
    then over the model's context window 422 (Pretrained.encode)."""
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
    served.check_index("layer", layer)
    served.check_pair(layer, head)  # a head this layer has
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
    served.check_index("layer", layer)
    served.check_pair(layer, head)  # a head this layer has
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
