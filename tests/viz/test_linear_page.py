"""The page, `qkv show` and the notebook on a model with linear layers: a linear layer's signed
effective weights are drawn as each row's shares of |w| and the page says so, its pairs are not
redone from q and k (refused by name), and the notebook's trace says no softmax happened."""

from __future__ import annotations

import json
import re

import pytest
import torch

import qkv
from browser import offline
from linear_models import linear_model, wide_linear_model
from qkv.inspect.summaries import summarize
from qkv.viz.notebook import trace_html
from qkv.viz.page import attention_page, drawn_weights, write_attention_page
from qkv.viz.show import draw_attention
from variant_models import TEXT


@pytest.fixture(scope="module")
def model():
    return linear_model()


def test_linear_layers_are_drawn_as_shares_of_their_effective_weights(model):
    seen = model.attentions(TEXT)
    weights, note = drawn_weights(seen)
    effective = seen.records[0].weights()[0].double()  # signed
    assert bool((effective < 0).any())
    shares = effective.abs() / effective.abs().sum(-1, keepdim=True)
    torch.testing.assert_close(weights[0].double(), shares, atol=1e-6, rtol=0)
    torch.testing.assert_close(weights[2], seen.weights[2])  # the softmax layer as it is
    assert note.startswith("layers 0, 1 keep a running memory (linear attention)")


def test_the_page_says_so_and_redoes_no_pair_from_q_and_k(model, tmp_path):
    page = attention_page(model.attentions(TEXT), title="linear", text=TEXT).decode()
    assert "keep a running memory (linear attention), with no softmax" in page
    assert "written without the query, key and value vectors" in page
    told = []
    draw_attention(model.attentions(TEXT), tmp_path / "page.html", name="tiny", text=TEXT,
                   model=model.model, untraced=told.append)  # fmt: skip
    assert (tmp_path / "page.html").exists()
    assert told and "keeps a running memory (linear attention)" in told[0]


def test_the_notebooks_trace_says_no_softmax(model):
    html = trace_html(qkv.trace(model, TEXT, "deep", "bank", layer=0, head=1))
    assert "No softmax: the effective weight of" in html
    assert "effective weights (linear attention) in this head" in html
    assert "Softmax over every key word" not in html


def test_summaries_of_a_long_text_refuse_a_linear_layer_by_name(model):
    with pytest.raises(ValueError, match="keeps a running memory \\(linear attention\\)"):
        summarize(model.attentions(TEXT))


def test_a_layer_of_fewer_heads_has_its_missing_heads_marked_absent(tmp_path):
    wide = wide_linear_model()  # linear layers of 4 heads, a full layer of 2
    seen = wide.attentions(TEXT)
    weights, _ = drawn_weights(seen)
    assert bool(weights[2, 2:].isnan().all()) and not bool(weights[:2].isnan().any())
    torch.testing.assert_close(weights[2, :2], seen.weights[2, :2])
    page = attention_page(seen, title="wide", text=TEXT).decode()
    data = json.loads(re.search(r'id="qkv-data">(.*?)</script>', page, re.S).group(1))
    assert data["absent"] == [[False] * 4, [False] * 4, [False, False, True, True]]
    assert data["weights"]["heads"][2][3] is None and data["weights"]["heads"][0][3] is not None
    assert "function fitHead()" in page
    with pytest.raises(ValueError, match="layer 2 has no head 3 on this page: it has 2 heads"):
        attention_page(seen, title="wide", head=(2, 3))
    with pytest.raises(ValueError, match="layer 2 of tiny has 2 heads"):
        draw_attention(
            seen, tmp_path / "page.html", name="tiny", text=TEXT, layer=2, head=3, model=wide.model
        )
    draw_attention(
        seen, tmp_path / "page.html", name="tiny", text=TEXT, layer=0, head=3, model=wide.model
    )
    assert (tmp_path / "page.html").exists()


def test_the_pages_head_picker_offers_each_layer_its_own_heads(tmp_path):
    seen = wide_linear_model().attentions(TEXT)
    path = write_attention_page(tmp_path / "wide.html", seen, title="wide", text=TEXT, head=(0, 3))
    with offline(path) as page:
        page.select_option("#layer", "2")  # a layer of 2 heads: head 3 is not one of its own
        page.wait_for_function("document.querySelector('#head').value === '0'")
        disabled = page.eval_on_selector_all("#head option", "os => os.map(o => o.disabled)")
        assert disabled == [False, False, True, True]
        page.select_option("#layer", "1")
        disabled = page.eval_on_selector_all("#head option", "os => os.map(o => o.disabled)")
        assert disabled == [False] * 4
