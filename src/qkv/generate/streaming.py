"""Generated tokens to text as it is made: each sequence's text cut at the first stop string,
streamed a piece at a time, never showing text that the result will not contain."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from torch import Tensor


class Continuation:
    """The text one sequence has generated so far, cut at the first stop string.

    Text that might be the start of a stop string is held back from the stream until the
    next tokens tell, so a stream never shows text that the result will not contain.
    """

    def __init__(self, stream, stop: list[str]):
        self.stream, self.stop = stream, [s for s in stop if s]
        self.text, self.emitted, self.done = "", 0, False
        self.ends: list[int] = []  # the text's length after each token, before any cut
        self.within: int | None = None  # after a stop string: how many tokens the text holds

    def push(self, token: int) -> str:
        """Add a token; return the text that is now certain (possibly empty)."""
        piece = self.stream.push(token)
        self.ends.append(len(self.text) + len(piece))
        return self._add(piece, final=False)

    def finish(self) -> str:
        """End the sequence: return whatever was held back."""
        piece = self._add(self.stream.finish(), final=True)
        self.done = True
        return piece

    def _add(self, piece: str, final: bool) -> str:
        text = self.text + piece
        cut = min((i for i in (text.find(s) for s in self.stop) if i >= 0), default=-1)
        if cut >= 0:  # a stop string: keep what came before it, and stop
            text, self.done, final = text[:cut], True, True
            self.within = sum(end <= cut for end in self.ends)  # the tokens wholly before it
        held = 0 if final else max((_overlap(text, s) for s in self.stop), default=0)
        self.text = text
        out, self.emitted = text[self.emitted : len(text) - held], len(text) - held
        return out


def _overlap(text: str, stop: str) -> int:
    """How many last characters of text begin `stop` (at most len(stop) - 1)."""
    for k in range(min(len(stop) - 1, len(text)), 0, -1):
        if text.endswith(stop[:k]):
            return k
    return 0


def continuations(
    steps: Iterable[Tensor],
    tokenizer,
    eos: set[int],
    stop: list[str],
    stream: Callable[[int, str], None] | None,
    n: int,
) -> list[Continuation]:
    """Each of n sequences' text as `steps` give its tokens (B,), to an end-of-sequence token
    (any of `eos`), a stop string or the last step; pieces streamed as stream(row, text) as
    they are certain."""
    rows = [Continuation(tokenizer.stream(), stop) for _ in range(n)]

    def emit(row: int, piece: str) -> None:
        if stream is not None and piece:
            stream(row, piece)

    for tokens in steps:
        for row, token in enumerate(tokens.tolist()):
            if not rows[row].done:
                emit(row, rows[row].finish() if token in eos else rows[row].push(token))
        if all(r.done for r in rows):
            break
    for row, continuation in enumerate(rows):  # text held back for a partial character
        if not continuation.done:
            emit(row, continuation.finish())
    return rows


def end_ids(hf_config: dict, tokenizer) -> set[int]:
    """The tokens that end a generation: config.json's eos_token_id (one or a list) and the
    tokenizer's end-of-sequence token."""
    ids = hf_config.get("eos_token_id")
    ids = set(ids if isinstance(ids, list) else [] if ids is None else [ids])
    if tokenizer.eos_id is not None:
        ids.add(tokenizer.eos_id)
    return ids
