"""The notebook views of qkv's interventions (docs/hide.md, ablate.md, patch.md, lens.md,
heads.md): static HTML, each number in a `title` and, exactly, in a `data-value` attribute,
styled under the class `qkv-nb` as the rest of `qkv.viz.notebook`; and each result's short
`repr`.
"""

from __future__ import annotations

import torch

from qkv.inspect.census import SCORES
from qkv.viz import escape
from qkv.viz.lines import hide_scale_text
from qkv.viz.notebook import cut, grid_table, number_cell, quoted, wrapped


def hidden_html(found) -> str:
    """`qkv.hide`'s result (a `qkv.inspect.hide.Hidden`): the change with the key hidden
    everywhere asked, each (layer, head)'s alone as a grid, and a decoder's next tokens."""
    keys = " and ".join(quoted(k) for k in _listed(found.key))
    whom = quoted(found.query) if found.query is not None else "every word"
    L = found.effect.shape[0]
    parts = [f"<h4>{keys} hidden from {whom}: {escape.text(found.source)}</h4>"]
    if found.clean_states is None:  # compare=False: one run, nothing to compare with
        parts.append("<p>Hidden in every head asked at once, in one run without the clean one "
                     "(compare=False): no change to show. <i>"
                     f"{escape.text(cut(found.text, 120))}</i></p>")  # fmt: skip
        return wrapped("".join(parts))
    parts += [
        _over_html(found),
        f"<p>Hidden in every head asked at once, {whom}'s final vector changes by "
        f'<b class="total" data-value="{found.total!r}">{found.total:.4f}</b>'
        f"{_interval_html(found, 'total')} (1 - cosine; distance {found.total_distance:.4f}). "
        f"<i>{escape.text(cut(found.text, 120))}</i></p>",
    ]
    scale = hide_scale_text(found)
    if scale is not None:
        parts.append(f'<p class="scale">{escape.text(scale[0].upper() + scale[1:])}.</p>')
    if bool((found.effect == found.effect).any()):  # the table was asked for (table=True)
        parts.append("<p>Each (layer, head) alone, the change of the final vector "
                     "(1 - cosine); blank where not asked:</p>")  # fmt: skip
        parts.append(_head_grid(found.effect, "change", L))
    if found.next is not None:
        parts.append(_next_html(found.next))
    return wrapped("".join(parts))


def hidden_repr(found) -> str:
    keys = "+".join(repr(cut(k, 20)) for k in _listed(found.key))
    whom = repr(cut(found.query, 20)) if found.query is not None else "every word"
    over = f", {len(found.texts)} prompts" if len(found.texts) > 1 else ""
    return (f"Hidden({keys} hidden from {whom}, {cut(found.source, 40)}{over}, "
            f"total {found.total:.4f})")  # fmt: skip


def ablated_html(found) -> str:
    """`qkv.ablate`'s result (a `qkv.inspect.ablate.Ablated`): the change with every head
    asked ablated, each head's alone as a grid, and a decoder's next tokens."""
    L = found.effect.shape[0]
    title = (f"<h4>{len(found.heads)} head{'s' * (len(found.heads) != 1)} ablated "
             f"({escape.text(found.mode)}): {escape.text(found.source)}</h4>")  # fmt: skip
    if found.clean_states is None:  # compare=False: one run, nothing to compare with
        return wrapped(title + "<p>Ablated in one run without the clean one (compare=False): "
                       "no change to show.</p>")  # fmt: skip
    parts = [
        title,
        _over_html(found),
        f'<p>All at once, the final vectors change by <b class="total" data-value='
        f'"{found.total!r}">{found.total:.4f}</b>{_interval_html(found, "total")} (1 - cosine, '
        f"the mean over every token). <i>{escape.text(cut(found.text, 120))}</i></p>",
        "<p>Each head ablated alone; blank where not asked:</p>",
        _head_grid(found.effect, "change", L),
    ]
    if found.next is not None:
        parts.append(_next_html(found.next))
    return wrapped("".join(parts))


