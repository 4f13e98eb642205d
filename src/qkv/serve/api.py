"""The JSON API's routes: each picks its model, then runs its `compute` function in a worker.

Each request is checked where it enters: by its schema (`qkv.serve.schemas`), then its
strings against the server's limits (`Request.check`), before any work. Work runs in the
app's thread pool (`qkv.serve.jobs`), never on the event loop, so a slow request delays no
other; each is bounded by `Limits.timeout_s` (504 past it, the wait for a worker included),
and past it its work is told to stop and does, at its next step. A generation first awaits
its model's turn (503 if it does not come within timeout_s), then runs until
max_new_tokens, the end of the text or `Limits.generate_s`; the turn passes on when its work
has really stopped. A long text is read in its model's own thread, in turn
(`qkv.serve.long_texts`), and a model's census of heads in a thread of its own: a request
waits for either on the event loop, holding no worker, and past half of timeout_s is told to
ask again (a long text's 202, the census's 503).
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from collections.abc import Callable

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from qkv.inspect.article import SENTENCE
from qkv.inspect.bank_sentences import SENTENCES
from qkv.serve import compute, long
from qkv.serve.answers import (
    AttentionAnswer,
    ContributionsAnswer,
    GenerateAnswer,
    LongAnswer,
    LongHeadAnswer,
    LongProgress,
    LongRegionAnswer,
    ModelsAnswer,
    NextAnswer,
    Problem,
)
from qkv.serve.jobs import finished, in_pool, wait_turn
from qkv.serve.limits import Cancelled
from qkv.serve.schemas import (
    AttentionRequest,
    ContributionsRequest,
    GenerateRequest,
    HeadsRequest,
    HideRequest,
    LongHeadRequest,
    LongRegionRequest,
    LongRequest,
    NextRequest,
    ProbeRequest,
    TraceRequest,
    WhyRequest,
)

ERRORS = {
    code: {"model": Problem, "description": why}
    for code, why in {
        400: "the body is not JSON",
        413: "over a size limit: body, characters, tokens, sentences, weights or a region's "
        "size; `limit` names it",
        422: "a value not allowed: empty text, unknown model or word, a token position, layer "
        "or head out of range or repeated, an encoder asked to generate, a decoder's key hidden "
        "from a query before it",
        503: "the model is generating for another request for longer than the time limit, "
        "its census of heads or the long text asked about is still being computed, a long "
        "text was dropped (nobody asked about it for long_idle_s), or max_long_waiting long "
        "texts wait already: ask again",
        504: "the request took longer than the time limit; its work was stopped",
    }.items()
}

router = APIRouter(prefix="/api", tags=["attention"], responses=ERRORS)
log = logging.getLogger("qkv.serve")


@router.get("/models", response_model=ModelsAnswer, summary="The models and the limits")
async def models(request: Request):
    state = request.app.state.qkv
    return {
        "version": request.app.version,  # qkv's (`create_app`)
        "models": [served.describe() for served in state.models.values()],
        "limits": state.limits.to_dict(),
        "examples": [SENTENCE, *SENTENCES],
    }


@router.post("/attention", response_model=AttentionAnswer, summary="Every weight of a text")
async def attention(body: AttentionRequest, request: Request):
    """The tokens of a text and the attention weights of every layer and head (or of the
    chosen ones): row i of a head's matrix is how token i's attention divides, summing to 1."""
    return await answer(
        request, body, compute.attention, body.text, body.layers, body.heads, body.format
    )


@router.post("/trace", summary="The article's steps for one (query, key) pair")
async def trace(body: TraceRequest, request: Request) -> dict:
    """`qkv.trace(...).to_dict()`: query, key and value vectors, the attention scalar, its
    scaled value, the softmax over every key, the scaled value vector, the sum, the model's
    own output for the head, and every token's contribution. Fields: docs/explain.md."""
    return await answer(
        request,
        body,
        compute.trace_pair,
        body.text,
        body.query,
        body.key,
        body.layer,
        body.head,
    )


@router.post("/why", summary="Why a query token attends to a key token: the score taken apart")
async def why(body: WhyRequest, request: Request) -> dict:
    """`qkv.why(...).to_dict(top)` of the pair at these token positions: the score the softmax
    read as a sum of terms, (query part, key part), each part of the stream entering the layer
    (the embedding, each earlier head, each MLP, biases) with every norm's scale held; the
    largest terms, each side's parts, a rotary layer's content and position, the words the top
    heads carried, and the top parts removed for real (checks). `pieces`: each token as the
    page shows it. Fields: `qkv.inspect.why_parts.Why.to_dict`."""
    return await answer(
        request,
        body,
        compute.why_pair,
        body.text,
        body.query_index,
        body.key_index,
        body.layer,
        body.head,
        body.checks,
        body.top,
        body.grid,
    )


