"""`qkv.why`'s result as a person sees it: its short repr, its notebook view and its text
(`qkv.viz.notebook_why`, `qkv.viz.why_lines`), each number the library's own, every token
escaped."""

from __future__ import annotations

import dataclasses
import re

import pytest

import qkv
from qkv.viz.why_lines import position_terms, terms_grid, why_lines, why_step
from variant_models import TEXT as TINY_TEXT
from variant_models import decoder, tiny

TEXT = "I sat by the river bank"


@pytest.fixture(scope="module")
def found(minilm):
    return qkv.why(minilm, TEXT, "bank", "river", layer=2, head=11)


def test_the_repr_is_one_short_line_with_the_score_weight_and_top_term(found):
    shown = repr(found)
    assert shown.startswith("Why('bank' <- 'river', minilm, layer 2 head 11, ")
    assert len(shown) < 200 and "\n" not in shown and "tensor(" not in shown
    (a, b, value), *_ = found.ranked(1)
    assert f"score {found.score:.4f}" in shown and f"weight {found.weight:.4f}" in shown
    assert f"top {a}.{b} {value:+.4f}" in shown


def test_the_view_holds_the_librarys_numbers(found):
    shown = found._repr_html_()
    assert shown.isascii() and ' id="' not in shown and "<script" not in shown

    def value(css: str) -> float:
        return float(re.search(rf'class="{css}" data-value="([^"]+)"', shown).group(1))

    assert value("score") == found.score and value("weight") == found.weight
    assert value("total") == found.total
    assert value("position") == pytest.approx(position_terms(found), rel=1e-12)
    listed = re.findall(r'<tr data-query-part="([^"]+)" data-key-part="([^"]+)">'
                        r'<td data-value="([^"]+)">', shown)  # fmt: skip
    assert [(a, b, float(v)) for a, b, v in listed] == found.ranked(10)
    row = (r'<tr data-part="([^"]+)" data-side="(\w+)"><td class="text">[^<]*</td>'
           r'<td data-value="([^"]+)">[^<]*</td><td data-value="([^"]+)">')  # fmt: skip
    checks = re.findall(row, shown)
    assert [(p, s, float(a), float(b)) for p, s, a, b in checks] == [
        (c.part, c.side, c.predicted_score, c.real_score) for c in found.checks
    ]
    assert len(found.checks) == 6 and len(found.carried) == 4
    for c in found.carried:
        assert f'data-part="{c.part}" data-side="{c.side}"' in shown
        assert f'<td data-value="{c.value!r}">{c.value:+.4f}</td>' in shown
    assert "every norm&#x27;s scale is held" in shown or "every norm's scale is held" in shown


def test_the_grid_keeps_the_largest_parts_and_still_sums_to_the_score(found):
    rows, columns, values = terms_grid(found, most=5)
    assert len(rows) == len(columns) == 6 and rows[-1] == f"every other part ({30 - 5})"
    assert set(rows[:-1]) == {p for p, _ in found.by_part("query")[:5]}
    assert sum(map(sum, values)) == pytest.approx(found.total, rel=1e-12)
    i, j = found.parts_q.index(rows[0]), found.parts_k.index(columns[0])
    assert values[0][0] == float(found.terms[i, j])
    full = terms_grid(found, most=29)  # one part left over would be a row of its own: kept
    assert full[0] == found.parts_q and full[2] == found.terms.tolist()
    shown = found._repr_html_()
    cells = re.findall(r'<td data-row="(\d+)" data-col="(\d+)" data-value="([^"]+)"', shown)
    rows, columns, values = terms_grid(found)
    assert len(cells) == len(rows) * len(columns)
    assert all(float(v) == values[int(r)][int(c)] for r, c, v in cells)


def test_a_hostile_text_and_word_are_escaped(minilm):
    text = "the river <script>alert(1)</script> bank"
    found = qkv.why(minilm, text, "bank", "river", layer=1, head=3, checks=1)
    hostile = dataclasses.replace(found, query='"><img src=x onerror=alert(2)>', key="<b>&amp;")
    shown = hostile._repr_html_()
    assert "<script>" not in shown and "<img" not in shown and "<b>&amp;" not in shown
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in shown
    assert "&gt;&lt;img src=x onerror=alert(2)&gt;" in shown
    assert "&lt;b&gt;&amp;amp;" in shown
    assert repr(hostile).startswith("Why('\"><img src=x onerro\u2026' <- '<b>&amp;'")


def test_the_text_tells_the_librarys_numbers(found):
    told = why_lines(found, top=4)
    assert f"Score {found.score:+.4f}" in told and f"weight {100 * found.weight:.2f}%" in told
    assert f"they sum to {found.total:+.6f}" in told
    (a, b, value), *_ = found.ranked(1)
    assert (a, b) == ("position", "position")
    assert f"{value:+9.4f}" in told and "bank's position embedding . river's position" in told
    assert len(re.findall(r"^ +[+-]\d+\.\d{4} +-?\d+\.\d%  ", told, re.M)) == 4
    c = found.checks[0]
    assert f"score {c.predicted_score:+.4f} -> {c.real_score:+.4f}" in told
    assert f"{found.carried[0].part} carried into" in told
    assert f"sum to {position_terms(found):+.4f} of {found.total:+.4f}" in told
    step = "\n".join(why_step(found))
    assert step.count("\n     ") == 3 and f"All 900 terms sum to {found.total:+.4f}" in step


def test_a_rotary_layer_tells_content_and_position():
    small = tiny(decoder())  # rotary
    found = qkv.why(small, TINY_TEXT, "deep", "bank", layer=1, head=0, checks=0)
    content = float(found.content.sum())
    assert content + found.position == pytest.approx(found.total, rel=1e-9)
    assert f"content {content:+.4f} position {found.position:+.4f}" in repr(found)
    told = why_lines(found)
    assert f"Content {content:+.4f}" in told and f"+ position {found.position:+.4f}" in told
    assert "Removed for real: nothing" in told
    shown = found._repr_html_()
    assert f'class="content" data-value="{content!r}"' in shown
    assert f'class="position" data-value="{found.position!r}"' in shown
    assert 'class="checks"' not in shown
