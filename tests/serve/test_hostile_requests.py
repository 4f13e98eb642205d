"""Hostile input against a real server on loopback (issue 14): each class of bad request is
refused where it enters, in one line, before any work; an answer's size is known before it
is computed; a request past its time limit stops its work; and schemathesis, sending what
/openapi.json allows and what it does not, finds no answer the schema does not promise."""

from __future__ import annotations

import json
import logging
import os
import re
import resource
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

import qkv
from hostile import DEFAULT_MEMORY_GB
from qkv.inspect.article import SENTENCE  # the article's sentence
from qkv.serve import Limits, create_app, running

LIMITS = Limits(max_new_tokens=4, max_weights=100_000)
LONG = " ".join(["bank river money"] * 8)  # 24 words: SmolLM2's 270 heads see 155,520 weights


@pytest.fixture(scope="module")
def server(minilm, smollm2):
    app = create_app({"minilm": minilm, "smollm2": smollm2}, LIMITS)
    with running(app) as url, httpx.Client(base_url=url, timeout=60) as client:
        yield client


def refused(answer: httpx.Response, status: int, *says: str) -> str:
    """The server said no, with `status` and one line naming what was wrong."""
    assert answer.status_code == status, answer.text[:300]
    assert len(answer.content) < 1000  # a refusal, not an answer
    detail = answer.json()["detail"]
    assert isinstance(detail, str) and "\n" not in detail
    for part in says:
        assert part in detail, (part, detail)
    return detail


# ------------------------------------------------------------------ repeats and answer sizes


REPEATS = [
    ("/api/attention", {"text": SENTENCE, "layers": [0, 1, 2, 3, 4, 5] * 4,
                        "heads": list(range(12)) * 4}, "layers: 0 is given twice"),
    ("/api/attention", {"text": SENTENCE, "heads": [3, 1, 3]}, "heads: 3 is given twice"),
    ("/api/attention", {"text": SENTENCE, "layers": [2, 2.0]}, "layers: 2 is given twice"),
]  # fmt: skip


@pytest.mark.parametrize(("path", "body", "says"), REPEATS)
def test_repeated_layers_or_heads_are_refused_by_name(server, path, body, says):
    """The issue's 819-byte body asked a 91 MB answer (6 layers x 4, 12 heads x 4)."""
    refused(server.post(path, json=body), 422, says, "name each once")


def test_an_answer_over_max_weights_is_refused_before_the_forward_pass(server, smollm2):
    T = len(smollm2.encode(LONG).ids)
    body = {"model": "smollm2", "text": LONG, "format": "base64"}
    refused(
        server.post("/api/attention", json=body),
        413,
        f"30 layers x 9 heads x {T} x {T} tokens are {270 * T * T:,} weights",
        "at most 100,000 in one answer (max_weights)",
    )
    fewer = server.post("/api/attention", json={**body, "layers": [0, 29], "heads": [8]})
    assert fewer.status_code == 200 and fewer.json()["shape"] == [2, 1, T, T]


SERVE_ON_ANY_PORT = """
import qkv
from qkv.serve import bind, create_app, serve
from qkv.serve.server import address
sock = bind("127.0.0.1", 0)
print(address(sock), flush=True)
serve(create_app({"minilm": qkv.load("minilm")}), sock, quiet=True)
"""


def test_a_thousand_repeats_are_refused_by_a_server_under_a_memory_limit():
    """The issue's x1000 body (56 kB) made the server try to allocate 428 GB. Here the server
    is a child process whose address space is capped, so the old code fails fast with a 500
    instead of hurting the machine; the refusal must come first."""
    size = int(DEFAULT_MEMORY_GB * 2**30)
    child = subprocess.Popen(
        [sys.executable, "-c", SERVE_ON_ANY_PORT],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(Path(qkv.__file__).parents[1])},  # this qkv
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_AS, (size, size)),
    )
    try:
        url = child.stdout.readline().strip()
        assert url.startswith("http://127.0.0.1:"), child.stderr.read()[-3000:]
        body = {"text": SENTENCE, "layers": list(range(6)) * 1000, "heads": list(range(12)) * 1000}
        assert len(json.dumps(body)) < Limits().max_body_bytes  # within the body limit
        answer = httpx.post(url + "/api/attention", json=body, timeout=60)
        refused(answer, 422, "layers: 0 is given twice")
        assert httpx.post(url + "/api/attention", json={"text": "a bank"}).status_code == 200
    finally:
        child.terminate()
        child.communicate(timeout=30)


# ------------------------------------------------------------------ text that is not text


