"""A token as people read it, in every view: SmolLM2's byte-level tokenizer splits "日" (the
bytes E6 97 A5) over three tokens, and no page may show U+FFFD for them, which the text does
not hold; each such token shows its bytes (<0xE6>), as `Tokenizer.pieces` documents."""

from __future__ import annotations

import html
import re

import qkv
from qkv.viz.generation import read_generation_page, render_generation_page

TEXT = "The river 日本 bank"
PIECES = ["The", " river", " <0xE6>", "<0x97>", "<0xA5>", "本", " bank"]


def test_the_tokenizer_shows_a_split_characters_bytes(smollm2):
    encoded = smollm2.tokenizer.encode(TEXT)
    assert encoded.tokens[2:5] == ["Ġæ", "Ĺ", "¥"]  # one character, three tokens
    assert smollm2.tokenizer.pieces(encoded.ids) == PIECES == encoded.pieces
    # a U+FFFD the text holds stays one; a character that is whole is text
    real = smollm2.tokenizer.encode("a \ufffd and 😀")
    assert "".join(real.pieces) == "a \ufffd and <0xF0><0x9F><0x98><0x80>"


def test_the_notebook_page_shows_each_tokens_text(smollm2):
    shown = smollm2.attentions(TEXT, layers=[0])._repr_html_()
    page = html.unescape(re.search(r'srcdoc="([^"]*)"', shown).group(1))
    buttons = re.findall(r'<button type="button" class="token" data-index="\d+">([^<]*)</button>',
                         page)  # fmt: skip
    assert [html.unescape(b) for b in buttons] == PIECES
    assert "\ufffd" not in page and "Ġ" not in page


def test_the_generation_page_and_view_show_no_replacement_character(smollm2):
    seen = smollm2.generate("The capital of Japan is 日", 2, record="all")
    P = seen.prompt_length
    assert seen.tokens[P - 3 : P] == ["Ġæ", "Ĺ", "¥"]  # "日" split over three tokens
    assert seen.pieces[P - 3 : P] == [" <0xE6>", "<0x97>", "<0xA5>"]
    assert "".join(seen.pieces).startswith("The capital of Japan is <0xE6><0x97><0xA5>")
    page = render_generation_page(seen, title="generation").decode("utf-8")
    assert "\ufffd" not in page and read_generation_page(page)["pieces"] == seen.pieces
    assert "&#65533;" not in seen._repr_html_()


def test_the_lens_names_a_byte_token_by_its_byte(smollm2):
    found = qkv.lens(smollm2, TEXT, position=2, attribute=False)  # after the first byte of 日
    # what may follow a character's first byte is its next byte: each named as one
    assert all(re.fullmatch("<0x[89AB][0-9A-F]>", t) for t in found.top_tokens[-1])
    assert not any("\ufffd" in t for depth in found.top_tokens for t in depth)
    assert "&#65533;" not in found._repr_html_()


def test_the_long_text_page_shows_a_token_as_it_is(tmp_path):
    """matplotlib's labels escape "$" (it reads "$...$" as mathematics); a page does not."""
    from dataclasses import replace

    from qkv.inspect.summaries import summarize
    from qkv.viz.long import summary_page
    from variant_models import TEXT as WORDS
    from variant_models import decoder, tiny

    summary = summarize(tiny(decoder()).attentions(WORDS))
    summary = replace(summary, tokens=["$5 & <b>"] * len(summary.tokens))
    page = summary_page(summary, tmp_path / "long.html").read_text(encoding="utf-8")
    assert "0 $5 &amp; &lt;b&gt; (" in page and "\\$" not in page


def test_qkv_shows_page_and_summaries_show_each_tokens_text(smollm2, tmp_path):
    """`qkv show` wrote the vocabulary's names into its page ("Ġriver", and "Ġæ", "Ĺ", "¥"
    for a split "日"); a long text's summaries (the server's long view) named them too."""
    from typer.testing import CliRunner

    from qkv.cli import app
    from qkv.inspect.summaries import summarize
    from qkv.viz.report import read_weights

    out = tmp_path / "page.html"
    done = CliRunner().invoke(app, ["show", TEXT, "--model", "smollm2", "--out", str(out)])
    assert done.exit_code == 0, done.output
    page = out.read_text(encoding="utf-8")
    assert read_weights(page)[1] == PIECES and "\ufffd" not in page and "Ġ" not in page
    assert summarize(smollm2.attentions(TEXT, layers=[0])).tokens == PIECES
