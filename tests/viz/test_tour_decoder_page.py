"""The tour page of a decoder (SmolLM2: rotary positions, grouped key/value heads) in Chromium,
offline: every step drawn without a script error, every number shown the tour's, each
experiment's result in place, a rotated query box showing the record's rotated query."""

from __future__ import annotations

import json

import pytest

from browser import flat, offline
from qkv.inspect.tour import STEPS, tour
from qkv.viz.tour import render_tour

TEXT = "When Mary and John went to the store, John gave a drink to"


@pytest.fixture(scope="module")
def found(smollm2):
    return tour(smollm2, TEXT)


def test_a_decoders_tour_page(found, smollm2, tmp_path):
    path = tmp_path / "tour.html"
    path.write_text(render_tour(found), encoding="utf-8")
    with offline(path) as page:
        errors: list[str] = []
        page.on("pageerror", lambda error: errors.append(str(error)))
        for step in found.steps:
            page.click(f"#steps button[data-step='{step.id}']")
            assert page.evaluate("document.body.dataset.step") == step.id
            shown = page.eval_on_selector_all(
                "#step [data-value]", "ns => ns.map(n => JSON.parse(n.dataset.value))"
            )
            known = set(flat(step.numbers))
            known |= {x * 1e3 for x in flat(step.numbers) if isinstance(x, float)}
            assert [x for x in shown if x not in known] == [], step.id
            for experiment in step.experiments:
                where = f"#step .experiment[data-experiment='{experiment['id']}']"
                page.click(f"{where} button")
                assert experiment["says"] in page.inner_text(f"{where} .result")
        assert [s.id for s in found.steps] == list(STEPS)
        record = smollm2.attentions(TEXT).records[found.layer]
        kv = found.head // record.shape.group
        for box, tensor in (("L.q_rotary", record.q[0, found.head, found.query_index]),
                            ("L.k", record.k_before_rotary[0, kv, found.query_index])):  # fmt: skip
            page.click(f"#diagram .box[data-box='{box}']")
            values = json.loads(page.get_attribute("#box-tensor .vec", "data-values"))
            assert values == [float(x) for x in tensor.double()]
        assert "rotate" in found.step("embeddings").says
        assert errors == []
