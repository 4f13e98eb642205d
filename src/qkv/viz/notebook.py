"""qkv's results in a notebook: the HTML of each object's `_repr_html_`, and its short `repr`.

Jupyter (JupyterLab, classic Notebook, VS Code) shows an object by calling its `_repr_html_`.
Every view here is self-contained: inline styles and numbers, images as data: URIs, no CDN,
no network, no server, no widget extension. Several outputs in one notebook must not clash,
so nothing here uses an element id or a global name:

- `Attentions` shows the interactive page of `qkv show` (`qkv.viz.page.attention_page`) inside
  an iframe whose `srcdoc` is the whole page: its ids and its script live in a window of
  their own, one per output;
- the other results are static HTML (tables with colored cells, each number in a `title`
  and, exactly, in a `data-value` attribute), styled under the class `qkv-nb`.

A plain `repr` stays one short line, e.g. `Hidden('river' hidden from 'bank', minilm, total
0.0388)`: these dataclasses hold tensors whose default repr runs to pages.
"""

from __future__ import annotations

import base64
import json
import math
import tempfile
from pathlib import Path

import torch

from qkv.inspect.probe import MEASURES
from qkv.inspect.sinks import sink_sentence
from qkv.viz import escape
from qkv.viz.generation import render_generation_page
from qkv.viz.heatmap import head_heatmap
from qkv.viz.lines import probe_embeddings_note
from qkv.viz.page import attention_page, drawn_weights
from qkv.viz.report import strongest_head
from qkv.viz.step_words import ROLES, multiplied, shifted_right, split_words

# The most bytes of page a notebook output carries: Jupyter's server drops output beyond its
# iopub data rate limit (1 MB/s over 3 s windows by default), leaving a blank cell.
NOTEBOOK_PAGE_BYTES = 2 * 2**20
VIRIDIS = [(68, 1, 84), (59, 82, 139), (33, 145, 140), (94, 201, 98), (253, 231, 37)]
STYLE = """<style>
.qkv-nb { font-family: system-ui, -apple-system, "Segoe UI", Roboto, Arial, sans-serif;
  font-size: 13px; color: #1f2328; line-height: 1.35; }
.qkv-nb h4 { margin: .6em 0 .3em; font-size: 14px; }
.qkv-nb p { margin: .3em 0; }
.qkv-nb table { border-collapse: collapse; margin: .2em 0 .6em; }
.qkv-nb th, .qkv-nb td { padding: 2px 6px; text-align: right; border: 1px solid #eaeef2;
  font-variant-numeric: tabular-nums; }
.qkv-nb th { font-weight: 600; background: #f6f8fa; }
.qkv-nb td.text, .qkv-nb th.text { text-align: left; }
.qkv-nb table.grid td { min-width: 2.6em; font-size: 11px; }
.qkv-nb td.none { color: #8c959f; background: #f6f8fa; }
.qkv-nb .mono { font-family: ui-monospace, Menlo, Consolas, monospace; font-size: 12px; }
.qkv-nb .bar { display: inline-block; height: .8em; background: #21918c; vertical-align: middle; }
.qkv-nb .bar.negative { background: #c0392b; }
.qkv-nb .note { color: #57606a; }
.qkv-nb td.followed { font-weight: bold; }
</style>"""


# ---------------------------------------------------------------------------- Attentions


def attentions_html(seen) -> str:
    """The interactive page of `seen` (a `qkv.inspect.attentions.Attentions`) in an iframe of
    its own: layer and head selectors, heatmap, head view, a query's row and, where the records
    allow (`qkv.inspect.records.why_not_redone`), a clicked pair's steps; cross-attention's page
    has the target's tokens down and the source's across. A page too large for a notebook
    output shows the strongest head as a PNG (cross-attention: as a table)."""
    weights = drawn_weights(seen)[0]  # (L', H', Tq, Tk); linear layers' as shares of |w|
    if seen.query_tokens is not None:
        return _cross_html(seen, weights)
    page = attention_page(seen, title=f"Attention: {cut(seen.encoded.text, 60)}",
                          text=seen.encoded.text, max_bytes=NOTEBOOK_PAGE_BYTES)  # fmt: skip
    if len(page) > NOTEBOOK_PAGE_BYTES:
        layer, head = strongest_head(weights)  # counted among the layers and heads shown
        layer, head = seen.layers[layer], seen.heads[head]
        return wrapped(
            f"<p>{len(seen.tokens)} tokens: the page of every head would take "
            f"{len(page) / 2**20:.1f} MB, more than a notebook output carries "
            f"({NOTEBOOK_PAGE_BYTES / 2**20:.0f} MB). The strongest head, layer {layer}, head "
            f"{head} (counted from 0) is drawn below; <code>qkv.viz.write_html(path, "
            "att.weights, att.tokens)</code> writes the whole page to open in a browser.</p>"
            + _png_heatmap(
                weights[seen.layers.index(layer), seen.heads.index(head)],
                seen.pieces,
                f"layer {layer}, head {head}",
            )
        )
    return _page_frame(page, len(seen.tokens))


