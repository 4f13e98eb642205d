// Drawing: the heatmap, the head view, the grid of heads and the trace, from numbers the API
// gave. Nothing here computes attention; it only shows the model's numbers.
"use strict";

export const $ = (id) => document.getElementById(id);
const TABLE_MAX = 40;  // up to this many tokens the heatmap is a table of cells, then a canvas
const VIRIDIS = [[68, 1, 84], [59, 82, 139], [33, 145, 140], [94, 201, 98], [253, 231, 37]];

// A token as people read it: byte-level BPE's space (Ġ) and newline (Ċ), sentencepiece's (▁).
export function shown(token) {
  const plain = token.replaceAll("Ġ", "").replaceAll("▁", "").replaceAll("Ċ", "\\n");
  const text = plain || token;
  return text.trim() === "" ? JSON.stringify(text) : text;
}
export const short = (t) => (shown(t).length > 16 ? shown(t).slice(0, 15) + "…" : shown(t));

// Text from a model or a person (a token, a word, a model's name, an error) enters the page
// as text only: by textContent, or as an attribute's value by setAttribute, never inside
// markup given to innerHTML, where a token such as `"><img onerror=...>` would be markup.
const SVG = new Set(["svg", "g", "line", "text"]);

// An element with its attributes (null, undefined and false leave one out) and children
// (elements, or strings made text nodes).
export function make(tag, attributes = {}, ...children) {
  const element = SVG.has(tag)
    ? document.createElementNS("http://www.w3.org/2000/svg", tag) : document.createElement(tag);
  for (const [name, value] of Object.entries(attributes)) {
    if (value !== null && value !== undefined && value !== false) element.setAttribute(name, String(value));
  }
  element.append(...children.flat(Infinity).filter((c) => c !== null && c !== undefined && c !== ""));
  return element;
}

// For markup qkv writes itself around such text: put(text) leaves an empty slot in the
// markup, and fill(box, markup) sets the markup, then puts each text in its slot as a text node.
export function texts() {
  const kept = [];
  return {
    put: (value) => `<span data-text="${kept.push(String(value)) - 1}"></span>`,
    fill(box, markup) {
      box.innerHTML = markup;
      for (const slot of box.querySelectorAll("span[data-text]")) {
        slot.replaceWith(kept[Number(slot.dataset.text)]);
      }
    },
  };
}
export const percent = (w, digits = 2) => (100 * w).toFixed(digits) + "%";

export function color(x) {  // x in [0, 1] -> [r, g, b] on viridis
  const p = Math.min(Math.max(x, 0), 1) * (VIRIDIS.length - 1);
  const i = Math.min(Math.floor(p), VIRIDIS.length - 2), f = p - i;
  return VIRIDIS[i].map((c, j) => Math.round(c + f * (VIRIDIS[i + 1][j] - c)));
}

export function unpack(text) {  // base64 of little-endian float32 -> Float32Array
  const bytes = Uint8Array.from(atob(text), (c) => c.charCodeAt(0));
  return new Float32Array(bytes.buffer);
}

const largest = (w) => w.reduce((a, v) => (v > a ? v : a), 0) || 1;

function paint(canvas, w, T) {  // a T x T matrix onto a T x T canvas, scaled to its largest
  canvas.width = canvas.height = T;
  const context = canvas.getContext("2d"), image = context.createImageData(T, T);
  const top = largest(w);
  for (let i = 0; i < T * T; i++) image.data.set([...color(w[i] / top), 255], i * 4);
  context.putImageData(image, 0, 0);
}

// The heatmap of one head: a table with data-q, data-k, data-w (the weight, every digit the
// model gave) up to TABLE_MAX tokens, a canvas beyond.
export function drawHeatmap(box, w, tokens, state) {
  const T = tokens.length;
  if (T > TABLE_MAX) {
    box.innerHTML = '<div class="canvas-box"><canvas id="heatmap-canvas"></canvas>'
      + '<div class="cursor-mark" id="heatmap-cursor"></div></div>';
    paint($("heatmap-canvas"), w, T);
    const [q, k] = state.cursor, mark = $("heatmap-cursor");
    Object.assign(mark.style, { top: `${(100 * q) / T}%`, left: `${(100 * k) / T}%`,
      width: `${100 / T}%`, height: `${100 / T}%` });
    return;
  }
  const top = largest(w);
  const rows = tokens.map((t, q) => make("tr", { class: q === state.query && "selected" },
    make("th", { scope: "row", "data-q": q }, short(t)),
    tokens.map((u, k) => {
      const v = w[q * T + k], [r, g, b] = color(v / top);
      const marks = [q === state.query && k === state.key ? "pair" : "",
        q === state.cursor[0] && k === state.cursor[1] ? "cursor" : ""].join(" ").trim();
      return make("td", { class: marks || null, "data-q": q, "data-k": k, "data-w": v,
        title: `${shown(t)} → ${shown(u)}: ${percent(v)}`,
        style: `background:rgb(${r},${g},${b})` });
    })));
  box.replaceChildren(make("table", { id: "heatmap-table" },
    make("thead", {}, make("tr", {}, make("th"), tokens.map((t) => make("th", { scope: "col" }, short(t))))),
    make("tbody", {}, rows)));
}

