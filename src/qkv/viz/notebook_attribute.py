"""The view of `qkv.attribute`'s result (docs/attribute.md): its short `repr`, its notebook HTML
(each number in a `title` and, exactly, in a `data-value` attribute, under the class `qkv-nb`
as the rest of `qkv.viz.notebook`), and the text `qkv attribute` prints."""

from __future__ import annotations

from qkv.viz import escape
from qkv.viz.notebook import cut, grid_table, quoted, wrapped


def _mean(values) -> float:
    return float(values.double().mean())


def attributed_repr(found) -> str:
    N = len(found.pairs)
    edges = (
        f", {len(found.senders)}x{len(found.receivers)} edges" if found.edges is not None else ""
    )
    return (f"Attributed({cut(str(found.metrics[0]), 50)}, {cut(found.source, 40)}, {N} "
            f"pair{'s' * (N != 1)}, steps {found.steps}{edges})")  # fmt: skip


def attributed_html(found) -> str:
    """The heads grid (the estimated change of the metric), the MLPs' and the residual's per
    (layer, position), and with edges the largest edges."""
    L, H = found.heads.shape
    first = found.pairs[0]
    columns = [f"{i} {t}" for i, t in enumerate(found.corrupt_tokens[0])]
    columns += [str(i) for i in range(len(columns), found.residual.shape[1])]
    parts = [
        f"<h4>Attribution patching of {quoted(cut(first.clean, 60))} into "
        f"{quoted(cut(first.corrupt, 60))}"
        + (f" and {len(found.pairs) - 1} more pairs" if len(found.pairs) > 1 else "")
        + f": {escape.text(found.source)}</h4>",
        f"<p>Metric {escape.text(str(found.metrics[0]))}: clean "
        f'<b data-value="{_mean(found.clean)!r}">{_mean(found.clean):.4f}</b>, corrupted '
        f'<b data-value="{_mean(found.corrupt)!r}">{_mean(found.corrupt):.4f}</b>. Each cell '
        "estimates how much patching that activation of the clean run into the corrupted run "
        "moves the metric (gradient x difference"
        + (f", integrated over {found.steps} steps" if found.steps > 1 else "")
        + ").</p><h4>Each head's output</h4>",
        grid_table(found.heads.tolist(), [f"layer {n}" for n in range(L)],
                   [f"head {h}" for h in range(H)], name="change", diverging=True),
        "<h4>Each MLP's output, at each position</h4>",
        grid_table(found.mlp.tolist(), [f"layer {n}" for n in range(L)], columns,
                   name="change", diverging=True),
        "<h4>The residual stream after each layer, at each position</h4>",
        grid_table(found.residual.tolist(), [f"layer {n}" for n in range(L)], columns,
                   name="change", diverging=True),
    ]  # fmt: skip
    if found.edges is not None:
        rows = "".join(
            f"<tr><td>{escape.text(s)}</td><td>{escape.text(r)}</td>"
            f'<td data-value="{v!r}">{v:+.4g}</td></tr>'
            for s, r, v in found.top_edges(20)
        )
        parts.append("<h4>The largest edges</h4><table><tr><th>sender</th><th>receiver</th>"
                     f"<th>score</th></tr>{rows}</table>")  # fmt: skip
    return wrapped("".join(parts))


def attributed_lines(found, top: int = 10) -> str:
    """`qkv attribute`'s text: the metrics, the largest heads, the MLPs' and with edges the
    largest edges."""
    N = len(found.pairs)
    lines = [
        f"metric {found.metrics[0]}: clean {_mean(found.clean):.4f}, corrupted "
        f"{_mean(found.corrupt):.4f}" + (f" (means over {N} pairs)" if N > 1 else ""),
        "estimated change of the metric when a head's output of the clean run is patched into "
        "the corrupted one (gradient x difference"
        + (f", {found.steps} integration steps" if found.steps > 1 else "")
        + "), the largest:",
        "  layer  head   change     share of the gap",
    ]
    gap = found.gap
    for layer, head, value in found.top_heads(top):
        share = f"{value / gap:+.3f}" if gap else "n/a"
        lines.append(f"  {layer:>5}  {head:>4}   {value:+.4f}   {share}")
    mlp = found.mlp.nan_to_num(0.0).sum(-1)  # (L,): over positions
    order = sorted(range(len(mlp)), key=lambda n: -abs(float(mlp[n])))[:top]
    lines.append("MLP outputs (summed over positions), the largest: "
                 + ", ".join(f"L{n} {float(mlp[n]):+.4f}" for n in order))  # fmt: skip
    if found.edges is not None:
        lines.append("edges (sender -> receiver), the largest:")
        for sender, receiver, value in found.top_edges(top):
            lines.append(f"  {sender:>8} -> {receiver:<10} {value:+.4f}")
    return "\n".join(lines)


def faithfulness_line(checked) -> str:
    return (f"against real patching (qkv patch), heads: Pearson {checked.pearson:.3f}, Spearman "
            f"{checked.spearman:.3f}, top {checked.top} overlap {checked.overlap:.2f}")  # fmt: skip