def _cross_html(seen, weights) -> str:
    """Cross-attention's interactive page (target tokens down, source across) in an iframe of
    its own, as `qkv show --target` writes it; a page too large for a notebook output gives
    the head with the largest weight as a table."""
    title = f"Cross-attention: {cut(seen.encoded.text, 60)}"
    page = attention_page(seen, title=title, text=seen.encoded.text, max_bytes=NOTEBOOK_PAGE_BYTES)
    if len(page) <= NOTEBOOK_PAGE_BYTES:
        return _page_frame(page, max(len(seen.query_tokens), len(seen.tokens)))
    layer, head = strongest_head(weights, cross=True)  # the head holding the largest weight
    matrix = weights[layer, head].tolist()  # (Tq, Tk)
    model_layer, model_head = seen.layers[layer], seen.heads[head]
    return wrapped(
        f"<h4>Cross-attention: {len(seen.query_tokens)} target tokens (down) over "
        f"{len(seen.tokens)} source tokens (across)</h4><p>The page of every head would take "
        f"{len(page) / 2**20:.1f} MB, more than a notebook output carries. Layer {model_layer}, "
        f"head {model_head} (counted from 0), the head holding the largest weight; every head "
        "is in <code>.weights</code> (L, H, Tq, Tk).</p>"
        f'<p class="note">{escape.text(shifted_right(list(seen.query_tokens)))}</p>'
        + grid_table(matrix, seen.query_tokens, seen.pieces, name="weight", low=0.0)
    )


def _page_frame(page: bytes, rows: int) -> str:
    """A page of `attention_page` as an iframe's srcdoc, growing to fit its page."""
    height = 760 + 22 * min(rows, 40)  # until the page has loaded and the frame fits it
    fit = (  # grow the frame to its page, as the page grows (a clicked pair's trace)
        "try{const f=this,d=f.contentDocument,fit=()=>{f.style.height="
        "(d.documentElement.scrollHeight+4)+'px'};fit();new ResizeObserver(fit)"
        ".observe(d.body)}catch(e){}"
    )
    return _ascii(
        '<iframe class="qkv-page" title="qkv attention page" '
        f'srcdoc="{escape.attribute(page.decode())}" style="width:100%;height:{height}px;'
        f'border:0" onload="{escape.attribute(fit)}"></iframe>'
    )


def attentions_repr(seen) -> str:
    L, H = len(seen.layers), len(seen.heads)
    if seen.query_tokens is not None:
        return (f"Attentions(cross-attention, {len(seen.query_tokens)} target x "
                f"{len(seen.tokens)} source tokens, {L} layers x {H} heads)")  # fmt: skip
    return (f"Attentions({cut(seen.encoded.text, 60)!r}, {len(seen.tokens)} tokens, {L} layers"
            f" x {H} heads)")  # fmt: skip


# ---------------------------------------------------------------------------- Trace


