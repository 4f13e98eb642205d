"""What `generate` records for the page of attention while generating (`qkv generate
--attention FILE.html`), every choice checked before any token is made: the layers and heads
in range, what they keep within the library's and the page's limits."""

from __future__ import annotations

from qkv.attention.index_text import parse_indices
from qkv.inspect.generation import Recording, check_recording_size
from qkv.inspect.layer_heads import heads_per_layer
from qkv.models import Decoder
from qkv.viz.generation import check_page_size


def page_recording(
    pretrained,
    prompt: str,
    *,
    layers: str | None,
    heads: str | None,
    name: str,
    chat: bool,
    system: str | None,
    new: int,
) -> Recording:
    """generate's `record` for a page of `new` generated tokens after `prompt` (wrapped in
    the chat template with `system` when `chat`), from a `Pretrained` decoder called `name`;
    layers, heads: as written on the command line ('0,2,5', '0-3'; all if None)."""
    if not isinstance(pretrained.model, Decoder):
        raise ValueError(f"--attention shows a decoder's self-attention; {name} is not a decoder")
    L, counts = len(pretrained.model.blocks), heads_per_layer(pretrained.model)
    recording = Recording(parse_indices(layers, "layers", L, name) or "all",
                          parse_indices(heads, "heads", max(counts), name))  # fmt: skip
    kept_layers, kept_heads = recording.resolve(L, counts, name)  # each layer's own count
    text = pretrained.chat_prompt(prompt, system) if chat else prompt
    P = len(pretrained.tokenizer.encode(text, add_special_tokens=not chat).ids)
    check_recording_size(len(kept_layers), len(kept_heads), P, new)
    check_page_size(len(kept_layers), len(kept_heads), P, new)
    return recording
