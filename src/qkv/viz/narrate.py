"""A trace told as the article tells it: a guided walk in plain text, with the real numbers."""

from __future__ import annotations

import math
import textwrap

from torch import Tensor

from qkv.inspect.sinks import sink_sentence
from qkv.inspect.trace import Trace
from qkv.inspect.why_parts import Why
from qkv.viz.narrate_compressed import compressed_steps
from qkv.viz.step_words import multiplied, shifted_right, split_words
from qkv.viz.why_lines import why_step


def vector(t: Tensor, n: int = 4) -> str:
    """The first n values and the norm: '[+0.123, -0.456, ...] (32 numbers, norm 5.43)'."""
    shown = ", ".join(f"{x:+.3f}" for x in t[:n].tolist())
    more = ", ..." if t.numel() > n else ""
    return f"[{shown}{more}] ({t.numel()} numbers, norm {t.norm().item():.3f})"


def shown(token: str) -> str:
    """A token as people read it: byte-level BPE's space mark (Ġ) and newline mark (Ċ) and
    sentencepiece's space mark (▁) are dropped or spelled out."""
    plain = token.replace("Ġ", "").replace("▁", "").replace("Ċ", "\\n")
    return plain or token


def percent(x: float) -> str:
    return f"{100 * x:.1f}%"


def tokens_line(trace: Trace) -> str:
    q, k = trace.query_index, trace.key_index
    listing = " ".join(shown(t) for t in trace.tokens)
    if trace.query_tokens is None:
        return (
            f"Tokens ({len(trace.tokens)}): {listing}\n"
            f'  "{trace.query}" is token {q} ({trace.tokens[q]!r}), '
            f'"{trace.key}" is token {k} ({trace.tokens[k]!r}); tokens count from 0.'
        ) + "".join("\n  " + line for line in split_words(trace))
    return (
        f"Source tokens, read by the encoder ({len(trace.tokens)}): {listing}\n"
        f"Target tokens, read by the decoder ({len(trace.query_tokens)}): "
        f"{' '.join(shown(t) for t in trace.query_tokens)}\n"
        f'  Cross-attention: the query word "{trace.query}" is target token {q}, the key word '
        f'"{trace.key}" is source token {k}; tokens count from 0.'
    ) + "".join("\n  " + line for line in split_words(trace))