def ablated_repr(found) -> str:
    return (f"Ablated({found.mode}, {len(found.heads)} heads, {cut(found.source, 40)}, "
            f"total {found.total:.4f})")  # fmt: skip


def patched_html(found) -> str:
    """`qkv.patch`'s result (a `qkv.inspect.patch.Patched`): the share of the clean metric
    each patch restores, per grid patched (heads first); `qkv.path_patch`'s (a `PathPatched`):
    the metric with the sender's change through its receivers only."""
    if hasattr(found, "sender"):
        return _path_patched_html(found)
    N = len(found.pairs)
    which = (f"{N} pairs, the first: " if N > 1 else "") + (
        f"{quoted(cut(found.clean_text, 60))} into {quoted(cut(found.corrupt_text, 60))}"
    )
    parts = [
        f"<h4>Patching {which}: {escape.text(found.source)}</h4>"
        f"<p>Metric {escape.text(str(found.metric))}: clean "
        f'<b data-value="{found.clean!r}">{found.clean:.4f}</b>, corrupted '
        f'<b data-value="{found.corrupt!r}">{found.corrupt:.4f}</b>'
        + (" (means over the pairs)" if N > 1 else "") + ". Each cell is the share of "
        "the way back to clean that one patch restores (1: all of it, 0: nothing); the metric "
        "itself is in its title.</p>"
    ]  # fmt: skip
    for what in sorted(found.what, key=lambda w: w != "heads"):  # the heads' grid first
        parts.append(_patched_grid(found, what))
    return wrapped("".join(parts))


TITLES = {
    "heads": "Each head's output patched in", "q": "Each head's queries patched in",
    "k": "Each query head's keys patched in", "v": "Each query head's values patched in",
    "weights": "Each head's attention weights patched in",
    "residual": "The residual stream after each layer, at each position",
    "mlp": "Each layer's MLP output, at each position",
    "mlp_layers": "Each layer's MLP output, at every position at once",
    "head_positions": "Each head's output at one position: the largest moves",
}  # fmt: skip


def _patched_grid(found, what: str) -> str:
    grid = found.grid(what)
    restored = found.restored(grid)
    L = grid.shape[0]
    layers = [f"layer {n}" for n in range(L)]
    title = f"<h4>{TITLES[what]}</h4>"
    if what == "mlp_layers":
        return title + grid_table([restored.tolist()], ["MLP"], layers, name="restored",
                                  raw=[grid.tolist()], diverging=True)  # fmt: skip
    if what == "head_positions":  # (L, H, T): the cells that move the metric most
        cells = sorted((c for c in torch.nonzero(~grid.isnan()).tolist()),
                       key=lambda c: -abs(float(grid[tuple(c)]) - found.corrupt))[:20]  # fmt: skip
        labels = found.position_labels()
        rows = "".join(
            f'<tr><td>{n}</td><td>{h}</td><td class="text">{t} {escape.text(labels[t])}</td>'
            f"{number_cell(grid[n, h, t])}{number_cell(restored[n, h, t])}</tr>"
            for n, h, t in cells
        )
        return (title + '<table><tr><th>layer</th><th>head</th><th class="text">position</th>'
                f"<th>metric</th><th>restored</th></tr>{rows}</table>")  # fmt: skip
    if what in ("residual", "mlp"):
        columns = [f"{i} {t}" for i, t in enumerate(found.position_labels())]
    else:
        columns = [f"head {h}" for h in range(grid.shape[1])]
    return title + grid_table(restored.tolist(), layers, columns, name="restored",
                              raw=grid.tolist(), diverging=True)  # fmt: skip


