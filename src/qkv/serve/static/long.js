// The long view: a text over max_tokens, read from its per-head summaries (/api/long*),
// never from every weight. The chosen head's heatmap is max-downsampled (each cell the
// LARGEST weight of its block, so no strong weight disappears); a click opens the block
// around it at full resolution, every weight its own cell. Every request goes to this server.
"use strict";
import { $, color, make, percent, shown, texts, unpack } from "/static/views.js";

const REGION = 64;  // a click opens up to this many queries x keys around it
const PLOT = 512, LEFT = 46, TOP = 6, BOTTOM = 22, RIGHT = 10;  // the heatmap, in pixels
const CELLS = 448;  // the region's side, in pixels (each weight a square cell)

const view = {
  on: false, api: null, model: null, text: null, table: null, head: null, region: null,
  cursor: [0, 0], asking: 0,
};
const sleep = (ms) => new Promise((done) => setTimeout(done, ms));

export const longActive = () => view.on;

export function leaveLong() {
  view.on = false;
  view.asking++;
  document.body.classList.remove("long");
  delete document.body.dataset.long;
}

const post = async (path, body) => (await view.api(path, body)).json();
// Token i in words, a `texts()` of views.js: its text goes in by textContent.
const tokenAt = (words, i) => `“${words.put(shown(view.table.tokens[i]))}” (${i})`;

// Read the text (202 while the server computes it: asked again each second; 503 while its
// queue is full: asked again), then draw the table and the head chosen() then. current():
// false once another text is shown (stop).
export async function showLong({ api, model, text, why, chosen, current }) {
  Object.assign(view, { on: true, api, model, text, table: null, head: null, region: null,
    cursor: [0, 0] });
  const asking = ++view.asking, started = performance.now();
  document.body.classList.add("long");
  delete document.body.dataset.long;
  $("long-note").textContent = `${why}. A text this long is read from per-head summaries `
    + "(up to the server's max_long_tokens), never from every weight: the heatmap below keeps "
    + "the largest weight of each block, and a click opens the block at full resolution.";
  $("long-table").innerHTML = "";
  $("long-map").innerHTML = "";
  $("long-region-box").innerHTML = '<p class="note">Click the heatmap to open a region.</p>';
  $("long-hover").textContent = "";
  for (;;) {
    let response;
    try {
      response = await api("/api/long", { model, text });
    } catch (error) {  // 503: the queue is full for now; the protocol is to ask again
      if (error.status !== 503) throw error;
      if (!current() || asking !== view.asking) return null;
      $("long-progress").textContent = `${error.message} (asking again)`;
      await sleep(2000);
      continue;
    }
    const answer = await response.json();
    if (!current() || asking !== view.asking) return null;
    if (response.status !== 202) {
      view.table = answer;
      break;
    }
    const share = answer.layers_done / answer.num_layers;
    $("long-progress").replaceChildren(`${answer.detail} `,
      make("progress", { max: 1, value: share }));
    await sleep(1000);
    if (!current() || asking !== view.asking) return null;
  }
  const t = view.table, seconds = ((performance.now() - started) / 1000).toFixed(1);
  $("long-progress").textContent = `${model}: ${t.tokens.length.toLocaleString("en")} `
    + `tokens, ${t.layers.length} layers × ${t.heads.length} heads summarized (read in `
    + `${seconds} s). Each heatmap cell is ${t.query_bin} × ${t.key_bin} tokens.`;
  drawTable();
  await chooseHead(...chosen());
  document.body.dataset.long = text.length;
  return view.table;
}

const SORTS = {  // the table's orders: a header's button picks one
  head: (a, b) => a.layer - b.layer || a.head - b.head,
  entropy: (a, b) => a.entropy - b.entropy,  // the most focused heads first
  first: (a, b) => b.first - a.first,  // the strongest attention sinks first
};

