"""The models this server holds: loaded once at start-up, read-only, shared by every request.

(Named `held`, not `models`, so that it is never read as `qkv.models`, the model classes: what
lives here is the server's own record of each model it was given, by the name requests use.)

Concurrency, and why: a forward pass under `torch.inference_mode` reads the weights and
writes only tensors of its own, and everything the server shows about attention (weights,
traces, contributions, probes) is read from the records that forward pass returns, not
from hooks on the model. So every request runs on one model at once, with no lock.

Generation is the one thing served in turn: it keeps a KV cache of its own and runs one
step after another for seconds, and two generations on two cores would each go at half
speed while a queue of them held every worker. The server runs one generation per model at
a time (`generation_lock`, asyncio's lock awaited before any worker thread is taken); the
other requests go on beside it.
"""

from __future__ import annotations

import asyncio
import weakref
from dataclasses import dataclass, field

from qkv.attention.inputs import check_indices
from qkv.inspect.layer_heads import check_heads, check_layer_head, heads_per_layer
from qkv.models import Decoder, Encoder
from qkv.serve.long_reading import read
from qkv.serve.long_texts import LongTexts


@dataclass
class Served:
    """One model of the server: the loaded model, its name in requests, its generation lock,
    its long texts (`qkv.serve.long_texts`)."""

    name: str
    pretrained: object  # qkv.Pretrained
    _generating: weakref.WeakKeyDictionary = field(default_factory=weakref.WeakKeyDictionary)
    long: LongTexts = field(default_factory=lambda: LongTexts(read))

    def generation_lock(self) -> asyncio.Lock:
        """This model's generation lock in the running event loop (an asyncio lock belongs to
        one loop; a server has one, a test may start several)."""
        loop = asyncio.get_running_loop()
        if loop not in self._generating:
            self._generating[loop] = asyncio.Lock()
        return self._generating[loop]

    @property
    def decoder(self) -> bool:
        return isinstance(self.pretrained.model, Decoder)

    def describe(self) -> dict:
        """What the page and clients need to know to ask about this model."""
        config = self.pretrained.config
        block = config.block
        counts = heads_per_layer(self.pretrained.model)
        return {
            "name": self.name,
            "kind": "decoder" if self.decoder else "encoder",
            "family": self.pretrained.family.name,
            "num_layers": config.num_layers,
            "num_heads": max(counts),  # the most a layer has
            # each layer's own count: Qwen3.5's linear layers have more heads than its full ones
            "heads_per_layer": counts,
            "num_kv_heads": block.kv_heads,
            "head_dim": block.head_dim or block.width // block.num_heads,
            "width": block.width,
            "context_window": self.pretrained.context_window,
            "generates": self.decoder,
        }

    def choose(self, name: str, values) -> list[int]:
        """The layers or heads ("layer" or "head") asked for, None for every one, counted from
        0: `check_indices`, whose ValueError names the range or the repeat."""
        config = self.pretrained.config
        if name == "layer":
            return check_indices(name, values, config.num_layers, self.name)
        return check_indices(name, values, max(heads_per_layer(self.pretrained.model)), self.name)

    def check_index(self, name: str, value: int) -> None:
        """ValueError naming the range when a layer or head is out of it (counted from 0)."""
        self.choose(name, [value])

    def choose_heads(self, heads, layers: list[int]) -> list[int]:
        """The heads asked of `layers` (None: every head of the layer with most), each one
        that some layer asked has; a head none has is refused naming a layer's count."""
        return check_heads(heads, layers, heads_per_layer(self.pretrained.model), self.name)

    def own_heads(self, heads: list[int], layer: int) -> list[int]:
        """Of `heads`, those `layer` has."""
        return [h for h in heads if h < heads_per_layer(self.pretrained.model)[layer]]

    def check_pair(self, layer: int, head: int) -> None:
        """ValueError naming the layer's own count when `head` is not one of its heads."""
        check_layer_head(layer, head, heads_per_layer(self.pretrained.model), self.name)


def served_models(models: dict) -> dict[str, Served]:
    """Check the models given to `create_app`: a name -> Pretrained dict of encoders and
    decoders (an encoder-decoder's page would be its cross-attention, which this is not)."""
    if not models:
        raise ValueError("give the server one model at least, e.g. {'minilm': qkv.load('minilm')}")
    out = {}
    for name, pretrained in models.items():
        if not isinstance(name, str) or not name.strip():
            raise ValueError(f"a served model's name is a non-empty string, not {name!r}")
        if not isinstance(getattr(pretrained, "model", None), Encoder | Decoder):
            kind = type(getattr(pretrained, "model", pretrained)).__name__
            raise ValueError(f"qkv serve shows encoders and decoders; {name} is a {kind}")
        out[name] = Served(name, pretrained)
    return out
