"""The tokenizer of a `.gguf` file, rebuilt with the `tokenizers` package.

Rebuilt the way transformers builds it (AutoTokenizer with gguf_file) from the file's own
vocabulary, merges and token types: "gpt2" files are byte-level BPE, "llama" files are
sentencepiece-style BPE.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path
from typing import Any

from gguf import TokenType
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from qkv.io.unicode import bytes_to_unicode

# Split patterns for the byte-level pre-tokenizer tags whose text is not split GPT-2's way;
# any other tag (e.g. SmolLM2's "smollm") keeps GPT-2's, as transformers does.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLITS = {tag: _LLAMA3_SPLIT for tag in ("llama-bpe", "llama3", "llama-v3", "smaug-bpe", "dbrx")}
_SPLITS["tekken"] = _TEKKEN_SPLIT


def gguf_tokenizer(meta: dict[str, Any], path: Path) -> tuple[Tokenizer, dict[str, Any]]:
    """The tokenizer transformers builds from the same file (AutoTokenizer with gguf_file), and
    its settings. `tokenizer.ggml.model` "gpt2" is byte-level BPE; "llama" is sentencepiece BPE."""
    kind, tokens = meta.get("tokenizer.ggml.model"), meta.get("tokenizer.ggml.tokens")
    if kind not in ("gpt2", "llama") or not tokens:
        raise ValueError(f"{path} has tokenizer model {kind!r}; supported: gpt2, llama")
    _check_vocabulary(meta, path)
    types = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    named = {}
    for name, key in [("bos", "bos"), ("eos", "eos"), ("pad", "padding"), ("unk", "unknown")]:
        index = meta.get(f"tokenizer.ggml.{key}_token_id")
        named[f"{name}_token"] = (
            tokens[index] if index is not None and index < len(tokens) else None
        )
    config = {
        **named,
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", kind == "llama")),
        "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        "chat_template": meta.get("tokenizer.chat_template"),
    }

    tokenizer = _byte_level(meta) if kind == "gpt2" else _sentencepiece(meta)
    # Control tokens stay whole and special. In a byte-level vocabulary, one spelled outside the
    # byte alphabet is a llama.cpp mislabel, and transformers leaves it out.
    alphabet = set(bytes_to_unicode().values()) if kind == "gpt2" else None
    control = [
        token
        for token, kind_of in zip(tokens, types, strict=True)
        if kind_of == TokenType.CONTROL and (alphabet is None or set(token) <= alphabet)
    ]
    tokenizer.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in control])
    user = [t for t, k in zip(tokens, types, strict=True) if k == TokenType.USER_DEFINED]
    if user:  # the vocabulary's 49,152 entries are read out only where a file has such tokens
        vocab = tokenizer.get_vocab()
        user = [t for t in user if t in vocab]
    tokenizer.add_tokens([AddedToken(t, normalized=False, special=False) for t in user])
    missing = [t for t in named.values() if t is not None and t not in control]
    tokenizer.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in missing])

    # what transformers' add_bos_token / add_eos_token do: "<s>:0 $A:0" for one sequence
    bos = [named["bos_token"]] if config["add_bos_token"] and named["bos_token"] else []
    eos = [named["eos_token"]] if config["add_eos_token"] and named["eos_token"] else []

    def template(sequence: str, type_id: int) -> list[str]:
        return (
            [f"{t}:{type_id}" for t in bos]
            + [f"${sequence}:{type_id}"]
            + [f"{t}:{type_id}" for t in eos]
        )

    tokenizer.post_processor = processors.TemplateProcessing(
        single=template("A", 0),
        pair=template("A", 0) + template("B", 1),
        special_tokens=[(t, tokenizer.token_to_id(t)) for t in bos + eos],
    )
    return tokenizer, config


def _check_vocabulary(meta: dict[str, Any], path: Path) -> None:
    """The header's vocabulary is lists of the right kinds and lengths, and its token ids
    are whole numbers; an id past the vocabulary names no token (as transformers reads it)."""
    tokens = meta["tokenizer.ggml.tokens"]
    if not isinstance(tokens, list) or not all(type(t) is str for t in tokens):
        raise ValueError(f"{path}: tokenizer.ggml.tokens must be an array of strings")
    per_token = [("token_type", (int,), "whole numbers"), ("scores", (int, float), "numbers")]
    for key, kinds, what in per_token:
        values = meta.get(f"tokenizer.ggml.{key}")
        if values is not None and (
            not isinstance(values, list)
            or len(values) != len(tokens)
            or not all(type(v) in kinds for v in values)
        ):
            raise ValueError(
                f"{path}: tokenizer.ggml.{key} must be an array of {len(tokens)} {what}, one "
                "per token"
            )
    merges = meta.get("tokenizer.ggml.merges")
    if merges is not None and (
        not isinstance(merges, list) or not all(type(m) is str and " " in m for m in merges)
    ):
        raise ValueError(f"{path}: tokenizer.ggml.merges must be an array of 'left right' strings")
    for key in ("bos", "eos", "padding", "unknown"):
        index = meta.get(f"tokenizer.ggml.{key}_token_id")
        if index is not None and (type(index) is not int or index < 0):
            raise ValueError(
                f"{path}: tokenizer.ggml.{key}_token_id must be a whole number >= 0, got {index!r}"
            )


def _merges(meta: dict[str, Any]) -> list[tuple[str, ...]]:
    return [tuple(merge.split(" ")) for merge in meta["tokenizer.ggml.merges"]]


@functools.cache
def _outside(alphabet: frozenset[str]) -> re.Pattern:
    """A pattern that finds a character outside the byte-level alphabet."""
    return re.compile(f"[^{''.join(re.escape(c) for c in sorted(alphabet))}]")


def _byte_level(meta: dict[str, Any]) -> Tokenizer:
    spelling = bytes_to_unicode()
    alphabet = frozenset(spelling.values())
    tokens = meta["tokenizer.ggml.tokens"]
    if _outside(alphabet).search("".join(tokens)) is None:  # one pass, not one set a token
        vocab = dict(zip(tokens, range(len(tokens)), strict=True))
    else:
        vocab = {
            t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8")): index
            for index, t in enumerate(tokens)
        }
    bpe = models.BPE(vocab, _merges(meta), continuing_subword_prefix="", end_of_word_suffix="")
    tokenizer = Tokenizer(bpe)
    split = _SPLITS.get(meta.get("tokenizer.ggml.pre"))
    if split is None:
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def _sentencepiece(meta: dict[str, Any]) -> Tokenizer:
    """Sentencepiece BPE with byte fallback; without merges in the file, they are recovered
    from the scores: every split of a token into two tokens, best-scoring token first."""
    tokens = meta["tokenizer.ggml.tokens"]
    vocab = {token: index for index, token in enumerate(tokens)}
    if "tokenizer.ggml.merges" in meta:
        merges = _merges(meta)
    else:
        scores = meta.get("tokenizer.ggml.scores") or [0.0] * len(tokens)
        found = []
        for token, score in dict(zip(tokens, scores, strict=True)).items():
            pairs = [(token[:i], token[i:]) for i in range(1, len(token))]
            pairs = sorted(
                (p for p in pairs if p[0] in vocab and p[1] in vocab),
                key=lambda p: (vocab[p[0]], vocab[p[1]]),
            )
            found += [(left, right, score) for left, right in pairs]
        found.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
        merges = [(left, right) for left, right, _ in found]
    tokenizer = Tokenizer(models.BPE(vocab, merges, fuse_unk=True, byte_fallback=True))
    # llama.cpp honours add_space_prefix = false; transformers ignores it and always prepends
    prepend = "never" if meta.get("tokenizer.ggml.add_space_prefix") is False else "first"
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme=prepend, split=False)
    parts = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if prepend == "first":
        parts.append(decoders.Strip(content=" ", left=1, right=0))
    tokenizer.decoder = decoders.Sequence(parts)
    return tokenizer
