"""The work behind each endpoint, run in a worker thread: library calls, their answers as JSON.

Nothing here computes attention itself: the weights are `Pretrained.attentions`, a pair's
steps and contributions are `qkv.trace`, the sense probe is `qkv.inspect.probe.probe`,
generation is `Pretrained.generate`, a hidden key is `qkv.hide`, the census `qkv.heads`.
This module checks what only a model can tell (tokens, layers and heads in range, an
answer's size) and shapes the answer. Requests share a model
with no lock: each forward pass returns the records its numbers come from (see
`qkv.serve.held`). Each function takes `stop`, an event the server sets when the request's
time is up; the work checks it between its expensive steps (`going`) and stops there.
"""

from __future__ import annotations

import base64
import contextlib
import json
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import Future

import numpy as np
import torch

# the module, not its function: a test may replace `census.heads` with a slow one
from qkv.inspect import census
from qkv.inspect.hide import hide
from qkv.inspect.probe import probe
from qkv.inspect.sinks import SAID, sink_indices
from qkv.inspect.trace import trace
from qkv.inspect.why import encoded_why
from qkv.inspect.words import compressed_words
from qkv.serve.held import Served
from qkv.serve.jobs import in_thread
from qkv.serve.limits import Busy, Cancelled, Limits, TooLarge
from qkv.viz.lines import hide_scale_text
from qkv.viz.page import drawn_weights
from qkv.viz.step_words import ROLES, multiplied

FLOAT32 = "float32, little-endian, row-major T x T, base64; one string per head"


def going(stop: threading.Event | None) -> None:
    """Cancelled when the request's time is up: called between a work's expensive steps."""
    if stop is not None and stop.is_set():
        raise Cancelled


def encode(served: Served, limits: Limits, text: str, what: str = "the text"):
    """The text's tokens, within max_tokens (its characters were checked on arrival)."""
    return within(served, text, lambda count: limits.check_tokens(count, what))


def within(served: Served, text: str, check: Callable[[int], None]):
    """The text's tokens once check(count) passes: the server's token limit first (413), then
    the model's own context window (`Pretrained.encode`: 422), so that a text over a limit
    is told that limit's status whatever its length (MiniLM reads 512 tokens: a text of 600
    over max_tokens was once a 422 where one of 300 was a 413)."""
    encoded = served.pretrained.tokenizer.encode(text)
    check(len(encoded.ids))
    if len(encoded.ids) > served.pretrained.context_window:
        served.pretrained.encode(text)  # raises, naming the model and its window
    return encoded


def attention(
    served: Served,
    limits: Limits,
    text: str,
    layers: list[int] | None,
    heads: list[int] | None,
    fmt: str,
    stop: threading.Event | None = None,
) -> bytes:
    """The weights of the chosen layers and heads, (L', H', T, T), and the text's tokens, as
    JSON. Its size, L' x H' x T x T, is checked against max_weights before the forward pass."""
    T = len(encode(served, limits, text).ids)
    for name, chosen in (("layer", layers), ("head", heads)):
        if chosen is not None and not chosen:
            raise ValueError(f"{name}s is empty; leave it out for every {name}")
    layers = served.choose("layer", layers)
    heads = served.choose_heads(heads, layers)  # each layer's own count (Qwen3.5's differ)
    size = len(layers) * len(heads) * T * T
    if size > limits.max_weights:
        raise TooLarge(
            f"{len(layers)} layers x {len(heads)} heads x {T} x {T} tokens are {size:,} "
            f"weights; this server sends at most {limits.max_weights:,} in one answer "
            "(max_weights): ask for fewer layers or heads, or a shorter text"
        )
    going(stop)
    seen = served.pretrained.attentions(text, layers=layers, heads=heads)
    # a linear layer's signed effective weights as each row's shares of |w|, as the page draws
    drawn, effective = drawn_weights(seen)
    weights = drawn[[seen.layers.index(layer) for layer in layers]]  # (L', H', T, T)
    rows = []  # one layer's JSON at a time: the slow part of a large answer, so it can stop
    for row in weights.numpy():  # (H', T, T)
        going(stop)
        rows.append(json.dumps([matrix_json(m, fmt) for m in row]))
    answer = {
        "model": served.name,
        "text": text,
        "tokens": list(seen.tokens),
        "pieces": seen.pieces,
        "words": words(seen.encoded),
        "layers": layers,
        "heads": heads,
        "shape": list(weights.shape),
        "format": fmt,
        "encoding": FLOAT32 if fmt == "base64" else "lists of floats: [layer][head][query][key]",
        "on_words": compressed_words(seen.records),  # entries' weights spread on their words
        # where some layers keep a running memory (linear attention): what their weights are
        "effective": effective,
        "effective_layers": [n for n in layers if seen.records[n].linear is not None],
        # a query's largest weight on one of these is named an attention sink (qkv.inspect.sinks)
        "sinks": {"indices": sink_indices(list(seen.tokens)), "said": SAID},
    }
    return (json.dumps(answer)[:-1] + ', "weights": [' + ", ".join(rows) + "]}").encode()