SURROGATE = "\ud800"  # valid JSON ("\\ud800"), not text: UTF-8 cannot hold it
TEXTS = [
    ("/api/attention", {"text": SURROGATE}, "text"),
    ("/api/attention", {"text": SENTENCE, "model": SURROGATE}, "model"),
    ("/api/trace", {"text": SENTENCE + SURROGATE, "query": "bank", "key": "river"}, "text"),
    ("/api/trace", {"text": SENTENCE, "query": "bank" + SURROGATE, "key": "river"}, "query"),
    ("/api/trace", {"text": SENTENCE, "query": "bank", "key": SURROGATE}, "key"),
    ("/api/contributions", {"text": SURROGATE, "query": "bank", "layer": 0, "head": 0}, "text"),
    ("/api/probe", {"word": "bank", "sentences": ["a bank", SURROGATE]}, "sentences[1]"),
    ("/api/probe", {"word": "bank", "sentences": ["a bank", "the bank"],
                    "labels": ["x", SURROGATE]}, "labels[1]"),
    ("/api/next", {"model": "smollm2", "text": SURROGATE}, "text"),
    ("/api/generate", {"model": "smollm2", "prompt": SURROGATE}, "prompt"),
    ("/api/generate", {"model": "smollm2", "prompt": "a", "stop": [SURROGATE]}, "stop[0]"),
    ("/api/generate/stream", {"model": "smollm2", "prompt": "a" + SURROGATE}, "prompt"),
]  # fmt: skip


@pytest.mark.parametrize(("path", "body", "field"), TEXTS)
def test_a_lone_surrogate_in_any_string_is_422_naming_the_field(server, path, body, field):
    content = json.dumps(body).encode()  # json.dumps writes it as the escape "\\ud800"
    answer = server.post(path, content=content, headers={"content-type": "application/json"})
    detail = refused(answer, 422, "is a lone surrogate (U+D800)")
    assert detail.startswith(f"{field}: character "), detail


# ------------------------------------------------------------------ numbers that are not numbers


NOT_WHOLE = [
    ("/api/trace", {"text": SENTENCE, "query": "bank", "key": "river", "head": False}, "head"),
    ("/api/trace", {"text": SENTENCE, "query": "bank", "key": "river", "layer": True}, "layer"),
    ("/api/trace", {"text": SENTENCE, "query": "bank", "key": "river", "layer": "1"}, "layer"),
    ("/api/attention", {"text": SENTENCE, "layers": [True]}, "layers[0]"),
    ("/api/contributions", {"text": SENTENCE, "query": "bank", "layer": 0, "head": 1.5}, "head"),
    ("/api/next", {"model": "smollm2", "text": "a", "top": "5"}, "top"),
    ("/api/generate", {"model": "smollm2", "prompt": "a", "max_new_tokens": True},
     "max_new_tokens"),
    ("/api/generate", {"model": "smollm2", "prompt": "a", "temperature": "1"}, "temperature"),
]  # fmt: skip


@pytest.mark.parametrize(("path", "body", "field"), NOT_WHOLE)
def test_booleans_strings_and_fractions_are_not_whole_numbers(server, path, body, field):
    detail = refused(server.post(path, json=body), 422)
    assert detail.startswith(f"{field}: Input should be a valid "), detail


def test_whole_floats_are_whole_numbers_as_json_schema_says(server, minilm):
    body = {"text": SENTENCE, "query": "bank", "key": "river", "layer": 3.0, "head": 5.0}
    answer = server.post("/api/trace", json=body).json()
    assert (answer["layer"], answer["head"], answer["chosen"]) == (3, 5, "asked")


# ------------------------------------------------------------------ sampling


@pytest.mark.parametrize("path", ["/api/generate", "/api/generate/stream"])
def test_a_tiny_temperature_samples_the_most_likely_tokens(server, smollm2, path):
    body = {"model": "smollm2", "prompt": SENTENCE, "max_new_tokens": 4, "temperature": 1e-300}
    answer = server.post(path, json={**body, "seed": 1})
    assert answer.status_code == 200, answer.text[:300]
    greedy = smollm2.generate(SENTENCE, 4)
    if path == "/api/generate":
        assert answer.json()["text"] == greedy
    else:
        assert "event: error" not in answer.text and json.dumps(greedy)[1:-1] in answer.text


# ------------------------------------------------------------------ the time limit


