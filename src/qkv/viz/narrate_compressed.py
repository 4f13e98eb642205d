"""Steps 3-7 of a trace in a layer of compressed attention (DeepSeek-V4's CSA and HCA), told
as the article tells them: what the query attended to (the window's words, the entries, each
a block of words, and the sink), the weights on the words and why a word got none."""

from __future__ import annotations

from qkv.inspect.trace import Trace
from qkv.inspect.trace_compressed import EntryStep


def percent(x: float) -> str:
    return f"{100 * x:.1f}%"


def entry_name(e: EntryStep) -> str:
    return f"entry {e.entry} (words {e.first}..{e.last})"


def attended_line(t: Trace) -> str:
    """What the query attended to, in one line: the window, each attended entry, the sink."""
    c = t.compressed
    parts = [f"the window (words {c.window_first}..{t.query_index}) {percent(c.window_weight)}"]
    parts += [f"{entry_name(e)} {percent(e.weight)}" for e in c.entries if e.attended]
    if t.sink_weight is not None:
        parts.append(f"the sink {percent(t.sink_weight)}")
    return "; ".join(parts)


def compressed_steps(t: Trace, shown, vector, roundoff) -> list[str]:
    """Steps 3-7 for a trace whose `compressed` is set (shown, vector, roundoff: narrate's)."""
    c, q, k = t.compressed, f'"{t.query}"', f'"{t.key}"'
    overlap = (f"{2 * c.rate} words, one every {c.rate} (each overlaps the one before)"
               if c.kind == "CSA" else f"{c.rate} words, one every {c.rate}")  # fmt: skip
    attended = [e for e in c.entries if e.attended]
    lines = [
        f"3. This layer ({c.kind}) attends over two kinds of keys: the words of a sliding window "
        f"of {c.window},",
        f"   one key each, and compressed entries, each pooling {overlap}",
        "   into one key (its value is the same vector) by the compressor's weights.",
    ]
    if c.top_k is not None:
        lines.append(f"   A lightning indexer scored the {c.complete} entries complete at {q} and "
                     f"chose its top {c.top_k}: {q} attends those only.")  # fmt: skip
    else:
        lines.append(f"   {q} attends every entry whose block is complete: {c.complete}.")
    if c.key_entry is None and c.from_window == 0 and t.key_index < t.query_index:
        lines.append(f"   No key {q} attends holds {k}: steps 2-6 show {k}'s own key, which the "
                     "window hides from it.")  # fmt: skip
    if c.key_entry is not None:
        e = next(e for e in attended if e.entry == c.key_entry)
        lines.append(f"   {k} is outside the window; steps 2-6 show {entry_name(e)}, the entry "
                     "that holds the most of it")  # fmt: skip
        lines.append(f"   ({k}'s coefficient in it: {e.key_share:.3f}).")
    lines += [
        f"   Attention scalar: query . key = {t.attention_scalar:+.4f}, divided by "
        f"sqrt({t.head_dim}): {t.scaled_scalar:+.4f}",
        f"4. Softmax over the window's words, the {len(attended)} entries {q} attends and this "
        f"head's learned sink ({t.sink:+.4f}):",
        f"     {attended_line(t)}",
        "   On the words: each entry's weight spread over its block by the compressor's "
        "coefficients, averaged over",
        "   its channels (the compressor's softmax is per channel, so a word's share of an "
        "entry is an attribution):",
        "     " + "  ".join(f"{shown(tok)} {percent(w)}"
                            for tok, w in zip(t.tokens, t.weights.tolist(), strict=True)),
    ]  # fmt: skip
    if c.why_zero is not None:
        lines.append(f"   {k} gets 0: {c.why_zero}.")
    else:
        lines.append(
            f"   {k} gets {percent(t.weight)}: {percent(c.from_window)} as a word of "
            f"the window, {percent(c.from_entries)} through the entries holding it."
        )
    skipped = (
        []
        if c.why_zero is not None
        else [  # why_zero names them already
            e for e in c.entries if not e.attended and e.rank is not None
        ]
    )
    for e in skipped:
        lines.append(f"   {entry_name(e)} holds {k} but was not chosen by the indexer (rank "
                     f"{e.rank} of {c.complete}).")  # fmt: skip
    what = f"{k}'s value" if c.key_entry is None else f"entry {c.key_entry}'s value"
    lines += [
        f"5. Value vector: {what} (in this layer the key vector is also the value vector):",
        f"     {vector(t.value_vector)}",
        f"6. Scaled value vector: the value vector times its weight {percent(c.key_weight)}:",
        f"     {vector(t.scaled_value_vector)}",
        f"7. The sum of the window words' and the {len(attended)} entries' scaled value vectors "
        f"is {q}'s",
        f"   contextualized vector in this head: {vector(t.contextualized)}",
        f"   The model's own attention output for this head and word: {vector(t.model_output)}",
        f"   ({roundoff((t.contextualized - t.model_output).abs().max().item())}: "
        "the walk-through is the model's computation).",
    ]
    if t.experts is not None:
        lines.append(f"   After attention, {q}'s MLP in this layer is a mixture of experts: it "
                     f"{t.experts}.")  # fmt: skip
    return lines
