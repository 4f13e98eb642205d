"""/api/long, /api/long/head and /api/long/region: a text over max_tokens read from its
summaries. Their numbers are `summarize`'s and `region`'s called directly (and a region is
the slice of `record.weights()`); the work runs in a thread of its own (202, then 200); each
limit is a one-line 413 naming it; bad input is a one-line 422; each model keeps the texts it
read (its queue and its memory: test_long_turns.py). Small limits (max_tokens=16) and texts
of a few hundred tokens keep it fast."""

from __future__ import annotations

import base64
import threading

import numpy as np
import pytest
import torch
from fastapi.testclient import TestClient

from qkv.inspect.summaries import region, summarize
from qkv.serve import Limits, create_app

BASE = (
    "We walked for hours along the old towpath, past the mill, the lock and the row of "
    "cottages where the boatmen once lived. The water was high after a week of rain, brown "
    "and fast, carrying branches and leaves down towards the town. "
)
TEXT = BASE * 6  # 313 tokens on SmolLM2: over max_tokens = 16
OTHER = BASE * 5 + "By the afternoon the clouds had cleared."
LIMITS = Limits(max_tokens=16, max_long_tokens=600, max_long_chars=3_000, max_region=1_000)


@pytest.fixture(scope="module")
def app(minilm, smollm2):
    return create_app({"smollm2": smollm2, "minilm": minilm}, LIMITS)


@pytest.fixture(scope="module")
def client(app):
    with TestClient(app) as client:
        yield client


def read(client, text: str, model: str = "smollm2"):
    """/api/long's answer once the text is read: 202 (ask again) until then."""
    for _ in range(100):
        answer = client.post("/api/long", json={"model": model, "text": text})
        if answer.status_code != 202:
            return answer
    return answer


def refused(answer, status: int, *says: str) -> str:
    assert answer.status_code == status, answer.text[:300]
    detail = answer.json()["detail"]
    assert isinstance(detail, str) and "\n" not in detail
    for part in says:
        assert part in detail, (part, detail)
    return detail


@pytest.fixture(scope="module")
def seen(smollm2):
    # the server reads a long text's records alone (weights=False), so its forward pass is
    # this one to the last bit; attentions' default would make the weights in its own pass
    return smollm2.attentions(TEXT, weights=False)


@pytest.fixture(scope="module")
def want(seen):
    return summarize(seen)


def test_the_table_is_summarize_of_every_layer_and_head(client, seen, want):
    answer = read(client, TEXT)
    assert answer.status_code == 200, answer.text[:300]
    got = answer.json()
    T = len(seen.tokens)
    # each token as its decoder writes it (" walked", not "Ġwalked"), as summarize gives it
    assert got["tokens"] == seen.pieces == want.tokens and T > 256  # over 256 cells a side
    assert (got["layers"], got["heads"]) == (list(range(30)), list(range(9)))
    assert (got["query_bin"], got["key_bin"], got["top_k"]) == (2, 2, 5)
    assert got["mean_entropy"] == want.entropy.mean(-1).tolist()
    assert got["mean_first_token_mass"] == want.first_token_mass.mean(-1).tolist()
    most = want.received.topk(3, dim=-1)
    assert got["most_received_keys"] == most.indices.tolist()
    assert got["most_received"] == most.values.tolist()
    entropy = np.array(got["mean_entropy"])
    assert entropy.shape == (30, 9) and entropy.min() > 0 and entropy.max() < np.log(T)


