"""Cross-attention on the interactive page: a tiny random BART's decoder reading its encoder,
the target's tokens down and the source's across, with the numbers `transformers` computes,
in Chromium with every request but the page's own blocked and counted."""

from __future__ import annotations

import html
import json
import re
import string

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

import qkv
from browser import ARTIFACTS, offline
from qkv.cli import app
from qkv.inspect.records import why_not_redone
from qkv.nn import MultiHeadAttention
from qkv.viz import page_trace, read_weights, write_html, write_report
from qkv.viz.report import CROSS_HEADER

LETTERS = list(string.ascii_lowercase)


@pytest.fixture(scope="module")
def bart(folder):
    return qkv.load(folder)


@pytest.fixture(scope="module")
def seen(bart):
    """Cross-attention of 6 target rows (the start token, then 5 words) over 7 source tokens."""
    words = [LETTERS[i] for i in torch.randperm(len(LETTERS))[:5].tolist()]
    return bart.attentions(" ".join(words), target=" ".join(reversed(words)))


def data_of(page: str) -> dict:
    found = re.search(r'<script type="application/json" id="qkv-data">(.*?)</script>', page, re.S)
    return json.loads(found.group(1))


def cross_page(path, seen, **options):
    vectors, scores = page_trace(seen.records, cross=True)
    return write_html(path, seen.weights, seen.tokens, query_tokens=seen.query_tokens,
                      vectors=vectors, scale=seen.scale, scores=scores, **options)  # fmt: skip


def test_the_page_holds_the_cross_attention_transformers_computes(folder, bart, seen, tmp_path):
    import transformers as hf

    theirs = hf.BartForConditionalGeneration.from_pretrained(folder, attn_implementation="eager")
    source = torch.tensor([seen.encoded.ids])  # (1, Tk)
    start = theirs.config.decoder_start_token_id
    target = bart.tokenizer.encode(" ".join(seen.query_tokens[1:]), add_special_tokens=False).ids
    with torch.no_grad():
        out = theirs.eval()(input_ids=source, decoder_input_ids=torch.tensor([[start, *target]]),
                            output_attentions=True)  # fmt: skip
    want = torch.stack([layer[0] for layer in out.cross_attentions]).numpy()  # (L, H, Tq, Tk)

    page = cross_page(tmp_path / "cross.html", seen).read_text()
    weights, tokens = read_weights(page)
    assert weights.shape == (2, 4, 6, 7) == want.shape
    assert np.array_equal(weights, seen.weights.numpy())  # stored exactly
    np.testing.assert_allclose(weights, want, atol=1e-5, rtol=0)
    data = data_of(page)
    assert tokens == seen.tokens and data["query_tokens"] == seen.query_tokens
    assert data["weights"]["encoding"].startswith("float32, little-endian, row-major Tq x Tk")
    assert CROSS_HEADER in page and "Heatmap: target (queries) down, source (keys) across" in page
    buttons = re.findall(r'<button type="button" class="token" data-index="(\d+)">([^<]*)<', page)
    assert [html.unescape(t) for _, t in buttons] == seen.query_tokens  # a target token: a query
    assert len(data["vectors"]["query"][0]) == 4 and data["vectors"]["layers"][0]["window"] is None


def test_cross_records_are_traced_only_as_cross_attention(seen):
    assert why_not_redone(seen.records, cross=True) is None
    assert why_not_redone(seen.records) == "layer 0 is not one text's self-attention"
    (q, k, v), scores = page_trace(seen.records, cross=True)
    assert q.shape == (2, 4, 6, 8) and k.shape == v.shape == (2, 4, 7, 8)
    assert np.array_equal(q[1, 2], seen.records[1].q[0, 2].numpy())
    assert [(s.window, s.softcap, s.bias) for s in scores] == [(None, None, None)] * 2
    mha = MultiHeadAttention(width=16, num_heads=2)  # causal self-attention is not cross's
    _, record = mha(torch.randn(1, 3, 16), causal=True, record=True)
    assert why_not_redone({0: record}, cross=True) == (
        "layer 0 hides keys by position, which cross-attention does not"
    )


