"""qkv in a notebook: examples/attention.ipynb executed headless in a real ipykernel (nbclient),
its HTML outputs rendered in Debian's Chromium with every request but the page's own blocked
and counted, and the numbers they show compared with the library's; and each result's
`_repr_html_` self-contained and its `repr` short.
"""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path

import nbformat
import pytest
import torch
from nbclient import NotebookClient
from playwright.sync_api import sync_playwright

import qkv
from browser import ARTIFACTS, CHROMIUM, FLAGS, only_file
from qkv.inspect.census import heads
from qkv.inspect.probe import probe
from variant_models import TEXT as TINY_TEXT
from variant_models import decoder, tiny

NOTEBOOK = Path(__file__).parents[2] / "examples" / "attention.ipynb"
TEXT = "The bank on the side of the river"  # the notebook's text


@pytest.fixture(scope="module")
def executed(tmp_path_factory) -> nbformat.NotebookNode:
    """The notebook, run top to bottom in a fresh ipykernel that imports this qkv (its
    IPython profile in a temporary folder, not the user's home)."""
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    source = str(Path(qkv.__file__).parents[1])  # the kernel imports the qkv under test
    path = os.pathsep.join(p for p in (source, os.environ.get("PYTHONPATH")) if p)
    client = NotebookClient(notebook, timeout=120, kernel_name="python3",
                            resources={"metadata": {"path": str(NOTEBOOK.parent)}})  # fmt: skip
    home = tmp_path_factory.mktemp("ipython")
    client.execute(env={**os.environ, "PYTHONPATH": path, "IPYTHONDIR": str(home)})
    return notebook


def outputs(notebook, cell_id: str) -> list:
    (cell,) = [c for c in notebook.cells if c.get("id") == cell_id]
    return cell.outputs


def html_of(notebook, cell_id: str) -> str:
    (shown,) = [o for o in outputs(notebook, cell_id) if "text/html" in o.get("data", {})]
    return shown.data["text/html"]


def test_the_notebook_is_committed_without_outputs():
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(notebook)
    code = [c for c in notebook.cells if c.cell_type == "code"]
    assert code and all(c.outputs == [] and c.execution_count is None for c in code)


def test_the_notebook_runs_and_its_outputs_show_the_models_numbers(executed, minilm):
    errors = [o for c in executed.cells for o in c.get("outputs", []) if o.output_type == "error"]
    assert errors == []
    for cell_id in ("attentions", "trace", "why", "circuits", "probe", "hide"):
        (plain,) = [o.data["text/plain"] for o in outputs(executed, cell_id)]
        assert len(plain) < 200 and "\n" not in plain, plain
    seen = minilm.attentions(TEXT)
    step = qkv.trace(minilm, TEXT, "bank", "river", attentions=seen)
    hidden = qkv.hide(minilm, TEXT, "river", query="bank")
    why = qkv.why(minilm, "I sat by the river bank", "bank", "river", layer=2, head=11)
    senses = probe(minilm, "bank")
    found = qkv.circuits(minilm)
    other = minilm.attentions("The bank lent me money")  # a second page in the same document
    names = ("attentions", "trace", "why", "circuits", "probe", "hide")
    sections = {name: html_of(executed, name) for name in names}
    sections["second"] = other._repr_html_()
    document = "".join(f'<section data-cell="{n}">{h}</section>' for n, h in sections.items())
    page_file = ARTIFACTS / "notebook.html"
    ARTIFACTS.mkdir(exist_ok=True)
    page_file.write_text(f"<!doctype html><html><body>{document}</body></html>", "utf-8")

    bank, river = seen.tokens.index("bank"), seen.tokens.index("river")
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        try:
            context = browser.new_context(viewport={"width": 1200, "height": 900})
            outside = only_file(context, page_file)
            page = context.new_page()
            page.goto(page_file.as_uri())
            first, second = (
                page.locator(f"section[data-cell='{n}'] iframe").element_handle().content_frame()
                for n in ("attentions", "second")
            )
            for frame in (first, second):
                frame.wait_for_function("window.qkvReady === true", timeout=20_000)
            first.select_option("#layer", str(step.layer))
            first.select_option("#head", str(step.head))
            first.locator(f"#heatmap-table td[data-q='{bank}'][data-k='{river}']").click()
            first.wait_for_function(
                "document.getElementById('trace').dataset.pair === "
                f"'{step.layer},{step.head},{bank},{river}'"
            )
            words = (first.inner_text("#row-title"),
                     page.inner_text("section[data-cell='trace'] h4"))  # fmt: skip
            page_weight = json.loads(first.get_attribute("#t-weight", "data-values"))
            pair = f"#heatmap-table td[data-q='{bank}'][data-k='{river}']"
            cell = float(first.get_attribute(pair, "data-w"))
            second_pair = second.evaluate("document.getElementById('trace').dataset.pair")

            def value(cell_id: str, selector: str, name: str = "data-value") -> str | None:
                return page.get_attribute(f"section[data-cell='{cell_id}'] {selector}", name)

            last = len(senses.layers) - 1
            layer, head, effect = hidden.ranked()[0]
            grid_cell = f"td[data-row='{layer}'][data-col='{head}']"
            shown = {
                "trace": value("trace", "tr[data-step='weight'] td[data-value]"),
                "scalar": value("trace", "tr[data-step='scalar'] td[data-value]"),
                "total": value("hide", ".total"),
                "why": value("why", ".score"),
                "why total": value("why", ".total"),
                "why top": value("why", "table.terms tr[data-query-part] td[data-value]"),
                "singular": value("circuits", "table tr:nth-child(2) td[data-value]"),
                "separation": value("probe", f"tr[data-depth='{last}'] td:nth-child(3)"),
                "cell": value("hide", grid_cell),
                "title": value("hide", grid_cell, "title"),
            }
            page.screenshot(path=str(ARTIFACTS / "notebook.png"), full_page=True)
        finally:
            browser.close()

    assert outside == [], f"the notebook's outputs asked for {outside}"
    # the document says no encoding: the outputs' own characters are references, so they read
    # the same whatever the notebook page is decoded with
    assert "\u201cbank\u201d" in words[0] and "\u201cbank\u201d gets context" in words[1], words
    assert page_weight == pytest.approx(step.weight, abs=1e-6)
    assert cell == pytest.approx(float(seen.weights[step.layer, step.head, bank, river]), abs=1e-6)
    assert second_pair is None, "a click in one output changed another"
    assert float(shown["trace"]) == pytest.approx(step.weight, abs=1e-6)
    assert float(shown["scalar"]) == pytest.approx(step.attention_scalar, rel=1e-6)
    assert float(shown["total"]) == pytest.approx(hidden.total, abs=1e-6)
    assert float(shown["why"]) == pytest.approx(why.score, rel=1e-6)
    assert float(shown["why total"]) == pytest.approx(why.total, rel=1e-6)
    assert float(shown["why top"]) == pytest.approx(why.ranked(1)[0][2], rel=1e-6)
    assert float(shown["singular"]) == pytest.approx(float(found.qk_singular[0, 0]), rel=1e-5)
    assert float(shown["cell"]) == pytest.approx(effect, abs=1e-6)
    assert shown["title"].startswith(f"layer {layer}, head {head}: change ")
    assert float(shown["separation"]) == pytest.approx(senses.separation[-1], abs=1e-6)


