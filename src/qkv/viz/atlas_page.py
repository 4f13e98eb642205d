"""The atlas's page, index.html: every head in a table that sorts by any statistic, filters by
layer and by a search box, and lists each head's top examples, each a link to its own attention
page (examples/L{layer}H{head}-{rank}.html, `qkv.viz.report.render_page`'s page).

One self-contained file, nothing from the network: inline CSS and script, the data in a
<script type="application/json" id="atlas-data"> tag (`escape.script_json`); the script puts
every token and name on the page with `textContent` and `setAttribute`, never as markup.
Its controls: <select id="sort"> (a statistic), <select id="order">, <select id="layer">
(all or one), <input id="search"> (a head as "L3H5" or "3.5", or a token in its examples);
each head is a <tr class="head" data-layer data-head>, each example an <a class="example">.
The page sets `window.qkvReady = true` once drawn.
"""

from __future__ import annotations

import json

from qkv.inspect.atlas import STATS
from qkv.viz import escape

# what each statistic's column says, its heading's title
MEANINGS = {
    "entropy": "mean entropy of a query's weights, nats (low: focused)",
    "sink": "mean weight on key 0, the window's first token",
    "previous_token": "mean weight on the token just before the query",
    "induction": "mean weight on the tokens just after earlier occurrences of the query's token",
    "distance": "mean distance, in tokens, the weight goes back (or forth)",
    "window_use": "mean distance as a share of the farthest key the sliding window allows",
    "self": "mean weight on the query itself",
}