def narrate(trace: Trace, why: Why | str | None = None) -> str:
    """Steps 1-7 of the article for the trace's pair, then what contributed most. why: the same
    pair's `qkv.why`, told after step 3 ("Why this scalar"), or why it could not be had."""
    t, q, k = trace, f'"{trace.query}"', f'"{trace.key}"'
    D = t.head_dim
    cross = t.query_tokens is not None
    kind = " (decoder cross-attention)" if cross else ""
    lines = [
        f"Layer {t.layer}, head {t.head}{kind} of {t.source} ({t.num_layers} layers x "
        f"{t.num_heads} heads, counted from 0), {t.chosen}.",
    ]
    if cross:
        lines += textwrap.wrap(shifted_right(t.query_tokens), 97, initial_indent="  ",
                               subsequent_indent="  ")  # fmt: skip
    if t.num_kv_heads != t.num_heads:
        group = t.num_heads // t.num_kv_heads
        first = t.kv_head * group
        lines.append(
            f"  Grouped-query attention: query heads {first}-{first + group - 1} share key/value "
            f"head {t.kv_head}."
        )
    lines += [
        f"1. Query vector: {multiplied('query', t.layer, cross=cross, whose=q + chr(39) + 's')},"
        " times the query matrix "
        f"({t.width} -> {D} numbers):",
        f"     {vector(t.query_vector)}",
        f"2. Key vector: {_key_of(t)} times the key matrix:",
        f"     {vector(t.key_vector)}",
    ]
    lines += _qk_norm_lines(t)
    if t.query_unrotated is not None:
        lines += [
            "   Rotary positions turn both by an angle that grows with the token's position",
            f"   (lengths unchanged): query before {vector(t.query_unrotated)}",
            f"                        key before   {vector(t.key_unrotated)}",
        ]
        lines += _rotary_lines(t)
    if t.linear is not None:  # no softmax: a running memory
        return "\n".join(lines + _linear_steps(t))
    if t.compressed is not None:  # a window's words and compressed entries
        return "\n".join(lines + compressed_steps(t, shown, vector, roundoff))
    lines += [
        f"3. Attention scalar: query . key = {t.attention_scalar:+.4f}  (how much {q} should "
        f"attend to {k})",
        _scale_line(t),
    ]
    lines += _score_lines(t)
    lines += _hidden_lines(t)
    if isinstance(why, str):
        lines.append(f"   Why this scalar: not taken apart here: {why}")
    elif why is not None:
        lines += why_step(why)
    pairs = zip(t.tokens, t.weights.tolist(), strict=True)
    row = "  ".join(f"{shown(tok)} {percent(w)}" for tok, w in pairs)
    changed = t.softcap is not None or t.bias is not None or t.temperature is not None
    scores = "'s score" if changed else ""
    # in cross-attention the keys are the source's tokens: the query word is not among them
    among = f"{q} itself included" if t.query_tokens is None else "the source's tokens"
    if t.sink_weight is None:
        lines.append(f"4. Softmax over every key word{scores} ({among}), so the "
                     f"{len(t.tokens)} weights sum to 100%:")  # fmt: skip
    else:
        lines.append(f"4. Softmax over every key word{scores} ({among}) and this head's learned "
                     f"sink ({t.sink:+.4f}),")  # fmt: skip
        lines.append(f"   one more score with no value behind it: the sink took "
                     f"{percent(t.sink_weight)} of {q}'s attention; the words share the other "
                     f"{percent(1 - t.sink_weight)}:")  # fmt: skip
    lines += [
        f"     {row}",
        f"   {k} gets {percent(t.weight)}.",
        *_sink_lines(t, q),
        f"5. Value vector: {_value_of(t, k)} times the value matrix{_value_words(t)}:",
        f"     {vector(t.value_vector)}",
        f"6. Scaled value vector: the value vector times {percent(t.weight)}:",
        f"     {vector(t.scaled_value_vector)}",
        f"7. The sum of all {len(t.tokens)} scaled value vectors (and nothing else: not {q}'s "
        "own embedding) is",
        f"   {q}'s contextualized vector in this head: {vector(t.contextualized)}",
        f"   The model's own attention output for this head and word: {vector(t.model_output)}",
        f"   ({roundoff((t.contextualized - t.model_output).abs().max().item())}: "
        "the walk-through is the model's computation).",
    ]
    if t.experts is not None:
        lines.append(f"   After attention, {q}'s MLP in this layer is a mixture of experts: it "
                     f"{t.experts}.")  # fmt: skip
    return "\n".join(lines)


def _sink_lines(t: Trace, q: str) -> list[str]:
    """Where the query's largest weight is on the first or a special token: that it is an
    attention sink (cross-attention's keys are the source's: its first token too)."""
    said = sink_sentence(t.tokens, t.weights.tolist(), q)
    return [] if said is None else textwrap.wrap(said + ".", 97, initial_indent="   ",
                                                 subsequent_indent="   ")  # fmt: skip


def _value_of(t: Trace, k: str) -> str:
    return multiplied("value", t.layer, cross=t.query_tokens is not None, whose=f"{k}'s")


def _key_of(t: Trace) -> str:
    """Whose key step 2 shows: the key word's vector, or (compressed attention) the entry's
    pooled vector where the key word is outside the window."""
    c = t.compressed
    if c is None or c.key_entry is None:
        return multiplied("key", t.layer, cross=t.query_tokens is not None, whose=f'"{t.key}"\'s')
    e = next(e for e in c.entries if e.entry == c.key_entry)
    return (
        f"entry {e.entry}'s vector (the compressor's pool of words {e.first}..{e.last}, "
        f'which holds "{t.key}")'
    )


def _value_words(t: Trace) -> str:
    a = t.anatomy
    if a is None or a.latent_rank is None:
        return ""
    return (f" (latent attention: keys and values come from one {a.latent_rank}-number "
            f"vector per token, which is what the cache keeps; values have "
            f"{t.value_vector.numel()} numbers, keys {t.head_dim})")  # fmt: skip


def roundoff(difference: float) -> str:
    """A difference that is only round-off, as a bound: its digits depend on the CPU's order
    of additions, not on the model (float32 round-off of values near 1 is about 1e-7). A
    larger one is shown as it is.

    >>> roundoff(6.6e-08), roundoff(3.2e-04)
    ('largest difference below 1e-6', 'largest difference 3.2e-04')
    """
    if difference < 1e-6:
        return "largest difference below 1e-6"
    return f"largest difference {difference:.1e}"


