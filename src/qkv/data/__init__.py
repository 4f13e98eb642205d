"""Corpora to train and probe attention on: generated toy tasks with known right answers,
and any text files turned into token shards.

`bank` makes sentences where one cue word tells which "bank" is meant; `seq2seq` makes
copy/reverse/swap tasks whose cross-attention alignment is known; `word_level` builds
word-level tokenizers for them; `text` trains tokenizers on text files and writes
memory-mapped shards. Beside torch and numpy, `text` and `word_level` import the
`tokenizers` package (through `qkv.io.tokenizer`): everything that reads a corpus builds or
holds a tokenizer.
"""

from qkv.data.bank import BankSentence, bank_corpus, bank_vocabulary
from qkv.data.seq2seq import TASKS, Seq2SeqExample, seq2seq_corpus, task_symbols
from qkv.data.text import TokenShards, read_text, train_tokenizer, write_shards
from qkv.data.word_level import word_tokenizer

__all__ = [
    "TASKS",
    "BankSentence",
    "Seq2SeqExample",
    "TokenShards",
    "bank_corpus",
    "bank_vocabulary",
    "read_text",
    "seq2seq_corpus",
    "task_symbols",
    "train_tokenizer",
    "word_tokenizer",
    "write_shards",
]
