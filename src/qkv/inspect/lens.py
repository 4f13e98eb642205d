"""The logit lens and direct logit attribution: what each layer of a decoder would predict.

A decoder's residual stream is a sum: the embeddings, plus each layer's attention output,
plus each layer's MLP output. The model predicts the next token from the last of these
through its final norm and its LM head. The *logit lens* sends every intermediate stream
(the embeddings, then each block's output) through that same norm and head, showing which
next tokens each depth already points at. *Direct logit attribution* splits the final
logit of one token into one term per part: the embeddings, each head of each layer (its
output through its slice of the output projection), each layer's attention bias, each
layer's MLP, and what the final norm adds itself (a linear layer's head: its read of the
memory after the layer's gated norm, which is what the output projection reads). The norm
is not linear; its scale is frozen at the value it takes on the final stream (the standard
attribution), so that the terms add up to the model's own logit.

>>> import qkv
>>> result = lens(qkv.load("smollm2"), "The capital of France is")
>>> result.layers[0], result.layers[-1], len(result.top_ids[0])
('embeddings', 'layer 29', 5)
>>> abs(result.attribution.total - result.attribution.logit) < 1e-3
True
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import ClassVar

import torch
from torch import Tensor, nn

from qkv.inspect.layer_heads import heads_per_layer, nan_grid
from qkv.inspect.prompts import Spread
from qkv.inspect.records import check_head_outputs
from qkv.inspect.residual import head_writes
from qkv.inspect.runs import (
    encoded_prompts,
    padded_ids,
    prompt_groups,
    prompt_name,
    spreads_dict,
    spreads_of,
)
from qkv.io.words import spaced_token, token_note
from qkv.models import Decoder, DecoderOutput
from qkv.models.deepseek_v4 import DeepseekV4Decoder
from qkv.nn import RMSNorm
from qkv.views import Shown


@dataclass
class Attribution:
    """One token's logit at one position, split into the direct contribution of each part.

    logit = embeddings + heads.nansum() + attention_bias.sum() + mlps.sum() + remainder, where
    each term is that part's output through the final norm (its scale frozen at its value
    on the final residual stream), the LM head's row of the token and the head scale.
    """

    token_id: int
    token: str
    position: int
    logit: float  # the model's own logit of the token at the position
    embeddings: float  # the token (and position) embeddings' contribution
    # (L, H) float64: each head's output through its slice of the output matrix; H is the most
    # heads any layer has, NaN in a layer with fewer
    heads: Tensor
    attention_bias: Tensor  # (L,) float64: each layer's output-projection bias (0 if none)
    mlps: Tensor  # (L,) float64: block output - block input - attention output
    # the logit minus every term above: what the final norm's shift and the LM head's bias add
    remainder: float
    remainder_explicit: float  # the same computed from the norm's bias and the head's bias
    norm_scale: float  # the frozen scale: 1 / rms (RMSNorm) or 1 / std (LayerNorm); 1 if none

    @property
    def total(self) -> float:
        """Every term plus the remainder: the logit, up to rounding."""
        parts = self.heads.nansum() + self.attention_bias.sum() + self.mlps.sum()
        return float(self.embeddings + parts + self.remainder)

    def terms(self) -> list[tuple[str, float]]:
        """Every term by name, the largest in size first (a negative term pushes the token
        down): ("layer 3 head 5", 1.2), ("layer 29 mlp", -0.4), ..."""
        named = [("embeddings", self.embeddings)]
        L, H = self.heads.shape
        for layer in range(L):
            named += [
                (f"layer {layer} head {h}", float(self.heads[layer, h]))
                for h in range(H)
                if self.heads[layer, h] == self.heads[layer, h]
            ]  # a head it has
            if self.attention_bias[layer] != 0:
                named.append((f"layer {layer} attention bias", float(self.attention_bias[layer])))
            named.append((f"layer {layer} mlp", float(self.mlps[layer])))
        return sorted(named, key=lambda term: -abs(term[1]))

    def to_dict(self) -> dict:
        return {
            "token_id": self.token_id,
            "token": self.token,
            "position": self.position,
            "logit": self.logit,
            "embeddings": self.embeddings,
            "heads": [[None if v != v else v for v in row] for row in self.heads.tolist()],
            "attention_bias": self.attention_bias.tolist(),
            "mlps": self.mlps.tolist(),
            "remainder": self.remainder,
            "remainder_explicit": self.remainder_explicit,
            "norm_scale": self.norm_scale,
            "total": self.total,
            "terms": [{"name": name, "logit": value} for name, value in self.terms()],
        }


@dataclass(repr=False)
class Lens(Shown):
    """Each depth's next-token prediction at one position, and the attribution of a token,
    in one prompt or in each of several.

    Depth d is `layers[d]`: depth 0 is the embeddings, depth i + 1 the output of layer i
    (layers count from 0); the last depth is the model's own prediction. Over several
    prompts: `rank`, `logprob` and the attribution's numbers are the mean over the prompts
    (`spreads` holds each prompt's, the mean and a bootstrap 95% interval), the top tokens are
    those of the mean probability, and `tokens`, `position`, `logits` are the first prompt's;
    with no token asked, each prompt follows its own top prediction (`token_ids`).
    """

    view: ClassVar[str] = "lens"  # drawn by qkv.viz.notebook_interventions

    source: str
    tokens: list[str]  # the text's tokens
    position: int  # the position read, counted from 0
    layers: list[str]  # ["embeddings", "layer 0", ..., "layer L-1"]
    logits: Tensor  # (L+1, vocab) each depth's stream through the final norm and LM head
    top_ids: list[list[int]]  # (L+1, top) the most likely next tokens at each depth
    top_tokens: list[list[str]]  # the same as text
    top_probs: list[list[float]]  # their probabilities (softmax over the whole vocabulary)
    token_id: int  # the token followed: asked, or the model's top prediction
    token: str
    rank: list[int]  # (L+1,) how many tokens each depth scores above the token (0: the top)
    logprob: list[float]  # (L+1,) the token's log-probability at each depth
    attribution: Attribution | None  # None when asked for the lens alone
    texts: list[str] = field(default_factory=list)  # every prompt
    positions: list[int] = field(default_factory=list)  # the position read in each prompt
    token_ids: list[int] = field(default_factory=list)  # the token followed in each prompt
    # per-prompt values, mean and interval of rank and logprob (L+1,) and of the attribution's
    # logit, embeddings, heads (L, H), attention_bias (L,), mlps (L,) and remainder
    spreads: dict[str, Spread] = field(default_factory=dict)
    # the token asked has no leading space where the model's own token for the word has one
    token_note: str | None = None

    def to_dict(self) -> dict:
        """JSON-ready (see docs/lens.md); `logits` is left out: it is the vocabulary's size
        at every depth."""
        return {
            "source": self.source,
            "tokens": list(self.tokens),
            "position": self.position,
            "layers": list(self.layers),
            "top": [
                [{"id": i, "token": t, "prob": p} for i, t, p in zip(*row, strict=True)]
                for row in zip(self.top_ids, self.top_tokens, self.top_probs, strict=True)
            ],
            "token_id": self.token_id,
            "token": self.token,
            "token_note": self.token_note,
            "rank": list(self.rank),
            "logprob": list(self.logprob),
            "attribution": None if self.attribution is None else self.attribution.to_dict(),
            "texts": list(self.texts),
            "positions": list(self.positions),
            "token_ids": list(self.token_ids),
            # several prompts: each one's values, their mean and interval
            **({"spreads": spreads_dict(self.spreads)} if len(self.texts) > 1 else {}),
        }


def lens(
    pretrained,
    text: str | Sequence[str] | Path,
    *,
    position: int = -1,
    token: str | int | None = None,
    top: int = 5,
    attribute: bool = True,
) -> Lens:
    """The logit lens of `pretrained`'s decoder over `text`, at `position` (default the last
    token), and the direct logit attribution of `token` there.

    text: one text, a list of texts, or a file (`Path`: text lines, TSV or JSONL), run in
    padded batches; position counts in each prompt (-1: each one's last token).
    token: the next token to follow, as text that is one token of the vocabulary (" Paris",
    with its leading space) or as an id; default the model's own top prediction (in each
    prompt).
    top: how many of each depth's most likely next tokens to keep.
    attribute: False for the lens alone (the attribution refuses some models by name).
    """
    model = pretrained.model
    if not isinstance(model, Decoder) or model.config.cross_attention:
        raise ValueError(
            f"the logit lens reads a decoder's next-token predictions; {pretrained.source} is "
            f"{pretrained.family.name}, not a decoder"
        )
    if isinstance(model, DeepseekV4Decoder):
        raise ValueError(
            f"the logit lens reads each layer's one vector per token; {pretrained.source} is a "
            "DeepSeek-V4 decoder, which keeps n streams per token between layers "
            "(hyper-connections), mixed into one only after the last layer"
        )
    texts, encoded = encoded_prompts(pretrained, text)
    token_id = None if token is None else token_id_of(pretrained, token)
    lengths = [len(e.ids) for e in encoded]
    for n, length in enumerate(lengths):
        where = "" if len(texts) == 1 else f"{prompt_name(n, texts[n])}: "
        _check_position(position, length, where)

    def spell(i: int) -> str:
        return pretrained.tokenizer.pieces([i])[0]  # part of a character: its bytes, <0xE6>

    rows: list[_Row | None] = [None] * len(texts)
    for group in prompt_groups(model, lengths, per_token=model.config.vocab_size):
        ids, _ = padded_ids(pretrained, model, [encoded[p].ids for p in group])
        found = _lens_rows(model, ids, [lengths[p] for p in group], position=position,
                           token_id=token_id, top=top, attribute=attribute, spell=spell,
                           source=pretrained.source)  # fmt: skip
        for p, row in zip(group, found, strict=True):
            rows[p] = row
    result = _gathered(model, [r for r in rows if r is not None], top, spell, pretrained.source)
    result.tokens, result.texts = list(encoded[0].tokens), texts
    if isinstance(token, str):
        result.token_note = token_note(pretrained.tokenizer, token, "the token")
    return result


def token_id_of(pretrained, token: str | int) -> int:
    """The id of a token given as text (" Paris") or id; a clear error if it is not one
    token of the vocabulary."""
    size = pretrained.model.config.vocab_size
    if isinstance(token, int) and not isinstance(token, bool):
        if not 0 <= token < size:
            raise ValueError(f"token id {token} is outside the vocabulary (0..{size - 1})")
        return token
    if not isinstance(token, str) or not token:
        raise ValueError(f"the token must be a text such as ' Paris' or an id, got {token!r}")
    found = pretrained.tokenizer.encode(token, add_special_tokens=False)
    spaced = spaced_token(pretrained.tokenizer, token)
    if len(found.ids) != 1:
        raise ValueError(
            f"{token!r} is not one token of {pretrained.source}'s vocabulary: it tokenizes as "
            f"{list(found.tokens)}; give one of those (with its leading space where it has one)"
            + (f", or {spaced!r}, one token" if spaced is not None else "")
        )
    return found.ids[0]


def decoder_lens(
    model: Decoder,
    ids: Tensor,
    *,
    position: int = -1,
    token_id: int | None = None,
    top: int = 5,
    attribute: bool = True,
    spell: Callable[[int], str] = str,
    source: str = "the model",
) -> Lens:
    """The lens of a Decoder over ids (1, T): one forward with every layer's record and
    hidden state, under inference mode. spell(id) names a token (default its id)."""
    if ids.dim() != 2 or ids.shape[0] != 1:
        raise ValueError(f"the lens reads one text: ids of shape (1, T), got {tuple(ids.shape)}")
    _check_position(position, ids.shape[1])
    rows = _lens_rows(model, ids, [ids.shape[1]], position=position, token_id=token_id, top=top,
                      attribute=attribute, spell=spell, source=source)  # fmt: skip
    return _gathered(model, rows, top, spell, source)


@dataclass
class _Row:
    """One prompt's lens: its tokens, position, logits (L+1, vocab), followed token, ranks,
    log-probabilities and attribution."""

    tokens: list[str]
    position: int
    logits: Tensor
    logprobs: Tensor  # (L+1, vocab) float64
    token_id: int
    rank: list[int]
    logprob: list[float]
    attribution: Attribution | None


def _check_position(position: int, T: int, where: str = "") -> None:
    if not isinstance(position, int) or not -T <= position < T:
        raise ValueError(
            f"{where}position {position} is out of range: the text has {T} tokens (0..{T - 1}, "
            f"or -{T}..-1 from the end)"
        )


def _lens_rows(
    model: Decoder, ids: Tensor, lengths: list[int], *, position: int, token_id: int | None,
    top: int, attribute: bool, spell: Callable[[int], str], source: str,
) -> list[_Row]:  # fmt: skip
    """The lens of each row of ids (B, T), right-padded: row b's real tokens are its first
    lengths[b] (a decoder's real tokens never see the padding after them)."""
    if not isinstance(top, int) or not 1 <= top <= model.config.vocab_size:
        raise ValueError(f"top must be a whole number in 1..{model.config.vocab_size}, got {top}")
    if attribute:
        check_attributable(model, source)
    found = []
    with torch.inference_mode():
        out = model(ids, layers="all" if attribute else None, hidden_states=True)
        for b, length in enumerate(lengths):
            at = position % length
            streams = torch.stack([h[b, at] for h in out.hidden_states[:-1]])  # (L, C)
            logits = model.project(streams if model.norm is None else model.norm(streams))
            # the last depth is the model's own prediction, as its forward computed it: the
            # same norm and head on one row instead of T can round differently in the last bit
            logits = torch.cat([logits, out.logits[b, at][None]])  # (L+1, vocab)
            logprobs = logits.double().log_softmax(-1)  # (L+1, vocab)
            followed = int(out.logits[b, at].argmax()) if token_id is None else token_id
            chosen = logits[:, followed : followed + 1]  # (L+1, 1)
            rank = (logits > chosen).sum(-1)  # (L+1,)
            attribution = None
            if attribute:
                attribution = attribute_logit(model, out, at, followed, spell(followed), row=b)
            found.append(_Row([spell(i) for i in ids[b, :length].tolist()], at, logits.float(),
                              logprobs, followed, rank.tolist(), logprobs[:, followed].tolist(),
                              attribution))  # fmt: skip
    return found


def _gathered(model: Decoder, rows: list[_Row], top: int, spell, source: str) -> Lens:
    """One Lens from each prompt's: the first prompt's tokens, position and logits; the mean
    of the rest (one prompt: its own), with every prompt's values in `spreads`."""
    first, L = rows[0], model.config.num_layers
    probs = torch.stack([row.logprobs.exp() for row in rows]).mean(0)  # (L+1, vocab)
    best = probs.topk(top, dim=-1)
    values = {
        name: torch.tensor([getattr(row, name) for row in rows], dtype=torch.float64)
        for name in ("rank", "logprob")
    }
    attributions = [row.attribution for row in rows if row.attribution is not None]
    if attributions:
        for name in ("logit", "embeddings", "heads", "attention_bias", "mlps", "remainder"):
            values[name] = torch.stack([torch.as_tensor(getattr(a, name), dtype=torch.float64)
                                        for a in attributions])  # fmt: skip
    spreads = spreads_of(values)
    attribution = first.attribution
    if len(rows) > 1 and attribution is not None:
        mean = {name: spreads[name].mean for name in ("heads", "attention_bias", "mlps")}
        numbers = {name: float(spreads[name].mean) for name in ("logit", "embeddings", "remainder")}
        attribution = Attribution(
            token_id=attribution.token_id, token=attribution.token, position=first.position,
            **numbers, **mean,
            remainder_explicit=sum(a.remainder_explicit for a in attributions) / len(rows),
            norm_scale=sum(a.norm_scale for a in attributions) / len(rows),
        )  # fmt: skip
    one = len(rows) == 1
    return Lens(
        source=source,
        tokens=first.tokens,
        position=first.position,
        layers=["embeddings", *(f"layer {i}" for i in range(L))],
        logits=first.logits,
        top_ids=best.indices.tolist(),
        top_tokens=[[spell(i) for i in row] for row in best.indices.tolist()],
        top_probs=best.values.tolist(),
        token_id=first.token_id,
        token=spell(first.token_id),
        rank=first.rank if one else spreads["rank"].mean.tolist(),
        logprob=first.logprob if one else spreads["logprob"].mean.tolist(),
        attribution=attribution,
        positions=[row.position for row in rows],
        token_ids=[row.token_id for row in rows],
        spreads=spreads,
    )


# what each refusal of the attribution adds: the logit lens itself reads any decoder
_LENS_ALONE = "(the lens alone works: attribute=False, qkv lens --no-attribution)"


def check_attributable(model: Decoder, source: str = "the model") -> None:
    """Refuse, by name, a decoder whose logit is not a sum of its parts' outputs."""
    block, cfg = model.config.block, model.config
    if block.norm_position == "post":
        raise ValueError(
            f"direct logit attribution needs pre-norm blocks; {source}'s blocks normalize after "
            "each residual sum (post-norm), so the heads' outputs are not terms of the final "
            "stream " + _LENS_ALONE
        )
    if block.sublayer_norm:
        raise ValueError(
            f"direct logit attribution needs sub-layer outputs added as they are; {source} "
            "normalizes each sub-layer's output before adding it (sublayer_norm, as Gemma 2 "
            "and 3 and OLMo 2), so the heads' outputs are not terms of the stream " + _LENS_ALONE
        )
    if cfg.logit_softcap is not None:
        raise ValueError(
            f"direct logit attribution splits a linear logit; {source} soft-caps its logits "
            f"(cap {cfg.logit_softcap}: cap * tanh(logit / cap)), which is not a sum of terms "
            + _LENS_ALONE
        )
    linear = [model.lm_head, *(b.attn.out for b in model.blocks)]
    if not all(type(layer) is nn.Linear for layer in linear):
        raise ValueError(
            f"direct logit attribution reads the output and LM head matrices; {source}'s are "
            "packed (int4): load it without int4"
        )


def attribute_logit(
    model: Decoder,
    out: DecoderOutput,
    position: int,
    token_id: int,
    token: str = "",
    *,
    row: int = 0,
) -> Attribution:
    """Split the logit of token_id at `position` into direct contributions (float64).

    out: the model's forward with every layer's record and hidden_states=True; row: which of
    its batch's rows.
    """
    check_head_outputs(out.records, "direct logit attribution")
    states = [h[row, position].double() for h in out.hidden_states]  # (C,) each, L+1
    final = states[-1]
    direction, scale, explicit = _readout(model, final, token_id)  # (C,): logit = c . direction
    L = model.config.num_layers
    heads = nan_grid(heads_per_layer(model))  # NaN where a layer has fewer heads
    biases = torch.zeros(L, dtype=torch.float64)
    mlps = torch.zeros(L, dtype=torch.float64)
    for layer, block in enumerate(model.blocks):
        record = _row_of(out.records[layer], row)
        x = out.hidden_states[layer][row : row + 1]  # (1, T, C)
        head_out = head_writes(block, record, x, position)
        W_o = block.attn.out.weight.double()  # (C, H*D)
        H = head_out.shape[0]  # this layer's heads
        read = (W_o.T @ direction).view(H, -1)  # (H, D): each head's slice, read out
        heads[layer, :H] = (head_out * read).sum(-1)
        attended = W_o @ head_out.reshape(-1)  # (C,) the attention output, bias apart
        if block.attn.out.bias is not None:
            bias = block.attn.out.bias.double()
            attended = attended + bias
            biases[layer] = bias @ direction
        mlp_out = states[layer + 1] - states[layer] - attended  # (C,) (a parallel block too)
        mlps[layer] = mlp_out @ direction
    embeddings = float(states[0] @ direction)
    logit = float(out.logits[row, position, token_id])
    remainder = logit - float(embeddings + heads.nansum() + biases.sum() + mlps.sum())
    return Attribution(
        token_id=token_id, token=token, position=position, logit=logit, embeddings=embeddings,
        heads=heads, attention_bias=biases, mlps=mlps, remainder=remainder,
        remainder_explicit=explicit, norm_scale=scale,
    )  # fmt: skip


def _row_of(record, row: int) -> SimpleNamespace:
    """What `head_writes` reads of a record, at one row of its batch: out (1, H, T, D) and
    the output gate."""
    gate = record.output_gate
    return SimpleNamespace(out=record.out[row : row + 1],
                           output_gate=None if gate is None else gate[row : row + 1])  # fmt: skip


def _readout(model: Decoder, final: Tensor, token_id: int) -> tuple[Tensor, float, float]:
    """The final norm (scale frozen on `final` (C,)) and the LM head's row of the token as
    one linear map: (direction (C,), the frozen scale, the affine part: the norm's shift
    and the head's bias, read out). A term c's contribution is c . direction."""
    row = model.lm_head.weight[token_id].double()  # (C,)
    if model.config.head_scale is not None:
        row = row * model.config.head_scale
    explicit = 0.0
    if model.lm_head.bias is not None:
        explicit += float(model.lm_head.bias[token_id])
    norm, scale = model.norm, 1.0
    if norm is None:
        return row, scale, explicit
    if isinstance(norm, RMSNorm):
        scale = float(torch.rsqrt(final.pow(2).mean() + norm.eps))
        gain = norm.weight.double() + (1.0 if norm.plus_one else 0.0)
        return scale * gain * row, scale, explicit
    if isinstance(norm, nn.LayerNorm):
        scale = float(torch.rsqrt(final.var(unbiased=False) + norm.eps))
        gain = row if norm.weight is None else norm.weight.double() * row
        if norm.bias is not None:
            explicit += float(norm.bias.double() @ row)
        return scale * (gain - gain.mean()), scale, explicit  # centering: c - mean(c)
    raise ValueError(f"direct logit attribution knows RMSNorm and LayerNorm, not {norm}")
