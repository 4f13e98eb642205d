"""No script from a token: every page and notebook view of qkv, made from a crafted tokenizer
whose tokens are markup, opened in Debian's Chromium; every element hovered and clicked.

The tokenizer is a real `tokenizers` one (a word-level model and added tokens, so that a token
may hold quotes, angle brackets, a line separator) on a tiny random qkv decoder, and on a tiny
BART for cross-attention. Each hostile token, parsed as markup, would run script that changes
`document.title` or opens a dialog, or would add an element or an attribute the page's own code
does not make. The test fails on any of these in any frame, on any request beyond the pages'
own files and the server under test, and on a token shown other than as its own text (an
entity escaped twice reads `&amp;amp;`). One browser and one context load every page in turn.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from tokenizers import AddedToken
from tokenizers import Tokenizer as Backend
from tokenizers import models, pre_tokenizers

import qkv
from browser import CHROMIUM, FLAGS
from qkv.inspect.census import heads
from qkv.inspect.probe import probe
from qkv.inspect.summaries import summarize
from qkv.io.families import FAMILIES
from qkv.io.tokenizer import Tokenizer
from qkv.models import Decoder
from variant_models import decoder

WORDS = ["[UNK]", "the", "bank", "of", "river", "was", "wide", "and", "deep"]
ATTRIBUTE = "x\"onmouseover=\"document.title='pwned';//"  # breaks out of a "..." attribute
HOSTILE = [
    ATTRIBUTE,
    '"><img src=x onerror=alert(1)>',  # breaks out of an attribute and makes an element
    "</script><script>alert(1)</script>",  # ends a script's data and starts another script
    "x'onmouseover='document.title=`pwned`'",  # breaks out of a '...' attribute
    "<svg onload=alert(1)>",
    "&amp;",  # shown twice-escaped, it reads &amp;amp;
    "&rarr;",
    "{{7*7}}",  # a template language would show 49
    "${alert(1)}",
    "<!--",
    "'",
    "\u2028",  # a line separator: ends a line in JavaScript before ES2019
]
TEXT = "the bank " + " ".join(HOSTILE) + " of the river"
PAYLOAD_MARKS = ("alert(", "pwned", "onerror", "onmouseover", "onload=")


def hostile_tokenizer() -> Tokenizer:
    backend = Backend(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.add_tokens([AddedToken(token, normalized=False) for token in HOSTILE])
    return Tokenizer(backend)


@pytest.fixture(scope="module")
def model() -> qkv.Pretrained:
    """A tiny random decoder whose vocabulary holds the hostile tokens."""
    tokenizer = hostile_tokenizer()
    config = dataclasses.replace(decoder(), vocab_size=len(tokenizer))
    torch.manual_seed(0)
    stack = Decoder(config).eval()
    return qkv.Pretrained(stack, tokenizer, config, family=FAMILIES[0], hf_config={},
                          source="tiny")  # fmt: skip


@pytest.fixture(scope="module")
def bart(tmp_path_factory) -> qkv.Pretrained:
    """A tiny random BART (transformers builds it) with the hostile tokenizer."""
    from qkv.io.hf import load_folder
    from tiny_models import save_tiny

    folder = tmp_path_factory.mktemp("hostile-bart")
    save_tiny("bart", folder)
    stack, family, config, hf_config = load_folder(folder, torch.float32, None)
    return qkv.Pretrained(stack, hostile_tokenizer(), config, family=family,
                          hf_config=hf_config, source="tiny-bart")  # fmt: skip


def test_the_tokenizer_keeps_every_hostile_token_whole(model):
    encoded = model.tokenizer.encode(TEXT)
    assert encoded.tokens == ["the", "bank", *HOSTILE, "of", "the", "river"]


def notebook_views(model, bart) -> dict[str, str]:
    """Every result's `_repr_html_`, each made with the hostile tokens."""
    first, second = HOSTILE[0], HOSTILE[1]
    generated = model.generate(TEXT, 4, record="all")
    P = generated.prompt_length
    # the generated tokens' own text: hostile too (a random model writes what it writes)
    pieces = [*generated.pieces[:P], *HOSTILE[: generated.generated]]
    generated = dataclasses.replace(generated, pieces=pieces, tokens=pieces)
    summaries = model.generate(TEXT, 3, record="summaries")
    summaries = dataclasses.replace(summaries, pieces=[*summaries.pieces[:P], *HOSTILE[3:6]])
    senses = [TEXT, TEXT + " deep", TEXT + " wide", TEXT + " and"]
    source = f"the bank {first} {second} of the river"  # short: the trace shows it whole
    return {
        "Attentions": model.attentions(TEXT)._repr_html_(),
        "Attentions (cross)": bart.attentions(source, target=f"{first} the river")._repr_html_(),
        "Trace": qkv.trace(model, TEXT, second, first)._repr_html_(),
        "Trace (cross)": qkv.trace(bart, source, first, second,
                                   target=f"{first} the river")._repr_html_(),  # fmt: skip
        "Hidden": qkv.hide(model, TEXT, first, query=second)._repr_html_(),
        "Ablated": qkv.ablate(model, TEXT, [(0, 1), (1, 0)])._repr_html_(),
        # the same text clean and corrupted: nothing to restore, every cell "not computed"
        "Patched": qkv.patch(model, TEXT, TEXT, f"diff: {first}, {second}")._repr_html_(),
        "Lens": qkv.lens(model, TEXT)._repr_html_(),
        "Census": heads(model, prompts=[TEXT], rows=1, length=8)._repr_html_(),
        "Probe": probe(model, first, senses, [second, second, HOSTILE[2], HOSTILE[2]],
                       cues=[second] * 4)._repr_html_(),  # fmt: skip
        "Generation": generated._repr_html_(),
        "Generation (summaries)": summaries._repr_html_(),
    }


