"""The one page builder (`qkv.viz.page`): the page `qkv show` writes, from an `Attentions`,
equal byte for byte to the page written from its parts."""

from __future__ import annotations

from qkv.inspect.records import why_not_redone
from qkv.models import EncoderConfig
from qkv.nn import BlockConfig
from qkv.viz import page_trace
from qkv.viz.page import attention_page, write_attention_page
from qkv.viz.report import read_weights, render_page
from variant_models import TEXT, WORDS, gemma2_like, tiny


def from_parts(seen, *, bias_is_distance=False, **options) -> bytes:
    vectors, scores = page_trace(seen.records, bias_is_distance=bias_is_distance)
    return render_page(seen.weights, seen.pieces, vectors=vectors, scale=seen.scale,
                       scores=scores, causal=seen.causal, extra=None, head=None, query=None,
                       **options)  # fmt: skip


def test_the_page_of_attentions_is_the_page_of_its_parts():
    seen = tiny(gemma2_like()).attentions(TEXT)  # a window and a soft-cap to redo
    assert why_not_redone(seen.records) is None
    assert attention_page(seen, title="t", text=TEXT) == from_parts(seen, title="t", text=TEXT)
    relative = EncoderConfig(vocab_size=len(WORDS), num_layers=1, position="relative",
                             relative_buckets=8, relative_max_distance=16,
                             block=BlockConfig(width=32, num_heads=2))  # fmt: skip
    seen = tiny(relative).attentions(TEXT)
    built = attention_page(seen, title="t", bias_is_distance=True)
    assert built == from_parts(seen, bias_is_distance=True, title="t", text=None)
    assert b'"bias_is_distance":true' in built


def test_without_the_trace_or_above_max_bytes_the_page_holds_the_weights_alone(tmp_path):
    seen = tiny(gemma2_like()).attentions(TEXT)
    alone = render_page(seen.weights, seen.pieces, title="t", text=None, extra=None,
                        head=None, query=None, causal=seen.causal)  # fmt: skip
    assert attention_page(seen, title="t", trace=False) == alone
    assert attention_page(seen, title="t", max_bytes=len(alone)) == alone
    folder = write_attention_page(tmp_path / "report", seen, title="t")
    assert (folder / "index.html").read_bytes() == attention_page(seen, title="t")
    page = write_attention_page(tmp_path / "page.html", seen, title="t")
    weights, tokens = read_weights(page.read_text(encoding="utf-8"))
    assert tokens == seen.pieces and weights.shape == tuple(seen.weights.shape)
