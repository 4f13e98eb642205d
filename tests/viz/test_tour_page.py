"""The tour page in Chromium, offline from file://: every number shown is the library's, each
step is reached by the keyboard with its diagram boxes lit, each experiment shows the library's
result, a click on a box shows its real tensor, and nothing is asked of the network."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

import qkv
from browser import flat, offline
from qkv.inspect.article import SENTENCE
from qkv.inspect.probe import probe
from qkv.inspect.tour import STEPS, tour
from qkv.viz import escape
from qkv.viz.tour import render_tour, write_tour

# the screenshots go to a test folder; docs/images/tour-*.png are made by running this file
# with QKV_TOUR_IMAGES=docs/images (docs/tour.md), so a test run leaves the repository as it was
IMAGES = os.environ.get("QKV_TOUR_IMAGES")


@pytest.fixture(scope="module")
def bank(minilm):
    return tour(minilm, SENTENCE)


@pytest.fixture(scope="module")
def page(bank, tmp_path_factory):
    path = tmp_path_factory.mktemp("tour") / "tour.html"
    path.write_text(render_tour(bank), encoding="utf-8")
    with offline(path, {"width": 1200, "height": 800}) as shown:  # asserts no outside request
        errors: list[str] = []
        shown.on("pageerror", lambda error: errors.append(str(error)))
        yield shown
        assert errors == [], errors  # the script ran without an error throughout


def _go(page, step: str) -> None:
    page.click(f"#steps button[data-step='{step}']")
    assert page.evaluate("document.body.dataset.step") == step


def test_every_step_by_keyboard_lit_and_photographed(page, bank, tmp_path):
    page.click("#steps button[data-step='tokens']")
    images = Path(IMAGES) if IMAGES else tmp_path
    images.mkdir(parents=True, exist_ok=True)
    for step in STEPS:
        assert page.evaluate("document.body.dataset.step") == step
        lit = page.eval_on_selector_all("#diagram .box.lit", "gs => gs.map(g => g.dataset.box)")
        assert sorted(lit) == sorted(bank.diagram.lit(step))
        page.evaluate("window.scrollTo(0, 0)")
        shot = images / f"tour-{step}.png"
        page.screenshot(path=str(shot))
        assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        page.keyboard.press("ArrowRight")
    assert page.evaluate("document.body.dataset.step") == STEPS[-1]  # the last step stays
    page.keyboard.press("ArrowLeft")
    assert page.evaluate("document.body.dataset.step") == STEPS[-2]
    # Tab reaches the step buttons, and Enter on one shows its step
    page.focus("#steps button[data-step='heads']")
    page.keyboard.press("Tab")
    assert page.evaluate("document.activeElement.dataset.step") == "layers"
    page.keyboard.press("Enter")
    assert page.evaluate("document.body.dataset.step") == "layers"


def test_every_number_shown_is_the_tours(page, bank):
    for step in bank.steps:
        _go(page, step.id)
        shown = page.eval_on_selector_all(
            "#step [data-value]", "ns => ns.map(n => JSON.parse(n.dataset.value))"
        )
        known = set(flat(step.numbers))
        known |= {x * 1e3 for x in flat(step.numbers) if isinstance(x, float)}  # ms
        missing = [x for x in shown if x not in known]
        assert not missing, (step.id, missing[:5])
        # a step without its own numbers says why (no cross-attention, no training run here)
        assert shown or step.id in ("cross", "training")


def test_the_seven_steps_shown_are_the_traces(page, minilm, bank):
    t = qkv.trace(minilm, SENTENCE, "bank", "river")
    _go(page, "qkv")
    fact = "#step [data-fact='{}'] .num"
    assert float(page.get_attribute(fact.format("scalar"), "data-value")) == t.attention_scalar
    assert float(page.get_attribute(fact.format("scaled"), "data-value")) == t.scaled_scalar
    vectors = page.eval_on_selector_all(
        "#step .vec", "vs => vs.map(v => JSON.parse(v.dataset.values))"
    )
    assert vectors[0] == [float(x) for x in t.query_vector]
    assert vectors[1] == [float(x) for x in t.key_vector]
    assert vectors[-1] == [float(x) for x in t.contextualized]
    weights = page.eval_on_selector_all(
        "#step table.weights td .num", "ns => ns.map(n => JSON.parse(n.dataset.value))"
    )
    assert weights == [float(w) for w in t.weights]
    _go(page, "heads")
    every = minilm.attentions(SENTENCE).weights[t.layer, :, t.query_index, t.key_index]
    shown = page.eval_on_selector_all(
        "#step table.heads td .num", "ns => ns.map(n => JSON.parse(n.dataset.value))"
    )
    torch.testing.assert_close(torch.tensor(shown), every)


def test_each_experiment_shows_the_librarys_result(page, minilm, bank):
    expected = {
        "hide": qkv.hide(minilm, SENTENCE, "river", query="bank", table=False).total,
        "ablate": qkv.ablate(minilm, SENTENCE, [(bank.layer, bank.head)]).total,
    }
    for step in bank.steps:
        for experiment in step.experiments:
            _go(page, step.id)
            where = f"#step .experiment[data-experiment='{experiment['id']}']"
            assert page.inner_text(f"{where} .result") == ""
            page.click(f"{where} button")
            assert experiment["says"] in page.inner_text(f"{where} .result")
            if experiment["id"] in expected:
                value = page.get_attribute(f"{where} [data-fact='change'] .num", "data-value")
                assert float(value) == expected[experiment["id"]]
            if experiment["id"] == "swap":
                text = experiment["result"]["text"]
                t = qkv.trace(minilm, text, "bank", "money", layer=bank.layer, head=bank.head)
                shown = page.eval_on_selector_all(
                    f"{where} td .num", "ns => ns.map(n => JSON.parse(n.dataset.value))"
                )
                assert shown == [float(w) for w in t.weights]
            if experiment["id"] == "compare":
                p = probe(minilm, "bank", [SENTENCE, experiment["result"]["text"]])
                shown = page.eval_on_selector_all(
                    f"{where} td .num", "ns => ns.map(n => JSON.parse(n.dataset.value))"
                )
                assert shown == [float(c) for c in p.similarity[:, 0, 1]]


def test_a_box_shows_its_real_tensor(page, minilm, bank):
    record = minilm.attentions(SENTENCE).records[bank.layer]
    for box, tensor in (("L.q", record.q[0, bank.head, bank.query_index]),
                        ("L.v", record.v[0, bank.head, bank.query_index]),
                        ("L.z", record.out[0, bank.head, bank.query_index])):  # fmt: skip
        page.focus(f"#diagram .box[data-box='{box}']")
        page.keyboard.press("Enter")
        assert page.get_attribute("#box-tensor", "data-box") == box
        values = json.loads(page.get_attribute("#box-tensor .vec", "data-values"))
        assert values == [float(x) for x in tensor.double()]
        assert bank.diagram.box(box).shape in page.inner_text("#box-tensor")


def test_written_atomically_and_hostile_text_stays_text(minilm, tmp_path):
    hostile = "The bank </script><img src=x onerror=alert(1)> by the river"
    with pytest.raises(ValueError, match="extension must be .html"):
        write_tour(minilm, hostile, tmp_path / "tour.png")
    assert list(tmp_path.iterdir()) == []
    path = write_tour(minilm, hostile, tmp_path / "tour.html")
    page = path.read_text(encoding="utf-8")
    data = page.split('id="tour-data">')[1].split("</script>")[0]  # the element ends once
    assert "<img" not in page and json.loads(data)["text"] == hostile
    assert f'<q id="sentence">{escape.text(hostile)}</q>' in page


def test_a_notebook_shows_the_page_in_an_iframe(minilm, bank):
    import html

    from qkv.viz.notebook_tour import show_tour

    shown = bank._repr_html_()
    assert shown.isascii() and shown.startswith('<iframe class="qkv-tour"')
    srcdoc = html.unescape(shown.split('srcdoc="')[1].split('" style=')[0])
    assert srcdoc == render_tour(bank)
    assert repr(bank).startswith("Tour('The bank on the side of the river' on minilm")
    assert qkv.tour is tour and show_tour(minilm, "Cats chase mice").query == "mice"
