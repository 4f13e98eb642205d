"""The JSON the API takes, as pydantic models: what `/docs` shows of each request (what it
gives back is `qkv.serve.answers`).

Every request is checked here, where it enters, before any work: fields it does not know are
refused (a misspelt "layre" is an error, not ignored); numbers are strict (`"head": false`
or `"2"` is not a head); text is real text (a lone surrogate such as "\\ud800" is valid
JSON but no tokenizer can read it); words and lists are not empty; layers and heads count
from 0 and are named once each. What depends on the server (its models, `Limits`) is
checked by `Request.check` and written into its OpenAPI description by `with_limits`, so
a client generated from `/openapi.json` sends only what this server takes. No field is a
file path: a model is named by the name the server gave it at start-up.
"""

from __future__ import annotations

import copy
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field

from qkv.serve.limits import Limits, TooLarge

LIMIT = "x-qkv-limit"  # in a schema: which of the server's numbers `with_limits` writes there


def readable(value: str) -> str:
    """Refuse a lone surrogate: valid JSON ("\\ud800"), not text any tokenizer reads.

    >>> readable("bank")
    'bank'
    >>> readable("bank\\ud800")
    Traceback (most recent call last):
    ...
    ValueError: character 4 is a lone surrogate (U+D800), not text; send valid UTF-8
    """
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as error:
        raise ValueError(
            f"character {error.start} is a lone surrogate (U+{ord(value[error.start]):04X}), "
            "not text; send valid UTF-8"
        ) from None
    return value


def some_text(value: str) -> str:
    if not value.strip():
        raise ValueError("is empty or only spaces; give some text")
    return value


def whole(value):
    """JSON's whole numbers: 2 and 2.0 (JSON Schema's integers both), not 2.5, "2" or false."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value  # then strictly an int: a bool or a string is refused


def once_each(values: list[int]) -> list[int]:
    """Refuse a repeat: each layer or head is sent once, so an answer's size is known."""
    seen: set[int] = set()
    for value in values:
        if value in seen:
            raise ValueError(f"{value} is given twice; name each once (leave it out for all)")
        seen.add(value)
    return values


String = Annotated[str, AfterValidator(readable)]  # every string: at most max_chars
WHOLE = BeforeValidator(whole)  # after a whole number's Field, so its bounds are in its schema
Text = Annotated[
    String,
    AfterValidator(some_text),
    Field(json_schema_extra={"pattern": r"\S"}, description="the text to read"),
]
Word = Annotated[
    String,
    AfterValidator(some_text),
    Field(
        json_schema_extra={"pattern": r"\S"},
        description='a word of the text as written, case ignored; "bank#2" is its second '
        "occurrence",
    ),
]
ModelName = Annotated[
    Annotated[String, Field(json_schema_extra={LIMIT: "models"})] | None,
    Field(description="a model this server loaded at start-up (GET /api/models); default: "
          "the first one"),
]  # fmt: skip
GeneratingModel = Annotated[
    Annotated[String, Field(json_schema_extra={LIMIT: "generating models"})] | None,
    Field(description="a decoder this server loaded (GET /api/models: generates); default: "
          "the first of them"),
]  # fmt: skip
Layer = Annotated[int, Field(ge=0, json_schema_extra={LIMIT: "layer"}, description="from 0"), WHOLE]
Head = Annotated[int, Field(ge=0, json_schema_extra={LIMIT: "head"}, description="from 0"), WHOLE]
Layers = Annotated[
    list[Layer],
    Field(min_length=1, json_schema_extra={"uniqueItems": True, LIMIT: "layers"}),
    AfterValidator(once_each),
]
Heads = Annotated[
    list[Head],
    Field(min_length=1, json_schema_extra={"uniqueItems": True, LIMIT: "heads"}),
    AfterValidator(once_each),
]
Sentences = Annotated[list[Text], Field(min_length=2, json_schema_extra={LIMIT: "max_sentences"})]
PerSentence = Annotated[
    list[String], Field(min_length=2, json_schema_extra={LIMIT: "max_sentences"})
]


