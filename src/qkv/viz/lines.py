"""Inspection results told in plain text for people: the probe, the interventions (hide,
ablate, patch, senses without context), the logit lens and the census of heads. What `qkv`'s
verbs print; the numbers are the results' own (`--json` gives every one)."""

from __future__ import annotations

import textwrap

import torch

from qkv.inspect.ablate import Ablated
from qkv.inspect.census import SCORES, Census
from qkv.inspect.hide import Hidden, Senses
from qkv.inspect.hide_scale import key_rank
from qkv.inspect.lens import Lens
from qkv.inspect.patch import Patched
from qkv.inspect.path_patch import PathPatched
from qkv.inspect.probe import MEASURES, Probe
from qkv.inspect.runs import NextTokens, Token
from qkv.viz.narrate import shown


def probe_lines(probe: Probe) -> str:
    """Per depth: how alike the word's vectors are across sentences, and how far apart the
    senses are (with labels); each measure named as `MEASURES` names it, and defined."""
    n = len(probe.sentences)
    others = ~torch.eye(n, dtype=torch.bool)  # pairs of different sentences
    lines = [f'"{probe.word}" in {n} sentences; cosine similarity of its vectors:']
    for depth, name in enumerate(probe.layers):
        pairs = probe.similarity[depth][others]
        line = (
            f"  {name:>10}: mean cosine {pairs.mean().item():.3f}, lowest {pairs.min().item():.3f}"
        )
        if probe.separation is not None:
            line += (
                f"; separation {probe.separation[depth]:+.3f}, "
                f"accuracy {100 * probe.accuracy[depth]:.0f}%"
            )
        lines.append(line)
    lines.append(textwrap.fill(probe_embeddings_note(probe), 100))
    if probe.cue_head is not None:
        layer, head, share = probe.cue_head
        lines.append(
            f'In layer {layer}, head {head}, "{probe.word}" attends most to the word that tells '
            f"its sense in {100 * share:.1f}% of the sentences (the best of every layer and head)."
        )
    shown = ["mean cosine"] + (["separation", "accuracy"] if probe.separation is not None else [])
    lines += [textwrap.fill(f"{name}: {MEASURES[name]}.", 100, subsequent_indent="  ")
              for name in shown]  # fmt: skip
    return "\n".join(lines)


def probe_embeddings_note(probe: Probe) -> str:
    """Why the word's vectors at the embeddings are (or are not) all equal, from the numbers:
    every occurrence is the same token, so only a position added there tells them apart."""
    n = len(probe.sentences)
    lowest = float(probe.similarity[0][~torch.eye(n, dtype=torch.bool)].min()) if n > 1 else 1.0
    same = f'At the embeddings every "{probe.word}" is the same token'
    if lowest > 1 - 1e-6:
        return (f"{same}, and its vectors are equal (cosine 1): this model adds no position "
                "there (its positions act inside attention).")  # fmt: skip
    return (f"{same}; the cosines there are below 1 (lowest {lowest:.3f}) because the model "
            "adds each token's position to its embedding, and the word sits at different "
            "positions (before attention, no other word reaches it).")  # fmt: skip


# ---------------------------------------------------------------------------- interventions


def _next_lines(next: NextTokens | None, what: str, result=None) -> list[str]:
    """A decoder's next tokens before and after (the first prompt's, and over several prompts
    the mean change of each one's own first token)."""
    if next is None:
        return []

    def listed(tokens: list[Token]) -> str:
        return ", ".join(f"{t.token!r} {t.logprob:.3g}" for t in tokens)

    several = result is not None and len(result.texts) > 1
    lines = [
        f"{'the first prompt: ' if several else ''}next token after position {next.position} "
        "(log-probabilities):",
        f"  as the model reads it: {listed(next.before)}",
        f"  {what}: {listed(next.after)}",
        f"  the first one's log-probability changed by {next.top_change:+.3g}",
    ]
    if several and "top_change" in result.spreads:
        change = result.spreads["top_change"]
        lines.append(f"over the {len(result.texts)} prompts, each one's first next token's "
                     f"log-probability changed by {float(change.mean):+.3g}"
                     f"{_interval(result, 'top_change')}")  # fmt: skip
    return lines


def senses_lines(result: Senses) -> str:
    counts = ", ".join(f"{result.labels.count(s)} {s}" for s in dict.fromkeys(result.labels))
    return "\n".join([
        f"'{result.word}' after the last layer, in {len(result.sentences)} sentences ({counts}):",
        f"  with its context:         separation {result.separation:+.3f}, "
        f"accuracy {result.accuracy:.0%}",
        f"  every other word hidden:  separation "
        f"{result.hidden_separation:+.3f}, accuracy {result.hidden_accuracy:.0%}",
        "  (hidden from it in every layer and head: what is left is the word itself, its",
        "  position and the special tokens)",
        *(textwrap.fill(f"{name}: {MEASURES[name]}.", 100, subsequent_indent="  ")
          for name in ("separation", "accuracy")),
    ])  # fmt: skip


