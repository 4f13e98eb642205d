"""Sampling from a decoder with a KV cache: one new token per step for every sequence.

The prompt is read in one forward pass that fills the cache; each later step feeds only
the newest token, whose query attends to every cached key. Batches are left-padded so
that every sequence's next token is in the last column.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence

import torch
from torch import Tensor

from qkv import native
from qkv.generate.fast_step import FastStep, fast_step_refusal, head_of
from qkv.generate.native_step import NativeStep, native_step_refusal
from qkv.generate.sampling import Sampling
from qkv.models import Decoder, EncoderDecoder
from qkv.models.decoder import cap_logits
from qkv.nn import AttentionRecord
from qkv.nn.quant_linear import QuantLinear, cores_to_the_kernels

# the longest prompt NativeStep reads in one call (its attention goes a row at a time, as the
# steps', where Decoder.forward's is one product of matrices: a long prompt is faster there)
NATIVE_PROMPT = 128


def decode_steps(
    model: Decoder,
    input_ids: Tensor,
    attention_mask: Tensor | None,
    sampling: Sampling,
    max_new_tokens: int,
    *,
    layers: Sequence[int] | None = None,
    keep: Callable[[dict[int, AttentionRecord]], None] | None = None,
) -> Iterator[Tensor]:
    """Yield the next token of every sequence (B,), max_new_tokens times at most.

    input_ids (B, T) left-padded, attention_mask (B, T) with 1 for real tokens (None when
    nothing is padded). The caller stops iterating when it has what it wants.
    layers, keep: every forward pass (the prompt's, then each fed-back token's) returns the
    records of these layers and hands them to keep(records) before its token is yielded;
    without them the forward passes record nothing.
    """
    if max_new_tokens < 1:
        return
    generator = None
    if sampling.seed is not None:
        generator = torch.Generator(device=input_ids.device).manual_seed(sampling.seed)
    cache = model.new_cache()
    positions = None
    if attention_mask is not None and not bool(attention_mask.all()):
        # each row counts positions from its own first real token
        positions = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)  # (B, T)
    else:
        attention_mask = None  # nothing padded: the faster unmasked path
    # each token after the prompt's through one native call (NativeStep) or FastStep, where they
    # compute what forward does; a short prompt through NativeStep too
    use_fast = keep is None and fast_step_refusal(model, input_ids.device) is None
    native_steps = (
        use_fast and native_step_refusal(model, len(input_ids), positions is not None) is None
    )
    # while the native step decodes, its pool's workers spin between tokens rather than sleep
    with native.lingering() if native_steps else contextlib.nullcontext():
        capacity = input_ids.shape[1] + max_new_tokens
        fast = None
        if native_steps and input_ids.shape[1] <= NATIVE_PROMPT:
            fast = NativeStep(model, None, capacity)
            head, bias = _step_head(model, True, native_step=True)
            logits = _head(model, head, bias, fast.read(input_ids))
        else:
            # The prompt's token comes from the model's own head (model(ids).logits'
            # arithmetic), and is yielded before the copies that make each later step fast
            # (0.1-0.2 s for SmolLM2's): a stream shows it that much sooner.
            with _prompt_cores(model):
                logits = _next_logits(model, None, None, input_ids, attention_mask, positions,
                                      cache, layers, keep)  # fmt: skip
        token = sampling.pick(logits, generator)  # (B,)
        yield token
        if max_new_tokens <= 1:
            return
        if fast is None:
            if native_steps:
                fast = NativeStep(model, cache, capacity)
            elif use_fast:
                fast = FastStep(model, cache, capacity, attention_mask)
            head, bias = _step_head(model, use_fast, native_step=native_steps)
        for _ in range(max_new_tokens - 1):
            if positions is not None:
                positions = positions[:, -1:] + 1  # (B, 1)
                if fast is None:
                    more = attention_mask.new_ones(len(token), 1)
                    attention_mask = torch.cat([attention_mask, more], 1)
            if fast is not None:
                logits = _head(model, head, bias, fast(token, positions))
            else:
                logits = _next_logits(model, head, bias, token[:, None], attention_mask, positions,
                                      cache, layers, keep)  # fmt: skip
            token = sampling.pick(logits, generator)  # (B,)
            yield token


def seq2seq_steps(
    model: EncoderDecoder,
    source_ids: Tensor,
    source_mask: Tensor | None,
    start_id: int,
    sampling: Sampling,
    max_new_tokens: int,
) -> Iterator[Tensor]:
    """Yield the next target token of every sequence (B,), max_new_tokens times at most.

    The encoder reads source_ids (B, S) (right-padded; source_mask 1 for real tokens) once;
    the decoder starts from `start_id` and feeds each new token back with its KV cache, its
    cross-attention reading the encoder's output every step.
    """
    generator = None
    if sampling.seed is not None:
        generator = torch.Generator(device=source_ids.device).manual_seed(sampling.seed)
    with torch.inference_mode():
        encoded = model.read_source(source_ids, source_mask=source_mask)
    cache = model.new_cache()
    token = torch.full((len(source_ids),), start_id, dtype=torch.long, device=source_ids.device)
    for _ in range(max_new_tokens):
        with torch.inference_mode():
            logits = model(source_ids, token[:, None], source_mask=source_mask, encoded=encoded,
                           cache=cache).logits[:, -1]  # fmt: skip
        token = sampling.pick(logits, generator)  # (B,)
        yield token


@torch.inference_mode()
def _next_logits(model: Decoder, head, bias, input_ids, attention_mask, positions, cache,
                 layers=None, keep=None):  # fmt: skip
    """The logits (B, vocab) of the token after input_ids (B, T), appending to the cache;
    the records of `layers` go to keep(records)."""
    out = model(
        input_ids, attention_mask=attention_mask, positions=positions, cache=cache,
        layers=layers, logits=False,
    )  # fmt: skip
    if keep is not None:
        keep(out.records)
    return _head(model, head, bias, out.hidden[:, -1])


def _prompt_cores(model: Decoder):
    """Where the model multiplies a file's blocks with qkv's kernels: its prompt's products on
    every core and torch's operations on one (`cores_to_the_kernels`); elsewhere nothing."""
    if any(type(m) is QuantLinear for m in model.modules()):
        return cores_to_the_kernels()
    return contextlib.nullcontext()


