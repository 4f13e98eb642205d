"""POST /api/why: a pair at token positions taken apart, as `qkv.why` takes the words there
apart; every bad request refused before any work, with the right status and one line."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

import qkv
from qkv.inspect.article import SENTENCE  # "The bank on the side of the river"
from qkv.serve import Limits, create_app
from variant_models import TEXT, decoder, tiny

LONG = "bank " * 200  # 202 tokens with [CLS] and [SEP]: over max_tokens (128)
PAIR = {"text": SENTENCE, "query_index": 2, "key_index": 8, "layer": 3, "head": 5}


def test_why_is_qkv_why_of_the_words_at_those_tokens(client, minilm):
    answer = client.post("/api/why", json={**PAIR, "top": 5, "checks": 1})
    assert answer.status_code == 200, answer.text
    got = answer.json()
    want = qkv.why(minilm, SENTENCE, "bank", "river", layer=3, head=5, checks=1)
    assert (got["query_index"], got["key_index"]) == (want.query_index, want.key_index) == (2, 8)
    assert (got["model"], got["query"], got["key"]) == ("minilm", "bank", "river")
    assert got["pieces"] == minilm.encode(SENTENCE).pieces
    assert got["score"] == want.score and got["weight"] == want.weight
    assert got["total"] == want.total and got["terms"] is None  # the grid only when asked
    assert [list(t.values())[:3] for t in got["ranked"]] == [list(t) for t in want.ranked(5)]
    assert len(got["checks"]) == 2  # the top part of each side removed
    assert [c["real_score"] for c in got["checks"]] == [c.real_score for c in want.checks]
    assert [c["part"] for c in got["carried"]] == [c.part for c in want.carried]
    fewer = client.post("/api/why", json={**PAIR, "checks": 0, "grid": True}).json()
    assert fewer["checks"] == [] and fewer["terms"] == want.terms.tolist()
    # no layer and head: where the query token attends most to the key token, as qkv.why
    best = client.post("/api/why", json={**PAIR, "layer": None, "head": None, "checks": 0})
    chosen = qkv.why(minilm, SENTENCE, "bank", "river", checks=0)
    best = best.json()
    assert (best["layer"], best["head"], best["chosen"]) == (chosen.layer, chosen.head,
                                                            chosen.chosen)  # fmt: skip


def test_a_rotary_decoders_content_and_position_and_its_hidden_keys():
    model = tiny(decoder())
    with TestClient(create_app({"tiny": model}, Limits())) as client:
        got = client.post("/api/why", json={"text": TEXT, "query_index": 8, "key_index": 1,
                                            "layer": 1, "head": 0}).json()  # fmt: skip
        later = client.post("/api/why", json={"text": TEXT, "query_index": 1, "key_index": 8})
    want = qkv.why(model, TEXT, "deep", "bank", layer=1, head=0)
    assert got["content"] == float(want.content.sum()) and got["position"] == want.position
    assert got["score"] == want.score
    assert later.status_code == 422
    assert "does not see the key word (token 8)" in later.json()["detail"]


@pytest.mark.parametrize(
    ("body", "status", "says"),
    [
        ({**PAIR, "query_index": 10}, 422, "the query position 10 is outside the text's 10 tokens"),
        ({**PAIR, "key_index": -1}, 422, "key_index: Input should be greater than or equal to 0"),
        ({**PAIR, "query_index": "2"}, 422, "query_index: Input should be a valid integer"),
        ({**PAIR, "query_index": True}, 422, "query_index: Input should be a valid integer"),
        ({**PAIR, "layer": 6}, 422, "layer 6 is out of range: minilm has 6 layers (0-5)"),
        ({**PAIR, "head": 12}, 422, "head 12 is out of range: layer 3 of minilm has 12 heads"),
        ({**PAIR, "layer": None, "head": 12}, 422, "head 12 is out of range: minilm has 12"),
        ({**PAIR, "checks": 6}, 422, "checks: Input should be less than or equal to 5"),
        ({**PAIR, "top": 0}, 422, "top: Input should be greater than or equal to 1"),
        ({**PAIR, "text": ""}, 422, "text: is empty or only spaces"),
        ({**PAIR, "text": "x" * 2001}, 413, "at most 2,000 (max_chars)"),
        ({**PAIR, "text": LONG}, 413, "202 tokens; this server takes at most 128"),
        ({**PAIR, "model": "smollm2"}, 422, "unknown model 'smollm2'"),
        ({**PAIR, "query": "bank"}, 422, "query: is not a field"),
        ({"text": SENTENCE, "key_index": 8}, 422, "query_index: is required"),
    ],
)  # fmt: skip
def test_bad_why_requests_get_the_right_status_and_one_line(client, body, status, says):
    answer = client.post("/api/why", json=body)
    assert answer.status_code == status, answer.text
    detail = answer.json()["detail"]
    assert isinstance(detail, str) and "\n" not in detail
    assert says in detail
