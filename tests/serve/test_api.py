"""Every endpoint with httpx (Starlette's TestClient) against the app: good input answered
with the model's own numbers, each kind of bad input with the right status and a message."""

from __future__ import annotations

import base64
import json
import re

import numpy as np
import pytest
import torch

import qkv
from qkv.inspect.article import SENTENCE  # the article's sentence
from qkv.inspect.probe import probe


def test_models_lists_what_was_loaded_and_the_limits(client):
    answer = client.get("/api/models").json()
    assert [m["name"] for m in answer["models"]] == ["minilm"]
    minilm = answer["models"][0]
    assert (minilm["kind"], minilm["num_layers"], minilm["num_heads"], minilm["head_dim"]) == (
        "encoder",
        6,
        12,
        32,
    )
    assert answer["limits"]["max_tokens"] == 128
    assert answer["examples"][0] == SENTENCE


def test_attention_is_every_weight_of_the_model(client, minilm):
    answer = client.post("/api/attention", json={"text": SENTENCE}).json()
    want = minilm.attentions(SENTENCE)
    assert answer["tokens"] == want.tokens and answer["pieces"] == want.encoded.pieces
    assert answer["shape"] == [6, 12, len(want.tokens), len(want.tokens)]
    assert torch.tensor(answer["weights"]) == pytest.approx(want.weights, abs=1e-7)
    assert {"word": "river", "tokens": [8, 9]} in answer["words"]


def test_attention_of_chosen_layers_and_heads_in_base64_is_exact(client, minilm):
    body = {"text": SENTENCE, "layers": [5, 0], "heads": [3], "format": "base64"}
    answer = client.post("/api/attention", json=body).json()
    T = len(answer["tokens"])
    assert (answer["layers"], answer["heads"], answer["shape"]) == ([5, 0], [3], [2, 1, T, T])
    got = [
        np.frombuffer(base64.b64decode(row[0]), "<f4").reshape(T, T) for row in answer["weights"]
    ]
    want = minilm.attentions(SENTENCE).weights
    assert np.array_equal(got[0], want[5, 3].numpy()) and np.array_equal(got[1], want[0, 3].numpy())


def test_trace_is_qkv_trace(client, minilm):
    body = {"text": SENTENCE, "query": "bank", "key": "river", "layer": 3, "head": 5}
    answer = client.post("/api/trace", json=body).json()
    want = qkv.trace(minilm, SENTENCE, "bank", "river", layer=3, head=5).to_dict()
    assert answer["model"] == "minilm"
    for name in ("query_vector", "key_vector", "weights", "contextualized", "model_output"):
        assert answer[name] == pytest.approx(want[name], abs=1e-9), name
    assert answer["attention_scalar"] == pytest.approx(want["attention_scalar"], rel=1e-12)
    assert answer["weight"] == pytest.approx(want["weight"]) and answer["chosen"] == "asked"
    chosen = client.post("/api/trace", json={"text": SENTENCE, "query": "bank", "key": "river"})
    assert (chosen.json()["layer"], chosen.json()["head"]) == (0, 10)  # where bank -> river peaks


def test_contributions_rank_the_traces_numbers(client, minilm):
    body = {"text": SENTENCE, "query": "bank", "layer": 0, "head": 10}
    answer = client.post("/api/contributions", json=body).json()
    want = qkv.trace(minilm, SENTENCE, "bank", "river", layer=0, head=10).contributions
    assert [c["weight"] for c in answer["contributions"]] == pytest.approx([c.weight for c in want])
    assert [c["size"] for c in answer["contributions"]] == pytest.approx([c.size for c in want])
    assert answer["by_weight"][0] == answer["tokens"].index("river") == answer["by_size"][0]
    assert sum(c["weight"] for c in answer["contributions"]) == pytest.approx(1.0)


def test_probe_compares_a_word_across_sentences(client, minilm):
    sentences = [SENTENCE, "The bank approved my loan.", "I sat on the grassy bank."]
    answer = client.post("/api/probe", json={"word": "bank", "sentences": sentences}).json()
    want = probe(minilm, "bank", sentences)
    assert answer["layers"] == want.layers
    assert torch.tensor(answer["similarity"]) == pytest.approx(want.similarity, abs=1e-6)
    labelled = client.post("/api/probe", json={"word": "bank"}).json()  # the built-in 16
    assert len(labelled["sentences"]) == 16 and labelled["accuracy"][-1] == 1.0


