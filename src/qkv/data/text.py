"""Any text files to token shards: a tokenizer trained on them, and memory-mapped token files.

`write_shards` turns files into flat streams of token ids (documents joined by EOS) split
into train and validation, stored as raw numpy arrays that `TokenShards` maps into memory:
sampling a batch reads only the bytes it needs, however large the corpus.

>>> document_parts("first part\\n\\n\\nsecond\\n  \\nthird\\n")
['first part', 'second', 'third\\n']
"""

from __future__ import annotations

import json
import os
import random
import re
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tokenizers import Regex, decoders, models, pre_tokenizers, processors, trainers
from tokenizers import Tokenizer as Backend

from qkv.io.files import write_folder_atomically
from qkv.io.tokenizer import Tokenizer

StrPath = str | os.PathLike[str]
KINDS = ("bpe", "wordpiece", "char")
SPLITS = ("train", "val")
_EOT = "<|endoftext|>"
_BERT_SPECIALS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
_BLANK_LINES = re.compile(r"\n(?:[ \t\r\f\v]*\n)+")  # a newline, then one or more blank lines


def read_text(path: StrPath) -> str:
    """The file's text as UTF-8, or a ValueError that says where the first bad byte is.

    The byte is a 0-based offset into the file (as `xxd` and `dd skip=` count); line and
    column are 1-based, the column counted in characters as an editor shows it.
    """
    try:
        data = Path(path).read_bytes()
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
        raise ValueError(f"{path}: no such file") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        line_start = data.rfind(b"\n", 0, error.start) + 1
        line = data.count(b"\n", 0, error.start) + 1
        column = len(data[line_start : error.start].decode("utf-8")) + 1
        raise ValueError(
            f"{path}: byte {error.start} (line {line}, column {column}) is not UTF-8 "
            f"(0x{data[error.start]:02x})"
        ) from None


def document_parts(text: str) -> list[str]:
    """A file's documents: its parts between blank lines, the blank ones dropped."""
    return [part for part in _BLANK_LINES.split(text) if part.strip()]


