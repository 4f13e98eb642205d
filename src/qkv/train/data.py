"""A run's tokenizer and data, made once in the run folder and read back on resume.

Text files: a tokenizer trained on them (run/tokenizer) and token shards (run/data),
written by the first process before the others read them. Generated corpora (the bank
sentences, the toy seq2seq tasks) are regenerated from the seed: they are small and
deterministic, so only their tokenizer is saved, for people to read.
"""

from __future__ import annotations

from pathlib import Path

from qkv.data import (
    TokenShards,
    bank_corpus,
    bank_vocabulary,
    seq2seq_corpus,
    task_symbols,
    train_tokenizer,
    word_tokenizer,
    write_shards,
)
from qkv.io.files import write_folder_atomically
from qkv.io.run_config import RunConfig
from qkv.io.tokenizer import Tokenizer
from qkv.train.batches import Examples

TOKENIZER_STYLE = {"gpt2": "gpt", "llama": "gpt", "bert": "bert", "bart": "bart"}
# With data.sense_targets, the masked objective's target at "bank": the sense as a word of
# its own (only targets: no input sentence contains them); where the sentence does not tell,
# the target is "bank" itself.
SENSE_WORDS = {"river": "bank_river", "money": "bank_money"}
SENSES = ("river", "money", "untold")


def prepare(config: RunConfig, run: Path, dist):
    """(tokenizer, train data, validation data) for the run; see Batches for their types."""
    data = config.data
    folder = run / "tokenizer"
    if data.kind == "text":
        if dist.main and not (run / "data" / "shards.json").exists():
            tokenizer = train_tokenizer(list(data.paths), kind=data.tokenizer,
                                        vocab_size=data.vocab_size)  # fmt: skip
            _save_tokenizer(tokenizer, folder)
            write_shards(list(data.paths), tokenizer, run / "data",
                         val_fraction=data.val_fraction, seed=config.train.seed)  # fmt: skip
        dist.barrier()
        tokenizer = Tokenizer.from_folder(folder)
        train, val = TokenShards(run / "data", "train"), TokenShards(run / "data", "val")
        need = config.model.context + (1 if config.objective == "causal" else 0)
        for split, shards in (("train", train), ("validation", val)):
            if len(shards) < need:
                raise ValueError(
                    f"the {split} split has {len(shards)} tokens, fewer than one training "
                    f"block of {need}; give more text or a shorter model.context"
                )
        return tokenizer, train, val

    tokenizer, train, val = _generated(config)
    if dist.main and not folder.exists():
        _save_tokenizer(tokenizer, folder)
    longest = max(len(ids) for ids in [*train.inputs, *val.inputs, *(train.targets or [])])
    if longest + 1 > config.model.context:
        raise ValueError(
            f"the longest example has {longest} tokens; model.context {config.model.context} "
            f"must be at least {longest + 1}"
        )
    return tokenizer, train, val


def _generated(config: RunConfig):
    data, seed = config.data, config.train.seed
    style = TOKENIZER_STYLE[config.model.arch]
    if data.kind == "bank":
        tokenizer = word_tokenizer([*bank_vocabulary(), *SENSE_WORDS.values()], style=style)
        splits = [bank_corpus(data.examples, split="train", seed=seed, untold=data.untold),
                  bank_corpus(data.heldout, split="heldout", seed=seed)]  # fmt: skip
        made = []
        for split in splits:
            encoded = [tokenizer.encode(s.text) for s in split]
            fixed = None
            if config.objective == "masked" and data.sense_targets:
                # "bank" stays "bank" in the input; its target is the sense, spelled out
                target = {s: tokenizer.token_to_id(SENSE_WORDS.get(s, "bank")) for s in SENSES}
                fixed = [{e.find("bank")[0]: target[s.sense]}
                         for e, s in zip(encoded, split, strict=True)]  # fmt: skip
            made.append(Examples([e.ids for e in encoded], fixed_labels=fixed))
        return tokenizer, *made
    tokenizer = word_tokenizer(task_symbols(data.symbols), style=style)
    made = []
    for split, n in (("train", data.examples), ("heldout", data.heldout)):
        examples = seq2seq_corpus(
            data.kind, n, split=split, seed=seed, symbols=data.symbols,
            min_length=data.min_length, max_length=data.max_length,
        )  # fmt: skip
        made.append(
            Examples(
                [tokenizer.encode(e.source).ids for e in examples],
                [tokenizer.encode(e.target, add_special_tokens=False).ids for e in examples],
            )
        )
    return tokenizer, *made


def _save_tokenizer(tokenizer, folder: Path) -> None:
    """All or nothing, so a reader never sees half a tokenizer; one left by a run killed
    before its shards were written is replaced."""
    write_folder_atomically(folder, tokenizer.save, replace=True)