@router.post(
    "/contributions",
    response_model=ContributionsAnswer,
    summary="What each word added to a query word",
)
async def contributions(body: ContributionsRequest, request: Request):
    """In one layer and head: each token's softmax weight for the query word, and the size
    of what it added after the output projection (a large weight on a small value vector can
    add less than a modest weight on a large one)."""
    return await answer(
        request, body, compute.contributions, body.text, body.query, body.layer, body.head
    )


@router.post("/probe", summary="The sense probe: one word across sentences, layer by layer")
async def probe(body: ProbeRequest, request: Request) -> dict:
    """`probe(...).to_dict()`: the cosine similarity of the word's vectors in every pair of
    sentences at every depth; with labels, how well the senses separate. Fields:
    docs/probe.md."""
    return await answer(
        request, body, compute.probe_word, body.word, body.sentences, body.labels, body.cues
    )


@router.post("/hide", summary="What if a key word were hidden from a query word?")
async def hide(body: HideRequest, request: Request) -> dict:
    """`qkv.hide(...).to_dict()`: the key hidden from the query (from every word without one)
    in each asked (layer, head) alone, `effect` [layer][head] (1 - cosine of the query's final
    vector with and without; null where not asked), `ranked`, and hidden in all of them at
    once, `total`; for a decoder the next token before and after. Fields: docs/hide.md."""
    return await answer(
        request,
        body,
        compute.hide_word,
        body.text,
        body.key,
        body.query,
        body.layers,
        body.heads,
        body.table,
        body.scale,
    )


@router.post("/heads", summary="The census of the model's heads")
async def census(body: HeadsRequest, request: Request) -> dict:
    """`qkv.heads(...).to_dict()`: each head's previous-token, induction, first-token, self,
    entropy (and window use) scores on built-in prompts, the top heads of each, and each
    layer's first-token mass. The same for every request: computed once per model. Fields:
    docs/heads.md."""
    state = request.app.state.qkv
    body.check(state.limits)
    served = state.pick(body.model)
    deadline = time.monotonic() + state.limits.timeout_s / 2
    counted = compute.census_of(served)
    if not await finished(counted.done, deadline):
        raise compute.still_counting(served)
    return await run(request, lambda stop: compute.head_census(served, counted))


LONG = {
    409: {
        "model": Problem,
        "description": "not a long text the model keeps (never read, dropped or evicted): POST "
        "/api/long with it again",
    }
}
RETRY_AFTER = "1"  # seconds: the page asks again every second


@router.post(
    "/long",
    response_model=LongAnswer,
    summary="A long text's per-head summaries (up to max_long_tokens)",
    responses={
        202: {
            "model": LongProgress,
            "description": "waiting for its turn or being read: ask again (Retry-After)",
        }
    },
)
async def long_text(body: LongRequest, request: Request):
    """Reads a text too long for /api/attention (up to max_long_tokens): one forward pass
    keeps every layer's record, then `summarize` gives each (layer, head) its summaries; the
    answer is their table (mean entropy, mean first-token mass, most received keys) and the
    tokens. Each model reads its long texts one at a time, in the order they came, each to
    its end: a request waits up to half of timeout_s, then is told 202 with its progress and
    how many texts are ahead of it (ask again, after Retry-After), until 200. Asking again
    keeps the text's place; a text nobody asks about for long_idle_s is dropped. At most
    max_long_waiting texts wait (then 503: ask again later). The texts read are kept for
    /api/long/head and /api/long/region, the least recently used going first past
    max_long_kept_bytes."""
    state = request.app.state.qkv
    body.check(state.limits)
    served, limits = state.pick(body.model), state.limits
    deadline = time.monotonic() + limits.timeout_s / 2
    reading = await in_pool(request, lambda stop: long.ask(served, limits, body.text))
    touched = served.long.touch  # at each look: its client is still here
    if not await finished(reading.done.is_set, deadline, between=lambda: touched(reading)):
        progress = long.progress(served, reading)
        return JSONResponse(progress, status_code=202, headers={"Retry-After": RETRY_AFTER})
    return await run(request, lambda stop: long.summaries_of(served, reading))


@router.post(
    "/long/head",
    response_model=LongHeadAnswer,
    summary="One head of the long text: its downsampled heatmap and per-query summaries",
    responses=LONG,
)
async def long_head(body: LongHeadRequest, request: Request):
    """The head's heatmap (at most 256 x 256: each cell the LARGEST weight of its block, so
    no strong weight disappears), each query's entropy, first-token mass and top keys, and
    the attention each key receives. The text must be the model's long text (POST /api/long)."""
    return await answer(request, body, long.head_of, body.text, body.layer, body.head, body.format)


