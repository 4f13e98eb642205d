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
from tokenizers import AddedToken, models, pre_tokenizers
from tokenizers import Tokenizer as Backend

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
ATLAS_EXAMPLE = "#L1H0-0"  # the atlas example's page shows the example its address names
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
    from qkv.io.hf_folder import load_folder
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
        "Trace (cross)": qkv.trace(
            bart, source, first, second, target=f"{first} the river"
        )._repr_html_(),
        "Hidden": qkv.hide(model, TEXT, first, query=second)._repr_html_(),
        "Ablated": qkv.ablate(model, TEXT, [(0, 1), (1, 0)])._repr_html_(),
        # the same text clean and corrupted: nothing to restore, every cell "not computed"
        "Patched": qkv.patch(model, TEXT, TEXT, f"diff: {first}, {second}")._repr_html_(),
        "Lens": qkv.lens(model, TEXT)._repr_html_(),
        "Why": qkv.why(model, TEXT, second, first)._repr_html_(),
        "Why (cross)": qkv.why(
            bart, source, first, second, target=f"{first} the river"
        )._repr_html_(),
        "Census": heads(model, prompts=[TEXT], rows=1, length=8)._repr_html_(),
        "Probe": probe(
            model, first, senses, [second, second, HOSTILE[2], HOSTILE[2]], cues=[second] * 4
        )._repr_html_(),
        "Generation": generated._repr_html_(),
        "Generation (summaries)": summaries._repr_html_(),
    }


def page_files(model, bart, folder: Path) -> dict[str, Path]:
    """Every page qkv writes, and a page of each notebook view, with the hostile tokens."""
    from qkv.viz import page_trace, write_html
    from qkv.viz.atlas import atlas
    from qkv.viz.generation import write_generation_page
    from qkv.viz.long import summary_page

    seen = model.attentions(TEXT)
    vectors, scores = page_trace(seen.records)
    common = dict(title=f"{HOSTILE[2]} {HOSTILE[1]}", text=TEXT, extra={HOSTILE[1]: HOSTILE[2]})
    cross = bart.attentions(TEXT, target=f"{HOSTILE[0]} the river")
    generated = model.generate(TEXT, 3, record="all")
    # write_report's index.html is this page too (render_page), beside its PNGs
    files = {
        "report page": write_html(
            folder / "page.html", seen.weights, seen.tokens, vectors=vectors, scores=scores,
            causal=True, scale=seen.scale, **common,
        ),
        "cross-attention page": write_html(
            folder / "cross.html", cross.weights, cross.tokens, query_tokens=cross.query_tokens,
            **common,
        ),
        "generation page": write_generation_page(folder / "generation.html", generated,
                                                 title=HOSTILE[2]),
        "long-text page": summary_page(summarize(seen), folder / "long.html", title=HOSTILE[2],
                                       text=TEXT),
    }  # fmt: skip
    corpus = folder / "corpus.txt"  # the atlas's page and its examples' page, of these tokens
    corpus.write_text(f"{TEXT}\n", encoding="utf-8")
    atlas(model, corpus, folder / "atlas", window=32, top=2)
    files["atlas page"] = folder / "atlas" / "index.html"
    files["atlas example"] = folder / "atlas" / "examples" / "example.html"
    for name, shown in notebook_views(model, bart).items():
        path = folder / f"notebook-{name.replace(' ', '-').strip('()')}.html"
        path.write_text(f"<!doctype html><html><head><title>qkv</title></head><body>{shown}"
                        "</body></html>", encoding="ascii")  # fmt: skip
        files[f"notebook {name}"] = path
    return files


# In every frame: what the pages' own code never makes. The notebook's iframe grows itself
# with an onload of its own (class qkv-page); nothing else in qkv has an inline handler.
FOUND = """() => {
  const found = [], forms = "#text-form, #compare-form, #gen-form";  // the server's page's own
  for (const element of document.querySelectorAll("*")) {
    for (const { name } of element.attributes) {
      const own = name === "onload" && element.matches("iframe.qkv-page");
      if ((name.startsWith("on") && !own) || !/^[a-z][a-z0-9-]*$/.test(name)) {
        found.push(`${element.tagName} has the attribute ${name}`);
      }
    }
    const tag = element.tagName.toLowerCase(), source = element.getAttribute("src") || "";
    if (tag === "img" && !source.startsWith("data:image/png;base64,")) {
      found.push(`an img from ${source}`);
    }
    if (["object", "embed", "base", "frame", "form"].includes(tag) && !element.matches(forms)) {
      found.push(`a ${tag} element`);
    }
    const code = tag === "script" && element.type !== "application/json";
    if (code && /alert\\(|pwned/.test(element.textContent)) found.push("a script of a token");
    if (tag === "svg" && element.id !== "headview") found.push("an svg element");
  }
  if (document.title.startsWith("pwned")) found.push("a token set document.title");
  const text = document.body ? document.body.innerText : "";
  for (const twice of ["&amp;amp;", "&amp;rarr;", "&lt;", "&gt;", "&quot;", "&#", "\\\\$"]) {
    if (text.includes(twice)) found.push(`the text shows ${twice}: escaped twice`);
  }
  return found;
}"""

