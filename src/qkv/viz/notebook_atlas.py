"""The views of an `Atlas` (`qkv.atlas`, docs/atlas.md): its short `repr`, the lines the
shell shows, and the notebook's static HTML: each statistic's (layer x head) grid as colored
cells (`notebook.grid_table`, the exact value in each cell's data-value), then the top heads of
each statistic with their best example, the query and its key marked."""

from __future__ import annotations

from qkv.inspect.atlas import STATS
from qkv.viz import escape
from qkv.viz.notebook import cut, grid_table, wrapped

SHOWN = 5  # heads listed per statistic


def atlas_repr(found) -> str:
    return (f"Atlas({cut(found.source, 40)} on {cut(found.corpus['name'], 40)}, "
            f"{found.tokens:,} tokens, {len(found.heads_per_layer)} layers)")  # fmt: skip


def atlas_lines(found, top: int = SHOWN) -> str:
    """The top heads of each statistic (the lowest for entropy), one statistic a line."""
    lines = [f"{found.source} over {found.corpus['name']}: {found.tokens:,} tokens in "
             f"{found.windows:,} windows; layers and heads from 0"]  # fmt: skip
    for name in STATS:
        heads = found.top(name, top)
        said = "  ".join(f"L{layer} H{head} {value:.3f}" for layer, head, value in heads)
        lines.append(f"  {name.replace('_', ' '):>15}  {said or '(no layer has it)'}")
    return "\n".join(lines)


def example_text(found, layer: int, head: int, rank: int = 0) -> tuple[str, str, str] | None:
    """An example's tokens before its query, the query, and its key, as text; None where
    the head has none."""
    examples = found.examples[layer][head]
    if rank >= len(examples):
        return None
    e = examples[rank]
    pieces = found.contexts[e.window]
    return "".join(pieces[max(1, e.query - 8) : e.query]), pieces[e.query], pieces[e.key]


def atlas_html(found) -> str:
    L = len(found.heads_per_layer)
    H = max(found.heads_per_layer)
    parts = [f"<h4>Head atlas: {escape.text(atlas_repr(found))}</h4>"]
    for name in STATS:
        grid = found.stats[name]
        if bool(grid.isnan().all()):
            continue
        parts.append(f"<h4>{escape.text(name.replace('_', ' '))}</h4>")
        parts.append(grid_table(grid.tolist(), [f"L{n}" for n in range(L)],
                                [f"H{h}" for h in range(H)], name=name))  # fmt: skip
    rows = []
    for name in STATS:
        for layer, head, value in found.top(name, SHOWN):
            said = example_text(found, layer, head)
            before, query, key = said if said is not None else ("", "", "")
            rows.append(
                f"<tr><td>{escape.text(name)}</td><td>L{layer} H{head}</td>"
                f'<td data-value="{value!r}">{value:.3f}</td><td>{escape.text(before)}'
                f"<b>{escape.text(query)}</b></td><td>{escape.text(key)}</td></tr>"
            )
    parts.append("<h4>Top heads and their best example</h4><table><tr><th>statistic</th>"
                 "<th>head</th><th>value</th><th>context, query in bold</th><th>key</th></tr>"
                 f"{''.join(rows)}</table>")  # fmt: skip
    return wrapped("".join(parts))