def test_work_past_its_time_limit_stops_instead_of_running_on(smollm2, caplog):
    """One worker, a 0.25 s limit, and an answer that takes seconds to compute and encode
    (all 270 heads of SmolLM2 at 123 tokens, as lists): 504, and its work stops at its next
    step (the old code ran it to the end, holding the worker, after the 504)."""
    app = create_app({"smollm2": smollm2}, Limits(timeout_s=0.25, workers=1))
    text = " ".join(["bank river money"] * 41)
    with caplog.at_level(logging.INFO, "qkv.serve"), running(app) as url:
        answer = httpx.post(url + "/api/attention", json={"text": text}, timeout=60)
        refused(answer, 504, "longer than this server's limit of 0.25 s", "was stopped")
        app.state.qkv.pool.submit(lambda: None).result(60)  # the worker is free again
    stopped = [r.getMessage() for r in caplog.records if "time limit" in r.getMessage()]
    assert stopped == ["/api/attention stopped at its time limit"]


# ------------------------------------------------------------------ the schema says it all


def test_the_openapi_schema_states_this_servers_limits_and_models(server):
    schemas = server.get("/openapi.json").json()["components"]["schemas"]
    attention = schemas["AttentionRequest"]["properties"]
    assert attention["text"]["maxLength"] == LIMITS.max_chars and attention["text"]["pattern"]
    layers = attention["layers"]["anyOf"][0]  # SmolLM2's 30 layers are the most
    assert (layers["minItems"], layers["maxItems"], layers["uniqueItems"]) == (1, 30, True)
    assert (layers["items"]["minimum"], layers["items"]["maximum"]) == (0, 29)
    assert attention["model"]["anyOf"][0]["enum"] == ["minilm", "smollm2"]
    generate = schemas["GenerateRequest"]["properties"]
    assert generate["model"]["anyOf"][0]["enum"] == ["smollm2"]  # the one that generates
    assert generate["max_new_tokens"]["anyOf"][0]["maximum"] == LIMITS.max_new_tokens
    assert generate["stop"]["items"]["maxLength"] == LIMITS.max_chars
    probe = schemas["ProbeRequest"]["properties"]
    assert probe["sentences"]["anyOf"][0]["maxItems"] == LIMITS.max_sentences
    assert probe["word"]["minLength"] if "minLength" in probe["word"] else probe["word"]["pattern"]
    assert "x-qkv-limit" not in json.dumps(schemas)


# ------------------------------------------------------------------ schemathesis

SCHEMATHESIS = """
# Statuses a request may get beyond schemathesis's defaults, and why.
[checks.negative_data_rejection]
# a string or list over this server's max_chars or max_sentences is 413, the size limits' code
expected-statuses = ["400", "413", "422"]

[[operations]]
# what no schema can say: a word of the text or a token position in it, a layer or head of the
# model chosen (the schema gives the largest model's), one label per sentence, a tour's target
# text (for encoder-decoder models only)
include-path = ["/api/attention", "/api/trace", "/api/why", "/api/contributions", "/api/probe",
                "/api/hide", "/api/tour"]
checks.positive_data_acceptance.expected-statuses = ["200", "422"]

[[operations]]
# a model's census is counted once, in a thread of its own: until it is, a request is told 503
include-path = "/api/heads"
checks.positive_data_acceptance.expected-statuses = ["200", "503"]

[[operations]]
# a long text is read in its turn, in a thread of its own: 202 until it is (503 while
# max_long_waiting texts wait already); a head or a region of a text not read first (or
# evicted) is 409, of one being read 503, and its ranges depend on the text (422)
include-path = ["/api/long", "/api/long/head", "/api/long/region"]
checks.positive_data_acceptance.expected-statuses = ["200", "202", "409", "422", "503"]

[[operations]]
# the same request and the same checks as /api/generate, whose coverage cases (each a
# generation) are the slowest of the run; its examples and fuzzing still run
include-path = "/api/generate/stream"
phases.coverage.enabled = false
"""


def test_schemathesis_finds_nothing_the_schema_does_not_promise(minilm, smollm2, tmp_path):
    """Every default check (no server error, documented statuses and bodies, data the schema
    refuses is refused, data it allows is answered) on every endpoint, with small limits so
    each case is fast: the 12 characters of a text are at most 50 of SmolLM2's tokens."""
    limits = Limits(max_chars=12, max_new_tokens=1, max_sentences=2, max_long_chars=24)
    app = create_app({"minilm": minilm, "smollm2": smollm2}, limits)
    (tmp_path / "schemathesis.toml").write_text(SCHEMATHESIS)
    command = [str(Path(sys.executable).parent / "schemathesis"), "--no-color"]
    command += ["--config-file", str(tmp_path / "schemathesis.toml"), "run"]
    with running(app) as url:
        command += [url + "/openapi.json", "--max-examples", "2", "--seed", "14", "--no-shrink"]
        result = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
    assert re.search(r"\d+ generated, \d+ passed", result.stdout), result.stdout[-3000:]