# ---------------------------------------------------------------------------- each result


@pytest.fixture(scope="module")
def results(minilm) -> dict:
    """One of each result a user holds, from MiniLM and a tiny random decoder."""
    small = tiny(decoder())
    seen = minilm.attentions(TEXT)
    return {
        "Attentions": seen,
        "Attentions (some heads)": minilm.attentions(TEXT, layers=[1, 4], heads=[3, 7]),
        "Attentions (decoder)": small.attentions(TINY_TEXT),
        "Trace": qkv.trace(minilm, TEXT, "bank", "river", attentions=seen),
        "Probe": probe(minilm, "bank"),
        "Hidden": qkv.hide(minilm, TEXT, "river", query="bank"),
        "Hidden (decoder)": qkv.hide(small, TINY_TEXT, "bank", query="river"),
        "Ablated": qkv.ablate(minilm, TEXT, [(0, 1), (4, 7)]),
        "Patched": qkv.patch(
            small, "the bank of the river", "the river of the bank", "diff: river, bank"
        ),
        "Lens": qkv.lens(small, TINY_TEXT),
        "Why": qkv.why(minilm, TEXT, "bank", "river", layer=2, checks=1),
        "Why (decoder)": qkv.why(small, TINY_TEXT, "deep", "bank", checks=1),
        "Census": heads(minilm, prompts=["The bank of the river."], rows=1, length=8),
    }


NAMES = ["Attentions", "Attentions (some heads)", "Attentions (decoder)", "Trace", "Probe",
         "Hidden", "Hidden (decoder)", "Ablated", "Patched", "Lens", "Why", "Why (decoder)",
         "Census"]  # fmt: skip


@pytest.mark.parametrize("name", NAMES)
def test_each_result_shows_itself_self_contained_with_a_short_repr(results, name):
    found = results[name]
    shown = found._repr_html_()
    assert shown.isascii(), "characters beyond ASCII depend on the page's encoding"
    assert "http://" not in shown and "https://" not in shown
    inner = re.search(r'srcdoc="([^"]*)"', shown)
    pages = [shown] + ([_unescape(inner.group(1))] if inner else [])
    for text in pages:
        assert "http://" not in text and "https://" not in text
        sources = re.findall(r"""\b(?:src|href)\s*=\s*["']?([^"'\s>]*)""", text)
        assert all(s.startswith("data:") for s in sources), sources
        assert "<link" not in text and "@import" not in text
    assert ' id="' not in shown, "an id in one output could clash with another's"
    if getattr(found, "next", None) is not None:  # a decoder's next tokens, before and after
        assert f"{found.next.top_change:+.4f}" in shown
    plain = repr(found)
    assert len(plain) < 200 and "\n" not in plain and "tensor(" not in plain, plain
    assert plain.startswith(type(found).__name__ + "(")


