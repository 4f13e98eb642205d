"""Cross-attention: a tiny random BART's decoder reading its encoder, drawn with the target's
tokens down and the source's across, as `transformers` computes it."""

from __future__ import annotations

import string

import matplotlib.image as mpimg
import numpy as np
import pytest
import torch
from typer.testing import CliRunner

import qkv
from qkv.cli import app
from qkv.viz import head_heatmap, model_view
from qkv.viz import heatmap as heatmap_module

LETTERS = list(string.ascii_lowercase)


@pytest.fixture(scope="module")
def bart(folder):
    import transformers as hf

    theirs = hf.BartForConditionalGeneration.from_pretrained(folder, attn_implementation="eager")
    return qkv.load(folder), theirs.eval()


def random_letters(n: int) -> list[str]:
    return [LETTERS[i] for i in torch.randperm(len(LETTERS))[:n].tolist()]


def anti_diagonal(Tq: int, Tk: int) -> torch.Tensor:
    """What a sequence reverser's cross-attention looks like: decoder row i (the start token,
    then the target's words) predicts target word i, so it reads source token Tk - 2 - i
    (the source is <s> words </s>)."""
    weights = torch.full((Tq, Tk), 0.01)
    for i in range(Tq):
        weights[i, Tk - 2 - i] = 1.0
    return weights / weights.sum(-1, keepdim=True)  # (Tq, Tk)


def test_cross_attention_is_what_transformers_computes(bart):
    ours, theirs = bart
    words = random_letters(int(torch.randint(3, 9, ()).item()))
    text, target = " ".join(words), " ".join(reversed(words))
    att = ours.attentions(text, target=target)

    source = ours.tokenizer.encode(text).ids  # <s> a b c </s>
    start = theirs.config.decoder_start_token_id
    decoder = [start, *ours.tokenizer.encode(target, add_special_tokens=False).ids]
    assert att.tokens == ["<s>", *words, "</s>"]
    assert att.query_tokens == ["</s>", *reversed(words)]  # the start token is </s> in BART
    assert att.encoded.ids == source
    with torch.no_grad():
        out = theirs(input_ids=torch.tensor([source]), decoder_input_ids=torch.tensor([decoder]),
                     output_attentions=True)  # fmt: skip
    want = torch.stack([layer[0] for layer in out.cross_attentions])  # (L, H, Tt, Ts)
    L, H = theirs.config.decoder_layers, theirs.config.decoder_attention_heads
    assert att.weights.shape == (L, H, len(decoder), len(source))
    torch.testing.assert_close(att.weights, want, atol=1e-5, rtol=0)
    torch.testing.assert_close(att.weights.sum(-1), torch.ones(L, H, len(decoder)))


def test_without_a_target_an_encoder_decoder_shows_its_encoder(bart):
    ours, theirs = bart
    att = ours.attentions("a b c", target=None)
    with torch.no_grad():
        out = theirs.model.encoder(torch.tensor([att.encoded.ids]), output_attentions=True)
    torch.testing.assert_close(att.weights, torch.stack([a[0] for a in out.attentions]),
                               atol=1e-5, rtol=0)  # fmt: skip
    assert att.weights.shape[-2:] == (5, 5) and att.query_tokens is None


def test_targets_are_checked(bart):
    ours, _ = bart
    with pytest.raises(ValueError, match="target text is empty"):
        ours.attentions("a b c", target="  ")
    with pytest.raises(ValueError, match="the target has 71 tokens with the start token"):
        ours.attentions("a b c", target="a " * 70)  # the context window is 64
    minilm = qkv.load("minilm")
    with pytest.raises(ValueError, match="target text is for encoder-decoder models"):
        minilm.attentions("the bank of the river", target="la rive")


def test_one_cross_attention_head_has_target_rows_and_source_columns(tmp_path, drawn):
    source, target = ["<s>", *"abcdefgh", "</s>"], ["</s>", *"hgfedcba"]
    weights = anti_diagonal(len(target), len(source))  # (9, 10)
    path = head_heatmap(weights, source, tmp_path / "reverse.png", query_tokens=target)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["reverse.png"]
    image = mpimg.imread(path)  # (height, width, RGBA)
    side = heatmap_module.figure_side
    assert image.shape == (round(side(9) * 100), round((side(10) + 1.6) * 100), 4)
    ax = drawn[0].axes[0]
    np.testing.assert_array_equal(ax.images[0].get_array(), weights.numpy())
    assert [t.get_text() for t in ax.get_xticklabels()] == source
    assert [t.get_text() for t in ax.get_yticklabels()] == target
    assert (ax.get_xlabel(), ax.get_ylabel()) == ("source token (key)", "target token (query)")
    assert ax.get_xlim() == (-0.5, 9.5) and ax.get_ylim() == (8.5, -0.5)  # first target on top


