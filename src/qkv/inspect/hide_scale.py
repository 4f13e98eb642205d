"""A scale for `hide`'s number: the same question asked of every other word.

"Hiding 'river' from 'bank' changes its final vector by 1 - cosine 0.0388" says nothing
until it is set beside something. The scale asked of the same model, the same text and the
same heads: hide each other word of the text instead (everywhere asked at once) and rank the
key's change among theirs. Each is `hide(..., table=False)`: a clean run and one knockout;
a long text asks at most MOST of them, the words nearest the query (the key where there is
no query), so the scale costs a bounded number of runs beside the table's.
"""

from __future__ import annotations

from dataclasses import dataclass

MOST = 24  # other words hidden for the scale, at most


@dataclass(frozen=True)
class OtherWord:
    """One other word of the text, hidden instead of the key: its name (as `explain` takes
    words, "the#2") and the change it makes (1 - cosine of the query's final vector)."""

    word: str
    total: float


def other_words(encoded, key_spans, query_span, causal: bool, total_of) -> tuple[list, int]:
    """(the other words hidden, how many other words there are): each word of `encoded` (the
    first prompt) that is neither a key nor the query, hidden in its place (`total_of(name)`:
    the change hiding that word makes, hide's own), largest change first; the MOST nearest
    the query (or the first key) where there are more. A decoder's query sees only earlier
    words: the words after it are left out, as they cannot be hidden from it."""
    taken = {tuple(span) for span in key_spans}
    if query_span is not None:
        taken.add(tuple(query_span))
    near = (query_span if query_span is not None else key_spans[0])[0]
    candidates = [
        word for word in encoded.words()
        if (word.token_start, word.token_end) not in taken
        and not (causal and query_span is not None and word.token_start >= query_span[1])
    ]  # fmt: skip
    asked = sorted(candidates, key=lambda word: abs(word.token_start - near))[:MOST]
    found = [OtherWord(word.name, total_of(word.name)) for word in asked]
    return sorted(found, key=lambda w: -w.total), len(candidates)


def key_rank(total: float, others: list[OtherWord]) -> int:
    """The key's place (from 1) among the other words by the change hiding it makes."""
    return 1 + sum(other.total > total for other in others)
