// The explorer's state and its conversation with the API. Every request goes to this server.
"use strict";
import { chooseHead, leaveLong, longActive, showLong, wireLong } from "/static/long.js";
import { $, drawCensus, drawGrid, drawHeadView, drawHeatmap, drawHide, drawRow, drawTrace, make,
  percent, shown, texts, unpack } from "/static/views.js";

const state = {
  models: [], model: null, seen: null, limits: null,  // seen: the /api/attention answer, weights decoded
  layer: 0, head: 0, query: null, key: null, cursor: [0, 0], overlay: false,
  hidden: null,  // the /api/hide answer of the pair shown
};
let shows = 0, traces = 0, hides = 0, whys = 0, censuses = 0, generation = null;
const HIDE_NOTE = "<h2>What if the key were hidden?</h2><p class=\"note\">Choose a pair of "
  + "words (as for the article's steps) to see, in every layer and head, how much the query "
  + "word changes when it may not attend to the key.</p>";

async function api(path, body) {
  const response = await fetch(path, body === undefined ? {} : {
    method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(body),
  });
  if (!response.ok) {
    const problem = await response.json().catch(() => ({ detail: response.statusText }));
    throw Object.assign(new Error(problem.detail || `HTTP ${response.status}`),
      { status: response.status, limit: problem.limit });
  }
  return response;
}
const post = async (path, body) => (await api(path, body)).json();

function fail(error) {
  $("error").hidden = false;
  $("error").textContent = String(error.message || error);
  document.body.dataset.error = $("error").textContent;
}
function clearError() {
  $("error").hidden = true;
  delete document.body.dataset.error;
}

const info = () => state.models.find((m) => m.name === state.model);

// A layer of fewer heads (Qwen3.5's full layers beside its linear ones): only its own heads.
function fitHead() {
  const model = info();
  const count = model.heads_per_layer ? model.heads_per_layer[state.layer] : model.num_heads;
  Array.from($("head").options).forEach((o) => { o.disabled = Number(o.value) >= count; });
  if (state.head >= count) {
    state.head = count - 1;
    $("head").value = String(state.head);
  }
}
const weights = (layer = state.layer, head = state.head) => state.seen.weights[layer][head];

function options(select, count, chosen, first) {
  select.innerHTML = Array.from({ length: count }, (_, i) =>
    `<option value="${i}"${i === chosen ? " selected" : ""}>${i}${i ? "" : ` (${first})`}</option>`,
  ).join("");
}

async function show() {  // the attention of every layer and head of the text
  const ticket = ++shows, text = $("text").value, started = performance.now();
  clearError();
  $("status").textContent = "Reading…";
  if (text.length > state.limits.max_chars) {  // too long to send every weight of
    showLongText(ticket, text, `This text has ${text.length.toLocaleString("en")} characters, `
      + `more than the ${state.limits.max_chars.toLocaleString("en")} whose every weight this `
      + "page draws (max_chars)");
    return;
  }
  try {
    const seen = await post("/api/attention", { model: state.model, text, format: "base64" });
    if (ticket !== shows) return;
    leaveLong();
    // [layer][head]: T * T; null for a head its layer does not have
    seen.weights = seen.weights.map((row) => row.map((m) => (m === null ? null : unpack(m))));
    seen.tokens = seen.pieces;  // each token's text as its decoder writes it, not its name
    seen.wordOf = seen.tokens.map(() => null);
    seen.words.forEach((w) => { for (let t = w.tokens[0]; t < w.tokens[1]; t++) seen.wordOf[t] = w; });
    state.seen = seen;
    const model = info();
    state.layer = Math.min(state.layer, model.num_layers - 1);
    state.head = Math.min(state.head, model.num_heads - 1);
    state.query = state.key = null;
    state.cursor = [0, 0];
    options($("layer"), model.num_layers, state.layer, "the first layer");
    options($("head"), model.num_heads, state.head, "the first head");
    fitHead();
    // linear layers' effective weights are drawn as each row's shares of |w|: say so
    $("effective").hidden = !seen.effective;
    $("effective").textContent = seen.effective
      ? `Effective weights (linear attention): ${seen.effective}` : "";
    $("tokens").replaceChildren(...seen.tokens.map((t, i) => make("button",
      { type: "button", class: `token${seen.wordOf[i] ? "" : " special"}`, "data-index": i },
      shown(t))));
    drawGrid($("grid"), seen.weights, seen.tokens, seen.layers, seen.heads, state);
    render();
    resetTrace();
    const ms = Math.round(performance.now() - started);
    $("status").textContent = `${model.name} (${model.kind}): ${seen.tokens.length} tokens, `
      + `${model.num_layers} layers × ${model.num_heads} heads, answered in ${ms} ms`;
    document.body.dataset.shown = text;
    document.body.dataset.model = state.model;
    if (model.generates) nextTokens(text);
  } catch (error) {
    if (ticket !== shows) return;
    if (error.status === 413 && ["max_tokens", "max_chars"].includes(error.limit)) {
      showLongText(ticket, text, `${error.message.replace(/^the text/, "This text")} for the `
        + "views of every weight");
    } else {
      $("status").textContent = "";
      fail(error);
    }
  }
}