def contributions(trace: Trace, top: int = 4) -> str:
    """Which key words added most to the query word's new vector, by two measures."""
    by_size = sorted(trace.contributions, key=lambda c: -c.size)[:top]
    if trace.linear is not None:  # signed effective weights, a read before its gated norm
        by_weight = sorted(trace.contributions, key=lambda c: -abs(c.weight))[:top]
        return "\n".join(
            [
                f'What added most to "{trace.query}"\'s read of the memory in this head:',
                "  by effective weight (step 4, largest first either sign): "
                + ", ".join(f"{shown(c.token)} {c.weight:+.4f}" for c in by_weight),
                "  by size of the scaled value vector:                     "
                + ", ".join(f"{shown(c.token)} {c.size:.3f}" for c in by_size),
                "  (before the read's gated norm and the output projection: no softmax, so a "
                "weight",
                "   may be negative, and the weights need not sum to 1)",
            ]
        )
    by_weight = sorted(trace.contributions, key=lambda c: -c.weight)[:top]
    spread = [] if trace.compressed is None else [
        "  (on the words: an entry's weight and scaled value spread over its block by the "
        "compressor's",
        "   coefficients, averaged over channels: an attribution)",
    ]  # fmt: skip
    return "\n".join(
        [
            f'What added most to "{trace.query}" in this head:',
            "  by attention weight (step 4):           "
            + ", ".join(f"{shown(c.token)} {percent(c.weight)}" for c in by_weight),
            "  by size after the output projection     "
            + ", ".join(f"{shown(c.token)} {c.size:.3f}" for c in by_size),
            "  (the length of output matrix x weighted value vector: a large weight on a small",
            "   value vector can add less than a modest weight on a large one)",
            *spread,
        ]
    )


def heads_and_layers(trace: Trace) -> str:
    """How one head's output becomes the layer's output, and the next layer's input."""
    t = trace
    Dv = t.value_vector.numel()  # each head's output: its values' size (usually head_dim)
    residual = _residual_words(t)
    gated = [] if t.linear is None else [
        "Each head's read of its memory is first RMS-normalized and multiplied by a gate made "
        "from the word's vector."
    ]  # fmt: skip
    return "\n".join(
        [
            *gated,
            f"Several heads: this is head {t.head} of {t.num_heads}. Each head runs the same "
            "steps with its own",
            f"matrices; their {Dv}-number outputs are concatenated into {t.num_heads} x "
            f"{Dv} = {t.num_heads * Dv} numbers,",
            f"and the output projection ({t.num_heads * Dv} -> {t.width}) mixes them "
            "into one vector per token.",
            residual
            + ("" if residual.endswith("\n") else " ")
            + (
                f"and becomes the input of layer {t.layer + 1}, which runs the same algorithm "
                "again\nwith its own query, key and value matrices, on vectors that already "
                "carry context."
                if t.layer + 1 < t.num_layers
                else "and is the model's output: this is the last layer." + _logit_cap_words(t)
            ),
        ]
    )


def _logit_cap_words(t: Trace) -> str:
    cap = t.anatomy.logit_softcap if t.anatomy is not None else None
    if cap is None:
        return ""
    return f"\nIts logits are capped to {cap:g} tanh(x/{cap:g}) before the softmax over words."


# ---- what a family does differently, told at the step where it does it -----------------


def _qk_norm_lines(t: Trace) -> list[str]:
    a = t.anatomy
    if a is None or a.qk_norm is None:
        return []
    over = f"each head's {t.head_dim} numbers" if a.qk_norm == "head" else "all heads' numbers"
    return [
        f"   This model normalizes each query and key first (QK-norm, over {over}): the",
        "   vectors above are normalized and times a learned gain, which keeps the scores small.",
    ]


def _rotary_lines(t: Trace) -> list[str]:
    a, lines = t.anatomy, []
    if a is None:
        return lines
    if a.rope_dims is not None:
        lines.append(
            f"   Only the first {a.rope_dims} of the {t.head_dim} numbers turn (partial rotary); "
            "the rest carry no position."
        )
    if a.rope_scaling is not None:
        lines.append(
            f"   The angles are rescaled ({a.rope_scaling}), so the model reads texts longer "
            "than it was trained on."
        )
    return lines


