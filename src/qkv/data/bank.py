"""The "bank" corpus: generated sentences where one cue word tells which bank is meant.

Every sentence has "bank" once and one cue word, a river word ("reeds") or a money word
("loan"). The frames (sentence templates) are sense-neutral and each is used equally often
with both senses, so neither the frame nor the position of "bank" tells the sense: a model
that gets it right has attended from "bank" to the cue. The cue comes before "bank" in some
frames and after it in others, at varying distances, and optional fillers ("yesterday",
"old", "anna") make sentences of one frame differ. The "heldout" split uses frames that
"train" never does, with the same cues, to test that what was learned is the cue and not
the frame.

>>> for sentence in bank_corpus(2, seed=1):
...     print(sentence.sense, sentence.cue, "|", sentence.text)
money mortgage | lucy wrote a letter about the mortgage near the little bank .
river stream | sara wrote a letter about the stream near the bank .
"""

from __future__ import annotations

import random
from dataclasses import dataclass

SENSES = ("river", "money")
SPLITS = ("train", "heldout")

CUES = {
    "river": (
        "river", "stream", "creek", "reeds", "ducks", "willows", "boat",
        "mud", "otters", "frogs", "heron", "canoe", "fish", "rushes",
    ),
    "money": (
        "loan", "deposit", "cash", "account", "mortgage", "teller", "savings",
        "cheque", "interest", "vault", "overdraft", "salary", "coins", "pension",
    ),
}  # fmt: skip

# Sense-neutral nouns for the cue's slot, in sentences that do not tell which bank is meant
# (`bank_corpus(untold=...)`): with them, a model cannot treat "no river word" as "money".
UNTOLD = "untold"
NEUTRAL = (
    "weather", "news", "crowd", "noise", "sign", "parade", "festival", "statue",
    "bus", "lamp", "clock", "poster", "music", "traffic",
)  # fmt: skip

# Sense-neutral words for the optional slots; "{name}" is always filled.
FILLERS = {
    "time": ("yesterday", "today", "recently", "earlier"),
    "adv": ("quietly", "slowly", "happily", "briefly", "calmly"),
    "adj": ("old", "small", "big", "little", "familiar", "nearby"),
    "name": ("anna", "tom", "maria", "ben", "lucy", "omar", "sara", "james"),
}

# Cue before "bank" and cue after alternate, so each split has both, half and half.
_TRAIN_FRAMES = (
    "{time} {name} saw the {cue} near the {adj} bank .",
    "{time} {name} walked past the {adj} bank and the {cue} .",
    "{name} {adv} talked about the {cue} at the {adj} bank .",
    "the {adj} bank was quiet , but the {cue} was not .",
    "{time} {name} thought of the {cue} and then of the {adj} bank .",
    "{name} took a photo of the {adj} bank {time} , with the {cue} in it .",
    "the {cue} was the first thing {name} noticed at the {adj} bank .",
    "{name} {adv} drew the {adj} bank and the {cue} for a school project .",
    "{time} the {cue} made {name} smile on the way to the {adj} bank .",
    "at the {adj} bank {name} {adv} asked about the {cue} .",
    "{name} said the {cue} by the {adj} bank had changed a lot .",
    "the {adj} bank is where {name} first heard about the {cue} .",
    "{time} {name} read a story about the {cue} and the {adj} bank .",
    "{name} {adv} pointed from the {adj} bank to the {cue} .",
    "because of the {cue} , {name} went back to the {adj} bank {time} .",
    "{name} remembers the {adj} bank {time} , and mostly the {cue} .",
    "nobody told {name} that the {cue} and the {adj} bank were so close .",
    "{time} the {adj} bank looked different to {name} because of the {cue} .",
    "{name} wrote a letter about the {cue} near the {adj} bank .",
    "the {adj} bank , {name} said {adv} , was all about the {cue} .",
    "{name} {adv} checked the {cue} before leaving the {adj} bank .",
    "{time} {name} came to the {adj} bank only for the {cue} .",
    "the {cue} is the reason {name} likes the {adj} bank .",
    "{name} looked at the {adj} bank {adv} and asked about the {cue} .",
    "{time} {name} and a friend spoke about the {cue} , then left the {adj} bank .",
    "{name} was standing at the {adj} bank when someone mentioned the {cue} .",
)
_HELDOUT_FRAMES = (
    "{time} {name} dreamed about the {cue} beside the {adj} bank .",
    "{name} {adv} showed a friend the {adj} bank and the {cue} .",
    "the {cue} kept {name} busy all day at the {adj} bank .",
    "{time} the {adj} bank reminded {name} of the {cue} .",
    "{name} forgot the {cue} and {adv} returned to the {adj} bank .",
    "on a cold morning the {adj} bank was empty except for the {cue} .",
    "{name} once painted the {cue} next to the {adj} bank .",
    "everyone at the {adj} bank {time} was talking about the {cue} .",
    "after hearing about the {cue} , {name} {adv} went over to the {adj} bank .",
    "{name} sent a postcard of the {adj} bank showing the {cue} .",
)
FRAMES = _TRAIN_FRAMES + _HELDOUT_FRAMES  # BankSentence.frame indexes this
_SPLIT_FRAMES = {
    "train": range(len(_TRAIN_FRAMES)),
    "heldout": range(len(_TRAIN_FRAMES), len(FRAMES)),
}


