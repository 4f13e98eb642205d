"""The server's trace says what the layer's matrices multiply in `qkv.viz.step_words`' words."""

from __future__ import annotations

from qkv.viz.step_words import multiplied


def test_the_trace_answer_names_the_vector_entering_the_layer(client):
    body = {"text": "The bank on the side of the river", "query": "bank", "key": "river",
            "layer": 2, "head": 1}  # fmt: skip
    answer = client.post("/api/trace", json=body).json()
    assert answer["layer"] == 2
    assert answer["multiplies"] == {role: multiplied(role, 2) for role in ("query", "key", "value")}
    assert "entering layer 2" in answer["multiplies"]["query"]
