"""The server's limits and its concurrency: time limits that really answer 504, generation
that stops at its time limit, body sizes counted however they are sent, and concurrent
requests (traces among them) on one model, with no lock, that each get their own numbers."""

from __future__ import annotations

import asyncio
import json
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch
from fastapi.testclient import TestClient

import qkv
from qkv.inspect.article import SENTENCE  # the article's sentence
from qkv.serve import Limits, create_app
from qkv.serve.compute import trace_pair


def test_a_request_past_its_time_limit_is_504_and_the_server_goes_on(minilm):
    app = create_app({"minilm": minilm}, Limits(timeout_s=0.2, workers=1))
    with TestClient(app) as client:
        release = threading.Event()
        app.state.qkv.pool.submit(release.wait, 5)  # the only worker is busy for over 0.2 s
        try:
            answer = client.post("/api/attention", json={"text": SENTENCE})
        finally:
            release.set()
        assert answer.status_code == 504
        assert "longer than this server's limit of 0.2 s (timeout_s)" in answer.json()["detail"]
        assert client.post("/api/attention", json={"text": SENTENCE}).status_code == 200


def test_generation_stops_at_its_time_limit_with_what_it_wrote(minilm, smollm2):
    app = create_app({"smollm2": smollm2}, Limits(generate_s=1e-9))
    body = {"prompt": SENTENCE, "max_new_tokens": 16}
    with TestClient(app) as client:
        whole = client.post("/api/generate", json=body).json()
        with client.stream("POST", "/api/generate/stream", json=body) as stream:
            text = "".join(stream.iter_text())
    assert whole["finished"] == "time limit" and whole["limit_s"] == 1e-9
    assert whole["text"] and smollm2.generate(SENTENCE, 16).startswith(whole["text"])
    assert text.count("event: token") == 1 and '"finished": "time limit"' in text


def test_a_second_generation_waits_its_turn_then_503(smollm2):
    app = create_app({"smollm2": smollm2}, Limits(timeout_s=0.2))
    served = app.state.qkv.models["smollm2"]

    async def busy_then_ask():
        lock = served.generation_lock()
        await lock.acquire()  # another request is generating
        try:
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://qkv") as client:
                return await client.post("/api/generate", json={"prompt": SENTENCE})
        finally:
            lock.release()

    answer = asyncio.run(busy_then_ask())
    assert answer.status_code == 503
    assert "smollm2 has been generating for another request" in answer.json()["detail"]


def test_a_body_over_the_limit_is_413_declared_or_chunked(minilm):
    app = create_app({"minilm": minilm}, Limits(max_body_bytes=100))
    body = json.dumps({"text": "bank " * 30}).encode()  # 163 bytes
    with TestClient(app) as client:
        declared = client.post("/api/attention", content=body)
        chunked = client.post("/api/attention", content=iter([body[:80], body[80:]]))
        small = client.post(
            "/api/attention",
            content=iter([b'{"text": ', b'"a bank"}']),
            headers={"content-type": "application/json"},
        )
    for answer in (declared, chunked):
        assert answer.status_code == 413
        assert "this server takes at most 100 (max_body_bytes)" in answer.json()["detail"]
    assert small.status_code == 200 and small.json()["tokens"] == ["[CLS]", "a", "bank", "[SEP]"]


def test_concurrent_requests_each_get_their_own_texts_numbers(minilm):
    """Attention and trace requests on one model at once, through the app."""
    app = create_app({"minilm": minilm}, Limits(workers=4))
    cues = {f"The bank on the side of the {place}": place for place in ("river", "lake", "pond")}
    cues |= {"I deposited money at the bank": "money", "The bank lent me a house": "house"}

    async def ask_all():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://qkv") as client:
            asks = []
            for _ in range(3):
                for text, cue in cues.items():
                    asks.append(client.post("/api/attention", json={"text": text, "layers": [2]}))
                    body = {"text": text, "query": "bank", "key": cue, "layer": 2, "head": 4}
                    asks.append(client.post("/api/trace", json=body))
            return await asyncio.gather(*asks)

    answers = [answer.json() for answer in asyncio.run(ask_all())]
    assert len(answers) == 30
    for answer in answers:
        if "shape" in answer:
            want = minilm.attentions(answer["text"]).weights[2]
            assert torch.tensor(answer["weights"][0]) == pytest.approx(want, abs=1e-6)
        else:
            want = qkv.trace(minilm, answer["text"], "bank", answer["key"], layer=2, head=4)
            assert answer["contextualized"] == pytest.approx(want.contextualized.tolist())
            assert answer["model_output"] == pytest.approx(want.model_output.tolist(), abs=1e-6)


@pytest.mark.parametrize("name", ["minilm", "smollm2"])
def test_traces_from_8_threads_at_once_equal_traces_one_at_a_time(name, request):
    """No lock and no hooks: 8 threads trace on one model at once (released together by a
    barrier into their forward passes) and get exactly the numbers of the same traces run
    one after another. Under the old hooks, the threads' passes overwrote each other's."""
    served = create_app({name: request.getfixturevalue(name)}).state.qkv.models[name]
    places = ("river", "lake", "pond", "sea", "stream", "canal", "road", "hill")
    texts = [f"The bank on the side of the {place}" for place in places]  # 8 texts
    limits = Limits()

    def ask(text: str) -> dict:  # the last word's attention to "bank": it differs by text
        return trace_pair(served, limits, text, text.split()[-1], "bank", None, None)

    alone = [ask(text) for text in texts]
    barrier = threading.Barrier(len(texts))

    def together(text: str) -> dict:
        barrier.wait(30)
        return ask(text)

    with ThreadPoolExecutor(len(texts)) as pool:
        at_once = list(pool.map(together, texts))
    assert at_once == alone
    assert len({json.dumps(answer["weights"]) for answer in at_once}) == len(texts)


def test_limits_are_checked():
    with pytest.raises(ValueError, match="max_tokens must be an integer >= 1, got 0"):
        Limits(max_tokens=0)
    with pytest.raises(ValueError, match="generate_s must be a number > 0"):
        Limits(generate_s=float("nan"))
    with pytest.raises(ValueError, match="encoders and decoders"):
        create_app({"x": object()})
    with pytest.raises(ValueError, match="one model at least"):
        create_app({})