async function showLongText(ticket, text, why) {  // over max_tokens: the long view
  const model = info();
  state.seen = null;
  state.layer = Math.min(state.layer, model.num_layers - 1);
  state.head = Math.min(state.head, model.num_heads - 1);
  options($("layer"), model.num_layers, state.layer, "the first layer");
  options($("head"), model.num_heads, state.head, "the first head");
  fitHead();
  $("effective").hidden = true;
  $("status").textContent = "";
  try {
    const read = await showLong({ api, model: state.model, text, why,
      chosen: () => [state.layer, state.head], current: () => ticket === shows });
    if (read === null || ticket !== shows) return;
    document.body.dataset.shown = text;
    document.body.dataset.model = state.model;
  } catch (error) {
    if (ticket === shows) fail(error);
  }
}

function chooseLongHead(layer, head) {
  state.layer = layer;
  state.head = head;
  $("layer").value = String(layer);
  $("head").value = String(head);
  chooseHead(layer, head).catch(fail);
}

function render() {  // the selected head's views
  const { seen } = state;
  if (!seen) return;
  drawHeatmap($("heatmap"), weights(), seen.tokens, state);
  const heads = state.overlay
    ? seen.heads.map((h) => ({ w: weights(state.layer, h), head: h })).filter((v) => v.w)
    : [{ w: weights(), head: state.head }];
  drawHeadView($("headview"), heads, seen.tokens, state);
  drawRow($("row"), $("row-title"), weights(), seen.tokens, state);
  showStrongest();
  showSink();
  document.querySelectorAll(".token").forEach((el) =>
    el.classList.toggle("selected", Number(el.dataset.index) === state.query));
  document.querySelectorAll(".thumb").forEach((el) => el.classList.toggle("selected",
    Number(el.dataset.layer) === state.layer && Number(el.dataset.head) === state.head));
  document.body.dataset.view = [state.layer, state.head, state.query ?? "", state.key ?? ""].join(",");
}

// The head where the chosen pair's weight is largest, offered when another is shown: a pair
// opened on head 0 may show 0.30% where another head gives it most of the query's weight.
function showStrongest() {
  const box = $("strongest"), { seen, query, key } = state;
  if (!seen || query === null || key === null) { box.hidden = true; box.replaceChildren(); return; }
  const T = seen.tokens.length;
  let best = null;
  seen.weights.forEach((row, l) => row.forEach((w, h) => {
    if (w && (best === null || w[query * T + key] > best.w)) best = { layer: l, head: h, w: w[query * T + key] };
  }));
  box.hidden = false;
  box.dataset.layer = best.layer;
  box.dataset.head = best.head;
  box.dataset.w = best.w;
  const here = best.layer === state.layer && best.head === state.head;
  box.replaceChildren(`Strongest head for this pair: layer ${best.layer} head ${best.head} `
    + `(${percent(best.w)})${here ? ", the one shown." : "; this one gives it "
    + percent(weights()[query * T + key]) + ". "}`, here ? "" : make("button",
    { type: "button", id: "strongest-show" }, `Show layer ${best.layer} head ${best.head}`));
}

// The row's largest weight on the first or a special token: named an attention sink, in the
// words of qkv.inspect.sinks that the server sends with the weights.
function showSink() {
  const box = $("sink"), { seen, query } = state;
  box.textContent = "";
  if (!seen || query === null || !seen.sinks) return;
  const T = seen.tokens.length, w = weights(), row = w.subarray(query * T, (query + 1) * T);
  const top = row.reduce((best, v, k) => (v > row[best] ? k : best), 0);
  box.dataset.top = top;
  if (!seen.sinks.indices.includes(top)) return;
  const fill = { token: `"${shown(seen.tokens[top])}"`, index: top,
    query: `"${shown(seen.tokens[query])}"`, weight: percent(row[top]) };
  box.textContent = seen.sinks.said.replace(/\{(\w+)\}/g, (_, name) => fill[name]) + ".";
}

