"""The probe's sentences file (`qkv probe --sentences FILE`): three forms of line, one per
file, and a one-line refusal of anything else."""

from __future__ import annotations

import pytest

from qkv.inspect.sentences_file import read_sentences


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("The river bank\n\nThe bank paid\n", (["The river bank", "The bank paid"], None, None)),
        ("river\tThe river bank\nmoney \tThe bank paid\n",
         (["The river bank", "The bank paid"], ["river", "money"], None)),
        ("river\triver\tThe river bank\nmoney\tpaid\tThe bank paid\n",
         (["The river bank", "The bank paid"], ["river", "money"], ["river", "paid"])),
    ],
)  # fmt: skip
def test_each_form_gives_texts_labels_and_cues(tmp_path, text, expected):
    path = tmp_path / "sentences.txt"
    path.write_text(text, encoding="utf-8")
    assert read_sentences(path) == expected


@pytest.mark.parametrize(
    ("content", "says"),
    [
        (None, "does not exist"),
        (b"", "is empty"),
        (b"\xff\xfe bank\n", "is not UTF-8 text (byte 0"),
        (b"a\tThe bank\nThe river bank\n", "line 2 has 1 tab-separated columns, line 1 has 2"),
        (b"a\tb\tc\td\n", "line 1 has 4 tab-separated columns; give every line the same form"),
    ],
)
def test_anything_else_is_refused_by_name(tmp_path, content, says):
    path = tmp_path / "sentences.txt"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(ValueError, match=says.replace("(", r"\(")):
        read_sentences(path)
    with pytest.raises(ValueError, match="is a folder"):
        read_sentences(tmp_path)
