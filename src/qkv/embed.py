"""Sentence vectors from an encoder: its token vectors pooled (mean, [CLS] or max) and
normalized as the model's sentence-transformers config says; what `Pretrained.embed` returns.

>>> hidden = torch.tensor([[[1.0, 0.0], [3.0, 4.0], [9.0, 9.0]]])  # (B=1, T=3, C=2)
>>> pool(hidden, torch.tensor([[1, 1, 0]]), Pooling("mean", normalize=False))  # 3rd: padding
tensor([[2., 2.]])
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch
from torch import Tensor

from qkv.device import choose_precision
from qkv.io.hf_folder import Pooling
from qkv.models import Encoder

logger = logging.getLogger(__name__)

PRECISIONS = ("auto", "float32", "bfloat16")


def embed(
    model: Encoder,
    tokenizer,
    sentences: Sequence[str],
    *,
    pooling: Pooling,
    limit: int,
    source: str,
    batch_size: int = 64,
    precision: str = "auto",
) -> Tensor:
    """One vector per sentence (N, C), pooled by `pooling`; each sentence cut at `limit`
    tokens (its [CLS] ... [SEP] kept), with a warning naming the sentences cut. Sentences are
    sorted by length and batched, so padding costs little. precision: see `Pretrained.embed`.
    """
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be 'auto', 'float32' or 'bfloat16', got {precision!r}")
    if precision == "auto":
        precision = choose_precision()[0]
    if isinstance(sentences, str):
        sentences = [sentences]
    rows_ids, lengths = tokenizer.encode_ids(sentences, max_length=limit)
    cut = [i for i, n in enumerate(lengths) if n > limit]
    if cut:
        listed = ", ".join(map(str, cut[:10])) + (" ..." if len(cut) > 10 else "")
        logger.warning(
            "%s reads %d tokens of a sentence; %d of %d sentences were longer and were cut "
            "there (sentences %s, counted from 0)", source, limit, len(cut),
            len(sentences), listed,
        )  # fmt: skip
    order = sorted(range(len(sentences)), key=lambda i: -len(rows_ids[i]))
    out = torch.empty(len(sentences), model.config.block.width)
    lower = precision == "bfloat16"
    with torch.inference_mode(), torch.autocast("cpu", torch.bfloat16, enabled=lower):
        for start in range(0, len(order), batch_size):
            rows = order[start : start + batch_size]
            ids, mask = tokenizer.pad([rows_ids[i] for i in rows])  # (B, T)
            padded = None if bool(mask.all()) else mask  # unpadded: the unmasked kernel
            hidden = model(ids, attention_mask=padded).hidden.float()  # (B, T, C)
            out[rows] = pool(hidden, mask, pooling)
    return out


def pool(hidden: Tensor, mask: Tensor, pooling: Pooling) -> Tensor:
    """Token vectors (B, T, C) with mask (B, T) -> sentence vectors (B, C)."""
    real = mask.to(hidden.dtype)[..., None]  # (B, T, 1)
    if pooling.mode == "mean":
        vectors = (hidden * real).sum(1) / real.sum(1).clamp(min=1e-9)
    elif pooling.mode == "cls":
        vectors = hidden[:, 0]
    else:
        vectors = hidden.masked_fill(real == 0, float("-inf")).max(1).values
    return torch.nn.functional.normalize(vectors, dim=-1) if pooling.normalize else vectors
