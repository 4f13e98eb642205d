"""The tour served: GET /tour, the tour page of a text (the article's sentence by default, any
other with ?text=), and POST /api/tour, the tour's data for any text (`Tour.to_dict()`), or its
page with "format": "html".

Each request is checked as the API's are (its schema, then the server's limits on characters
and tokens), runs in the app's worker pool with its time limit (`qkv.serve.api.run`) and on
the model the request names (the first one by default). The page is the same self-contained
file `qkv tour` writes (`qkv.viz.tour.render_tour`).
"""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Query, Request
from fastapi.responses import Response
from pydantic import Field

from qkv.inspect.article import SENTENCE
from qkv.inspect.tour import tour
from qkv.serve.api import ERRORS, run
from qkv.serve.compute import encode, going
from qkv.serve.schemas import Head, Layer, ModelName, Text, Word
from qkv.serve.schemas import Request as Checked
from qkv.viz.tour import render_tour

tour_router = APIRouter(tags=["attention"], responses=ERRORS)


class TourRequest(Checked):
    model: ModelName = None
    text: Annotated[Text, Field(examples=[SENTENCE])]
    query: Word | None = Field(None, description="default: 'bank', else the last word")
    key: Word | None = Field(None, description="default: 'river', else what query reads most")
    layer: Layer | None = Field(None, description="default: where query attends most to key")
    head: Head | None = Field(None, description="default: where query attends most to key")
    target: Text | None = Field(None, description="encoder-decoder models: the decoder's text "
                                "(default: what the model writes)")  # fmt: skip
    format: Literal["json", "html"] = Field("json", description="the data, or the whole page")


def _tour(served, limits, text: str, options: dict, html: bool, stop=None) -> bytes | dict:
    encode(served, limits, text)
    if options["target"] is not None:
        encode(served, limits, options["target"], "the target")
    going(stop)
    found = tour(served.pretrained, text, **options)
    return render_tour(found).encode("utf-8") if html else {"model": served.name,
                                                            **found.to_dict()}  # fmt: skip


async def _answer(request: Request, body: TourRequest, html: bool) -> Response:
    state = request.app.state.qkv
    body.check(state.limits)
    served = state.pick(body.model)
    options = {"query": body.query, "key": body.key, "layer": body.layer, "head": body.head,
               "target": body.target}  # fmt: skip
    answer = await run(request, lambda stop: _tour(served, state.limits, body.text, options,
                                                   html, stop))  # fmt: skip
    if html:
        return Response(answer.body, media_type="text/html")
    return answer


@tour_router.post("/api/tour", summary="The guided tour of the article for one text")
async def tour_api(body: TourRequest, request: Request) -> Response:
    """`qkv.inspect.tour.tour(...).to_dict()`: the article's steps, each with the model's own
    numbers and its experiments' results, and the model's diagram with each box's tensor;
    with "format": "html" the self-contained page instead. Fields: docs/tour.md."""
    return await _answer(request, body, body.format == "html")


@tour_router.get("/tour", include_in_schema=False)
async def tour_page(
    request: Request,
    text: Annotated[str, Query(max_length=100_000)] = SENTENCE,
    model: Annotated[str | None, Query(max_length=200)] = None,
) -> Response:
    return await _answer(request, TourRequest(model=model, text=text, format="html"), True)