function drawTable(order = "head") {  // every (layer, head): entropy, first-token mass, keys
  const t = view.table, rows = [], words = texts();
  t.layers.forEach((layer, n) => t.heads.forEach((head, h) => rows.push({ layer, head,
    entropy: t.mean_entropy[n][h], first: t.mean_first_token_mass[n][h],
    keys: t.most_received_keys[n][h].map((j, r) => `${tokenAt(words, j)} `
      + `${t.most_received[n][h][r].toFixed(1)}`).join(", ") })));
  rows.sort(SORTS[order]);
  const shown = view.head ? [view.head.layer, view.head.head] : [];
  const sort = (name, label) => `<th><button type="button" data-sort="${name}"`
    + `${name === order ? ' class="sorted"' : ""}>${label}</button></th>`;
  words.fill($("long-table"), `<thead><tr>${sort("head", "head")}`
    + `${sort("entropy", "mean entropy (nats), lowest first")}`
    + `${sort("first", "mean first-token mass, highest first")}`
    + "<th>most received keys (position, summed weight)</th></tr></thead><tbody>"
    + rows.map((r) => `<tr data-layer="${r.layer}" data-head="${r.head}" data-entropy="`
      + `${r.entropy}" data-first="${r.first}"${r.layer === shown[0] && r.head === shown[1]
        ? ' class="selected"' : ""}><td><button type="button" data-layer="${r.layer}" `
      + `data-head="${r.head}">layer ${r.layer}, head ${r.head}</button></td><td>`
      + `${r.entropy.toFixed(3)}</td><td>${percent(r.first)}</td><td>${r.keys}</td></tr>`)
      .join("") + "</tbody>");
}

// The head's summaries from the server, its heatmap drawn; the region is closed.
export async function chooseHead(layer, head) {
  if (!view.table) return;  // still reading: the head chosen is drawn when it is read
  const asking = ++view.asking;
  const answer = await post("/api/long/head", { model: view.model, text: view.text, layer,
    head, format: "base64" });
  if (asking !== view.asking) return;
  answer.heatmap = unpack(answer.heatmap);  // Rq * Rk, row-major
  view.head = answer;
  view.region = null;
  document.querySelectorAll("#long-table tr[data-layer]").forEach((tr) => tr.classList.toggle(
    "selected", Number(tr.dataset.layer) === layer && Number(tr.dataset.head) === head));
  $("long-head-title").textContent = `layer ${layer}, head ${head}`;
  $("long-hover").textContent = "";  // it spoke of the head before
  drawHeatmap();
  $("long-region-box").innerHTML = '<p class="note">Click the heatmap (or press Enter on it) '
    + "to open that block's region at full resolution.</p>";
  $("long").dataset.head = `${layer},${head}`;
}

const largest = (w) => w.reduce((a, v) => (v > a ? v : a), 0) || 1;

function ticks(T) {  // token positions worth a label: 0, a round step, ...
  const rough = T / 6, power = 10 ** Math.floor(Math.log10(Math.max(rough, 1)));
  const step = [1, 2, 5, 10].map((f) => f * power).find((s) => s >= rough) || 1;
  const out = [];
  for (let t = 0; t < T; t += step) out.push(t);
  return out;
}

function drawHeatmap() {
  const h = view.head, T = h.num_tokens, [Rq, Rk] = h.shape;
  $("long-map").innerHTML = `<canvas id="long-heatmap" tabindex="0" width="${LEFT + PLOT + RIGHT}"`
    + ` height="${TOP + PLOT + BOTTOM}" data-layer="${h.layer}" data-head="${h.head}" role="img"`
    + ` aria-label="layer ${h.layer}, head ${h.head}: max-downsampled heatmap; arrow keys move,`
    + ` Enter opens the region"></canvas><div class="cursor-mark" id="long-cursor"></div>`;
  const canvas = $("long-heatmap"), context = canvas.getContext("2d");
  const image = context.createImageData(PLOT, PLOT), top = largest(h.heatmap);
  for (let y = 0; y < PLOT; y++) {  // a pixel shows the cell its token position falls in
    const i = Math.min(Rq - 1, Math.floor(Math.floor((y * T) / PLOT) / h.query_bin));
    for (let x = 0; x < PLOT; x++) {
      const j = Math.min(Rk - 1, Math.floor(Math.floor((x * T) / PLOT) / h.key_bin));
      image.data.set([...color(h.heatmap[i * Rk + j] / top), 255], (y * PLOT + x) * 4);
    }
  }
  context.putImageData(image, LEFT, TOP);
  context.fillStyle = "#57606a";
  context.font = "11px system-ui, sans-serif";
  for (const t of ticks(T)) {
    const at = (t / T) * PLOT;
    context.textAlign = "right";
    context.fillText(String(t), LEFT - 4, TOP + at + 4);
    context.fillRect(LEFT - 3, TOP + at, 3, 1);
    context.textAlign = "center";
    context.fillText(String(t), LEFT + at, TOP + PLOT + 15);
    context.fillRect(LEFT + at, TOP + PLOT, 1, 3);
  }
  markCursor();
}