def test_a_long_target_over_a_short_source_is_a_tall_picture(tmp_path, drawn):
    weights = torch.softmax(torch.randn(300, 6), dim=-1)  # (Tq, Tk)
    queries = [f"t{i}" for i in range(300)]
    image = mpimg.imread(head_heatmap(weights, list("abcdef"), tmp_path / "t.png",
                                      query_tokens=queries))  # fmt: skip
    assert image.shape[0] > image.shape[1]
    labels = [t.get_text() for t in drawn[0].axes[0].get_yticklabels()]
    assert 20 < len(labels) < 300 and labels[0] == "0 t0"  # thinned rows, every column
    assert len(drawn[0].axes[0].get_xticklabels()) == 6


def test_model_view_draws_every_cross_attention_head(bart, tmp_path, drawn):
    ours, _ = bart
    att = ours.attentions("a b c d", target="d c b a")
    path = model_view(att.weights, att.tokens, tmp_path / "all.png",
                      query_tokens=att.query_tokens)  # fmt: skip
    assert mpimg.imread(path)[..., :3].std() > 0.1
    L, H = att.weights.shape[:2]
    titles = [ax.get_title() for ax in drawn[0].axes[:-1]]  # the last: the colour bar
    assert titles == [f"L{layer} H{head}" for layer in range(L) for head in range(H)]
    np.testing.assert_array_equal(drawn[0].axes[H + 2].images[0].get_array(), att.weights[1, 2])
    title = drawn[0].get_suptitle()
    assert "cross-attention of 5 target tokens over 6 source tokens" in title


def test_mismatched_cross_attention_shapes_are_refused(tmp_path):
    source, target = list("abcdef"), list("xyz")
    path = tmp_path / "x.png"
    with pytest.raises(ValueError, match=r"\(Tq, Tk\) with Tq = 3 target tokens.*transposed"):
        head_heatmap(torch.rand(6, 3), source, path, query_tokens=target)
    with pytest.raises(ValueError, match=r"\(L, H, Tq, Tk\) with Tq = 3.*got \(3, 6\)"):
        model_view(torch.rand(3, 6), source, path, query_tokens=target)
    with pytest.raises(ValueError, match="Tk = 5 source tokens"):
        head_heatmap(torch.rand(3, 6), source[:-1], path, query_tokens=target)
    with pytest.raises(ValueError, match="no target tokens"):
        head_heatmap(torch.rand(0, 6), source, path, query_tokens=[])
    with pytest.raises(ValueError, match=r"\(T, T\) with T = 6"):
        head_heatmap(torch.rand(3, 6), source, path)  # rectangular without query_tokens
    assert list(tmp_path.iterdir()) == []


def test_show_draws_cross_attention_to_a_png(folder, tmp_path):
    runner = CliRunner()
    one = tmp_path / "head.png"
    args = ["show", "a b c d", "--model", str(folder), "--target", "d c b a"]
    result = runner.invoke(app, [*args, "--out", str(one), "--layer", "1", "--head", "3"])
    assert result.exit_code == 0, result.output
    assert result.stdout == f"wrote {one}\n" and mpimg.imread(one).shape[2] == 4
    grid = tmp_path / "grid.png"
    result = runner.invoke(app, [*args, "--out", str(grid), "--layers", "0-1", "--heads", "0,3"])
    assert result.exit_code == 0, result.output
    assert grid.is_file()


def test_show_refuses_a_target_it_cannot_draw(tmp_path):  # pages: tests/viz/test_cross_page.py
    runner = CliRunner()
    minilm = runner.invoke(app, ["show", "the river bank", "--target", "la rive",
                                 "--out", str(tmp_path / "x.png")])  # fmt: skip
    assert minilm.exit_code == 2
    assert minilm.stderr == (
        "error: a target text is for encoder-decoder models' cross-attention; minilm is bert\n"
    )
    assert list(tmp_path.iterdir()) == []
