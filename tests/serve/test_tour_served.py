"""The tour served: POST /api/tour is `tour(...).to_dict()` for any text, GET /tour its page;
bad words and texts over the limits answer 4xx in one line."""

from __future__ import annotations

import qkv
from qkv.inspect.article import SENTENCE
from qkv.inspect.tour import STEPS

TEXT = "Cats chase mice at night"


def test_api_tour_is_the_librarys_tour_of_any_text(client, minilm):
    answer = client.post("/api/tour", json={"text": TEXT, "query": "cats", "key": "mice"})
    assert answer.status_code == 200
    found = answer.json()
    assert found["model"] == "minilm" and [s["id"] for s in found["steps"]] == list(STEPS)
    t = qkv.trace(minilm, TEXT, "cats", "mice")
    qkv_step = next(s for s in found["steps"] if s["id"] == "qkv")["numbers"]
    assert (found["layer"], found["head"]) == (t.layer, t.head)
    assert qkv_step["attention_scalar"] == t.attention_scalar
    assert qkv_step["weights"] == [float(w) for w in t.weights.double()]


def test_get_tour_is_the_page_and_post_gives_it_too(client):
    page = client.get("/tour")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert 'id="tour-data"' in page.text and "The bank on the side of the river" in page.text
    posted = client.post("/api/tour", json={"text": SENTENCE, "format": "html"})
    assert posted.status_code == 200 and posted.text.startswith("<!doctype html>")


def test_bad_input_is_a_4xx(client):
    answer = client.post("/api/tour", json={"text": TEXT, "query": "boat"})
    assert answer.status_code == 422 and "not a word of the text" in answer.text
    assert client.post("/api/tour", json={"text": "x " * 3000}).status_code == 413
    assert client.post("/api/tour", json={"text": TEXT, "layer": 6}).status_code == 422
    assert client.get("/tour", params={"text": " "}).status_code == 422


def test_a_target_is_for_encoder_decoders(client):
    answer = client.post("/api/tour", json={"text": TEXT, "target": "night at mice"})
    assert answer.status_code == 422 and "encoder-decoder" in answer.text
