"""qkv.data.seq2seq: alignments are right, and held-out sources never appear in training."""

from __future__ import annotations

import pytest

from qkv.data import TASKS, seq2seq_corpus, task_symbols

EXPECTED_ALIGNMENT = {
    "copy": lambda length: list(range(length)),
    "reverse": lambda length: list(reversed(range(length))),
    "swap": lambda length: [min(i + 1, length - 1) if i % 2 == 0 else i - 1 for i in range(length)],
}


@pytest.mark.parametrize("task", TASKS)
def test_every_target_symbol_copies_its_aligned_source_symbol(task):
    for example in seq2seq_corpus(task, 300, seed=1, min_length=3, max_length=9, symbols=5):
        source, target = example.source.split(), example.target.split()
        assert 3 <= len(source) <= 9 and set(source) <= set(task_symbols(5))
        assert list(example.alignment) == EXPECTED_ALIGNMENT[task](len(source))
        assert target == [source[j] for j in example.alignment]


def test_swap_exchanges_adjacent_pairs():
    examples = seq2seq_corpus("swap", 200, seed=0)
    example = next(e for e in examples if len(e.source.split()) == 5)
    a, b, c, d, e = example.source.split()
    assert example.target.split() == [b, a, d, c, e]


def test_heldout_sources_never_appear_in_training():
    train = {e.source for seed in (0, 1) for e in seq2seq_corpus("copy", 3000, seed=seed)}
    heldout = {
        e.source for seed in (0, 1) for e in seq2seq_corpus("copy", 300, split="heldout", seed=seed)
    }
    assert len(heldout) > 250 and not train & heldout


def test_lengths_and_symbols_are_spread_uniformly():
    examples = seq2seq_corpus("copy", 2000, seed=0, min_length=4, max_length=7, symbols=4)
    lengths = [len(e.source.split()) for e in examples]
    assert all(400 < lengths.count(length) < 600 for length in range(4, 8))  # 500 expected
    symbols = [s for e in examples for s in e.source.split()]
    assert all(0.22 < symbols.count(s) / len(symbols) < 0.28 for s in "abcd")


def test_same_arguments_same_examples_and_same_sources_across_tasks():
    assert seq2seq_corpus("reverse", 30, seed=4) == seq2seq_corpus("reverse", 30, seed=4)
    assert seq2seq_corpus("reverse", 30, seed=4) != seq2seq_corpus("reverse", 30, seed=5)
    sources = {task: [e.source for e in seq2seq_corpus(task, 30, seed=4)] for task in TASKS}
    assert sources["reverse"] == sources["swap"] == sources["copy"]


def test_symbols_are_the_first_letters():
    assert task_symbols() == list("abcdefghijklmnop")
    assert len(task_symbols(26)) == 26


@pytest.mark.parametrize(
    ("args", "kwargs", "message"),
    [
        (("sort", 5), {}, "reverse, swap, copy"),
        (("copy", 5), {"split": "val"}, "train, heldout"),
        (("copy", 0), {}, "positive int"),
        (("copy", 5), {"min_length": 6, "max_length": 5}, "min_length <= max_length"),
        (("copy", 5), {"symbols": 27}, "from 2 to 26"),
        (("copy", 5), {"symbols": 1}, "from 2 to 26"),
        # the only sources, "a" and "b", both hash into training: no held-out one exists
        (
            ("copy", 1),
            {"split": "heldout", "min_length": 1, "max_length": 1, "symbols": 2},
            "only 0",
        ),
    ],
)
def test_bad_arguments_are_refused(args, kwargs, message):
    with pytest.raises(ValueError, match=message):
        seq2seq_corpus(*args, **kwargs)
