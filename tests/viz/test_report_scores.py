"""What the page is given to redo a pair beyond q, k, v and the scale: each layer's window,
soft-cap and score bias (the page's numbers themselves are checked in test_browser.py)."""

from __future__ import annotations

import base64
import json
import re
import zlib

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from qkv.cli import app
from qkv.inspect.records import why_not_redone
from qkv.models import EncoderConfig
from qkv.nn import BlockConfig, MultiHeadAttention
from qkv.viz import LayerScores, page_trace, write_html
from variant_models import TEXT, WORDS, gemma2_like, tiny


def page_data(path) -> dict:
    page = path.read_text(encoding="utf-8")
    found = re.search(r'<script type="application/json" id="qkv-data">(.*?)</script>', page, re.S)
    return json.loads(found.group(1))


def test_qkv_show_gives_the_page_each_layers_window_and_cap(tmp_path, monkeypatch):
    model = tiny(gemma2_like())
    monkeypatch.setattr("qkv.pretrained.load", lambda name, backend=None: model)
    out = tmp_path / "gemma2.html"
    result = CliRunner().invoke(app, ["show", TEXT, "--model", "tiny", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "traces no pair" not in result.output
    layers = page_data(out)["vectors"]["layers"]
    assert [(x["window"], x["softcap"], x["bias"]) for x in layers] == [
        (3, 0.02, None),
        (None, 0.02, None),
    ]


def test_a_relative_bias_is_stored_exactly_per_head(tmp_path):
    config = EncoderConfig(vocab_size=len(WORDS), num_layers=1, position="relative",
                           relative_buckets=8, relative_max_distance=16,
                           block=BlockConfig(width=32, num_heads=2))  # fmt: skip
    seen = tiny(config).attentions(TEXT)
    vectors, scores = page_trace(seen.records, bias_is_distance=True)
    path = write_html(tmp_path / "t5.html", seen.weights, seen.tokens, vectors=vectors,
                      scale=seen.scale, scores=scores)  # fmt: skip
    (layer,) = page_data(path)["vectors"]["layers"]
    assert layer["bias_is_distance"] and layer["window"] is None and layer["softcap"] is None
    T = len(seen.tokens)
    stored = [np.frombuffer(zlib.decompress(base64.b64decode(h)), "<f4").reshape(T, T)
              for h in layer["bias"]]  # fmt: skip
    want = seen.records[0].bias.expand(1, 2, T, T)[0].numpy()
    assert np.array_equal(np.stack(stored), want) and np.abs(want).max() > 0


def test_grouped_key_heads_are_repeated_beside_their_query_heads():
    seen = tiny(gemma2_like()).attentions(TEXT)  # 2 query heads read 1 key/value head
    (q, k, v), _ = page_trace(seen.records)
    assert q.shape == k.shape == v.shape == (2, 2, 9, 16)
    assert np.array_equal(k[0, 1], seen.records[0].k[0, 0].numpy())


def test_a_masked_record_is_not_traced_by_the_page():
    mha = MultiHeadAttention(width=16, num_heads=2)
    mask = torch.tensor([[True, True, False]])
    _, record = mha(torch.randn(1, 3, 16), mask=mask, record=True)
    assert why_not_redone({0: record}) == "layer 0 masks keys beyond the causal rule and the window"
    with pytest.raises(ValueError, match="the page cannot redo these pairs: layer 0 masks"):
        page_trace({0: record})


@pytest.mark.parametrize(
    "scores, message",
    [
        ([LayerScores()], "one LayerScores per layer: 2, not 1"),
        ([LayerScores(window=0)] * 2, "layer 0's window must be a positive whole number"),
        ([LayerScores(softcap=-1.0)] * 2, "layer 0's soft-cap must be a positive number"),
        ([LayerScores(), LayerScores(bias=np.zeros((2, 9, 8)))],
         r"layer 1's score bias must be \(H, T, T\) = \(2, 9, 9\), not \(2, 9, 8\)"),
        ([LayerScores(bias=np.full((2, 9, 9), np.nan))] * 2, "NaN or infinite"),
    ],
)  # fmt: skip
def test_bad_scores_are_a_one_line_error(tmp_path, scores, message):
    seen = tiny(gemma2_like()).attentions(TEXT)
    vectors, _ = page_trace(seen.records)
    with pytest.raises(ValueError, match=message):
        write_html(tmp_path / "x.html", seen.weights, seen.tokens, vectors=vectors,
                   causal=True, scores=scores)  # fmt: skip
    assert not (tmp_path / "x.html").exists()


def test_scores_without_vectors_are_refused(tmp_path):
    seen = tiny(gemma2_like()).attentions(TEXT)
    with pytest.raises(ValueError, match="pass them with the vectors"):
        write_html(tmp_path / "x.html", seen.weights, seen.tokens, scores=[LayerScores()] * 2)
