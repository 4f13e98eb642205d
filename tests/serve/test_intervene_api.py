"""/api/hide and /api/heads: the library's own numbers (`qkv.hide`, `qkv.heads`) through the
API, a decoder's too, and each kind of bad input refused in one line before any work."""

from __future__ import annotations

import threading

import pytest

import qkv
from qkv.inspect.article import SENTENCE  # the article's sentence
from qkv.viz.lines import hide_scale_text

TEXT = "The bank of the river flooded the bank"  # two banks: bank#1, bank#2


def answer_of(hidden) -> dict:
    """/api/hide's answer for a `qkv.hide` result: its JSON and the scale, in words."""
    return {**hidden.to_dict(), "scale": hide_scale_text(hidden)}


def test_hide_is_qkv_hide_for_a_pair(client, minilm):
    # the library first: a process's first run of batched heads also loads what torch
    # imports lazily (seconds on a busy machine), which the request's time limit need not pay
    want = answer_of(qkv.hide(minilm, TEXT, "river", query="bank#1"))
    answer = client.post("/api/hide", json={"text": TEXT, "key": "river", "query": "bank#1"})
    assert answer.status_code == 200, answer.text
    assert answer.json() == {"model": "minilm", **want}  # every field, every digit
    assert len(want["ranked"]) == 72 and want["total"] > want["ranked"][0]["effect"] > 0


def test_hide_from_every_word_in_chosen_layers_and_heads(client, minilm):
    body = {"text": SENTENCE, "key": "river", "layers": [4, 1], "heads": [3, 0]}
    want = answer_of(qkv.hide(minilm, SENTENCE, "river", layers=[4, 1], heads=[3, 0]))
    answer = client.post("/api/hide", json=body).json()
    assert answer == {"model": "minilm", **want}
    asked = {(n, h) for n, row in enumerate(answer["effect"]) for h, e in enumerate(row) if e}
    assert asked == {(4, 3), (4, 0), (1, 3), (1, 0)}  # the rest are null: not asked


def test_hide_in_a_decoder_gives_the_next_token_before_and_after(decoder_client, smollm2):
    text = "The bank of the river was"
    body = {"model": "smollm2", "text": text, "key": "river", "layers": [29, 27], "heads": [8, 0]}
    want = answer_of(qkv.hide(smollm2, text, "river", layers=[29, 27], heads=[8, 0]))
    answer = decoder_client.post("/api/hide", json=body).json()
    assert answer == {"model": "smollm2", **want}
    assert answer["next"]["position"] == len(answer["tokens"]) - 1
    assert answer["next_by_head"][29][8] is not None and answer["next_by_head"][28][8] is None


def census_answer(client, body: dict):
    """/api/heads's answer once the census is counted: on a busy machine it may take longer
    than the half of timeout_s one request waits (503: ask again), so ask again, as the page
    does."""
    for _ in range(30):
        answer = client.post("/api/heads", json=body)
        if answer.status_code != 503:
            return answer
    return answer


def test_the_census_is_qkv_heads(client, minilm):
    want = qkv.heads(minilm).to_dict()
    first = census_answer(client, {})
    assert first.status_code == 200, first.text
    assert first.json() == {"model": "minilm", **want}
    again = client.post("/api/heads", json={"model": "minilm"})  # kept: answered at once
    assert again.status_code == 200 and again.json() == first.json()


LONG = "bank " * 200  # 202 tokens with [CLS] and [SEP]: over 128


@pytest.mark.parametrize(
    ("path", "body", "status", "says"),
    [
        ("/api/hide", {"text": TEXT, "key": "money", "query": "bank#1"}, 422,
         "the key word: 'money' is not a word of the text"),
        ("/api/hide", {"text": TEXT, "key": "river", "query": "bank"}, 422,
         "the query word: 'bank' occurs 2 times in the text; name one: bank#1, bank#2"),
        ("/api/hide", {"text": TEXT, "key": "river", "layers": [6]}, 422,
         "layer 6 is out of range: minilm has 6 layers (0-5)"),
        ("/api/hide", {"text": TEXT, "key": "river", "heads": [12]}, 422,
         "head 12 is out of range: minilm has 12 heads (0-11)"),
        ("/api/hide", {"text": TEXT, "key": "river", "heads": [1, 1]}, 422,
         "heads: 1 is given twice"),
        ("/api/hide", {"text": TEXT, "key": "river", "layers": []}, 422, "layers: List should"),
        ("/api/hide", {"text": TEXT, "key": ""}, 422, "key: is empty"),
        ("/api/hide", {"text": TEXT}, 422, "key: is required"),
        ("/api/hide", {"text": TEXT, "key": "river", "layer": 0}, 422, "layer: is not a field"),
        ("/api/hide", {"text": TEXT, "key": "river", "model": "gpt2"}, 422,
         "this server has: minilm"),
        ("/api/hide", {"text": "x" * 2001, "key": "x"}, 413, "at most 2,000 (max_chars)"),
        ("/api/hide", {"text": LONG, "key": "bank#1"}, 413, "202 tokens; this server takes"),
        ("/api/heads", {"model": "smollm2"}, 422, "unknown model 'smollm2'"),
        ("/api/heads", {"text": TEXT}, 422, "text: is not a field"),
    ],
)  # fmt: skip
def test_bad_input_gets_the_right_status_and_one_line(client, path, body, status, says):
    answer = client.post(path, json=body)
    assert answer.status_code == status, answer.text
    detail = answer.json()["detail"]
    assert isinstance(detail, str) and "\n" not in detail
    assert says in detail, detail


def test_a_decoder_cannot_hide_a_word_from_one_before_it(decoder_client):
    body = {"model": "smollm2", "text": TEXT, "key": "river", "query": "bank#1", "layers": [0]}
    answer = decoder_client.post("/api/hide", json=body)
    assert answer.status_code == 422
    assert (
        "is a decoder: 'bank#1' (token 1) sees only the words before it"
        in (answer.json()["detail"])
    )


def test_a_census_still_being_computed_is_503_ask_again(monkeypatch):
    """The census runs once per model in a thread of its own; a request that waited half of
    timeout_s for it is told 503, and a later one gets it."""
    from fastapi.testclient import TestClient

    import qkv.inspect.census
    from qkv.serve import Limits, create_app
    from variant_models import decoder, tiny

    model, release, counted = tiny(decoder()), threading.Event(), []
    real = qkv.inspect.census.heads

    def slow(pretrained):
        counted.append(pretrained)
        assert release.wait(60)
        return real(pretrained)

    monkeypatch.setattr(qkv.inspect.census, "heads", slow)
    with TestClient(create_app({"toy": model}, Limits(timeout_s=0.5))) as client:
        for _ in range(2):  # the second request waits for the same census
            answer = client.post("/api/heads", json={})
            assert answer.status_code == 503, answer.text
            assert "the census of toy's heads is being computed" in answer.json()["detail"]
        release.set()
        answer = census_answer(client, {})
        assert answer.json() == {"model": "toy", **real(model).to_dict()}
    assert counted == [model]  # computed once


def test_hide_without_the_table_is_the_total_alone(client, minilm):
    body = {"text": TEXT, "key": "river", "query": "bank#1", "layers": [2, 3], "table": False}
    answer = client.post("/api/hide", json=body).json()
    want = qkv.hide(minilm, TEXT, "river", query="bank#1", layers=[2, 3])
    assert answer["total"] == want.total and answer["total_distance"] == want.total_distance
    assert answer["ranked"] == [] and {e for row in answer["effect"] for e in row} == {None}
    assert answer["others"] == [] and answer["scale"] is None  # no table asked: no scale
