"""The page of a generation: click a generated token to see what the model attended to when it
chose it.

One self-contained HTML file, as the report page: inline CSS and a little vanilla JavaScript,
nothing from the network, the weights embedded in <script type="application/json"
id="qkv-data">. The text is drawn token by token (the prompt's as span.token, each generated
one as button.token.generated with data-step j, counted from 0); <select id="layer"> and
<select id="head"> pick a recorded layer and head. Clicking generated token j colors the
background of every token before it by the weight the query that chose it (the token before,
position P + j - 1) gave it; each token carries its exact weight in data-w, and id="row" lists
the row, strongest first. The page sets `window.qkvReady = true` once it has drawn.

The weights are the generation's own (`GenerationAttention.row(j)`), stored exactly: float32,
base64, one string per recorded layer and head holding every generated token's row one after
the other (row j has P + j weights). `read_generation_page` decodes them.

Example::

    seen = qkv.load("smollm2").generate("The river bank", 16, record="all")
    write_generation_page("generation.html", seen)
"""

from __future__ import annotations

import base64
import json
import re
from pathlib import Path

import numpy as np

from qkv.io.files import write_atomically
from qkv.version import __version__
from qkv.viz import escape
from qkv.viz.encode import page_json
from qkv.viz.paths import html_path

ENCODING = (
    "float32, little-endian, base64; one per layer and head: row j (P + j weights) after row j - 1"
)
# Above this many bytes of weights the page is refused: tens of MB open slowly, and the
# generation's rows are all in Python (GenerationAttention) anyway.
PAGE_MAX_BYTES = 48 * 2**20


def write_generation_page(path: str | Path, seen, *, title: str = "Attention while generating",
                          head: tuple[int, int] | None = None) -> Path:  # fmt: skip
    """Write the page of `seen`, a `GenerationAttention`, as one .html file; return its path.

    head = (layer, head), as the model counts them, is the one shown first (the first recorded
    by default). Nothing is written when an argument is wrong.
    """
    path = html_path(path)
    page = render_generation_page(seen, title=title, head=head)
    write_atomically(path, lambda file: file.write(page))
    return path