// The head view: tokens in two columns, a line from each query to each key it attends to,
// as thick and as dark as the weight. `heads` is one matrix, or every head of the layer.
export function drawHeadView(svg, heads, tokens, state) {
  const T = tokens.length, ROW = 18, TOP = 14, LEFT = 150, RIGHT = 290;
  const y = (i) => TOP + i * ROW - 4;
  const queries = state.query === null ? tokens.map((_, q) => q) : [state.query];
  const overlay = heads.length > 1;
  // thin lines are left out when many are drawn: they would hide the strong ones
  const least = state.query !== null ? 0.005 : overlay ? 0.15 : 0.05;
  const parts = ['<g class="lines">'];
  heads.forEach(({ w, head }) => {
    const hue = overlay ? `hsl(${(head * 360) / heads.length}, 70%, 42%)` : null;
    for (const q of queries) {
      for (let k = 0; k < T; k++) {
        const v = w[q * T + k];
        if (v < least) continue;
        parts.push(`<line x1="${LEFT + 6}" y1="${y(q)}" x2="${RIGHT - 6}" y2="${y(k)}"`
          + ` data-q="${q}" data-k="${k}" data-w="${v}"${hue ? ` style="stroke:${hue}"` : ""}`
          + ` stroke-opacity="${Math.max(v, 0.1).toFixed(3)}"`
          + ` stroke-width="${(0.5 + 5 * v).toFixed(2)}"/>`);
      }
    }
  });
  parts.push("</g>");
  svg.setAttribute("height", TOP + T * ROW);
  svg.innerHTML = parts.join("");  // the lines: numbers only
  tokens.forEach((t, i) => {
    const q = i === state.query ? " selected" : "", k = i === state.key ? " selected" : "";
    svg.append(make("text", { class: `hv-query${q}`, "data-index": i, x: LEFT, y: TOP + i * ROW,
      "text-anchor": "end" }, short(t)));
    svg.append(make("text", { class: `hv-key${k}`, "data-index": i, x: RIGHT, y: TOP + i * ROW },
      short(t)));
  });
}

// Every layer and head as a small picture; each is a button that shows that head.
export function drawGrid(box, weights, tokens, layers, heads, state) {
  const T = tokens.length;
  box.style.gridTemplateColumns = `max-content repeat(${heads.length}, 60px)`;
  const parts = ['<span></span>', ...heads.map((h) => `<span class="label">head ${h}</span>`)];
  layers.forEach((l) => {
    parts.push(`<span class="label">layer ${l}</span>`);
    heads.forEach((h) => {
      const selected = l === state.layer && h === state.head ? " selected" : "";
      if (weights[l][h] === null) {  // a head its layer lacks (layers of different counts)
        parts.push(`<span class="label">no head ${h}</span>`);
        return;
      }
      parts.push(`<button type="button" class="thumb${selected}" data-layer="${l}"`
        + ` data-head="${h}" aria-label="layer ${l}, head ${h}"><canvas></canvas></button>`);
    });
  });
  box.innerHTML = parts.join("");
  box.querySelectorAll(".thumb").forEach((button) =>
    paint(button.firstChild, weights[button.dataset.layer][button.dataset.head], T));
}

export function drawRow(list, title, w, tokens, state) {
  const where = `layer ${state.layer}, head ${state.head}`;
  if (state.query === null) {
    title.textContent = `Choose a query token to see how its attention divides (${where})`;
    list.innerHTML = "";
    return;
  }
  const T = tokens.length, q = state.query;
  title.textContent = `Query “${shown(tokens[q])}” (token ${q}), ${where}: its weights; `
    + "choose a key to trace the pair";
  list.replaceChildren(...tokens.map((t, k) => {
    const v = w[q * T + k];
    return make("li", { class: k === state.key && "key", "data-k": k, "data-w": v },
      make("button", { type: "button", "data-k": k },
        make("span", { class: "bar", style: `width:${percent(v)}` }), `${shown(t)}: ${percent(v)}`));
  }));
}

