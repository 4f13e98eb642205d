"""Self-contained attention pages: one HTML file, or a report folder with PNGs beside it.

The page (`report.html` in this package) needs nothing from the network: inline CSS and a
little vanilla JavaScript, the system font, and the weights embedded in a
<script type="application/json" id="qkv-data"> tag. A layer and a head are picked with
<select id="layer"> and <select id="head">; the selected head is drawn as a heatmap (a table
of cells with data-q, data-k and data-w up to 40 tokens, a canvas beyond) and as a head view
(tokens in two columns, lines weighted by attention); clicking a token (class "token",
data-index) makes it the query and lists its row as percentages in id="row". The page sets
`window.qkvReady = true` once it has drawn.

Given `query_tokens`, the weights are an encoder-decoder's cross-attention, (L, H, Tq, Tk):
the target's tokens (the queries) down, the source's (`tokens`, the keys) across, and the
clickable tokens are the target's. Its pairs are traced as self-attention's are, from the
decoder's q and the encoder's k and v (`page_trace(records, cross=True)`).

Given `vectors` = (q, k, v), every layer's and head's query, key and value vectors as attention
received them (`Attentions.vectors()`), and the `scale` on their dot products (1/sqrt(D) by
default, the records' `scale`) and, per layer, what it does to a score beyond the scale
(`scores`: its window, Gemma 2's soft-cap, a bias such as T5's distances; `page_trace` reads
both from a text's records), the page also traces a pair: clicking a
heatmap cell (query i, key j), or a key in the query's row, redoes the article's steps for it
in the panel id="trace" (#t-scalar, #t-scaled, #t-weight, #t-contextualized, ..., each with
its full value as JSON in data-values; #t-capped, #t-bias and #t-score where a layer caps or
biases its scores). They are stored exactly (float32, zlib, base64, one
string per head) for texts up to 128 tokens; longer pages leave them out and say so.

The weights are stored exactly as the model gave them (float32, zlib, base64, one string per
head), never rounded or renormalised, so no ranking of two weights can change on the page:
`read_weights` decodes them. A 6-layer, 12-head model over 500 tokens makes a page of about
80 MB (the float32 bits barely compress); over 128 tokens, about 5 MB.

Example, with a real model::

    att = qkv.load("minilm").attentions("The bank on the side of the river")
    write_report("bank-report", att.weights, att.tokens, title="bank", text=att.encoded.text)

and with the pairs' traces (`causal=True` for decoders, whose keys after a query are masked)::

    minilm = qkv.load("minilm")
    att = minilm.attentions("The bank on the side of the river")
    write_html("bank.html", att.weights, att.tokens, vectors=att.vectors(), causal=False)

and an encoder-decoder's cross-attention (target tokens down, source tokens across)::

    att = reverser.attentions("a b c d", target="d c b a")
    vectors, scores = page_trace(att.records, cross=True)
    write_html("cross.html", att.weights, att.tokens, query_tokens=att.query_tokens,
               vectors=vectors, scale=att.scale, scores=scores)
"""

from __future__ import annotations

import base64
import json
import re
import zlib
from collections.abc import Sequence
from importlib.resources import files
from pathlib import Path

import numpy as np

from qkv.attention.inputs import check_indices
from qkv.inspect.sinks import SAID, sink_indices
from qkv.io.files import write_atomically, write_folder_atomically
from qkv.version import __version__
from qkv.viz import escape
from qkv.viz.encode import pack, page_json
from qkv.viz.heatmap import check_cross_weights, check_weights, head_heatmap, model_view
from qkv.viz.page_vectors import (
    VECTORS_MAX_BYTES,
    LayerScores,
    check_scores,
    check_vectors,
    vectors_data,
)
from qkv.viz.paths import html_path
from qkv.viz.step_words import multiplied_by_layer, shifted_right

ENCODING = "float32, little-endian, row-major T x T, zlib, base64; one per head"
CROSS_ENCODING = "float32, little-endian, row-major Tq x Tk, zlib, base64; one per head"
CROSS_HEADER = "cross-attention: target (queries) down, source (keys) across"
WHY_SECTION = (
    '<section id="why" class="panel"><h2>Why this score?</h2><p class="note">Click a cell to '
    "see its score taken apart (qkv.why).</p></section>"
)