def _interval(result, name: str, *cell: int) -> str:
    """' [low, high]': the bootstrap 95% interval of a mean over several prompts; '' for one."""
    spread = result.spreads.get(name)
    if len(result.texts) < 2 or spread is None:
        return ""
    return f" [{float(spread.low[cell]):.3g}, {float(spread.high[cell]):.3g}]"


def _over(result) -> list[str]:
    """The line that says a result is a mean over prompts (none for one prompt)."""
    n = len(result.texts)
    if n < 2:
        return []
    return [f"over {n} prompts: each number the mean, [in brackets] its bootstrap 95% interval"]


def hide_lines(result: Hidden, top: int = 10) -> str:
    """The heads that carry the key into the query, largest effect first, and the total
    (over several prompts: the means, with their intervals)."""
    key = result.key if isinstance(result.key, str) else ", ".join(result.key)
    query = f"'{result.query}'" if result.query is not None else "every word"
    lines = [
        f"hiding '{key}' from {query} in {result.source}, in each head alone:",
        f"the change of the final vector of {query} (1 - cosine, and distance)",
        "  layer  head   1-cos     distance",
    ]
    lines[1:1] = _over(result)
    for layer, head, effect in result.ranked()[:top]:
        distance = float(result.distance[layer, head])
        shown_effect = f"{effect:<8.3g}{_interval(result, 'effect', layer, head)}"
        lines.append(f"  {layer:>5}  {head:>4}   {shown_effect}  {distance:.3g}"
                     f"{_interval(result, 'distance', layer, head)}")  # fmt: skip
    shown = len(result.layers) * len(result.heads)
    if shown > top:
        lines.append(f"  ({shown - top} more heads; --json lists every one)")
    lines.append(
        f"hidden in all {shown} heads at once: 1 - cosine {result.total:.3g}"
        f"{_interval(result, 'total')}, distance {result.total_distance:.3g}"
        f"{_interval(result, 'total_distance')}"
    )
    scale = hide_scale_text(result)
    if scale is not None:
        lines.append(textwrap.fill(scale, 100, subsequent_indent="  "))
    return "\n".join(lines + _next_lines(result.next, f"with '{key}' hidden", result))


def hide_scale_text(result: Hidden) -> str | None:
    """The key's change set beside each other word's, hidden instead in the same heads (None
    where the scale was not asked: several prompts, or no table)."""
    others = result.others
    if not others:
        return None
    key = result.key if isinstance(result.key, str) else ", ".join(result.key)
    shown = len(result.layers) * len(result.heads)
    rank = key_rank(result.total, others)
    low, high = others[-1], others[0]
    which = ("each other word" if result.others_of <= len(others) else
             f"the {len(others)} of {result.others_of} other words nearest the query")  # fmt: skip
    return (
        f"for scale, {which} hidden instead (in the same {shown} heads at once): "
        f"'{key}' ranks {rank} of {len(others) + 1}, the others change it by 1 - cosine "
        f"{low.total:.3g} ('{low.word}') to {high.total:.3g} ('{high.word}')"
    )


def ablate_lines(result: Ablated, top: int = 10) -> str:
    lines = [
        f"{result.mode}-ablating heads of {result.source}, each alone (mean change of every "
        "token's final vector, 1 - cosine):",
        *_over(result),
        "  layer  head   1-cos",
    ]
    for layer, head, effect in result.ranked()[:top]:
        lines.append(f"  {layer:>5}  {head:>4}   {effect:.3g}"
                     f"{_interval(result, 'effect', layer, head)}")  # fmt: skip
    if len(result.heads) > top:
        lines.append(f"  ({len(result.heads) - top} more heads; --json lists every one)")
    lines.append(f"all {len(result.heads)} heads ablated at once: 1 - cosine {result.total:.3g}"
                 f"{_interval(result, 'total')}")  # fmt: skip
    return "\n".join(lines + _next_lines(result.next, "with them ablated", result))


