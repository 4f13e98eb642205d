"""Long texts on the server: one text's forward pass kept per model, read as summaries.

/api/attention sends every weight, so it stops at `Limits.max_tokens`: a 4,096-token text on
SmolLM2 has 4.5 billion of them. /api/long reads such a text the way `qkv show` does
(docs/long.md): one forward pass keeps each layer's record (q, k, v: linear in T), then
`summarize` computes every (layer, head)'s summaries a chunk of queries at a time (entropy,
first-token mass, top keys of each query, attention received per key, a max-downsampled
heatmap). A head's summaries (/api/long/head) are read from them, and a rectangle of
weights at full resolution (/api/long/region) is `region` of the kept record.

That takes longer than a request may wait (about 30 s for 4,096 tokens of SmolLM2 on two
cores), so it runs in a thread of its own, as the census of heads does: a request waits up
to half of timeout_s, then is told 202 with how far it has got (ask again). Memory stays
bounded: each served model keeps ONE long text (its q and k and its summaries: 0.5 GB for
4,096 tokens of SmolLM2). A new text drops the old one, and stops its computation at the
next layer, before its own forward pass; one model's computations run one after another.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import torch

from qkv.serve.limits import Cancelled, Limits

RECEIVED = 3  # keys per head in the table: those that receive the most attention
TOP_K = 5  # keys kept per query


class Computing(Exception):
    """The long text is still being computed: HTTP 202 with `progress` (ask again)."""

    def __init__(self, progress: dict):
        super().__init__(progress["detail"])
        self.progress = progress


class NotComputed(Exception):
    """A head or a region of a text that is not the model's long text: HTTP 409."""


@dataclass
class LongRun:
    """One long text's computation, and what it keeps once done."""

    text: str
    T: int
    num_layers: int
    stop: threading.Event = field(default_factory=threading.Event)
    done: threading.Event = field(default_factory=threading.Event)
    started: bool = False  # it has the model's turn (the run before it has stopped)
    layers_done: int = 0
    records: dict | None = None  # {layer: its record, `weights_only`}
    summaries: object = None  # qkv.inspect.summaries.Summaries of every layer and head
    table: dict | None = None  # the /api/long answer, less the model's name
    error: BaseException | None = None


class LongTexts:
    """A served model's long text: the last one asked for, and its computation."""

    def __init__(self):
        self._guard = threading.Lock()  # who is current
        self._turn = threading.Lock()  # one computation at a time
        self.current: LongRun | None = None

    def run_for(self, pretrained, text: str, T: int, *, start: bool) -> LongRun | None:
        """The run of `text`: the current one, or (start=True) a new one in its own thread,
        which drops the current one and stops it at its next layer. None: not this text."""
        with self._guard:
            run = self.current
            failed = run is not None and run.done.is_set() and run.error is not None
            if run is not None and run.text == text and not (start and failed):
                return run  # a run that failed is tried again when asked to start
            if not start:
                return None
            if run is not None:
                run.stop.set()
            self.current = run = LongRun(text, T, pretrained.config.num_layers)
        threading.Thread(target=self._compute, args=(pretrained, run), name="qkv-long",
                         daemon=True).start()  # fmt: skip
        return run

    def _compute(self, pretrained, run: LongRun) -> None:
        from qkv.inspect.summaries import summarize

        try:
            with self._turn:  # the one before has stopped, and dropped what it kept
                if run.stop.is_set():
                    raise Cancelled
                run.started = True
                seen = pretrained.attentions(run.text, weights=False)  # summaries alone
                tokens, heads = list(seen.tokens), seen.heads
                records = {layer: weights_only(r) for layer, r in seen.records.items()}
                del seen  # the forward pass's full records: only what weights read is kept
                parts = []
                for layer, record in records.items():  # a layer at a time: it can stop
                    if run.stop.is_set():
                        raise Cancelled
                    parts.append(summarize({layer: record}, heads=heads, top_k=TOP_K))
                    run.layers_done += 1
                summaries = joined(parts, tokens)
                run.table, run.records, run.summaries = table(summaries), records, summaries
        except BaseException as error:  # told to every request for this text
            run.error = error
        finally:
            run.done.set()


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
    """The tokens of a long text, within max_long_tokens and the model's context window."""
    encoded = served.pretrained.encode(text)
    limits.check_long_tokens(len(encoded.ids))
    return encoded


def progress(served, run: LongRun) -> dict:
    if not run.started:
        where = "waiting for the long text before it to stop"
    elif run.layers_done == 0:
        where = "the forward pass"
    else:
        where = f"{run.layers_done} of {run.num_layers} layers summarized"
    return {
        "model": served.name,
        "detail": f"{served.name} is reading this text of {run.T:,} tokens ({where}); ask again",
        "tokens": run.T,
        "layers_done": run.layers_done,
        "num_layers": run.num_layers,
    }


def finished(served, run: LongRun) -> LongRun:
    """The run, if it ended well; its error if not."""
    if run.error is None:
        return run
    if isinstance(run.error, Cancelled):
        from qkv.serve.api import Busy

        raise Busy(
            f"another long text replaced this one on {served.name} before it was read (this "
            "server keeps one long text per model); ask again to read it again"
        )
    raise run.error


def summaries_of(served, limits: Limits, text: str, stop: threading.Event | None = None) -> dict:
    """POST /api/long: the per-head table of `text`, computed (or started) in its own thread;
    Computing (202) while it is, after waiting up to half of timeout_s."""
    from qkv.serve.compute import going

    run = served.long.run_for(served.pretrained, text, len(encode(served, limits, text).ids),
                              start=True)  # fmt: skip
    deadline = time.monotonic() + limits.timeout_s / 2
    while not run.done.wait(0.05):
        going(stop)
        if time.monotonic() > deadline:
            raise Computing(progress(served, run))
    return {"model": served.name, **finished(served, run).table}


def kept(served, limits: Limits, text: str) -> LongRun:
    """The model's long text, if it is `text` and is read: NotComputed (409) if it is not
    the text, Busy (503) while it is being read."""
    from qkv.serve.api import Busy

    run = served.long.run_for(served.pretrained, text, len(encode(served, limits, text).ids),
                              start=False)  # fmt: skip
    if run is None:
        raise NotComputed(
            f"{served.name} has not read this long text (it keeps the last one it was asked "
            "for): POST /api/long with it first"
        )
    if not run.done.is_set():
        raise Busy(progress(served, run)["detail"])
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
