"""qkv.data.word_level: word-level tokenizers with each family's special tokens and ids."""

from __future__ import annotations

import pytest

from qkv.data import bank_corpus, bank_vocabulary, word_tokenizer
from qkv.io.tokenizer import Tokenizer

SPECIALS = {
    "bert": ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"],
    "bart": ["<s>", "<pad>", "</s>", "<unk>", "<mask>"],
    "gpt": ["<|endoftext|>", "<unk>"],
}
ENDS = {"bert": ("[CLS]", "[SEP]"), "bart": ("<s>", "</s>"), "gpt": (None, None)}
SENTENCES = [s.text for split in ("train", "heldout") for s in bank_corpus(40, split=split)]


@pytest.mark.parametrize("style", SPECIALS)
def test_specials_come_first_then_the_words_sorted(style):
    tokenizer = word_tokenizer(["river", "bank", "the", "bank"], style=style)
    tokens = [tokenizer.id_to_token(i) for i in range(len(tokenizer))]
    assert tokens == [*SPECIALS[style], "bank", "river", "the"]


def test_named_special_tokens():
    bert = word_tokenizer(["x"], style="bert")
    assert (bert.pad_id, bert.bos_id, bert.eos_id) == (0, None, None)
    assert bert.special_tokens["mask_token"] == "[MASK]"
    bart = word_tokenizer(["x"], style="bart")
    assert (bart.bos_id, bart.pad_id, bart.eos_id) == (0, 1, 2)
    assert bart.special_tokens["mask_token"] == "<mask>"
    gpt = word_tokenizer(["x"], style="gpt")
    assert (gpt.bos_id, gpt.eos_id, gpt.pad_id) == (None, 0, 0)


@pytest.mark.parametrize("style", SPECIALS)
def test_bank_sentences_encode_whole_words_between_the_markers(style):
    tokenizer = word_tokenizer(bank_vocabulary(), style=style)
    unk = tokenizer.token_to_id(tokenizer.special_tokens["unk_token"])
    first, last = ENDS[style]
    for text in SENTENCES:
        encoded = tokenizer.encode(text)
        words = encoded.tokens[1:-1] if first else encoded.tokens
        assert words == text.split() and unk not in encoded.ids
        if first:
            assert (encoded.tokens[0], encoded.tokens[-1]) == (first, last)
        assert tokenizer.decode(encoded.ids) == text


def test_unknown_words_become_unk():
    tokenizer = word_tokenizer(bank_vocabulary(), style="bert")
    assert tokenizer.encode("the bank of zanzibar").tokens[-2] == "[UNK]"


@pytest.mark.parametrize("style", SPECIALS)
def test_save_and_load_give_the_same_ids(style, tmp_path):
    tokenizer = word_tokenizer(bank_vocabulary(), style=style)
    tokenizer.save(tmp_path)
    loaded = Tokenizer.from_folder(tmp_path)
    assert loaded.special_tokens == tokenizer.special_tokens
    assert (loaded.bos_id, loaded.eos_id, loaded.pad_id) == (
        tokenizer.bos_id,
        tokenizer.eos_id,
        tokenizer.pad_id,
    )
    for text in [*SENTENCES, "the [MASK] bank <mask> ."]:
        assert loaded.encode(text).ids == tokenizer.encode(text).ids


@pytest.mark.parametrize(
    ("words", "style", "message"),
    [
        ([], "bert", "words is empty"),
        (["[PAD]"], "bert", "words is empty"),
        (["river"], "t5", "bert, bart, gpt"),
        (["don't"], "gpt", "would be split"),
    ],
)
def test_bad_arguments_are_refused(words, style, message):
    with pytest.raises(ValueError, match=message):
        word_tokenizer(words, style=style)
