"""The model diagram as people see it: an inline SVG (no outside resources) and a plain-text
alternative, both from `qkv.inspect.diagram.model_diagram`.

The flow runs down the page: each box sits one row below the boxes it is computed from, boxes
of one row side by side (q, k and v), one layer drawn once inside a frame that says "× N
layers"; an encoder-decoder draws its encoder on the left and its decoder on the right, with
the encoder's output crossing over to the decoder's keys and values. Each box is a keyboard-
focusable button carrying its id, step and tensor as data attributes and its text alternative
as aria-label and <title>; the boxes of the tour's current step carry the class "lit" (a thick
black border, so that it shows without colour). Fills follow the Okabe-Ito palette, readable
by people with colour-blindness, each a light tint under black text.

>>> from qkv.inspect.diagram import model_diagram
>>> from qkv.models import EncoderConfig
>>> from qkv.nn import BlockConfig
>>> d = model_diagram(EncoderConfig(vocab_size=9, num_layers=2, block=BlockConfig(
...     width=8, num_heads=2)), 3)
>>> svg = diagram_svg(d, lit="qkv")
>>> svg.count('class="box lit"'), svg.count('class="box"')
(4, 14)
>>> print(diagram_text(d).splitlines()[2][:50])
1. Tokens, (B, T) = (1, 3): The text cut into 3 to
"""

from __future__ import annotations

from collections import defaultdict

from qkv.inspect.diagram import STEPS, Diagram
from qkv.viz.escape import attribute, text

# light tints of the Okabe-Ito colours, one per step: black text reads on each
FILLS = {"tokens": "#e0e0e0", "embeddings": "#f9dfa6", "qkv": "#bfe3f7", "scaling": "#f7f2b0",
         "heads": "#a9e0cf", "layers": "#d9cbe8", "cross": "#f3c2a0", "training": "#edc5dc",
         "parallel": "#ffffff"}  # fmt: skip
ROW, GAP, PAD, SIDE = 44, 28, 36, 44  # box height, gap between rows, frame padding, skip lane
STYLE = (".qkv-diagram .box{cursor:pointer}"
         ".qkv-diagram .box rect{stroke:#444;stroke-width:1}"
         ".qkv-diagram .box.lit rect{stroke:#000;stroke-width:4}"
         ".qkv-diagram .box.lit .label{font-weight:bold}"
         ".qkv-diagram .box:focus{outline:none}"
         ".qkv-diagram .box:focus rect{stroke:#0072b2;stroke-width:4;"
         "stroke-dasharray:6 3}")  # fmt: skip


def diagram_svg(diagram: Diagram, *, lit: str | None = None) -> str:
    """An inline SVG of the diagram; the boxes of step `lit` (one of STEPS) light up."""
    if lit is not None and lit not in STEPS:
        raise ValueError(f"lit must be one of {', '.join(STEPS)} or None, got {lit!r}")
    width = 8 + 7 * max(max(len(b.label), len(b.shape)) for b in diagram.boxes)
    places, columns, centres = _layout(diagram, width)
    total_w = sum(columns) + 2 * SIDE * len(columns)
    total_h = max(y for _, y in places.values()) + ROW + PAD + 8
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" class="qkv-diagram" role="group" '
        f'viewBox="0 0 {total_w} {total_h}" width="{total_w}" height="{total_h}" '
        f'font-family="DejaVu Sans, Arial, sans-serif" font-size="12" '
        f'aria-label="{attribute(diagram.title)}">',
        f"<title>{text(diagram.title)}</title>",
        f"<style>{STYLE}</style>",
        '<defs><marker id="qkv-diagram-arrow" viewBox="0 0 8 8" refX="8" refY="4" '
        'markerWidth="7" markerHeight="7" orient="auto-start-reverse">'
        '<path d="M0,0 L8,4 L0,8 z" fill="#333"/></marker></defs>',
    ]
    parts += _frames(diagram, places, centres)
    parts += [_edge(places, centres[b], a, b, width) for a, b in diagram.edges]
    parts += [_box(box, places[box.id], width, box.step == lit) for box in diagram.boxes]
    return "\n".join([*parts, "</svg>"])