def patch_lines(result: Patched, top: int = 10) -> str:
    """Both metrics (with their 95% intervals over several pairs), then each grid patched: the
    cells that move the metric most (per head), or the share restored (per position, layer)."""
    N = len(result.pairs)
    lines = [f"metric {result.metric}: clean {result.clean:.4f}, corrupted {result.corrupt:.4f}"]
    if N > 1:
        own = len({str(pair.metric) for pair in result.pairs}) > 1
        metric = "each pair's own metric (the first: " + str(result.metric) + ")" if own else (
            f"metric {result.metric}")  # fmt: skip
        lines[0] = (f"{N} pairs, {metric}: mean clean {result.clean:.4f}, corrupted "
                    f"{result.corrupt:.4f}")  # fmt: skip
        clean, corrupt = result.clean_spread, result.corrupt_spread
        lines.append(f"  95% intervals: clean {_spread_interval(clean, ())}, corrupted "
                     f"{_spread_interval(corrupt, ())}")  # fmt: skip
    for what in result.what:
        grid = result.grid(what)
        if what == "residual" or what == "mlp":
            lines.extend(_positions_lines(result, what, grid))
        elif what == "mlp_layers":
            lines.append("each layer's MLP output patched at every position (layer: metric, "
                         "restored):")  # fmt: skip
            restored = result.restored(grid)
            lines.extend(f"  {n:>5}  {float(grid[n]):+.4f}   {float(restored[n]):+.3f}"
                         for n in range(grid.shape[0]))  # fmt: skip
        else:
            lines.extend(_cell_lines(result, what, grid, top))
    return "\n".join(lines)


PATCHED = {
    "heads": "head outputs", "head_positions": "head outputs at one position",
    "q": "head queries", "k": "head keys (per query head)", "v": "head values (per query head)",
    "weights": "head attention weights", "residual": "residual stream", "mlp": "MLP outputs",
}  # fmt: skip


def _cell_lines(result: Patched, what: str, grid, top: int) -> list[str]:
    """The `top` cells of a per-head grid whose patch moves the metric most."""
    cells = [c for c in zip(*torch.nonzero(~grid.isnan(), as_tuple=True), strict=True)]
    cells.sort(key=lambda c: -abs(float(grid[c] - result.corrupt)))
    restored = result.restored(grid)
    names = ["layer", "head", "pos"][: grid.dim()]
    lines = [f"{PATCHED[what]} of the clean run patched into the corrupted one, the largest "
             "moves:", "  " + "  ".join(f"{n:>5}" for n in names) + "   metric     restored"
             + ("   95% interval" if len(result.pairs) > 1 else "")]  # fmt: skip
    for cell in cells[:top]:
        index = tuple(int(i) for i in cell)
        line = "  " + "  ".join(f"{i:>5}" for i in index)
        line += f"   {float(grid[index]):+.4f}   {float(restored[index]):+.3f}"
        if len(result.pairs) > 1:
            line += f"   {_spread_interval(result.grids[what], index)}"
        lines.append(line)
    return lines


def _positions_lines(result: Patched, what: str, grid) -> list[str]:
    restored = result.restored(grid)
    lines = [f"{PATCHED[what]} patched after each layer, restored (rows: layers; columns: "
             "positions):"]  # fmt: skip
    lines.append("         " + " ".join(f"{shown(t)[:7]:>7}" for t in result.position_labels()))
    for n in range(restored.shape[0]):
        lines.append(f"  {n:>5}  " + " ".join(f"{float(v):+7.2f}" for v in restored[n]))
    return lines


def _spread_interval(spread, index: tuple) -> str:
    return f"[{float(spread.low[index]):+.4f}, {float(spread.high[index]):+.4f}]"


def path_patch_lines(result: PathPatched) -> str:
    """The path-patched metric beside the clean and corrupted ones."""
    layer, head = result.sender
    receivers = len(result.receivers)
    lines = [
        f"metric {result.metric}: clean {result.clean:.4f}, corrupted {result.corrupt:.4f}",
        f"layer {layer} head {head}'s change through {receivers} receiver"
        f"{'s' * (receivers != 1)} (via {', '.join(result.via)}): {result.value:+.4f}, "
        f"restored {result.restored:+.3f}",
    ]
    if len(result.pairs) > 1:
        lines.append(f"  {len(result.pairs)} pairs; 95% interval of the mean "
                     f"{_spread_interval(result.spread, ())}")  # fmt: skip
    return "\n".join(lines)


# ---------------------------------------------------------------------------- lens


