"""Stop strings, on texts chosen so the answer is known."""

from __future__ import annotations

import pytest

from qkv.generate import Continuation


class _Pieces:
    """A stand-in for the tokenizer's stream: each 'token' is already its text."""

    def push(self, piece):
        return piece

    def finish(self):
        return ""


@pytest.mark.parametrize(
    ("pieces", "stop", "text", "streamed"),
    [
        (["Hel", "lo", " wor", "ld"], ["wor"], "Hello ", ["Hel", "lo", " "]),
        (["a", "b", "X", "c"], ["bc"], "abXc", ["a", "", "bX", "c"]),
        (["ab", "c", "d"], ["bcd"], "a", ["a", "", ""]),
        (["one", " two"], [], "one two", ["one", " two"]),
    ],
)
def test_stop_strings_cut_the_text_and_the_stream_never_shows_what_is_cut(
    pieces, stop, text, streamed
):
    continuation = Continuation(_Pieces(), stop)
    shown = []
    for piece in pieces:
        if continuation.done:
            break
        shown.append(continuation.push(piece))
    if not continuation.done:
        shown.append(continuation.finish())
    assert continuation.text == text
    assert "".join(shown) == text
    assert shown[: len(streamed)] == streamed