def diagram_text(diagram: Diagram) -> str:
    """The whole diagram as plain text, in the order the pass computes it: each box with its
    shape, what it computes, and what it is computed from."""
    sources = defaultdict(list)
    for a, b in diagram.edges:
        sources[b].append(a)
    labels = {box.id: f"{n}. {box.label}" for n, box in enumerate(diagram.boxes, 1)}
    lines, inside = [diagram.title, "Shapes: B texts, T tokens, S source tokens, C width, H "
                     "heads, Hkv key/value heads, D head size, V vocabulary."], None  # fmt: skip
    for n, box in enumerate(diagram.boxes, 1):
        stack = next((s for s in diagram.stacks if box.id.startswith(s.prefix)), None)
        if stack is not inside:
            if stack is not None:
                lines.append(f"Each of the {stack.layers} layers of the {stack.name}:")
            else:
                lines.append(f"After the {inside.name}'s last layer:")
            inside = stack
        fed = sources[box.id]
        after = "" if fed == [diagram.ids[n - 2]] or not fed else (
            f" (from {', '.join(labels[a] for a in fed)})")  # fmt: skip
        lines.append(f"{n}. {box.label}, {box.shape}: {box.explain}{after}")
    return "\n".join(lines)


def _layout(diagram: Diagram, width: int) -> tuple[dict, list[int], dict[str, tuple[int, int]]]:
    """{box id: (x, y) of its top-left corner}, each column's width, and {box id: (its
    column's left and right x, +1 where skips from its middle pass on the right, -1 on the
    left)}: a column per stack (an encoder-decoder's encoder on the left), a row per step."""
    side = {box.id: int(not box.id.startswith("enc.")) for box in diagram.boxes}
    if not any(side[i] == 0 for i in side):
        side = dict.fromkeys(side, 0)
    level: dict[str, int] = {}
    previous: dict[int, str] = {}  # each side's box placed last
    for box in diagram.boxes:  # in the pass's order: every source is placed first
        fed = [a for a, b in diagram.edges if b == box.id]
        before = [level[a] + 1 for a in fed if side[a] == side[box.id]]
        if fed and not before:  # fed from the other column only: beside the box before it
            before = [level[previous[side[box.id]]]]
        level[box.id], previous[side[box.id]] = max(before, default=0), box.id
    crossing = [(a, b) for a, b in diagram.edges if side[a] != side[b]]
    # the decoder starts low enough for the encoder's output to come down into its keys
    shift = max([level[a] + 1 - level[b] for a, b in crossing] + [0])
    rows = defaultdict(list)
    for box in diagram.boxes:  # in a row, the boxes fed from the other column first (left)
        rows[side[box.id], level[box.id] + shift * side[box.id]].append(box.id)
    fed_across = {b for _, b in crossing}
    for ids in rows.values():
        ids.sort(key=lambda id: id not in fed_across)
    sides = sorted(set(side.values()))
    widest = [max(len(ids) for (s, _), ids in rows.items() if s == k) for k in sides]
    columns = [n * width + (n - 1) * 16 + 2 * PAD for n in widest]
    places = {}
    for (s, row), ids in rows.items():
        left = sum(columns[:s]) + 2 * SIDE * s + SIDE
        start = left + (columns[s] - len(ids) * width - (len(ids) - 1) * 16) // 2
        for n, id in enumerate(ids):
            places[id] = (start + n * (width + 16), PAD + 8 + row * (ROW + GAP))
    centres = {}
    for id, s in side.items():
        left = sum(columns[:s]) + 2 * SIDE * s + SIDE
        outer = 1 if len(sides) == 2 and s == 1 else -1  # away from the crossing arrows
        centres[id] = (left, left + columns[s], outer)
    return places, columns, centres


