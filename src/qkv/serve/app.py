"""`create_app`: the FastAPI app of `qkv serve`, from models already loaded and its limits.

The app serves the explorer page at `/` (its script, style and every asset from the
package: no network), the JSON API under `/api` (see `qkv.serve.api`), its OpenAPI
description at `/openapi.json` and a Swagger page at `/docs` whose files come from the
`swagger-ui-bundle-v2` package, not a CDN. The description states this server's own limits
and models (`qkv.serve.schemas.with_limits`). Every error is JSON `{"detail": one line}`.

    import qkv
    from qkv.serve import Limits, create_app

    app = create_app({"minilm": qkv.load("minilm")}, Limits(max_tokens=64))
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from importlib.resources import files

import swagger_ui_bundle
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import FileResponse, JSONResponse
from fastapi.staticfiles import StaticFiles

from qkv.serve.api import router
from qkv.serve.atlas import atlas_router
from qkv.serve.held import Served, served_models
from qkv.serve.limits import BodyLimit, Busy, Limits, NotComputed, TimedOut, TooLarge
from qkv.serve.schemas import with_limits
from qkv.serve.tour import tour_router

# the facade's, where qkv's version is read (importlib.metadata, or "+source" in a checkout)
from qkv.version import __version__

log = logging.getLogger("qkv.serve")
STATIC = files("qkv.serve") / "static"
WHY_PANEL = files("qkv.viz") / "why_panel.js"


@dataclass
class State:
    """What every request reads: the models, the limits and the worker threads."""

    models: dict[str, Served]
    limits: Limits
    pool: ThreadPoolExecutor
    serving: int = 0  # how many servers (test clients too) have started the app and not stopped
    turns: threading.Lock = field(default_factory=threading.Lock)

    def started(self) -> None:
        """One more server serves the app: the first gets fresh worker threads (the app may
        be served again after it stopped: a test client, then a server)."""
        with self.turns:
            if self.serving == 0:
                stopped, self.pool = (
                    self.pool,
                    ThreadPoolExecutor(self.limits.workers, thread_name_prefix="qkv-serve"),
                )
                stopped.shutdown(wait=False)
            self.serving += 1

    def stopped(self) -> None:
        """One server stopped: the last shuts the worker threads. One that stops while
        another still serves leaves it its threads (it once shut them, and every later
        request of the other was a 500, "cannot schedule new futures after shutdown")."""
        with self.turns:
            self.serving -= 1
            if self.serving == 0:
                self.pool.shutdown(wait=False, cancel_futures=True)

    def pick(self, name: str | None, generating: bool = False) -> Served:
        """The model a request names (None: the first, or the first decoder for a request
        that generates); never loads one."""
        if name is None and generating:
            decoders = [served for served in self.models.values() if served.decoder]
            if not decoders:
                raise ValueError(
                    f"this server has no decoder ({', '.join(self.models)}: encoders); "
                    "next-token probabilities and generation need one"
                )
            return decoders[0]
        if name is None:
            return next(iter(self.models.values()))
        if name not in self.models:
            raise ValueError(
                f"unknown model {name!r}; this server has: {', '.join(self.models)} (models "
                "are loaded when the server starts, never by a request)"
            )
        return self.models[name]


def create_app(models: dict, limits: Limits | None = None, *, atlas=None) -> FastAPI:
    """The app serving `models` ({name: qkv.Pretrained}, encoders and decoders) within
    `limits`, and the atlas folder `atlas` (`qkv atlas`'s) read-only at /atlas/ where given.
    The models are only read; the app may be served by any ASGI server."""
    limits = limits or Limits()
    atlas_routes = None if atlas is None else atlas_router(atlas)  # refused before the rest
    state = State(
        served_models(models),
        limits,
        ThreadPoolExecutor(limits.workers, thread_name_prefix="qkv-serve"),
    )

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        state.started()
        try:
            yield
        finally:
            state.stopped()

    app = FastAPI(
        title="qkv serve",
        version=__version__,
        description="Self-attention in real pretrained models: weights, the article's steps "
        "for a pair of words, contributions, the sense probe, next-token probabilities and "
        "generation. Layers, heads and tokens count from 0. The page is at /.",
        docs_url=None,  # served below from local files
        redoc_url=None,
        lifespan=lifespan,
    )
    app.state.qkv = state
    plain = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is None:
            app.openapi_schema = with_limits(plain(), limits, state.models)
        return app.openapi_schema

    app.openapi = openapi
    app.include_router(router)
    app.include_router(tour_router)  # GET /tour, POST /api/tour
    if atlas_routes is not None:
        app.include_router(atlas_routes)
    long_body = (limits.max_long_body_bytes, "max_long_body_bytes")
    long_routes = {path: long_body for path in ("/api/long", "/api/long/head", "/api/long/region")}
    app.add_middleware(BodyLimit, limit=limits.max_body_bytes, routes=long_routes)
    _add_error_handlers(app)

    @app.get("/static/why.js", include_in_schema=False)
    async def why_panel():  # one panel for both pages: the file qkv show's page inlines
        return FileResponse(str(WHY_PANEL), media_type="text/javascript")

    app.mount("/static", StaticFiles(directory=str(STATIC)), name="static")
    swagger = StaticFiles(directory=str(swagger_ui_bundle.swagger_ui_path))
    app.mount("/docs-assets", swagger, name="docs-assets")

    @app.get("/", include_in_schema=False)
    async def page():
        return FileResponse(str(STATIC / "index.html"), media_type="text/html")

    @app.get("/docs", include_in_schema=False)
    async def docs():
        return get_swagger_ui_html(
            openapi_url=app.openapi_url,
            title="qkv serve: the API",
            swagger_js_url="/docs-assets/swagger-ui-bundle.js",
            swagger_css_url="/docs-assets/swagger-ui.css",
            swagger_favicon_url="/docs-assets/favicon-32x32.png",
            swagger_ui_parameters={"validatorUrl": None},  # never ask validator.swagger.io
        )

    return app


def _add_error_handlers(app: FastAPI) -> None:
    def problem(status: int, detail: str, limit: str | None = None) -> JSONResponse:
        # a detail may quote the request; what it quotes is sent escaped, never unsendable
        detail = detail.encode("utf-8", "backslashreplace").decode("utf-8")
        named = {} if limit is None else {"limit": limit}
        return JSONResponse({"detail": detail, **named}, status_code=status)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, error: RequestValidationError):
        errors = error.errors()
        first = errors[0] if errors else {"loc": (), "msg": "invalid request"}
        if first.get("type") == "json_invalid":
            at = first.get("ctx", {}).get("error", "")
            return problem(400, f"the body is not valid JSON ({at}); send a JSON object")
        where = "".join(
            f"[{part}]" if isinstance(part, int) else f".{part}"
            for part in first.get("loc", ())
            if part != "body"
        ).removeprefix(".")  # layers[2], stop[0]
        more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
        message = first.get("msg", "invalid").removeprefix("Value error, ")
        if first.get("type") == "extra_forbidden":
            message = "is not a field of this request (see /docs)"
        elif first.get("type") == "missing":
            message = "is required"
        return problem(422, f"{where or 'the body'}: {message}{more}")

    @app.exception_handler(TooLarge)
    async def too_large(request: Request, error: TooLarge):
        return problem(413, str(error), error.limit)

    @app.exception_handler(ValueError)
    async def bad_value(request: Request, error: ValueError):
        return problem(422, str(error))

    @app.exception_handler(TimedOut)
    async def timed_out(request: Request, error: TimedOut):
        return problem(504, str(error))

    @app.exception_handler(NotComputed)
    async def not_computed(request: Request, error: NotComputed):
        return problem(409, str(error))

    @app.exception_handler(Busy)
    async def busy(request: Request, error: Busy):
        return problem(503, str(error))

    @app.exception_handler(Exception)
    async def failed(request: Request, error: Exception):
        log.exception("%s %s failed", request.method, request.url.path)
        return problem(500, f"the server failed ({type(error).__name__}); its log says more")