def train_tokenizer(
    paths: Sequence[StrPath], *, kind: str = "bpe", vocab_size: int = 4096
) -> Tokenizer:
    """A tokenizer trained on the files' text.

    kind: "bpe" (byte-level BPE as GPT-2's: any text encodes, decode gives it back exactly;
    <|endoftext|> is EOS and padding), "wordpiece" (BERT's: [PAD] [UNK] [CLS] [SEP] [MASK],
    adds [CLS] ... [SEP]) or "char" (one token per character, the `vocab_size` - 2 most
    frequent ones, plus <|endoftext|> and <unk>; decode gives the text back exactly where
    no character is <unk>).
    """
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {', '.join(KINDS)}, not {kind!r}")
    smallest = {"bpe": 257, "wordpiece": len(_BERT_SPECIALS) + 1, "char": 3}[kind]
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < smallest:
        raise ValueError(f"vocab_size must be an int of at least {smallest} for {kind}")
    texts = [read_text(path) for path in _check_paths(paths)]
    if kind == "bpe":
        backend = Backend(models.BPE())
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        backend.decoder = decoders.ByteLevel()
        backend.post_processor = processors.ByteLevel(trim_offsets=False)  # as GPT-2's
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=[_EOT],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # all 256 bytes, seen or not
            show_progress=False,
        )
        backend.train_from_iterator(texts, trainer)
        return Tokenizer(backend, eos_token=_EOT, pad_token=_EOT)
    if kind == "wordpiece":
        backend = Backend(models.WordPiece(unk_token="[UNK]"))
        backend.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        backend.decoder = decoders.WordPiece()
        trainer = trainers.WordPieceTrainer(
            vocab_size=vocab_size, special_tokens=list(_BERT_SPECIALS), show_progress=False
        )
        backend.train_from_iterator(texts, trainer)
        backend.post_processor = processors.TemplateProcessing(
            single="[CLS] $A [SEP]",
            pair="[CLS] $A [SEP] $B:1 [SEP]:1",
            special_tokens=[(t, backend.token_to_id(t)) for t in ("[CLS]", "[SEP]")],
        )
        names = dict(zip(("cls_token", "sep_token", "mask_token"), _BERT_SPECIALS[2:], strict=True))
        return Tokenizer(backend, pad_token="[PAD]", unk_token="[UNK]", extra_special_tokens=names)
    counts = Counter(character for text in texts for character in text)
    # Most frequent first, ties in character order, so the same text gives the same ids.
    kept = sorted(counts, key=lambda c: (-counts[c], c))[: vocab_size - 2]
    ids = {token: i for i, token in enumerate([_EOT, "<unk>", *sorted(kept)])}
    backend = Backend(models.WordLevel(ids, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()  # characters join with nothing between them
    return Tokenizer(backend, eos_token=_EOT, pad_token=_EOT, unk_token="<unk>")


def _check_paths(paths: Sequence[StrPath]) -> list[StrPath]:
    if isinstance(paths, (str, os.PathLike)):
        return [paths]  # one file is a corpus too
    if not paths:
        raise ValueError("paths is empty: give at least one text file")
    return list(paths)


def _separator_id(tokenizer: Tokenizer) -> int:
    """EOS, or BERT's [SEP] where there is none: the token that ends each document."""
    for name in ("eos_token", "sep_token"):
        token = tokenizer.special_tokens.get(name)
        if token is not None:
            return tokenizer.token_to_id(token)
    raise ValueError("the tokenizer has no eos_token or sep_token to end documents with")


def write_shards(
    paths: Sequence[StrPath],
    tokenizer: Tokenizer,
    out_dir: StrPath,
    *,
    val_fraction: float = 0.1,
    shard_tokens: int = 1 << 24,
    seed: int = 0,
) -> dict[str, Any]:
    """Tokenize the files into train-NNNNN.bin and val-NNNNN.bin shards plus shards.json.

    Each file is split into documents at blank lines; each document's ids (without the
    tokenizer's [CLS]/BOS markers) are followed by EOS. A seeded shuffle picks about
    `val_fraction` of the documents for validation, at least one, and at least one stays for
    training; a corpus of one document has its token stream cut instead. Each split keeps
    its documents in file order. Shards hold at most `shard_tokens` ids each, as uint16
    where the vocabulary fits, else uint32. The folder appears whole or not at all: it is
    built beside `out_dir` and renamed into place. Returns what shards.json holds.
    """
    if not 0 < val_fraction < 1:
        raise ValueError(f"val_fraction must be between 0 and 1 (exclusive), not {val_fraction}")
    if isinstance(shard_tokens, bool) or not isinstance(shard_tokens, int) or shard_tokens < 1:
        raise ValueError(f"shard_tokens must be a positive int, not {shard_tokens!r}")
    paths = _check_paths(paths)
    out_dir = Path(out_dir)
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise ValueError(f"{out_dir} exists and is not an empty folder; choose a new out_dir")
    eos = _separator_id(tokenizer)
    dtype = np.dtype(np.uint16 if tokenizer.vocab_size <= 1 << 16 else np.uint32)
    documents = []  # (record, ids) in file order
    for path in paths:
        parts = document_parts(read_text(path))
        encodings = tokenizer.backend.encode_batch(parts, add_special_tokens=False)
        for part, encoding in enumerate(encodings):
            if encoding.ids:
                ids = np.array([*encoding.ids, eos], dtype=dtype)
                documents.append(({"path": str(path), "part": part, "start": 0}, ids))
    if not documents:
        raise ValueError(f"{', '.join(map(str, paths))}: the corpus is empty")
    splits = _assign(documents, val_fraction, seed)

    meta: dict[str, Any] = {"dtype": dtype.name, "vocab_size": tokenizer.vocab_size, "eos_id": eos}

    def write(folder: Path) -> None:
        meta["splits"] = {
            split: _write_split(folder, split, splits[split], shard_tokens) for split in SPLITS
        }
        with open(folder / "shards.json", "w", encoding="utf-8") as file:
            json.dump(meta, file, indent=2)
            file.write("\n")

    write_folder_atomically(out_dir, write)
    return meta


def _assign(
    documents: list[tuple[dict[str, Any], np.ndarray]], val_fraction: float, seed: int
) -> dict[str, list[tuple[dict[str, Any], np.ndarray]]]:
    """Documents per split, each split in file order."""
    if len(documents) == 1:
        record, ids = documents[0]
        # ids holds at least one token and EOS, so both parts can have one
        cut = min(max(1, int(len(ids) * (1 - val_fraction))), len(ids) - 1)
        return {"train": [(record, ids[:cut])], "val": [({**record, "start": cut}, ids[cut:])]}
    order = list(range(len(documents)))
    random.Random(seed).shuffle(order)
    n_val = min(max(1, round(len(documents) * val_fraction)), len(documents) - 1)
    val = set(order[:n_val])
    return {
        "train": [d for i, d in enumerate(documents) if i not in val],
        "val": [d for i, d in enumerate(documents) if i in val],
    }


def _write_split(
    folder: Path, split: str, documents: list[tuple[dict[str, Any], np.ndarray]], size: int
) -> dict[str, Any]:
    """Write one split's token stream as shards of at most `size` ids; describe them."""
    stream = np.concatenate([ids for _, ids in documents])  # every split has a document
    shards = []
    for index, start in enumerate(range(0, len(stream), size)):
        name = f"{split}-{index:05d}.bin"
        with open(folder / name, "wb") as file:  # fsynced with its folder
            file.write(stream[start : start + size].tobytes())
        shards.append({"file": name, "tokens": len(stream[start : start + size])})
    documents_meta = [{**record, "tokens": len(ids)} for record, ids in documents]
    return {"tokens": len(stream), "shards": shards, "documents": documents_meta}


class TokenShards:
    """One split of a write_shards folder, read as one long stream of token ids.

    >>> import tempfile
    >>> with tempfile.TemporaryDirectory() as folder:
    ...     np.arange(5, dtype=np.uint16).tofile(f"{folder}/val-00000.bin")
    ...     shard = {"file": "val-00000.bin", "tokens": 5}
    ...     meta = {"dtype": "uint16", "splits": {"val": {"shards": [shard]}}}
    ...     _ = Path(folder, "shards.json").write_text(json.dumps(meta))
    ...     print(TokenShards(folder, "val").read(1, 3))
    tensor([1, 2, 3])
    """

    def __init__(self, folder: StrPath, split: str) -> None:
        if split not in SPLITS:
            raise ValueError(f"split must be one of {', '.join(SPLITS)}, not {split!r}")
        folder = Path(folder)
        path = folder / "shards.json"
        if not path.is_file():
            raise ValueError(f"{path} not found: make the folder with write_shards")
        meta = json.loads(path.read_text(encoding="utf-8"))
        self.split = split
        self.shards = [
            np.memmap(folder / shard["file"], dtype=meta["dtype"], mode="r", shape=shard["tokens"])
            for shard in meta["splits"][split]["shards"]
        ]
        # starts[i] is the stream offset of shard i; the last entry is the total
        self.starts = np.cumsum([0, *(len(shard) for shard in self.shards)])

    def __len__(self) -> int:
        return int(self.starts[-1])

    def read(self, start: int, length: int) -> torch.Tensor:
        """Tokens [start, start + length) of the stream as int64 (length,), across shards."""
        if start < 0 or length < 0 or start + length > len(self):
            raise ValueError(
                f"cannot read {length} tokens from {start}: the {self.split} split has "
                f"{len(self)} tokens"
            )
        pieces = []
        shard = int(np.searchsorted(self.starts, start, side="right")) - 1
        while length > 0:
            offset = start - int(self.starts[shard])
            piece = self.shards[shard][offset : offset + length]
            pieces.append(piece)
            start, length, shard = start + len(piece), length - len(piece), shard + 1
        tokens = np.concatenate(pieces) if pieces else np.empty(0)
        return torch.from_numpy(tokens.astype(np.int64))

    def sample(self, generator: torch.Generator, batch: int, length: int) -> torch.Tensor:
        """`batch` windows of `length` tokens from uniform random starts: int64 (B, T)."""
        if batch < 1 or length < 1:
            raise ValueError(f"batch and length must be at least 1, not {batch} and {length}")
        if len(self) < length:
            raise ValueError(
                f"the {self.split} split has {len(self)} tokens, fewer than one block of "
                f"{length}; use more text or a shorter context"
            )
        starts = torch.randint(0, len(self) - length + 1, (batch,), generator=generator)
        return torch.stack([self.read(int(start), length) for start in starts])  # (B, T)