function resetTrace() {
  traces++;
  resetHide();
  resetWhy();
  delete $("trace").dataset.pair;
  $("trace").innerHTML = "<h2>The article's steps for one pair</h2><p class=\"note\">Click a "
    + "heatmap cell, or a query token and then a key in its list, to follow the article's "
    + "steps with this model's numbers.</p>";
}

async function trace() {  // the article's steps for (query, key) in this layer and head
  const { seen, query, key } = state, ticket = ++traces;
  const q = seen.wordOf[query], k = seen.wordOf[key];
  if (!q || !k) {
    const which = !q ? query : key;
    resetHide();
    delete $("trace").dataset.pair;
    const words = texts();
    words.fill($("trace"), `<h2>“${words.put(shown(seen.tokens[which]))}” is not a word</h2>`
      + "<p>It is a marker the tokenizer adds (token " + which + "), not a word of the text: its"
      + ` weight is ${percent(weights()[query * seen.tokens.length + key])} in this head. The`
      + " article's steps are traced between words; choose two.</p>");
    return;
  }
  hide(q.word, k.word);  // beside the trace, not after it
  try {
    const t = await post("/api/trace", { model: state.model, text: seen.text, query: q.word,
      key: k.word, layer: state.layer, head: state.head });
    if (ticket !== traces) return;
    const first = (w, i) => (w.tokens[0] === i ? "" : ` “${w.word}” is tokens `
      + `${w.tokens[0]}-${w.tokens[1] - 1}: traced at its first token.`);
    drawTrace($("trace"), t, `Computed by qkv.trace with the model's own vectors.${first(q, query)}${first(k, key)}`);
  } catch (error) {
    if (ticket === traces) fail(error);
  }
}

const WHY_NOTE = "Choose a pair (as for the article's steps) to see its score taken apart: "
  + "which parts of the query token's vector and of the key token's make it large.";
function resetWhy(note = WHY_NOTE) {
  whys++;
  delete $("why").dataset.pair;
  $("why").replaceChildren(make("h2", {}, "Why this score?"), make("p", { class: "note" }, note));
}

// the pair's score taken apart (qkv.why), at the tokens clicked: words or not
async function why() {
  const { seen, query, key } = state, started = performance.now();
  resetWhy(`Taking apart the score of token ${query} over token ${key}…`);
  const ticket = whys;  // resetWhy's: a newer pair, head or text takes another
  try {
    const w = await post("/api/why", { model: state.model, text: seen.text, query_index: query,
      key_index: key, layer: state.layer, head: state.head });
    if (ticket !== whys) return;
    const ms = Math.round(performance.now() - started);
    drawWhy($("why"), w, seen.tokens.map(shown), "Computed by qkv.why with the model's own "
      + `vectors, every norm's scale held at its value in this pass (answered in ${ms} ms).`);
  } catch (error) {  // e.g. a decoder's key after its query: said in the panel
    if (ticket !== whys) return;
    $("why").replaceChildren(make("h2", {}, "Why this score?"),
      make("p", { class: "masked", id: "why-error" }, error.message));
  }
}

function resetHide() {
  hides++;
  state.hidden = null;
  delete $("hide").dataset.pair;
  $("hide").innerHTML = HIDE_NOTE;
}

async function hide(query, key) {  // the key hidden from the query, in every layer and head
  const panel = $("hide"), pair = `${query},${key}`;
  if (state.hidden && state.hidden.pair === pair) {  // the same pair: redrawn, not asked again
    drawHide(panel, state.hidden, state);
    return;
  }
  const ticket = ++hides, asked = { model: state.model, text: state.seen.text, query, key };
  delete panel.dataset.pair;
  const words = texts();
  words.fill(panel, `<h2>What if the key were hidden?</h2><p class="note">Hiding `
    + `“${words.put(key)}” from “${words.put(query)}” in every layer and head…</p>`);
  try {
    // first the key hidden everywhere at once (one run), then each layer's heads alone: a
    // request per layer, so each stays short on a large model and the grid fills as it goes
    const h = await post("/api/hide", { ...asked, table: false, scale: true });
    if (ticket !== hides) return;
    Object.assign(h, { pair, done: 0 });
    state.hidden = h;
    drawHide(panel, h, state);
    for (const layer of h.layers) {
      const row = await post("/api/hide", { ...asked, layers: [layer], scale: false });
      if (ticket !== hides) return;
      for (const name of ["effect", "distance", "next_by_head"]) {
        if (h[name]) h[name][layer] = row[name][layer];
      }
      h.ranked = h.ranked.concat(row.ranked).sort((a, b) => b.effect - a.effect);
      h.done += 1;
      drawHide(panel, h, state);
    }
    panel.dataset.pair = pair;
  } catch (error) {  // e.g. a decoder's key after its query: said in the panel
    if (ticket !== hides) return;
    state.hidden = null;
    panel.replaceChildren(make("h2", {}, "What if the key were hidden?"),
      make("p", { class: "masked", id: "hide-error" }, error.message));
  }
}