def trace_html(found) -> str:
    """The article's seven steps for one pair (a `qkv.inspect.trace.Trace`), as a table of the
    real numbers: each vector's first numbers and its norm shown, every number kept in the
    cell's data-value."""
    q, k = quoted(found.query), quoted(found.key)
    cross, layer = found.query_tokens is not None, found.layer
    source = {role: escape.text(multiplied(role, layer, cross=cross)) for role in ROLES}
    rows = [
        ("1", "query", f"Query vector of {q} ({source['query']} times the query matrix)",
         _vector(found.query_vector)),
        ("2", "key", f"Key vector of {k} ({source['key']} times the key matrix)",
         _vector(found.key_vector)),
        ("3", "scalar", "Dot product of the query and key vectors: the attention scalar",
         number_cell(found.attention_scalar)),
        ("", "scaled", f"Times the scale {found.scale:.6g} (1/&radic;{found.head_dim} = "
         f"{1 / math.sqrt(found.head_dim):.6g}: the side note)", number_cell(found.scaled_scalar)),
    ]  # fmt: skip
    if found.score != found.scaled_scalar:
        beyond = []
        if found.softcap is not None:
            beyond.append(f"soft-capped to {found.softcap:g} tanh(s/{found.softcap:g})")
        if found.bias is not None:
            beyond.append(f"plus the layer's score bias {found.bias:+.4f}")
        rows.append(("", "score", f"The score the softmax reads: {', '.join(beyond)}",
                     number_cell(found.score)))  # fmt: skip
    why = ""
    if found.masked:
        why = " (hidden by the layer's mask" + (", outside its window)" if found.outside_window
                                                 else ")")  # fmt: skip
    if found.linear is not None:  # no softmax: a running memory's effective weight
        rows[2] = ("3", "scalar", "Dot product of the query and key vectors (both of length 1); "
                   "no softmax reads it in this layer, which keeps a running memory (linear "
                   "attention)", number_cell(found.attention_scalar))  # fmt: skip
        if found.write_strength is not None:
            rows.append(("", "write", f"{k} writes its value into the memory under its key with "
                         "this strength", number_cell(found.write_strength)))  # fmt: skip
        rows.append(("4", "weight", f"No softmax: the effective weight of {k} for {q}, what "
                     f"the memory returns of {k}'s value when {q}'s query reads it (signed; the "
                     "weights need not sum to 1)", number_cell(found.weight)))  # fmt: skip
    else:
        rows.append(("4", "weight", f"Softmax over every key word: the weight of {k} for "
                     f"{q}{why}", number_cell(found.weight, shown=f"{100 * found.weight:.2f}% "
                                              f"({found.weight:.6g})")))  # fmt: skip
    rows += [
        ("5", "value", f"Value vector of {k} ({source['value']} times the value matrix)",
         _vector(found.value_vector)),
        ("6", "scaled-value", "Scaled value vector: the weight times the value vector",
         _vector(found.scaled_value_vector)),
        ("7", "contextualized", f"The sum of every key's scaled value vector: {q}'s new vector"
         " in this head", _vector(found.contextualized)),
        ("", "output", "The model's own output of this head (the same, computed by its backend)",
         _vector(found.model_output)),
    ]  # fmt: skip
    body = "".join(
        f'<tr data-step="{name}"><td>{step}</td><td class="text">{words}</td>{cell}</tr>'
        for step, name, words, cell in rows
    )
    where = f"layer {found.layer}, head {found.head}"
    if found.num_kv_heads != found.num_heads:
        where += f" (reading key/value head {found.kv_head})"
    chosen = "" if found.chosen == "asked" else f": {escape.text(found.chosen)}"
    # the arrow as a character: an entity here would be escaped again below ("&amp;rarr;")
    shown = found.text if found.target is None else f"{found.text} \u2192 {found.target}"
    weights = [float(w) for w in found.weights]
    keys = found.tokens
    top = sorted(range(len(weights)), key=lambda i: -abs(weights[i]))[:8]
    signed = found.linear is not None  # effective weights: signed, any size
    most = max((abs(weights[i]) for i in top), default=1.0) or 1.0 if signed else 1.0
    row = "".join(
        f'<tr data-key="{i}"><td class="text">{escape.text(keys[i])} ({i})</td>'
        f'<td data-value="{weights[i]!r}">'
        f"{f'{weights[i]:+.4f}' if signed else f'{100 * weights[i]:.2f}%'}</td>"
        f'<td class="text"><span class="bar{" negative" if weights[i] < 0 else ""}" '
        f'style="width:{120 * abs(weights[i]) / most:.1f}px"></span></td></tr>'
        for i in top
    )
    kind = "effective weights (linear attention)" if signed else "weights"
    said = None if signed else sink_sentence(keys, weights, f'"{found.query}"')
    sink = "" if said is None else f'<p class="note sink">{escape.text(said)}.</p>'
    split = "".join(f'<p class="note split">{escape.text(line)}</p>' for line in split_words(found))

    if found.compressed is not None:  # a compressed layer's, spread from its entries
        kind = ("weights on the words (each compressed entry's spread over its block by the "
                "compressor's coefficients, averaged over channels: an attribution)")  # fmt: skip
    return wrapped(
        f"<h4>{q} gets context from {k}: {where}, counted from 0{chosen}</h4>"
        f"<p>{escape.text(found.source)} ({found.num_layers} layers x {found.num_heads} heads, D = "
        f"{found.head_dim}{', causal' if found.causal else ''}): "
        f"<i>{escape.text(cut(shown, 120))}</i></p>{split}"
        f'<table class="steps"><tr><th>step</th><th class="text">the article</th>'
        f"<th>the model's numbers</th></tr>{body}</table>"
        f"<h4>{q}'s {kind} in this head, the largest first</h4>"
        f'<table class="row">{row}</table>{sink}'
    )


