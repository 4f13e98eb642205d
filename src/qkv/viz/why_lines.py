"""`qkv.why` told in plain text: each part in words, the largest terms, the content / position
split, the words the heads carried, the causal checks and the notes. What `qkv why` prints and
`qkv explain`'s step "Why this scalar"; the numbers are the `Why`'s own (`--json` gives every one).

>>> part_words("L0.H2", "bank")
"head L0.H2's output in bank"
>>> part_words("enc.position", "river")
"river's position embedding (encoder)"
"""

from __future__ import annotations

from qkv.inspect.why_parts import HEAD, MLP, Why

# what each named part of a word's stream is, in words ({} the word)
WORDS = {
    "embedding": "{}'s token embedding",
    "position": "{}'s position embedding",
    "segment": "{}'s segment embedding",
    "bias": "the biases in {}",
}


def part_words(part: str, word: str) -> str:
    """A part of a word's stream ("L3.H5", "L3.mlp", "embedding", "enc.bias") in words."""
    if part.startswith("enc."):  # an encoder's part, read by a decoder's cross-attention
        return part_words(part.removeprefix("enc."), word) + " (encoder)"
    if part in WORDS:
        return WORDS[part].format(word)
    if HEAD.match(part):
        return f"head {part}'s output in {word}"
    if mlp := MLP.match(part):
        return f"layer {mlp[1]}'s MLP output in {word}"
    if ".cross.H" in part:  # "L2.cross.H3": a decoder's earlier cross-attention head
        return f"cross-attention head {part}'s output in {word}"
    return f"{part} in {word}"


def pair_words(why: Why, query_part: str, key_part: str) -> str:
    """One term in words: "bank's position embedding . river's position embedding"."""
    return f"{part_words(query_part, why.query)} . {part_words(key_part, why.key)}"


def share(why: Why, value: float) -> str:
    """A term as a share of the score its terms sum to: "53.3%"."""
    return f"{100 * value / max(abs(why.total), 1e-12):.1f}%"


def where(why: Why) -> str:
    kind = " (decoder cross-attention)" if why.query_tokens is not None else ""
    chosen = "asked" if why.chosen == "asked" else why.chosen
    return f"layer {why.layer}, head {why.head}{kind} of {why.source} ({chosen}; counted from 0)"


def split_lines(why: Why, indent: str = "  ") -> list[str]:
    """The content / position split of a rotary layer; elsewhere what the position embedding
    adds, where the model has one as a part of its own."""
    if why.content is not None:
        content = float(why.content.sum())
        return [
            f"{indent}Content {content:+.4f} (both words turned as if at the same position)",
            f"{indent}+ position {why.position:+.4f} (what their distance adds) = {why.total:+.4f}",
        ]
    if "position" in why.parts_q and "position" in why.parts_k:
        return [
            f"{indent}Not rotary: the position embedding is a part of its own; the terms with it",
            f"{indent}on either side sum to {position_terms(why):+.4f} of {why.total:+.4f}",
        ]
    return [f"{indent}Not a rotary layer: no content / position split"]


def position_terms(why: Why) -> float:
    """The terms with the position embedding on the query side, the key side or both."""
    i, j = why.parts_q.index("position"), why.parts_k.index("position")
    return float(why.terms[i].sum() + why.terms[:, j].sum() - why.terms[i, j])


def terms_grid(why: Why, most: int = 16) -> tuple[list[str], list[str], list[list[float]]]:
    """The grid of terms to draw: each side's `most` largest parts (by `by_part`), in the
    model's order, and one more row and column, "every other part", that sums the rest, so
    that the grid still sums to the score. Returns (query parts, key parts, values)."""

    def kept(side: str, names: list[str]) -> list[int]:
        if len(names) <= most + 1:  # one row of "every other part" would hide just one
            return list(range(len(names)))
        largest = {p for p, _ in why.by_part(side)[:most]}
        return [i for i, name in enumerate(names) if name in largest]

    rows, columns = kept("query", why.parts_q), kept("key", why.parts_k)
    terms = why.terms.double()
    left = [i for i in range(len(why.parts_q)) if i not in rows]
    right = [j for j in range(len(why.parts_k)) if j not in columns]
    values = [[float(terms[i, j]) for j in columns] + ([float(terms[i, right].sum())] if right
              else []) for i in rows]  # fmt: skip
    if left:
        values.append([float(terms[left][:, j].sum()) for j in columns]
                      + ([float(terms[left][:, right].sum())] if right else []))  # fmt: skip
    rest = "every other part"
    return ([why.parts_q[i] for i in rows] + [f"{rest} ({len(left)})"] * bool(left),
            [why.parts_k[j] for j in columns] + [f"{rest} ({len(right)})"] * bool(right),
            values)  # fmt: skip