async function census(again = null) {  // the model's heads on built-in prompts
  const box = $("census"), ticket = again ?? ++censuses;
  if (again === null) {
    box.replaceChildren(make("p", { class: "note" }, `Counting what ${state.model}'s heads do…`));
    delete box.dataset.model;
  }
  try {
    const c = await post("/api/heads", { model: state.model });
    if (ticket === censuses) drawCensus(box, c);
  } catch (error) {
    if (ticket !== censuses) return;
    if (error.status === 503) {  // still being counted (once per model): ask again soon
      box.replaceChildren(make("p", { class: "note" }, error.message));
      setTimeout(() => census(ticket), 3000);
    } else {
      box.replaceChildren(make("p", { class: "masked" }, error.message));
    }
  }
}

function select(query, key = null) {
  state.query = query;
  state.key = key;
  if (query !== null) state.cursor = [query, key ?? state.cursor[1]];
  render();
  if (query !== null && key !== null) {
    trace();
    why();
  } else {
    resetTrace();
  }
}

async function nextTokens(text) {
  const list = $("next");
  try {
    const answer = await post("/api/next", { model: state.model, text, top: 10 });
    list.replaceChildren(...answer.next.map((n) => make("li", { "data-p": n.probability,
      "data-id": n.id }, make("span", { class: "bar-cell" },
      make("span", { style: `width:${percent(n.probability)}` })),
    `${JSON.stringify(n.text)} ${percent(n.probability)}`)));
  } catch (error) {
    fail(error);
  }
}

async function generate() {  // streamed: server-sent events read from a POST's body
  const controller = new AbortController();
  generation = controller;
  $("gen-go").disabled = true;
  $("gen-stop").disabled = false;
  $("gen-prompt").textContent = $("text").value;
  $("gen-new").textContent = "";
  $("gen-status").textContent = "Writing…";
  try {
    const response = await api("/api/generate/stream", {
      model: state.model, prompt: $("text").value, max_new_tokens: Number($("gen-max").value),
      temperature: Number($("gen-temperature").value),
    });
    const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
    let buffer = "";
    const cancel = () => reader.cancel();
    controller.signal.addEventListener("abort", cancel);
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += value;
      let end;
      while ((end = buffer.indexOf("\n\n")) >= 0) {
        const block = buffer.slice(0, end);
        buffer = buffer.slice(end + 2);
        const kind = /^event: (.*)$/m.exec(block)[1], data = JSON.parse(/^data: (.*)$/m.exec(block)[1]);
        if (kind === "token") $("gen-new").textContent += data.text;
        else if (kind === "done") $("gen-status").textContent = `Done: ${data.ended}.`;
        else throw new Error(data.detail);
      }
    }
    if (controller.signal.aborted) $("gen-status").textContent = "Stopped.";
  } catch (error) {
    $("gen-status").textContent = "";
    fail(error);
  } finally {
    $("gen-go").disabled = false;
    $("gen-stop").disabled = true;
    generation = null;
  }
}

async function compare() {
  const table = $("compare-table");
  try {
    const answer = await post("/api/probe", { model: state.model, word: $("compare-word").value,
      sentences: [$("compare-a").value, $("compare-b").value] });
    table.className = "bars";
    table.replaceChildren(
      make("thead", {}, make("tr", {}, make("th", {}, "depth"),
        make("th", {}, "cosine of the two vectors"))),
      ...answer.layers.map((name, d) => {
        const cosine = answer.similarity[d][0][1];
        return make("tr", { "data-depth": d, "data-cosine": cosine }, make("th", {}, name),
          make("td", { class: "bar-cell" }, make("span", { class: "bar",
            style: `width:${percent(Math.max(cosine, 0))}` }), cosine.toFixed(3)));
      }));
  } catch (error) {
    fail(error);
  }
}