def trace_repr(found) -> str:
    return (f"Trace({cut(found.query, 20)!r} <- {cut(found.key, 20)!r}, "
            f"{cut(found.source, 40)}, layer {found.layer} head {found.head}, "
            f"weight {found.weight:.4f})")  # fmt: skip


# ---------------------------------------------------------------------------- Probe


def probe_html(found) -> str:
    """The sense probe (a `qkv.inspect.probe.Probe`): per depth, the senses' separation and
    accuracy with bars, then the similarity matrix at the last depth as colored cells."""
    depths = found.layers
    head = '<tr><th class="text">depth</th><th>mean cosine</th>'
    if found.separation is not None:
        head += '<th>separation</th><th class="text"></th><th>accuracy</th>'
    head += "</tr>"
    N = found.similarity.shape[-1]
    off = ~_eye(N)
    rows = []
    for d, name in enumerate(depths):
        mean = float(found.similarity[d][off].mean()) if N > 1 else 1.0
        cells = f'<td class="text">{escape.text(name)}</td>{number_cell(mean, shown=f"{mean:.4f}")}'
        if found.separation is not None:
            s, a = found.separation[d], found.accuracy[d]
            width = max(0.0, 300 * s)
            cells += (f'{number_cell(s, shown=f"{s:.4f}")}<td class="text"><span class="bar" '
                      f'style="width:{width:.1f}px"></span></td>'
                      f'{number_cell(a, shown=f"{100 * a:.0f}%")}')  # fmt: skip
        rows.append(f'<tr data-depth="{d}">{cells}</tr>')
    what = f"{len(found.sentences)} sentences"
    if found.labels is not None:
        counts = {label: found.labels.count(label) for label in dict.fromkeys(found.labels)}
        what += " (" + ", ".join(f"{n} {escape.text(label)}" for label, n in counts.items()) + ")"
    cue = ""
    if found.cue_head is not None:
        layer, head_, share = found.cue_head
        cue = (f"<p>The cue head: layer {layer}, head {head_}, where {quoted(found.word)} "
               f"attends most to its cue in {100 * share:.0f}% of the sentences.</p>")  # fmt: skip
    names = [f"{i} {found.labels[i]}" if found.labels else str(i) for i in range(N)]
    last = found.similarity[-1].tolist()
    return wrapped(
        f"<h4>{quoted(found.word)} across {what}, at every depth</h4>"
        f'<p class="note">{escape.text(_measures(found))} Depth 0 is the embeddings, before '
        f"any attention. {escape.text(probe_embeddings_note(found))}</p>"
        f'<table class="depths">{head}{"".join(rows)}</table>{cue}'
        f"<h4>Cosine similarity of {quoted(found.word)} at {escape.text(depths[-1])}</h4>"
        + grid_table(last, names, [str(i) for i in range(N)], name="cosine")
    )


def _measures(found) -> str:
    shown = ["mean cosine"] + (["separation", "accuracy"] if found.separation is not None else [])
    return " ".join(f"{name[0].upper()}{name[1:]}: {MEASURES[name]}." for name in shown)


def probe_repr(found) -> str:
    apart = ""
    if found.separation is not None:
        apart = f", separation {found.separation[0]:.3f} -> {found.separation[-1]:.3f}"
    return (f"Probe({cut(found.word, 20)!r}, {len(found.sentences)} sentences, "
            f"{len(found.layers)} depths{apart})")  # fmt: skip


# ---------------------------------------------------------------------------- generation
# (the interventions' views are in notebook_interventions.py)