@pytest.mark.parametrize("fmt", ["lists", "base64"])
def test_a_head_is_its_summaries(client, seen, want, fmt):
    assert read(client, TEXT).status_code == 200
    body = {"model": "smollm2", "text": TEXT, "layer": 7, "head": 4, "format": fmt}
    got = client.post("/api/long/head", json=body).json()
    T = len(seen.tokens)
    Rq = -(-T // 2)
    assert (got["layer"], got["head"], got["num_tokens"], got["shape"]) == (7, 4, T, [Rq, Rq])
    if fmt == "base64":
        heatmap = np.frombuffer(base64.b64decode(got["heatmap"]), "<f4").reshape(Rq, Rq)
        assert np.array_equal(heatmap, want.heatmap[7, 4].numpy())
    else:
        assert torch.equal(torch.tensor(got["heatmap"]), want.heatmap[7, 4])
        heatmap = np.array(got["heatmap"], dtype=np.float32)
    for name in ("entropy", "first_token_mass", "top_keys", "top_weights", "received"):
        assert got[name] == getattr(want, name)[7, 4].tolist(), name
    # each cell is the largest weight of its 2 x 2 block of the full matrix (the last: 1 x 1)
    full = torch.nn.functional.pad(seen.records[7].weights([4])[0, 0], (0, 1, 0, 1))  # (314, 314)
    blocks = full.reshape(Rq, 2, Rq, 2).amax(dim=(1, 3))
    assert np.array_equal(heatmap, blocks.numpy())


def test_a_region_is_region_and_the_slice_of_the_weights(client, seen):
    assert read(client, TEXT).status_code == 200
    body = {"model": "smollm2", "text": TEXT, "layer": 12, "head": 2,
            "queries": [250, 280], "keys": [0, 30]}  # fmt: skip
    got = client.post("/api/long/region", json=body).json()
    want = region(seen.records[12], queries=(250, 280), keys=(0, 30), heads=[2])[0]
    assert (got["queries"], got["keys"], got["shape"]) == ([250, 280], [0, 30], [30, 30])
    assert torch.equal(torch.tensor(got["weights"]), want)
    full = seen.records[12].weights([2])[0, 0]  # (T, T)
    assert torch.tensor(got["weights"]) == pytest.approx(full[250:280, 0:30], abs=1e-6)
    assert (got["query_tokens"], got["key_tokens"]) == (seen.pieces[250:280], seen.pieces[:30])
    packed = client.post("/api/long/region", json={**body, "format": "base64"}).json()
    weights = np.frombuffer(base64.b64decode(packed["weights"]), "<f4").reshape(30, 30)
    assert np.array_equal(weights, want.numpy())
    causal = client.post("/api/long/region", json={**body, "queries": [0, 30]}).json()
    assert np.triu(np.array(causal["weights"]), 1).max() == 0  # a decoder's later keys: 0


def test_the_work_runs_in_its_own_thread_202_then_200(minilm, smollm2):
    app = create_app({"smollm2": smollm2}, Limits(max_tokens=16, timeout_s=0.2))
    slot = app.state.qkv.models["smollm2"].long
    release, reading_of, reads = threading.Event(), slot._read, []

    def held(pretrained, run, going):  # the model's readings wait until released
        release.wait(30)
        reading_of(pretrained, run, going)
        reads.append((run.text, run.error))

    slot._read = held
    body = {"text": OTHER}
    SHORT = BASE * 2  # 104 tokens
    with TestClient(app) as client:
        try:
            reading = client.post("/api/long", json=body)
            waiting = client.post("/api/long", json={"text": SHORT})
            head = client.post("/api/long/head", json={**body, "layer": 0, "head": 0})
            square = {"layer": 0, "head": 0, "queries": [0, 2], "keys": [0, 2]}
            region_ = client.post("/api/long/region", json={**body, **square})
            again = client.post("/api/long", json=body)  # its place, not a new reading
        finally:
            release.set()
        answer = read(client, OTHER)
        short = read(client, SHORT)
    for answer_ in (reading, waiting, again):
        assert answer_.status_code == 202 and answer_.headers["retry-after"] == "1"
    T, T_short = len(smollm2.encode(OTHER).ids), len(smollm2.encode(SHORT).ids)
    assert reading.json() == again.json() == {
        "model": "smollm2", "tokens": T, "ahead": 0, "layers_done": 0, "num_layers": 30,
        "detail": f"smollm2 is reading this text of {T} tokens (the forward pass); "
                  "ask again"}  # fmt: skip
    assert waiting.json() == {
        "model": "smollm2", "tokens": T_short, "ahead": 1, "layers_done": 0, "num_layers": 30,
        "detail": f"smollm2 is reading this text of {T_short} tokens (waiting for its turn: 1 "
                  "long text before it); ask again"}  # fmt: skip
    refused(head, 503, "smollm2 is reading this text")
    refused(region_, 503, "smollm2 is reading this text")
    assert answer.status_code == 200 and len(answer.json()["tokens"]) == T
    assert short.status_code == 200 and len(short.json()["tokens"]) == T_short
    assert reads == [(OTHER, None), (SHORT, None)]  # each read once, in turn, to its end


def test_each_model_keeps_the_texts_it_read(app, client, smollm2):
    slot = app.state.qkv.models["smollm2"].long
    assert read(client, TEXT).status_code == 200
    assert read(client, OTHER).status_code == 200  # within max_long_kept_bytes: both kept
    for text in (TEXT, OTHER):
        head = {"model": "smollm2", "text": text, "layer": 0, "head": 0}
        assert client.post("/api/long/head", json=head).status_code == 200
    never = {"model": "smollm2", "text": BASE * 3, "layer": 0, "head": 0}
    refused(client.post("/api/long/head", json=never), 409, "POST /api/long with it again")
    region_ = {**never, "queries": [0, 4], "keys": [0, 4]}
    refused(client.post("/api/long/region", json=region_), 409, "POST /api/long with it again")
    # another model keeps its own
    assert read(client, TEXT, "minilm").status_code == 200
    assert TEXT in slot._runs and TEXT in app.state.qkv.models["minilm"].long._runs
    assert BASE * 3 not in slot._runs  # a head or a region asked for reads nothing


def test_one_limit_is_one_status_whatever_the_length_of_the_text(client):
    """MiniLM reads 512 tokens: a text over the server's max_long_tokens (600) or max_tokens
    (16) is 413 naming that limit even when it is over MiniLM's window too (issue 32: it was
    422 then); a text within the server's limit and over the model's window is 422."""
    over = client.post("/api/long", json={"model": "minilm", "text": "a " * 700})
    refused(over, 413, "the text has 702 tokens", "at most 600 of a long text (max_long_tokens)")
    assert over.json()["limit"] == "max_long_tokens"
    head = client.post("/api/long/head", json={"model": "minilm", "text": "a " * 700,
                                               "layer": 0, "head": 0})  # fmt: skip
    refused(head, 413, "(max_long_tokens)")
    short = client.post("/api/attention", json={"model": "minilm", "text": "a " * 600})
    refused(short, 413, "the text has 602 tokens", "(max_tokens)")
    assert short.json()["limit"] == "max_tokens"
    window = client.post("/api/long", json={"model": "minilm", "text": "bank " * 560})
    refused(window, 422, "the text has 562 tokens; minilm reads at most 512")


def test_the_limits_are_each_a_one_line_413_naming_it(client, smollm2):
    over = BASE * 13  # 677 tokens, 2,990 characters
    answer = client.post("/api/long", json={"text": over})
    refused(answer, 413, "the text has 677 tokens", "at most 600 of a long text (max_long_tokens)")
    assert answer.json()["limit"] == "max_long_tokens"
    answer = client.post("/api/long", json={"text": "a " * 1501})
    refused(answer, 413, "3,002 characters", "(max_long_chars)")
    assert answer.json()["limit"] == "max_long_chars"
    big = client.post("/api/long", json={"text": "a " * 90_000})  # 180 kB: over 160 KiB
    refused(big, 413, "at most 163,840 (max_long_body_bytes)")
    assert big.json()["limit"] == "max_long_body_bytes"
    short = client.post("/api/attention", json={"text": "a " * 40_000})  # the others: 64 KiB
    refused(short, 413, "at most 65,536 (max_body_bytes)")
    attention = client.post("/api/attention", json={"model": "smollm2", "text": TEXT})
    refused(attention, 413, "at most 16 (max_tokens)")
    assert attention.json()["limit"] == "max_tokens"  # what tells the page to read it long
    assert read(client, TEXT).status_code == 200
    body = {"model": "smollm2", "text": TEXT, "layer": 0, "head": 0}
    wide = client.post("/api/long/region", json={**body, "queries": [0, 40], "keys": [0, 26]})
    refused(wide, 413, "queries 0:40 x keys 0:26 are 1,040 weights", "at most 1,000 in one "
            "region (max_region)")  # fmt: skip
    fits = client.post("/api/long/region", json={**body, "queries": [0, 40], "keys": [0, 25]})
    assert fits.status_code == 200 and fits.json()["shape"] == [40, 25]


@pytest.mark.parametrize(
    ("path", "extra", "says"),
    [
        ("/api/long/head", {"layer": 30, "head": 0}, "layer 30 is out of range: smollm2 has 30"),
        ("/api/long/head", {"layer": 0, "head": 9}, "layer 0 of smollm2 has 9 heads"),
        ("/api/long/head", {"layer": -1, "head": 0}, "layer: Input should be greater than"),
        ("/api/long/head", {"layer": 0}, "head: is required"),
        ("/api/long/region", {"layer": 0, "head": 0, "queries": [5, 2], "keys": [0, 4]},
         "queries 5:2 is not a range within 0:313"),
        ("/api/long/region", {"layer": 0, "head": 0, "queries": [0, 4], "keys": [290, 314]},
         "keys 290:314 is not a range within 0:313"),
        ("/api/long/region", {"layer": 0, "head": 0, "queries": [0, 4, 8], "keys": [0, 4]},
         "queries: List should have at most 2 items"),
        ("/api/long/region", {"layer": 0, "head": 0, "queries": [0, 4]}, "keys: is required"),
        ("/api/long/region", {"layer": 0, "head": 0, "queries": [0, 4], "keys": [0, True]},
         "keys[1]: Input should be a valid integer"),
    ],
)  # fmt: skip
def test_bad_layers_heads_and_ranges_are_a_one_line_422(client, path, extra, says):
    assert read(client, TEXT).status_code == 200
    refused(client.post(path, json={"model": "smollm2", "text": TEXT, **extra}), 422, says)


def test_bad_texts_are_refused_before_any_work(client):
    refused(client.post("/api/long", json={"text": "  "}), 422, "text: is empty")
    refused(client.post("/api/long", json={"text": "a", "model": "gpt2"}), 422, "unknown model")
    too_long = "bank " * 560  # 562 tokens: within max_long_tokens, over MiniLM's 512
    refused(client.post("/api/long", json={"model": "minilm", "text": too_long}), 422,
            "the text has 562 tokens; minilm reads at most 512")  # fmt: skip


def test_the_schema_states_the_long_limits(client):
    spec = client.get("/openapi.json").json()
    assert {"/api/long", "/api/long/head", "/api/long/region"} <= set(spec["paths"])
    schemas = spec["components"]["schemas"]
    assert schemas["LongRequest"]["properties"]["text"]["maxLength"] == 3_000
    assert schemas["LongRegionRequest"]["properties"]["text"]["maxLength"] == 3_000
    assert schemas["AttentionRequest"]["properties"]["text"]["maxLength"] == 2_000
    assert "202" in spec["paths"]["/api/long"]["post"]["responses"]
    assert "409" in spec["paths"]["/api/long/head"]["post"]["responses"]
    limits = client.get("/api/models").json()["limits"]
    assert (limits["max_long_tokens"], limits["max_region"]) == (600, 1_000)
