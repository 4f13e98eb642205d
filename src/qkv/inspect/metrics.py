"""What an intervention's run is scored by: a function of the logits at one position.

Five kinds, each differentiable (attribution takes their gradient):

- "diff: A, B": log p(A) - log p(B), the log-probability difference of two tokens (the logit
  difference, as the log-softmax's normalizer cancels: " Mary" over " John");
- "prob: A": p(A);
- "logprob: A": log p(A);
- "kl": KL(clean || run), in nats: how far the run's next-token distribution moved from the
  clean run's (0 at the clean run);
- a Python function of the logits: `fn(logits (…, vocab) float64) -> (…)`, e.g.
  `lambda logits: logits[..., 42] - logits[..., 7]`.

A token is written as the model's tokenizer reads it: " Paris" (with its space) is another
token than "Paris".

>>> Metric.parse("diff: Mary, John").tokens
(' Mary', ' John')
>>> str(Metric.parse("kl"))
'KL(clean || run)'
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from torch import Tensor

from qkv.io.words import spaced_token, token_note

COUNTS = {"diff": 2, "prob": 1, "logprob": 1, "kl": 0, "fn": 0}
FORMS = "'diff: A, B', 'prob: A', 'logprob: A', 'kl', or a function of the logits"


@dataclass(frozen=True)
class Metric:
    """A metric of the logits at the last position (see the module's docstring)."""

    kind: Literal["diff", "prob", "logprob", "kl", "fn"]
    tokens: tuple[str, ...] = ()
    fn: Callable[[Tensor], Tensor] | None = None

    def __post_init__(self):
        if self.kind not in COUNTS:
            raise ValueError(f"a metric is {FORMS}; got {self.kind!r}")
        if len(self.tokens) != COUNTS[self.kind]:
            raise ValueError(
                f"metric {self.kind!r} takes {COUNTS[self.kind]} token(s), got {len(self.tokens)}"
            )
        if (self.kind == "fn") != (self.fn is not None):
            raise ValueError("a metric of kind 'fn' is a function of the logits, and only it")

    @classmethod
    def parse(cls, spec) -> Metric:
        """A Metric, a function of the logits, a ("diff", a, b) / ("prob", t) tuple, or text:
        "diff: Mary, John" (tokens after the colon, split at commas, spaces kept: ' Mary' and
        ' John'), "prob: Paris", "logprob: Paris" or "kl"."""
        if isinstance(spec, Metric):
            return spec
        if callable(spec):
            return cls("fn", fn=spec)
        if isinstance(spec, tuple) and spec:
            return cls(spec[0], tuple(spec[1:]))
        if isinstance(spec, str) and spec.strip() == "kl":
            return cls("kl")
        if not isinstance(spec, str) or ":" not in spec:
            raise ValueError(f"a metric is {FORMS}; got {spec!r}")
        kind, _, rest = spec.partition(":")
        return cls(kind.strip(), tuple(rest.split(",")))

    @property
    def needs_clean(self) -> bool:
        """Whether the score reads the clean run's distribution (KL)."""
        return self.kind == "kl"

    def ids(self, tokenizer) -> list[int]:
        """The metric's tokens' ids, each one token of the vocabulary."""
        found = []
        for token in self.tokens:
            encoded = tokenizer.encode(token, add_special_tokens=False)
            if len(encoded.ids) != 1:
                spaced = spaced_token(tokenizer, token)
                offer = f", or {spaced!r}, one token" if spaced is not None else ""
                raise ValueError(
                    f"the metric's token {token!r} is not one token of the vocabulary: it reads "
                    f"as {list(encoded.tokens)}; give one of those, spaces as written{offer}"
                )
            found.append(encoded.ids[0])
        return found

    def notes(self, tokenizer) -> list[str]:
        """A line for each of the metric's tokens typed without the leading space the model's
        own token for that word has ("prob: Paris" where the model writes " Paris")."""
        said = (token_note(tokenizer, token, "the metric's token") for token in self.tokens)
        return [line for line in said if line is not None]

    def score(self, logits: Tensor, ids: list[int], clean: Tensor | None = None) -> Tensor:
        """logits (…, vocab) -> the metric (…), float64. clean: the clean run's logits
        (vocab,) or (…, vocab) at the same position, for "kl"."""
        if self.kind == "fn":
            assert self.fn is not None
            value = self.fn(logits.double())
            if not isinstance(value, Tensor) or value.shape != logits.shape[:-1]:
                shape = getattr(value, "shape", type(value).__name__)
                raise ValueError(
                    f"the metric function returned {shape}; it takes logits (…, vocab) and "
                    f"returns one number per row (…): {tuple(logits.shape[:-1])} here"
                )
            return value.double()
        logprobs = logits.double().log_softmax(-1)
        if self.kind == "diff":
            return logprobs[..., ids[0]] - logprobs[..., ids[1]]
        if self.kind == "logprob":
            return logprobs[..., ids[0]]
        if self.kind == "prob":
            return logprobs[..., ids[0]].exp()
        if clean is None:
            raise ValueError("the 'kl' metric compares with the clean run: pass its logits")
        reference = clean.double().log_softmax(-1)
        return (reference.exp() * (reference - logprobs)).sum(-1)

    def to_dict(self) -> dict:
        return {"kind": self.kind, "tokens": list(self.tokens), "text": str(self)}

    def __str__(self) -> str:
        if self.kind == "diff":
            return f"log p({self.tokens[0]!r}) - log p({self.tokens[1]!r})"
        if self.kind == "prob":
            return f"p({self.tokens[0]!r})"
        if self.kind == "logprob":
            return f"log p({self.tokens[0]!r})"
        if self.kind == "kl":
            return "KL(clean || run)"
        return f"{getattr(self.fn, '__name__', 'fn')}(logits)"