def write_html(
    path: str | Path,
    weights,
    tokens: Sequence[str],
    *,
    title: str = "Attention",
    text: str | None = None,
    extra: dict | None = None,
    head: tuple[int, int] | None = None,
    query: int | None = None,
    vectors=None,
    causal: bool = False,
    scale: float | None = None,
    scores: Sequence[LayerScores] | None = None,
    query_tokens: Sequence[str] | None = None,
) -> Path:
    """Write the interactive page of (L, H, T, T) `weights` over `tokens` as one .html file.

    `head` = (layer, head) is the one shown first (by default the `strongest_head`), `query`
    the token selected first (none by default), `extra` a JSON-able dict shown as a list of
    keys and values and embedded with the data. `vectors` = (q, k, v), each (L, H, T, D), lets
    the page trace a clicked pair (`causal`: keys after the query are masked, as in decoders;
    `scale`: the factor on each dot product, 1/sqrt(D) if None; `scores`: each layer's
    window, soft-cap and score bias, `LayerScores`, none if None). With `query_tokens`, the
    weights are cross-attention, (L, H, Tq, Tk) from the target's Tq tokens (rows) to the
    source's Tk `tokens` (columns); `vectors` are then q (L, H, Tq, D), k and v (L, H, Tk, D).
    Returns the path written.
    """
    path = html_path(path)
    page = render_page(
        weights, tokens, title=title, text=text, extra=extra, head=head, query=query,
        vectors=vectors, causal=causal, scale=scale, scores=scores, query_tokens=query_tokens,
    )  # fmt: skip
    write_atomically(path, lambda file: file.write(page))
    return path


def write_report(
    folder: str | Path,
    weights,
    tokens: Sequence[str],
    *,
    title: str = "Attention",
    text: str | None = None,
    extra: dict | None = None,
    head: tuple[int, int] | None = None,
    query: int | None = None,
    vectors=None,
    causal: bool = False,
    scale: float | None = None,
    scores: Sequence[LayerScores] | None = None,
    query_tokens: Sequence[str] | None = None,
    beside: dict[str, str] | None = None,
) -> Path:
    """Write a report folder: index.html (the page of `write_html`), model_view.png (every
    layer and head) and head_L{l}_H{h}.png (the head shown first, by default the
    `strongest_head`). All or nothing: the folder is built beside the target and renamed.
    `vectors`, `causal`, `scale`, `scores` and `query_tokens` (cross-attention) are as in
    `write_html`. `beside`: {label: file name} of pages the caller puts in the same folder
    (`qkv demo`'s tour.html), linked under the page's title.

    The target must not exist or be an empty folder. Returns the folder.
    """
    folder = Path(folder)
    check_new_folder(folder)
    page = render_page(
        weights, tokens, title=title, text=text, extra=extra, head=head, query=query,
        vectors=vectors, causal=causal, scale=scale, scores=scores, query_tokens=query_tokens,
        beside=beside,
    )  # fmt: skip
    return report_folder(folder, page, weights, tokens, head=head, query_tokens=query_tokens)


def check_new_folder(folder: Path) -> None:
    """A report folder is written where nothing is, or into an empty folder."""
    if folder.exists() and (not folder.is_dir() or any(folder.iterdir())):
        raise ValueError(f"{folder} exists and is not an empty folder; choose a new one")