def page_files(model, bart, folder: Path) -> dict[str, Path]:
    """Every page qkv writes, with the hostile tokens in it."""
    from qkv.viz import page_trace, write_html, write_report
    from qkv.viz.generation import write_generation_page
    from qkv.viz.long import summary_page

    seen = model.attentions(TEXT)
    vectors, scores = page_trace(seen.records)
    common = dict(title=f"{HOSTILE[2]} {HOSTILE[1]}", text=TEXT, extra={HOSTILE[1]: HOSTILE[2]})
    files = {
        "report page": write_html(folder / "page.html", seen.weights, seen.tokens,
                                  vectors=vectors, scores=scores, causal=True,
                                  scale=seen.scale, **common),  # fmt: skip
        "report folder": write_report(folder / "report", seen.weights, seen.tokens, **common)
        / "index.html",
        "generation page": write_generation_page(
            folder / "generation.html", model.generate(TEXT, 3, record="all"), title=HOSTILE[2]
        ),
        "long-text page": summary_page(summarize(seen), folder / "long.html", title=HOSTILE[2],
                                       text=TEXT),  # fmt: skip
    }
    cross = bart.attentions(TEXT, target=f"{HOSTILE[0]} the river")
    files["cross-attention page"] = write_html(
        folder / "cross.html", cross.weights, cross.tokens, query_tokens=cross.query_tokens,
        **common,
    )  # fmt: skip
    for name, html in notebook_views(model, bart).items():
        path = folder / f"notebook-{name.replace(' ', '-').strip('()')}.html"
        path.write_text(f"<!doctype html><html><head><title>qkv</title></head><body>{html}"
                        "</body></html>", encoding="ascii")  # fmt: skip
        files[f"notebook {name}"] = path
    return files