function positionOf(event) {  // the (query, key) token positions under the pointer, or null
  const canvas = $("long-heatmap"), box = canvas.getBoundingClientRect();
  const x = ((event.clientX - box.left) * canvas.width) / box.width - LEFT;
  const y = ((event.clientY - box.top) * canvas.height) / box.height - TOP;
  if (x < 0 || y < 0 || x >= PLOT || y >= PLOT) return null;
  const T = view.head.num_tokens;
  return [Math.floor((y * T) / PLOT), Math.floor((x * T) / PLOT)];
}

function describe(q, k) {  // what the hover line says of query q (and the block under k)
  const h = view.head, Rk = h.shape[1];
  const i = Math.floor(q / h.query_bin), j = Math.floor(k / h.key_bin), T = h.num_tokens;
  const block = h.heatmap[i * Rk + j], words = texts();
  const top = h.top_keys[q].filter((_, r) => h.top_weights[q][r] > 0)  // not the hidden keys
    .map((key, r) => `${tokenAt(words, key)} ${percent(h.top_weights[q][r])}`);
  const box = $("long-hover");
  Object.assign(box.dataset, { q, k, block });
  words.fill(box, `Query ${tokenAt(words, q)}: entropy ${h.entropy[q].toFixed(3)} nats, `
    + `${percent(h.first_token_mass[q])} on the first token; its top keys: ${top.join(", ")}.`
    + ` <span class="note">Block of queries ${i * h.query_bin}–`
    + `${Math.min(T, (i + 1) * h.query_bin) - 1} × keys ${j * h.key_bin}–`
    + `${Math.min(T, (j + 1) * h.key_bin) - 1}: largest weight ${percent(block)}.</span>`);
}

function markCursor() {
  const h = view.head, T = h.num_tokens, [q, k] = view.cursor, mark = $("long-cursor");
  if (!mark) return;
  const width = LEFT + PLOT + RIGHT, height = TOP + PLOT + BOTTOM;
  const cell = (t, bin) => [Math.floor(t / bin) * bin, Math.min(T, (Math.floor(t / bin) + 1) * bin)];
  const [q0, q1] = cell(q, h.query_bin), [k0, k1] = cell(k, h.key_bin);
  Object.assign(mark.style, {
    top: `${(100 * (TOP + (q0 / T) * PLOT)) / height}%`,
    left: `${(100 * (LEFT + (k0 / T) * PLOT)) / width}%`,
    height: `${Math.max(0.3, (100 * ((q1 - q0) / T) * PLOT) / height)}%`,
    width: `${Math.max(0.3, (100 * ((k1 - k0) / T) * PLOT) / width)}%`,
  });
}

// Every weight of up to REGION x REGION tokens around (q, k), from /api/long/region.
export async function openRegion(q, k) {
  const h = view.head, T = h.num_tokens, W = Math.min(REGION, T), asking = view.asking;
  const clamp = (t) => Math.min(T - W, Math.max(0, t - Math.floor(W / 2)));
  const queries = [clamp(q), clamp(q) + W], keys = [clamp(k), clamp(k) + W];
  const r = await post("/api/long/region", { model: view.model, text: view.text,
    layer: h.layer, head: h.head, queries, keys, format: "base64" });
  if (asking !== view.asking) return;
  r.weights = unpack(r.weights);
  view.region = r;
  drawRegion();
}

