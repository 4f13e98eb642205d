"""The models a server holds: loaded once at start-up, read-only, shared by every request.

Concurrency, and why: a plain forward pass under `torch.inference_mode` reads the weights
and writes only tensors of its own, so several requests run forwards on one model at once
(attention, next-token probabilities, probes). Two things are not like that:

- `qkv.trace` registers forward hooks on the model's attention modules for the length of
  its forward pass; any other forward on that model meanwhile would run through those hooks
  and overwrite what the trace keeps. A trace therefore holds the model alone (`exclusive`).
- generation keeps a KV cache and runs one step after another for seconds. Its cache is its
  own, but the server runs one generation per model at a time (`generation_lock`, asyncio's
  lock awaited before any worker thread is taken): two generations on two cores would each
  go at half speed, and a queue of them would hold every worker. Between steps it lets a
  waiting trace go first (`Guard.pause`), so a trace waits one step, not a whole generation.
"""

from __future__ import annotations

import asyncio
import threading
import weakref
from contextlib import contextmanager
from dataclasses import dataclass, field

from qkv.models import Decoder, Encoder


class Guard:
    """A readers-writer lock: many `shared` holders, or one `exclusive` holder.

    A waiting writer is let in before new readers, so a trace is not starved by a stream
    of attention requests.
    """

    def __init__(self):
        self._lock = threading.Condition()
        self._readers = 0
        self._writing = False
        self._writers_waiting = 0

    @contextmanager
    def shared(self):
        with self._lock:
            while self._writing or self._writers_waiting:
                self._lock.wait()
            self._readers += 1
        try:
            yield
        finally:
            self._release_shared()

    @contextmanager
    def exclusive(self):
        with self._lock:
            self._writers_waiting += 1
            try:
                while self._writing or self._readers:
                    self._lock.wait()
            finally:
                self._writers_waiting -= 1
            self._writing = True
        try:
            yield
        finally:
            with self._lock:
                self._writing = False
                self._lock.notify_all()

    def pause(self) -> None:
        """Called by a shared holder between two steps: a waiting writer goes first."""
        with self._lock:
            if not self._writers_waiting:
                return
        self._release_shared()
        with self._lock:
            while self._writing or self._writers_waiting:
                self._lock.wait()
            self._readers += 1

    def _release_shared(self) -> None:
        with self._lock:
            self._readers -= 1
            if not self._readers:
                self._lock.notify_all()


@dataclass
class Served:
    """One model of the server: the loaded model, its name in requests, and its locks."""

    name: str
    pretrained: object  # qkv.Pretrained
    guard: Guard = field(default_factory=Guard)
    _generating: weakref.WeakKeyDictionary = field(default_factory=weakref.WeakKeyDictionary)

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
        return {
            "name": self.name,
            "kind": "decoder" if self.decoder else "encoder",
            "family": self.pretrained.family.name,
            "layers": config.num_layers,
            "heads": block.num_heads,
            "kv_heads": getattr(block, "num_kv_heads", None) or block.num_heads,
            "head_dim": block.head_dim or block.width // block.num_heads,
            "width": block.width,
            "context_window": self.pretrained.context_window,
            "generates": self.decoder,
        }

    def check_index(self, name: str, value: int) -> None:
        """ValueError naming the range when a layer or head is out of it (counted from 0)."""
        config = self.pretrained.config
        most = config.num_layers if name == "layer" else config.block.num_heads
        if not 0 <= value < most:
            raise ValueError(
                f"{name} {value} is out of range: {self.name} has {most} {name}s (0-{most - 1})"
            )


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