# Every element hovered, focused and clicked (but those matching `unclicked`), every option
# of every select chosen: inline handlers and the page's own handlers run on these events.
EVERYTHING = """(unclicked) => {
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
    const skip = unclicked && element.matches(unclicked) ? ["click", "keydown"] : [];
    for (const kind of events.filter((kind) => !skip.includes(kind))) {
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


class Watched:
    """A page whose dialogs, requests beyond `allowed` (and loopback) and requests still
    open are counted."""

    def __init__(self, context, allowed: set[str]):
        self.dialogs, self.outside, self.open = [], [], 0

        def route(route):
            url = route.request.url
            if url in allowed or url.startswith(("http://127.0.0.1:", "data:")):
                return route.continue_()
            self.outside.append(url)
            return route.abort()

        def count(change: int):
            def counted(_):
                self.open += change

            return counted

        context.route("**/*", route)
        self.page = page = context.new_page()
        page.on("dialog", lambda dialog: (self.dialogs.append(dialog.message), dialog.dismiss()))
        page.on("request", count(1))
        page.on("requestfinished", count(-1))
        page.on("requestfailed", count(-1))

    def quiet(self) -> None:
        """Wait until no request is open and the page's redraws have run."""
        for _ in range(600):
            self.page.wait_for_timeout(50)
            if self.open == 0:
                return
        raise AssertionError(f"{self.open} requests still open after 30 s")

    def everything(self, name: str, passes: int = 2, unclicked: str = "") -> list[str]:
        """Hover and click everything in every frame (twice: the first clicks draw more, a
        trace panel, a row) and return what a token did there."""
        for _ in range(passes):
            for frame in self.page.frames:
                assert frame.evaluate(EVERYTHING, unclicked) > 0
            self.quiet()
        return self.found(name)

    def found(self, name: str) -> list[str]:
        return [f"{name}: {p}" for frame in self.page.frames for p in frame.evaluate(FOUND)]


def check_files(watched: Watched, files: dict[str, Path], tokens: list[str]) -> list[str]:
    page, problems = watched.page, []
    for name, path in files.items():
        page.goto(path.as_uri() + (ATLAS_EXAMPLE if name == "atlas example" else ""))
        for frame in page.frames:
            if frame.evaluate("Boolean(document.querySelector('script:not([type])'))"):
                frame.wait_for_function("window.qkvReady === true", timeout=20_000)
        problems += watched.everything(name)
        if name == "report page":  # each token shown as its own text, nothing more or less
            shown = page.eval_on_selector_all("button.token", "b => b.map(e => e.textContent)")
            assert shown == [json.dumps(t, ensure_ascii=False) if not t.strip() else t
                             for t in tokens]  # fmt: skip
            drawn = "e => e instanceof SVGTextElement && e.getBBox().width > 0"  # made as SVG
            assert page.eval_on_selector(".hv-query[data-index='2']", drawn)
            title = page.get_attribute("#heatmap-table td[data-q='3'][data-k='2']", "title")
            assert title.startswith(f"{HOSTILE[1]} \u2192 {HOSTILE[0]}: ")
        if name == "atlas example":  # the example its address names, its tokens as text
            assert page.inner_text("h1").startswith("L1 H0 example 1:")
            shown = page.eval_on_selector_all("button.token", "b => b.map(e => e.textContent)")
            kept = {json.dumps(t, ensure_ascii=False) for t in tokens} | set(tokens)
            assert shown and {t.removeprefix("… ") for t in shown} <= kept
            assert set(HOSTILE) & {t.removeprefix("… ") for t in shown}
        if name == "notebook Patched":  # the cell of issue 32, hovered with the mouse
            page.hover("td.none >> nth=0")
            assert page.get_attribute("td.none >> nth=0", "title").endswith(": not computed")
        shown = page.inner_text("i") if name == "notebook Trace (cross)" else "\u2192"
        if "\u2192" not in shown or "&rarr;" in page.content():  # not escaped twice
            problems.append(f"{name}: the arrow is not shown as one: {shown}")
    return problems