PAGE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<title>Head atlas: %(title)s</title>
<style>
body { font: 14px/1.4 system-ui, sans-serif; margin: 1rem 2rem; color: #1f2328; }
#controls { display: flex; gap: 1rem; flex-wrap: wrap; align-items: end; margin: 1rem 0; }
label { display: flex; flex-direction: column; font-size: 12px; color: #57606a; }
table { border-collapse: collapse; }
th, td { padding: 2px 8px; border-bottom: 1px solid #d0d7de; text-align: right;
         vertical-align: top; }
th { cursor: pointer; position: sticky; top: 0; background: #f6f8fa; }
td.examples { text-align: left; }
a.example { display: block; text-decoration: none; color: #0969da; white-space: nowrap; }
.q { background: #ffd8b5; } .k { background: #b6e3ff; }
#note { color: #57606a; }
</style></head><body>
<h1>Head atlas: %(title)s</h1>
<p id="note">%(note)s</p>
<div id="controls">
<label>sort by <select id="sort">%(sort_options)s</select></label>
<label>order <select id="order"><option value="desc">highest first</option>
<option value="asc">lowest first</option></select></label>
<label>layer <select id="layer"><option value="all">all</option>%(layer_options)s</select>
</label>
<label>search <input id="search" type="search" placeholder="L3H5, 3.5 or a token"></label>
<span id="shown"></span>
</div>
<table><thead><tr><th>layer</th><th>head</th>%(headings)s
<th>top examples (click one for its attention page)</th></tr></thead>
<tbody id="heads"></tbody></table>
<script type="application/json" id="atlas-data">%(data)s</script>
<script>
"use strict";
const DATA = JSON.parse(document.getElementById("atlas-data").textContent);
const $ = (id) => document.getElementById(id);
const STATS = DATA.stats_order;
function el(tag, attrs, text) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
  if (text !== undefined) node.textContent = text;
  return node;
}
const rows = [];
DATA.heads_per_layer.forEach((count, layer) => {
  for (let head = 0; head < count; head++) {
    const values = {layer: layer, head: head};
    for (const s of STATS) values[s] = DATA.stats[s][layer][head];
    const examples = DATA.examples[layer][head];
    const words = [];
    const tr = el("tr", {class: "head", "data-layer": layer, "data-head": head});
    tr.append(el("td", {}, String(layer)), el("td", {}, String(head)));
    for (const s of STATS) {
      const v = values[s];
      tr.append(el("td", {"data-stat": s}, v === null ? "-" : v.toFixed(3)));
    }
    const cell = el("td", {class: "examples"});
    examples.forEach((e, rank) => {
      const tokens = DATA.contexts[String(e.window)];
      const a = el("a", {class: "example", href: e.page,
                         title: `window ${e.window}, query ${e.query}, key ${e.key}`});
      a.append(el("span", {}, e.weight.toFixed(3) + "  "));
      const from = Math.max(1, e.key - 3);
      for (let i = from; i <= e.query && i < from + 12; i++) {
        const cls = i === e.query ? "q" : i === e.key ? "k" : "";
        a.append(el("span", cls ? {class: cls} : {}, tokens[i]));
        words.push(tokens[i].trim().toLowerCase());
      }
      if (e.query >= from + 12) {
        a.append(el("span", {}, " … "), el("span", {class: "q"}, tokens[e.query]));
        words.push(tokens[e.query].trim().toLowerCase());
      }
      cell.append(a);
    });
    tr.append(cell);
    rows.push({values, words, tr});
  }
});
function matches(row, text) {
  if (!text) return true;
  const named = text.toUpperCase().replace(/\\s/g, "").match(/^L?(\\d+)(?:\\.|H)(\\d+)$/);
  if (named) return row.values.layer === +named[1] && row.values.head === +named[2];
  return row.words.some((w) => w.includes(text.toLowerCase()));
}
function draw() {
  const stat = $("sort").value, sign = $("order").value === "asc" ? 1 : -1;
  const layer = $("layer").value, text = $("search").value.trim();
  const kept = rows.filter((r) => (layer === "all" || r.values.layer === +layer)
                                  && matches(r, text));
  kept.sort((a, b) => {
    const x = a.values[stat], y = b.values[stat];
    if (x === null || y === null) return (x === null) - (y === null);
    return sign * (x - y) || a.values.layer - b.values.layer || a.values.head - b.values.head;
  });
  $("heads").replaceChildren(...kept.map((r) => r.tr));
  $("shown").textContent = `${kept.length} of ${rows.length} heads`;
  document.body.dataset.sorted = stat;
}
for (const th of document.querySelectorAll("th[data-stat]")) {
  th.addEventListener("click", () => {
    if ($("sort").value === th.dataset.stat) {
      $("order").value = $("order").value === "asc" ? "desc" : "asc";
    } else {
      $("sort").value = th.dataset.stat;
    }
    draw();
  });
}
for (const id of ["sort", "order", "layer"]) $(id).addEventListener("change", draw);
$("search").addEventListener("input", draw);
draw();
window.qkvReady = true;
</script></body></html>
"""


def atlas_page(data: dict) -> bytes:
    """index.html (UTF-8) of an atlas's `to_dict()` with each example's "page" added."""
    stats = "".join(f'<option value="{name}">{escape.text(name)}</option>' for name in STATS)
    layers = "".join(f'<option value="{n}">{n}</option>' for n in range(data["layers"]))
    headings = "".join(
        f'<th data-stat="{name}" title="{escape.attribute(MEANINGS[name])}">'
        f"{escape.text(name.replace('_', ' '))}</th>"
        for name in STATS
    )
    corpus = data["corpus"]
    note = (
        f"{data['model']} over {corpus['name']} ({data['tokens']:,} tokens in "
        f"{data['windows']:,} windows of up to {data['options']['window']} tokens). Each "
        "statistic is a mean over every query after a window's first token; layers and heads "
        "count from 0. An example is a query whose largest weight on a key other than key 0 "
        "is among the head's largest: the query is orange, that key blue."
    )
    shown = {**data, "stats_order": list(STATS)}
    page = PAGE % {
        "title": escape.text(f"{data['model']} on {corpus['name']}"),
        "note": escape.text(note),
        "sort_options": stats,
        "layer_options": layers,
        "headings": headings,
        "data": escape.script_json(json.dumps(shown, separators=(",", ":"))),
    }
    return page.encode("utf-8")
