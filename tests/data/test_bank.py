"""qkv.data.bank: only the cue tells the sense, and held-out frames are really new."""

from __future__ import annotations

from collections import Counter

import pytest

from qkv.data import bank_corpus, bank_vocabulary
from qkv.data.bank import CUES, FILLERS, SENSES

ALL_CUES = {cue for cues in CUES.values() for cue in cues}
ALL_FILLERS = {word for words in FILLERS.values() for word in words}


def skeleton(sentence) -> str:
    """The frame a sentence came from, as text: the cue marked, the fillers dropped."""
    words = ["<cue>" if w == sentence.cue else w for w in sentence.text.split()]
    return " ".join(w for w in words if w not in ALL_FILLERS)


@pytest.mark.parametrize("split", ["train", "heldout"])
def test_each_sentence_has_bank_once_and_one_cue_of_its_sense(split):
    for sentence in bank_corpus(400, split=split, seed=1):
        words = sentence.text.split()
        assert sentence.text == " ".join(words) == sentence.text.lower()
        assert words[-1] == "." and words.count("bank") == 1
        assert words.count(sentence.cue) == 1 and sentence.cue in CUES[sentence.sense]
        assert set(words) & ALL_CUES == {sentence.cue}  # no second cue, none of the other sense


@pytest.mark.parametrize("n", [2, 10, 300])
def test_senses_are_balanced_within_every_frame(n):
    sentences = bank_corpus(n, seed=5)
    by_frame = Counter((s.frame, s.sense) for s in sentences)
    assert Counter(s.sense for s in sentences) == {"river": n // 2, "money": n // 2}
    assert all(by_frame[frame, "river"] == by_frame[frame, "money"] for frame, _ in by_frame)


def test_words_other_than_cues_and_fillers_are_as_common_in_both_senses():
    sentences = bank_corpus(600, seed=2)
    counts = {sense: Counter() for sense in SENSES}
    for s in sentences:
        counts[s.sense].update(w for w in s.text.split() if w not in ALL_CUES | ALL_FILLERS)
    assert counts["river"] == counts["money"]


def test_heldout_frames_are_not_train_frames():
    train = bank_corpus(2000, split="train", seed=0)
    heldout = bank_corpus(1000, split="heldout", seed=0)
    for sentences in (train, heldout):  # one skeleton per frame: the fillers really drop out
        frames = {s.frame: skeleton(s) for s in sentences}
        assert {(s.frame, skeleton(s)) for s in sentences} == set(frames.items())
    train_frames, heldout_frames = {skeleton(s) for s in train}, {skeleton(s) for s in heldout}
    assert len(train_frames) >= 24 and len(heldout_frames) >= 8
    assert not train_frames & heldout_frames
    assert not {s.frame for s in train} & {s.frame for s in heldout}
    # the model must know every cue, so held-out sentences reuse the training cues
    assert {s.cue for s in heldout} <= {s.cue for s in train} == ALL_CUES


@pytest.mark.parametrize("split", ["train", "heldout"])
def test_cue_comes_before_and_after_bank_at_varying_distances(split):
    offsets = []
    for s in bank_corpus(1000, split=split, seed=3):
        words = s.text.split()
        offsets.append(words.index(s.cue) - words.index("bank"))
    before = sum(offset < 0 for offset in offsets) / len(offsets)
    assert 0.3 < before < 0.7
    assert len({abs(offset) for offset in offsets}) >= 4


def test_fillers_make_sentences_of_one_frame_differ():
    sentences = [s for s in bank_corpus(2000, seed=0) if s.frame == 0 and s.sense == "river"]
    assert len({s.text for s in sentences}) > len({s.cue for s in sentences})
    used = {w for s in sentences for w in s.text.split()} & ALL_FILLERS
    assert used & set(FILLERS["time"]) and used & set(FILLERS["adj"])


def test_same_arguments_same_sentences_and_seeds_or_splits_differ():
    assert bank_corpus(50, seed=3) == bank_corpus(50, seed=3)
    assert bank_corpus(50, seed=3) != bank_corpus(50, seed=4)
    assert bank_corpus(50, seed=3) != bank_corpus(50, split="heldout", seed=3)
    assert len(bank_corpus(7)) == 7


def test_vocabulary_covers_both_splits():
    vocabulary = bank_vocabulary()
    assert vocabulary == sorted(set(vocabulary))
    for split in ("train", "heldout"):
        words = {w for s in bank_corpus(2000, split=split) for w in s.text.split()}
        assert words <= set(vocabulary)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"n": 0}, "n must be a positive int"), ({"n": 4, "split": "test"}, "train, heldout")],
)
def test_bad_arguments_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        bank_corpus(**kwargs)
