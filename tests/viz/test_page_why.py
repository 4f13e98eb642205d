"""`page_whys`: the pairs a page takes apart ahead are each of the first `count` query tokens
with its strongest key in the head asked, each `qkv.why`'s; a linear layer's are refused by
name, in the page too; a page asked for none has no why panel."""

from __future__ import annotations

import json
import re

from linear_models import linear_model
from qkv.inspect.why import encoded_why
from qkv.viz.page_why import page_whys
from qkv.viz.show import draw_attention
from variant_models import TEXT, decoder, tiny


def test_each_of_the_first_queries_with_its_strongest_key():
    model = tiny(decoder())
    seen = model.attentions(TEXT)
    whys = page_whys(model.model, seen, (1, 0), count=4, checks=0)
    assert (whys["layer"], whys["head"], whys["count"], whys["refused"]) == (1, 0, 4, None)
    strongest = [int(seen.weights[1, 0, q].argmax()) for q in range(4)]
    assert [(p["query_index"], p["key_index"]) for p in whys["pairs"]] == list(
        zip(range(4), strongest, strict=True)
    )
    for p in whys["pairs"]:
        want = encoded_why(model.model, seen.encoded, p["query_index"], p["key_index"], layer=1,
                           head=0, checks=0)  # fmt: skip
        assert p["score"] == want.score and p["content"] == float(want.content.sum())
        assert "terms" not in p and "tokens" not in p and p["checks"] == []


def data_of(page_file) -> tuple[dict, str]:
    page = page_file.read_text()
    found = re.search(r'<script type="application/json" id="qkv-data">(.*?)</script>', page, re.S)
    return json.loads(found.group(1)), page


def test_a_linear_layer_is_refused_in_the_page_and_whys_0_leaves_the_panel_out(tmp_path):
    model = linear_model()
    seen = model.attentions(TEXT)
    draw_attention(seen, tmp_path / "a.html", name="tiny", text=TEXT, model=model.model,
                   layer=0, head=0)  # fmt: skip
    data, page = data_of(tmp_path / "a.html")
    assert data["whys"]["pairs"] == [] and "linear attention" in data["whys"]["refused"]
    assert 'id="why"' in page and "function drawWhy" in page
    draw_attention(seen, tmp_path / "b.html", name="tiny", text=TEXT, model=model.model, whys=0)
    data, page = data_of(tmp_path / "b.html")
    assert data["whys"] is None and 'id="why"' not in page and "function drawWhy" not in page
