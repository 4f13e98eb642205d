"""Inspection reads records, never hooks: no forward hook anywhere in qkv, none registered
while anything is inspected, and one forward pass per text for `qkv show` and `qkv demo`."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

import qkv
from qkv.inspect.article import SENTENCE
from qkv.inspect.tour import tour
from qkv.models import Encoder
from qkv.viz.page_why import PAGE_WHYS

SRC = Path(qkv.__file__).parent
HOOKS = ("register_forward_hook", "register_forward_pre_hook", "register_module_forward")


def test_no_module_of_qkv_registers_a_forward_hook():
    found = [
        f"{path.relative_to(SRC)}: {name}"
        for path in SRC.rglob("*.py")
        for name in HOOKS
        if re.search(rf"\b{name}", path.read_text(encoding="utf-8"))
    ]
    assert found == []


@pytest.fixture
def no_hooks(monkeypatch):
    """Any hook registered from here on fails the test (the global ones too)."""

    def refuse(*args, **kwargs):
        raise AssertionError("inspection registered a forward hook")

    for name in ("register_forward_hook", "register_forward_pre_hook"):
        monkeypatch.setattr(torch.nn.Module, name, refuse)
    for name in ("register_module_forward_hook", "register_module_forward_pre_hook"):
        monkeypatch.setattr(torch.nn.modules.module, name, refuse)


def test_inspecting_registers_no_hook(no_hooks, minilm, smollm2, tmp_path):
    from qkv.inspect.probe import probe
    from qkv.inspect.trace import attention_vectors
    from qkv.viz import write_html

    for pretrained in (minilm, smollm2):
        traced = qkv.trace(pretrained, SENTENCE, "river", "bank")
        seen = pretrained.attentions(SENTENCE)
        assert traced.weight == pytest.approx(
            float(seen.weights[traced.layer, traced.head, traced.query_index, traced.key_index])
        )
        q, _, _ = attention_vectors(pretrained, SENTENCE)
        assert q.shape[:2] == seen.weights.shape[:2]
        write_html(tmp_path / f"{pretrained.source}.html", seen.weights, seen.tokens,
                   vectors=seen.vectors(), causal=seen.causal, scale=seen.scale)  # fmt: skip
        for module in pretrained.model.modules():
            assert not module._forward_hooks and not module._forward_pre_hooks
    found = probe(minilm, "bank", ["the bank of the river", "the bank lent money"] * 2,
                  cues=["river", "money"] * 2)  # fmt: skip
    assert found.cue_attention.shape == (6, 12)


@pytest.fixture
def forwards(monkeypatch) -> list[tuple[int, int]]:
    """The (B, T) of every forward pass an Encoder runs from here on."""
    seen: list[tuple[int, int]] = []
    original = Encoder.forward

    def counted(self, input_ids, **kwargs):
        seen.append(tuple(input_ids.shape))
        return original(self, input_ids, **kwargs)

    monkeypatch.setattr(Encoder, "forward", counted)
    return seen


def test_show_runs_the_model_once_per_text(forwards, tmp_path):
    from qkv.cli import app

    for out in ("page.html", "heads.png", "report"):
        forwards.clear()
        result = CliRunner().invoke(app, ["show", SENTENCE, "--out", str(tmp_path / out)])
        assert result.exit_code == 0, result.output
        # the sentence is 10 tokens with [CLS] and [SEP]; a page also takes apart ahead, for
        # its "why" panel, each query token with its strongest key: one pass each, stopped at
        # the page's layer (`qkv.viz.page_why`), never more than PAGE_WHYS
        whys = 0 if out == "heads.png" else min(PAGE_WHYS, 10)  # the report holds a page
        assert forwards == [(1, 10)] * (1 + whys), out


def test_the_demo_runs_once_for_its_sentence_once_for_the_probe_and_per_layer_to_hide(
    forwards, tmp_path
):
    from qkv.cli.demo import article_walk

    sections = list(article_walk(tmp_path / "report"))
    assert len(sections) == 9
    assert forwards[0] == (1, 10), "the trace, the page and its vectors share one pass"
    assert forwards[1][0] == 16, "the probe reads its 16 sentences at once"
    # hiding "river" from "bank": one clean pass, one pass per layer with its 12 heads side by
    # side (each resumed at its layer), one with the word hidden everywhere
    assert forwards[2:10] == [(1, 10)] + [(12, 10)] * 6 + [(1, 10)]
    # the scale beside it: each of the sentence's 6 other words hidden instead, a clean and a
    # hidden pass each
    assert forwards[10:22] == [(1, 10)] * 12
    # every other word hidden from "bank" in each of the 16 sentences: a clean and a hidden pass
    assert len(forwards) >= 22 + 2 * 16 and all(b == 1 for b, _ in forwards[22:54])
    # then the tour written beside the report: the passes of the tour alone, no more
    in_demo = forwards[54:]
    forwards.clear()
    tour(qkv.load("minilm"), SENTENCE)
    assert in_demo == forwards
