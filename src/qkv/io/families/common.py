"""What every family module uses: `Weight`, `Family`, the weight-map template expander, and
the checks that say which config a family can read or write.

A weight map is a list of (qkv name, checkpoint name) templates, litgpt's style: `{}` stands
for the layer index, and `expand` writes one `Weight` per layer. A third element, a layout,
says how a tensor turns between the two (GPT-2's Conv1D stores its matrices transposed).
Where one qkv parameter is made of several checkpoint tensors (a mixture's experts, one
tensor each in the checkpoint, one stacked tensor in qkv), the checkpoint side is a `Joined`
(`stacked`, `stacked_halves`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor


def _same(t: Tensor) -> Tensor:
    return t


def _transposed(t: Tensor) -> Tensor:
    return t.t().contiguous()  # GPT-2's Conv1D stores (in, out); Linear wants (out, in)


@dataclass(frozen=True)
class Layout:
    """How a tensor turns from its checkpoint layout to qkv's (`load`) and back (`save`)."""

    load: Callable[[Tensor], Tensor] = _same
    save: Callable[[Tensor], Tensor] = _same


SAME = Layout()
TRANSPOSED = Layout(_transposed, _transposed)


def permuted_rows(order: Tensor) -> Layout:
    """A layout whose qkv rows are the checkpoint's rows in `order` (qkv row i is checkpoint
    row order[i]), for a weight or a bias alike; saving puts them back.

    >>> layout = permuted_rows(torch.tensor([0, 2, 1]))
    >>> layout.load(torch.tensor([10, 11, 12])).tolist(), layout.save(torch.tensor([10, 12, 11]))
    ([10, 12, 11], tensor([10, 11, 12]))
    """
    back = torch.argsort(order)
    return Layout(lambda t: t[order], lambda t: t[back])


@dataclass(frozen=True)
class Joined:
    """The checkpoint side of a qkv parameter made of several checkpoint tensors.

    names: one checkpoint template per tensor, in the order `load` takes them (`{}` is the
    layer index, as in any template). load: those tensors -> the parameter. save: the
    parameter -> the tensors again, in the same order. `stacked` and `stacked_halves` make
    the two that mixtures of experts need.
    """

    names: tuple[str, ...]
    load: Callable[[list[Tensor]], Tensor]
    save: Callable[[Tensor], list[Tensor]]


def stacked(template: str, count: int) -> Joined:
    """`count` tensors, `{e}` in the template standing for 0 .. count - 1, stacked along a new
    first dimension: the experts' down matrices (E, C, I) of E checkpoint tensors (C, I).

    >>> joined = stacked("layers.{}.experts.{e}.w2", 2)
    >>> joined.names, joined.load([torch.zeros(3, 4), torch.ones(3, 4)]).shape
    (('layers.{}.experts.0.w2', 'layers.{}.experts.1.w2'), torch.Size([2, 3, 4]))
    """
    names = tuple(template.replace("{e}", str(e)) for e in range(count))
    return Joined(names, lambda parts: torch.stack(parts), lambda t: list(t.unbind(0)))


def stacked_halves(first: str, second: str, count: int) -> Joined:
    """`count` pairs of tensors, `{e}` in the templates standing for 0 .. count - 1; entry e of
    the stacked parameter is pair e's first tensor's rows, then its second's: the experts'
    gate_up (E, 2I, C) of E gate (I, C) and E up (I, C) tensors. Checkpoint names come in
    pairs: first of expert 0, second of expert 0, first of expert 1, ...

    >>> joined = stacked_halves("e{e}.gate", "e{e}.up", 2)
    >>> joined.names
    ('e0.gate', 'e0.up', 'e1.gate', 'e1.up')
    >>> joined.load([torch.zeros(2, 5), torch.ones(2, 5)] * 2)[:, :, 0].tolist()
    [[0.0, 0.0, 1.0, 1.0], [0.0, 0.0, 1.0, 1.0]]
    """
    names = tuple(t.replace("{e}", str(e)) for e in range(count) for t in (first, second))

    def load(parts: list[Tensor]) -> Tensor:
        return torch.stack([torch.cat(parts[i : i + 2]) for i in range(0, len(parts), 2)])

    def save(t: Tensor) -> list[Tensor]:
        return [half for entry in t.unbind(0) for half in entry.chunk(2)]

    return Joined(names, load, save)


