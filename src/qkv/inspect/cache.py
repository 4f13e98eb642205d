"""Every activation of one forward pass, by name, and the gradient of a metric by each.

`cache(pretrained, text)` runs a decoder once with every layer's record and every block's input
(`model(ids, layers="all", hidden_states=True)`, the low-level door it reads) and names what the
pass computed: the residual stream before, between and after each block's attention and MLP,
each head's queries, keys, values, scores, weights and output, what attention and the MLP
added to the stream, the final norm's output and the logits (docs/cache.md lists every name
and TransformerLens's name for it). `grad=metric` adds d metric / d activation for each, from
one real backward pass through the model: the record's tensors are the ones the pass used, so
autograd reaches them; the few a block never holds apart (the norms' outputs, the weights) get
theirs by the chain rule from the ones it does. The model's parameters get no `.grad`.

>>> import qkv
>>> found = qkv.cache(qkv.load("smollm2"), "When Mary and John went", grad="diff: Mary, John")
>>> found["L3.q"].shape, found.grad("weights", 3).shape
(torch.Size([1, 9, 5, 64]), torch.Size([1, 9, 5, 5]))
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from qkv.attention.eager import compute_dtype
from qkv.inspect.metrics import Metric
from qkv.inspect.prompts import padded, texts_of
from qkv.inspect.residual import check_walkable
from qkv.inspect.runs import stack_of
from qkv.models import Decoder
from qkv.nn.attention import MultiHeadAttention, l2_norm
from qkv.nn.head_edits import per_query_head

# every layer's names, in the order the pass makes them, and the stack's own
KINDS = ("resid_pre", "attn_in", "q_before_rotary", "k_before_rotary", "q", "k", "v", "scores",
         "weights", "z", "attn_out", "resid_mid", "mlp_in", "mlp_out", "resid_post")  # fmt: skip
GLOBAL = ("embed", "final", "logits")


def check_cacheable(stack, source: str, what: str) -> None:
    """Refuse, by name, a stack whose pass is not one stream of sequential pre-norm blocks of
    softmax heads: where the names (resid_mid above all) would not mean what they say."""
    if not isinstance(stack, Decoder):
        raise ValueError(f"{what} reads a decoder's next-token logits; {source} is an encoder")
    check_walkable(stack, source, what)
    if stack.config.cross_attention:
        raise ValueError(f"{what} reads self-attention blocks; {source}'s blocks also attend to an "
                         "encoder (cross-attention), which is not in its names")  # fmt: skip
    for layer, block in enumerate(stack.blocks):
        attn = block.attn
        if not isinstance(attn, MultiHeadAttention):
            raise ValueError(
                f"{what} reads softmax heads with their own q, k and v; {source}'s layer {layer} "
                f"is {type(attn).__name__} (latent attention's heads share one compressed "
                "vector, linear attention keeps a running memory): not supported"
            )
        if attn.gate is not None:
            raise ValueError(
                f"{what}: {source}'s layer {layer} gates its heads' outputs by a "
                "sigmoid of its input (an output gate), which is not supported"
            )
        if block.position != "pre" or block.parallel:
            how = "in parallel" if block.parallel else f"with {block.position}-norm"
            raise ValueError(
                f"{what} names the stream between attention and the MLP (resid_mid); "
                f"{source}'s blocks run {how}: only sequential pre-norm blocks (GPT-2, Llama) "
                "are supported"
            )


@dataclass(repr=False)
class Cache:
    """The activations of one pass over `texts` (right-padded to the longest, `lengths` real
    tokens each), by name: `cache["L3.q"]` or `cache["q", 3]`; `grad(name)` the gradient of
    `metric` (summed over the rows, each read at its last real token: a row's gradient is its
    own). Names: docs/cache.md; `names` lists those kept.

    Shapes: B texts, T the longest, C width, H query heads, Hkv key/value heads, D head size.
    (B, T, C): embed, L{l}.resid_pre, .attn_in, .attn_out, .resid_mid, .mlp_in, .mlp_out,
    .resid_post, final; (B, H, T, D): .q, .q_before_rotary, .z; (B, Hkv, T, D): .k,
    .k_before_rotary, .v; (B, H, T, T): .scores, .weights; (B, T, vocab): logits.
    """

    source: str
    texts: list[str]
    tokens: list[list[str]]
    lengths: Tensor  # (B,)
    values: dict[str, Tensor]
    grads: dict[str, Tensor] = field(default_factory=dict)
    metric: Metric | None = None
    score: Tensor | None = None  # (B,) float64: the metric of each row
    _stack: Decoder | None = None

    @property
    def names(self) -> list[str]:
        return list(self.values)

    def __getitem__(self, key) -> Tensor:
        return self.values[self._name(key)]

    def __contains__(self, key) -> bool:
        return self._name(key, check=False) in self.values

    def grad(self, name, layer: int | None = None) -> Tensor:
        """d metric / d activation, the activation's shape; `grad("q", 3)` is `grad("L3.q")`."""
        if not self.grads:
            raise ValueError("this cache was made without a metric: pass grad=metric to qkv.cache")
        return self.grads[self._name(name if layer is None else (name, layer))]

    def result(self, layer: int) -> Tensor:
        """(B, H, T, C): each head's output projected by its slice of W_O, what it adds to the
        stream (TransformerLens's hook_result; their sum over heads plus the output bias is
        attn_out). Made from L{layer}.z, not kept."""
        z = self[f"L{layer}.z"]  # (B, H, T, D)
        assert self._stack is not None
        weight = self._stack.blocks[layer].attn.out.weight  # (C, H*D)
        per_head = weight.view(weight.shape[0], z.shape[1], z.shape[3])  # (C, H, D)
        with torch.no_grad():  # W_O is a parameter: no graph
            return torch.einsum("bhtd,chd->bhtc", z, per_head.to(z.dtype))  # (B, H, T, C)

    def _name(self, key, check: bool = True) -> str:
        if isinstance(key, tuple) and len(key) == 2:
            kind, layer = key
            key = f"L{layer}.{kind}"
        if check and key not in self.values:
            shown = ", ".join(self.names[:12]) + (", …" if len(self.values) > 12 else "")
            raise KeyError(f"no activation named {key!r} in this cache; it keeps {shown} "
                           "(docs/cache.md lists every name)")  # fmt: skip
        return key

    def __repr__(self) -> str:
        B, T = len(self.texts), int(self.lengths.max())
        grads = f", grads of {self.metric}" if self.grads else ""
        return (f"Cache({self.source}, {B} text{'s' * (B != 1)} of up to {T} tokens, "
                f"{len(self.values)} activations{grads})")  # fmt: skip


