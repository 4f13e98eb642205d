"""The tour's steps, one function each, in the article's order (see `qkv.inspect.tour`).

Each reads what the library computed (the trace, the layer's record, the hidden states, the
probe) and returns a `Step` with its numbers as plain floats and lists: nothing here computes
a number a second way. Vectors are kept whole (C or D floats), so that a page can show any
part of them and a test can compare every one.
"""

from __future__ import annotations

import copy
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from qkv.attention import attend, explain_choice
from qkv.inspect.probe import probe
from qkv.inspect.records import why_not_redone
from qkv.inspect.sinks import is_sink, sink_sentence
from qkv.inspect.why import why as explain_why
from qkv.inspect.words import on_words
from qkv.io.load import load_source
from qkv.io.runs import checkpoints, step_of
from qkv.models import Decoder, EncoderDecoder
from qkv.models.encoder import padded_positions
from qkv.nn.position import positions_for


def _floats(x: Tensor) -> list[float]:
    return [float(v) for v in x.double().flatten()]


@dataclass(frozen=True)
class Step:
    """One section of the article: what it says, the model's numbers for it (JSON-ready), and
    the experiments offered beside it, each with its result precomputed."""

    id: str
    title: str
    says: str  # the article's point in a sentence or two, with this model's words
    numbers: dict
    experiments: tuple[dict, ...] = ()

    def to_dict(self) -> dict:
        return {"id": self.id, "title": self.title, "says": self.says, "numbers": self.numbers,
                "experiments": list(self.experiments)}  # fmt: skip


def _step(id: str, title: str, says: str, numbers: dict, tried=()) -> Step:
    return Step(id, title, says, numbers, tuple(tried))


def tokens_step(pretrained, encoded, found):
    """The text as the model reads it: token ids and the pieces they stand for."""
    T = len(encoded.ids)
    return _step(
        "tokens", "Tokens",
        f"The model does not read words but tokens: {T} of them here, each an id in a "
        f"vocabulary of {pretrained.tokenizer.vocab_size:,}. Special tokens mark the text's "
        "edges; a long word may be several tokens.",
        {"ids": list(encoded.ids), "tokens": list(encoded.tokens),
         "pieces": list(encoded.pieces or encoded.tokens),
         "special": list(encoded.special), "vocab_size": pretrained.tokenizer.vocab_size,
         "query_index": found.query_index, "key_index": found.key_index},
    )  # fmt: skip


def embeddings_step(pretrained, stack, encoded, found, states):
    """The query token's embedding, the position embedding added to it (or, with rotary
    positions, none: they turn q and k instead), and the vector that enters layer 0."""
    embed = stack.embed
    at = found.query_index
    ids = torch.tensor([encoded.ids])  # (1, T)
    numbers: dict = {"index": at, "token": found.tokens[at], "width": found.width}
    with torch.inference_mode():
        numbers["token_vector"] = _floats(embed.tokens.weight[encoded.ids[at]] * embed.scale)
        numbers["scale"] = float(embed.scale)
        position = None
        if embed.positions is not None:
            padding = getattr(stack.config, "position_padding", None)
            where = positions_for(ids.shape[1]) if padding is None else padded_positions(
                ids, padding)[0]  # fmt: skip
            position = embed.positions(where)[at]  # (C,)
            numbers["position_vector"] = _floats(position)
            numbers["position"] = int(where[at])
        if embed.types is not None:  # BERT's segment embedding: every token in segment 0
            numbers["segment_vector"] = _floats(embed.types.weight[0])
        numbers["layer_input"] = _floats(states[0][0, at])  # (C,) after the embeddings' norm
    numbers["norm"] = None if embed.norm is None else type(embed.norm).__name__
    kind = getattr(stack.config, "position", "learned")
    numbers["position_kind"] = kind
    if position is not None:
        says = (f"Each token becomes a vector of {found.width} numbers (its embedding); "
                "its position's embedding is added to it, not concatenated, so the same word "
                "at two places gives two different vectors.")  # fmt: skip
    elif kind == "rotary":
        says = (f"Each token becomes a vector of {found.width} numbers. This model adds no "
                "position vector: its positions rotate each head's query and key vectors "
                "(rotary positions), so that their dot product depends on how far apart two "
                "words are.")  # fmt: skip
    else:
        says = (
            f"Each token becomes a vector of {found.width} numbers. This model adds no "
            f"position vector here ({kind} positions act inside attention)."
        )
    return _step("embeddings", "Embeddings and positions", says, numbers)


