"""The JSON the API takes and gives, as pydantic models: what `/docs` shows.

Requests refuse fields they do not know (a misspelt "layre" is an error, not ignored), and
no field is a file path: a model is named by the name the server gave it at start-up.
Layers, heads and tokens count from 0.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

ModelName = Annotated[
    str | None,
    Field(
        description="a model this server loaded at start-up (GET /api/models); default: "
        "the first one"
    ),
]
Text = Annotated[
    str, Field(description="the text to read", examples=["The bank on the side of the river"])
]
Word = Annotated[
    str,
    Field(
        description='a word of the text as written, case ignored; "bank#2" is its second '
        "occurrence",
        examples=["bank"],
    ),
]
Index = Annotated[int, Field(description="counted from 0")]


class Request(BaseModel):
    model_config = ConfigDict(extra="forbid")


class AttentionRequest(Request):
    model: ModelName = None
    text: Text
    layers: list[int] | None = Field(None, description="layers to send (from 0); default: all")
    heads: list[int] | None = Field(None, description="heads to send (from 0); default: all")
    format: Literal["lists", "base64"] = Field(
        "lists",
        description="lists: nested lists of floats [layer][head][query][key]; base64: one "
        "string per head, the T x T float32 matrix's little-endian bytes (exact, 4x smaller)",
    )


class TraceRequest(Request):
    model: ModelName = None
    text: Text
    query: Word
    key: Annotated[str, Field(description="the word giving context", examples=["river"])]
    layer: Index | None = Field(None, description="default: where query attends most to key")
    head: Index | None = Field(None, description="default: where query attends most to key")


class ContributionsRequest(Request):
    model: ModelName = None
    text: Text
    query: Word
    layer: Index
    head: Index


class ProbeRequest(Request):
    model: ModelName = None
    word: Annotated[str, Field(description="the word to follow", examples=["bank"])]
    sentences: list[str] | None = Field(
        None,
        description="sentences that each use the word; none for 'bank': 16 labelled ones",
        examples=[["The bank on the side of the river", "The bank approved my loan."]],
    )
    labels: list[str] | None = Field(None, description="the word's sense in each sentence")
    cues: list[str] | None = Field(None, description="the word that tells the sense in each")


class NextRequest(Request):
    model: ModelName = None
    text: Text
    top: int = Field(10, ge=1, le=100, description="how many of the most likely tokens")


class GenerateRequest(Request):
    model: ModelName = None
    prompt: Annotated[str, Field(examples=["The bank on the side of the river"])]
    max_new_tokens: int | None = Field(
        None, ge=1, description="at most the server's max_new_tokens; default: 32, or that"
    )
    temperature: float = Field(0.0, ge=0, description="0 is greedy")
    top_k: int | None = Field(None, ge=1)
    top_p: float | None = Field(None, gt=0, le=1)
    seed: int | None = None
    stop: list[str] = Field([], max_length=8, description="end at any of these strings")
    chat: bool = Field(False, description="wrap the prompt in the model's chat template")


# ------------------------------------------------------------------ answers (for /docs)


class ModelInfo(BaseModel):
    name: str
    kind: Literal["encoder", "decoder"]
    family: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    width: int
    context_window: int
    generates: bool


class ModelsAnswer(BaseModel):
    version: str
    models: list[ModelInfo]
    limits: dict[str, float]
    examples: list[str] = Field(description="the article's sentence and the probe's 'bank' set")


class WordSpan(BaseModel):
    word: str = Field(description="its name for a trace: 'bank', 'bank#2'")
    tokens: list[int] = Field(description="its tokens [start, end)")


class AttentionAnswer(BaseModel):
    model: str
    text: str
    tokens: list[str]
    words: list[WordSpan]
    layers: list[int]
    heads: list[int]
    shape: list[int] = Field(description="[layers, heads, T, T]")
    format: Literal["lists", "base64"]
    encoding: str
    weights: list = Field(description="[layer][head]: a T x T matrix, or its base64 string")


class ContributionItem(BaseModel):
    token: str
    index: int
    weight: float = Field(description="its softmax weight, 0 to 1")
    size: float = Field(
        description="the norm of its scaled value vector after the output projection"
    )


class ContributionsAnswer(BaseModel):
    model: str
    text: str
    tokens: list[str]
    query: str
    query_index: int
    layer: int
    head: int
    causal: bool
    contributions: list[ContributionItem]
    by_weight: list[int] = Field(description="token indices, largest weight first")
    by_size: list[int] = Field(description="token indices, largest size first")


class NextItem(BaseModel):
    id: int
    token: str
    text: str
    probability: float
    logit: float


class NextAnswer(BaseModel):
    model: str
    text: str
    tokens: list[str]
    next: list[NextItem]


class GenerateAnswer(BaseModel):
    model: str
    text: str = Field(description="the new text, the prompt not repeated")
    finished: Literal["end", "time limit", "cancelled"] = Field(
        description="end: the end-of-text token or max_new_tokens; time limit: generate_s"
    )
    limit_s: float


class Problem(BaseModel):
    detail: str = Field(description="one line: what was wrong and what is allowed")