def report_folder(
    folder: Path,
    page: bytes,
    weights,
    tokens: Sequence[str],
    *,
    head: tuple[int, int] | None = None,
    query_tokens: Sequence[str] | None = None,
) -> Path:
    """Write `page` (`render_page`'s, of these `weights` and `head`) as a report folder's
    index.html, beside model_view.png and the PNG of `head` (by default the
    `strongest_head`), all or nothing."""
    cross = query_tokens is not None
    stack = _check_stack(weights, tokens, query_tokens)  # (L, H, Tq, Tk)
    layer, chosen = head if head is not None else strongest_head(stack, cross=cross)
    strongest = "the strongest weight" + ("" if cross else " from one token to another")
    why = "chosen" if head is not None else strongest

    def write(staging: Path) -> None:
        write_atomically(staging / "index.html", lambda file: file.write(page))
        model_view(stack, tokens, staging / "model_view.png", query_tokens=query_tokens)
        head_heatmap(
            stack[layer, chosen],
            tokens,
            staging / f"head_L{layer}_H{chosen}.png",
            title=f"L{layer} H{chosen} (from 0), {why}",
            query_tokens=query_tokens,
        )

    return write_folder_atomically(folder, write)


def strongest_head(weights, *, cross: bool = False) -> tuple[int, int]:
    """(layer, head) holding the largest weight from one token to another (the diagonal,
    a token's weight on itself, left out); the first such head on a tie. With `cross`, the
    weights are cross-attention (L, H, Tq, Tk), whose diagonal is no token's weight on itself:
    the head holding the largest weight of all.

    >>> w = np.tile(np.eye(3), (2, 2, 1, 1))  # (L, H, T, T): every token on itself only
    >>> w[1, 0, 2] = [0.1, 0.7, 0.2]
    >>> strongest_head(w)
    (1, 0)
    >>> strongest_head(w, cross=True)
    (0, 0)
    """
    if hasattr(weights, "detach"):
        weights = weights.detach().float().cpu().numpy()
    stack = np.asarray(weights, dtype=np.float32)  # (L, H, T, T)
    stack = np.where(np.isnan(stack), -np.inf, stack)  # NaN: a head the layer does not have
    L, H, T = stack.shape[0], stack.shape[1], stack.shape[-1]
    if cross:
        return divmod(int(stack.reshape(L * H, -1).max(axis=1).argmax()), H)
    if T < 2:
        return 0, 0
    flat = stack.reshape(L * H, T * T).copy()
    flat[:, :: T + 1] = -np.inf  # the diagonal of each (T, T) matrix
    return divmod(int(flat.max(axis=1).argmax()), H)


def read_weights(page: str) -> tuple[np.ndarray, list[str]]:
    """The (L, H, T, T) float32 weights, as stored, and the tokens embedded in a page; for
    cross-attention (L, H, Tq, Tk) and the source's tokens (the target's are the page data's
    "query_tokens")."""
    found = re.search(r'<script type="application/json" id="qkv-data">(.*?)</script>', page, re.S)
    if found is None:
        raise ValueError("this page has no qkv-data script: it was not written by qkv")
    data = json.loads(found.group(1))
    Tk = len(data["tokens"])
    Tq = len(data.get("query_tokens") or data["tokens"])
    heads = [
        [np.frombuffer(zlib.decompress(base64.b64decode(h)), "<f4").reshape(Tq, Tk) for h in layer]
        for layer in data["weights"]["heads"]
    ]
    return np.array(heads, dtype=np.float32), data["tokens"]


