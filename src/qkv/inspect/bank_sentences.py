"""Sixteen short sentences with "bank" once each: eight by a river, eight where money is kept.

Only the other words tell the sense: "river" and "money" themselves appear in one sentence
at most, so a probe that separates the senses has read the context, not one telltale word.

>>> len(SENTENCES) == len(LABELS) == 16, sorted(set(LABELS))
(True, ['money', 'river'])
"""

from __future__ import annotations

_LABELLED = [
    ("The bank on the side of the river was muddy.", "river"),  # the article's example
    ("We had a picnic on the grassy bank.", "river"),
    ("The boat drifted slowly toward the bank.", "river"),
    ("Ducks waddled up the steep bank after their swim.", "river"),
    ("She sat on the bank and dipped her feet in the stream.", "river"),
    ("After the flood, the bank of the creek had washed away.", "river"),
    ("Fishermen lined the bank at dawn, casting into the water.", "river"),
    ("Reeds and willows grew thick along the bank.", "river"),
    ("The bank approved my loan.", "money"),
    ("I deposited my paycheck at the bank this morning.", "money"),
    ("The bank raised its interest rates again.", "money"),
    ("She opened a savings account at the bank downtown.", "money"),
    ("Robbers broke into the bank vault overnight.", "money"),
    ("The bank charged me a fee for the overdraft.", "money"),
    ("He asked the bank for a mortgage on the house.", "money"),
    ("My bank sent a new debit card in the mail.", "money"),
]

SENTENCES: list[str] = [sentence for sentence, _ in _LABELLED]
LABELS: list[str] = [label for _, label in _LABELLED]
