"""The tour's one-click experiments, precomputed so that an offline page can show them.

Each asks the model itself, through the library's own functions, and comes with its scale:
a change measured as 1 - cosine means little until it stands beside how far two different
words lie apart in the same layer.

- hide the key word from the query word (`qkv.hide`): the query's final vector changes;
- swap the key word for another ("river" -> "money", `qkv.trace` on both sentences): the
  query's weights in the same layer and head;
- ablate the head (`qkv.ablate`): every token's final vector changes, the query's too;
- compare two sentences (`qkv.inspect.probe`): the query word's vector in each, layer by layer.
"""

from __future__ import annotations

import torch
from torch import Tensor

from qkv.inspect.ablate import ablate
from qkv.inspect.bank_sentences import LABELS, SENTENCES
from qkv.inspect.hide import hide
from qkv.inspect.probe import probe
from qkv.inspect.trace import trace

SWAPS = {"river": "money", "money": "river"}  # the key word's stand-in
STAND_INS = ("river", "money", "table", "music")  # otherwise the first not in the text
OTHER_BANK = SENTENCES[LABELS.index("money")]  # "The bank approved my loan."


def _one_minus_cos(a: Tensor, b: Tensor) -> float:
    return float(1 - torch.nn.functional.cosine_similarity(a.double(), b.double(), dim=-1))


def _span_mean(states: Tensor, span: tuple[int, int]) -> Tensor:
    return states[span[0] : span[1]].double().mean(0)  # (C,)


def across_senses(senses) -> float:
    """1 - the mean cosine between a river "bank" and a money "bank" in the probe's last
    layer: how far the two senses lie apart there."""
    similarity, labels = senses.similarity[-1].double(), senses.labels
    across = [float(similarity[i, j]) for i in range(len(labels)) for j in range(len(labels))
              if labels[i] != labels[j]]  # fmt: skip
    return 1 - sum(across) / len(across)


def experiments(pretrained, text: str, found, states, senses, *, swap=None, compare=None) -> dict:
    """{"qkv": [...], "scaling": [...], "heads": [...], "layers": [...]}: each step's
    experiments (dicts: id, label, says, result), and "vectors": the query word's vector at
    every depth (L+1, C), read by the probe beside the compared sentence's. An experiment the
    model cannot run (an intervention its layers refuse) says why, by name, with no result."""
    encoded = pretrained.encode(text)
    query_span, key_span = encoded.find(found.query), encoded.find(found.key)
    final = states[-1][0]  # (T, C) the last layer's output
    apart = _one_minus_cos(_span_mean(final, query_span), _span_mean(final, key_span))
    senses_apart = across_senses(senses)
    scale = {"words_apart": apart, "senses_apart": senses_apart,
             "scale_says": f"for scale: {found.query!r} and {found.key!r} lie {apart:.4f} apart "
                           f"(1 - cos) in the last layer of this sentence; a river 'bank' and a "
                           f"money 'bank' lie {senses_apart:.4f} apart"}  # fmt: skip
    key_word = next(w for w in encoded.words() if w.token_span == key_span)
    present = {w.text.casefold() for w in encoded.words()}
    stand_in = swap or next(w for w in (SWAPS.get(key_word.text.casefold()), *STAND_INS)
                            if w is not None and w not in present)  # fmt: skip
    if not isinstance(stand_in, str) or not stand_in.strip() or stand_in.split() != [stand_in]:
        raise ValueError(f"swap must be one word, got {stand_in!r}")
    swapped_text = text[: key_word.start] + stand_in + text[key_word.end :]
    if compare is None:
        plain = "#" not in found.query and found.query.casefold() == "bank"
        compare = OTHER_BANK if plain and text != OTHER_BANK else swapped_text
    tried = {
        "qkv": [_tried("hide", f"Hide {found.key!r} from {found.query!r}", _hide,
                       pretrained, text, found, scale)],
        "scaling": [_tried("swap", f"Swap {found.key!r} for {stand_in!r}", _swap,
                           pretrained, swapped_text, stand_in, found)],
        "heads": [_tried("ablate", f"Ablate head {found.head} of layer {found.layer}", _ablate,
                         pretrained, text, found, query_span, scale)],
    }  # fmt: skip
    both = probe(pretrained, found.query, [text, compare])
    cosines = [float(c) for c in both.similarity[:, 0, 1]]
    tried["layers"] = [{
        "id": "compare", "label": "Compare with another sentence",
        "says": f"{found.query!r} in {text!r} and in {compare!r}: cosine "
                f"{cosines[0]:.4f} at the embeddings, {cosines[-1]:.4f} after the last layer.",
        "result": {"text": compare, "depths": list(both.layers), "cosine": cosines,
                   "senses_apart": senses_apart},
    }]  # fmt: skip
    return {**tried, "vectors": both.vectors[:, 0]}


def _tried(id: str, label: str, run, *args) -> dict:
    """The experiment's dict from run(*args) -> (says, result), or, where the model refuses
    it, the refusal in its place."""
    try:
        says, result = run(*args)
    except ValueError as error:
        return {"id": id, "label": label, "says": f"Not on this model: {error}", "result": None}
    return {"id": id, "label": label, "says": says, "result": result}


def _hide(pretrained, text, found, scale):
    hidden = hide(pretrained, text, found.key, query=found.query, table=False)
    says = (f"With {found.key!r} hidden from {found.query!r} in every layer and head, "
            f"{found.query!r}'s final vector changes by 1 - cos = {hidden.total:.4f}; "
            + scale["scale_says"] + ".")  # fmt: skip
    return says, {"change": hidden.total, "distance": hidden.total_distance, **scale}


def _swap(pretrained, swapped_text, stand_in, found):
    swapped = trace(pretrained, swapped_text, found.query, stand_in, layer=found.layer,
                    head=found.head)  # fmt: skip
    says = (f"In {swapped_text!r}, layer {found.layer}, head {found.head}: {found.query!r} gives "
            f"{stand_in!r} {swapped.weight:.1%} of its weight, where it gave {found.key!r} "
            f"{found.weight:.1%}.")  # fmt: skip
    return says, {"text": swapped_text, "tokens": list(swapped.tokens), "word": stand_in,
                  "weights": [float(w) for w in swapped.weights], "weight": swapped.weight,
                  "original_weight": found.weight, "key_index": swapped.key_index}  # fmt: skip


def _ablate(pretrained, text, found, query_span, scale):
    ablated = ablate(pretrained, text, [(found.layer, found.head)])
    query_change = _one_minus_cos(_span_mean(ablated.clean_states, query_span),
                                  _span_mean(ablated.states, query_span))  # fmt: skip
    says = (f"With head {found.head} of layer {found.layer} zeroed, every token's final vector "
            f"changes by 1 - cos = {ablated.total:.4f} on average and {found.query!r}'s by "
            f"{query_change:.4f}; " + scale["scale_says"] + ".")  # fmt: skip
    return says, {"change": ablated.total, "query_change": query_change, **scale}