def cache_names(num_layers: int, names: Sequence[str] | None = None,
                layers: Sequence[int] | None = None) -> list[str]:  # fmt: skip
    """The names asked for, in the pass's order: every one for None; an entry is a full name
    ("L3.q", "embed") or a kind ("q": every layer's, or `layers`' only)."""
    chosen = list(range(num_layers)) if layers is None else list(layers)
    for layer in chosen:
        if type(layer) is not int or not 0 <= layer < num_layers:
            raise ValueError(f"layer {layer!r} is out of range: layers 0..{num_layers - 1}")
    every = ["embed"] + [f"L{n}.{kind}" for n in chosen for kind in KINDS] + ["final", "logits"]
    if names is None:
        return every
    if isinstance(names, str):
        names = [names]
    wanted = set()
    for name in names:
        if name in KINDS:
            wanted |= {f"L{n}.{name}" for n in chosen}
        elif name in GLOBAL or _full_name(name, num_layers):
            wanted.add(name)
        else:
            raise ValueError(f"no activation is named {name!r}: give a kind ({', '.join(KINDS)}), "
                             f"one of {', '.join(GLOBAL)}, or a full name such as "
                             f"'L0.q' (docs/cache.md)")  # fmt: skip
    full = ["embed"] + [f"L{n}.{kind}" for n in range(num_layers) for kind in KINDS]
    return [name for name in [*full, "final", "logits"] if name in wanted]


def _full_name(name: str, num_layers: int) -> bool:
    layer, _, kind = name.partition(".")
    if kind not in KINDS or not layer.startswith("L") or not layer[1:].isdigit():
        return False
    if int(layer[1:]) >= num_layers:
        raise ValueError(f"{name}: layer {layer[1:]} is out of range: layers 0..{num_layers - 1}")
    return True