def _step_head(model: Decoder, fast: bool, native_step: bool = False) -> tuple:
    """The LM head each step after the prompt's reads, and its bias where it is not a module.

    The head reads the largest matrix once per token: stored (C, vocab) it is read in memory
    order, about twice as fast at one row as the (vocab, C) Linear weight, and in oneDNN's
    layout (FastStep's `head_of`) faster still; an 8-bit one (int4 models'), with 8-bit inputs
    where the CPU has VNNI; a file's own blocks (QuantLinear) on the native step's threads
    where it runs. A quantized head FastStep does not take computes itself."""
    packed = head_of(model, native.threads() if native_step else None) if fast else None
    if packed is not None:
        return packed, None
    head = model.lm_head
    if isinstance(head, torch.nn.Linear):
        return head.weight.detach().t().contiguous(), head.bias  # (C, vocab)
    return head, None


@torch.inference_mode()
def _head(model: Decoder, head, bias, hidden: Tensor) -> Tensor:
    """The logits (B, vocab) of the last position's hidden vectors (B, C); head None: the
    model's own (`Decoder.project`)."""
    if head is None:
        return model.project(hidden)
    if model.config.head_scale is not None:  # as Decoder.project: scaled before the head
        hidden = hidden * model.config.head_scale
    # (B, vocab): a module or a function (a quantized or a packed head) adds its own bias
    logits = hidden @ head.to(hidden.dtype) if isinstance(head, Tensor) else head(hidden)
    logits = logits if bias is None else logits + bias
    return cap_logits(logits, model.config.logit_softcap)