@dataclass(frozen=True)
class BankSentence:
    """One generated sentence, with what a probe or a test needs to know about it."""

    text: str  # lowercase words and punctuation separated by single spaces
    sense: str  # "river" or "money"
    cue: str  # the one word that tells the sense, once in text
    frame: int  # index into FRAMES


def bank_corpus(
    n: int, *, split: str = "train", seed: int = 0, untold: float = 0.0
) -> list[BankSentence]:
    """`n` sentences of `split` ("train" or "heldout"), the same ones for the same arguments.

    Sentences come in pairs that share a frame, one per sense, shuffled: for even `n` the
    senses are exactly balanced and every frame is as often river as money (for odd `n`, one
    sense has one sentence more). untold: the share of sentences whose cue is replaced by a
    sense-neutral noun (sense "untold", cue that noun), so that they do not tell.

    >>> [s.sense for s in bank_corpus(4, seed=3)].count("river")
    2
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be a positive int, not {n!r}")
    if split not in SPLITS:
        raise ValueError(f"split must be one of {', '.join(SPLITS)}, not {split!r}")
    rng = random.Random(f"bank/{split}/{seed}")  # str seeds are stable across runs
    sentences: list[BankSentence] = []
    for _ in range((n + 1) // 2):
        frame = rng.choice(_SPLIT_FRAMES[split])
        sentences += [_fill(rng, frame, sense) for sense in SENSES]
    rng.shuffle(sentences)
    if not 0.0 <= untold < 1.0:
        raise ValueError(f"untold must be a share in [0, 1), not {untold!r}")
    for i, sentence in enumerate(sentences[:n] if untold else ()):
        if rng.random() < untold:
            noun = rng.choice(NEUTRAL)
            text = sentence.text.replace(f" {sentence.cue} ", f" {noun} ", 1)
            sentences[i] = BankSentence(text=text, sense=UNTOLD, cue=noun, frame=sentence.frame)
    return sentences[:n]


def _fill(rng: random.Random, frame: int, sense: str) -> BankSentence:
    """Fill one frame: the cue, a name, and each optional slot with a filler half the time."""
    slots = {"cue": rng.choice(CUES[sense]), "name": rng.choice(FILLERS["name"])}
    for slot in ("time", "adv", "adj"):
        slots[slot] = rng.choice(FILLERS[slot]) if rng.random() < 0.5 else ""
    text = " ".join(FRAMES[frame].format(**slots).split())  # empty slots leave no double space
    return BankSentence(text=text, sense=sense, cue=slots["cue"], frame=frame)


def bank_vocabulary() -> list[str]:
    """Every word a sentence of either split can contain, sorted.

    A tokenizer built from it covers the held-out split too, so no held-out word is [UNK].

    >>> {"bank", "reeds", "loan", "yesterday", "."} <= set(bank_vocabulary())
    True
    """
    words = {w for frame in FRAMES for w in frame.split() if not w.startswith("{")}
    words |= {w for cues in (*CUES.values(), NEUTRAL) for w in cues}
    words |= {w for fillers in FILLERS.values() for w in fillers}
    return sorted(words)
