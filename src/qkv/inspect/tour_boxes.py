"""The real tensor behind each box of the model diagram, for the tour's page.

A click on a box shows the tensor it stands for, for the learner's sentence at the layer and
head the tour is on: the whole shape in the article's letters, and the row of the query word
(and, for a head's tensors, the tour's head) as numbers. Each value is read from the forward
pass the tour ran (its records and hidden states), never recomputed. A box whose tensor the
pass does not keep apart (a norm inside a block) says so beside its shape.
"""

from __future__ import annotations

from torch import Tensor


def _row(x: Tensor) -> list[float]:
    return [float(v) for v in x.double().flatten()]


def box_values(
    diagram, seen, found, states, embeddings: dict, heads: dict, prefix: str = ""
) -> dict[str, dict]:
    """{box id: {"what": which slice, in words, "values": [...]} or {"what": why none}}.

    seen: the tour's Attentions; found: its Trace; states: the hidden states L+1 x (1, T, C);
    embeddings, heads: the numbers of the tour's embeddings and heads steps (whose vectors
    are the same tensors' rows); prefix: "enc." where these are an encoder-decoder's encoder's
    (the decoder's boxes then show their shape only)."""
    layer, head, at = found.layer, found.head, found.query_index
    record = seen.records[layer]
    kv = head // record.shape.group
    word = f"the row of {found.query!r} (token {at})"
    in_head = f"{word} in head {head} of layer {layer}"
    in_layer = f"{word} in layer {layer}"
    read: dict[str, tuple[str, Tensor | list[float] | None]] = {
        "tokens": ("every token's id", [float(i) for i in seen.encoded.ids]),
        "embed": (f"{word}: its token embedding", embeddings.get("token_vector")),
        "position": (f"{word}: its position's embedding", embeddings.get("position_vector")),
        "embed_norm": (f"{word}: what enters layer 0", embeddings.get("layer_input")),
        "L.resid_pre": (f"{in_layer}: what enters it", states[layer][0, at]),
        "L.q": (in_head, record.q[0, head, at] if record.q_before_rotary is None
                else record.q_before_rotary[0, head, at]),
        "L.k": (f"{word} in key head {kv} of layer {layer}", record.k[0, kv, at]
                if record.k_before_rotary is None else record.k_before_rotary[0, kv, at]),
        "L.v": (f"{word} in value head {kv} of layer {layer}", record.v[0, kv, at]),
        "L.q_rotary": (in_head + ", rotated", record.q[0, head, at]),
        "L.k_rotary": (f"{word} in key head {kv} of layer {layer}, rotated", record.k[0, kv, at]),
        "L.scores": (in_head + ": the scaled dot product with every key",
                     [float(p.scaled_scalar) for p in record.steps(head, at).pairs]),
        "L.weights": (in_head + ": its weight on every key", found.weights),
        "L.z": (in_head + ": its new vector", record.out[0, head, at]),
        "L.concat": (in_layer + ": every head's output side by side", heads.get("concatenated")),
        "L.o": (in_layer + ": what attention adds", heads.get("projected")),
        "L.resid_post": (f"{in_layer}: its output", states[layer + 1][0, at]),
    }  # fmt: skip
    if record.attn_out is not None:
        read["L.o"] = (in_layer + ": what attention adds", record.attn_out[0, at])
        read["L.resid_mid"] = (in_layer + ": the input plus attention",
                               states[layer][0, at] + record.attn_out[0, at])  # fmt: skip
    if record.mlp_out is not None:
        read["L.mlp"] = (in_layer + ": what the MLP adds", record.mlp_out[0, at])
    if diagram is not None and any(b.id == "L.norm_mlp" and b.tensor and "resid_post" in b.tensor
                                   for b in diagram.boxes):  # fmt: skip
        read["L.norm_mlp"] = (f"{in_layer}: its output", states[layer + 1][0, at])
    found_values: dict[str, dict] = {}
    for box in () if diagram is None else diagram.boxes:
        own = box.id[len(prefix) :] if box.id.startswith(prefix) else None
        what, values = read.get(own, (None, None)) if own is not None else (None, None)
        if values is None:
            found_values[box.id] = {"what": "not kept apart by the forward pass: its shape only"}
            continue
        values = _row(values) if isinstance(values, Tensor) else list(values)
        found_values[box.id] = {"what": what, "values": values}
    return found_values
