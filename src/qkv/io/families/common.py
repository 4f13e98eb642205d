"""What every family module uses: `Weight`, `Family`, the weight-map template expander, and
the checks that say which config a family can read or write.

A weight map is a list of (qkv name, checkpoint name) templates, litgpt's style: `{}` stands
for the layer index, and `expand` writes one `Weight` per layer. A third element, a layout,
says how a tensor turns between the two (GPT-2's Conv1D stores its matrices transposed).

Where a checkpoint keeps one qkv parameter as several tensors (Mixtral's experts: a gate, up
and down matrix per expert, which qkv stacks into one tensor per layer), the Weight's `parts`
say which tensors and how they join; `expert_weights` writes those of a mixture of experts.
Where it keeps several qkv parameters in one tensor (Qwen3-Next's in_proj_qkvz: each key
head's query, key, value and gate rows side by side), each Weight's `rows` say which rows
are its own.
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


@dataclass(frozen=True)
class Parts:
    """One parameter that a checkpoint keeps as several tensors: `names`, in order; `join`
    makes the parameter from them (given in that order), `split` gives them back from it (in
    that order, each a tensor of its own, not a view of the parameter)."""

    names: tuple[str, ...]
    join: Callable[[list[Tensor]], Tensor]
    split: Callable[[Tensor], list[Tensor]]


@dataclass(frozen=True, eq=False)
class Rows:
    """One parameter that is some rows of a checkpoint tensor it shares with others:
    `index` (n,), the checkpoint rows that make the parameter's rows, in its order; `total`,
    how many rows the checkpoint tensor has. Loading takes those rows (then the layout
    turns them); an export puts every sharing parameter's rows back into one tensor.

    >>> rows = Rows(torch.tensor([2, 0]), 3)
    >>> rows.take(torch.tensor([10, 11, 12])).tolist()
    [12, 10]
    """

    index: Tensor
    total: int

    def __post_init__(self):
        assert self.index.dim() == 1 and int(self.index.max()) < self.total, self

    def take(self, t: Tensor) -> Tensor:
        if t.shape[0] != self.total:
            raise ValueError(f"has {t.shape[0]} rows; the model built from config.json "
                             f"reads {self.total}")  # fmt: skip
        return t[self.index]


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
class Weight:
    """One qkv parameter and where it lives in a checkpoint.

    names: the checkpoint names of the tensor that holds it whole, aliases in the order
    tried; the first is canonical (written on export) unless `parts` is set.
    parts: where the checkpoint keeps it as several tensors (`Parts`): that spelling is
    canonical, tried first and written on export; `names` are then its other, one-tensor
    spellings (transformers' in-memory stacked experts), read too.
    load, save: the layout turn from the checkpoint's tensor (found whole or joined from
    its parts) to qkv's, and back (before the parts are split).
    rows: where the checkpoint tensor holds other parameters too (`Rows`): the rows that are
    this one's, taken before `load` turns them.
    """

    qkv: str
    names: tuple[str, ...]
    load: Callable[[Tensor], Tensor] = _same
    save: Callable[[Tensor], Tensor] = _same
    parts: Parts | None = None
    rows: Rows | None = None

    def __post_init__(self):
        assert self.names or self.parts, f"{self.qkv} has no checkpoint name"
        assert self.rows is None or self.parts is None, f"{self.qkv}: rows of parts"

    @property
    def canonical(self) -> str:
        """The first checkpoint name written on export (for messages)."""
        return self.parts.names[0] if self.parts is not None else self.names[0]


# (qkv template, checkpoint template or several aliases[, layout]); `{}` is the layer index
Template = tuple[str, str | tuple[str, ...]] | tuple[str, str | tuple[str, ...], Layout]


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


def stacked(tensors: list[Tensor]) -> Tensor:
    """E tensors of one shape -> one (E, ...) tensor."""
    return torch.stack(tensors)


def unstacked(stack: Tensor) -> list[Tensor]:
    """(E, ...) -> E tensors, each its own copy (a file may not hold views of one tensor)."""
    return [t.clone() for t in stack.unbind(0)]


def stacked_pairs(tensors: list[Tensor]) -> Tensor:
    """2E tensors (E, I, C)-wise, every expert's first matrix then every expert's second ->
    (E, 2I, C): each expert's first rows above its second (gate above up)."""
    E = len(tensors) // 2
    return torch.cat([stacked(tensors[:E]), stacked(tensors[E:])], dim=1)


def unstacked_pairs(stack: Tensor) -> list[Tensor]:
    """(E, 2I, C) -> every expert's first (I, C) rows, then every expert's second."""
    first, second = stack.chunk(2, dim=1)
    return unstacked(first) + unstacked(second)


def expert_weights(
    qkv: str, num_experts: int, gate: str, up: str, down: str, fused: tuple[str, str] = ("", "")
) -> list[Weight]:
    """The stacked expert tensors of one mixture-of-experts layer (`qkv.nn.experts.MoE`),
    `{qkv}.gate_up` (E, 2I, C) and `{qkv}.down` (E, C, I), from a checkpoint that keeps each
    expert's matrices apart (Mixtral, Qwen3-MoE, DeepSeek-V3): `gate`, `up` and `down` name
    expert e's (I, C), (I, C) and (C, I) matrices, "{e}" standing for e. fused: the names of
    the same stacked tensors held whole ((E, 2I, C), (E, C, I): transformers' in-memory
    gate_up_proj and down_proj), read too; "" for none.

    >>> gate_up, down = expert_weights("blocks.1.mlp", 2, "x.{e}.w1", "x.{e}.w3", "x.{e}.w2")
    >>> gate_up.qkv, gate_up.parts.names, down.parts.names
    ('blocks.1.mlp.gate_up', ('x.0.w1', 'x.1.w1', 'x.0.w3', 'x.1.w3'), ('x.0.w2', 'x.1.w2'))
    """
    experts = range(num_experts)
    gate_up = tuple(name.format(e=e) for name in (gate, up) for e in experts)
    downs = tuple(down.format(e=e) for e in experts)
    return [
        Weight(f"{qkv}.gate_up", tuple(n for n in fused[:1] if n),
               parts=Parts(gate_up, stacked_pairs, unstacked_pairs)),
        Weight(f"{qkv}.down", tuple(n for n in fused[1:] if n),
               parts=Parts(downs, stacked, unstacked)),
    ]  # fmt: skip


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