function drawRegion() {
  const r = view.region, [Q, K] = r.shape, cell = Math.max(1, Math.floor(CELLS / Math.max(Q, K)));
  const box = $("long-region-box");
  box.innerHTML = `<h3>Queries ${r.queries[0]}–${r.queries[1] - 1} × keys ${r.keys[0]}–`
    + `${r.keys[1] - 1}, layer ${r.layer}, head ${r.head} <span class="note">every weight its `
    + "own cell, scaled to the region's largest; hover for the tokens</span></h3>"
    + `<canvas id="long-region" width="${K * cell}" height="${Q * cell}" data-queries="`
    + `${r.queries.join(",")}" data-keys="${r.keys.join(",")}" data-layer="${r.layer}" `
    + `data-head="${r.head}"></canvas><p id="long-region-hover" class="note"></p>`;
  const context = $("long-region").getContext("2d"), top = largest(r.weights);
  for (let i = 0; i < Q; i++) {
    for (let j = 0; j < K; j++) {
      const [red, green, blue] = color(r.weights[i * K + j] / top);
      context.fillStyle = `rgb(${red},${green},${blue})`;
      context.fillRect(j * cell, i * cell, cell, cell);
    }
  }
}

function hoverRegion(event) {
  const r = view.region, canvas = $("long-region"), box = canvas.getBoundingClientRect();
  const [Q, K] = r.shape;
  const i = Math.min(Q - 1, Math.floor(((event.clientY - box.top) / box.height) * Q));
  const j = Math.min(K - 1, Math.floor(((event.clientX - box.left) / box.width) * K));
  const w = r.weights[i * K + j], q = r.queries[0] + i, k = r.keys[0] + j, line = $("long-region-hover");
  Object.assign(line.dataset, { q, k, w });
  const words = texts();
  words.fill(line, `${tokenAt(words, q)} → ${tokenAt(words, k)}: ${percent(w, 3)}`);
}

function moveCursor(event) {  // the heatmap by keyboard: arrows move a block, Enter opens it
  const h = view.head, T = h.num_tokens, [q, k] = view.cursor;
  const moves = { ArrowUp: [-h.query_bin, 0], ArrowDown: [h.query_bin, 0],
    ArrowLeft: [0, -h.key_bin], ArrowRight: [0, h.key_bin] };
  if (event.key in moves) {
    const [dq, dk] = moves[event.key];
    view.cursor = [Math.min(T - 1, Math.max(0, q + dq)), Math.min(T - 1, Math.max(0, k + dk))];
    markCursor();
    describe(...view.cursor);
  } else if (event.key === "Enter" || event.key === " ") {
    openRegion(q, k).catch(showError);
  } else {
    return;
  }
  event.preventDefault();
}

let showError = () => {};

// The long view's events, wired once. choose(layer, head): the page's layer and head
// controls follow a head chosen in the table; fail(error): how the page shows an error.
export function wireLong({ choose, fail }) {
  showError = fail;
  const box = $("long");
  box.addEventListener("mousemove", (e) => {
    if (!view.head) return;
    if (e.target.id === "long-heatmap") {
      const at = positionOf(e);
      if (at) describe(...at);
    } else if (e.target.id === "long-region" && view.region) {
      hoverRegion(e);
    }
  });
  box.addEventListener("click", (e) => {
    const row = e.target.closest("#long-table button[data-layer]");
    const order = e.target.closest("#long-table button[data-sort]");
    if (order && view.table) {
      drawTable(order.dataset.sort);
    } else if (row) {
      choose(Number(row.dataset.layer), Number(row.dataset.head));
    } else if (e.target.id === "long-heatmap" && view.head) {
      const at = positionOf(e);
      if (!at) return;
      view.cursor = at;
      markCursor();
      openRegion(...at).catch(fail);
    }
  });
  box.addEventListener("keydown", (e) => {
    if (e.target.id === "long-heatmap" && view.head) moveCursor(e);
  });
}