class Request(BaseModel):
    # strict: JSON's own types only (no "2" for 2, no false for 0); python-re: the schema's
    # patterns mean what Python's re (and so str.strip) means
    model_config = ConfigDict(extra="forbid", strict=True, regex_engine="python-re")

    def check(self, limits: Limits) -> None:
        """TooLarge when any string of the request is over the server's max_chars."""
        for name, value in self:
            strings = value if isinstance(value, list) else [value]
            for i, string in enumerate(strings):
                if isinstance(string, str):
                    limits.check_text(string, f"{name}[{i}]" if isinstance(value, list) else name)


class AttentionRequest(Request):
    model: ModelName = None
    text: Annotated[Text, Field(examples=["The bank on the side of the river"])]
    layers: Layers | None = Field(None, description="layers to send (from 0); default: all")
    heads: Heads | None = Field(None, description="heads to send (from 0); default: all")
    format: Literal["lists", "base64"] = Field(
        "lists",
        description="lists: nested lists of floats [layer][head][query][key]; base64: one "
        "string per head, the T x T float32 matrix's little-endian bytes (exact, 4x smaller)",
    )


class TraceRequest(Request):
    model: ModelName = None
    text: Annotated[Text, Field(examples=["The bank on the side of the river"])]
    query: Annotated[Word, Field(examples=["bank"])]
    key: Annotated[Word, Field(description="the word giving context", examples=["river"])]
    layer: Layer | None = Field(None, description="default: where query attends most to key")
    head: Head | None = Field(None, description="default: where query attends most to key")


Position = Annotated[int, Field(ge=0, description="a token position, from 0"), WHOLE]


class WhyRequest(Request):
    model: ModelName = None
    text: Annotated[Text, Field(examples=["I sat by the river bank"])]
    query_index: Position = Field(examples=[6])
    key_index: Position = Field(examples=[5])
    layer: Layer | None = Field(None, description="default: where query attends most to key")
    head: Head | None = Field(None, description="default: where query attends most to key")
    checks: Annotated[int, Field(ge=0, le=5), WHOLE] = Field(
        3, description="how many top parts of each side to remove for real (0: none)"
    )
    top: Annotated[int, Field(ge=1, le=50), WHOLE] = Field(
        10, description="how many of the largest terms and parts to list"
    )
    grid: bool = Field(False, description="send every term, the full parts x parts grid")


class ContributionsRequest(Request):
    model: ModelName = None
    text: Annotated[Text, Field(examples=["The bank on the side of the river"])]
    query: Annotated[Word, Field(examples=["bank"])]
    layer: Layer
    head: Head


class ProbeRequest(Request):
    model: ModelName = None
    word: Annotated[Word, Field(description="the word to follow", examples=["bank"])]
    sentences: Sentences | None = Field(
        None,
        description="sentences that each use the word; none for 'bank': 16 labelled ones",
        examples=[["The bank on the side of the river", "The bank approved my loan."]],
    )
    labels: PerSentence | None = Field(None, description="the word's sense in each sentence")
    cues: PerSentence | None = Field(None, description="the word that tells the sense in each")

    def check(self, limits: Limits) -> None:
        super().check(limits)
        for name in ("sentences", "labels", "cues"):
            given = getattr(self, name) or []
            if len(given) > limits.max_sentences:
                raise TooLarge(
                    f"{len(given)} {name}; this server probes at most {limits.max_sentences} "
                    "sentences at once (max_sentences)"
                )


class NextRequest(Request):
    model: GeneratingModel = None
    text: Annotated[Text, Field(examples=["The bank on the side of the"])]
    top: Annotated[int, Field(ge=1, le=100), WHOLE] = Field(
        10, description="how many of the most likely tokens"
    )


class GenerateRequest(Request):
    model: GeneratingModel = None
    prompt: Annotated[Text, Field(examples=["The bank on the side of the river"])]
    max_new_tokens: (
        Annotated[int, Field(ge=1, json_schema_extra={LIMIT: "max_new_tokens"}), WHOLE] | None
    ) = Field(None, description="at most the server's max_new_tokens; default: 32, or that")
    temperature: Annotated[float, Field(ge=0, allow_inf_nan=False)] = Field(
        0.0, description="0 is greedy"
    )
    top_k: Annotated[int, Field(ge=1), WHOLE] | None = None
    top_p: Annotated[float, Field(gt=0, le=1, allow_inf_nan=False)] | None = None
    # at most 2**32 - 1: a bound a client reading JSON numbers as doubles reads exactly
    seed: Annotated[int, Field(ge=0, le=2**32 - 1), WHOLE] | None = None
    stop: list[String] = Field([], max_length=8, description="end at any of these strings")
    chat: bool = Field(False, description="wrap the prompt in the model's chat template")


