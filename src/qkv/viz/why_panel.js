// The "why" panel: one pair's score taken apart, as qkv.why gave it (Why.to_dict). One file
// for both pages: qkv show's page inlines it, qkv serve sends it as /static/why.js. A plain
// script (no module), so both can load it: it defines drawWhy and nothing else.
//
// Every string from a model or a person (a token, a part's name, a note) enters the panel by
// textContent or setAttribute only, never as markup: a token may be `<img onerror=...>`.
// Each number is shown rounded and kept whole in a data- attribute, as the other panels do.
"use strict";

// panel: the element to fill; why: Why.to_dict(); tokens: each token as the page shows it
// (why's indices count in them); note: where the numbers come from, one line.
function drawWhy(panel, why, tokens, note) {
  const node = (tag, attributes = {}, ...children) => {
    const element = document.createElement(tag);
    for (const [name, value] of Object.entries(attributes)) {
      if (value !== null && value !== undefined) element.setAttribute(name, String(value));
    }
    element.append(...children.flat().filter((c) => c !== null && c !== undefined && c !== ""));
    return element;
  };
  const signed = (x) => (x >= 0 ? "+" : "−") + Math.abs(x).toFixed(3);
  const percent = (w) => (w < 0 ? "−" : "") + (100 * Math.abs(w)).toFixed(2) + "%";
  const number = (id, value, text) => node("b", { id, class: "number", "data-value": value }, text);
  const word = (index) => `“${tokens[index]}”`;
  const Q = word(why.query_index), K = word(why.key_index);
  // a part of the stream entering the layer, in words: whose vector it is part of
  const inWords = (part, into) => {
    const own = part.startsWith("enc.") ? "the encoder's " : "";
    const name = part.replace(/^enc\./, "");
    let found;
    if (name === "embedding") return `${into}'s token embedding`;
    if (name === "position") return `${into}'s position embedding`;
    if (name === "segment") return `${into}'s segment embedding`;
    if (name === "bias") return "the biases and the norms' shifts";
    if ((found = /^L(\d+)\.H(\d+)$/.exec(name))) {
      return `what ${own}layer ${found[1]}, head ${found[2]} wrote into ${into}`;
    }
    if ((found = /^L(\d+)\.cross\.H(\d+)$/.exec(name))) {
      return `what layer ${found[1]}'s cross-attention head ${found[2]} wrote into ${into}`;
    }
    if ((found = /^L(\d+)\.mlp$/.exec(name))) return `what ${own}layer ${found[1]}'s MLP wrote into ${into}`;
    return `${name} of ${into}`;
  };
  const part = (name, into) => [inWords(name, into), " (", node("code", {}, name), ")"];

  const title = node("h2", { id: "why-title" }, `Why ${Q} (token ${why.query_index}) attends to `
    + `${K} (token ${why.key_index}): layer ${why.layer}, head ${why.head}`);
  const chosen = why.chosen === "asked" ? "" : ` Layer and head: ${why.chosen}.`;
  const summary = node("p", { id: "why-summary" }, "The score the softmax read: ",
    number("why-score", why.score, signed(why.score)), "; the weight after it: ",
    number("why-weight", why.weight, percent(why.weight)), ". The terms below sum to ",
    number("why-total", why.total, signed(why.total)),
    why.softcap === null ? "" : ` (the score before the layer's cap of ${why.softcap})`, ".");
  const split = why.content === null ? null : node("p", { id: "why-split" },
    "Content, the score the two would have at distance 0: ",
    number("why-content", why.content, signed(why.content)), "; position, what their distance adds: ",
    number("why-position", why.position, signed(why.position)), ".");
  const terms = node("table", { id: "why-terms", class: "bars" },
    node("thead", {}, node("tr", {}, node("th", {}, `part of ${Q}'s query`),
      node("th", {}, `part of ${K}'s key`), node("th", {}, "term"), node("th", {}, "share"))),
    node("tbody", {}, why.ranked.map((t) => node("tr", { "data-query-part": t.query_part,
      "data-key-part": t.key_part, "data-value": t.value, "data-share": t.share },
    node("td", {}, part(t.query_part, Q)), node("td", {}, part(t.key_part, K)),
    node("td", {}, signed(t.value)), node("td", {}, percent(t.share))))));
  const side = (id, parts, into) => node("ol", { id }, parts.map((p) =>
    node("li", { "data-part": p.part, "data-value": p.value }, part(p.part, into), ": ",
      signed(p.value))));
  const carried = why.carried.map((c) => node("li", { "data-side": c.side, "data-part": c.part,
    "data-value": c.value }, node("code", {}, c.part), ` carried into ${c.side === "query" ? Q : K}`
    + ` (${signed(c.value)} of the score), from: `, c.words.map((w, n) => node("span", {
    class: "carried-word", "data-index": w.index, "data-weight": w.weight, "data-value": w.value },
  `${n ? "; " : ""}${word(w.index)} (weight ${percent(w.weight)}, ${signed(w.value)})`))));
  const checks = why.checks.map((c) => node("tr", { "data-side": c.side, "data-part": c.part,
    "data-position": c.position, "data-predicted-score": c.predicted_score,
    "data-real-score": c.real_score, "data-predicted-weight": c.predicted_weight,
    "data-real-weight": c.real_weight },
  node("td", {}, node("code", {}, c.part), ` at ${word(c.position)}`),
  node("td", {}, signed(c.predicted_score)), node("td", {}, signed(c.real_score)),
  node("td", {}, percent(c.predicted_weight)), node("td", {}, percent(c.real_weight))));
  panel.dataset.pair = [why.layer, why.head, why.query_index, why.key_index].join(",");
  panel.replaceChildren(...[title, node("p", { class: "note" }, note + chosen), summary, split,
    node("h3", {}, "The largest terms"),
    node("p", { class: "note" }, `Each term is a part of ${Q}'s vector entering the layer, `
      + `through the query matrix, against a part of ${K}'s, through the key matrix, times the `
      + "scale; every term of every pair of parts sums to the score."),
    node("div", { class: "scroll" }, terms),
    node("div", { class: "columns" },
      node("div", {}, node("h3", {}, `${Q}'s parts (against ${K}'s whole key)`),
        side("why-query-parts", why.by_query_part.slice(0, 5), Q)),
      node("div", {}, node("h3", {}, `${K}'s parts (against ${Q}'s whole query)`),
        side("why-key-parts", why.by_key_part.slice(0, 5), K))),
    carried.length ? node("h3", {}, "The words the top heads carried") : null,
    carried.length ? node("ul", { id: "why-carried" }, carried) : null,
    checks.length ? node("h3", {}, "Removed for real") : null,
    checks.length ? node("p", { class: "note" }, "Each part zeroed at its word and the model "
      + "rerun from its layer: the linear prediction beside the real score and weight (they "
      + "differ by how the norms and later layers respond).") : null,
    checks.length ? node("table", { id: "why-checks", class: "bars" }, node("thead", {},
      node("tr", {}, ...["part removed", "predicted score", "real score", "predicted weight",
        "real weight"].map((h) => node("th", {}, h)))), node("tbody", {}, checks)) : null,
    node("ul", { id: "why-notes", class: "note" }, why.notes.map((n) => node("li", {}, n)))]
    .filter((child) => child !== null));
}
