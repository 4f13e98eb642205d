"""Text as Unicode and as bytes: text no encoding can write is refused, and a token that
holds part of a character is shown as its bytes.

Byte-level BPE (GPT-2's, SmolLM2's, Llama 3's) spells each byte as a printable character
("Ġ" is the space); sentencepiece names a byte token "<0xE6>". `token_bytes` reads either
spelling back into bytes, and `with_hex_bytes` writes bytes as text with each byte that is
not part of a whole character as <0xNN>.
"""

from __future__ import annotations


def check_unicode(text: str, what: str) -> None:
    """Refuse text that is not valid Unicode: a lone surrogate (U+D800..U+DFFF), which no
    encoding can write. Python makes them from bytes that are not UTF-8 (a command line's
    argv, a file read with errors="surrogateescape"); the tokenizer would fail on them.

    >>> check_unicode("river bank", "the text")
    >>> check_unicode("bank\\udcff", "the text")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ValueError: the text is not valid Unicode: character 4 is '\\udcff', which stands for ...
    """
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        i, bad = error.start, text[error.start]
        what = f"{what} is not valid Unicode: character {i}"
        if 0xDC80 <= ord(bad) <= 0xDCFF:  # Python's stand-in for a byte it could not decode
            raise ValueError(
                f"{what} is {bad!r}, which stands for the byte {ord(bad) - 0xDC00:#04x} that is "
                "not UTF-8 (a lone surrogate); give UTF-8 text"
            ) from None
        raise ValueError(f"{what} is a lone surrogate {bad!r}; give UTF-8 text") from None


def token_bytes(name: str | None) -> bytes | None:
    """The bytes a token's name would spell as byte-level BPE's (GPT-2's printable spelling of
    each byte: "Ġ" is the space) or as sentencepiece's byte token ("<0xE6>"); None where it
    cannot ("▁bank"). A name of printable ASCII spells its own bytes in any tokenizer, so the
    caller checks them against what the decoder made of the token.

    >>> token_bytes("Ġæ"), token_bytes("<0xE6>"), token_bytes("▁bank")
    (b' \\xe6', b'\\xe6', None)
    """
    if name is None:
        return None
    if len(name) == 6 and name.startswith("<0x") and name.endswith(">"):
        try:
            return bytes([int(name[3:5], 16)])
        except ValueError:
            return None
    byte_of = {character: byte for byte, character in bytes_to_unicode().items()}
    if all(character in byte_of for character in name):
        return bytes(byte_of[character] for character in name)
    return None


def with_hex_bytes(raw: bytes) -> str:
    """UTF-8 bytes as text, each byte that is not part of a whole character as <0xNN>.

    >>> with_hex_bytes(" 日".encode()[:2]), with_hex_bytes("本".encode())
    (' <0xE6>', '本')
    """
    shown, start = [], 0
    while start < len(raw):
        try:
            shown.append(raw[start:].decode("utf-8"))
            break
        except UnicodeDecodeError as error:
            shown.append(raw[start : start + error.start].decode("utf-8"))
            shown += [f"<0x{b:02X}>" for b in raw[start + error.start : start + error.end]]
            start += error.end
    return "".join(shown)


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's spelling of bytes as printable characters: 'Ġ' is the space byte 32."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    others = [b for b in range(256) if b not in printable]
    spelling = {b: chr(b) for b in printable}
    spelling |= {b: chr(256 + n) for n, b in enumerate(others)}
    return spelling