def test_a_decoders_next_token_probabilities(decoder_client, smollm2):
    body = {"model": "smollm2", "text": "The bank on the side of the", "top": 5}
    answer = decoder_client.post("/api/next", json=body).json()
    ids = torch.tensor([smollm2.encode(body["text"]).ids])
    with torch.inference_mode():
        want = smollm2.model(ids).logits[0, -1].softmax(-1)
    assert [n["id"] for n in answer["next"]] == want.topk(5).indices.tolist()
    assert [n["probability"] for n in answer["next"]] == pytest.approx(want.topk(5).values.tolist())
    assert answer["next"][0]["text"] == smollm2.tokenizer.decode([answer["next"][0]["id"]])
    # after "日", most likely tokens are a character's first bytes: named as bytes, never U+FFFD
    body = {"model": "smollm2", "text": "The capital of Japan is 日", "top": 10}
    shown = [n["text"] for n in decoder_client.post("/api/next", json=body).json()["next"]]
    assert not any("\ufffd" in t for t in shown)
    assert sum(re.fullmatch("(<0x[0-9A-F]{2}>)+", t) is not None for t in shown) >= 5


def test_generation_answered_whole_and_streamed_is_the_models(decoder_client, smollm2):
    body = {"model": "smollm2", "prompt": SENTENCE, "max_new_tokens": 8}
    want = smollm2.generate(SENTENCE, 8)
    whole = decoder_client.post("/api/generate", json=body).json()
    assert (whole["text"], whole["finished"]) == (want, "end")
    with decoder_client.stream("POST", "/api/generate/stream", json=body) as stream:
        assert stream.headers["content-type"].startswith("text/event-stream")
        events = sse(stream.iter_text())
    pieces = [data["text"] for kind, data in events if kind == "token"]
    assert len(pieces) >= 2 and "".join(pieces) == want
    assert events[-1] == ("done", whole)


def sse(chunks) -> list[tuple[str, dict]]:
    """Server-sent events -> [(event, data)]."""
    blocks = "".join(chunks).strip().split("\n\n")
    return [
        (block.split("\n")[0].removeprefix("event: "), json.loads(block.split("\n")[1][6:]))
        for block in blocks
    ]


LONG = "bank " * 200  # 200 words, 202 tokens with [CLS] and [SEP]: over 128


@pytest.mark.parametrize(
    ("path", "body", "status", "says"),
    [
        ("/api/attention", {"text": ""}, 422, "text: is empty or only spaces"),
        ("/api/attention", {"text": "   "}, 422, "text: is empty or only spaces"),
        ("/api/attention", {"text": "x" * 2001}, 413, "at most 2,000 (max_chars)"),
        ("/api/attention", {"text": LONG}, 413, "202 tokens; this server takes at most 128"),
        ("/api/attention", {"text": SENTENCE, "model": "gpt2"}, 422, "this server has: minilm"),
        ("/api/attention", {"text": SENTENCE, "model": "/etc/passwd"}, 422, "unknown model"),
        ("/api/attention", {"text": SENTENCE, "layers": [6]}, 422,
         "layer 6 is out of range: minilm has 6 layers (0-5)"),
        ("/api/attention", {"text": SENTENCE, "heads": [-1]}, 422,
         "heads[0]: Input should be greater than or equal to 0"),
        ("/api/attention", {"text": SENTENCE, "layers": []}, 422, "layers: List should have"),
        ("/api/attention", {"text": SENTENCE, "layers": "all"}, 422, "layers: Input should be"),
        ("/api/attention", {"text": SENTENCE, "path": "/etc"}, 422, "path: is not a field"),
        ("/api/attention", {}, 422, "text: is required"),
        ("/api/attention", {"text": SENTENCE, "format": "png"}, 422, "format: Input should be"),
        ("/api/trace", {"text": SENTENCE, "query": "bank", "key": "money"}, 422,
         "'money' is not a word of the text; its words are: The, bank"),
        ("/api/trace", {"text": SENTENCE, "query": "bank", "key": "river", "layer": 7}, 422,
         "layer 7 is out of range: minilm has 6 layers (0-5)"),
        ("/api/trace", {"text": SENTENCE, "query": "bank", "key": "river", "head": 12}, 422,
         "head 12 is out of range: minilm has 12 heads (0-11)"),
        ("/api/trace", {"text": SENTENCE + " the", "query": "the", "key": "bank"}, 422,
         "'the' occurs 4 times in the text; name one: the#1"),
        ("/api/trace", {"text": LONG, "query": "bank", "key": "bank#2"}, 413, "max_tokens"),
        ("/api/contributions", {"text": SENTENCE, "query": "bank", "layer": 0, "head": 99}, 422,
         "head 99 is out of range"),
        ("/api/contributions", {"text": SENTENCE, "query": "bank", "layer": 0}, 422,
         "head: is required"),
        ("/api/probe", {"word": "bank", "sentences": ["The river.", "A bank."]}, 422, "not a word"),
        ("/api/probe", {"word": "bank", "sentences": ["a bank"] * 33}, 413, "(max_sentences)"),
        ("/api/probe", {"word": "bank", "sentences": ["bank", LONG]}, 413, "sentence 1 has 202"),
        ("/api/probe", {"word": "", "sentences": ["a bank", "a bank"]}, 422, "word: is empty"),
        ("/api/next", {"text": SENTENCE}, 422, "no decoder (minilm: encoders)"),
        ("/api/next", {"text": SENTENCE, "model": "minilm"}, 422, "minilm is an encoder"),
        ("/api/next", {"text": SENTENCE, "top": 0}, 422, "top: Input should be greater"),
        ("/api/generate", {"prompt": SENTENCE}, 422, "no decoder (minilm: encoders)"),
        ("/api/generate/stream", {"prompt": SENTENCE, "model": "minilm"}, 422,
         "minilm is an encoder"),
    ],
)  # fmt: skip
def test_bad_input_gets_the_right_status_and_one_line(client, path, body, status, says):
    answer = client.post(path, json=body)
    assert answer.status_code == status, answer.text
    detail = answer.json()["detail"]
    assert isinstance(detail, str) and "\n" not in detail
    assert says in detail