def check_server(watched: Watched, model) -> list[str]:
    """The server's page (its script builds the page from the API's JSON) over the hostile
    text: the short views, a trace and a hide of hostile words, the next tokens, a
    generation, then the long view of a text over max_tokens."""
    from qkv.serve import Limits, create_app
    from qkv.serve.server import running

    page, problems = watched.page, []
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
        drawn = "e => e instanceof SVGTextElement && e.getBBox().width > 0"  # made as SVG
        assert page.eval_on_selector(".hv-key[data-index='2']", drawn)
        for query, key in [(3, 2), (4, 3), (12, 5), (16, 0)]:  # hostile words traced, hidden
            page.click(f"#heatmap-table td[data-q='{query}'][data-k='{key}']")
            pair = json.dumps(f",{query},{key}")
            page.wait_for_function(f"(document.getElementById('trace').dataset.pair || '')"
                                   f".endsWith({pair})")  # fmt: skip
            page.wait_for_function("document.getElementById('hide').dataset.pair"
                                   " || document.getElementById('hide-error')")  # fmt: skip
            problems += watched.found(f"served page, pair {pair}")
        page.click("#heatmap-table td[data-q='13'][data-k='12']")  # a line separator: no word
        page.wait_for_function("document.querySelector('#trace h2').textContent"
                               ".endsWith('is not a word')")  # fmt: skip
        # every cell hovered; clicked, each would trace and hide a pair: the four above do
        problems += watched.everything("served page", 1, "#heatmap-table td")
        page.fill("#gen-max", "3")
        page.click("#gen-go")
        page.wait_for_function("document.getElementById('gen-status').textContent"
                               ".startsWith('Done')")  # fmt: skip
        long_text = " ".join([TEXT] * 3)  # over max_tokens: the long view
        page.fill("#text", long_text)
        page.press("#text", "Enter")
        page.wait_for_function(f"document.body.dataset.long === '{len(long_text)}'",
                               timeout=60_000)  # fmt: skip
        box = page.locator("#long-heatmap").bounding_box()
        for x, y in [(0.2, 0.3), (0.8, 0.9), (0.5, 0.5)]:
            page.mouse.move(box["x"] + box["width"] * x, box["y"] + box["height"] * y)
        page.mouse.click(box["x"] + box["width"] * 0.5, box["y"] + box["height"] * 0.5)
        page.wait_for_selector("#long-region")
        region = page.locator("#long-region").bounding_box()
        page.mouse.move(region["x"] + region["width"] / 2, region["y"] + region["height"] / 2)
        assert page.inner_text("#long-region-hover") and page.inner_text("#long-hover")
        problems += watched.everything("served long view", 1)
    return problems


def test_no_token_runs_script_or_adds_markup_in_any_page(model, bart, tmp_path, browser):
    files = page_files(model, bart, tmp_path)
    context = browser.new_context(viewport={"width": 1200, "height": 900})
    data = {path.as_uri() for path in (tmp_path / "atlas" / "examples").glob("*.js")}
    watched = Watched(context, {path.as_uri() for path in files.values()} | data)
    problems = check_files(watched, files, model.encode(TEXT).tokens)
    problems += check_server(watched, model)
    context.close()
    assert problems == [], "\n".join(problems)
    assert watched.dialogs == [], f"a token opened a dialog: {watched.dialogs}"
    assert watched.outside == [], f"a page asked for {watched.outside}"


def test_script_json_keeps_every_value_and_leaves_no_markup():
    import re

    from qkv.viz import escape

    value = {"tokens": HOSTILE, "paragraph": "\u2029"}
    safe = escape.script_json(json.dumps(value, ensure_ascii=False))
    assert json.loads(safe) == value
    assert not re.search("[<>&\u2028\u2029]", safe)


SCRIPTS = [
    *sorted((Path(qkv.__file__).parent / "serve" / "static").glob("*.js")),
    Path(qkv.__file__).parent / "viz" / "report.html",
    Path(qkv.__file__).parent / "viz" / "atlas_examples.py",  # the examples' page's scripts
    Path(qkv.__file__).parent / "viz" / "atlas_page.py",
    Path(qkv.__file__).parent / "viz" / "generation.py",  # its page's script is in TEMPLATE
]


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda path: path.name)
def test_the_pages_scripts_put_text_in_as_text(script):
    """What the pages' scripts hand to innerHTML holds no token, word, name or message: those
    go in by textContent or setAttribute (views.js's make and texts), so no escaping function
    in JavaScript has to be right for a page to be safe."""
    import re

    source = script.read_text(encoding="utf-8")
    assert not re.search(r"\besc\(", source), "an escaping function in the page's script"
    text = re.compile(r"shown\(|short\(|show\(|token|message|model|name|\.text\b|detail")
    for assigned in re.finditer(r"\.innerHTML\s*\+?=(.*?);\s*$", source, re.S | re.M):
        for expression in re.findall(r"\$\{([^}]*)\}", assigned.group(1)):
            assert not text.search(expression), f"innerHTML gets {expression!r} in {script.name}"