def lens_lines(found: Lens, terms: int = 10) -> str:
    """The lens as text for people: each depth's top next tokens, then the largest direct
    contributions to the token's logit, the rest summed, the remainder and the total."""
    at = f"position {found.position} ({found.tokens[found.position]!r})"
    followed = f"{found.token!r} followed"
    several = len(found.texts) > 1
    if several:
        places = sorted(set(found.positions))
        at = f"position {places[0]} of each prompt" if len(places) == 1 else (
            "each prompt's position (" + ", ".join(map(str, found.positions[:8]))
            + (", ..." if len(found.positions) > 8 else "") + ")")  # fmt: skip
        if len(set(found.token_ids)) > 1:
            followed = "each prompt's own top prediction followed"
    lines = [
        f"{found.source}, {len(found.tokens)} tokens; the next token after {at}",
        f"logit lens: each depth's stream through the final norm and LM head; {followed} "
        "(rank 0: the top)",
    ]
    if found.token_note is not None:
        lines.insert(0, found.token_note)
    if several:
        lines[0] = f"{found.source}, {len(found.texts)} prompts; the next token after {at}"
        lines += _over(found)
        lines.append("the top tokens of the mean probability over the prompts")
    cells = [[f"{t!r} {p:.3g}" for t, p in zip(tokens, probs, strict=True)]
             for tokens, probs in zip(found.top_tokens, found.top_probs, strict=True)]  # fmt: skip
    widths = [max(len(row[i]) for row in cells) for i in range(len(cells[0]))]
    name_width = max(len(name) for name in found.layers)
    for depth, name in enumerate(found.layers):
        row = "  ".join(cell.ljust(w) for cell, w in zip(cells[depth], widths, strict=True))
        rank = f"{found.rank[depth]:.3g}" if several else f"{found.rank[depth]}"
        lines.append(f"  {name:<{name_width}}  {row}  | rank {rank}"
                     f"{_interval(found, 'rank', depth)}, log-prob {found.logprob[depth]:.3g}"
                     f"{_interval(found, 'logprob', depth)}")  # fmt: skip
    attribution = found.attribution
    if attribution is None:
        return "\n".join(lines)
    ranked = attribution.terms()
    shown, rest = ranked[:terms], ranked[terms:]
    token = "each prompt's token" if followed.startswith("each") else f"{attribution.token!r}"
    lines += ["", f"direct logit attribution of {token} at {at}, "
              f"logit {attribution.logit:.4f}{_interval(found, 'logit')}; the largest terms "
              "first:"]  # fmt: skip
    lines += [f"  {value:+10.4f}  {name}" for name, value in shown]
    if rest:
        lines.append(f"  {sum(v for _, v in rest):+10.4f}  the other {len(rest)} terms")
    lines.append(f"  {attribution.remainder:+10.4f}  the final norm's remainder (its shift and "
                 "the LM head's bias)")  # fmt: skip
    lines.append(f"  {attribution.total:10.4f}  total = the logit")
    return "\n".join(lines)


# ---------------------------------------------------------------------------- census


_MEANING = {
    "previous_token": "previous token (weight on key i-1)",
    "induction": "induction (repeated random tokens: key i-n+1)",
    "first_token": "first token (weight on key 0: a sink)",
    "self": "self (weight on key i)",
    "entropy": "entropy (nats; lowest first: most focused)",
    "window_use": "window use (distance / farthest key seen)",
}


def _census_interval(census: Census, name: str, layer: int, head: int) -> str:
    """' [low, high]' of a score's mean over several prompts (induction: random rows)."""
    spread = census.spreads.get(name)
    if spread is None or spread.values.shape[0] < 2:
        return ""
    return f" [{float(spread.low[layer, head]):.3f}, {float(spread.high[layer, head]):.3f}]"


def census_lines(census: Census, k: int = 5) -> str:
    """The census for people: the top k heads of each score, then each layer's first-token
    mass (the mean over its heads) with a bar."""
    L, H = census.previous_token.shape
    counts = [int((~row.isnan()).sum()) for row in census.previous_token]  # each layer's own
    heads = f"{H} heads" if set(counts) == {H} else (
        f"up to {H} heads ({', '.join(map(str, counts))} by layer)")  # fmt: skip
    lines = [f"{census.source}: {L} layers x {heads} (counted from 0), each score the mean "
             "over queries i >= 1"]  # fmt: skip
    if len(census.prompts) > 1:
        lines.append(f"then over {len(census.prompts)} prompts (induction: over "
                     f"{census.induction_rows} random rows), [in brackets] its bootstrap 95% "
                     "interval")  # fmt: skip
    effective = census.effective_words()
    if effective is not None:
        lines.append(effective)
    lines += ["", "top heads, as L(ayer) H(ead) score:"]
    width = max(len(text) for text in _MEANING.values())
    for name in SCORES:
        top = census.top(name, k)
        cells = "   ".join(
            f"L{layer} H{head} {score:.3f}{_census_interval(census, name, layer, head)}"
            for layer, head, score in top
        )
        lines.append(f"  {_MEANING[name]:<{width}}  {cells or '(no layer has a window)'}")
    lines += ["", "first-token mass per layer (attention sinks):"]
    for layer, mass in enumerate(census.sink_per_layer.tolist()):
        lines.append(f"  layer {layer:>2}  {mass:.3f}  {'#' * round(mass * 40)}")
    return "\n".join(lines)
