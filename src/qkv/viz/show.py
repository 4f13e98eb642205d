"""What `qkv show` draws of one forward pass (`Pretrained.attentions`): an interactive page,
one head's heatmap, a grid of layers x heads or a report folder, each from every weight; or,
for a text of more than LONG tokens (or a --region of one head), the same from the text's
summaries, computed a chunk of queries at a time, never from the (L, H, T, T) weights.

The file's suffix chooses the picture: .html/.htm a page, .png a heatmap (a grid with
`layers`/`heads`), anything else a report folder.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from torch import nn

# viz's drawing functions are looked up on the package when called, as `qkv show` always
# did, so that a test can stand in for one
from qkv import viz
from qkv.attention.index_text import parse_indices
from qkv.attention.inputs import check_indices
from qkv.inspect.layer_heads import check_layer_head
from qkv.inspect.records import why_not_redone
from qkv.inspect.summaries import region as region_of
from qkv.inspect.summaries import summarize
from qkv.models import Decoder, Encoder
from qkv.viz.long import downsampled_grid, downsampled_heatmap, summary_page
from qkv.viz.page import drawn_weights, write_attention_page
from qkv.viz.page_why import PAGE_WHYS, page_whys
from qkv.viz.report import strongest_head

LONG = 512  # tokens beyond which `show` draws summaries rather than every weight


def draw_attention(
    seen,
    out: Path,
    *,
    name: str,
    text: str,
    model: nn.Module,
    transformers: bool = False,
    layers: str | None = None,
    heads: str | None = None,
    layer: int | None = None,
    head: int | None = None,
    region: str | None = None,
    cross: bool = False,
    untraced: Callable[[str], None] | None = None,
    whys: int = PAGE_WHYS,
) -> None:
    """Draw `seen` (the attentions of `model`, called `name`, over `text`) to `out`.

    layers, heads: a grid's layers and heads as written on the command line ('0,2,5',
    '0-3'; all if None); layer, head: the one head a heatmap, a --region or the page opens
    on; region: 'Q0:Q1,K0:K1', queries x keys of that head at full resolution (a PNG);
    cross: `seen` is an encoder-decoder's cross-attention; transformers: `model` was loaded
    by transformers onto qkv's attention. A page traces a clicked pair from the records'
    q, k, v where they allow it; where they do not, `untraced` is told why before the page
    is written (the page then traces no pair, rather than redo one with wrong numbers). A
    page of qkv's own self-attention takes apart ahead, for its "why" panel, each of the first
    `whys` query tokens with its strongest key in the head it opens on (`page_whys`; 0: none).
    """
    if region is not None or max(len(seen.tokens), len(seen.query_tokens or ())) > LONG:
        _draw_long(seen, out, name, text, layers, heads, layer, head, region)
        return
    weights = drawn_weights(seen)[0]  # a linear layer's as shares of |effective weight|
    L, H = weights.shape[:2]
    for what, value, most in (("layer", layer, L), ("head", head, H)):
        if value is not None:
            check_indices(what, [value], most, name)
    chosen = (layer or 0, head or 0) if layer is not None or head is not None else None
    if chosen is not None:  # a head its layer has (layers may differ: Qwen3.5's)
        counts = [seen.records[n].shape.H for n in seen.layers]
        check_layer_head(chosen[0], chosen[1], counts, name)
    if out.suffix.lower() == ".png" and (layers or heads):
        viz.model_view(weights, seen.pieces, out,
                       layers=parse_indices(layers, "layers", L, name),
                       heads=parse_indices(heads, "heads", H, name),
                       query_tokens=seen.query_tokens)  # fmt: skip
    elif out.suffix.lower() == ".png":
        lh = chosen or (0, 0)
        kind = " cross-attention" if cross else ""
        viz.head_heatmap(weights[lh], seen.pieces, out,
                         title=f"{name}{kind} L{lh[0]} H{lh[1]}",
                         query_tokens=seen.query_tokens)  # fmt: skip
    else:  # a page, which traces a clicked pair from the q, k, v vectors
        why = why_not_redone(seen.records, cross=cross)  # cross: the decoder's q over the encoder's
        if why is not None and untraced is not None:  # the page would redo pairs wrongly
            untraced(why)
        relative = getattr(getattr(model, "config", None), "position", None) == "relative"
        taken = None
        if whys and not cross and isinstance(model, Encoder | Decoder):
            taken = page_whys(model, seen, chosen or strongest_head(weights), count=whys)
        write_attention_page(
            out,
            seen,
            title=f"{name}: {text[:60]}",
            text=text,
            head=chosen,
            bias_is_distance=relative and not cross,
            trace=cross or transformers or isinstance(model, Encoder | Decoder),
            whys=taken,
        )


def _draw_long(seen, out: Path, name: str, text: str, layers, heads, layer, head, region):
    """`show` of a long text (or of a --region): from summaries computed a chunk of queries at
    a time, never the (L, H, T, T) weights."""
    L, H = len(seen.layers), len(seen.heads)
    for what, value, most in (("layer", layer, L), ("head", head, H)):
        if value is not None:
            check_indices(what, [value], most, name)
    lh = (layer or 0, head or 0)
    suffix = out.suffix.lower()
    if region is not None:
        if suffix != ".png":
            raise ValueError("a --region is drawn as PNG; use --out FILE.png")
        spans = region_spans(region, len(seen.query_tokens or seen.tokens), len(seen.tokens))
        (q0, q1), (k0, k1) = spans
        weights = region_of(seen.records[lh[0]], queries=spans[0], keys=spans[1], heads=[lh[1]])
        queries = seen.query_tokens or seen.pieces
        viz.head_heatmap(weights[0], seen.pieces[k0:k1], out, query_tokens=queries[q0:q1],
                         title=f"{name} L{lh[0]} H{lh[1]}: queries {q0}-{q1 - 1} over keys "
                         f"{k0}-{k1 - 1}, every weight")  # fmt: skip
        return
    if suffix not in (".png", ".html", ".htm"):
        raise ValueError(f"a text of more than {LONG} tokens is shown as FILE.png or FILE.html "
                         "(from its summaries); a report folder draws every weight")  # fmt: skip
    summary = summarize(seen)
    if suffix == ".png" and (layers or heads):
        downsampled_grid(summary, out, layers=parse_indices(layers, "layers", L, name),
                         heads=parse_indices(heads, "heads", H, name))  # fmt: skip
    elif suffix == ".png":
        downsampled_heatmap(summary, *lh, out, title=f"{name} L{lh[0]} H{lh[1]}")
    else:
        summary_page(summary, out, title=f"{name}: {text[:60]}", text=text)


def region_spans(spec: str, Tq: int, Tk: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """'Q0:Q1,K0:K1' -> ((Q0, Q1), (K0, K1)), each a range of token positions from 0.

    >>> region_spans("0:4,2:6", 10, 10)
    ((0, 4), (2, 6))
    >>> region_spans("0:4,2:16", 10, 10)
    Traceback (most recent call last):
    ...
    ValueError: --region keys 2:16 is not within 0:10 (first < last; the text has that many tokens)
    """
    try:
        spans = [tuple(int(end) for end in part.split(":")) for part in spec.split(",")]
    except ValueError:
        spans = []
    if len(spans) != 2 or any(len(span) != 2 for span in spans):
        raise ValueError(f"--region takes Q0:Q1,K0:K1 (token positions from 0), got {spec!r}")
    for what, (first, last), count in (("queries", spans[0], Tq), ("keys", spans[1], Tk)):
        if not 0 <= first < last <= count:
            raise ValueError(f"--region {what} {first}:{last} is not within 0:{count} "
                             "(first < last; the text has that many tokens)")  # fmt: skip
    return spans[0], spans[1]