def _scale_line(t: Trace) -> str:
    """Step 3's side note, or what this model does instead of dividing by sqrt(D)."""
    D = t.head_dim
    if math.isclose(t.scale * math.sqrt(D), 1.0, rel_tol=1e-9):
        return (
            f"   Divided by sqrt({D}) = {math.sqrt(D):.3f}: {t.scaled_scalar:+.4f}  (the side "
            "note: keeps softmax from saturating)"
        )
    if t.scale == 1.0:
        return (
            f"   This model does not divide at all (the article divides by sqrt({D})): its "
            f"weights were trained for undivided scores: {t.scaled_scalar:+.4f}"
        )
    divisor = 1 / t.scale**2
    if math.isclose(divisor, round(divisor), rel_tol=1e-9):
        return (
            f"   Divided by sqrt({round(divisor)}) = {1 / t.scale:.3f}, not sqrt({D}): this "
            f"model's own scale: {t.scaled_scalar:+.4f}"
        )
    return (
        f"   Times this layer's scale {t.scale:.6g} (not the article's 1/sqrt({D})): "
        f"{t.scaled_scalar:+.4f}"
    )


def _score_lines(t: Trace) -> list[str]:
    """A temperature, a soft-cap and a score bias, between the scaled scalar and the softmax."""
    lines, score = [], t.scaled_scalar
    if t.temperature is not None:
        score = score * t.temperature
        lines.append(
            f"   Times {t.query}'s temperature {t.temperature:.4f} = {score:+.4f}  (it grows with "
            "the position, so that far into a text the weights do not flatten out)"
        )
    if t.softcap is not None:
        c = t.softcap
        score = c * math.tanh(score / c)
        lines.append(
            f"   Capped to {c:g} tanh(s/{c:g}) = {score:+.4f}  (a soft cap: no score leaves "
            f"-{c:g}..+{c:g})"
        )
    if t.bias is not None:
        what = (
            "a learned bias for the distance between the words"
            if t.anatomy is not None and t.anatomy.relative_bias
            else "this layer's score bias"
        )
        lines.append(f"   Plus {what}: {t.bias:+.4f}, so {score + t.bias:+.4f}")
    if lines:
        lines.append(f"   The softmax reads this score: {t.score:+.4f}")
    return lines


def _hidden_lines(t: Trace) -> list[str]:
    """Which keys this layer hides, and why the key word's weight is 0 where it is."""
    q, k, lines = f'"{t.query}"', f'"{t.key}"', []
    if t.window is not None:
        where = "back" if t.causal else "away"
        lines.append(
            f"   This layer's window: keys {t.window} or more tokens {where} are hidden (weight 0)."
        )
    if t.chunk is not None:
        lines.append(
            f"   This layer cuts the text into chunks of {t.chunk} tokens: a query sees only the "
            "keys of its own chunk."
        )
    if t.chunk is not None and t.query_chunk != t.key_chunk:
        lines.append(
            f"   {k} is in chunk {t.key_chunk}, {q} in chunk {t.query_chunk}: the chunk boundary "
            "hides it, so its weight is 0."
        )
    elif t.outside_window:
        distance = abs(t.query_index - t.key_index)
        lines.append(
            f"   {k} is {distance} tokens {where}: outside the window, so its weight is 0."
        )
    elif t.masked and t.causal and t.key_index > t.query_index:
        lines.append(
            f"   {k} comes after {q}: in a decoder the causal mask hides it, so its weight is 0."
        )
    elif t.masked:
        lines.append(f"   The mask hides {k} from {q}, so its weight is 0.")
    return lines


def _residual_words(t: Trace) -> str:
    """How a layer's attention output joins the token's vector, in this model's blocks: the
    article's words (pre- and post-norm alike), or whole lines for blocks that differ."""
    a = t.anatomy
    if a is not None and a.parallel:
        return (
            "Several layers: attention and the MLP read the same normalized input, side by side; "
            "both\noutputs are added to the token's input (the residual) at once,\n"
        )
    if a is not None and a.sublayer_norm and a.norm_position == "none":
        return (
            "Several layers: that vector is normalized (this model norms each sub-layer's output, "
            "not its\ninput), then added to the token's input (the residual); the MLP's output "
            "likewise,\n"
        )
    if a is not None and a.sublayer_norm:
        return (
            "Several layers: that vector is normalized (this model norms each sub-layer's "
            "output), then\nadded to the token's input (the residual); the MLP reads the sum "
            "normalized, and its output\nis normalized and added too,\n"
        )
    return (
        "Several layers: that vector is added to the token's input (the residual), "
        "normalized, passed\nthrough an MLP,"
    )