class HideRequest(Request):
    model: ModelName = None
    text: Annotated[Text, Field(examples=["The bank on the side of the river"])]
    key: Annotated[Word, Field(description="the word to hide", examples=["river"])]
    query: Annotated[Word, Field(examples=["bank"])] | None = Field(
        None, description="the word it is hidden from; default: from every word"
    )
    layers: Layers | None = Field(None, description="layers to hide it in (from 0); default: all")
    heads: Heads | None = Field(None, description="heads to hide it in (from 0); default: all")
    table: bool = Field(
        True,
        description="false: only the key hidden in every layer and head asked at once (total, "
        "next: one run), no effect per head (null); the page asks that, then a layer at a time",
    )
    scale: bool | None = Field(
        None,
        description="also hide each other word instead (`others`, and `scale` in words: the "
        "key's rank among them); default: with the table. The page asks it with the total",
    )


class HeadsRequest(Request):
    model: ModelName = None


# ------------------------------------------------------------------ long texts (docs/serve.md)

LongText = Annotated[
    String,
    AfterValidator(some_text),
    Field(
        json_schema_extra={"pattern": r"\S", LIMIT: "max_long_chars"},
        description="the text, up to max_long_tokens tokens (and max_long_chars characters)",
    ),
]
Span = Annotated[
    list[Annotated[int, Field(ge=0), WHOLE]],
    Field(min_length=2, max_length=2, description="[first, last + 1]: token positions from 0"),
]
Format = Literal["lists", "base64"]
FORMAT = Field(
    "lists",
    description="lists: nested lists of floats; base64: the float32 matrix's little-endian "
    "bytes, row-major (exact, 4x smaller)",
)


class LongRequest(Request):
    model: ModelName = None
    text: LongText

    def check(self, limits: Limits) -> None:
        """The text against max_long_chars (not max_chars), the model's name as any string."""
        limits.check_long_text(self.text)
        if self.model is not None:
            limits.check_text(self.model, "model")


class LongHeadRequest(LongRequest):
    layer: Layer
    head: Head
    format: Format = FORMAT


class LongRegionRequest(LongRequest):
    layer: Layer
    head: Head
    queries: Span = Field(examples=[[0, 64]])
    keys: Span = Field(examples=[[0, 64]])
    format: Format = FORMAT


def with_limits(schema: dict, limits: Limits, models: dict) -> dict:
    """The app's OpenAPI description with this server's numbers: every request string's
    maxLength (max_chars), the models' names (and which generate), the largest layer and
    head, max_sentences and max_new_tokens. `models`: {name: Served}."""
    schema = copy.deepcopy(schema)
    described = [served.describe() for served in models.values()]
    layers = max(d["num_layers"] for d in described)
    heads = max(d["num_heads"] for d in described)
    generating = [d["name"] for d in described if d["generates"]]
    numbers = {
        "models": {"enum": list(models)},
        "generating models": {"enum": generating} if generating else {},
        "layer": {"maximum": layers - 1},
        "head": {"maximum": heads - 1},
        "layers": {"maxItems": layers},
        "heads": {"maxItems": heads},
        "max_sentences": {"maxItems": limits.max_sentences},
        "max_new_tokens": {"maximum": limits.max_new_tokens},
        "max_long_chars": {"maxLength": limits.max_long_chars},
    }

    def fill(node, request: bool) -> None:
        if isinstance(node, list):
            for item in node:
                fill(item, request)
        if not isinstance(node, dict):
            return
        if LIMIT in node:
            node.update(numbers[node.pop(LIMIT)])
        if request and node.get("type") == "string" and "enum" not in node:
            node.setdefault("maxLength", limits.max_chars)  # a long text's is its own
        for value in node.values():
            fill(value, request)

    for name, component in schema.get("components", {}).get("schemas", {}).items():
        fill(component, name.endswith("Request"))
    return schema