function moveCursor(event) {  // the heatmap by keyboard: arrows move, Enter traces
  if (!state.seen) return;
  const T = state.seen.tokens.length, [q, k] = state.cursor;
  const moves = { ArrowUp: [-1, 0], ArrowDown: [1, 0], ArrowLeft: [0, -1], ArrowRight: [0, 1] };
  if (event.key in moves) {
    const [dq, dk] = moves[event.key];
    state.cursor = [Math.min(T - 1, Math.max(0, q + dq)), Math.min(T - 1, Math.max(0, k + dk))];
    const [cq, ck] = state.cursor;
    $("cell").textContent = `${shown(state.seen.tokens[cq])} (${cq}) → `
      + `${shown(state.seen.tokens[ck])} (${ck}): ${percent(weights()[cq * T + ck])}`;
    render();
  } else if (event.key === "Enter" || event.key === " ") {
    select(q, k);
  } else {
    return;
  }
  event.preventDefault();
}

function canvasCell(event) {
  const canvas = $("heatmap-canvas"), box = canvas.getBoundingClientRect();
  const T = state.seen.tokens.length;
  const at = (x, size) => Math.min(T - 1, Math.max(0, Math.floor((x / size) * T)));
  return [at(event.clientY - box.top, box.height), at(event.clientX - box.left, box.width)];
}

function wire() {
  $("text-form").addEventListener("submit", (e) => { e.preventDefault(); show(); });
  $("example").addEventListener("change", (e) => {
    if (e.target.value) { $("text").value = e.target.value; show(); }
  });
  $("model").addEventListener("change", (e) => {
    state.model = e.target.value;
    $("decoder").hidden = !info().generates;
    $("compare-table").innerHTML = "";  // its numbers were the other model's
    show();
    census();
  });
  const chosen = () => (longActive() ? chooseLongHead(state.layer, state.head)
    : select(state.query, state.key));
  $("layer").addEventListener("change", (e) => {
    state.layer = Number(e.target.value);
    fitHead();
    chosen();
  });
  $("head").addEventListener("change", (e) => { state.head = Number(e.target.value); chosen(); });
  $("text").addEventListener("keydown", (e) => {  // Enter shows; Shift+Enter is a new line
    if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); $("text-form").requestSubmit(); }
  });
  wireLong({ choose: chooseLongHead, fail });
  $("overlay").addEventListener("change", (e) => { state.overlay = e.target.checked; render(); });
  $("clear").addEventListener("click", () => select(null));
  $("strongest").addEventListener("click", (e) => {
    if (e.target.id !== "strongest-show") return;
    state.layer = Number($("strongest").dataset.layer);
    state.head = Number($("strongest").dataset.head);
    $("layer").value = String(state.layer);
    fitHead();
    $("head").value = String(state.head);
    select(state.query, state.key);
  });
  $("heatmap").addEventListener("keydown", moveCursor);
  $("compare-form").addEventListener("submit", (e) => { e.preventDefault(); compare(); });
  $("gen-form").addEventListener("submit", (e) => { e.preventDefault(); generate(); });
  $("gen-stop").addEventListener("click", () => generation && generation.abort());
  document.addEventListener("click", (e) => {
    if (!state.seen) return;
    const cell = e.target.closest("#heatmap-table td[data-k]");
    const key = e.target.closest("#row button[data-k], .hv-key");
    const query = e.target.closest(".token, .hv-query, #heatmap-table th[data-q]");
    const thumb = e.target.closest(".thumb, #census-top td[data-layer]");
    if (e.target.id === "heatmap-canvas") select(...canvasCell(e));
    else if (cell) select(Number(cell.dataset.q), Number(cell.dataset.k));
    else if (key && state.query !== null) select(state.query, Number(key.dataset.k ?? key.dataset.index));
    else if (query) select(Number(query.dataset.index ?? query.dataset.q));
    else if (thumb) {
      state.layer = Number(thumb.dataset.layer);
      state.head = Number(thumb.dataset.head);
      $("layer").value = String(state.layer);
      $("head").value = String(state.head);
      select(state.query, state.key);
    }
  });
}

async function start() {
  wire();
  try {
    const answer = await (await api("/api/models")).json();
    state.models = answer.models;
    state.model = answer.models[0].name;
    state.limits = answer.limits;
    $("model").replaceChildren(...answer.models.map((m) => make("option", { value: m.name },
      `${m.name} (${m.kind}, ${m.num_layers} × ${m.num_heads})`)));
    $("example").append(...answer.examples.map((s) => make("option", {}, s)));
    // no maxLength on the text: a pasted text is never cut silently; the server names its limit
    $("gen-max").max = answer.limits.max_new_tokens;
    $("text").value = answer.examples[0];
    $("decoder").hidden = !info().generates;
    await show();
    census();
    window.qkvReady = true;
  } catch (error) {
    fail(error);
  }
}

start();