def why_scalar(pretrained, found, top: int = 5) -> dict:
    """Why the scalar is what it is (`qkv.why`, no reruns): the score as a sum of terms, one per
    (part of the query word's stream, part of the key word's), the largest listed; or why not."""
    try:
        why = explain_why(pretrained, found.text, found.query, found.key, layer=found.layer,
                          head=found.head, checks=0)  # fmt: skip
    except ValueError as error:  # a layer the terms cannot be read from, said by name
        return {"shown": False, "why_not": str(error)}
    share = max(abs(why.total), 1e-12)
    return {"shown": True, "total": why.total, "score": why.score,
            "ranked": [{"query_part": q, "key_part": k, "value": v, "share": v / share}
                       for q, k, v in why.ranked(top)]}  # fmt: skip


def qkv_step(found, tried, why=None):
    """One head's query, key and value vectors and the article's seven steps (the trace)."""
    t = found
    numbers = {
        "layer": t.layer, "head": t.head, "chosen": t.chosen, "head_dim": t.head_dim,
        "query_vector": _floats(t.query_vector), "key_vector": _floats(t.key_vector),
        "attention_scalar": t.attention_scalar, "scale": t.scale,
        "scaled_scalar": t.scaled_scalar, "score": t.score, "weights": _floats(t.weights),
        "weight": t.weight, "value_vector": _floats(t.value_vector),
        "scaled_value_vector": _floats(t.scaled_value_vector),
        "contextualized": _floats(t.contextualized), "model_output": _floats(t.model_output),
        "causal": t.causal, "masked": t.masked,
        "query_unrotated": None if t.query_unrotated is None else _floats(t.query_unrotated),
        "why": why,
    }  # fmt: skip
    q, k = t.query, t.key
    top = int(t.weights.argmax())
    numbers["sink"] = None
    if top != t.key_index and is_sink(t.tokens, top):  # the row's most weight on a marker
        numbers["sink"] = {"index": top, "token": t.tokens[top], "weight": float(t.weights[top])}
    says = (f"In layer {t.layer}, head {t.head}, {q!r} asks with its query vector and {k!r} "
            "answers with its key vector: their dot product is one scalar, scaled and then "
            "normalized with the softmax over every word; each word's value vector is scaled by "
            f"its weight, and the sum is the new vector of {q!r} (the original embedding is "
            "not added here).")  # fmt: skip
    if numbers["sink"]:  # in the words every page uses (qkv.inspect.sinks)
        said = sink_sentence(t.tokens, t.weights.tolist(), repr(q))
        says += f" {said[0].upper()}{said[1:]}."
    return _step("qkv", "Query, key and value: the seven steps", says, numbers, tried)


def scaling_step(seen, found, tried):
    """The softmax of the query's row with and without dividing by sqrt(D), side by side."""
    steps = seen.records[found.layer].steps(found.head, found.query_index)
    scalars = torch.tensor([float(p.attention_scalar) for p in steps.pairs], dtype=torch.float64)
    allowed = torch.tensor([bool(p.allowed) for p in steps.pairs])
    unscaled = torch.zeros_like(scalars)
    unscaled[allowed] = torch.softmax(scalars[allowed], 0)  # the same row, D not divided out
    D = found.head_dim
    numbers = {
        "head_dim": D, "sqrt_d": math.sqrt(D), "scale": found.scale,
        "scalars": _floats(scalars),
        "scaled": [float(p.scaled_scalar) for p in steps.pairs],
        "with_scale": _floats(found.weights), "without_scale": _floats(unscaled),
        "allowed": allowed.tolist(), "top_with": float(found.weights.max()),
        "top_without": float(unscaled.max()),
        "variants": found.softcap is not None or found.bias is not None,
    }  # fmt: skip
    says = (f"The dot products grow with the vectors' size D = {D}; divided by sqrt(D) = "
            f"{math.sqrt(D):.2f} they stay in a range where the softmax still spreads weight "
            f"over several words. Without it the largest weight here would be "
            f"{numbers['top_without']:.2%} instead of {numbers['top_with']:.2%}.")  # fmt: skip
    return _step("scaling", "Normalization: dividing by sqrt(D), then the softmax", says,
                 numbers, tried)  # fmt: skip


