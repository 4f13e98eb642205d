"""The notebook view of `qkv.why` (a `qkv.inspect.why_parts.Why`): static HTML, each number in a
`title` and, exactly, in a `data-value` attribute, styled under the class `qkv-nb` as the rest of
`qkv.viz.notebook`; and its short `repr`. The same facts in plain text are `qkv.viz.why_lines`'s.
"""

from __future__ import annotations

from qkv.viz import escape
from qkv.viz.notebook import cut, grid_table, number_cell, quoted, wrapped
from qkv.viz.why_lines import pair_words, part_words, position_terms, terms_grid

TOP = 10  # terms listed, the largest first


def why_repr(found) -> str:
    """One short line: the pair, where, the score, the weight and the largest term."""
    (a, b, value), *_ = found.ranked(1) or [("", "", 0.0)]
    split = ""
    if found.content is not None:
        split = f", content {float(found.content.sum()):+.4f} position {found.position:+.4f}"
    return (f"Why({cut(found.query, 20)!r} <- {cut(found.key, 20)!r}, {cut(found.source, 30)}, "
            f"layer {found.layer} head {found.head}, score {found.score:.4f}, weight "
            f"{found.weight:.4f}{split}, top {cut(a, 14)}.{cut(b, 14)} {value:+.4f})")  # fmt: skip


def why_html(found) -> str:
    """The score of one pair taken apart: the largest terms in words, the content / position
    split, the grid of terms (the largest parts of each side), the words the heads carried,
    each top part removed for real beside its prediction, and the notes."""
    q, k = quoted(found.query), quoted(found.key)
    kind = " (decoder cross-attention)" if found.query_tokens is not None else ""
    chosen = "" if found.chosen == "asked" else f": {escape.text(found.chosen)}"
    P, K = len(found.parts_q), len(found.parts_k)
    parts = [
        f"<h4>Why {q} attends to {k}: layer {found.layer}, head {found.head}{kind}, counted from "
        f"0{chosen}</h4>",
        f"<p>{escape.text(found.source)}: <i>{escape.text(cut(found.text, 120))}</i></p>",
        f'<p>Score <b class="score" data-value="{found.score!r}">{found.score:+.4f}</b> (what the '
        f'softmax read), weight <b class="weight" data-value="{found.weight!r}">'
        f"{100 * found.weight:.2f}%</b>. With each norm's scale held, the score before the "
        f"softmax is a sum of {P} x {K} terms, one per (part of {q}'s query, part of {k}'s key): "
        f'they sum to <b class="total" data-value="{found.total!r}">{found.total:+.6f}</b>.</p>',
        _terms_table(found),
        _split_html(found),
        f"<h4>The terms: {q}'s query parts down, {k}'s key parts across</h4>",
    ]
    rows, columns, values = terms_grid(found)
    parts.append(grid_table(values, rows, columns, name="term", diverging=True))
    if found.carried:
        parts.append(_carried_table(found))
    if found.checks:
        parts.append(_checks_table(found))
    notes = "".join(f"<li>{escape.text(note)}</li>" for note in found.notes)
    parts.append(f'<ul class="note">{notes}</ul>')
    return wrapped("".join(parts))


def _terms_table(found) -> str:
    ranked = found.ranked(TOP)
    most = max((abs(v) for _, _, v in ranked), default=1.0) or 1.0
    total = max(abs(found.total), 1e-12)
    rows = "".join(
        f'<tr data-query-part="{escape.attribute(a)}" data-key-part="{escape.attribute(b)}">'
        f"{number_cell(v, shown=f'{v:+.4f}')}<td>{100 * v / total:.1f}%</td>"
        f'<td class="text">{escape.text(pair_words(found, a, b))}</td>'
        f'<td class="text"><span class="bar{" negative" if v < 0 else ""}" '
        f'style="width:{120 * abs(v) / most:.1f}px"></span></td></tr>'
        for a, b, v in ranked
    )
    return (f"<h4>The {len(ranked)} largest terms</h4>"
            '<table class="terms"><tr><th>term</th><th>share</th><th class="text">query part . '
            f'key part</th><th></th></tr>{rows}</table>')  # fmt: skip


def _split_html(found) -> str:
    if found.content is not None:
        content = float(found.content.sum())
        return (f'<p class="split">Content <b class="content" data-value="{content!r}">'
                f"{content:+.4f}</b> (every term with both words turned as if at the same "
                f'position) and position <b class="position" data-value="{found.position!r}">'
                f"{found.position:+.4f}</b> (what their distance adds).</p>")  # fmt: skip
    if "position" in found.parts_q and "position" in found.parts_k:
        value = position_terms(found)
        return (f'<p class="split">Not a rotary layer: positions enter as a part of their own; '
                f'the terms with the position embedding on either side sum to <b class="position"'
                f' data-value="{value!r}">{value:+.4f}</b>.</p>')  # fmt: skip
    return '<p class="split">Not a rotary layer: no content / position split.</p>'


def _carried_table(found) -> str:
    rows = []
    for c in found.carried:
        into = found.query if c.side == "query" else found.key
        words = ", ".join(f"{quoted(t)} ({100 * w:.1f}%) {v:+.3f}" for t, _, w, v in c.words[:3])
        rows.append(f'<tr data-part="{escape.attribute(c.part)}" data-side="{c.side}">'
                    f'<td class="text">{escape.text(part_words(c.part, into))}</td>'
                    f"{number_cell(c.value, shown=f'{c.value:+.4f}')}"
                    f'<td class="text">{words}</td></tr>')  # fmt: skip
    return (
        "<h4>What the heads carried: a head's part, split over the words it read (its "
        'weight on each)</h4><table class="carried"><tr><th class="text">part</th>'
        f'<th>term</th><th class="text">the words it read</th></tr>{"".join(rows)}</table>'
    )


def _checks_table(found) -> str:
    rows = []
    for c in found.checks:
        word = found.query if c.side == "query" else found.key
        cells = "".join(number_cell(v, shown=shown) for v, shown in (
            (c.predicted_score, f"{c.predicted_score:+.4f}"),
            (c.real_score, f"{c.real_score:+.4f}"),
            (c.predicted_weight, f"{100 * c.predicted_weight:.2f}%"),
            (c.real_weight, f"{100 * c.real_weight:.2f}%")))  # fmt: skip
        rows.append(
            f'<tr data-part="{escape.attribute(c.part)}" data-side="{c.side}">'
            f'<td class="text">{escape.text(part_words(c.part, word))}</td>{cells}</tr>'
        )
    return (
        "<h4>Each top part removed for real (zeroed at its word, the model rerun from its "
        "layer): the linear prediction beside the real change</h4>"
        '<table class="checks"><tr><th class="text">removed</th><th>score predicted</th>'
        "<th>score real</th><th>weight predicted</th><th>weight real</th></tr>"
        f"{''.join(rows)}</table>"
    )