def _linear_steps(t: Trace) -> list[str]:
    """Steps 3-7 in a linear layer: no score and no softmax; each word writes its value into a
    running memory under its key, the query reads the memory, and what it reads of each value
    is the key word's effective weight."""
    q, k, w = f'"{t.query}"', f'"{t.key}"', t.weight
    fade = "one fade per head" if t.linear == "head" else "one fade per key channel (KDA)"
    lines = [
        "   Linear attention mixes each token's query, key and value with the few tokens' "
        "before it (a short",
        "   causal convolution, then SiLU), and scales each query and key to length 1 (L2): "
        "query . key is a cosine.",
        f"3. No softmax here: this layer keeps a running memory (linear attention, the gated "
        f"delta rule, {fade}).",
        "   Word by word, every earlier memory fades, then the word writes its value into the "
        "memory under its key",
        "   (what the memory already held under that key is replaced, in the share the write "
        f"strength says); {q}'s query",
        "   reads the memory once. Query . key = "
        f"{t.attention_scalar:+.4f}, times {t.scale:.6g} (1/sqrt({t.head_dim})) = "
        f"{t.scaled_scalar:+.4f}, is not a score:",
        f"   no softmax reads it. What {q} gets of {k}'s value depends on every write between "
        "them.",
    ]
    if t.masked and t.key_index > t.query_index:
        lines.append(f"   {k} comes after {q}: the memory {q} reads holds nothing of it yet, so "
                     "its weight is 0.")  # fmt: skip
    elif t.masked:
        lines.append(f"   The mask hides {k} from {q}: it is not written into the memory {q} "
                     "reads, so its weight is 0.")  # fmt: skip
    else:
        later = t.query_index - t.key_index
        lines.append(f"   {k} wrote its value with strength {t.write_strength:.4f}; the fades of "
                     f"the {later} words after it leave {percent(t.fade)} of it,")  # fmt: skip
        lines.append("   and their own writes under keys like it replace part of what remains:")
        if t.carried is not None:
            lines.append(f"   {q}'s query, carried back through them to {k}'s write, meets its "
                         f"key at {t.carried:+.4f} (scaled),")  # fmt: skip
            lines.append(f"   so {q} reads {t.write_strength:.4f} x {t.carried:+.4f} = "
                         f"{t.weight:+.4f} of {k}'s value.")  # fmt: skip
    row = "  ".join(f"{shown(tok)} {x:+.3f}" for tok, x in zip(t.tokens, t.weights.tolist(),
                                                              strict=True))  # fmt: skip
    lines += [
        f"4. No softmax: the effective weight of {k} for {q} is {w:+.4f}, what the memory "
        f"returns of {k}'s value",
        f"   when {q}'s query reads it. Effective weights are signed and need not sum to 1 "
        f"(these sum to {float(t.weights.sum()):+.4f}):",
        f"     {row}",
        f"5. Value vector: {k}'s vector times the value matrix:",
        f"     {vector(t.value_vector)}",
        f"6. Scaled value vector: the value vector times its effective weight {w:+.4f}:",
        f"     {vector(t.scaled_value_vector)}",
        f"7. The sum of the {t.query_index + 1} scaled value vectors up to {q} is what {q}'s "
        "query reads of the memory",
    ]
    if t.from_state is not None:
        lines.append(f"   (plus {vector(t.from_state)}, what it reads of the memory the "
                     "earlier tokens left)")  # fmt: skip
    lines += [
        f"   in this head: {vector(t.contextualized)}",
        f"   The model's own read for this head and word: {vector(t.model_output)}",
        f"   ({roundoff((t.contextualized - t.model_output).abs().max().item())}: "
        "the walk-through is the model's computation).",
    ]
    if t.experts is not None:
        lines.append(f"   After attention, {q}'s MLP in this layer is a mixture of experts: it "
                     f"{t.experts}.")  # fmt: skip
    return lines