# In every frame: what a page's own code never makes. The notebook's iframe grows itself with
# an onload of its own (class qkv-page); nothing else in qkv has an inline handler.
FOUND = """() => {
  const found = [];
  for (const element of document.querySelectorAll("*")) {
    for (const attribute of element.attributes) {
      const name = attribute.name;
      const own = name === "onload" && element.matches("iframe.qkv-page");
      if ((name.startsWith("on") && !own) || !/^[a-z][a-z0-9-]*$/.test(name)) {
        found.push(`${element.tagName} has the attribute ${name}`);
      }
    }
    const tag = element.tagName.toLowerCase();
    if (tag === "img" && !element.getAttribute("src").startsWith("data:image/png;base64,")) {
      found.push(`an img from ${element.getAttribute("src")}`);
    }
    if (["object", "embed", "base", "form", "frame"].includes(tag) && !element.closest("#text-form, #compare-form, #gen-form")) {
      found.push(`a ${tag} element`);
    }
    if (tag === "script" && element.type !== "application/json" && /alert\\(|pwned/.test(element.textContent)) {
      found.push("a script with the payload");
    }
    if (tag === "svg" && element.id !== "headview") found.push("an svg element");
  }
  if (document.title.startsWith("pwned")) found.push("a token set document.title");
  const text = document.body ? document.body.innerText : "";
  for (const twice of ["&amp;amp;", "&amp;rarr;", "&lt;", "&gt;", "&quot;", "&#"]) {
    if (text.includes(twice)) found.push(`the text shows ${twice}: escaped twice`);
  }
  return found;
}"""

# Every element hovered, focused and clicked, every option chosen: inline handlers and the
# page's own handlers both run on these events.
EVERYTHING = """() => {
  const events = ["mouseover", "mouseenter", "mousemove", "mousedown", "mouseup", "click",
                  "mouseout", "mouseleave", "dblclick", "focus", "keydown"];
  let count = 0;
  for (const select of document.querySelectorAll("select:not(form select)")) {
    for (const option of Array.from(select.options)) {
      select.value = option.value;
      select.dispatchEvent(new Event("change", { bubbles: true }));
    }
  }
  for (const element of Array.from(document.querySelectorAll("body *"))) {
    if (element.closest("form, a[href]")) continue;  // another text, another page
    for (const kind of events) {
      const event = kind === "focus" ? new FocusEvent(kind)
        : kind === "keydown" ? new KeyboardEvent(kind, { key: "Enter", bubbles: true })
        : new MouseEvent(kind, { bubbles: true, cancelable: true, view: window });
      element.dispatchEvent(event);
    }
    count++;
  }
  return count;
}"""


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        try:
            yield chromium
        finally:
            chromium.close()


def check_every_frame(page, name: str) -> list[str]:
    """Hover and click everything in every frame, twice (the first clicks draw more), and
    return what the payload did."""
    problems = []
    for _ in range(2):
        for frame in page.frames:
            assert frame.evaluate(EVERYTHING) > 0
        page.wait_for_timeout(150)  # the pages' own redraws (they decode weights) settle
    for frame in page.frames:
        problems += [f"{name} ({frame.url[:40]}): {p}" for p in frame.evaluate(FOUND)]
    return problems


