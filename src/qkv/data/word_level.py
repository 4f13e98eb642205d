"""Word-level tokenizers for the generated corpora: one token per word, nothing split.

A generated corpus has a closed vocabulary, so a word-level tokenizer suits it: every word
is one token, attention maps read word by word, and no word is ever [UNK]. The special
tokens and their ids follow the model family a tokenizer is for (`style`), so a tiny model
trained on it can be saved and loaded as a Hugging Face folder of that family.

>>> tokenizer = word_tokenizer(["river", "bank", "the"], style="bert")
>>> tokenizer.encode("the river bank").tokens
['[CLS]', 'the', 'river', 'bank', '[SEP]']
"""

from __future__ import annotations

from collections.abc import Iterable

from tokenizers import Tokenizer as Backend
from tokenizers import models, pre_tokenizers, processors

from qkv.io.tokenizer import Tokenizer

# Each style: its special tokens in id order, the names qkv's Tokenizer registers them
# under, and the markers its post-processor puts around one text ($A) and a pair ($B).
_STYLES = {
    "bert": {
        "specials": ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"),
        "names": {
            "pad_token": "[PAD]",
            "unk_token": "[UNK]",
            "cls_token": "[CLS]",
            "sep_token": "[SEP]",
            "mask_token": "[MASK]",
        },
        "single": "[CLS] $A [SEP]",
        "pair": "[CLS] $A [SEP] $B:1 [SEP]:1",
    },
    "bart": {
        "specials": ("<s>", "<pad>", "</s>", "<unk>", "<mask>"),  # BART's own order
        "names": {
            "bos_token": "<s>",
            "eos_token": "</s>",
            "pad_token": "<pad>",
            "unk_token": "<unk>",
            "mask_token": "<mask>",
        },
        "single": "<s> $A </s>",
        "pair": "<s> $A </s> </s> $B </s>",
    },
    "gpt": {
        "specials": ("<|endoftext|>", "<unk>"),
        "names": {"eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>", "unk_token": "<unk>"},
        "single": None,  # GPT-2 adds nothing; the caller puts <|endoftext|> between documents
        "pair": None,
    },
}
_WRAPPER_NAMES = ("bos_token", "eos_token", "pad_token", "unk_token")  # Tokenizer's own kwargs


def word_tokenizer(words: Iterable[str], *, style: str) -> Tokenizer:
    """A word-level tokenizer over `words`, with the special tokens of `style`.

    style: "bert" ([PAD]=0 [UNK]=1 [CLS]=2 [SEP]=3 [MASK]=4, adds [CLS] ... [SEP]),
    "bart" (<s>=0 <pad>=1 </s>=2 <unk>=3 <mask>=4, adds <s> ... </s>) or
    "gpt" (<|endoftext|>=0 as EOS and padding, <unk>=1, adds nothing).
    The words follow the specials in sorted order, duplicates dropped. Text is split at
    whitespace and punctuation, so each word must be one such piece ("river", ",").

    >>> tokenizer = word_tokenizer(["b", "a", "b"], style="gpt")
    >>> [tokenizer.id_to_token(i) for i in range(len(tokenizer))]
    ['<|endoftext|>', '<unk>', 'a', 'b']
    """
    if style not in _STYLES:
        raise ValueError(f"style must be one of {', '.join(_STYLES)}, not {style!r}")
    spec = _STYLES[style]
    specials = spec["specials"]
    vocabulary = sorted(set(words) - set(specials))
    if not vocabulary:
        raise ValueError("words is empty: give at least one word besides the special tokens")
    pre_tokenizer = pre_tokenizers.Whitespace()
    for word in vocabulary:
        # A word the pre-tokenizer splits ("don't" -> don ' t) could never be looked up.
        pieces = [piece for piece, _ in pre_tokenizer.pre_tokenize_str(word)]
        if pieces != [word]:
            raise ValueError(
                f"word {word!r} would be split into {pieces}; words must be runs of letters "
                "and digits or of punctuation, without spaces"
            )
    ids = {token: i for i, token in enumerate([*specials, *vocabulary])}
    unk = spec["names"]["unk_token"]
    backend = Backend(models.WordLevel(ids, unk_token=unk))
    backend.pre_tokenizer = pre_tokenizer  # with no decoder, decode joins tokens with spaces
    if spec["single"] is not None:
        markers = sorted({t for t in (spec["single"] + " " + spec["pair"]).split() if t in ids})
        backend.post_processor = processors.TemplateProcessing(
            single=spec["single"],
            pair=spec["pair"],
            special_tokens=[(t, ids[t]) for t in markers],
        )
    names = spec["names"]
    return Tokenizer(
        backend,
        **{name: names.get(name) for name in _WRAPPER_NAMES},
        extra_special_tokens={k: v for k, v in names.items() if k not in _WRAPPER_NAMES},
    )
