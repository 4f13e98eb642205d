"""The words of a text and the tokens each became: what lets a user name "bank#2".

The one rule for naming a word, everywhere a word is asked for (a trace, hide, a probe, the
server): a word that occurs once is named as it is written ("river"); a word that occurs
more than once must say which, "bank#1" or "bank#2", and "bank" alone is refused with the
names there are. Case is ignored. `Encoded.find` is where the rule lives.

>>> from qkv.io.words import Encoded
>>> e = Encoded(ids=[5, 6, 7], tokens=["river", "bank", "bank"], offsets=[(0, 5), (6, 10),
...             (11, 15)], text="river bank bank", special=[False] * 3, word_ids=[0, 1, 2])
>>> e.find("bank#2"), e.find("river")
((2, 3), (0, 1))
>>> e.find("bank")
Traceback (most recent call last):
ValueError: 'bank' occurs 2 times in the text; name one: bank#1, bank#2
>>> [w.name for w in e.words()]
['river', 'bank#1', 'bank#2']
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass


@dataclass(frozen=True)
class Word:
    """One word of a text and the tokens it became.

    `start`/`end` are the word's characters in the text, whitespace excluded; tokens
    `token_start` to `token_end` (exclusive) spell it. `occurrence` counts equal words
    (ignoring case) from 1, so the second "bank" of a sentence is occurrence 2; `count` is
    how many times the word occurs in the text.
    """

    text: str
    start: int
    end: int
    occurrence: int
    token_start: int
    token_end: int
    count: int = 1

    @property
    def name(self) -> str:
        """The name `Encoded.find` takes for this word: "river" for a word that occurs once,
        "bank#1", "bank#2"... for one that occurs more than once."""
        return self.text if self.count == 1 else f"{self.text}#{self.occurrence}"

    @property
    def label(self) -> str:
        """How an error lists this word among the words of a text: "bank", then "bank#2",
        "bank#3"... (short; `name` is what `Encoded.find` takes)."""
        return self.text if self.occurrence == 1 else f"{self.text}#{self.occurrence}"

    @property
    def token_span(self) -> tuple[int, int]:
        return self.token_start, self.token_end


@dataclass(frozen=True)
class Encoded:
    """One encoded text: token ids with the tokens' names, character spans and words.

    offsets[i] is the character span of token i in `text`; tokens the post-processor adds
    ([CLS], [SEP], a BOS) have (0, 0). A character that byte-level BPE splits over several
    tokens gives each of them that character's span. Spans may include the space before a
    word ("Ġbank" -> " bank"); `words()` strips it.
    """

    ids: list[int]
    tokens: list[str]
    offsets: list[tuple[int, int]]
    text: str
    special: list[bool]  # markers, not text: [CLS], [SEP], <|im_start|>, BOS (not [UNK])
    word_ids: list[int | None]  # the pre-tokenizer piece of each token (None where added)
    # each token's own text as people read it, where the tokenizer told it (`Tokenizer.pieces`:
    # " river" for "Ġriver", " <0xE6>" for a byte of a character split over tokens)
    pieces: list[str] | None = None

    def __len__(self) -> int:
        return len(self.ids)

    def words(self) -> list[Word]:
        """The words of the text as the pre-tokenizer splits it, each with its token span.

        A word split into several tokens ("river", "##bank") is one word with a span of
        two tokens. Special tokens and whitespace-only pieces belong to no word.
        """
        groups: list[list[int]] = []
        previous_word, previous_end = None, 0
        for i, (word_id, (start, end)) in enumerate(zip(self.word_ids, self.offsets, strict=True)):
            if self.special[i] or word_id is None:
                previous_word = None
                continue
            # Some pre-tokenizers (Metaspace without splitting) leave a whole sentence as one
            # piece, so whitespace between two tokens (or at the edge of one) starts a word too.
            between = self.text[max(min(previous_end - 1, start), 0) : start + 1]
            if word_id != previous_word or any(c.isspace() for c in between):
                groups.append([])
            groups[-1].append(i)
            previous_word, previous_end = word_id, end

        found: list[tuple[str, int, int, int, int]] = []
        for group in groups:
            # Pure-whitespace tokens at a word's edge (a lone "Ġ") are not part of the word.
            blank = [not self.text[slice(*self.offsets[i])].strip() for i in group]
            if all(blank):
                continue
            first, last = blank.index(False), len(group) - 1 - blank[::-1].index(False)
            group = group[first : last + 1]
            start = min(self.offsets[i][0] for i in group)
            end = max(self.offsets[i][1] for i in group)
            raw = self.text[start:end]
            start += len(raw) - len(raw.lstrip())
            end -= len(raw) - len(raw.rstrip())
            found.append((self.text[start:end], start, end, group[0], group[-1] + 1))
        count = Counter(text.casefold() for text, *_ in found)
        seen: Counter[str] = Counter()
        words: list[Word] = []
        for text, start, end, token_start, token_end in found:
            seen[text.casefold()] += 1
            occurrence, repeats = seen[text.casefold()], count[text.casefold()]
            words.append(Word(text, start, end, occurrence, token_start, token_end, repeats))
        return words

    def find(self, word: str) -> tuple[int, int]:
        """Token span [start, end) of a word: "river"; "bank#1", "bank#2" where it repeats.

        Case is ignored. Raises ValueError naming the words there are when the word is not
        in the text, the names to choose from when it occurs more than once and no
        occurrence is named, or how many there are when the one asked for is past the last.
        """
        name, occurrence = parse_word(word)
        words = self.words()
        matches = [w for w in words if w.text.casefold() == name.casefold()]
        if not matches:
            raise ValueError(
                f"{word!r} is not a word of the text; its words are: {_listing(words)}"
            )
        if occurrence is None and len(matches) > 1:
            names = ", ".join(f"{word}#{n}" for n in range(1, len(matches) + 1))
            raise ValueError(f"'{word}' occurs {len(matches)} times in the text; name one: {names}")
        if occurrence is not None and occurrence > len(matches):
            raise ValueError(
                f"{word!r} asks for occurrence {occurrence} of {name!r}, but the text has "
                f"{len(matches)}: {', '.join(w.name for w in matches)}"
            )
        return matches[(occurrence or 1) - 1].token_span

    def span_text(self, start: int, end: int) -> str:
        """The text that tokens [start, end) cover (special tokens added around it cover none)."""
        if not 0 <= start <= end <= len(self.ids):
            raise ValueError(f"token span [{start}, {end}) is outside 0..{len(self.ids)}")
        spans = [
            self.offsets[i] for i in range(start, end) if self.offsets[i][1] > self.offsets[i][0]
        ]
        if not spans:
            return ""
        return self.text[min(s for s, _ in spans) : max(e for _, e in spans)]


def parse_word(word: str) -> tuple[str, int | None]:
    """A word as a user names it: (the word, the occurrence it names, or None for none).

    >>> parse_word("bank"), parse_word("bank#2"), parse_word("C#")
    (('bank', None), ('bank', 2), ('C#', None))
    """
    name, sep, number = word.rpartition("#")
    if not (sep and name and number.isdigit()):
        name, number = word, ""
    if not name.strip():
        raise ValueError("the word to find is empty; pass a word of the text, like 'bank'")
    if number and int(number) < 1:
        raise ValueError(f"{word!r}: occurrences count from 1 ('{name}#1' is the first)")
    return name, int(number) if number else None


def _listing(words: list[Word], limit: int = 40) -> str:
    labels = [w.label for w in words]
    more = f" (and {len(labels) - limit} more)" if len(labels) > limit else ""
    return (", ".join(labels[:limit]) + more) if labels else "(none)"


def spaced_token(tokenizer, token: str) -> str | None:
    """The model's own token for a word typed without its leading space: " Paris" where the
    user wrote "Paris" and the vocabulary has " Paris" as one token of its own (a byte-level
    or sentencepiece vocabulary writes a word after a space so). None where the token already
    starts with a space, or " " + token is not one token, or is the same token (WordPiece
    drops the space).

    A word the model writes after a space is its spaced token: "Paris" alone is another token
    (rank 9,492 after "The capital of France is", where " Paris" is the top).
    """
    if not token or token[0].isspace():
        return None
    spaced = tokenizer.encode(" " + token, add_special_tokens=False)
    if len(spaced.ids) != 1:
        return None
    plain = tokenizer.encode(token, add_special_tokens=False)
    if list(plain.ids) == list(spaced.ids):
        return None
    return " " + token


def token_note(tokenizer, token: str, what: str) -> str | None:
    """One line telling a user who typed `token` (the `what`: "--token", "the metric's token")
    that the model's own token for the word has a leading space; None where there is none."""
    spaced = spaced_token(tokenizer, token)
    if spaced is None:
        return None
    plain = tokenizer.encode(token, add_special_tokens=False)
    reads = "one token" if len(plain.ids) == 1 else f"{len(plain.ids)} tokens {list(plain.tokens)}"
    return (
        f"{what} {token!r} has no leading space and reads as {reads}; after a word the "
        f"model writes {spaced!r}, one token of its own: give {spaced!r} (quoted) for that"
    )