def _frames(diagram: Diagram, places, columns) -> list[str]:
    """A dashed frame around each stack's layer, with "× N layers" in its corner."""
    drawn = []
    for stack in diagram.stacks:
        ids = [b.id for b in diagram.boxes if b.id.startswith(stack.prefix)]
        left, right, _ = columns[ids[0]]
        x0, x1 = left + 2, right - 2
        y0 = min(places[id][1] for id in ids) - 22
        y1 = max(places[id][1] for id in ids) + ROW + 10
        drawn.append(f'<rect x="{x0}" y="{y0}" width="{x1 - x0}" height="{y1 - y0}" rx="10" '
                     'fill="none" stroke="#666" stroke-dasharray="5 4"/>')  # fmt: skip
        words = f"× {stack.layers} layers ({stack.name})"
        drawn.append(f'<text x="{x1 - 8}" y="{y0 + 14}" text-anchor="end" font-weight="bold">'
                     f"{text(words)}</text>")  # fmt: skip
    return drawn


def _edge(places, column: tuple[int, int, int], a: str, b: str, width: int) -> str:
    """An arrow from box a to box b: straight down to the next row; from further up, along a
    lane between the boxes and the frame (a side box's near it, a middle box's on the column's
    outer side); from the other column (cross-attention's keys and values), a curve."""
    (ax, ay), (bx, by) = places[a], places[b]
    arrow = 'fill="none" stroke="#333" stroke-width="1.3" marker-end="url(#qkv-diagram-arrow)"'
    if a.startswith("enc.") != b.startswith("enc."):
        # right, down the margin between the columns, along the gap above b's row, into b
        sx, sy, tx, ty = ax + width, ay + ROW // 2, bx + width // 2, by
        margin, gap = column[0] - SIDE // 2, by - GAP // 2
        return (f'<path d="M{sx},{sy} L{margin},{sy} L{margin},{gap} L{tx},{gap} L{tx},{ty}" '
                f"{arrow}/>")  # fmt: skip
    if by - ay == ROW + GAP:
        return f'<path d="M{ax + width // 2},{ay + ROW} L{bx + width // 2},{by}" {arrow}/>'
    left, right, outer = column
    offset = ax + width // 2 - (left + right) // 2
    offset = 0 if abs(offset) < width // 2 else offset  # a middle box, give or take rounding
    y0, y1 = ay + ROW // 2, by + ROW // 2
    if offset > 0 or (offset == 0 and outer > 0):
        lane = ax + width + 10 if offset else right - 12
        ax, bx = ax + width, bx + width
    else:
        lane = ax - 10 if offset else left + 12
    return f'<path d="M{ax},{y0} L{lane},{y0} L{lane},{y1} L{bx},{y1}" {arrow}/>'


def _box(box, place: tuple[int, int], width: int, lit: bool) -> str:
    x, y = place
    alternative = f"{box.label}: {box.shape}. {box.explain}"
    return (
        f'<g class="box{" lit" if lit else ""}" data-box="{attribute(box.id)}" '
        f'data-step="{attribute(box.step)}" data-tensor="{attribute(box.tensor or "")}" '
        f'tabindex="0" role="button" aria-label="{attribute(alternative)}">'
        f"<title>{text(alternative)}</title>"
        f'<rect x="{x}" y="{y}" width="{width}" height="{ROW}" rx="6" '
        f'fill="{FILLS[box.step]}"/>'
        f'<text class="label" x="{x + width // 2}" y="{y + 17}" text-anchor="middle">'
        f"{text(box.label)}</text>"
        f'<text class="shape" x="{x + width // 2}" y="{y + 35}" text-anchor="middle" '
        f'font-family="DejaVu Sans Mono, monospace" font-size="11">{text(box.shape)}</text></g>'
    )
