"""The atlas's examples as the usual attention page (`qkv.viz.report.render_page`'s), its code
written once: examples/example.html shows the example its address names
(example.html#L3H5-2: layer 3, head 5, the head's third example, all counted from 0), with
that example's tokens and weights from examples/L3.js, one data file per layer.

Pages are opened from disk (file://), where a page may not fetch() a file beside it but may
load a script: so each layer's data is a script, `window.qkvExamples = {...};`, its JSON made
safe by `escape.script_json`, that the page loads (with document.write, before its own script
runs) by the layer its address names. A small script then puts the example's data where the
attention page reads it (its <script id="qkv-data"> JSON, its title, text, token buttons and
details), every token with `textContent`, never as markup. An address that names no example
says so in the page's heading.

For SmolLM2 (30 layers of 9 heads, 8 examples a head) that is one 30 KB page and about 8 MB
of data, where a page per example was 2,160 pages of 28 KB each.
"""

from __future__ import annotations

import json
import re

from qkv.viz import escape
from qkv.viz.encode import pack, page_json
from qkv.viz.report import render_page

PAGE = "example.html"
NOTE = (
    "this head's real weights among these tokens of the window (key 0, and the tokens around "
    "the query and the key); weights on the tokens not shown are left out, so a row may sum "
    "below 1. '… ' marks a token after a gap."
)

# in <head>: which example the address names, and that layer's data loaded before the body
CHOOSE = """<script>
"use strict";
window.qkvExample = (/^#L(\\d+)H(\\d+)-(\\d+)$/.exec(location.hash) || []).slice(1).map(Number);
if (window.qkvExample.length === 3) {
  document.write('<script src="L' + window.qkvExample[0] + '.js"><\\/script>');
}
window.addEventListener("hashchange", () => location.reload());
</script>
"""

# after the page's data, before its own script: the example's data put in the page's place
FILL = """<script>
"use strict";
(() => {
  const [layer, head, rank] = window.qkvExample;
  const layerData = window.qkvExamples;
  const found = layerData && layerData.layer === layer && (layerData.heads[head] || [])[rank];
  const box = document.getElementById("qkv-data");
  const heading = document.querySelector("h1");
  if (!found) {
    document.title = heading.textContent = `No example ${location.hash || "named"} in this atlas`
      + " (an address names one as example.html#L3H5-2: layer 3, head 5, its example 2)";
    box.textContent = "";
    return;
  }
  const data = JSON.parse(box.textContent);
  Object.assign(data, { title: found.title, tokens: found.tokens, extra: found.extra });
  data.weights.heads = [[found.weights]];
  data.selected = { layer: 0, head: 0, query: found.query };
  box.textContent = JSON.stringify(data);
  document.title = heading.textContent = found.title;
  document.getElementById("text").textContent = found.tokens.join(" ");
  const show = (t) => (t.trim() === "" ? JSON.stringify(t) : t);
  document.getElementById("tokens").replaceChildren(...found.tokens.map((t, i) => {
    const button = document.createElement("button");
    button.type = "button";
    button.className = "token";
    button.dataset.index = String(i);
    button.textContent = show(t);
    return button;
  }));
  const list = document.querySelector("#extra dl");
  list.replaceChildren(...found.shown.flatMap(([name, value, block]) => {
    const term = document.createElement("dt"), said = document.createElement("dd");
    term.textContent = name;
    if (block) {
      const pre = document.createElement("pre");
      pre.textContent = value;
      said.append(pre);
    } else {
      said.textContent = value;
    }
    return [term, said];
  }));
})();
</script>
"""


def example_address(layer: int, head: int, rank: int) -> str:
    """An example's page, relative to the atlas's folder."""
    return f"examples/{PAGE}#L{layer}H{head}-{rank}"


def layer_file(layer: int) -> str:
    return f"L{layer}.js"


def example_data(found, layer: int, head: int, rank: int) -> dict:
    """What example.html needs of one example: its title, tokens, query (its place among the
    tokens shown), weights (packed as the attention page packs a head's), and details."""
    example = found.examples[layer][head][rank]
    pieces = found.contexts[example.window]
    positions = example.positions
    # a token after a gap in the positions shown is marked, so no one reads them as neighbours
    tokens = [("… " if n and positions[n - 1] != at - 1 else "") + pieces[at]
              for n, at in enumerate(positions)]  # fmt: skip
    extra = {
        "model": found.source,
        "layer, head": f"{layer}, {head} (counted from 0)",
        "example": f"{rank + 1} of {len(found.examples[layer][head])} of this head",
        "weight": example.weight,
        "window": example.window,
        "query position": example.query,
        "key position": example.key,
        "positions shown": positions,
        "note": NOTE,
    }
    title = (f"L{layer} H{head} example {rank + 1}: {example.weight:.3f} from token "
             f"{example.query} to token {example.key} of window {example.window}")  # fmt: skip
    weights = example.weights.numpy().astype("<f4")  # (n, n)
    # the details as the attention page writes them: a number or text as it is, a list as JSON
    shown = [[name, str(value), False] if isinstance(value, str | int | float) else
             [name, page_json(value, indent=2), True] for name, value in extra.items()]  # fmt: skip
    return {"title": title, "tokens": tokens, "query": positions.index(example.query),
            "weights": pack(weights), "extra": extra, "shown": shown}  # fmt: skip


def layer_script(found, layer: int) -> bytes:
    """examples/L{layer}.js: every example of the layer's heads, [head][rank]."""
    heads = [[example_data(found, layer, head, rank) for rank in range(len(examples))]
             for head, examples in enumerate(found.examples[layer])]  # fmt: skip
    text = json.dumps({"layer": layer, "heads": heads}, ensure_ascii=False, allow_nan=False,
                      separators=(",", ":"))  # fmt: skip
    return f"window.qkvExamples = {escape.script_json(text)};\n".encode()


def example_page(found) -> bytes:
    """examples/example.html: the attention page of the atlas's first example, which its two
    scripts replace with the example its address names."""
    layer, head = next((layer, head) for layer, heads in enumerate(found.examples)
                       for head, examples in enumerate(heads) if examples)  # fmt: skip
    first = example_data(found, layer, head, 0)
    weights = found.examples[layer][head][0].weights
    n = weights.shape[0]
    page = render_page(weights.reshape(1, 1, n, n).numpy(), first["tokens"],
                       title=first["title"], text=None, extra=first["extra"], head=(0, 0),
                       query=first["query"]).decode("utf-8")  # fmt: skip
    page, count = re.subn(r"(<meta charset=\"utf-8\">\n)", lambda m: m.group(1) + CHOOSE, page,
                          count=1)  # fmt: skip
    assert count == 1, "the attention page has no <meta charset> to put its chooser after"
    page, count = re.subn(r"(<script type=\"application/json\" id=\"qkv-data\">.*?</script>\n)",
                          lambda m: m.group(1) + FILL, page, count=1, flags=re.S)  # fmt: skip
    assert count == 1, "the attention page has no qkv-data script to fill"
    return page.encode("utf-8")