def heads_step(stack, seen, found, tried):
    """Every head's weight for the pair in the layer; the heads' outputs concatenated
    (B, T, H*D) and projected back to the width C."""
    record = seen.records[found.layer]
    weights = on_words(record)[0, :, found.query_index, found.key_index]  # (H,)
    H, D = record.shape.H, record.shape.value_size
    attn = stack.blocks[found.layer].attn
    with torch.inference_mode():
        concatenated = record.out[0, :, found.query_index].reshape(H * D)  # (H*D,)
        projected = attn.out(concatenated[None].to(attn.out.weight.dtype))[0]  # (C,)
    B, T, C = 1, len(found.tokens), found.width
    numbers = {
        "weights": _floats(weights), "strongest": int(weights.argmax()),
        "num_heads": H, "head_dim": D, "width": C,
        "concatenated": _floats(concatenated), "projected": _floats(projected),
        "shapes": {"heads": f"(B, H, T, D) = ({B}, {H}, {T}, {D})",
                   "concatenated": f"(B, T, H*D) = ({B}, {T}, {H * D})",
                   "projection": f"(C, H*D) = ({C}, {H * D})",
                   "projected": f"(B, T, C) = ({B}, {T}, {C})"},
    }  # fmt: skip
    says = (f"Layer {found.layer} has {H} heads, each with its own query, key and value "
            f"matrices, so each weighs the pair differently. Their {H} outputs of {D} numbers "
            f"are concatenated into {H * D} and projected back to the width {C}.")  # fmt: skip
    return _step("heads", "Multiple heads", says, numbers, tried)


def layers_step(found, vectors, senses, tried):
    """The query word's vector after every layer (cosine between consecutive depths), and the
    two senses of "bank" separating (the probe over the embedded labelled sentences)."""
    unit = torch.nn.functional.normalize(vectors.double(), dim=-1)  # (L+1, C)
    consecutive = (unit[1:] * unit[:-1]).sum(-1)  # (L,)
    numbers = {
        "depths": ["embeddings", *(f"layer {i}" for i in range(len(vectors) - 1))],
        "consecutive_cosine": _floats(consecutive),
        "norms": _floats(vectors.double().norm(dim=-1)),
        "senses": {"word": senses.word, "separation": list(senses.separation),
                   "accuracy": list(senses.accuracy), "sentences": len(senses.sentences)},
    }  # fmt: skip
    says = (
        "The new vectors feed the next layer, which does it all again with matrices of its "
        f"own: {len(vectors) - 1} layers here. Layer by layer the word's vector changes; "
        "and where 'bank' means a river bank in some sentences and a money bank in others, "
        "the two senses move apart (separation: mean cosine within a sense minus across)."
    )
    return _step("layers", "Multiple layers", says, numbers, tried)


def cross_step(pretrained, text: str, target: str | None):
    """An encoder-decoder's cross-attention over `target` (by default what it writes for
    `text`): one head's weights from the decoder's tokens to the source's, and the shift: the
    decoder reads its start token, then the target, so row i predicts target token i. Other
    models: a note of what would have it."""
    if not isinstance(pretrained.model, EncoderDecoder):
        kind = "decoder" if isinstance(pretrained.model, Decoder) else "encoder"
        says = (f"This model ({kind}) has no cross-attention: its queries, keys and values all "
                "come from one text. An encoder-decoder (the original transformer, T5, BART, or "
                "a `qkv train --preset reverse` run) has it: the decoder's queries read the "
                "encoder's keys and values. Its decoder reads the target shifted right (a start "
                "token first), so its row for target word i predicts word i + 1 and its weights "
                "look shifted by one.")  # fmt: skip
        return _step("cross", "Cross-attention", says, {"has_cross": False, "kind": kind})
    if target is None:  # the model's own output for the text (greedy)
        target = pretrained.generate(text, max_new_tokens=min(64, 2 * len(text.split()) + 4))
        if not target.strip():
            raise ValueError("the model wrote nothing for the text; give target= to show its "
                             "cross-attention")  # fmt: skip
    seen = pretrained.attentions(text, target=target)
    weights = seen.weights.double()  # (L, H, Tt, Ts)
    peak = weights.max(-1).values.mean(-1)  # (L, H): how sharply each head's rows look
    layer, head = divmod(int(peak.argmax()), weights.shape[1])
    rows = weights[layer, head]  # (Tt, Ts)
    queries = list(seen.query_tokens)
    numbers = {
        "has_cross": True, "kind": "encoder-decoder", "target": target, "layer": layer,
        "head": head, "source_tokens": list(seen.tokens), "decoder_tokens": queries,
        "predicts": [*queries[1:], "(the end)"], "weights": [_floats(r) for r in rows],
        "looks_at": [int(r.argmax()) for r in rows],
    }  # fmt: skip
    says = (
        f"The decoder's queries read the encoder's keys and values. Here, layer {layer}, "
        f"head {head} (where the rows look most sharply at one source token). The decoder "
        f"reads its start token {queries[0]!r} and then the target shifted right, so the row "
        "of each decoder token predicts the next one: its weights look shifted by one."
    )
    return _step("cross", "Cross-attention", says, numbers)


