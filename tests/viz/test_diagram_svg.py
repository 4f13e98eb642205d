"""The model diagram's SVG and text: well-formed XML whose every box carries its own id, step,
tensor and text alternative, the tour's step lit and no other, hostile strings escaped, an
encoder-decoder drawn as two columns, readable colours, and in Chromium: offline, lit boxes
drawn thicker, every box reached by the keyboard."""

from __future__ import annotations

import xml.etree.ElementTree as ET
from dataclasses import replace

import pytest
import transformers as hf

from browser import offline
from qkv.inspect.diagram import STEPS, model_diagram
from qkv.io.families import bart, gemma, t5
from qkv.viz.diagram import FILLS, diagram_svg, diagram_text

SVG = "{http://www.w3.org/2000/svg}"
HOSTILE = "x\"'><script>alert(1)</script>&amp;</g>"


def configs(minilm, smollm2) -> dict:
    """A config of each kind: an encoder, decoders with and without GQA, two seq2seq."""
    return {
        "minilm": minilm, "smollm2": smollm2,
        "gemma3": gemma.config(hf.Gemma3TextConfig(
            vocab_size=99, hidden_size=32, intermediate_size=37, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=1, head_dim=16,
            sliding_window=8).to_dict()),
        "t5": t5.config(hf.T5Config(vocab_size=99, d_model=32, d_kv=12, d_ff=37, num_layers=2,
                                    num_decoder_layers=3, num_heads=4).to_dict()),
        "bart": bart.config(hf.BartConfig(vocab_size=99, d_model=32, encoder_layers=2,
                                          decoder_layers=2, encoder_attention_heads=4,
                                          decoder_attention_heads=4).to_dict()),
    }  # fmt: skip


def boxes_of(svg: str) -> list[ET.Element]:
    return [g for g in ET.fromstring(svg).iter(f"{SVG}g") if "box" in g.get("class").split()]


def test_every_box_is_a_button_with_its_own_data_and_text(minilm, smollm2):
    for name, model in configs(minilm, smollm2).items():
        diagram = model_diagram(model, 7, target=5)
        svg = diagram_svg(diagram)
        groups = boxes_of(svg)
        assert [g.get("data-box") for g in groups] == list(diagram.ids), name
        for g, box in zip(groups, diagram.boxes, strict=True):
            words = f"{box.label}: {box.shape}. {box.explain}"
            assert g.get("data-step") == box.step and g.get("data-tensor") == (box.tensor or "")
            assert g.get("tabindex") == "0" and g.get("role") == "button"
            assert g.get("aria-label") == words and g.find(f"{SVG}title").text == words
            assert [t.text for t in g.iter(f"{SVG}text")] == [box.label, box.shape]
        arrows = [p for p in ET.fromstring(svg).iter(f"{SVG}path") if p.get("marker-end")]
        assert len(arrows) == len(diagram.edges)
        frames = [t.text for t in ET.fromstring(svg).iter(f"{SVG}text") if "layers (" in t.text]
        assert frames == [f"× {s.layers} layers ({s.name})" for s in diagram.stacks]


@pytest.mark.parametrize("step", [*STEPS, None])
def test_lit_lights_exactly_that_steps_boxes(step, smollm2):
    diagram = model_diagram(smollm2, 6)
    lit = {g.get("data-box") for g in boxes_of(diagram_svg(diagram, lit=step))
           if "lit" in g.get("class").split()}  # fmt: skip
    assert lit == ({b.id for b in diagram.boxes if b.step == step} if step else set())
    if step in ("qkv", "scaling", "heads", "layers", "embeddings"):
        assert lit  # a decoder has boxes in every one of these steps


def test_a_bad_step_is_refused(smollm2):
    with pytest.raises(ValueError, match="lit must be one of tokens, embeddings"):
        diagram_svg(model_diagram(smollm2, 3), lit="softmax")


def test_hostile_strings_are_escaped_and_read_back_as_text(smollm2):
    diagram = model_diagram(smollm2, 3)
    bad = replace(diagram.boxes[0], id=HOSTILE, label=HOSTILE, explain=HOSTILE, tensor=HOSTILE)
    diagram = replace(
        diagram,
        title=HOSTILE,
        boxes=(bad, *diagram.boxes[1:]),
        edges=tuple((HOSTILE if a == "tokens" else a, b) for a, b in diagram.edges),
    )
    svg = diagram_svg(diagram, lit="tokens")
    root = ET.fromstring(svg)  # well-formed: no markup got out of its place
    assert not [e for e in root.iter() if "script" in e.tag]
    g = boxes_of(svg)[0]
    assert g.get("data-box") == g.get("data-tensor") == HOSTILE
    assert g.get("aria-label").startswith(HOSTILE) and root.get("aria-label") == HOSTILE
    assert root.find(f"{SVG}title").text == HOSTILE
    assert HOSTILE in diagram_text(diagram)


