"""qkv.data.text: tokenizers trained on files, shards written whole, read back exactly."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from qkv.data import TokenShards, bank_corpus, read_text, train_tokenizer, write_shards
from qkv.data.text import document_parts

SAMPLE = "Café naïve 日本語 🙂\n  indented\tand\r\nspaced  text, the river bank.\n"


def write_corpus(folder, files=3, paragraphs=6) -> list:
    """A few KB of text in `files` files, each `paragraphs` documents apart at blank lines."""
    sentences = iter(bank_corpus(files * paragraphs * 3, seed=7))
    paths = []
    for f in range(files):
        documents = [
            " ".join(next(sentences).text for _ in range(3)) + f" ({f}, {p}) {SAMPLE}"
            for p in range(paragraphs)
        ]
        paths.append(folder / f"part{f}.txt")
        paths[-1].write_text("\n\n".join(documents), encoding="utf-8")
    return paths


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("corpus"))


@pytest.fixture(scope="module")
def tokenizers(corpus):
    return {kind: train_tokenizer(corpus, kind=kind, vocab_size=400) for kind in ("bpe", "char")}


def test_read_text_names_the_first_bad_byte(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_bytes(b"ok\n\xff")
    with pytest.raises(ValueError, match=r"notes.txt: byte 3 \(line 2, column 1\).*\(0xff\)"):
        read_text(path)
    path.write_bytes("one\ncafé ".encode() + b"\xfe more")  # columns count characters
    with pytest.raises(ValueError, match=r"byte 10 \(line 2, column 6\) is not UTF-8 \(0xfe\)"):
        read_text(path)
    with pytest.raises(ValueError, match="missing.txt: no such file"):
        read_text(tmp_path / "missing.txt")


def test_read_text_keeps_every_character(tmp_path):
    (tmp_path / "a.txt").write_bytes(SAMPLE.encode())
    assert read_text(tmp_path / "a.txt") == SAMPLE


@pytest.mark.parametrize("kind", ["bpe", "char"])
def test_decode_gives_the_text_back(tokenizers, kind):
    tokenizer = tokenizers[kind]
    text = SAMPLE + "the willows near the bank"
    ids = tokenizer.encode(text).ids
    assert tokenizer.decode(ids) == text
    assert tokenizer.eos_id == tokenizer.pad_id == tokenizer.token_to_id("<|endoftext|>")


def test_bpe_learns_merges_and_char_keeps_characters(tokenizers):
    bpe, char = tokenizers["bpe"], tokenizers["char"]
    assert len(bpe) == 400
    assert len(bpe.encode("the river bank").ids) < len("the river bank")
    assert len(char.encode("the river bank").ids) == len("the river bank")


def test_char_vocab_size_keeps_the_most_frequent_characters(corpus):
    tokenizer = train_tokenizer(corpus, kind="char", vocab_size=5)  # 2 specials + 3 characters
    assert len(tokenizer) == 5
    assert {tokenizer.id_to_token(i) for i in (2, 3, 4)} == {" ", "e", "a"}
    assert tokenizer.encode("a z").tokens == ["a", " ", "<unk>"]


def test_wordpiece_is_bert_like(corpus):
    tokenizer = train_tokenizer(corpus, kind="wordpiece", vocab_size=300)
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    assert [tokenizer.id_to_token(i) for i in range(5)] == specials
    tokens = tokenizer.encode("the river bank, the loan").tokens
    assert tokens[0] == "[CLS]" and tokens[-1] == "[SEP]" and "[UNK]" not in tokens
    assert tokenizer.special_tokens["mask_token"] == "[MASK]"


def test_train_tokenizer_refuses_bad_input(corpus, tmp_path):
    with pytest.raises(ValueError, match="bpe, wordpiece, char"):
        train_tokenizer(corpus, kind="unigram")
    with pytest.raises(ValueError, match="at least 257"):
        train_tokenizer(corpus, kind="bpe", vocab_size=100)
    (tmp_path / "bad.txt").write_bytes(b"fine\n\xc3(")
    with pytest.raises(ValueError, match=r"bad.txt: byte 5 \(line 2, column 1\)"):
        train_tokenizer([*corpus, tmp_path / "bad.txt"], kind="char")


def expected_stream(tokenizer, meta, split) -> list[int]:
    """The split's documents, tokenized one by one and each followed by EOS, in stored order."""
    stream = []
    for document in meta["splits"][split]["documents"]:
        text = document_parts(read_text(document["path"]))[document["part"]]
        ids = [*tokenizer.encode(text, add_special_tokens=False).ids, meta["eos_id"]]
        stream += ids[document["start"] : document["start"] + document["tokens"]]
    return stream