def cache(pretrained, text, *, grad=None, names: Sequence[str] | None = None,
          layers: Sequence[int] | None = None) -> Cache:  # fmt: skip
    """Every activation of one forward pass over `text` (a text or a list of texts, run as one
    right-padded batch), and with `grad` (a metric: "diff: Mary, John", "prob: Paris",
    "logprob: Paris", a function of the logits) the gradient of the metric at each text's last
    token by each. `names` (full names or kinds) and `layers` keep fewer: every layer's
    weights (B, H, T, T) is what makes a full cache large.

    >>> found = cache(pretrained, "the bank of the river", names=["z", "logits"])  # doctest: +SKIP
    >>> found["L0.z"].shape  # (B, H, T, D)  # doctest: +SKIP
    """
    stack = stack_of(pretrained)
    check_cacheable(stack, pretrained.source, "qkv.cache")
    wanted = cache_names(stack.config.num_layers, names, layers)
    metric = None if grad is None else Metric.parse(grad)
    if metric is not None and metric.needs_clean:
        raise ValueError(
            "qkv.cache runs one text once: 'kl' compares two runs (and is 0 at its "
            "own); give 'diff: A, B', 'prob: A', 'logprob: A' or a function"
        )
    metric_ids = None if metric is None else metric.ids(pretrained.tokenizer)
    texts = texts_of(text, "text")
    encoded = [pretrained.encode(t) for t in texts]
    ids, lengths = padded([e.ids for e in encoded])  # (B, T), (B,)
    with torch.enable_grad() if metric is not None else torch.no_grad():
        out = stack(ids, layers="all", hidden_states=True)
        graph = graph_tensors(out, stack.config.num_layers)
        score = None
        if metric is not None:
            last = out.logits[torch.arange(len(texts)), lengths - 1]  # (B, vocab)
            score = metric.score(last, metric_ids)  # (B,)
    if names is None:  # every name this model has: no scores where they are not q k^T alone
        wanted = [name for name in wanted if _has(name, out.records)]
    with torch.no_grad():
        values = {name: _value(name, out, graph, stack).detach() for name in wanted}
    grads = {} if score is None else gradients(score.sum(), out, graph, stack, wanted)
    return Cache(
        source=pretrained.source, texts=texts, tokens=[list(e.tokens) for e in encoded],
        lengths=lengths, values=values, grads=grads, metric=metric,
        score=None if score is None else score.detach(), _stack=stack,
    )  # fmt: skip


def graph_tensors(out, num_layers: int) -> dict[str, Tensor]:
    """The names whose tensors the pass itself used (autograd reaches them)."""
    states = out.hidden_states  # L + 1 tensors (B, T, C)
    found = {"embed": states[0], "final": out.hidden}
    if out.logits is not None:
        found["logits"] = out.logits
    for n in range(num_layers):
        record = out.records[n]
        found |= {
            f"L{n}.resid_pre": states[n], f"L{n}.q": record.q, f"L{n}.k": record.k,
            f"L{n}.v": record.v, f"L{n}.z": record.out, f"L{n}.attn_out": record.attn_out,
            f"L{n}.mlp_out": record.mlp_out, f"L{n}.resid_post": states[n + 1],
        }  # fmt: skip
        if record.q_before_rotary is not None:
            found[f"L{n}.q_before_rotary"] = record.q_before_rotary
            found[f"L{n}.k_before_rotary"] = record.k_before_rotary
    return found


def _has(name: str, records) -> bool:
    layer, _, kind = name.partition(".")
    if kind in ("q_before_rotary", "k_before_rotary"):
        return records[int(layer[1:])].q_before_rotary is not None
    return kind != "scores" or not _variants(records[int(layer[1:])])


def _variants(record) -> list[str]:
    names = ("softcap", "bias", "sinks", "query_scale")
    return [name for name in names if getattr(record, name) is not None]


def _value(name: str, out, graph: dict[str, Tensor], stack) -> Tensor:
    if name in graph:
        return graph[name]
    layer, _, kind = name.partition(".")
    n = int(layer[1:])
    block, record = stack.blocks[n], out.records[n]
    if kind in ("q_before_rotary", "k_before_rotary"):
        raise ValueError(f"{name}: layer {n} has no rotary positions; its q and k are L{n}.q "
                         f"and L{n}.k")  # fmt: skip
    if kind == "attn_in":
        return block.attn_norm(graph[f"L{n}.resid_pre"])  # (B, T, C), the block's own arithmetic
    if kind == "resid_mid":
        return graph[f"L{n}.resid_pre"] + record.attn_out  # (B, T, C)
    if kind == "mlp_in":
        return block.mlp_norm(_value(f"L{n}.resid_mid", out, graph, stack))
    if kind == "weights":
        return record.weights()  # (B, H, T, T)
    return _scores(record, name)  # (B, H, T, T)


def _scores(record, name: str) -> Tensor:
    """q k^T times the scale, -inf where a query did not see a key (TransformerLens's
    hook_attn_scores): plain softmax scores only."""
    if variants := _variants(record):
        layer = name.partition(".")[0]
        raise ValueError(
            f"{name}: this layer's scores have {', '.join(variants)} on top of q "
            f"k^T; its weights ({layer}.weights) are kept, its scores are not"
        )
    k = per_query_head(record.k, record.q.shape[1])  # (B, H, Tk, D)
    dtype = compute_dtype(record.q.dtype)  # the weights' (float32, float64 for float64)
    scores = (record.q @ k.transpose(-1, -2)).to(dtype) * record.scale  # (B, H, Tq, Tk)
    return scores.masked_fill(~record.allowed, float("-inf"))


