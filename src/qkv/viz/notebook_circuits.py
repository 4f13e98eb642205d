"""The views of `qkv.circuits` (docs/circuits.md): the lines `qkv circuits` prints, and the
notebook's short `repr` and static HTML (each number in a `title` and, exactly, in a
`data-value` attribute, styled under the class `qkv-nb` as the rest of `qkv.viz.notebook`).

Composition scores are computed on first use, about a second per kind on a small model; a
view shows the kinds already computed and computes K-composition only where none is, so that
displaying a result never costs three kinds."""

from __future__ import annotations

from qkv.viz import escape
from qkv.viz.notebook import cut, number_cell, wrapped

KIND_NAMES = {
    "q": "Q-composition: a later head's queries read what an earlier head wrote",
    "k": "K-composition: a later head's keys read what an earlier head wrote",
    "v": "V-composition: a later head's values read what an earlier head wrote",
}


def circuits_lines(found, kind: str = "k", top: int = 10) -> str:
    """The strongest compositions of one kind, one pair a line, then the notes."""
    pairs = found.strongest(kind, top)
    lines = [
        f"{found.source}: {found.num_layers} layers, {len(found.names)} softmax heads "
        f"(at most {found.num_heads} a layer); from the weights alone",
        f"{KIND_NAMES[kind]} (Elhage et al. 2021; 0 to 1, higher: more)",
        f"  {'sender':>8}  {'receiver':>8}  score",
    ]
    lines += [f"  {s:>8}  {r:>8}  {v:.4f}" for s, r, v in pairs]
    if not pairs:
        lines.append("  (no pair: no softmax head has an earlier layer's head to read)")
    if found.skipped:
        lines.append(f"skipped (linear attention): layers {', '.join(map(str, found.skipped))}")
    lines += [f"note: {note}" for note in found.notes]
    return "\n".join(lines)


def head_lines(head) -> str:
    """One head's token tables: its top QK pairs, its copying score and top copied tokens,
    and a rotary head's top pairs at other distances."""
    lines = [
        f"L{head.layer}.H{head.head} (key and value head {head.kv_head}): the QK circuit "
        f"through the embedding, at distance {head.distance}",
        f"  {'pair':>4}  {'query token':>16}  {'key token':>16}  score",
    ]
    lines += [f"  {'#' + str(i):>4}  {q!r:>16}  {k!r:>16}  {s:.4f}"
              for i, (q, k, s) in enumerate(head.pairs, 1)]  # fmt: skip
    if head.by_distance:
        lines.append("the top pairs' score by distance (the key that many tokens before):")
        lines.append("  " + " ".join(f"{d:>8}" for d in ["pair", *head.distances]))
        for rank, row in enumerate(head.by_distance, 1):
            lines.append(f"  {'#' + str(rank):>8} " + " ".join(f"{v:>8.3f}" for v in row))
    if head.copying is None:
        lines.append("OV circuit: no LM head to read it through")
    else:
        lines.append(f"OV circuit: copying score {head.copying:+.4f} (sum of its eigenvalues / "
                     "sum of their sizes: +1 copies, -1 suppresses)")  # fmt: skip
        lines.append("  top copied tokens: " + ", ".join(f"{t!r} {v:.3f}" for t, v in head.copied))
    lines += [f"note: {note}" for note in head.notes]
    return "\n".join(lines)


def _kinds(found) -> list[str]:
    computed = [kind for kind in ("q", "k", "v") if kind in found._scores]
    return computed or ["k"]


def circuits_repr(found) -> str:
    computed = [kind for kind in ("q", "k", "v") if kind in found._scores]
    shown = ""
    if computed and found.strongest(computed[0], 1):
        s, r, v = found.strongest(computed[0], 1)[0]
        shown = f", strongest {computed[0].upper()}: {s} -> {r} {v:.4f}"
    return (f"Circuits({cut(found.source, 40)}, {found.num_layers} layers, "
            f"{len(found.names)} heads{shown})")  # fmt: skip


def circuits_html(found, top: int = 10) -> str:
    """`qkv.circuits`'s result: the strongest compositions of each kind computed (K by
    default), and each head's largest QK and OV singular values."""
    parts = [
        f"<h4>Circuits from the weights: {escape.text(found.source)}</h4>",
        f"<p>{found.num_layers} layers, {len(found.names)} softmax heads. comp(W_A, W_B) = "
        "||W_A W_B||_F / (||W_A||_F ||W_B||_F), the sender's W_OV as W_B.</p>",
    ]
    for kind in _kinds(found):
        try:
            pairs = found.strongest(kind, top)
        except ValueError as refused:  # post-norm blocks: said why, in place of the table
            parts.append(f"<p>{escape.text(refused)}</p>")
            break
        rows = "".join(
            f"<tr><td>{escape.text(s)}</td><td>{escape.text(r)}</td>{number_cell(v, f'{v:.4f}')}"
            "</tr>"
            for s, r, v in pairs
        )
        parts.append(
            f"<h4>{escape.text(KIND_NAMES[kind])}</h4><table><tr><th>sender</th>"
            f"<th>receiver</th><th>score</th></tr>{rows}</table>"
        )
    largest = "".join(
        f"<tr><td>{escape.text(name)}</td>{number_cell(found.qk_singular[i, 0])}"
        f"{number_cell(found.ov_singular[i, 0])}</tr>"
        for i, name in enumerate(found.names[: 4 * top])
    )
    more = len(found.names) - 4 * top
    parts.append(
        "<h4>Each head's largest singular values</h4><table><tr><th>head</th>"
        f"<th>W_QK</th><th>W_OV</th></tr>{largest}</table>"
        + (f"<p>and {more} more heads (Circuits.qk_singular, .ov_singular)</p>" if more > 0 else "")
    )
    parts += [f"<p><i>{escape.text(note)}</i></p>" for note in found.notes]
    return wrapped("".join(parts))