def matrix_json(matrix: np.ndarray, fmt: str):
    """One head's (T, T) weights as the answer sends them; None for a head its layer does not
    have (all NaN: layers of different head counts, as Qwen3.5's)."""
    if np.isnan(matrix).all():
        return None
    return pack_float32(matrix) if fmt == "base64" else matrix.tolist()


def words(encoded) -> list[dict]:
    """Each word of the text with its name for a trace (`Word.name`: "bank#1", "bank#2" for a
    word that occurs more than once, as a trace must be asked for it) and its tokens [start,
    end)."""
    return [{"word": w.name, "tokens": list(w.token_span)} for w in encoded.words()]


def trace_pair(
    served: Served,
    limits: Limits,
    text: str,
    query: str,
    key: str,
    layer: int | None,
    head: int | None,
    stop: threading.Event | None = None,
) -> dict:
    """`qkv.trace(...).to_dict()`: the article's steps for one pair (docs/explain.md)."""
    encode(served, limits, text)
    going(stop)
    traced = trace(served.pretrained, text, query, key, layer=layer, head=head)
    return trace_answer(served.name, traced)


def trace_answer(model: str, traced) -> dict:
    """A trace as /api/trace answers it: `to_dict()`, the model's name, and what the layer's
    matrices multiply in the words the CLI and the report page use (`qkv.viz.step_words`)."""
    cross = traced.query_tokens is not None
    multiplies = {role: multiplied(role, traced.layer, cross=cross) for role in ROLES}
    return {"model": model, **traced.to_dict(), "multiplies": multiplies}


def why_pair(
    served: Served,
    limits: Limits,
    text: str,
    query_index: int,
    key_index: int,
    layer: int | None,
    head: int | None,
    checks: int,
    top: int,
    grid: bool,
    stop: threading.Event | None = None,
) -> dict:
    """`qkv.why(...).to_dict(top)` of the pair at token positions (query_index, key_index), as
    the page knows a clicked cell: the score taken apart (`qkv.inspect.why`), with `pieces` (each
    token as the page shows it). The full grid of terms only with `grid` (SmolLM2's is about
    300 x 300 parts); null otherwise."""
    encoded = encode(served, limits, text)
    if layer is not None:
        served.check_index("layer", layer)
        if head is not None:
            served.check_pair(layer, head)  # a head this layer has
    elif head is not None:
        served.check_index("head", head)
    going(stop)
    found = encoded_why(served.pretrained.model, encoded, query_index, key_index, layer=layer,
                        head=head, checks=checks, source=served.name)  # fmt: skip
    answer = found.to_dict(top)
    if not grid:
        answer["terms"] = None
    return {"model": served.name, "pieces": encoded.pieces, **answer}


def contributions(
    served: Served,
    limits: Limits,
    text: str,
    query: str,
    layer: int,
    head: int,
    stop: threading.Event | None = None,
) -> dict:
    """What each token added to `query`'s new vector in one head: the trace's contributions,
    ranked by softmax weight and by size after the output projection."""
    encode(served, limits, text)
    served.check_index("layer", layer)
    served.check_pair(layer, head)  # a head this layer has
    going(stop)
    # the query word as its own key: always a word it sees
    traced = trace(served.pretrained, text, query, query, layer=layer, head=head)
    found = [
        {"token": c.token, "index": c.index, "weight": c.weight, "size": c.size}
        for c in traced.contributions
    ]
    return {
        "model": served.name,
        "text": text,
        "tokens": traced.tokens,
        "query": query,
        "query_index": traced.query_index,
        "layer": layer,
        "head": head,
        "causal": traced.causal,
        "contributions": found,
        "by_weight": [c["index"] for c in sorted(found, key=lambda c: -c["weight"])],
        "by_size": [c["index"] for c in sorted(found, key=lambda c: -c["size"])],
    }


