"""The notebook's view of `qkv.circuits`: its repr, and HTML whose numbers are the library's
(exactly, in data-value) and whose every string is escaped."""

from __future__ import annotations

import re
from dataclasses import replace

import qkv
from variant_models import decoder, tiny


def _circuits(source: str = "tiny", **block):
    pretrained = tiny(replace(decoder(num_heads=4, num_kv_heads=2, **block), num_layers=3))
    pretrained.source = source
    return qkv.circuits(pretrained)


def test_repr_is_short_and_names_the_strongest_once_computed():
    found = _circuits()
    assert repr(found) == "Circuits(tiny, 3 layers, 12 heads)"
    s, r, v = found.strongest("k", 1)[0]
    assert repr(found) == f"Circuits(tiny, 3 layers, 12 heads, strongest K: {s} -> {r} {v:.4f})"


def test_html_holds_the_librarys_numbers_and_escapes_every_string():
    found = _circuits(source='<script>alert("x")</script>')
    found.composition("q")
    page = found._repr_html_()
    assert "<script>" not in page and "&lt;script&gt;" in page
    assert "Q-composition" in page and "K-composition" not in page  # the kinds computed only
    values = [float(v) for v in re.findall(r'data-value="([^"]+)"', page)]
    strongest = [v for _, _, v in found.strongest("q", 10)]
    assert values[: len(strongest)] == strongest
    assert values[len(strongest) : len(strongest) + 2] == [
        float(found.qk_singular[0, 0]), float(found.ov_singular[0, 0])]  # fmt: skip


def test_html_of_post_norm_blocks_says_why_there_is_no_table():
    page = _circuits(norm_position="post")._repr_html_()
    assert "post-norm" in page and "<th>sender</th>" not in page