def test_nothing_outside_the_svg_is_referenced(minilm, smollm2):
    for model in configs(minilm, smollm2).values():
        svg = diagram_svg(model_diagram(model, 4), lit="heads")
        links = [v for e in ET.fromstring(svg).iter() for k, v in e.attrib.items()
                 if "href" in k or "url(" in v]  # fmt: skip
        assert set(links) == {"url(#qkv-diagram-arrow)"}
        assert svg.count("http") == 1  # the SVG namespace only


def rects(svg: str) -> dict[str, tuple[float, float]]:
    corners = {}
    for g in boxes_of(svg):
        rect = g.find(f"{SVG}rect")
        corners[g.get("data-box")] = (float(rect.get("x")), float(rect.get("y")))
    return corners


def test_the_layout_flows_down_with_q_k_v_side_by_side(smollm2):
    diagram = model_diagram(smollm2, 4)
    at = rects(diagram_svg(diagram))
    for a, b in diagram.edges:  # every box below what it is computed from
        assert at[a][1] < at[b][1], (a, b)
    assert at["L.q"][1] == at["L.k"][1] == at["L.v"][1]
    assert at["L.q"][0] < at["L.k"][0] < at["L.v"][0]


def test_an_encoder_decoder_draws_two_columns_joined_by_cross_attention(minilm, smollm2):
    diagram = model_diagram(configs(minilm, smollm2)["t5"], 6, target=4)
    at = rects(diagram_svg(diagram))
    encoder = [x for id, (x, _) in at.items() if id.startswith("enc.")]
    decoder = [x for id, (x, _) in at.items() if not id.startswith("enc.")]
    assert max(encoder) < min(decoder)
    out = at["enc.final_norm"]
    assert out[1] < at["L.cross_k"][1] == at["L.cross_v"][1] == at["L.cross_q"][1]


def test_the_text_alternative_lists_every_box_in_order(minilm):
    diagram = model_diagram(minilm, 5)
    lines = diagram_text(diagram).splitlines()
    numbered = [line for line in lines if line.split(".")[0].isdigit()]
    assert len(numbered) == len(diagram.boxes)
    for n, (line, box) in enumerate(zip(numbered, diagram.boxes, strict=True), 1):
        assert line.startswith(f"{n}. {box.label}, {box.shape}: {box.explain}")
    assert lines[0] == diagram.title and "Each of the 6 layers of the encoder:" in lines
    # a residual sum names both of its inputs, by number and label
    number = {id: n for n, id in enumerate(diagram.ids, 1)}
    sources = ", ".join(f"{number[id]}. {diagram.box(id).label}" for id in ("L.resid_pre", "L.o"))
    assert numbered[number["L.resid_mid"] - 1].endswith(f"(from {sources})")


def luminance(colour: str) -> float:
    """WCAG's relative luminance of "#rrggbb"."""
    channels = [int(colour[i : i + 2], 16) / 255 for i in (1, 3, 5)]
    linear = [c / 12.92 if c <= 0.03928 else ((c + 0.055) / 1.055) ** 2.4 for c in channels]
    return 0.2126 * linear[0] + 0.7152 * linear[1] + 0.0722 * linear[2]


def test_black_text_reads_on_every_fill_and_each_step_has_its_own():
    assert set(FILLS) == set(STEPS)
    assert len(set(FILLS.values())) == len(FILLS)
    for colour in FILLS.values():  # contrast with black text: WCAG AAA asks 7
        assert (luminance(colour) + 0.05) / 0.05 >= 7, colour


def test_in_chromium_lit_boxes_are_thicker_and_the_keyboard_reaches_every_box(smollm2, tmp_path):
    diagram = model_diagram(smollm2, 4)
    page_file = tmp_path / "diagram.html"
    svg = diagram_svg(diagram, lit="scaling")
    ready = "<script>window.qkvReady = true</script>"
    page_file.write_text(f"<!doctype html><meta charset='utf-8'><body>{svg}{ready}</body>",
                         encoding="utf-8")  # fmt: skip
    with offline(page_file) as page:
        width = (
            "(id) => getComputedStyle(document.querySelector(`[data-box='${id}'] rect`))"
            ".strokeWidth"
        )
        assert page.evaluate(width, "L.scores") == "4px"
        assert page.evaluate(width, "L.q") == "1px"
        reached = []
        for _ in diagram.boxes:
            page.keyboard.press("Tab")
            reached.append(page.evaluate("document.activeElement.dataset.box"))
        assert reached == list(diagram.ids)