def probe_word(
    served: Served,
    limits: Limits,
    word: str,
    sentences: list[str] | None,
    labels: list[str] | None,
    cues: list[str] | None,
    stop: threading.Event | None = None,
) -> dict:
    """`probe(...).to_dict()`: the word's vectors compared across sentences (docs/probe.md)."""
    for i, sentence in enumerate(sentences or []):
        encode(served, limits, sentence, f"sentence {i}")
    going(stop)
    found = probe(served.pretrained, word, sentences, labels, cues=cues)
    return {"model": served.name, **found.to_dict()}


def next_tokens(
    served: Served, limits: Limits, text: str, top: int, stop: threading.Event | None = None
) -> dict:
    """A decoder's probabilities for the token after `text`: the `top` most likely."""
    must_generate(served)
    encoded = encode(served, limits, text)
    going(stop)
    with torch.inference_mode():
        logits = served.pretrained.model(torch.tensor([encoded.ids])).logits[0, -1].float()
    probabilities = logits.softmax(-1)  # (vocab,)
    best = probabilities.topk(min(top, len(probabilities)))
    tokenizer = served.pretrained.tokenizer
    ids = best.indices.tolist()
    return {
        "model": served.name,
        "text": text,
        "tokens": list(encoded.tokens),
        "next": [
            {
                "id": i,
                "token": tokenizer.id_to_token(i),
                "text": piece,  # a byte of a split character as <0xE6>, never U+FFFD
                "probability": p,
                "logit": float(logits[i]),
            }
            for p, i, piece in zip(best.values.tolist(), ids, tokenizer.pieces(ids), strict=True)
        ],
    }


def must_generate(served: Served) -> None:
    if not served.decoder:
        raise ValueError(
            f"{served.name} is an encoder: next-token probabilities and generation need a "
            "decoder model"
        )


def check_generation(served: Served, limits: Limits, prompt: str, max_new_tokens: int) -> None:
    """The checks a generation passes before it starts (and before a stream is opened)."""
    must_generate(served)
    if max_new_tokens > limits.max_new_tokens:
        raise ValueError(
            f"max_new_tokens {max_new_tokens} is over this server's limit of "
            f"{limits.max_new_tokens} (max_new_tokens)"
        )
    encode(served, limits, prompt, "the prompt")


class Stopped(Exception):
    """Raised from the stream callback to end a generation early."""


def generate(
    served: Served,
    limits: Limits,
    prompt: str,
    options: dict,
    emit: Callable[[str], None],
    stop: threading.Event | None = None,
) -> dict:
    """Run `Pretrained.generate`, handing each piece of text to `emit`; stop at
    max_new_tokens, the end of the text, generate_s or when `stop` is set (the client left,
    or the request's time is up), between one token and the next."""
    deadline = time.monotonic() + limits.generate_s
    finished = "end"  # the end-of-text token, or max_new_tokens
    pieces: list[str] = []

    def stream(row: int, piece: str) -> None:
        nonlocal finished
        pieces.append(piece)
        emit(piece)
        if stop is not None and stop.is_set():
            finished = "cancelled"
            raise Stopped
        if time.monotonic() >= deadline:
            finished = "time limit"
            raise Stopped

    with contextlib.suppress(Stopped):
        served.pretrained.generate(prompt, stream=stream, **options)
    return {
        "model": served.name,
        "text": "".join(pieces),
        "finished": finished,
        "limit_s": limits.generate_s,
        "ended": ended(
            finished,
            len(pieces),
            options.get("max_new_tokens"),
            limits.generate_s,
            stops=bool(options.get("stop")),
        ),
    }