@router.post(
    "/long/region",
    response_model=LongRegionAnswer,
    summary="A rectangle of the long text's weights at full resolution",
    responses=LONG,
)
async def long_region(body: LongRegionRequest, request: Request):
    """Every weight of queries q0..q1-1 over keys k0..k1-1 of one head (at most max_region),
    recomputed from the kept record exactly as `record.weights()` gives them."""
    return await answer(
        request,
        body,
        long.region_of,
        body.text,
        body.layer,
        body.head,
        body.queries,
        body.keys,
        body.format,
    )


@router.post("/next", response_model=NextAnswer, summary="A decoder's next-token probabilities")
async def next_tokens(body: NextRequest, request: Request):
    return await answer(request, body, compute.next_tokens, body.text, body.top)


@router.post("/generate", response_model=GenerateAnswer, summary="Generate, answered at the end")
async def generate(body: GenerateRequest, request: Request):
    served, limits = await checked_generation(body, request)
    body = defaults(body, limits)
    lock = served.generation_lock()
    await wait_turn(lock, served, limits.timeout_s)

    def work(stop: threading.Event) -> dict:
        return compute.generate(served, limits, body.prompt, options(body), lambda _: None, stop)

    timeout = limits.generate_s + limits.timeout_s
    return await run(request, work, timeout=timeout, then=lock.release)


@router.post(
    "/generate/stream",
    summary="Generate, streamed as server-sent events",
    response_class=StreamingResponse,
    responses={
        200: {
            "content": {"text/event-stream": {}},
            "description": (
                '`event: token` with data {"text": piece} as each piece is written, then '
                '`event: done` with the GenerateAnswer, or `event: error` with {"detail": ...}'
            ),
        }
    },
)
async def generate_stream(body: GenerateRequest, request: Request):
    state = request.app.state.qkv
    served, limits = await checked_generation(body, request)
    body = defaults(body, limits)
    lock = served.generation_lock()
    await wait_turn(lock, served, limits.timeout_s)
    loop, queue, cancelled = asyncio.get_running_loop(), asyncio.Queue(), threading.Event()

    def put(kind: str, payload: dict) -> None:
        try:
            loop.call_soon_threadsafe(queue.put_nowait, (kind, payload))
        except RuntimeError:  # the event loop has closed: nobody is listening
            cancelled.set()

    def work() -> None:
        try:
            put(
                "done",
                compute.generate(
                    served,
                    limits,
                    body.prompt,
                    options(body),
                    lambda piece: put("token", {"text": piece}),
                    cancelled,
                ),
            )
        except Exception as error:  # told to the client, which has a 200 already
            put("error", {"detail": f"{type(error).__name__}: {error}"})
        finally:
            loop.call_soon_threadsafe(lock.release)

    state.pool.submit(work)

    async def events():
        try:
            while True:
                kind, payload = await queue.get()
                yield f"event: {kind}\ndata: {json.dumps(payload)}\n\n"
                if kind != "token":
                    return
        finally:
            cancelled.set()  # the client left, or the stream ended: stop generating

    return StreamingResponse(
        events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
    )


async def checked_generation(body: GenerateRequest, request: Request):
    """The model and limits of a generation that passed its checks (before any stream)."""
    state = request.app.state.qkv
    body.check(state.limits)
    served, limits = state.pick(body.model, generating=True), state.limits
    max_new_tokens = defaults(body, limits).max_new_tokens

    def check(stop: threading.Event) -> None:
        compute.check_generation(served, limits, body.prompt, max_new_tokens)

    await run(request, check)
    return served, limits


def defaults(body: GenerateRequest, limits) -> GenerateRequest:
    if body.max_new_tokens is not None:
        return body
    return body.model_copy(update={"max_new_tokens": min(32, limits.max_new_tokens)})


def options(body: GenerateRequest) -> dict:
    return {
        "max_new_tokens": body.max_new_tokens,
        "temperature": body.temperature,
        "top_k": body.top_k,
        "top_p": body.top_p,
        "seed": body.seed,
        "stop": body.stop,
        "chat": body.chat,
    }


async def answer(request: Request, body, work: Callable, *args) -> Response:
    """work(served model, limits, *args, stop=...) for the model a request names, once the
    request's strings are within the limits (see `run`)."""
    state = request.app.state.qkv
    body.check(state.limits)
    served = state.pick(body.model, generating=isinstance(body, NextRequest))
    return await run(request, lambda stop: work(served, state.limits, *args, stop=stop))


async def run(
    request: Request,
    work: Callable[[threading.Event], object],
    *,
    timeout: float | None = None,
    then: Callable[[], None] | None = None,
) -> Response:
    """work(stop) in the app's thread pool (see `in_pool`), its answer JSON-encoded there too
    (bytes are sent as they are)."""

    def encoded(stop: threading.Event) -> bytes:
        try:
            answer = work(stop)
        except Cancelled:
            log.info("%s stopped at its time limit", request.url.path)
            raise
        return answer if isinstance(answer, bytes) else json.dumps(answer).encode()

    body = await in_pool(request, encoded, timeout=timeout, then=then)
    return Response(body, media_type="application/json")
