(function () {
  "use strict";
  // Every string from the data enters the page through textContent or setAttribute, never
  // as markup (qkv.viz.escape). Every number shown keeps its exact value in data-value.
  var data = JSON.parse(document.getElementById("tour-data").textContent);
  var steps = data.steps, current = 0;
  var VIRIDIS = ["#440154", "#482878", "#3e4989", "#31688e", "#26828e", "#1f9e89",
                 "#35b779", "#6ece58", "#b5de2b", "#fde725"];

  function el(tag, attrs, text) {
    var node = document.createElement(tag);
    Object.keys(attrs || {}).forEach(function (k) { node.setAttribute(k, attrs[k]); });
    if (text !== undefined && text !== null) node.textContent = String(text);
    return node;
  }
  function add(parent) {
    for (var i = 1; i < arguments.length; i++) if (arguments[i]) parent.appendChild(arguments[i]);
    return parent;
  }
  function fmt(v) {
    if (v === null || v === undefined) return "–";
    if (v === 0) return "0";
    var a = Math.abs(v);
    return (a >= 1e-3 && a < 1e5) ? String(Number(v.toPrecision(4))) : v.toExponential(3);
  }
  function num(v, percent) {
    var text = percent ? (v * 100).toFixed(2) + "%" : fmt(v);
    return el("span", {"class": "num", "data-value": JSON.stringify(v)}, text);
  }
  function viridis(t) {
    t = Math.max(0, Math.min(1, isFinite(t) ? t : 0));
    return VIRIDIS[Math.min(VIRIDIS.length - 1, Math.floor(t * VIRIDIS.length))];
  }
  function legend(lo, hi, what) {
    var bar = el("span", {"class": "bar", "aria-hidden": "true"});
    bar.style.background = "linear-gradient(to right," + VIRIDIS.join(",") + ")";
    // a fixed end of the scale (0 for weights) is the scale's own, not one of the model's numbers
    return add(el("div", {"class": "legend"}), el("span", {}, "colour scale (viridis) of " + what + ":"),
               typeof lo === "string" ? el("span", {}, lo) : num(lo), bar,
               typeof hi === "string" ? el("span", {}, hi) : num(hi));
  }
  function strip(name, values, cls) {
    var lo = Math.min.apply(null, values), hi = Math.max.apply(null, values);
    var box = el("div", {"class": "vec " + (cls || ""), "data-values": JSON.stringify(values)});
    add(box, el("span", {"class": "name"}, name + " (" + values.length + " numbers)"));
    var s = el("div", {"class": "strip", role: "img", "aria-label": name + ": " + values.length +
                       " numbers from " + fmt(lo) + " to " + fmt(hi)});
    values.forEach(function (v) {
      var c = el("span", {}); c.style.background = viridis((v - lo) / ((hi - lo) || 1));
      s.appendChild(c);
    });
    var first = el("div", {"class": "nums"}, "first " + Math.min(8, values.length) + ": ");
    values.slice(0, 8).forEach(function (v, i) {
      if (i) first.appendChild(document.createTextNode(", "));
      first.appendChild(num(v));
    });
    return add(box, s, legend(lo, hi, "these numbers"), first);
  }
  function facts(pairs) {
    var dl = el("dl", {"class": "facts"});
    pairs.forEach(function (p) {
      var dd = el("dd", {"data-fact": p[2] || ""});
      if (typeof p[1] === "number") dd.appendChild(num(p[1])); else dd.textContent = String(p[1]);
      add(dl, el("dt", {}, p[0]), dd);
    });
    return dl;
  }
  function bar(v, lo, hi) {
    var cell = el("td", {"class": "bar-cell"}), s = el("span", {"aria-hidden": "true"});
    s.style.width = Math.round(200 * Math.max(0, (v - lo) / ((hi - lo) || 1))) + "px";
    s.style.background = viridis((v - lo) / ((hi - lo) || 1));
    return add(cell, s);
  }
  function table(headers, rows, cls) {
    var t = el("table", {"class": cls || ""}), head = el("tr");
    headers.forEach(function (h) { head.appendChild(el("th", {}, h)); });
    t.appendChild(head);
    rows.forEach(function (r) { t.appendChild(r); });
    return t;
  }
  function tokenRow(i, cells, extra) {
    var tr = el("tr", {"data-index": i});
    if (i === data.query_index) tr.className = "query";
    else if (i === data.key_index) tr.className = "key";
    add(tr, el("td", {}, i), el("td", {"class": "tok"}, data.tokens[i]));
    cells.forEach(function (c) { tr.appendChild(c); });
    return tr;
  }
  function weightRows(weights, tokens) {
    var hi = Math.max.apply(null, weights);
    return weights.map(function (w, i) {
      var tr = el("tr", {"data-index": i});
      add(tr, el("td", {}, i), el("td", {"class": "tok"}, tokens[i]),
          add(el("td"), num(w, true)), bar(w, 0, hi));
      return tr;
    });
  }

  var DRAW = {
    tokens: function (n, box) {
      add(box, table(["#", "token", "id"], n.ids.map(function (id, i) {
        return tokenRow(i, [add(el("td"), num(id))]);
      }), "tokens"));
    },
    embeddings: function (n, box) {
      add(box, facts([["token", n.token], ["position (from 0)", n.position === undefined ?
        "none added" : n.position], ["positions", n.position_kind], ["width C", n.width]]));
      add(box, strip("token embedding", n.token_vector));
      if (n.position_vector) add(box, strip("+ position embedding", n.position_vector));
      if (n.segment_vector) add(box, strip("+ segment embedding (BERT's segment 0)", n.segment_vector));
      add(box, strip("= what enters layer 0" + (n.norm ? " (after " + n.norm + ")" : ""), n.layer_input));
    },
    qkv: function (n, box) {
      add(box, facts([["layer", n.layer], ["head", n.head], ["why this head", n.chosen],
                      ["head size D", n.head_dim]]));
      add(box, el("h3", {}, "1. The query vector of " + data.query));
      add(box, strip("query vector", n.query_vector));
      add(box, el("h3", {}, "2. The key vector of " + data.key));
      add(box, strip("key vector", n.key_vector));
      add(box, el("h3", {}, "3. Their dot product, one scalar, scaled by 1/√D"));
      add(box, facts([["q · k", n.attention_scalar, "scalar"], ["scale 1/√D", n.scale, "scale"],
                      ["(q · k) / √D", n.scaled_scalar, "scaled"]]));
      if (n.why && n.why.shown) {
        add(box, el("p", {}, "Why this scalar: the stream entering the layer is a sum of parts " +
                    "(the embedding, each earlier head and MLP), so the scaled score is a sum of " +
                    "terms, one per (query part, key part). The largest:"));
        add(box, table(["query part", "key part", "term", "share of the score"], n.why.ranked.map(function (r) {
          return add(el("tr"), el("td", {"class": "tok"}, r.query_part), el("td", {"class": "tok"}, r.key_part),
                     add(el("td"), num(r.value)), add(el("td"), num(r.share, true)));
        }), "why"));
        add(box, facts([["sum of every term", n.why.total, "why_total"]]));
      } else if (n.why) {
        add(box, el("p", {"class": "note"}, "Why this scalar: " + n.why.why_not));
      }
      add(box, el("h3", {}, "4. Softmax over every word: the weights sum to 1"));
      add(box, table(["#", "token", "weight", ""], weightRows(n.weights, data.tokens), "weights"));
      add(box, el("h3", {}, "5. The value vector of " + data.key));
      add(box, strip("value vector", n.value_vector));
      add(box, el("h3", {}, "6. Scaled by its weight"));
      add(box, strip("weight × value vector", n.scaled_value_vector));
      add(box, el("h3", {}, "7. Summed over every word: the new vector of " + data.query));
      add(box, strip("contextualized vector", n.contextualized));
      add(box, el("p", {}, "The model's own output for this head equals it to " +
                  fmt(Math.max.apply(null, n.model_output.map(function (v, i) {
                    return Math.abs(v - n.contextualized[i]); }))) + "."));
    },
    scaling: function (n, box) {
      add(box, facts([["D", n.head_dim], ["√D", n.sqrt_d], ["top weight without", n.top_without, "top_without"],
                      ["top weight with", n.top_with, "top_with"]]));
      var rows = n.scalars.map(function (s, i) {
        return tokenRow(i, [add(el("td"), num(s)), add(el("td"), num(n.scaled[i])),
                            add(el("td", {"class": "without"}), num(n.without_scale[i], true)),
                            add(el("td", {"class": "with"}), num(n.with_scale[i], true))]);
      });
      add(box, table(["#", "token", "q · k", "(q · k)/√D", "softmax without √D", "softmax with √D"],
                     rows, "scaling"));
    },
    heads: function (n, box) {
      var hi = Math.max.apply(null, n.weights);
      add(box, el("p", {}, "Every head's weight from " + data.query + " to " + data.key + " in layer " +
                  data.layer + " (strongest: head " + n.strongest + "):"));
      add(box, table(["head", "weight", ""], n.weights.map(function (w, h) {
        var tr = el("tr", {"data-head": h});
        if (h === data.head) tr.className = "query";
        return add(tr, el("td", {}, h), add(el("td"), num(w, true)), bar(w, 0, hi));
      }), "heads"));
      add(box, legend("0", hi, "the weights"));
      var s = n.shapes;
      add(box, facts([["each head's output", s.heads], ["concatenated", s.concatenated],
                      ["output projection W_O", s.projection], ["projected", s.projected]]));
      add(box, strip("concatenated heads of " + data.query, n.concatenated));
      add(box, strip("projected back to C", n.projected));
    },
    layers: function (n, box) {
      var rows = n.depths.map(function (d, i) {
        var tr = el("tr", {"data-depth": i});
        return add(tr, el("td", {"class": "tok"}, d),
                   add(el("td"), i ? num(n.consecutive_cosine[i - 1]) : el("span", {}, "–")),
                   add(el("td"), num(n.norms[i])),
                   add(el("td"), num(n.senses.separation[i])), add(el("td"), num(n.senses.accuracy[i])));
      });
      add(box, table(["depth", "cosine with the depth before", "norm",
                      "'bank' senses: separation", "sense accuracy"], rows, "layers"));
      add(box, el("p", {"class": "note"}, "Separation: mean cosine between two 'bank's of the same sense " +
        "minus between two of different senses, over " + n.senses.sentences + " labelled sentences. " +
        "Every 'bank' is the same token: at the embeddings their vectors differ only by what positions " +
        "add (nothing where positions rotate q and k instead); the layers' context does the rest."));
    },
    cross: function (n, box) {
      add(box, facts([["this model", n.kind], ["has cross-attention", n.has_cross ? "yes" : "no"]]));
      if (!n.has_cross) return;
      add(box, facts([["target", n.target], ["layer", n.layer], ["head", n.head]]));
      var head = el("tr");
      add(head, el("th", {}, "decoder reads"), el("th", {}, "predicts"));
      n.source_tokens.forEach(function (t) { head.appendChild(el("th", {"class": "tok"}, t)); });
      var t = add(el("table", {"class": "cross"}), head), top = 0;
      n.weights.forEach(function (row) { top = Math.max(top, Math.max.apply(null, row)); });
      n.weights.forEach(function (row, i) {
        var tr = add(el("tr", {"data-row": i}), el("td", {"class": "tok"}, n.decoder_tokens[i]),
                     el("td", {"class": "tok"}, n.predicts[i]));
        row.forEach(function (w, j) {
          var cell = add(el("td", {title: n.decoder_tokens[i] + " → " + n.source_tokens[j]}), num(w, true));
          cell.style.background = viridis(w / (top || 1));
          cell.style.color = w / (top || 1) > 0.55 ? "#000" : "#fff";
          if (j === n.looks_at[i]) cell.style.fontWeight = "bold";
          tr.appendChild(cell);
        });
        t.appendChild(tr);
      });
      add(box, t, legend("0", top, "the weights"));
    },
    training: function (n, box) {
      if (!n.run || !n.loss.length) return;
      var W = 520, H = 160, lo = Math.min.apply(null, n.loss), hi = Math.max.apply(null, n.loss);
      var svgNS = "http://www.w3.org/2000/svg", svg = document.createElementNS(svgNS, "svg");
      svg.setAttribute("width", W); svg.setAttribute("height", H); svg.setAttribute("role", "img");
      svg.setAttribute("aria-label", "training loss from " + fmt(n.loss[0]) + " to " + fmt(n.loss[n.loss.length - 1]));
      var line = document.createElementNS(svgNS, "polyline"), last = n.steps[n.steps.length - 1] || 1;
      line.setAttribute("points", n.loss.map(function (l, i) {
        return (8 + (W - 16) * n.steps[i] / last) + "," + (8 + (H - 16) * (hi - l) / ((hi - lo) || 1));
      }).join(" "));
      line.setAttribute("fill", "none"); line.setAttribute("stroke", "#21486b"); line.setAttribute("stroke-width", "2");
      var frame = document.createElementNS(svgNS, "rect");
      [["x", 1], ["y", 1], ["width", W - 2], ["height", H - 2], ["fill", "none"], ["stroke", "#999"]]
        .forEach(function (a) { frame.setAttribute(a[0], a[1]); });
      svg.appendChild(frame);
      [[6, 14, "loss " + fmt(hi)], [6, H - 6, "loss " + fmt(lo) + ", step " + last]].forEach(function (t) {
        var label = document.createElementNS(svgNS, "text");
        label.setAttribute("x", t[0]); label.setAttribute("y", t[1]); label.setAttribute("font-size", "11");
        label.textContent = t[2];
        svg.appendChild(label);
      });
      svg.appendChild(line);
      add(box, svg, facts([["first loss", n.loss[0]], ["last loss", n.loss[n.loss.length - 1]], ["steps", last]]));
      if (!n.cue) return;
      add(box, facts([["cue head: layer", n.cue.layer], ["head", n.cue.head], ["share", n.cue.share]]));
      add(box, el("p", {}, "The cue head forming: the share of held-out sentences in which 'bank' " +
                  "looks most at its cue, in this head, at each checkpoint the run kept:"));
      add(box, table(["step", "share"], n.cue.forming.map(function (f) {
        return add(el("tr"), add(el("td"), num(f.step)), add(el("td"), num(f.share, true)));
      }), "forming"));
    },
    parallel: function (n, box) {
      if (!n.timed) return;
      add(box, facts([["layer's q, k, v", n.shape], ["pairs", n.pairs], ["loop (ms)", n.loop_seconds * 1e3],
                      [n.backend + " (ms)", n.fused_seconds * 1e3], ["ratio", n.ratio],
                      ["largest difference", n.max_difference, "max_difference"]]));
      add(box, el("p", {"class": "note"}, "Times are measured once, when this page was made, on that machine."));
    }
  };

  var SHOW = {
    hide: function (r, box) {
      add(box, facts([["1 − cos of the change", r.change, "change"], ["distance", r.distance],
                      ["1 − cos of two words here", r.words_apart, "words_apart"],
                      ["1 − cos of the two senses of bank", r.senses_apart, "senses_apart"]]));
    },
    ablate: function (r, box) {
      add(box, facts([["mean 1 − cos of every token", r.change, "change"],
                      ["1 − cos of " + data.query, r.query_change, "query_change"],
                      ["1 − cos of two words here", r.words_apart, "words_apart"],
                      ["1 − cos of the two senses of bank", r.senses_apart, "senses_apart"]]));
    },
    swap: function (r, box) {
      add(box, el("p", {}, "Weights of " + data.query + " in “" + r.text + "”, layer " + data.layer +
                  ", head " + data.head + ":"));
      add(box, table(["#", "token", "weight", ""], weightRows(r.weights, r.tokens), "swap-weights"));
    },
    compare: function (r, box) {
      add(box, table(["depth", "cosine of " + data.query + " in the two sentences"], r.depths.map(function (d, i) {
        return add(el("tr", {"data-depth": i}), el("td", {"class": "tok"}, d), add(el("td"), num(r.cosine[i])));
      }), "compare"));
    }
  };

  function experiments(step, box) {
    if (!step.experiments.length) return;
    var part = el("section", {"class": "experiments", "aria-label": "Experiments"});
    add(box, add(part, el("h3", {}, "Try it on the model")));
    step.experiments.forEach(function (x) {
      var one = el("div", {"class": "experiment", "data-experiment": x.id});
      var button = el("button", {type: "button", "aria-expanded": "false"}, x.label);
      var result = el("div", {"class": "result", "aria-live": "polite"});
      add(part, add(one, button, result));
      button.addEventListener("click", function () {
        result.textContent = "";
        add(result, el("p", {}, x.says));
        if (x.result) SHOW[x.id](x.result, result);
        button.setAttribute("aria-expanded", "true");
      });
    });
  }

  function show(i, focus) {
    current = Math.max(0, Math.min(steps.length - 1, i));
    var step = steps[current], main = document.getElementById("step");
    main.textContent = "";
    add(main, el("h2", {}, (current + 1) + ". " + step.title), el("p", {"class": "says"}, step.says));
    DRAW[step.id](step.numbers, main);
    experiments(step, main);
    document.querySelectorAll("#steps button").forEach(function (b, n) {
      if (n === current) b.setAttribute("aria-current", "step"); else b.removeAttribute("aria-current");
    });
    var first = null;
    document.querySelectorAll("#diagram .box").forEach(function (g) {
      var lit = g.getAttribute("data-step") === step.id;
      g.classList.toggle("lit", lit);
      if (lit && !first) first = g;
    });
    var frame = document.getElementById("diagram");
    if (first && frame.scrollHeight > frame.clientHeight) {  // bring the lit boxes into view
      var top = first.getBoundingClientRect().top - frame.getBoundingClientRect().top;
      frame.scrollTop += top - 40;
    }
    if (first && frame.scrollWidth > frame.clientWidth) {  // the lit box in the middle
      var box = first.getBoundingClientRect(), view = frame.getBoundingClientRect();
      frame.scrollLeft += (box.left + box.width / 2) - (view.left + view.width / 2);
    }
    document.getElementById("where").textContent = "Step " + (current + 1) + " of " + steps.length;
    document.getElementById("prev").disabled = current === 0;
    document.getElementById("next").disabled = current === steps.length - 1;
    document.body.dataset.step = step.id;
    if (focus) main.focus();
  }

  function showBox(g) {
    var id = g.getAttribute("data-box"), found = data.boxes[id] || {}, box = null;
    (data.diagram ? data.diagram.boxes : []).forEach(function (b) { if (b.id === id) box = b; });
    var panel = document.getElementById("box-tensor");
    panel.textContent = "";
    panel.setAttribute("data-box", id);
    add(panel, el("h3", {}, box.label), facts([["shape", box.shape], ["what it computes", box.explain],
                                            ["shown", found.what || ""]]));
    if (found.values) add(panel, strip(box.label, found.values));
  }

  var nav = document.getElementById("steps");
  steps.forEach(function (s, n) {
    var b = el("button", {type: "button", "data-step": s.id}, (n + 1) + ". " + s.title);
    nav.appendChild(b);
    b.addEventListener("click", function () { show(n, true); });
  });
  document.getElementById("prev").addEventListener("click", function () { show(current - 1); });
  document.getElementById("next").addEventListener("click", function () { show(current + 1); });
  document.addEventListener("keydown", function (e) {
    var tag = (e.target && e.target.tagName) || "";
    if (tag === "INPUT" || tag === "TEXTAREA" || tag === "SELECT") return;
    if (e.key === "ArrowRight") { show(current + 1, true); e.preventDefault(); }
    if (e.key === "ArrowLeft") { show(current - 1, true); e.preventDefault(); }
  });
  document.querySelectorAll("#diagram .box").forEach(function (g) {
    g.addEventListener("click", function () { showBox(g); });
    g.addEventListener("keydown", function (e) {
      if (e.key === "Enter" || e.key === " ") { showBox(g); e.preventDefault(); }
    });
  });
  var start = 0;
  steps.forEach(function (s, n) { if (location.hash === "#" + s.id) start = n; });
  show(start);
  window.qkvReady = true;
})();