def ended(finished: str, count: int, most: int | None, limit_s: float, stops=False) -> str:
    """What ended a generation, in words: "end" is the model's end-of-text token or the
    max_new_tokens asked, told apart by the count of tokens written.

    >>> ended("end", 16, 16, 30.0)
    'wrote 16 tokens, the most asked (max_new_tokens 16)'
    >>> ended("end", 5, 16, 30.0)
    'the model ended its text (its end-of-text token) after 5 tokens'
    """
    if finished == "cancelled":
        return f"cancelled after {count} tokens"
    if finished == "time limit":
        return f"stopped at this server's time limit of {limit_s:g} s, after {count} tokens"
    if most is not None and count >= most:
        return f"wrote {count} tokens, the most asked (max_new_tokens {most})"
    why = "its end-of-text token, or a stop text asked" if stops else "its end-of-text token"
    return f"the model ended its text ({why}) after {count} tokens"


def pack_float32(values: np.ndarray) -> str:
    """One matrix as base64 of its little-endian float32 bytes, as the attention API sends it.

    >>> pack_float32(np.array([[1.0, 0.5]]))
    'AACAPwAAAD8='
    """
    return base64.b64encode(np.asarray(values, dtype="<f4").tobytes()).decode("ascii")


def hide_word(
    served: Served,
    limits: Limits,
    text: str,
    key: str,
    query: str | None,
    layers: list[int] | None,
    heads: list[int] | None,
    table: bool = True,
    scale: bool | None = None,
    stop: threading.Event | None = None,
) -> dict:
    """`qkv.hide(...).to_dict()` (docs/hide.md), a layer at a time so that it can stop.

    A whole table is many runs (SmolLM2's 270 heads are 270 runs through up to 30 layers),
    so the key is first hidden everywhere asked at once (`table=False`: one run, and every
    check of the words), then each layer's row is `hide` asked of that layer alone, with
    `going(stop)` between. A row is the same either way, since each layer's runs resume
    from the clean run there; a test checks the answer equals one `hide` call's.
    """
    encode(served, limits, text)
    layers = served.choose("layer", layers)
    heads = served.choose_heads(heads, layers)  # each layer's own count (Qwen3.5's differ)
    going(stop)
    hidden = hide(served.pretrained, text, key, query=query, layers=layers, heads=heads,
                  table=False, scale=table if scale is None else scale)  # fmt: skip
    for layer in layers if table else []:
        own = served.own_heads(heads, layer)
        if not own:
            continue  # none of the heads asked is this layer's
        going(stop)
        row = hide(served.pretrained, text, key, query=query, layers=[layer], heads=own,
                   scale=False)  # fmt: skip
        for name in ("effect", "distance", "next_by_head"):
            if getattr(hidden, name) is not None:
                getattr(hidden, name)[layer] = getattr(row, name)[layer]
    answer = hidden.to_dict()
    answer["scale"] = hide_scale_text(hidden)  # the key's rank among the other words, in words
    if not table:  # no head alone was run: nothing to rank (and NaN is not JSON)
        answer["ranked"] = []
    return {"model": served.name, **answer}


# A model's census depends on nothing a request sends: computed once per model, in a thread of
# its own (as long as the model is kept), while requests wait for it within their time limit.
_censuses: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # Pretrained -> Future
_census_guard = threading.Lock()


def census_of(served: Served) -> Future:
    """The census of the model's heads over the built-in prompts (`qkv.heads`, docs/heads.md),
    the same for every request: the first request starts it in a thread of its own (SmolLM2's
    takes a while on a small CPU: every prompt through every layer); each request waits for it
    up to half of timeout_s, and past that is told 503 (`still_counting`), ask again, while the
    census goes on to its end. A census the model cannot give is refused on every request."""
    pretrained = served.pretrained
    with _census_guard:
        if pretrained not in _censuses:
            counting = in_thread(lambda: census.heads(pretrained).to_dict(), "qkv-census")
            _censuses[pretrained] = counting
        return _censuses[pretrained]


def still_counting(served: Served) -> Busy:
    """The 503 of a request that waited for the census as long as it may."""
    return Busy(
        f"the census of {served.name}'s heads is being computed (every built-in prompt "
        "through every layer, once per model); ask again in a few seconds"
    )


def head_census(served: Served, counted: Future) -> dict:
    """`qkv.heads(...).to_dict()` once `counted` (`census_of`) is done; its error if it failed."""
    return {"model": served.name, **counted.result()}