def why_lines(why: Why, top: int = 10) -> str:
    """Everything `qkv why` prints: the pair, its score and weight, the `top` terms in words,
    each side's largest parts, the split, the carried words, the checks, the notes."""
    q, k = f'"{why.query}"', f'"{why.key}"'
    P, K = len(why.parts_q), len(why.parts_k)
    lines = [
        f"Why {q} attends to {k}: {where(why)}.",
        f"  Score {why.score:+.4f} (what the softmax read), weight {100 * why.weight:.2f}%.",
        f"  Before the softmax it is a sum of {P} x {K} = {P * K} terms, one per (part of {q}'s",
        f"  query, part of {k}'s key), each norm's scale held; they sum to {why.total:+.6f}.",
        "",
        f"The {min(top, P * K)} largest terms (share of {why.total:+.4f}):",
    ]
    lines += [f"  {v:+9.4f} {share(why, v):>7}  {pair_words(why, a, b)}"
              for a, b, v in why.ranked(top)]  # fmt: skip
    lines.append("Each part against the whole other side, the largest first:")
    for side, word in (("query", q), ("key", k)):
        parts = ", ".join(f"{p} {v:+.3f}" for p, v in why.by_part(side)[:5])
        lines.append(f"  {word}'s {side}: {parts}")
    lines += ["", "Content and position:", *split_lines(why)]
    if why.carried:
        lines += ["", "What the heads carried (a head's part, split over the words it read):"]
    for c in why.carried:
        into = q if c.side == "query" else k
        words = ", ".join(f'"{t}" ({100 * w:.1f}%) {v:+.3f}' for t, _, w, v in c.words[:3])
        lines.append(f"  {c.part} carried into {into}'s {c.side} {c.value:+.4f}: {words}")
    if why.checks:
        lines += ["", "Removed for real (the part zeroed at its word, the model rerun from its "
                  "layer), predicted -> real:"]  # fmt: skip
    else:
        lines += ["", "Removed for real: nothing (--checks 0, or no head or MLP writes before "
                  "this layer)"]  # fmt: skip
    for c in why.checks:
        word = why.query if c.side == "query" else why.key
        lines.append(
            f"  {part_words(c.part, word)}: score {c.predicted_score:+.4f} -> "
            f"{c.real_score:+.4f}, weight {100 * c.predicted_weight:.2f}% -> "
            f"{100 * c.real_weight:.2f}%"
        )
    lines += ["", "Notes:", *(f"  - {note}" for note in why.notes)]
    return "\n".join(lines)


def why_step(why: Why, top: int = 3) -> list[str]:
    """`qkv explain`'s step "Why this scalar", after step 3: the `top` terms in words, the
    content / position split and the score they sum to."""
    P, K = len(why.parts_q), len(why.parts_k)
    q, k = f'"{why.query}"', f'"{why.key}"'
    lines = [
        f"   Why this scalar: each norm's scale held, the vector entering layer {why.layer} is",
        "   a sum of parts (the embeddings, each earlier head's and MLP's output, biases), so the",
        f"   score is a sum of {P * K} terms, one per (part of {q}'s query, part of {k}'s key).",
        f"   The largest {min(top, P * K)}:",
    ]
    lines += [f"     {v:+.4f}  {pair_words(why, a, b)}" for a, b, v in why.ranked(top)]
    lines += split_lines(why, "   ")
    lines.append(f"   All {P * K} terms sum to {why.total:+.4f} (`qkv why` takes it further).")
    return lines