def render_page(
    weights,
    tokens: Sequence[str],
    *,
    title: str,
    text: str | None,
    extra: dict | None,
    head: tuple[int, int] | None,
    query: int | None,
    vectors=None,
    causal: bool = False,
    scale: float | None = None,
    scores: Sequence[LayerScores] | None = None,
    query_tokens: Sequence[str] | None = None,
    whys: dict | None = None,
    beside: dict[str, str] | None = None,
) -> bytes:
    """The page's HTML, UTF-8 encoded; every argument is checked before anything is built.
    With `query_tokens`, cross-attention: (L, H, Tq, Tk) weights, target rows, source columns.
    `whys`: the pairs taken apart ahead for the "why" panel (`qkv.viz.page_why.page_whys`);
    without them the page has no such panel."""
    tokens = [str(token) for token in tokens]
    cross = query_tokens is not None
    queries = [str(token) for token in query_tokens] if cross else tokens
    stack = _check_stack(weights, tokens, queries if cross else None)  # (L, H, Tq, Tk)
    L, H, Tq, T = stack.shape[0], stack.shape[1], len(queries), len(tokens)
    # a head a layer does not have (layers of different head counts: Qwen3.5's) is all NaN
    absent = np.isnan(stack).all(axis=(2, 3))  # (L, H)
    low, high = float(np.nanmin(stack)), float(np.nanmax(stack))
    if low < -1e-6 or high > 1 + 1e-6:
        raise ValueError(
            f"weights must lie between 0 and 1 (each row a softmax); these run {low:.4g} to "
            f"{high:.4g}"
        )
    layer, chosen = head if head is not None else strongest_head(stack, cross=cross)
    check_indices("layer", [layer], L, "the page")
    check_indices("head", [chosen], H, "the page")
    if absent[layer, chosen]:
        raise ValueError(f"layer {layer} has no head {chosen} on this page: it has "
                         f"{int((~absent[layer]).sum())} heads")  # fmt: skip
    if query is not None:
        check_indices("target token" if cross else "token", [query], Tq, "the page")
    if extra is not None and not isinstance(extra, dict):
        raise ValueError(f"extra must be a dict of names to values, not {type(extra).__name__}")
    kept = check_vectors(vectors, (L, H, Tq, T), cross) if vectors is not None else None
    rules = check_scores(scores, (L, H, Tq, T), cross) if scores is not None else None
    if rules is not None and kept is None:
        raise ValueError("scores change how the page redoes a pair: pass them with the vectors")
    size = 0 if kept is None else sum(array.size * 4 for array in kept)
    size += sum(rule.bias.size * 4 for rule in rules or () if rule.bias is not None)
    if size > VECTORS_MAX_BYTES:
        kept = None
        counted = f"{Tq} target and {T} source tokens" if cross else f"{T} tokens"
        trace_note = (
            f"The query, key and value vectors were left out of this page: for {counted} "
            f"they take {size / 2**20:.0f} MB, more than {VECTORS_MAX_BYTES / 2**20:.0f} MB. "
            "Trace a pair from Python with qkv.trace, or with qkv explain."
        )
    elif kept is None:
        trace_note = (
            "This page was written without the query, key and value vectors, so it cannot redo "
            "a pair's steps. qkv show writes them (up to "
            f"{VECTORS_MAX_BYTES / 2**20:.0f} MB of them); qkv explain traces a pair from the "
            "command line."
        )
    else:
        trace_note = (
            "Click a cell of the heatmap (a query row, a key column), or a query token and then "
            "a key in its list below the heatmap, to see the article's steps for that pair."
        )

    if scale is not None and not (isinstance(scale, int | float) and 0 < scale < float("inf")):
        raise ValueError(f"scale must be a positive number or None, got {scale!r}")
    if cross and causal:
        raise ValueError("cross-attention hides no key by position: causal must be False")
    stored = stack.astype("<f4")  # (L, H, Tq, Tk): the model's own numbers, nothing rounded
    data = {
        "format": "qkv-attention/2",
        "title": title,
        "text": text,
        "tokens": tokens,
        "query_tokens": queries if cross else None,  # cross-attention: the target's, the rows
        "num_layers": L,
        "num_heads": H,
        "weights": {
            "encoding": CROSS_ENCODING if cross else ENCODING,
            # null: a head the layer does not have
            "heads": [
                [None if gone else pack(matrix) for matrix, gone in zip(heads, lost, strict=True)]
                for heads, lost in zip(stored, absent, strict=True)
            ],
        },
        # per layer, the heads it does not have; null where every layer has every head
        "absent": absent.tolist() if absent.any() else None,
        "selected": {"layer": int(layer), "head": int(chosen), "query": _maybe_int(query)},
        "causal": bool(causal),
        "vectors": None if kept is None else vectors_data(kept, scale, rules),
        "extra": extra,
        "whys": whys,
        # what each layer's query, key and value matrices multiply, in the CLI's words
        "multiplies": multiplied_by_layer(L, cross=cross),
        # the keys a query's largest weight is named an attention sink on, and the words
        "sinks": {"indices": sink_indices(tokens), "said": SAID},
    }
    slots = {
        "version": __version__,
        "title": escape.text(title),
        "text": escape.text(text or " ".join(tokens)),
        "layer_options": _options(L, int(layer), first="the first layer"),
        "head_options": _options(H, int(chosen), first="the first head"),
        "tokens": "".join(
            f'<button type="button" class="token" data-index="{i}">{escape.text(_shown(t))}'
            "</button>"
            for i, t in enumerate(queries)
        ),
        "kind": _cross_header(queries, tokens) if cross else "",
        "heatmap_title": (
            "target (queries) down, source (keys) across" if cross else "queries down, keys across"
        ),
        "headview_title": (
            "target (queries) left, source (keys) right" if cross else "queries left, keys right"
        ),
        "extra": _extra_section(extra),
        "beside": _beside_links(beside),
        "trace_note": escape.text(trace_note),
        "why_section": "" if whys is None else WHY_SECTION,
        "why_script": "" if whys is None else _why_script(),
        "data": escape.script_json(page_json(data, separators=(",", ":"))),
    }
    template = (files("qkv.viz") / "report.html").read_text(encoding="utf-8")
    page = re.sub(r"\{\{ (\w+) \}\}", lambda match: slots[match.group(1)], template)
    return page.encode("utf-8", errors="replace")