def test_the_page_of_some_heads_says_which_they_are_and_traces_them(results):
    some = results["Attentions (some heads)"]
    page = _unescape(re.search(r'srcdoc="([^"]*)"', some._repr_html_()).group(1))
    data = json.loads(re.search(r'id="qkv-data">(.*?)</script>', page, re.S).group(1))
    assert data["extra"]["layers shown"] == [1, 4] and data["extra"]["heads shown"] == [3, 7]
    assert data["num_layers"] == 2 and data["num_heads"] == 2
    assert data["vectors"] is not None and len(data["vectors"]["query"][0]) == 2


def test_the_grids_hold_every_number_exactly(results):
    census = results["Census"]
    shown = census._repr_html_()
    grid = census.scores("previous_token")
    for layer, head in [(0, 0), (3, 5), (5, 11)]:
        value = re.search(
            rf'<table class="grid" data-name="previous token">.*?<td data-row="{layer}" '
            rf'data-col="{head}" data-value="([^"]+)"',
            shown,
            re.S,
        ).group(1)
        assert float(value) == float(grid[layer, head])
    patched = results["Patched"]
    restored = patched.restored(patched.heads)
    cells = re.findall(r'<td data-row="(\d+)" data-col="(\d+)" data-value="([^"]+)"',
                       patched._repr_html_())  # fmt: skip
    L, H = restored.shape
    for row, col, value in cells[: L * H]:  # the heads' grid comes first
        want = float(restored[int(row), int(col)])
        assert math.isnan(want) or float(value) == want


def test_a_result_whose_table_was_not_asked_shows_no_grid(minilm):
    found = qkv.hide(minilm, TEXT, "river", query="bank", table=False)
    assert torch.isnan(found.effect).all()
    assert '<table class="grid"' not in found._repr_html_()
    assert f"{found.total:.4f}" in repr(found)


def _unescape(text: str) -> str:
    import html

    return html.unescape(text)


def test_a_cross_attention_page_too_large_shows_its_strongest_head_as_a_table(
    tmp_path, monkeypatch
):  # the page itself: tests/viz/test_cross_page.py
    from tokenizers import Tokenizer as Backend
    from tokenizers import models, pre_tokenizers

    import qkv.viz.notebook as notebook
    from qkv.io.hf_folder import load_folder
    from qkv.io.tokenizer import Tokenizer
    from tiny_models import save_tiny

    save_tiny("bart", tmp_path)
    model, family, config, hf_config = load_folder(tmp_path, torch.float32, None)
    words = ["[UNK]", "the", "bank", "on", "side", "of", "river", "la", "rive", "banque"]
    backend = Backend(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    bart = qkv.Pretrained(model, Tokenizer(backend), config, family=family,
                          hf_config=hf_config, source="tiny-bart")  # fmt: skip
    seen = bart.attentions("the bank of the river", target="la banque")
    assert "<iframe" in seen._repr_html_()
    monkeypatch.setattr(notebook, "NOTEBOOK_PAGE_BYTES", 10_000)
    shown = seen._repr_html_()
    assert shown.isascii() and "<iframe" not in shown and "src=" not in shown
    assert "more than a notebook output carries" in shown
    flat = seen.weights.flatten(2).max(-1).values  # (L, H)
    layer, head = divmod(int(flat.argmax()), flat.shape[1])
    assert f"Layer {layer}, head {head}" in shown
    cells = re.findall(r'<td data-row="(\d+)" data-col="(\d+)" data-value="([^"]+)"', shown)
    Tq, Tk = seen.weights.shape[-2:]
    assert len(cells) == Tq * Tk
    for row, col, value in cells:
        assert float(value) == float(seen.weights[layer, head, int(row), int(col)])
    assert repr(seen).startswith("Attentions(cross-attention, 3 target x 5 source tokens")


def test_a_page_too_large_for_an_output_is_drawn_as_one_inline_png(results, monkeypatch):
    import qkv.viz.notebook as notebook

    monkeypatch.setattr(notebook, "NOTEBOOK_PAGE_BYTES", 10_000)
    shown = results["Attentions"]._repr_html_()
    assert "<iframe" not in shown and "more than a notebook output carries" in shown
    (picture,) = re.findall(r'src="([^"]+)"', shown)
    assert picture.startswith("data:image/png;base64,") and len(picture) > 1000
