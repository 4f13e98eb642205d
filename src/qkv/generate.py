"""Sampling from a decoder with a KV cache: one new token per step for every sequence.

The prompt is read in one forward pass that fills the cache; each later step feeds only
the newest token, whose query attends to every cached key. Batches are left-padded so
that every sequence's next token is in the last column.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor

from qkv.models import Decoder, EncoderDecoder
from qkv.models.decoder import cap_logits


@dataclass(frozen=True)
class Sampling:
    """How the next token is picked from the logits. temperature 0 means greedy."""

    temperature: float = 0.0
    top_k: int | None = None  # keep the k most likely tokens
    top_p: float | None = None  # keep the smallest set whose probabilities reach p
    seed: int | None = None

    def __post_init__(self):
        t = self.temperature
        if not (isinstance(t, int | float) and math.isfinite(t) and t >= 0):
            raise ValueError(f"temperature must be a finite number >= 0, got {t!r}")
        if self.top_k is not None and not (isinstance(self.top_k, int) and self.top_k >= 1):
            raise ValueError(f"top_k must be an integer >= 1 or None, got {self.top_k!r}")
        p = self.top_p
        if p is not None and not (isinstance(p, int | float) and 0 < p <= 1):
            raise ValueError(f"top_p must be in (0, 1] or None, got {p!r}")
        seed = self.seed  # torch's generators take 0..2**64-1 and wrap a negative silently
        if seed is not None and not (type(seed) is int and 0 <= seed < 2**64):
            raise ValueError(f"seed must be a whole number from 0 to 2**64-1, got {seed!r}")

    def pick(self, logits: Tensor, generator: torch.Generator | None) -> Tensor:
        """logits (B, vocab) -> next token ids (B,).

        Any finite temperature > 0 samples: the logits' gaps to their largest are divided in
        float64, so a tiny temperature sends every gap to -inf (probability 0) and the most
        likely token (or a tie among them) is drawn, never NaN; a huge one is near uniform.
        """
        if self.temperature == 0:
            return logits.argmax(dim=-1)
        logits = logits.double()
        logits = (logits - logits.max(dim=-1, keepdim=True).values) / self.temperature
        if self.top_k is not None and self.top_k < logits.shape[-1]:
            kth = logits.topk(self.top_k, dim=-1).values[:, -1:]  # (B, 1)
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if self.top_p is not None and self.top_p < 1:
            sorted_logits, order = logits.sort(dim=-1, descending=True)
            probs = sorted_logits.softmax(dim=-1)
            # drop a token when the tokens more likely than it already reach top_p
            drop = probs.cumsum(dim=-1) - probs >= self.top_p
            logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
        probs = logits.softmax(dim=-1)
        return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def decode_steps(
    model: Decoder,
    input_ids: Tensor,
    attention_mask: Tensor | None,
    sampling: Sampling,
    max_new_tokens: int,
) -> Iterator[Tensor]:
    """Yield the next token of every sequence (B,), max_new_tokens times at most.

    input_ids (B, T) left-padded, attention_mask (B, T) with 1 for real tokens (None when
    nothing is padded). The caller stops iterating when it has what it wants.
    """
    generator = None
    if sampling.seed is not None:
        generator = torch.Generator(device=input_ids.device).manual_seed(sampling.seed)
    # The LM head reads the largest matrix once per token; stored (C, vocab) it is read in
    # memory order, about twice as fast at one row as the (vocab, C) Linear weight.
    head = model.lm_head.weight.detach().t().contiguous()  # (C, vocab)
    bias = model.lm_head.bias
    cache = model.new_cache()
    positions = None
    if attention_mask is not None and not bool(attention_mask.all()):
        # each row counts positions from its own first real token
        positions = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)  # (B, T)
    else:
        attention_mask = None  # nothing padded: the faster unmasked path
    logits = _next_logits(model, head, bias, input_ids, attention_mask, positions, cache)
    for step in range(max_new_tokens):
        token = sampling.pick(logits, generator)  # (B,)
        yield token
        if step == max_new_tokens - 1:
            return
        if positions is not None:
            positions = positions[:, -1:] + 1  # (B, 1)
            attention_mask = torch.cat([attention_mask, attention_mask.new_ones(len(token), 1)], 1)
        logits = _next_logits(model, head, bias, token[:, None], attention_mask, positions, cache)


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
def _next_logits(model: Decoder, head, bias, input_ids, attention_mask, positions, cache):
    """The logits (B, vocab) of the token after input_ids (B, T), appending to the cache."""
    out = model(
        input_ids, attention_mask=attention_mask, positions=positions, cache=cache, logits=False
    )
    hidden = out.hidden[:, -1]  # (B, C)
    if model.config.head_scale is not None:  # as Decoder.project: scaled before the head
        hidden = hidden * model.config.head_scale
    logits = hidden @ head.to(out.hidden.dtype)  # (B, vocab)
    logits = logits if bias is None else logits + bias
    return cap_logits(logits, model.config.logit_softcap)
