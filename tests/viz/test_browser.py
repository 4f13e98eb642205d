"""The report page in a real headless Chromium (Debian's), driven by Playwright.

The page must work offline: every request that is not the page's own file is blocked and
counted. The numbers it shows must be the model's weights, and a screenshot is kept as a
test artifact (test-artifacts/report.png) and checked to be non-blank. A clicked pair's
trace, computed by the page's script, must match `qkv.trace` in Python.
"""

from __future__ import annotations

import json

import matplotlib.image
import pytest
import torch

import qkv
from browser import ARTIFACTS, offline
from qkv.inspect.trace import attention_vectors
from qkv.models import EncoderConfig
from qkv.nn import BlockConfig
from qkv.viz import page_trace, write_html
from variant_models import TEXT, WORDS, gemma2_like, tiny

SENTENCE = "The bank on the side of the river"


@pytest.fixture(scope="module")
def seen():
    return qkv.load("minilm").attentions(SENTENCE)


def test_the_page_works_offline_and_shows_the_models_numbers(seen, tmp_path):
    page_file = write_html(tmp_path / "page.html", seen.weights, seen.tokens, text=SENTENCE)
    with offline(page_file) as page:
        assert page.locator("#layer option").count() == 6
        assert page.locator("#head option").count() == 12
        page.select_option("#layer", "3")
        page.select_option("#head", "5")
        bank = seen.tokens.index("bank")
        page.locator(f"button.token[data-index='{bank}']").first.click()
        page.wait_for_function("document.querySelectorAll('#row li').length > 0")
        shown = page.eval_on_selector_all(
            "#row li", "items => items.map(li => [Number(li.dataset.k), Number(li.dataset.w)])"
        )
        title = page.inner_text("#row-title")
        untraced = page.inner_text("#trace")
        ARTIFACTS.mkdir(exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / "report.png"), full_page=True)
    assert "bank" in title
    assert "written without the query, key and value vectors" in " ".join(untraced.split())
    want = seen.weights[3, 5, bank]
    assert [k for k, _ in shown] == list(range(len(seen.tokens)))
    for k, w in shown:  # stored exactly: the model's float32 weight itself
        assert w == want[k].item()
    picture = matplotlib.image.imread(ARTIFACTS / "report.png")
    assert picture.shape[0] > 300 and picture.shape[1] > 300
    assert picture[..., :3].std() > 0.05, "the screenshot is blank"


def traced_in_the_page(page, layer: int, head: int, query: int, key: int) -> dict:
    """Pick (layer, head), click the heatmap cell (query, key); the trace's numbers by id."""
    page.select_option("#layer", str(layer))
    page.select_option("#head", str(head))
    page.locator(f"#heatmap-table td[data-q='{query}'][data-k='{key}']").click()
    pair = f"{layer},{head},{query},{key}"
    page.wait_for_function(f"document.getElementById('trace').dataset.pair === '{pair}'")
    return {
        name: json.loads(page.get_attribute(f"#t-{name}", "data-values"))
        for name in ("query", "key", "scalar", "scaled", "weight", "sum", "contextualized")
    } | {"text": page.inner_text("#trace")}


def test_clicking_a_pair_traces_it_with_the_models_numbers(tmp_path):
    minilm = qkv.load("minilm")
    seen = minilm.attentions(SENTENCE)
    vectors = attention_vectors(minilm, SENTENCE)
    page_file = write_html(tmp_path / "trace.html", seen.weights, seen.tokens, vectors=vectors)
    want = qkv.trace(minilm, SENTENCE, "bank", "river", layer=3, head=5)
    with offline(page_file) as page:
        got = traced_in_the_page(page, 3, 5, want.query_index, want.key_index)
        ARTIFACTS.mkdir(exist_ok=True)
        page.locator("#trace").screenshot(path=str(ARTIFACTS / "trace.png"))
        # the other way in: a query token, then a key in its row's list
        page.locator("button.token[data-index='1']").click()
        page.locator("#row li[data-k='8']").click()
        page.wait_for_function("document.getElementById('trace').dataset.pair === '3,5,1,8'")
        from_the_row = json.loads(page.get_attribute("#t-weight", "data-values"))
    assert from_the_row == pytest.approx(
        qkv.trace(minilm, SENTENCE, "the#1", "river", layer=3, head=5).weight, abs=1e-5
    )
    assert got["query"] == pytest.approx(want.query_vector.tolist(), abs=1e-6)
    assert got["key"] == pytest.approx(want.key_vector.tolist(), abs=1e-6)
    assert got["scalar"] == pytest.approx(want.attention_scalar, rel=1e-4)
    assert got["scaled"] == pytest.approx(want.scaled_scalar, rel=1e-4)
    assert got["weight"] == pytest.approx(want.weight, abs=1e-5)
    assert got["sum"] == pytest.approx(1.0, abs=1e-9)
    assert got["contextualized"] == pytest.approx(want.contextualized.tolist(), rel=1e-4, abs=1e-6)
    assert "bank" in got["text"] and "river" in got["text"] and "100.00%" in got["text"]