def test_no_token_runs_script_or_adds_markup_in_any_page(model, bart, tmp_path, browser):
    from qkv.serve import Limits, create_app
    from qkv.serve.server import running

    files = page_files(model, bart, tmp_path)
    dialogs, outside = [], []
    context = browser.new_context(viewport={"width": 1200, "height": 900})
    allowed = {path.as_uri() for path in files.values()}

    def route(route):
        url = route.request.url
        if url in allowed or url.startswith(("http://127.0.0.1:", "data:")):
            return route.continue_()
        outside.append(url)
        return route.abort()

    context.route("**/*", route)
    page = context.new_page()
    page.on("dialog", lambda dialog: (dialogs.append(dialog.message), dialog.dismiss()))
    problems = []
    for name, path in files.items():
        page.goto(path.as_uri())
        for frame in page.frames:
            if frame.evaluate("Boolean(document.querySelector('script:not([type])'))"):
                frame.wait_for_function("window.qkvReady === true", timeout=20_000)
        problems += check_every_frame(page, name)
        if name == "report page":  # each token is shown as its own text, nothing more
            shown = page.eval_on_selector_all("button.token", "b => b.map(e => e.textContent)")
            assert shown == [json.dumps(t, ensure_ascii=False) if not t.strip() else t
                             for t in model.tokenizer.encode(TEXT).tokens]  # fmt: skip
            cell = page.locator("#heatmap-table td[data-q='3'][data-k='2']")
            assert cell.get_attribute("title").startswith(f"{HOSTILE[1]} \u2192 {HOSTILE[0]}: ")
        if name == "notebook Patched":  # the cell of the report in issue 32, hovered for real
            page.hover("td.none >> nth=0")
            assert page.get_attribute("td.none >> nth=0", "title").endswith(": not computed")
        if name == "notebook Trace (cross)":
            if "\u2192" not in page.inner_text("i") or "&rarr;" in page.content():
                problems.append(f"{name}: the arrow is not shown as one: {page.inner_text('i')}")

    app = create_app({"tiny": model}, Limits(max_tokens=len(model.encode(TEXT).ids) + 2))
    with running(app) as url:
        page.goto(url + "/")
        page.wait_for_function("window.qkvReady === true", timeout=20_000)
        page.fill("#text", TEXT)
        page.press("#text", "Enter")
        page.wait_for_function(f"document.body.dataset.shown === {json.dumps(TEXT)}")
        page.wait_for_function("document.querySelector('#census-top') !== null")
        page.wait_for_function("document.querySelectorAll('#next li').length > 0")
        tokens = page.eval_on_selector_all("#tokens .token", "b => b.map(e => e.textContent)")
        assert tokens[2:4] == [ATTRIBUTE, HOSTILE[1]]
        for query, key in [(3, 2), (4, 3), (12, 5), (16, 0)]:  # hostile words traced, hidden
            page.click(f"#heatmap-table td[data-q='{query}'][data-k='{key}']")
            pair = f",{query},{key}"
            page.wait_for_function(f"(document.getElementById('trace').dataset.pair || '')"
                                   f".endsWith({json.dumps(pair)})")  # fmt: skip
            page.wait_for_function("document.getElementById('hide').dataset.pair !== undefined"
                                   " || document.getElementById('hide-error') !== null")  # fmt: skip
            problems += [f"served page, pair {pair}: {p}" for p in page.evaluate(FOUND)]
        page.click("#heatmap-table td[data-q='13'][data-k='12']")  # a line separator: no word
        page.wait_for_function("document.querySelector('#trace h2').textContent"
                               ".endsWith('is not a word')")  # fmt: skip
        problems += check_every_frame(page, "served page")
        page.select_option("#layer", "0")
        page.fill("#gen-max", "3")
        page.click("#gen-go")
        page.wait_for_function("document.getElementById('gen-status').textContent.startsWith"
                               "('Done')")  # fmt: skip
        # the long view: the same text three times is over max_tokens
        long_text = " ".join([TEXT] * 3)
        page.fill("#text", long_text)
        page.press("#text", "Enter")
        page.wait_for_function(f"document.body.dataset.long === '{len(long_text)}'")
        box = page.locator("#long-heatmap").bounding_box()
        for x, y in [(0.2, 0.3), (0.5, 0.5), (0.8, 0.9)]:
            page.mouse.move(box["x"] + box["width"] * x, box["y"] + box["height"] * y)
        page.mouse.click(box["x"] + box["width"] * 0.5, box["y"] + box["height"] * 0.5)
        page.wait_for_selector("#long-region")
        region = page.locator("#long-region").bounding_box()
        page.mouse.move(region["x"] + region["width"] / 2, region["y"] + region["height"] / 2)
        assert page.inner_text("#long-region-hover") and page.inner_text("#long-hover")
        problems += check_every_frame(page, "served long view")
    context.close()
    assert problems == [], "\n".join(problems)
    assert dialogs == [], f"a token opened a dialog: {dialogs}"
    assert outside == [], f"a page asked for {outside}"
