"""A diagram of a model, drawn from its own config: every tensor of one forward pass as a box
with its shape in the article's vocabulary, and arrows for what each is computed from.

One layer is drawn once, as a stack repeated N times ("L." boxes; an encoder-decoder's encoder
is "enc." and its layers "enc.L."). Each box names the tour step it belongs to and the real
tensor it shows (qkv.cache's names, with "{layer}" for the caller to fill: "L{layer}.q"), and
says in one sentence what it computes: the diagram's text alternative. What a family does
differently from the article is drawn, not smoothed over: norms before or after each sub-layer,
positions added to the tokens or turning q and k (rotary) or biasing the scores (T5), keys and
values shared by groups of query heads (Hkv < H), gated MLPs, attention and MLP side by side
(parallel blocks), cross-attention. What cannot be drawn truthfully (latent or linear
attention, output gates) is refused by name.

>>> from qkv.models import DecoderConfig
>>> from qkv.nn import BlockConfig
>>> cfg = DecoderConfig(vocab_size=50, num_layers=2, position="rotary", block=BlockConfig(
...     width=64, num_heads=4, num_kv_heads=2, norm="rmsnorm", mlp="swiglu"))
>>> d = model_diagram(cfg, 9)
>>> d.box("L.q").shape, d.box("L.k").shape
('(B, H, T, D) = (1, 4, 9, 16)', '(B, Hkv, T, D) = (1, 2, 9, 16)')
>>> d.box("L.k_rotary").tensor, d.lit("scaling")
('L{layer}.k', ('L.scores', 'L.weights'))
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from qkv.inspect.diagram_boxes import Box, Drawing
from qkv.models import DecoderConfig, EncoderConfig, EncoderDecoderConfig

# the tour's steps, in the article's order
STEPS = ("tokens", "embeddings", "qkv", "scaling", "heads", "layers", "cross", "training",
         "parallel")  # fmt: skip
NAMES = {"minilm": "MiniLM", "smollm2": "SmolLM2"}  # the embedded models, as people write them


@dataclass(frozen=True)
class Stack:
    """The boxes whose id starts with `prefix` are one layer of `layers` alike ones."""

    prefix: str
    name: str
    layers: int


@dataclass(frozen=True)
class Diagram:
    """A model's boxes in the order the pass computes them, and arrows (from, to) between
    them. `box(id)` one box, `lit(step)` the ids of one tour step's boxes ("parallel" has
    none: every box is computed for all tokens at once), `to_dict()` all of it as JSON."""

    title: str
    boxes: tuple[Box, ...]
    edges: tuple[tuple[str, str], ...]  # (from id, to id): the second is computed from the first
    stacks: tuple[Stack, ...] = ()

    def box(self, id: str) -> Box:
        for box in self.boxes:
            if box.id == id:
                return box
        raise ValueError(f"the diagram has no box {id!r}; it has {', '.join(self.ids)}")

    @property
    def ids(self) -> tuple[str, ...]:
        return tuple(box.id for box in self.boxes)

    def lit(self, step: str) -> tuple[str, ...]:
        """The ids of the boxes of one tour step."""
        if step not in STEPS:
            raise ValueError(f"step must be one of {', '.join(STEPS)}, got {step!r}")
        return tuple(box.id for box in self.boxes if box.step == step)

    def to_dict(self) -> dict:
        return {"title": self.title, "boxes": [asdict(b) for b in self.boxes],
                "edges": [list(e) for e in self.edges],
                "stacks": [asdict(s) for s in self.stacks]}  # fmt: skip


def model_diagram(config, tokens: int, *, batch: int = 1, target: int | None = None) -> Diagram:
    """The diagram of `config` (an EncoderConfig, DecoderConfig or EncoderDecoderConfig, or a
    Pretrained or model holding one) for `batch` texts of `tokens` tokens; an encoder-decoder
    reads `tokens` source tokens (S) and `target` target tokens (T, default `tokens`)."""
    name, family = _names(config)
    config = _config_of(config)
    for what, value in (("tokens", tokens), ("batch", batch), ("target", target or 1)):
        if type(value) is not int or value < 1:
            raise ValueError(f"{what} must be a whole number >= 1, got {value!r}")
    _check_drawable(config)
    d = Drawing(batch, config)
    if isinstance(config, EncoderDecoderConfig):
        encoder, decoder = config.encoder(), config.decoder()
        source = d.stack(encoder, "enc.", ("S", tokens))
        d.stack(decoder, "", ("T", target or tokens), cross=(source, ("S", tokens)))
        kind, stacks = (
            "encoder-decoder",
            (
                Stack("enc.L.", "encoder", encoder.num_layers),
                Stack("L.", "decoder", decoder.num_layers),
            ),
        )
        layers = f"{encoder.num_layers} + {decoder.num_layers} layers"
    else:
        d.stack(config, "", ("T", tokens))
        kind = "decoder" if isinstance(config, DecoderConfig) else "encoder"
        stacks, layers = (Stack("L.", kind, config.num_layers),), f"{config.num_layers} layers"
    block = config.block
    heads = f"{block.num_heads} heads of {block.head_size}"
    if block.kv_heads != block.num_heads:
        kv = f"{block.kv_heads} key/value head" + "s" * (block.kv_heads > 1)
        heads = f"{block.num_heads} query heads of {block.head_size} sharing {kv}"
    about = f"{family} {kind}" if family else kind
    title = f"{name} ({about})" if name else about[0].upper() + about[1:]
    return Diagram(f"{title}: {layers}, {heads}, width {block.width}", tuple(d.boxes),
                   tuple(d.edges), stacks)  # fmt: skip


def _names(thing) -> tuple[str | None, str | None]:
    """(the model's name, its family's) where `thing` is a Pretrained; (None, None) otherwise."""
    source, family = getattr(thing, "source", None), getattr(thing, "family", None)
    if source is None or family is None:
        return None, None
    family = getattr(family, "name", str(family))
    return NAMES.get(str(source), str(source)), family.upper() if family == "bert" else family


def _config_of(thing):
    if isinstance(thing, EncoderConfig | DecoderConfig | EncoderDecoderConfig):
        return thing
    for path in (("config",), ("model", "config")):
        found = thing
        for attribute in path:
            found = getattr(found, attribute, None)
        if isinstance(found, EncoderConfig | DecoderConfig | EncoderDecoderConfig):
            return found
    raise ValueError(f"model_diagram draws an EncoderConfig, DecoderConfig or "
                     f"EncoderDecoderConfig (or a Pretrained or model holding one), got "
                     f"{type(thing).__name__}")  # fmt: skip


def _check_drawable(config) -> None:
    """Refuse, by name, what one drawn layer of softmax heads would show wrongly."""
    if type(config) not in (EncoderConfig, DecoderConfig, EncoderDecoderConfig):
        raise ValueError(f"the diagram does not draw {type(config).__name__}: its layers "
                         "(shared keys, compressed keys, hyper-connections) are not one "
                         "repeated block of softmax heads")  # fmt: skip
    block = config.block
    refused = [(block.latent is not None, "latent attention (keys and values from one "
                "compressed vector per token)"),
               (block.linear is not None, "linear attention (a running memory, no softmax)"),
               (block.output_gate, "an output gate on the heads")]  # fmt: skip
    for found, what in refused:
        if found:
            raise ValueError(f"the diagram does not draw {what}; it draws softmax attention in "
                             "sequential blocks")  # fmt: skip


__all__ = ["STEPS", "Box", "Diagram", "Stack", "model_diagram"]