def test_clicking_a_target_token_shows_its_row_over_the_source(bart, seen, tmp_path):
    page_file = cross_page(tmp_path / "cross.html", seen, text=seen.encoded.text)
    text, target = seen.encoded.text, " ".join(seen.query_tokens[1:])
    query, key = 3, 4  # the third target word, over the fourth source token
    want = qkv.trace(bart, text, seen.query_tokens[query], seen.tokens[key], layer=1, head=2,
                     target=target)  # fmt: skip
    assert (want.query_index, want.key_index) == (query, key)
    with offline(page_file) as page:
        header = page.inner_text("#kind")
        columns = page.eval_on_selector_all("#heatmap-table thead th", "t => t.length")
        rows = page.locator("#heatmap-table tbody tr").count()
        page.select_option("#layer", "1")
        page.select_option("#head", "2")
        page.locator(f"button.token[data-index='{query}']").click()
        page.wait_for_function("document.querySelectorAll('#row li').length > 0")
        shown = page.eval_on_selector_all(
            "#row li", "items => items.map(li => [Number(li.dataset.w), li.textContent])"
        )
        title = page.inner_text("#row-title")
        page.locator(f"#heatmap-table td[data-q='{query}'][data-k='{key}']").click()
        page.wait_for_function(
            f"document.getElementById('trace').dataset.pair === '1,2,{query},{key}'"
        )
        traced = {
            name: json.loads(page.get_attribute(f"#t-{name}", "data-values"))
            for name in ("query", "key", "scalar", "scaled", "weight", "sum", "contextualized")
        }
        trace_text = page.inner_text("#trace")
        ARTIFACTS.mkdir(exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / "cross-page.png"), full_page=True)
    assert header.startswith(CROSS_HEADER) and "6 target tokens, 7 source tokens" in header
    assert (rows, columns) == (6, 1 + 7)  # a row per target token, a column per source token
    assert f"“{seen.query_tokens[query]}” (target token {query}), layer 1, head 2" in title
    row = seen.weights[1, 2, query]  # (Tk,)
    assert [w for w, _ in shown] == row.tolist()  # the model's float32 weights, exactly
    for (w, label), token in zip(shown, seen.tokens, strict=True):
        assert label == f"{token}: {100 * w:.2f}%"
    steps = seen.records[1].steps(head=2, query=query)  # the loop, float64
    assert traced["query"] == pytest.approx(want.query_vector.tolist(), abs=1e-6)
    assert traced["key"] == pytest.approx(want.key_vector.tolist(), abs=1e-6)
    assert traced["scalar"] == pytest.approx(steps.pairs[key].attention_scalar.item(), rel=1e-9)
    assert traced["scaled"] == pytest.approx(want.scaled_scalar, rel=1e-5)
    assert traced["weight"] == pytest.approx(steps.pairs[key].normalized_weight.item(), abs=1e-9)
    assert traced["weight"] == pytest.approx(row[key].item(), abs=1e-6)
    assert traced["sum"] == pytest.approx(1.0, abs=1e-9)
    assert traced["contextualized"] == pytest.approx(steps.contextualized.tolist(), abs=1e-9)
    assert "target token 3" in trace_text and "source token 4" in trace_text
    assert "causal" not in trace_text


def test_a_long_target_is_drawn_on_a_tall_canvas(tmp_path):
    Tq, Tk = 45, 6  # beyond the table's 40 rows: a canvas, a row per target token
    weights = torch.softmax(torch.randn(1, 2, Tq, Tk), dim=-1)  # (L, H, Tq, Tk)
    queries, keys = [f"t{i}" for i in range(Tq)], list("abcdef")
    page_file = write_html(tmp_path / "tall.html", weights, keys, query_tokens=queries,
                           head=(0, 1))  # fmt: skip
    with offline(page_file) as page:
        size = page.eval_on_selector("#heatmap-canvas", "c => [c.width, c.height]")
        page.locator("#heatmap-canvas").scroll_into_view_if_needed()
        box = page.locator("#heatmap-canvas").bounding_box()
        x, y = box["width"] * 4.5 / Tk, box["height"] * 30.5 / Tq  # in cell (query 30, key 4)
        page.mouse.move(box["x"] + x, box["y"] + y)
        cell = page.inner_text("#cell")
    assert size == [Tk, Tq]  # a pixel per weight, drawn no taller than a square map
    assert box["height"] == pytest.approx(640, abs=2)
    assert box["width"] == pytest.approx(640 * Tk / Tq, abs=2)
    assert cell == f"t30 (30) → e (4): {100 * weights[0, 1, 30, 4].item():.2f}%"