def test_a_decoders_later_key_is_masked_in_the_trace(tmp_path):
    smollm2 = qkv.load("smollm2")
    seen = smollm2.attentions(SENTENCE)
    vectors = attention_vectors(smollm2, SENTENCE)
    page_file = write_html(
        tmp_path / "causal.html", seen.weights, seen.tokens, vectors=vectors, causal=True
    )
    want = qkv.trace(smollm2, SENTENCE, "bank", "river", layer=3, head=5)
    assert want.masked  # "river" comes after "bank"
    with offline(page_file) as page:
        got = traced_in_the_page(page, 3, 5, want.query_index, want.key_index)
        # the other way round, "river" sees "bank": a real weight, as Python computes it
        back = qkv.trace(smollm2, SENTENCE, "river", "bank", layer=3, head=5)
        seen_back = traced_in_the_page(page, 3, 5, back.query_index, back.key_index)
    assert "hidden by the causal mask, weight 0" in got["text"]
    assert got["weight"] == 0 and got["sum"] == pytest.approx(1.0, abs=1e-9)
    assert got["contextualized"] == pytest.approx(want.contextualized.tolist(), rel=1e-4, abs=1e-5)
    assert "causal mask" not in seen_back["text"]
    assert seen_back["weight"] == pytest.approx(back.weight, abs=1e-5)
    assert seen_back["scalar"] == pytest.approx(back.attention_scalar, rel=1e-4)


def traced_variants(page, layer: int, head: int, query: int, key: int) -> dict:
    """The trace of (layer, head, query, key), with the cap, bias and score steps it shows."""
    got = traced_in_the_page(page, layer, head, query, key)
    for name in ("capped", "bias", "score"):
        if page.locator(f"#t-{name}").count():
            got[name] = json.loads(page.get_attribute(f"#t-{name}", "data-values"))
    return got


def assert_the_page_redoes(got: dict, steps, key: int) -> None:
    """The page's numbers for (query, key) are `AttentionRecord.steps()`'s, its loop's."""
    pair = steps.pairs[key]
    assert got["scalar"] == pytest.approx(pair.attention_scalar.item(), rel=1e-9, abs=1e-9)
    assert got["scaled"] == pytest.approx(pair.scaled_scalar.item(), rel=1e-9, abs=1e-9)
    assert got["weight"] == pytest.approx(pair.normalized_weight.item(), abs=1e-9)
    if "score" in got:  # what the softmax reads
        assert got["score"] == pytest.approx(pair.score.item(), rel=1e-9, abs=1e-9)
    else:
        assert pair.score.item() == pair.scaled_scalar.item()
    assert got["sum"] == pytest.approx(1.0, abs=1e-9)
    assert got["contextualized"] == pytest.approx(steps.contextualized.tolist(), rel=1e-9, abs=1e-9)


def test_a_decoders_window_and_soft_cap_are_redone_in_the_page(tmp_path):
    model = tiny(gemma2_like())  # layer 0: a window of 3 and a cap of 0.02; layer 1: the cap
    seen = model.attentions(TEXT)
    vectors, scores = page_trace(seen.records)
    page_file = write_html(tmp_path / "gemma2.html", seen.weights, seen.tokens, vectors=vectors,
                           causal=True, scale=seen.scale, scores=scores)  # fmt: skip
    record = seen.records[0]
    steps = record.steps(head=1, query=8)
    with offline(page_file) as page:
        near = traced_variants(page, 0, 1, 8, 7)  # one token back: inside the window
        far = traced_variants(page, 0, 1, 8, 2)  # six back: outside it
        full = traced_variants(page, 1, 0, 8, 2)  # layer 1 has no window
        ARTIFACTS.mkdir(exist_ok=True)
        page.locator("#trace").screenshot(path=str(ARTIFACTS / "trace-gemma2.png"))
    assert_the_page_redoes(near, steps, 7)
    assert_the_page_redoes(far, steps, 2)
    assert_the_page_redoes(full, seen.records[1].steps(head=0, query=8), 2)
    pair = steps.pairs[7]
    assert abs(pair.scaled_scalar.item()) > 0.02  # the cap acts on this pair
    assert near["capped"] == pytest.approx(pair.score.item(), rel=1e-9)
    assert "bias" not in near
    text = " ".join(near["text"].split())
    assert "Capped to 0.02 tanh(s/0.02) = " in text and "no score leaves -0.02..+0.02" in text
    assert f"The softmax reads this score: {pair.score.item():+.4f}" in text
    assert "keys 3 or more tokens back are hidden (weight 0)" in text
    assert not steps.pairs[2].allowed and far["weight"] == 0
    assert "is 6 tokens back: outside the window, so its weight is 0" in far["text"]
    assert full["weight"] > 0 and "window" not in full["text"]


def test_an_encoders_distance_bias_is_redone_in_the_page(tmp_path):
    config = EncoderConfig(vocab_size=len(WORDS), num_layers=2, position="relative",
                           relative_buckets=8, relative_max_distance=16,
                           block=BlockConfig(width=32, num_heads=2, attn_scale=1.0))  # fmt: skip
    model = tiny(config)
    with torch.no_grad():  # a bias as large as the scores, so a wrong one shows
        for name, p in model.model.named_parameters():
            if "relative" in name:
                p.mul_(20.0)
    seen = model.attentions(TEXT)
    assert seen.records[0].bias is not None
    vectors, scores = page_trace(seen.records, bias_is_distance=True)
    page_file = write_html(tmp_path / "t5.html", seen.weights, seen.tokens, vectors=vectors,
                           scale=seen.scale, scores=scores)  # fmt: skip
    steps = seen.records[1].steps(head=1, query=1)
    with offline(page_file) as page:
        before = traced_variants(page, 1, 1, 1, 0)  # encoders look both ways
        after = traced_variants(page, 1, 1, 1, 5)
    for key, got in ((0, before), (5, after)):
        assert_the_page_redoes(got, steps, key)
        bias = seen.records[1].bias.expand(1, 2, 9, 9)[0, 1, 1, key].item()
        assert got["bias"] == bias and abs(bias) > 0.1
        assert "capped" not in got
        assert f"Plus a learned bias for the distance between the words: {bias:+.4f}" in got["text"]
    assert before["bias"] != after["bias"]
    assert "causal mask" not in after["text"] and after["weight"] > 0