def gradients(total: Tensor, out, graph: dict[str, Tensor], stack,
              wanted: list[str]) -> dict[str, Tensor]:  # fmt: skip
    """d total / d each wanted name, from one backward pass (autograd.grad: no parameter's
    .grad is written) and the chain rule inside a block for the names it never holds apart."""
    needed = set()
    for name in wanted:
        needed |= _needs(name)
    inputs = [name for name in graph if name in needed]
    found = torch.autograd.grad(total, [graph[n] for n in inputs], allow_unused=True)
    grads = {
        name: torch.zeros_like(graph[name]) if g is None else g
        for name, g in zip(inputs, found, strict=True)
    }
    for name in wanted:
        if name not in grads:
            grads[name] = _derived_grad(name, grads, out, stack)
    return {name: grads[name].detach() for name in wanted}


def _needs(name: str) -> set[str]:
    """The graph tensors whose gradients give `name`'s."""
    layer, _, kind = name.partition(".")
    if kind in ("weights", "scores"):
        return {f"{layer}.z"}
    if kind == "resid_mid":  # resid_mid = resid_pre + attn_out: attn_out's gradient is its own
        return {f"{layer}.attn_out"}
    if kind == "mlp_in":
        return {f"{layer}.mlp_out"}
    if kind == "attn_in":
        return {f"{layer}.{k}" for k in ("q_before_rotary", "k_before_rotary", "q", "k", "v")}
    return {name}


def _derived_grad(name: str, grads: dict[str, Tensor], out, stack) -> Tensor:
    layer, _, kind = name.partition(".")
    n = int(layer[1:])
    block, record = stack.blocks[n], out.records[n]
    if kind == "resid_mid":
        return grads[f"{layer}.attn_out"]
    g_z = grads[f"{layer}.z"]  # (B, H, T, D)
    if kind in ("weights", "scores"):  # out = weights @ v, head by head
        v = per_query_head(record.v, g_z.shape[1]).detach()  # (B, H, Tk, D)
        dtype = compute_dtype(g_z.dtype)  # the weights' own
        g_weights = (g_z @ v.transpose(-1, -2)).to(dtype)  # (B, H, Tq, Tk)
        if kind == "weights":
            return g_weights
        weights = record.weights().detach()  # softmax's backward
        return weights * (g_weights - (g_weights * weights).sum(-1, keepdim=True))
    with torch.enable_grad():
        if kind == "mlp_in":  # the MLP (and its out-norm) again, from a leaf
            resid_mid = out.hidden_states[n] + record.attn_out  # (B, T, C)
            leaf = block.mlp_norm(resid_mid).detach().requires_grad_(True)
            mlp = block._mlp(leaf, False)[0]  # (B, T, C)
            if block.mlp_out_norm is not None:
                mlp = block.mlp_out_norm(mlp)
            return torch.autograd.grad(mlp, leaf, grads[f"{layer}.mlp_out"])[0]
        return _attn_in_grad(block.attn, block.attn_norm(out.hidden_states[n]).detach(),
                             record, grads, layer)  # fmt: skip


def _attn_in_grad(attn, attn_in: Tensor, record, grads: dict[str, Tensor], layer: str) -> Tensor:
    """d total / d the attention's input (its norm's output): its q, k and v made again from a
    leaf, by the layer's own arithmetic, and their gradients carried back."""
    leaf = attn_in.requires_grad_(True)
    keys, values = attn.keys_values(leaf)  # (B, T, Hkv*D) each
    q, k = attn._normed(attn.queries(leaf), keys)  # (B, H, T, D), (B, Hkv, T, D)
    v = attn.split_heads(values, attn.num_kv_heads)
    if record.q_before_rotary is not None:
        wanted = [grads[f"{layer}.q_before_rotary"], grads[f"{layer}.k_before_rotary"]]
    else:  # without rotary the record's q and k are these (after an L2 QK-norm where one is)
        if attn.qk_norm == "l2":
            q, k = l2_norm(q, attn.norm_eps), l2_norm(k, attn.norm_eps)
        wanted = [grads[f"{layer}.q"], grads[f"{layer}.k"]]
    return torch.autograd.grad([q, k, v], leaf, [*wanted, grads[f"{layer}.v"]])[0]