# ------------------------------------------------------------------ helpers


def _check_stack(weights, tokens: Sequence[str], query_tokens: Sequence[str] | None):
    """(L, H, T, T) self-attention weights, or (L, H, Tq, Tk) cross-attention's with
    `query_tokens`, as float32, their shape checked."""
    if query_tokens is None:
        return check_weights(weights, tokens, ndim=4)
    return check_cross_weights(weights, query_tokens, tokens, ndim=4)


def _why_script() -> str:
    """The why panel's script (one file for this page and `qkv serve`'s), as a <script>."""
    script = (files("qkv.viz") / "why_panel.js").read_text(encoding="utf-8")
    assert "</" not in script, "an inline script must not hold '</'"  # our own file
    return f"<script>\n{script}</script>"


def _cross_header(queries: list[str], tokens: list[str]) -> str:
    """The line under a cross-attention page's title: what its rows and columns are."""
    return (
        f'<p id="kind"><b>{CROSS_HEADER}</b>: {len(queries)} target tokens, '
        f"{len(tokens)} source tokens.</p>"
        f'<p id="shifted" class="note">{escape.text(shifted_right(queries))}</p>'
    )


def _maybe_int(index: int | None) -> int | None:
    return None if index is None else int(index)


def _options(count: int, selected: int, *, first: str) -> str:
    return "".join(
        f'<option value="{i}"{" selected" if i == selected else ""}>'
        f"{i}{f' ({first})' if i == 0 else ''}</option>"
        for i in range(count)
    )


def _shown(token: str) -> str:
    """Whitespace-only tokens in quotes, as the page's script shows them too."""
    return json.dumps(token, ensure_ascii=False) if not token.strip() else token


def _beside_links(beside: dict[str, str] | None) -> str:
    """Links to pages in the report's own folder: a plain file name each (no folder, no
    scheme), so a link can only open a sibling page, offline."""
    if not beside:
        return ""
    links = []
    for label, name in beside.items():
        if not isinstance(name, str) or not re.fullmatch(r"[\w-][\w.-]*\.html", name):
            raise ValueError(f"beside: {name!r} is not a page's file name in the report's folder")
        links.append(f'<a href="{escape.attribute(name)}">{escape.text(label)}</a>')
    return f'<p id="beside">{" · ".join(links)}</p>'


def _extra_section(extra: dict | None) -> str:
    if not extra:
        return ""
    items = []
    for key, value in extra.items():
        if isinstance(value, str | int | float | bool) or value is None:
            shown = escape.text(value)
        else:
            shown = f"<pre>{escape.text(page_json(value, indent=2))}</pre>"
        items.append(f"<dt>{escape.text(key)}</dt><dd>{shown}</dd>")
    return f'<section id="extra"><h2>Details</h2><dl>{"".join(items)}</dl></section>'