@pytest.mark.parametrize("kind", ["bpe", "char"])
def test_shards_hold_the_documents_joined_by_eos(corpus, tokenizers, tmp_path, kind):
    tokenizer = tokenizers[kind]
    meta = write_shards(corpus, tokenizer, tmp_path / "shards", val_fraction=0.2, shard_tokens=300)
    assert json.loads((tmp_path / "shards" / "shards.json").read_text()) == meta
    assert meta["dtype"] == "uint16" and meta["eos_id"] == tokenizer.eos_id
    records = {split: meta["splits"][split]["documents"] for split in ("train", "val")}
    keys = {split: {(d["path"], d["part"]) for d in records[split]} for split in records}
    assert len(keys["val"]) == round(18 * 0.2) and len(keys["train"] | keys["val"]) == 18
    assert not keys["train"] & keys["val"]
    for split in ("train", "val"):
        shards = TokenShards(tmp_path / "shards", split)
        stream = expected_stream(tokenizer, meta, split)
        assert len(shards) == len(stream) == meta["splits"][split]["tokens"]
        assert shards.read(0, len(shards)).tolist() == stream
        assert all(s["tokens"] <= 300 for s in meta["splits"][split]["shards"])
    shards = TokenShards(tmp_path / "shards", "train")
    assert len(meta["splits"]["train"]["shards"]) > 2
    crossing = shards.read(290, 20)  # the end of shard 0 and the start of shard 1
    assert crossing.dtype == torch.int64 and crossing.tolist() == stream_of(shards)[290:310]


def stream_of(shards) -> list[int]:
    return np.concatenate([np.asarray(s) for s in shards.shards]).tolist()


def test_one_document_is_cut_into_train_and_val(tokenizers, tmp_path):
    tokenizer = tokenizers["char"]
    (tmp_path / "one.txt").write_text("the river bank " * 20, encoding="utf-8")
    meta = write_shards([tmp_path / "one.txt"], tokenizer, tmp_path / "shards", val_fraction=0.25)
    train, val = (TokenShards(tmp_path / "shards", split) for split in ("train", "val"))
    ids = [*tokenizer.encode("the river bank " * 20).ids, tokenizer.eos_id]
    assert train.read(0, len(train)).tolist() + val.read(0, len(val)).tolist() == ids
    assert len(train) == int(len(ids) * 0.75) == meta["splits"]["train"]["tokens"]


def test_sample_draws_windows_of_the_split(corpus, tokenizers, tmp_path):
    write_shards(corpus, tokenizers["char"], tmp_path / "shards", shard_tokens=500)
    shards = TokenShards(tmp_path / "shards", "train")
    batch = shards.sample(torch.Generator().manual_seed(0), 8, 64)
    assert batch.shape == (8, 64) and batch.dtype == torch.int64
    assert torch.equal(batch, shards.sample(torch.Generator().manual_seed(0), 8, 64))
    assert not torch.equal(batch, shards.sample(torch.Generator().manual_seed(1), 8, 64))
    windows = torch.tensor(stream_of(shards)).unfold(0, 64, 1)  # (positions, 64)
    assert all((windows == row).all(dim=1).any() for row in batch)
    whole = shards.sample(torch.Generator(), 2, len(shards))  # the only window there is
    assert whole[0].tolist() == whole[1].tolist() == stream_of(shards)


def test_sample_refuses_a_split_shorter_than_one_block(corpus, tokenizers, tmp_path):
    write_shards(corpus, tokenizers["char"], tmp_path / "shards")
    val = TokenShards(tmp_path / "shards", "val")
    message = f"the val split has {len(val)} tokens, fewer than one block of {len(val) + 1}"
    with pytest.raises(ValueError, match=message):
        val.sample(torch.Generator(), 1, len(val) + 1)


def test_empty_corpus_is_refused(tokenizers, tmp_path):
    (tmp_path / "blank.txt").write_text("\n\n  \n", encoding="utf-8")
    with pytest.raises(ValueError, match="blank.txt: the corpus is empty"):
        write_shards([tmp_path / "blank.txt"], tokenizers["char"], tmp_path / "shards")
    assert not (tmp_path / "shards").exists()


def test_a_non_empty_out_dir_is_refused(corpus, tokenizers, tmp_path):
    (tmp_path / "shards").mkdir()
    (tmp_path / "shards" / "keep.txt").write_text("mine")
    with pytest.raises(ValueError, match="is not an empty folder"):
        write_shards(corpus, tokenizers["char"], tmp_path / "shards")
    assert [p.name for p in (tmp_path / "shards").iterdir()] == ["keep.txt"]
    (tmp_path / "shards" / "keep.txt").unlink()  # an empty folder is fine
    write_shards(corpus, tokenizers["char"], tmp_path / "shards")
    assert (tmp_path / "shards" / "shards.json").is_file()


def test_a_failure_leaves_nothing_behind(corpus, tokenizers, tmp_path, monkeypatch):
    out = tmp_path / "out"
    out.mkdir()
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"good text\n\nthen \xff")
    with pytest.raises(ValueError, match="bad.txt: byte 16"):
        write_shards([corpus[0], bad], tokenizers["char"], out / "shards")
    assert list(out.iterdir()) == []

    def fail(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr("qkv.data.text.json.dump", fail)  # fails after the shards are written
    with pytest.raises(OSError, match="disk full"):
        write_shards(corpus, tokenizers["char"], out / "shards")
    assert list(out.iterdir()) == []


def test_token_shards_refuses_bad_input(tmp_path):
    with pytest.raises(ValueError, match="train, val"):
        TokenShards(tmp_path, "test")
    with pytest.raises(ValueError, match="shards.json not found"):
        TokenShards(tmp_path, "train")