def check_page_size(layers: int, heads: int, prompt: int, new: int) -> None:
    """Refuse, by name, a page of more than PAGE_MAX_BYTES of weights: `new` generated rows of
    `prompt` + j weights for each of `layers` x `heads`."""
    size = layers * heads * (new * prompt + new * (new - 1) // 2) * 4
    if size > PAGE_MAX_BYTES:
        raise ValueError(
            f"the page of {layers} layers x {heads} heads over {prompt} prompt tokens and "
            f"{new} new ones would hold up to {size / 2**20:.0f} MB of weights, more than "
            f"{PAGE_MAX_BYTES / 2**20:.0f} MB; record fewer layers or heads (qkv generate "
            "--layers 0-3 --heads 0) or generate fewer tokens"
        )


def render_generation_page(seen, *, title: str, head: tuple[int, int] | None = None) -> bytes:
    """The page's HTML, UTF-8 encoded; checked before anything is built."""
    P, n = seen.prompt_length, seen.generated
    L, H = len(seen.layers), len(seen.heads)
    check_page_size(L, H, P, n)
    layer, chosen = head if head is not None else (seen.layers[0], seen.heads[0])
    for what, index, kept in (("layer", layer, seen.layers), ("head", chosen, seen.heads)):
        if index not in kept:
            raise ValueError(f"{what} {index} was not recorded; the recorded {what}s are {kept}")
    # (n, L', H', P + j) rows -> one float32 run per (layer, head)
    rows = [seen.row(j).detach().float().cpu().numpy() for j in range(n)]
    packed = [
        [_pack(np.concatenate([row[a, b] for row in rows])) for b in range(H)] for a in range(L)
    ]
    data = {
        "format": "qkv-generation/1",
        "pieces": seen.pieces,
        "tokens": seen.tokens,
        "prompt_length": P,
        "layers": seen.layers,
        "heads": seen.heads,
        "rows": {"encoding": ENCODING, "heads": packed},
        "selected": {"layer": int(layer), "head": int(chosen)},
    }
    text = "".join(
        f'<button type="button" class="token generated" data-index="{i}" data-step="{i - P}">'
        f"{_shown(piece)}</button>" if i >= P else
        f'<span class="token" data-index="{i}">{_shown(piece)}</span>'
        for i, piece in enumerate(seen.pieces)
    )  # fmt: skip
    slots = {
        "version": __version__,
        "title": escape.text(title),
        "layer_options": _options(seen.layers, layer, "the first layer"),
        "head_options": _options(seen.heads, chosen, "the first head"),
        "text": text,
        "data": escape.script_json(page_json(data, separators=(",", ":"))),
    }
    page = re.sub(r"\{\{ (\w+) \}\}", lambda match: slots[match.group(1)], TEMPLATE)
    return page.encode("utf-8", errors="replace")


def read_generation_page(page: str) -> dict:
    """What a generation page holds: its data, with "rows" decoded to a list over generated
    tokens j of (L', H', P + j) float32 arrays, as stored."""
    found = re.search(r'<script type="application/json" id="qkv-data">(.*?)</script>', page, re.S)
    if found is None:
        raise ValueError("this page has no qkv-data script: it was not written by qkv")
    data = json.loads(found.group(1))
    P, n = data["prompt_length"], len(data["pieces"]) - data["prompt_length"]
    runs = [[np.frombuffer(base64.b64decode(s), "<f4") for s in layer]
            for layer in data["rows"]["heads"]]  # fmt: skip
    starts = [j * P + j * (j - 1) // 2 for j in range(n + 1)]  # where row j begins in a run
    data["rows"] = [
        np.array([[run[starts[j] : starts[j + 1]] for run in layer] for layer in runs])
        for j in range(n)
    ]
    return data


def _pack(values: np.ndarray) -> str:
    return base64.b64encode(values.astype("<f4").tobytes()).decode("ascii")


def _options(indices: list[int], selected: int, first: str) -> str:
    return "".join(
        f'<option value="{i}"{" selected" if i == selected else ""}>'
        f"{i}{f' ({first})' if i == 0 else ''}</option>"
        for i in indices
    )


def _shown(piece: str) -> str:
    """A token's text, with a newline shown as ⏎ so that the text stays one flow."""
    return escape.text(piece.replace("\n", "⏎"))


TEMPLATE = """<!doctype html>
<!-- qkv generation page: one self-contained file, written by qkv.viz.generation. -->
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<meta name="generator" content="qkv {{ version }}">
<title>{{ title }}</title>
<style>
  :root { font-family: system-ui, -apple-system, "Segoe UI", Roboto, Arial, sans-serif;
    color: #1f2328; background: #fff; line-height: 1.5; }
  body { margin: 1.5rem auto; max-width: 1000px; padding: 0 1rem; }
  h1 { font-size: 1.5rem; margin: 0 0 .5rem; }
  .note { color: #57606a; font-size: .9rem; max-width: 75ch; }
  .controls { display: flex; gap: 1.5rem; margin: 1rem 0; }
  .controls select { font: inherit; padding: .2rem .4rem; }
  #text { border: 1px solid #d0d7de; border-radius: 6px; padding: .75rem; white-space: pre-wrap;
    font-size: 1.05rem; }
  .token { font: inherit; border: 0; padding: 0 .05rem; margin: 0; border-radius: 3px;
    background: transparent; color: inherit; white-space: pre-wrap; }
  .token.generated { text-decoration: underline dotted #21918c; cursor: pointer; }
  .token.selected { outline: 2px solid #e3342f; }
  #row-title { margin: 1rem 0 .5rem; }
  #row { list-style: none; padding: 0; margin: 0; columns: 14rem; font-size: .85rem; }
  #row li { position: relative; isolation: isolate; padding: .05rem .3rem; break-inside: avoid; }
  #row .bar { position: absolute; inset: 0 auto 0 0; background: #5ec96255; z-index: -1; }
  #error { color: #b00020; font-weight: bold; }
</style>
</head>
<body>
<h1>{{ title }}</h1>
<p class="note">
  The prompt, then the generated tokens (underlined). Click a generated token to see what the
  model attended to when it chose it: the attention of the token before it (the last query
  the model had read) over every token before it. A token's background is its weight in that
  row, the strongest key of the row in full color; hover a token for its exact weight. Layers
  and heads count from 0: layer 0 is the first layer. The weights are the model's own
  float32 numbers, read while it generated, not renormalised.
</p>
<p id="error" hidden></p>
<div class="controls">
  <label>Layer <select id="layer">{{ layer_options }}</select></label>
  <label>Head <select id="head">{{ head_options }}</select></label>
</div>
<div id="text">{{ text }}</div>
<p id="row-title">Click a generated token.</p>
<ol id="row"></ol>
<script type="application/json" id="qkv-data">{{ data }}</script>
<script>
"use strict";
const data = JSON.parse(document.getElementById("qkv-data").textContent);
const $ = (id) => document.getElementById(id);
const P = data.prompt_length;
const runs = new Map();  // "layer,head" -> Float32Array of every generated token's row
function run(a, b) {
  const key = `${a},${b}`;
  if (!runs.has(key)) {
    const bytes = Uint8Array.from(atob(data.rows.heads[a][b]), (c) => c.charCodeAt(0));
    runs.set(key, new Float32Array(bytes.buffer));
  }
  return runs.get(key);
}
function row(step) {  // generated token `step`'s row: P + step weights
  const a = data.layers.indexOf(Number($("layer").value));
  const b = data.heads.indexOf(Number($("head").value));
  const start = step * P + step * (step - 1) / 2;
  return run(a, b).subarray(start, start + P + step);
}
const tokens = Array.from(document.querySelectorAll("#text .token"));
let step = null;
function shown(piece) { return piece.trim() ? piece : JSON.stringify(piece); }
function draw() {
  for (const t of tokens) {
    t.style.background = ""; t.style.color = ""; t.removeAttribute("data-w"); t.title = "";
    t.classList.remove("selected");
  }
  $("row").replaceChildren();
  if (step === null) return;
  const weights = row(step), chosen = P + step, top = Math.max(...weights) || 1;
  weights.forEach((w, k) => {
    tokens[k].style.background = `rgba(33, 145, 140, ${(w / top).toFixed(3)})`;
    if (w / top > 0.6) tokens[k].style.color = "#fff";  // dark backgrounds: light text
    tokens[k].dataset.w = w;
    tokens[k].title = `${(100 * w).toFixed(2)}%`;
  });
  tokens[chosen].classList.add("selected");
  $("row-title").textContent = `${shown(data.pieces[chosen])} (generated token ${step}) was `
    + `chosen by the query at ${shown(data.pieces[chosen - 1])} (token ${chosen - 1}); layer `
    + `${$("layer").value}, head ${$("head").value}, its attention over the ${chosen} tokens `
    + "before it:";
  const order = Array.from(weights.keys()).sort((i, j) => weights[j] - weights[i]);
  for (const k of order) {
    const li = document.createElement("li");
    li.dataset.k = k; li.dataset.w = weights[k];
    const bar = document.createElement("span");
    bar.className = "bar"; bar.style.width = `${100 * weights[k]}%`;
    li.append(bar, `${(100 * weights[k]).toFixed(2)}%  ${shown(data.pieces[k])} (${k})`);
    $("row").append(li);
  }
}
try {
  for (const t of tokens) {
    if (t.classList.contains("generated")) {
      t.addEventListener("click", () => { step = Number(t.dataset.step); draw(); });
    }
  }
  $("layer").addEventListener("change", draw);
  $("head").addEventListener("change", draw);
  draw();
  window.qkvReady = true;
} catch (error) {
  $("error").hidden = false;
  $("error").textContent = `The weights could not be shown: ${error}`;
}
</script>
</body>
</html>
"""