def _path_patched_html(found) -> str:
    layer, head = found.sender
    N = len(found.pairs)
    return wrapped(
        f"<h4>Path patching layer {layer} head {head} through {len(found.receivers)} "
        f"receiver{'s' * (len(found.receivers) != 1)} (via {', '.join(found.via)}): "
        f"{escape.text(found.source)}</h4>"
        f"<p>Metric {escape.text(str(found.metric))}"
        + (f", the mean over {N} pairs" if N > 1 else "") + ": clean "
        f'<b data-value="{found.clean!r}">{found.clean:.4f}</b>, corrupted '
        f'<b data-value="{found.corrupt!r}">{found.corrupt:.4f}</b>, the sender\'s change '
        f'through the receivers only <b class="total" data-value="{found.value!r}">'
        f"{found.value:.4f}</b> (restored {found.restored:.3f}; 95% interval "
        f"{float(found.spread.low):.4f} to {float(found.spread.high):.4f}).</p>"
    )  # fmt: skip


def patched_repr(found) -> str:
    if hasattr(found, "sender"):
        return (f"PathPatched(L{found.sender[0]} H{found.sender[1]} via "
                f"{','.join(found.via)}, {len(found.receivers)} receivers, "
                f"{cut(found.source, 40)}, {found.value:.4f})")  # fmt: skip
    pairs = f", {len(found.pairs)} pairs" if len(found.pairs) > 1 else ""
    return (f"Patched({cut(str(found.metric), 50)}, {cut(found.source, 40)}{pairs}, "
            f"clean {found.clean:.4f}, corrupt {found.corrupt:.4f})")  # fmt: skip


def lens_html(found) -> str:
    """The logit lens (a `qkv.inspect.lens.Lens`): each depth's top next tokens, the followed
    token's rank and log-probability, then the largest terms of its logit's attribution."""
    top = len(found.top_tokens[0]) if found.top_tokens else 0
    head = ('<tr><th class="text">depth</th>' + "".join(f"<th>#{i + 1}</th>" for i in range(top))
            + f"<th>rank of {quoted(found.token)}</th><th>log-prob</th></tr>")  # fmt: skip
    rows = []
    for d, name in enumerate(found.layers):
        cells = "".join(
            f'<td class="text{" followed" if i == found.token_id else ""}" data-value="{p!r}" '
            f'title="p = {p:.6g}">{escape.text(repr(t))} {p:.3f}</td>'
            for t, p, i in zip(found.top_tokens[d], found.top_probs[d], found.top_ids[d],
                               strict=True)
        )  # fmt: skip
        logprob = number_cell(found.logprob[d], shown=f"{found.logprob[d]:.3f}")
        rank = f'<td data-value="{found.rank[d]}">{found.rank[d]}</td>'
        rows.append(f'<tr data-depth="{d}"><td class="text">{escape.text(name)}</td>{cells}{rank}'
                    f"{logprob}</tr>")  # fmt: skip
    at = f"position {found.position} ({quoted(found.tokens[found.position])})"
    parts = [f"<h4>The logit lens of {escape.text(found.source)}: the next token after {at}</h4>",
             _over_html(found), f'<table class="lens">{head}{"".join(rows)}</table>']  # fmt: skip
    a = found.attribution
    if a is not None:
        terms = a.terms()[:10]
        most = max((abs(v) for _, v in terms), default=1.0) or 1.0
        lines = "".join(
            f'<tr><td class="text">{escape.text(name)}</td>{number_cell(v, shown=f"{v:+.4f}")}<td '
            f'class="text"><span class="bar{" negative" if v < 0 else ""}" style="width:'
            f'{160 * abs(v) / most:.1f}px"></span></td></tr>'
            for name, v in terms
        )
        parts.append(
            f"<h4>Direct logit attribution of {quoted(a.token)}: logit "
            f'<span data-value="{a.logit!r}">{a.logit:.4f}</span>, the largest terms</h4>'
            f'<table class="terms">{lines}<tr><td class="text">the final norm\'s remainder</td>'
            f"{number_cell(a.remainder, shown=f'{a.remainder:+.4f}')}<td></td></tr>"
            f'<tr><td class="text">total (every term)</td>'
            f"{number_cell(a.total, shown=f'{a.total:.4f}')}<td></td></tr></table>"
        )
    return wrapped("".join(parts))


