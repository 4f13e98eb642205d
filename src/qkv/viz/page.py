"""The one page builder: the interactive page of a text's attention, from its `Attentions`.

`qkv show`, `qkv.hf`'s `write_page` and the notebook all build the page here, so that each
gets the same page for the same text: the weights, each token as people read it (`pieces`),
and, where the records allow (`qkv.inspect.records.why_not_redone`), the q, k, v vectors and
each layer's score rules that let the page redo a clicked pair.

Example, with a real model::

    seen = qkv.load("minilm").attentions("The bank on the side of the river")
    write_attention_page("bank.html", seen, title="bank")   # or a report folder
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
from torch import Tensor

from qkv.inspect.census import shares
from qkv.inspect.records import why_not_redone
from qkv.inspect.words import compressed_words
from qkv.io.files import write_atomically
from qkv.viz.page_vectors import page_trace
from qkv.viz.report import check_new_folder, render_page, report_folder


def attention_page(
    seen,
    *,
    title: str,
    text: str | None = None,
    extra: dict | None = None,
    head: tuple[int, int] | None = None,
    query: int | None = None,
    bias_is_distance: bool = False,
    trace: bool = True,
    max_bytes: int | None = None,
    whys: dict | None = None,
) -> bytes:
    """The page (UTF-8 HTML) of `seen`: an `Attentions` (`weights`, `pieces`, `records`,
    `layers`, `heads`, `causal`, `scale`, `query_tokens`), self-attention over one text or an
    encoder-decoder's cross-attention (target tokens down, source tokens across).

    The page redoes a clicked pair from the records' q, k, v where `why_not_redone` allows it
    and the layers share one scale; trace=False leaves the vectors out. bias_is_distance: the
    layers' score bias is T5's relative positions (the page says so). `extra` (a JSON-able
    dict shown as a list) is, by default, which of the model's layers and heads the page holds
    when it is not all of them. max_bytes: where the page with the vectors is larger, it is
    made without them. title, text, head and query as `render_page` takes them; whys: the
    pairs taken apart ahead for the "why" panel (`qkv.viz.page_why.page_whys`), none if None.
    """
    cross = seen.query_tokens is not None
    weights, effective = drawn_weights(seen)
    if effective is not None:
        extra = {**(subset_note(seen) or {} if extra is None else extra),
                 "effective weights": effective}  # fmt: skip
    spread = compressed_words(seen.records)  # entries' weights drawn on their words
    if spread is not None:
        extra = {**(subset_note(seen) or {} if extra is None else extra), "on words": spread}
    scale = _one_scale(seen)
    vectors = scores = None
    one_count = len({seen.records[n].shape.H for n in seen.layers}) == 1  # vectors stack
    if (
        trace
        and one_count
        and scale is not None
        and why_not_redone(seen.records, cross=cross) is None
    ):
        vectors, scores = page_trace(seen.records, bias_is_distance=bias_is_distance, cross=cross)
        heads = list(seen.heads)  # the heads shown, of every head a record holds
        vectors = [array[:, heads] for array in vectors]  # 3 x (L', H', T, D)
        scores = [s if s.bias is None else dataclasses.replace(s, bias=s.bias[heads])
                  for s in scores]  # fmt: skip
    common = dict(
        title=title, text=text, extra=subset_note(seen) if extra is None else extra, head=head,
        query=query, causal=seen.causal, query_tokens=seen.query_tokens, whys=whys,
    )  # fmt: skip
    page = render_page(weights, seen.pieces, vectors=vectors, scale=scale, scores=scores,
                       **common)  # fmt: skip
    if max_bytes is not None and len(page) > max_bytes and vectors is not None:
        page = render_page(weights, seen.pieces, **common)  # the weights alone, then
    return page


def write_attention_page(out: str | Path, seen, **options) -> Path:
    """`attention_page(seen, **options)` written as one file where `out` ends in .html or
    .htm, as a report folder otherwise (index.html beside model_view.png and the first head's
    PNG, `write_report`'s folder). All or nothing. Returns `out`."""
    out = Path(out)
    if out.suffix.lower() in (".html", ".htm"):
        page = attention_page(seen, **options)
        write_atomically(out, lambda file: file.write(page))
        return out
    check_new_folder(out)
    page = attention_page(seen, **options)
    return report_folder(out, page, drawn_weights(seen)[0], seen.pieces, head=options.get("head"),
                         query_tokens=seen.query_tokens)  # fmt: skip


def drawn_weights(seen) -> tuple[Tensor, str | None]:
    """The weights a picture of `seen` draws (L', H', Tq, Tk), each between 0 and 1, and the
    words that say where they are not a softmax's (None where every layer's are): a linear
    layer's effective weights are signed and sum to anything, so it is drawn as each row's
    shares of its absolute effective weight, |w| / sum |w|, as the census reads it."""
    linear = [i for i, n in enumerate(seen.layers) if seen.records[n].linear is not None]
    if not linear:
        return seen.weights, None
    weights = seen.weights.clone()
    some = weights[linear].double()  # NaN: a head the layer does not have, kept so
    weights[linear] = torch.where(some.isnan(), some, shares(some)).to(weights.dtype)
    named = ", ".join(str(seen.layers[i]) for i in linear)
    return weights, (
        f"layer{'s' if len(linear) > 1 else ''} {named} keep a running memory (linear "
        "attention), with no softmax: drawn as each row's shares of the absolute effective "
        "weight, |w| / sum |w|; the signed effective weights are in the records' weights() and "
        "qkv explain"
    )


def subset_note(seen) -> dict | None:
    """The page counts the layers and heads it holds from 0: say which of the model's they are
    when they are not all of them."""
    H = max(record.shape.H for record in seen.records.values())  # layers may differ
    layers, heads = seen.layers, list(seen.heads)
    if layers == list(range(len(layers))) and heads == list(range(H)):
        return None
    return {
        "layers shown": layers,
        "heads shown": heads,
        "counting": "this page counts the layers and heads it holds from 0: its layer i is "
        "the model's layer 'layers shown'[i], its head j the model's 'heads shown'[j]",
    }


def _one_scale(seen) -> float | None:
    """The one scale of every layer's dot products; None where they differ, and the page,
    which takes one, is then written without the vectors."""
    try:
        return float(seen.scale)
    except ValueError:  # the layers differ in scale: the page can only take one
        return None
