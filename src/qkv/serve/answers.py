"""The JSON the API gives, as pydantic models: what `/docs` shows of each answer.

Nothing here checks anything: the answers are made by `qkv.serve.compute` and `qkv.serve.long`,
and these models describe them for the OpenAPI description and clients generated from it.
What the API takes, and how a request is checked, is `qkv.serve.schemas`.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field


class ModelInfo(BaseModel):
    name: str
    kind: Literal["encoder", "decoder"]
    family: str
    num_layers: int
    num_heads: int = Field(description="the most heads a layer has")
    heads_per_layer: list[int] = Field(
        description="each layer's own number of heads (Qwen3.5's linear layers have more)"
    )
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
    tokens: list[str] = Field(description="the text's tokens, by their names in the vocabulary")
    pieces: list[str] = Field(
        description="each token's text as the tokenizer's decoder writes it (what the page "
        "shows): ' river' for 'Ġriver', a byte of a character split over tokens as <0xE6>"
    )
    words: list[WordSpan]
    layers: list[int]
    heads: list[int]
    shape: list[int] = Field(description="[layers, heads, T, T]")
    format: Literal["lists", "base64"]
    encoding: str
    weights: list = Field(
        description="[layer][head]: a T x T matrix, or its base64 string; "
        "null for a head its layer does not have"
    )
    on_words: str | None = Field(
        None,
        description="where some layers attend over compressed entries (DeepSeek-V4): "
        "which, and that their entries' weights are shown on the words by the compressor's "
        "coefficients (an attribution); null elsewhere",
    )
    effective: str | None = Field(
        None,
        description="where some layers keep a running memory (linear attention): their "
        "effective weights are signed and sum to anything, so they are sent as each row's "
        "shares of |w|, and this says so; null where every layer is a softmax",
    )
    effective_layers: list[int] = Field(
        default_factory=list, description="the layers sent as such shares"
    )
    sinks: dict | None = Field(
        None,
        description="`indices`: the first and the special tokens, where a query's largest "
        "weight is named an attention sink; `said`: the sentence, its {token}, {index}, {query} "
        "and {weight} filled in by the page",
    )


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
    ended: str = Field(
        description="what ended it, in words: the end-of-text token, "
        "max_new_tokens (told apart by the count), the time limit or a cancel"
    )


class LongProgress(BaseModel):
    model: str
    detail: str = Field(description="one line: how far it has got; ask again")
    tokens: int = Field(description="the text's tokens, T")
    ahead: int = Field(
        description="texts this model reads before it (the one being read included); 0 once "
        "its turn has come"
    )
    layers_done: int = Field(description="layers summarized so far")
    num_layers: int


class LongAnswer(BaseModel):
    model: str
    tokens: list[str] = Field(description="the text's T tokens")
    layers: list[int]
    heads: list[int]
    query_bin: int = Field(description="queries per row of a head's heatmap")
    key_bin: int = Field(description="keys per column of a head's heatmap")
    top_k: int = Field(description="keys kept per query in a head's top_keys")
    mean_entropy: list[list[float]] = Field(
        description="[layer][head]: each query's entropy (nats), averaged over the queries"
    )
    mean_first_token_mass: list[list[float]] = Field(
        description="[layer][head]: each query's weight on token 0, averaged"
    )
    most_received_keys: list[list[list[int]]] = Field(
        description="[layer][head]: the 3 keys whose weights summed over every query are largest"
    )
    most_received: list[list[list[float]]] = Field(description="[layer][head]: those sums")


class LongHeadAnswer(BaseModel):
    model: str
    layer: int
    head: int
    num_tokens: int = Field(description="T")
    query_bin: int
    key_bin: int
    shape: list[int] = Field(description="[Rq, Rk]: the heatmap's rows and columns (<= 256)")
    format: Literal["lists", "base64"]
    heatmap: list | str = Field(
        description="cell [i][j]: the LARGEST weight of queries i*query_bin.. over keys "
        "j*key_bin.. (lists, or base64 of float32)"
    )
    entropy: list[float] = Field(description="[query]: its weights' entropy in nats")
    first_token_mass: list[float] = Field(description="[query]: its weight on token 0")
    top_keys: list[list[int]] = Field(description="[query]: its top_k keys, strongest first")
    top_weights: list[list[float]] = Field(description="[query]: their weights")
    received: list[float] = Field(description="[key]: its weights summed over every query")


class LongRegionAnswer(BaseModel):
    model: str
    layer: int
    head: int
    queries: list[int] = Field(description="[q0, q1]")
    keys: list[int] = Field(description="[k0, k1]")
    shape: list[int] = Field(description="[q1 - q0, k1 - k0]")
    format: Literal["lists", "base64"]
    weights: list | str = Field(description="every weight [query][key] (lists, or base64)")
    query_tokens: list[str]
    key_tokens: list[str]


class Problem(BaseModel):
    detail: str = Field(description="one line: what was wrong and what is allowed")
    limit: str | None = Field(
        None, description="413: the name of the limit it is over, as GET /api/models lists it"
    )