def test_show_writes_the_cross_attention_page_and_report(folder, tmp_path):
    runner = CliRunner()
    args = ["show", "a b c d", "--model", str(folder), "--target", "d c b a"]
    page_file = tmp_path / "cross.html"
    result = runner.invoke(app, [*args, "--out", str(page_file), "--layer", "1", "--head", "3"])
    assert result.exit_code == 0, result.output
    assert result.stdout == f"wrote {page_file}\n" and result.stderr == ""
    want = qkv.load(folder).attentions("a b c d", target="d c b a")
    page = page_file.read_text()
    weights, tokens = read_weights(page)
    assert np.array_equal(weights, want.weights.numpy()) and tokens == want.tokens
    data = data_of(page)
    assert data["query_tokens"] == ["</s>", "d", "c", "b", "a"]
    assert data["selected"] == {"layer": 1, "head": 3, "query": None}
    assert data["vectors"] is not None and CROSS_HEADER in page
    report = tmp_path / "report"
    result = runner.invoke(app, [*args, "--out", str(report)])
    assert result.exit_code == 0, result.output
    head_png, *others = sorted(p.name for p in report.iterdir())
    assert re.fullmatch(r"head_L[01]_H[0-3]\.png", head_png)
    assert others == ["index.html", "model_view.png"]
    assert np.array_equal(read_weights((report / "index.html").read_text())[0], weights)


def test_the_notebook_shows_the_cross_attention_page(bart, seen):
    before = [p.clone() for p in bart.model.parameters()]
    shown = seen._repr_html_()
    assert shown.isascii() and shown.startswith('<iframe class="qkv-page"')
    (srcdoc,) = re.findall(r'srcdoc="([^"]*)"', shown)
    page = html.unescape(srcdoc)
    weights, tokens = read_weights(page)
    assert np.array_equal(weights, seen.weights.numpy()) and tokens == seen.tokens
    assert data_of(page)["query_tokens"] == seen.query_tokens and CROSS_HEADER in page
    assert data_of(page)["vectors"] is not None
    assert all(torch.equal(a, b) for a, b in zip(before, bart.model.parameters(), strict=True))


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(weights=lambda w: w.transpose(-1, -2)),
         r"^cross-attention weights must have shape \(L, H, Tq, Tk\) with Tq = 6 target tokens "
         r"\(rows\) and Tk = 7 source tokens \(columns\); got \(2, 4, 7, 6\) \(transposed\? "),
        (dict(query=6), r"^target token 6 is out of range: the page has 6 target tokens \(0-5\)$"),
        (dict(vectors=lambda q, k, v: (k, k, v)),
         r"^the query vectors must be \(L, H, Tq, D\) = \(2, 4, 6, D\) to match the weights, "
         r"not \(2, 4, 7, 8\)$"),
        (dict(causal=True), r"^cross-attention hides no key by position: causal must be False$"),
    ],
)  # fmt: skip
def test_a_bad_cross_attention_page_is_a_one_line_error(seen, tmp_path, change, message):
    vectors, _ = page_trace(seen.records, cross=True)
    weights = change.get("weights", lambda w: w)(seen.weights)
    vectors = change.get("vectors", lambda *x: x)(*vectors)
    options = {name: change[name] for name in ("query", "causal") if name in change}
    path = tmp_path / "x.html"
    with pytest.raises(ValueError, match=message) as error:
        write_html(path, weights, seen.tokens, query_tokens=seen.query_tokens, vectors=vectors,
                   **options)  # fmt: skip
    assert "\n" not in str(error.value)
    with pytest.raises(ValueError, match=r"\(L, H, Tq, Tk\) with Tq = 6"):
        write_report(tmp_path / "r", seen.weights[..., :-1], seen.tokens,
                     query_tokens=seen.query_tokens)  # fmt: skip
    assert list(tmp_path.iterdir()) == []
