"""Token ids to text one token at a time, for showing a generation as it grows."""

from __future__ import annotations

from typing import Protocol


class Decodes(Protocol):
    """What a stream needs of a tokenizer (`qkv.io.tokenizer.Tokenizer` is one)."""

    def decode(self, ids: list[int], *, skip_special_tokens: bool = True) -> str: ...


class TextStream:
    """Turns token ids into text one token at a time, for showing a generation as it grows.

    `push` returns the text that the new token completes. Byte-level BPE may spell one
    character with several tokens; the stream holds such bytes back until the character is
    whole, so it never returns half a character. Pushes plus `finish()` concatenate to
    `decode(all ids)`: each push decodes a short window (from the last emitted token on),
    which is exact for decoders that work token by token, as the byte-level, WordPiece and
    Metaspace/byte-fallback ones do.

    >>> from tokenizers import Tokenizer as Backend, models, pre_tokenizers
    >>> from qkv.io.tokenizer import Tokenizer
    >>> backend = Backend(models.WordLevel({"hi": 0, "there": 1}, unk_token="hi"))
    >>> backend.pre_tokenizer = pre_tokenizers.Whitespace()
    >>> stream = Tokenizer(backend).stream()
    >>> [stream.push(i) for i in (0, 1)]
    ['hi', ' there']
    """

    def __init__(self, tokenizer: Decodes, *, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self.text = ""  # everything returned so far
        # Decoding only a window (the last emitted token onwards) keeps each push O(1)
        # while giving decoders the left context they need (the space before a word).
        self._window_start = 0
        self._emitted_until = 0

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def push(self, token_id: int) -> str:
        """Add one token id; return the newly completed text ("" while a character is partial)."""
        self.ids.append(int(token_id))
        before = self._decode(self.ids[self._window_start : self._emitted_until])
        now = self._decode(self.ids[self._window_start :])
        if len(now) <= len(before) or now.endswith("\ufffd") or not now.startswith(before):
            return ""
        new = now[len(before) :]
        self._window_start, self._emitted_until = self._emitted_until, len(self.ids)
        self.text += new
        return new

    def finish(self) -> str:
        """The text held back: an incomplete character at the end, as decode() shows it."""
        before = self._decode(self.ids[self._window_start : self._emitted_until])
        rest = self._decode(self.ids[self._window_start :])[len(before) :]
        self._window_start = self._emitted_until = len(self.ids)
        self.text += rest
        return rest