@dataclass(frozen=True)
class Weight:
    """One qkv parameter (or persistent buffer) and where it lives in a checkpoint.

    A plain weight is one checkpoint tensor: `names` are its aliases (the first is canonical,
    written on export), `load` and `save` turn it. A joined weight (`parts` not empty) is made
    of several: `parts` holds each tensor's aliases, in order; `load` takes the list of them,
    `save` returns one tensor per part; `names` is then each part's canonical name.
    """

    qkv: str
    names: tuple[str, ...]
    load: Callable[[Tensor], Tensor] = _same
    save: Callable[[Tensor], Tensor] = _same
    parts: tuple[tuple[str, ...], ...] = ()


# (qkv template, checkpoint template or several aliases or a Joined[, layout]); `{}` is the
# layer index. A layout applies to a plain weight only (a Joined turns its own tensors).
Template = (
    tuple[str, str | tuple[str, ...] | Joined] | tuple[str, str | tuple[str, ...] | Joined, Layout]
)


def expand(
    templates: Iterable[Template], num_layers: int, *, prefixes: Sequence[str] = ("",)
) -> list[Weight]:
    """One Weight per template, per layer for templates with `{}`.

    Each checkpoint name is tried under every prefix in turn (sentence-transformers folders
    drop BertModel's "bert."): the first prefix is the one written on export.

    >>> [(w.qkv, w.names) for w in expand([("blocks.{}.q", "h.{}.q")], 2, prefixes=("t.", ""))]
    [('blocks.0.q', ('t.h.0.q', 'h.0.q')), ('blocks.1.q', ('t.h.1.q', 'h.1.q'))]
    """
    templates = list(templates)
    once = [t for t in templates if "{}" not in t[0]]
    layered = [t for t in templates if "{}" in t[0]]
    weights = []
    for i, (qkv, names, *layout) in [(0, t) for t in once] + [
        (i, t) for i in range(num_layers) for t in layered
    ]:
        if isinstance(names, Joined):
            parts = tuple(tuple(p + name.format(i) for p in prefixes) for name in names.names)
            canonical = tuple(part[0] for part in parts)
            weights.append(Weight(qkv.format(i), canonical, names.load, names.save, parts))
            continue
        aliases = (names,) if isinstance(names, str) else names
        how = layout[0] if layout else SAME
        checkpoint = tuple(p + name.format(i) for name in aliases for p in prefixes)
        weights.append(Weight(qkv.format(i), checkpoint, how.load, how.save))
    return weights


def decoder_weights(templates: Iterable[Template], cfg, **prefixes) -> list[Weight]:
    """A decoder's weights: `templates` expanded for its layers, and its own LM head
    (lm_head.weight) unless the head reuses the token matrix. prefixes: as in `expand`."""
    out = expand(templates, cfg.num_layers, **prefixes)
    if not cfg.tie_embeddings:
        out += expand([("lm_head.weight", "lm_head.weight")], 0)
    return out


