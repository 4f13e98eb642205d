"""The server on a model with linear layers of more heads than its full layer (as Qwen3.5's):
the answer sends a linear layer's effective weights as the page draws them (each row's shares
of |w|) and says so, a head a layer lacks is null, and the page says "effective weights
(linear attention)" and offers each layer its own heads."""

from __future__ import annotations

import base64

import numpy as np
import pytest
import torch
from fastapi.testclient import TestClient

import qkv
from browser import served, submit
from linear_models import wide_linear_model
from qkv.serve import Limits, create_app
from variant_models import TEXT


@pytest.fixture(scope="module")
def wide():
    return wide_linear_model()  # layers 0, 1 linear of 4 heads, layer 2 full of 2


@pytest.fixture(scope="module")
def app(wide):
    return create_app({"wide": wide}, Limits())


@pytest.fixture(scope="module")
def client(app):
    with TestClient(app) as client:
        yield client


def test_the_model_says_each_layers_heads(client):
    (model,) = client.get("/api/models").json()["models"]
    assert model["num_heads"] == 4 and model["heads_per_layer"] == [4, 4, 2]


def test_linear_layers_are_sent_as_shares_and_said_so(client, wide):
    answer = client.post("/api/attention", json={"text": TEXT}).json()
    assert answer["effective_layers"] == [0, 1]
    assert "keep a running memory (linear attention)" in answer["effective"]
    assert "shares of the absolute effective weight" in answer["effective"]
    assert answer["shape"] == [3, 4, 9, 9]
    assert answer["weights"][2][2] is None and answer["weights"][2][3] is None
    effective = wide.attentions(TEXT).records[0].weights()[0].double()  # (4, T, T), signed
    assert bool((effective < 0).any())
    shares = effective.abs() / effective.abs().sum(-1, keepdim=True)
    got = torch.tensor(answer["weights"][0], dtype=torch.float64)
    assert bool((got >= 0).all())
    torch.testing.assert_close(got, shares, atol=1e-6, rtol=0)
    full = wide.attentions(TEXT).weights[2, :2]  # the softmax layer as it is
    assert torch.tensor(answer["weights"][2][:2]) == pytest.approx(full, abs=1e-7)


def test_base64_sends_null_for_a_head_a_layer_lacks(client):
    body = {"text": TEXT, "layers": [2, 0], "heads": [3], "format": "base64"}
    answer = client.post("/api/attention", json=body).json()
    assert answer["weights"][0] == [None] and answer["effective_layers"] == [0]
    shares = np.frombuffer(base64.b64decode(answer["weights"][1][0]), "<f4").reshape(9, 9)
    assert np.allclose(shares[1:].sum(-1), 1.0, atol=1e-5)  # shares of |w| in each row


def test_a_softmax_only_answer_says_nothing_of_effective_weights(client):
    answer = client.post("/api/attention", json={"text": TEXT, "layers": [2]}).json()
    assert answer["effective"] is None and answer["effective_layers"] == []
    assert answer["heads"] == [0, 1]  # the heads of the layers asked
    refused = client.post("/api/attention", json={"text": TEXT, "layers": [2], "heads": [3]})
    assert refused.status_code == 422
    assert "head 3 is out of range: layer 2 of wide has 2 heads" in refused.json()["detail"]


def test_hide_rows_are_each_layers_own_heads(client, wide):
    answer = client.post("/api/hide", json={"text": TEXT, "key": "bank", "query": "deep"}).json()
    assert answer["effect"][2][2:] == [None, None] and None not in answer["effect"][0]
    alone = qkv.hide(wide, TEXT, "bank", query="deep")
    assert answer["effect"][0] == pytest.approx(alone.effect[0].tolist(), rel=1e-6)


@pytest.mark.parametrize("path", ["/api/contributions", "/api/trace"])
def test_a_head_a_layer_lacks_is_refused_by_the_layers_count(client, path):
    body = {"text": TEXT, "query": "deep", "layer": 2, "head": 3}
    if path == "/api/trace":
        body["key"] = "bank"
    answer = client.post(path, json=body)
    assert answer.status_code == 422, answer.text
    assert "head 3 is out of range: layer 2 of " in answer.json()["detail"]
    assert "has 2 heads (0-1)" in answer.json()["detail"]


def test_the_page_says_effective_weights_and_offers_each_layer_its_heads(app):
    with served(app) as page:
        submit(page, TEXT)
        shown = page.inner_text("#effective")
        assert shown.startswith("Effective weights (linear attention): layers 0, 1 keep")
        assert page.is_visible("#effective")
        page.select_option("#head", "3")
        page.select_option("#layer", "2")  # a layer of 2 heads: head 3 is not one of its own
        assert page.eval_on_selector("#head", "s => s.value") == "1"
        disabled = page.eval_on_selector_all("#head option", "os => os.map(o => o.disabled)")
        assert disabled == [False, False, True, True]
        assert page.locator("#grid .thumb").count() == 4 + 4 + 2
        assert "no head 3" in page.inner_text("#grid")