@pytest.mark.parametrize("path", ["/api/attention", "/api/trace", "/api/generate/stream"])
def test_malformed_json_is_400_with_a_message(client, path):
    answer = client.post(
        path, content=b'{"text": "a",', headers={"content-type": "application/json"}
    )
    assert answer.status_code == 400
    assert answer.json()["detail"].startswith("the body is not valid JSON")


@pytest.mark.parametrize(
    ("body", "status", "says"),
    [
        ({"model": "smollm2", "prompt": SENTENCE, "max_new_tokens": 17}, 422,
         "max_new_tokens 17 is over this server's limit of 16"),
        ({"model": "smollm2", "prompt": ""}, 422, "prompt: is empty or only spaces"),
        ({"model": "smollm2", "prompt": SENTENCE, "temperature": -1}, 422, "temperature: "),
        ({"model": "smollm2", "prompt": SENTENCE, "top_p": 1.5}, 422, "top_p: "),
        ({"model": "smollm2", "prompt": LONG}, 413, "the prompt has 201 tokens"),
    ],
)  # fmt: skip
def test_bad_generation_is_refused_before_any_stream(decoder_client, body, status, says):
    for path in ("/api/generate", "/api/generate/stream"):
        answer = decoder_client.post(path, json=body)
        assert answer.status_code == status, answer.text
        assert says in answer.json()["detail"]


def test_the_openapi_page_describes_every_endpoint_from_local_files(client):
    spec = client.get("/openapi.json").json()
    paths = {
        "/api/models",
        "/api/attention",
        "/api/trace",
        "/api/why",
        "/api/contributions",
        "/api/probe",
        "/api/next",
        "/api/generate",
        "/api/generate/stream",
        "/api/hide",
        "/api/heads",
        "/api/long",
        "/api/long/head",
        "/api/long/region",
        "/api/tour",
    }
    assert set(spec["paths"]) == paths
    assert "AttentionRequest" in spec["components"]["schemas"]
    docs = client.get("/docs").text
    assert "/docs-assets/swagger-ui-bundle.js" in docs and "cdn" not in docs.lower()
    assert client.get("/docs-assets/swagger-ui-bundle.js").status_code == 200
    page = client.get("/").text
    assert "/static/app.js" in page and "http" not in page.replace('href="/docs"', "")


def test_an_app_served_again_after_it_stopped_still_computes(minilm):
    """Stopping an app shuts its worker threads; serving it again starts new ones (it once
    answered 500, "cannot schedule new futures after shutdown", to every later request)."""
    from fastapi.testclient import TestClient

    from qkv.serve import Limits, create_app

    app = create_app({"minilm": minilm}, Limits())
    for _ in range(2):
        with TestClient(app) as again:
            answer = again.post("/api/attention", json={"text": SENTENCE})
            assert answer.status_code == 200, answer.text


def test_an_app_served_twice_at_once_keeps_serving_when_one_stops(minilm):
    """A server started and stopped while a test client is open (the page's test beside the
    run-wide client) leaves the client its worker threads: it once shut them, and CI saw every
    later request of the client answered 500."""
    from fastapi.testclient import TestClient

    from qkv.serve import Limits, create_app

    app = create_app({"minilm": minilm}, Limits())
    with TestClient(app) as first:
        with TestClient(app) as second:
            assert second.post("/api/attention", json={"text": SENTENCE}).status_code == 200
        answer = first.post("/api/attention", json={"text": SENTENCE})
        assert answer.status_code == 200, answer.text
    assert app.state.qkv.serving == 0
    with pytest.raises(RuntimeError, match="after shutdown"):  # the last stop shut the threads
        app.state.qkv.pool.submit(int)