def lens_repr(found) -> str:
    return (f"Lens({cut(found.source, 40)}, position {found.position}, {cut(found.token, 20)!r}"
            f" rank {found.rank[-1]} at {found.layers[-1]})")  # fmt: skip


def census_html(found) -> str:
    """The census of heads (a `qkv.inspect.census.Census`): each score as an (L, H) grid of
    colored cells, the top heads first."""
    L, H = found.previous_token.shape
    parts = [f"<h4>{escape.text(found.source)}: {L} layers x {H} heads, counted from 0</h4>"]
    if len(found.prompts) > 1:
        parts.append(f'<p class="prompts">Each score the mean over {len(found.prompts)} '
                     f"prompts (induction: {found.induction_rows} random rows); each cell's "
                     "bootstrap 95% interval is in <code>spreads</code>.</p>")  # fmt: skip
    effective = found.effective_words()
    if effective is not None:
        parts.append(f'<p class="effective">{escape.text(effective)}</p>')
    for name in SCORES:
        grid = found.scores(name)
        if bool(grid.isnan().all()):
            continue
        best = ", ".join(f"L{n} H{h} {s:.3f}" for n, h, s in found.top(name, 3))
        words = escape.text(name.replace("_", " "))
        parts.append(f'<h4 data-score="{escape.attribute(name)}">{words}: top {best}</h4>')
        parts.append(_head_grid(grid, name.replace("_", " "), L))
    return wrapped("".join(parts))


def census_repr(found) -> str:
    L, H = found.previous_token.shape
    tops = ", ".join(
        f"{name.replace('_', ' ')} L{n} H{h}"
        for name in ("previous_token", "induction")
        for n, h, _ in found.top(name, 1)
    )
    return f"Census({cut(found.source, 40)}, {L} layers x {H} heads; {tops})"


def _head_grid(grid, name: str, L: int) -> str:
    H = grid.shape[1]
    return grid_table(grid.tolist(), [f"layer {n}" for n in range(L)],
                 [f"head {h}" for h in range(H)], name=name)  # fmt: skip


def _over_html(found) -> str:
    """A line saying a result is a mean over prompts ('' for one prompt)."""
    n = len(getattr(found, "texts", []))
    if n < 2:
        return ""
    return (f'<p class="prompts">Over {n} prompts: each number the mean, [in brackets] its '
            "bootstrap 95% interval (each prompt's values in <code>spreads</code>); the tokens "
            "and next tokens shown are the first prompt's.</p>")  # fmt: skip


def _interval_html(found, name: str) -> str:
    """' [low, high]' of a mean over several prompts ('' for one)."""
    spread = getattr(found, "spreads", {}).get(name)
    if spread is None or len(found.texts) < 2:
        return ""
    low, high = float(spread.low), float(spread.high)
    return (f' <span class="interval" data-low="{low!r}" data-high="{high!r}">'
            f"[{low:.4f}, {high:.4f}]</span>")  # fmt: skip


def _listed(key) -> list[str]:
    return [key] if isinstance(key, str) else list(key)


def _next_html(next_tokens) -> str:
    def cells(token) -> str:
        shown = number_cell(token.logprob, shown=f"{token.logprob:.3f}")
        return f'<td class="text">{escape.text(repr(token.token))}</td>{shown}'

    rows = "".join(
        f"<tr>{cells(b)}{cells(a)}</tr>"
        for b, a in zip(next_tokens.before, next_tokens.after, strict=True)
    )
    return (
        f"<h4>The next token after position {next_tokens.position}: the clean top token's "
        f"log-probability changes by {next_tokens.top_change:+.4f}</h4>"
        '<table><tr><th class="text">before</th><th>log-prob</th><th class="text">after</th>'
        f"<th>log-prob</th></tr>{rows}</table>"
    )