const numbers = (values) => values.slice(0, 4).map((x) => (x >= 0 ? "+" : "") + x.toFixed(3));
const norm = (values) => Math.sqrt(values.reduce((a, x) => a + x * x, 0));
const vector = (id, values) =>  // the first 4 numbers and the norm shown, every number kept
  `<span class="vector" id="${id}" data-values="${JSON.stringify(values)}">`
  + `[${numbers(values).join(", ")}${values.length > 4 ? ", …" : ""}] (${values.length}`
  + ` numbers, norm ${norm(values).toFixed(3)})</span>`;
const number = (id, value, text) =>
  `<span class="number" id="${id}" data-values="${JSON.stringify(value)}">${text}</span>`;
const signed = (x) => (x >= 0 ? "+" : "") + x.toFixed(4);

// The article's steps, as /api/trace gave them (qkv.trace: the model's own computation).
export function drawTrace(panel, t, note) {
  const words = texts();
  const Q = `“${words.put(shown(t.tokens[t.query_index]))}”`;
  const K = `“${words.put(shown(t.tokens[t.key_index]))}”`;
  const D = t.head_dim, i = t.query_index, a = t.anatomy || {};
  const where = t.causal ? "back" : "away";
  const visible = (k) => (!t.causal || k <= i) && (t.window == null || Math.abs(i - k) < t.window);
  const seen = t.weights.filter((_, k) => visible(k));
  const difference = Math.max(...t.contextualized.map((x, d) => Math.abs(x - t.model_output[d])));
  const group = t.num_heads / t.num_kv_heads;
  const gqa = t.num_kv_heads === t.num_heads ? "" : ` Grouped-query attention: query heads `
    + `${t.kv_head * group}-${t.kv_head * group + group - 1} share key/value head ${t.kv_head}.`;
  const hidden = t.outside_window
    ? `${K} (token ${t.key_index}) is ${Math.abs(i - t.key_index)} tokens ${where}: outside the`
      + ` window, so it is hidden`
    : t.causal && t.key_index > i ? `${K} (token ${t.key_index}) comes after ${Q}: the causal`
      + ` mask hides it` : `the mask hides ${K} (token ${t.key_index})`;
  const weight = t.masked
    ? `<span class="masked">${hidden}, weight ${number("t-weight", 0, "0%")}</span>`
    : `the weight of ${K} is ${number("t-weight", t.weight, percent(t.weight))}`;
  const rotary = t.query_unrotated ? `<li class="note">Rotary positions turn both vectors by an`
    + ` angle that grows with the token's position (lengths unchanged): the query before was `
    + `${vector("t-query-unrotated", t.query_unrotated)}.`
    + (a.rope_dims ? ` Only the first ${a.rope_dims} of the ${D} numbers turn (partial rotary).` : "")
    + (a.rope_scaling ? ` The angles are rescaled (${words.put(a.rope_scaling)}) for texts longer than`
      + ` the model was trained on.` : "") + `</li>` : "";
  const qkNorm = a.qk_norm ? `<li class="note">This model normalizes each query and key first`
    + ` (QK-norm, over ${a.qk_norm === "head" ? `each head's ${D} numbers` : "all heads' numbers"}).`
    + `</li>` : "";
  const windowNote = t.window != null ? `<li class="note">This layer's window: keys ${t.window}`
    + ` or more tokens ${where} are hidden (weight 0).</li>` : "";
  const divisor = 1 / (t.scale * t.scale);
  const scaling = Math.abs(t.scale * Math.sqrt(D) - 1) < 1e-9 ? `Divided by √${D} = `
    + `${Math.sqrt(D).toFixed(3)}` : t.scale === 1 ? `Not divided at all (the article divides by`
    + ` √${D}; this model was trained without)` : Math.abs(divisor - Math.round(divisor)) < 1e-6
    ? `Divided by √${Math.round(divisor)} = ${(1 / t.scale).toFixed(3)}, not √${D} (this model's`
      + ` own scale)` : `Times this layer's scale ${t.scale.toPrecision(6)}`;
  const capped = t.softcap != null ? t.softcap * Math.tanh(t.scaled_scalar / t.softcap) : null;
  const score = (capped == null ? "" : `; capped to ${t.softcap} tanh(s/${t.softcap}) = `
    + signed(capped)) + (t.bias == null ? "" : `; plus ${a.relative_bias ? "a learned bias for"
    + " the distance between the words" : "this layer's score bias"} ${signed(t.bias)}`)
    + (capped == null && t.bias == null ? "" : `; the softmax reads `
      + number("t-score", t.score, signed(t.score)));
  const rows = t.contributions.map((c) => `<tr data-index="${c.index}" data-w="${c.weight}"`
    + ` data-size="${c.size}"${c.index === t.key_index ? ' class="key"' : ""}>`
    + `<td>${c.index}</td><td>${words.put(shown(c.token))}</td>`
    + `<td class="bar-cell"><span class="bar" style="width:${percent(c.weight)}"></span>`
    + `${percent(c.weight)}</td><td>${c.size.toFixed(3)}</td></tr>`).join("");
  panel.dataset.pair = [t.layer, t.head, t.query_index, t.key_index].join(",");
  words.fill(panel, `<h2>${Q} (query, token ${t.query_index}) gets context from ${K} (key, token
 ${t.key_index}): layer ${t.layer}, head ${t.head} of ${words.put(t.model)}</h2>
<p class="note">${words.put(note)}${gqa}</p>
<ol>
<li>Query vector: ${Q}, ${words.put(t.multiplies.query)}, times the query matrix (${t.width} → ${D}
 numbers): ${vector("t-query", t.query_vector)}</li>
<li>Key vector: ${K}, ${words.put(t.multiplies.key)}, times the key matrix: ${vector("t-key", t.key_vector)}</li>${qkNorm}${rotary}
<li>Attention scalar: query · key = ${number("t-scalar", t.attention_scalar, signed(t.attention_scalar))}
 (how much ${Q} should attend to ${K})</li>
${windowNote}<li>${scaling}:
 ${number("t-scaled", t.scaled_scalar, signed(t.scaled_scalar))}${score}; the softmax over the
 ${seen.length} keys ${Q} sees makes weights that sum to 100%, and ${weight}.</li>
<li>Value vector of ${K}, ${words.put(t.multiplies.value)}, times the value matrix: ${vector("t-value", t.value_vector)}</li>
<li>Scaled value vector, the weight times the value vector: ${vector("t-scaled-value", t.scaled_value_vector)}</li>
<li>Steps 1-6 for every key, then the sum of the ${t.tokens.length} scaled value vectors (and
 nothing else): ${Q}'s contextualized vector in this head, ${vector("t-contextualized", t.contextualized)}.
 The model's own attention output: ${vector("t-output", t.model_output)}; largest difference
 ${difference < 1e-6 ? "below 1e-6" : difference.toExponential(1)}.</li>
</ol>
<h3>What each token added to ${Q} in this head</h3>
<p class="note">Weight: the softmax weight (step 4). Size: the length of what it added after
 the output projection; a large weight on a small value vector can add less than a modest one.</p>
<table class="bars" id="t-contributions"><thead><tr><th>token</th><th></th><th>weight</th>
<th>size</th></tr></thead><tbody>${rows}</tbody></table>`);
}

