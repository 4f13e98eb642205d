"""A transformers model seen through qkv's inspection: `Attentions`, `qkv.trace`, the page.

qkv's inspection reads records (`AttentionRecord`), never a model's modules: so a model that
transformers loads and runs on qkv's attention (`attn_implementation="qkv"`) can be looked
into as qkv's own models are. `inspect(model, tokenizer)` wraps the two in an `Inspected`,
which offers what those functions ask of a model: its tokens (`encode`), one forward pass's
records (`attentions`) and, for a trace's contributions, each layer's output projection.

    seen = inspect(model, tokenizer).attentions("The bank of the river")
    seen.weights.shape  # (L, H, T, T): (30, 9, 6, 6) for SmolLM2
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
from torch import Tensor, nn
from transformers import AutoModel, AutoTokenizer

from qkv.attention.inputs import check_indices
from qkv.hf.backend import NAME, check, keep
from qkv.inspect.attentions import Attentions, check_weights_option
from qkv.inspect.trace import Layout, trace
from qkv.io.tokenizer import Tokenizer
from qkv.io.words import Encoded
from qkv.viz.page import write_attention_page
from qkv.viz.paths import html_path

# where transformers' attention modules keep their output projection, (C, H * D) as a Linear
OUTPUT_PROJECTIONS = ("o_proj", "out_proj", "dense", "c_proj")


class Inspected:
    """A transformers model (loaded with attn_implementation="qkv", in eval mode) and its fast
    tokenizer, with what `qkv.trace`, `qkv show`, the page and the notebook views read of a
    model."""

    def __init__(self, model: nn.Module, tokenizer, *, source: str | None = None):
        check(model)
        if getattr(model.config, "is_encoder_decoder", False):
            raise ValueError(
                f"qkv.hf inspects encoders and decoders; {type(model).__name__} is an "
                "encoder-decoder (qkv.load reads BART, Marian and T5 itself)"
            )
        if not getattr(tokenizer, "is_fast", False):
            raise ValueError(
                f"{type(tokenizer).__name__} is not a fast tokenizer: qkv needs its character "
                "offsets to find words (load it with AutoTokenizer, use_fast=True)"
            )
        if model.training:
            raise ValueError(
                f"{type(model).__name__} is in training mode (its dropout on); call model.eval() "
                "before inspecting it"
            )
        self.model, self.tokenizer = model, tokenizer
        self.config = model.config.get_text_config()
        self.source = source or getattr(model.config, "_name_or_path", "") or type(model).__name__
        self._modules: dict[int, nn.Module] = {}  # layer -> attention module, from a forward

    def __repr__(self) -> str:
        return f"Inspected({self.source!r}, {type(self.model).__name__})"

    @property
    def num_layers(self) -> int:
        return self.config.num_hidden_layers

    @property
    def num_heads(self) -> int:
        return self.config.num_attention_heads

    @property
    def context_window(self) -> int:
        """How many tokens the model reads at once (its max_position_embeddings)."""
        return getattr(self.config, "max_position_embeddings", None) or 2**31

    def encode(self, text: str) -> Encoded:
        """The tokens of one text, with the model's own special tokens, as qkv's `Encoded`
        (offsets and words: what lets a user name "bank#2"; pieces: each token's text as its
        decoder writes it, what pages show)."""
        if not isinstance(text, str) or not text.strip():
            raise ValueError("the text is empty; give a sentence")
        found = self.tokenizer(text, return_offsets_mapping=True, return_special_tokens_mask=True)
        ids = list(found["input_ids"])
        if len(ids) > self.context_window:
            raise ValueError(
                f"the text has {len(ids)} tokens; {self.source} reads at most {self.context_window}"
            )
        special_ids = set(self.tokenizer.all_special_ids)
        special = [bool(m) or i in special_ids
                   for i, m in zip(ids, found["special_tokens_mask"], strict=True)]  # fmt: skip
        return Encoded(ids=ids, tokens=self.tokenizer.convert_ids_to_tokens(ids),
                       offsets=[tuple(o) for o in found["offset_mapping"]], text=text,
                       special=special, word_ids=found.word_ids(),
                       pieces=Tokenizer(self.tokenizer.backend_tokenizer).pieces(ids))  # fmt: skip

    def attentions(
        self,
        text: str,
        *,
        target: str | None = None,
        layers: Sequence[int] | str | None = "all",
        heads: Sequence[int] | None = None,
        weights: bool | None = None,
    ) -> Attentions:
        """One forward pass over `text`, its layers' records: qkv's `Attentions`, whose
        `weights` (L', H', T, T) are computed from the records when first read. layers
        ("all" by default) and heads (all by default), counted from 0. weights: taken as
        `Pretrained.attentions` takes it; here the records are all that is kept."""
        check_weights_option(weights)
        if target is not None:
            raise ValueError(f"a target text is for encoder-decoder models; {self.source} is not")
        heads = check_indices("head", heads, self.num_heads, self.source)  # layers: by `keep`
        encoded = self.encode(text)
        ids = torch.tensor([encoded.ids], device=_device(self.model))  # (1, T)
        base = getattr(self.model, "base_model", self.model)  # no LM head: only records
        with torch.inference_mode(), keep(self.model, layers=layers, records=True) as kept:
            base(input_ids=ids)
        missing = sorted(set(kept.layers) - set(kept.records))
        if missing:
            raise ValueError(
                f"layer {missing[0]} of {self.source} made no qkv attention call; its "
                "attention does not go through qkv"
            )
        self._modules.update(kept.modules)
        return Attentions(dict(kept.records), list(encoded.tokens), encoded, heads)

    def trace(self, text: str, query: str, key: str, **options):
        """`qkv.trace` of this model: the article's steps for `query` getting context from
        `key` in `text` (options as `trace` takes them: layer, head, attentions)."""
        return trace(self, text, query, key, **options)

    def attention_layout(self):
        """What `qkv.trace` reads of the model beside its records (`qkv.inspect.trace.Layout`):
        its sizes, and each layer's output projection, found in transformers' attention
        module (o_proj, out_proj, dense or c_proj); a family that keeps it elsewhere is
        refused by name when a trace needs it."""
        return Layout(num_layers=self.num_layers, num_heads=self.num_heads,
                      width=self.config.hidden_size, cross=False,
                      out_weight=self._out_weight, anatomy=lambda layer: None)  # fmt: skip

    def _out_weight(self, layer: int) -> Tensor:
        """Layer `layer`'s output projection (C, H * D): column block h is head h's."""
        module = self._modules.get(layer)
        if module is None:
            raise ValueError(f"layer {layer} has not run yet; call attentions(text) first")
        for name in OUTPUT_PROJECTIONS:
            projection = getattr(module, name, None)
            if isinstance(projection, nn.Linear):
                return projection.weight
            if type(projection).__name__ == "Conv1D":  # GPT-2's: the weight is (in, out)
                return projection.weight.T
        raise ValueError(
            f"a trace needs layer {layer}'s output projection, and {type(module).__name__} holds "
            f"none of {', '.join(OUTPUT_PROJECTIONS)}: this family keeps it elsewhere"
        )

    def write_page(self, text: str, path: str | Path, **options) -> Path:
        """The interactive page of `qkv show` for `text`, with a clicked pair's steps redone
        from the records (`qkv.viz.page.write_attention_page`, whose options it takes)."""
        options = {"title": f"{self.source}: {text[:60]}", "text": text, **options}
        return write_attention_page(html_path(path), self.attentions(text), **options)


def inspect(model: nn.Module, tokenizer, *, source: str | None = None) -> Inspected:
    """A transformers model loaded with attn_implementation="qkv", and its (fast) tokenizer,
    ready for qkv's inspection: `.attentions(text)`, `.trace(text, query, key)`, the page."""
    return Inspected(model, tokenizer, source=source)


def load(source: str | Path, *, dtype: str | torch.dtype = "float32") -> Inspected:
    """A model folder or hub id loaded by transformers (`AutoModel`, any family it reads)
    onto qkv's attention, with its tokenizer (`AutoTokenizer`), as an `Inspected`."""
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    model = AutoModel.from_pretrained(source, attn_implementation=NAME, dtype=dtype)
    return Inspected(model, AutoTokenizer.from_pretrained(source), source=str(source))


def _device(model: nn.Module) -> torch.device:
    parameter = next(model.parameters(), None)
    return torch.device("cpu") if parameter is None else parameter.device