def generation_html(seen) -> str:
    """The page of `qkv generate --attention` (a `qkv.inspect.generation.GenerationAttention`) in an
    iframe of its own: click a generated token to see the row that chose it."""
    if seen.summaries is not None:
        return _generation_summaries_html(seen)
    page = render_generation_page(seen, title=f"Attention while generating: {cut(seen.text, 60)}")
    if len(page) > NOTEBOOK_PAGE_BYTES:
        return wrapped(
            f"<p>the page of {len(seen.layers)} layers x {len(seen.heads)} heads would take "
            f"{len(page) / 2**20:.1f} MB, more than a notebook output carries; record fewer "
            "(generate(..., record={'layers': [...], 'heads': [...]})) or write it with "
            "<code>qkv.viz.generation.write_generation_page(path, seen)</code>.</p>"
        )
    height = 420 + 18 * min(len(seen.ids) // 8, 30)
    return _ascii(
        f'<iframe class="qkv-page" title="qkv generation page" '
        f'srcdoc="{escape.attribute(page.decode())}" style="width:100%;height:{height}px;border:0">'
        "</iframe>"
    )


def _generation_summaries_html(seen) -> str:
    """A generation recorded as summaries: a row per generated token, with the summaries of
    the row that chose it, over every recorded layer and head."""
    rows = []
    for j in range(seen.generated):
        entropy, first, keys, weights = seen.summary(j)  # (L', H'), (L', H'), (L', H', k) x 2
        mass = torch.zeros(seen.prompt_length + j, dtype=weights.dtype)
        mass.index_add_(0, keys.flatten(), weights.flatten())  # each key's top weights, summed
        top = mass.topk(min(3, len(mass))).indices.tolist()
        named = ", ".join(f"{i} {escape.text(seen.pieces[i])}" for i in top)
        piece = seen.pieces[seen.prompt_length + j]
        rows.append(f"<tr><td>{j}</td><td>{escape.text(piece)}</td><td>{float(entropy.mean()):.3f}"
                    f"</td><td>{float(first.mean()):.3f}</td><td>{named}</td></tr>")  # fmt: skip
    return wrapped(
        f"<h4>Attention while generating, as summaries: {escape.text(cut(seen.text, 80))}</h4><p>"
        f"{seen.generated} tokens after a prompt of {seen.prompt_length}; for each, the row that "
        f"chose it, over {len(seen.layers)} layers x {len(seen.heads)} heads: mean entropy "
        "(nats), mean weight on token 0, and the keys whose top weights sum highest over "
        "the heads (position, text).</p><table><tr><th>token</th><th>text</th><th>entropy"
        "</th><th>on token 0</th><th>most attended</th></tr>" + "".join(rows) + "</table>"
    )


def generation_repr(seen) -> str:
    kept = "summaries of " if seen.summaries is not None else ""
    return (
        f"GenerationAttention({seen.generated} tokens generated after {seen.prompt_length}, "
        f"{kept}{len(seen.layers)} layers x {len(seen.heads)} heads: {cut(seen.text, 40)!r})"
    )


# ---------------------------------------------------------------------------- helpers


def wrapped(body: str) -> str:
    return _ascii(f'{STYLE}<div class="qkv-nb">{body}</div>')


def _ascii(markup: str) -> str:
    """Every character beyond ASCII as a character reference: the output reads the same
    whatever encoding the page around it is decoded with."""
    return markup.encode("ascii", "xmlcharrefreplace").decode("ascii")


def grid_table(values, rows, columns, *, name: str, low=None, raw=None, diverging=False) -> str:
    """A table of colored cells: `values` (R, C) lists of floats (NaN: blank), each cell's
    number shown to 3 places, in its title, and exactly in data-value (`raw`'s number in the
    title, where given). Colors run over the finite values (viridis), or, `diverging`, blue
    below 0 to red above."""
    finite = [v for row in values for v in row if v == v]
    top = max(finite, default=1.0)
    bottom = min(finite, default=0.0) if low is None else low
    span = max(abs(top), abs(bottom)) or 1.0
    head = "".join(
        f'<th title="{escape.attribute(c)}">{escape.text(cut(str(c), 10))}</th>' for c in columns
    )
    lines = [f"<tr><th></th>{head}</tr>"]
    for r, (label, row) in enumerate(zip(rows, values, strict=True)):
        cells = []
        for c, v in enumerate(row):
            where = f"{label}, {columns[c]}"
            if v != v:
                cells.append(f'<td class="none" data-row="{r}" data-col="{c}" '
                             f'title="{escape.attribute(where)}: not computed"></td>')  # fmt: skip
                continue
            rgb = _diverging(v / span) if diverging else _viridis(
                (v - bottom) / (top - bottom) if top > bottom else 1.0)  # fmt: skip
            ink = "#000" if 0.299 * rgb[0] + 0.587 * rgb[1] + 0.114 * rgb[2] > 140 else "#fff"
            shown = raw[r][c] if raw is not None else v
            extra = f" (restored {v:.4f})" if raw is not None else ""
            cells.append(
                f'<td data-row="{r}" data-col="{c}" data-value="{v!r}" '
                f'title="{escape.attribute(where)}: {escape.attribute(name)} {shown:.6g}{extra}" '
                f'style="background:rgb{rgb};color:{ink}">'
                f"{v:.3f}</td>"
            )
        label = escape.text(cut(str(label), 24))
        lines.append(f'<tr><th class="text">{label}</th>{"".join(cells)}</tr>')
    table = f'<table class="grid" data-name="{escape.attribute(name)}">{"".join(lines)}</table>'
    return table + _legend(name, (-span, span) if diverging else (bottom, top), diverging)


def _legend(name: str, scale: tuple[float, float], diverging: bool) -> str:
    """The colour scale of a grid: its two ends' numbers beside a bar of its colours."""
    low, high = scale
    ends = [_diverging(-1.0), (255, 255, 255), _diverging(1.0)] if diverging else VIRIDIS
    stops = ", ".join(f"rgb{tuple(c)} {100 * i / (len(ends) - 1):g}%" for i, c in enumerate(ends))
    said = f"colour: {name}, from {low:.3g} to {high:.3g}"
    return (
        f'<p class="legend note" data-low="{low!r}" data-high="{high!r}">{escape.text(said)} '
        f'<span role="img" aria-label="{escape.attribute(said)}" style="display:inline-block;'
        f"width:10em;height:.8em;vertical-align:middle;background:linear-gradient(to right, "
        f'{stops})"></span></p>'
    )


def _viridis(x: float) -> tuple[int, int, int]:
    p = min(max(x, 0.0), 1.0) * (len(VIRIDIS) - 1)
    i = min(int(p), len(VIRIDIS) - 2)
    f = p - i
    return tuple(round(a + f * (b - a)) for a, b in zip(VIRIDIS[i], VIRIDIS[i + 1], strict=True))


def _diverging(x: float) -> tuple[int, int, int]:
    """-1 blue, 0 white, +1 red."""
    x = min(max(x, -1.0), 1.0)
    far = (59, 76, 192) if x < 0 else (180, 4, 38)
    return tuple(round(255 + abs(x) * (c - 255)) for c in far)


def _png_heatmap(matrix, tokens, title: str) -> str:
    """One head drawn by `head_heatmap`, inline as a data: URI."""
    with tempfile.TemporaryDirectory(prefix="qkv-notebook-") as folder:
        path = head_heatmap(matrix, tokens, Path(folder) / "head.png", title=title)
        data = base64.b64encode(path.read_bytes()).decode("ascii")
    return (f'<img alt="{escape.attribute(title)}" src="data:image/png;base64,{data}" '
            'style="max-width:100%">')  # fmt: skip


def _vector(values) -> str:
    numbers = [float(x) for x in values]
    norm = math.sqrt(sum(x * x for x in numbers))
    shown = ", ".join(f"{x:.4f}" for x in numbers[:4]) + (", …" if len(numbers) > 4 else "")
    return (f'<td class="mono" data-value="{escape.attribute(json.dumps(numbers))}">[{shown}] '
            f"({len(numbers)} numbers, norm {norm:.4f})</td>")  # fmt: skip


def number_cell(value: float, shown: str | None = None) -> str:
    value = float(value)
    return f'<td data-value="{value!r}">{shown if shown is not None else f"{value:.6g}"}</td>'


def _eye(n: int):
    return torch.eye(n, dtype=torch.bool)


def quoted(word: str) -> str:
    """A word of the text in curly quotes, escaped as text."""
    return f"“{escape.text(word)}”"


def cut(words: str, width: int) -> str:
    """One line of at most `width` characters: "The bank on the side of the r…"."""
    line = " ".join(str(words).split())
    return line if len(line) <= width else line[: width - 1] + "…"