const tiny = (x) => (x === 0 ? "0" : Math.abs(x) >= 0.01 ? x.toFixed(4) : x.toExponential(2));

// "What if the key were hidden?", as /api/hide gave it (qkv.hide): a layer x head grid of
// `effect` (1 - cosine of the query word's final vector with and without), each cell
// keeping every digit in data-effect, coloured on its share of the largest.
export function drawHide(panel, h, state) {
  const words = texts();
  const Q = h.query === null ? "every word" : `“${words.put(h.query)}”`, K = `“${words.put(h.key)}”`;
  const cells = h.effect.flat().filter((e) => e !== null);
  const top = cells.reduce((a, v) => (v > a ? v : a), 0) || 1;
  const best = h.ranked[0] ?? { layer: -1, head: -1, effect: NaN };
  const head = h.effect[0].map((_, n) => `<th scope="col">${n}</th>`).join("");
  const rows = h.effect.map((row, l) => `<tr><th scope="row">layer ${l}</th>${row.map((e, n) => {
    if (e === null) return `<td class="none" data-layer="${l}" data-head="${n}"></td>`;
    const [r, g, b] = color(e / top);
    const marks = [l === best.layer && n === best.head ? "best" : "",
      l === state.layer && n === state.head ? "shown" : ""].join(" ").trim();
    return `<td${marks ? ` class="${marks}"` : ""} data-layer="${l}" data-head="${n}"`
      + ` data-effect="${e}" title="layer ${l}, head ${n}: 1 − cosine = ${tiny(e)}"`
      + ` style="background:rgb(${r},${g},${b})"></td>`;
  }).join("")}</tr>`).join("");
  let next = "";
  if (h.next) {
    const [before, after] = [h.next.before[0], h.next.after[0]];
    const p = (t) => `${words.put(JSON.stringify(shown(t.token)))} ${percent(Math.exp(t.logprob))}`;
    next = `<p id="hide-next">The next token after token ${h.next.position}: ${p(before)} with`
      + ` it, ${p(after)} without.</p>`;
  }
  const done = h.done ?? h.layers.length, count = h.layers.length;
  const progress = done < count ? ` <span class="note" id="hide-progress">(${done} of ${count}`
    + ` layers so far)</span>` : "";
  words.fill(panel, `<h2>What if the key were hidden? ${K} hidden from ${Q}</h2>
<p class="note">In each layer and head alone, ${Q} may not attend to ${K}: the softmax shares
 its weight among the other keys. A cell is how much the final vector of ${Q} changes, 1 −
 cosine (0: not at all), coloured on its share of the largest; rows are layers, columns heads
 (the dashed one is the head shown above). Computed by qkv.hide; hover for the number.</p>
<p id="hide-summary">${h.ranked.length ? `Largest: <b id="hide-best" data-layer="${best.layer}"
 data-head="${best.head}" data-effect="${best.effect}">layer ${best.layer}, head ${best.head}</b>
 (${tiny(best.effect)})${progress}. ` : `Each head alone${progress}… `}Hidden in every layer and
 head at once: <b id="hide-total" data-total="${h.total}">${tiny(h.total)}</b>.</p>
${h.scale ? `<p id="hide-scale" class="note">${words.put(h.scale[0].toUpperCase() + h.scale.slice(1))}.</p>` : ""}
${next}<div class="scroll"><table id="hide-table"><thead><tr><th>head</th>${head}</tr></thead>
<tbody>${rows}</tbody></table></div>`);
}