def training_step(pretrained):
    """A training run's loss curve and cue head; otherwise how to make one."""
    run = getattr(pretrained, "run", None)
    if run is None:
        return _step("training", "Training", (
            "The query, key and value matrices are learned. This model came trained; to watch "
            "training make them, train a small model on the 'bank' corpus in about a minute "
            "(`qkv train --preset bank`) and give its run folder to `qkv tour --model`."),
            {"run": False})  # fmt: skip
    metrics = Path(pretrained.source) / "metrics.jsonl"
    steps, losses, val = [], [], []
    if metrics.is_file():
        for line in metrics.read_text(encoding="utf-8").splitlines():
            record = json.loads(line) if line.strip() else None
            if record and "loss" in record:
                steps.append(int(record["step"]))
                losses.append(float(record["loss"]))
                val.append(record.get("val_loss"))
    numbers: dict = {"run": True, "steps": steps, "loss": losses, "val_loss": val, "cue": None}
    if run.data.kind == "bank":
        found = probe(pretrained, "bank")
        if found.cue_head is not None:
            layer, head, share = found.cue_head
            numbers["cue"] = {"layer": layer, "head": head, "share": share,
                              "forming": _cue_forming(pretrained, layer, head)}  # fmt: skip
    says = ("The matrices were learned by this run: its loss fell from "
            f"{losses[0]:.3f} to {losses[-1]:.3f} over {steps[-1]} steps." if losses else
            "The matrices were learned by this run (its metrics.jsonl is missing).")  # fmt: skip
    if numbers["cue"]:
        c = numbers["cue"]
        says += (f" The head in which 'bank' looks most often to the word that tells its sense "
                 f"is head {c['head']} of layer {c['layer']}: in {c['share']:.0%} of the run's "
                 "held-out sentences.")  # fmt: skip
    return _step("training", "Training", says, numbers)


def _cue_forming(pretrained, layer: int, head: int) -> list[dict]:
    """The cue head's share at each checkpoint the run kept, oldest first: the head forming.
    Each checkpoint is loaded as the run's model is (`load_source`), and probed the same way."""
    forming = []
    for checkpoint in checkpoints(Path(pretrained.source)):
        then = copy.copy(pretrained)  # the same tokenizer and run, that checkpoint's weights
        then.model = load_source(checkpoint).model
        cue = probe(then, "bank").cue_attention
        forming.append({"step": step_of(checkpoint), "share": float(cue[layer, head])})
    return forming


def parallel_step(seen, found):
    """The layer's attention by the `loop` backend (one pair at a time, as the article says it)
    and by the backend `auto` chooses, on the same q, k, v: equal outputs, their time ratio."""
    record = seen.records[found.layer]
    beyond = why_not_redone({found.layer: record}, applies=())
    if beyond is not None:
        return _step("parallel", "Parallel computation", (
            f"Every pair's dot product is independent of the others, so a fused kernel computes "
            f"them all at once; this layer is not plain softmax attention ({beyond}), so the tour "
            "does not time it."), {"timed": False})  # fmt: skip
    q, k, v = record.q, record.k, record.v  # (B, H, T, D), (B, Hkv, T, D)
    given = {"mask": record.mask, "causal": record.causal, "scale": record.scale}
    fused = explain_choice(q, k, v, **given).backend
    with torch.inference_mode():
        start = time.perf_counter()
        slow = attend(q, k, v, backend="loop", **given)
        loop_seconds = time.perf_counter() - start
        fast_seconds = math.inf
        for _ in range(5):  # the best of five: a fused call takes microseconds
            start = time.perf_counter()
            fast = attend(q, k, v, backend=fused, **given)
            fast_seconds = min(fast_seconds, time.perf_counter() - start)
    difference = float((slow.double() - fast.double()).abs().max())
    B, H, T, D = q.shape
    numbers = {
        "timed": True, "backend": fused, "loop_seconds": loop_seconds,
        "fused_seconds": fast_seconds, "ratio": loop_seconds / fast_seconds,
        "max_difference": difference, "pairs": B * H * T * record.k.shape[2],
        "shape": f"(B, H, T, D) = ({B}, {H}, {T}, {D})",
    }  # fmt: skip
    says = (f"No pair's scalar waits for another's, so all {numbers['pairs']:,} pairs of layer "
            f"{found.layer} can be computed at once. Measured now: the `loop` backend (one pair "
            f"at a time, as the article tells it) took {loop_seconds * 1e3:.1f} ms, `{fused}` "
            f"{fast_seconds * 1e3:.3f} ms ({numbers['ratio']:.0f}x), with outputs equal to "
            f"{difference:.1e}.")  # fmt: skip
    return _step("parallel", "Parallel computation", says, numbers)