@dataclass(frozen=True)
class Family:
    """A Hugging Face model family: its config.json both ways, and its weight map."""

    name: str
    model_types: tuple[str, ...]  # Hugging Face `model_type` values this family reads
    model: type  # the qkv model class: Encoder, Decoder or EncoderDecoder
    config: Callable[[dict], object]  # config.json -> qkv config, refusing what qkv lacks
    hf_config: Callable[[object], dict]  # qkv config -> config.json, refusing what it lacks
    weights: Callable[[object], list[Weight]]
    # checkpoint keys that hold no weights qkv uses (buffers, heads it does not have)
    ignored: tuple[str, ...] = field(default=())
    # The config.json keys of this family, for the test that no key that changes the
    # computation goes unread: `reads`, the keys `config` reads (computing them, or refusing
    # values it does not compute, by name); `inert`, keys that do not change the outputs
    # (token ids, dropout, init ranges, cache settings). `config_classes`: the transformers
    # config classes this family reads, by name (e.g. "LlamaConfig").
    reads: tuple[str, ...] = field(default=())
    inert: tuple[str, ...] = field(default=())
    config_classes: tuple[str, ...] = field(default=())
    # (model_type, why): types this family knows but qkv does not read (Gemma 3's multimodal
    # checkpoints), which family_for refuses by name rather than as unknown
    refused_types: tuple[tuple[str, str], ...] = field(default=())


def with_biases(pairs: Iterable[tuple[str, str]], layout: Layout = SAME) -> list[Template]:
    """(module, checkpoint module) pairs -> templates of their weights and biases; the
    layout turns the weights only (a bias is the same vector both ways)."""
    return [t for q, h in pairs for t in ((f"{q}.weight", f"{h}.weight", layout),
                                          (f"{q}.bias", f"{h}.bias"))]  # fmt: skip


# ---- config.json -> qkv config ------------------------------------------------------------

ACTIVATIONS = {
    "gelu": "gelu",
    "gelu_new": "gelu_tanh",
    "gelu_pytorch_tanh": "gelu_tanh",
    "relu": "relu",
    "silu": "silu",
    "swish": "silu",
}


def activation(hf: dict, key: str) -> str:
    name = hf.get(key, "gelu")
    if not isinstance(name, str) or name not in ACTIVATIONS:  # a list is no name (nor hashable)
        raise ValueError(
            f"activation {name!r} is not supported ({key}); supported: {list(ACTIVATIONS)}"
        )
    return ACTIVATIONS[name]


def require(hf: dict, family: str, **expected) -> None:
    """Refuse a config.json value qkv does not compute; the first allowed is the default."""
    for key, allowed in expected.items():
        value = hf.get(key, allowed[0])
        if value not in allowed:
            raise ValueError(f"{family} checkpoints with {key}={value!r} are not supported")


# ---- qkv config -> config.json --------------------------------------------------------------


def hf_activation(mlp: str, family: str, gelu_tanh: str = "gelu_pytorch_tanh") -> str:
    """The config.json name of a qkv activation (the family's own spelling of tanh-gelu)."""
    names = {"gelu": "gelu", "gelu_tanh": gelu_tanh, "relu": "relu", "silu": "silu"}
    if mlp not in names:
        raise ValueError(
            f"a {family} config.json cannot hold mlp={mlp!r}; it holds {', '.join(names)}"
        )
    return names[mlp]


def fits(family: str, cfg, **needed) -> None:
    """Refuse a qkv config that the family's config.json cannot describe, naming each field
    that does not fit. needed: a dotted field of `cfg` (block__norm is block.norm) and the
    one value the family holds."""
    wrong = []
    for key, want in needed.items():
        value = cfg
        for part in key.split("__"):
            value = getattr(value, part)
        if value != want:
            wrong.append(f"{key.replace('__', '.')}={value!r} (it has {want!r})")
    if wrong:
        raise ValueError(f"a {family} config.json cannot hold this model: {', '.join(wrong)}")


def one_head_size(family: str, block) -> None:
    """Families whose config.json has no head_dim: heads are width / num_heads wide, and
    every query head has its own key and value heads."""
    if block.head_size * block.num_heads != block.width or block.kv_heads != block.num_heads:
        raise ValueError(
            f"a {family} config.json cannot hold head_dim={block.head_size} with "
            f"num_kv_heads={block.kv_heads}: its heads are width / num_heads "
            f"({block.width // block.num_heads}) wide, one key and value head per query head"
        )