const SCORE_NAMES = {
  previous_token: "previous token (weight on the token before)",
  induction: "induction (repeated random tokens: the token after the earlier copy)",
  first_token: "first token (the attention sink)",
  self: "itself",
  entropy: "entropy, lowest first (the most focused heads)",
  window_use: "window use (share of the window the weight reaches)",
};

// The census of heads (/api/heads, qkv.heads): the top heads of each score, and each
// layer's mean weight on the first token.
export function drawCensus(box, c) {
  const rows = Object.keys(SCORE_NAMES).filter((name) => c.top[name].length).map((name) =>
    `<tr data-score="${name}"><th>${SCORE_NAMES[name]}</th>${c.top[name].map((t) =>
      `<td data-layer="${t.layer}" data-head="${t.head}" data-value="${t.score}"><button`
      + ` type="button" title="show layer ${t.layer}, head ${t.head}">layer ${t.layer}, head`
      + ` ${t.head}: ${t.score.toFixed(3)}</button></td>`).join("")}</tr>`).join("");
  const sinks = c.first_token_per_layer.map((m, l) => `<tr data-layer="${l}" data-mass="${m}">`
    + `<th>layer ${l}</th><td class="bar-cell"><span class="bar" style="width:${percent(m)}">`
    + `</span>${percent(m)}</td></tr>`).join("");
  box.dataset.model = c.model;
  const words = texts();
  words.fill(box, `<p class="note">${words.put(c.model)}'s ${c.layers} layers × ${c.heads} heads on
 ${c.prompts.length} built-in sentences and ${c.induction.rows} rows of ${c.induction.length}
 random tokens repeated; a score is a mean weight over queries (entropy in nats). Click a head
 to show it. Computed by qkv.heads.</p>
<h3>The top heads of each score</h3>
<div class="scroll"><table class="bars" id="census-top"><tbody>${rows}</tbody></table></div>
<h3>Each layer's weight on the first token (mean over heads)</h3>
<table class="bars" id="census-sinks"><tbody>${sinks}</tbody></table>`);
}
