"""What one request may ask of the server, and the errors that say so.

Every limit is a field of `Limits`, given to `create_app`, so a test can build an app with
a tiny time limit and the command line can raise one. A request over a size limit gets 413,
one with a value out of range 422, one that takes too long 504; each with a one-line
`detail` naming the limit. Sizes are checked before any work, so an answer's size is known
before it is computed; a request past its time limit is told 504 and its work is stopped
(`Cancelled`) at its next step, not left running.

>>> Limits().max_tokens, Limits(max_tokens=64).max_tokens
(128, 64)
>>> Limits(timeout_s=0)
Traceback (most recent call last):
...
ValueError: timeout_s must be a number > 0, got 0
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields

from starlette.responses import JSONResponse


@dataclass(frozen=True)
class Limits:
    """The most one request may ask. Sizes are per text: a probe's sentences each count."""

    max_body_bytes: int = 64 * 1024  # a request's JSON body
    max_chars: int = 2_000  # characters in one text, prompt or sentence
    # tokens in one text: the page draws every weight of every head, and at 128 tokens the
    # 270 heads of SmolLM2 are already 17 MB of float32
    max_tokens: int = 128
    max_sentences: int = 32  # sentences in one sense probe
    # weights in one attention answer, layers x heads x T x T, counted before the forward
    # pass: all 270 heads of SmolLM2 at 128 tokens are 4.4 million (18 MB of float32)
    max_weights: int = 5_000_000
    max_new_tokens: int = 128  # tokens one generation may ask for
    timeout_s: float = 10.0  # one request, from arrival to answer, waiting included
    generate_s: float = 60.0  # one generation: it ends there, with what it has written
    workers: int = 4  # requests computed at once; the rest wait their turn (within timeout_s)
    # A long text (over max_tokens) is read by /api/long*, from per-head summaries and regions,
    # never every weight: each model keeps one at a time (0.5 GB for 4,096 tokens of SmolLM2)
    max_long_tokens: int = 4_096
    max_long_chars: int = 24_000  # English prose is 4-5 characters a token: 4,096 is ~18k
    # a /api/long* body: max_long_chars of text even if each is sent as a 6-byte \uXXXX
    max_long_body_bytes: int = 160 * 1024
    max_region: int = 65_536  # weights in one /api/long/region answer: 256 x 256
    # Each model reads its long texts one at a time, in the order they came: at most this many
    # wait for their turn (then 503); a client's wait is its text's and those ahead of it
    max_long_waiting: int = 8
    # the records and summaries of the texts read that each model keeps, least recently used
    # going first (the last one read always stays): 4,096 tokens of SmolLM2 keep 0.5 GB
    max_long_kept_bytes: int = 1_536 * 2**20
    # a long text nobody has asked about for this long (its client left) is dropped, waiting
    # or being read; its client asks again every second (Retry-After) while it waits
    long_idle_s: float = 30.0

    def __post_init__(self):
        for field in fields(self):
            value = getattr(self, field.name)
            if field.type == "int" and not (isinstance(value, int) and value >= 1):
                raise ValueError(f"{field.name} must be an integer >= 1, got {value!r}")
            if field.type == "float" and not (
                isinstance(value, int | float) and math.isfinite(value) and value > 0
            ):
                raise ValueError(f"{field.name} must be a number > 0, got {value!r}")

    def to_dict(self) -> dict:
        return asdict(self)

    def check_text(self, text: str, what: str = "the text") -> None:
        """TooLarge when `text` has more characters than max_chars."""
        if len(text) > self.max_chars:
            raise TooLarge(
                f"{what} has {len(text):,} characters; this server takes at most "
                f"{self.max_chars:,} (max_chars)",
                limit="max_chars",
            )

    def check_tokens(self, count: int, what: str = "the text") -> None:
        """TooLarge when a text of `count` tokens is over max_tokens."""
        if count > self.max_tokens:
            raise TooLarge(
                f"{what} has {count} tokens; this server takes at most {self.max_tokens} "
                "(max_tokens)",
                limit="max_tokens",
            )

    def check_long_text(self, text: str) -> None:
        """TooLarge when a long text has more characters than max_long_chars."""
        if len(text) > self.max_long_chars:
            raise TooLarge(
                f"the text has {len(text):,} characters; this server reads at most "
                f"{self.max_long_chars:,} of a long text (max_long_chars)",
                limit="max_long_chars",
            )

    def check_long_tokens(self, count: int) -> None:
        """TooLarge when a long text of `count` tokens is over max_long_tokens."""
        if count > self.max_long_tokens:
            raise TooLarge(
                f"the text has {count:,} tokens; this server reads at most "
                f"{self.max_long_tokens:,} of a long text (max_long_tokens)",
                limit="max_long_tokens",
            )


class TooLarge(ValueError):
    """A request over a size limit: HTTP 413. `limit`: the limit's name, where one is named
    (sent beside the detail, so that a client such as the page can tell which it was)."""

    def __init__(self, message: str, *, limit: str | None = None):
        super().__init__(message)
        self.limit = limit


class TimedOut(Exception):
    """A request that took longer than its time limit: HTTP 504."""


class Busy(Exception):
    """The model is generating for someone else for longer than the time limit, its census
    or a long text is still being computed, or too many long texts wait: HTTP 503."""


class NotComputed(Exception):
    """A head or a region of a text that is not one of the model's long texts: HTTP 409."""


class Cancelled(Exception):
    """Raised in a request's work when its time is up: the work stops there, between steps."""


class BodyLimit:
    """ASGI middleware: a request body over `limit` bytes gets 413 before any of it is used.

    The declared Content-Length is checked first; a body sent in chunks is counted as it
    arrives, so a client that declares nothing cannot send more either. `routes`: {path:
    (bytes, the limit's name)} for the paths that take more (a long text's).
    """

    def __init__(self, app, limit: int, routes: dict[str, tuple[int, str]] | None = None):
        self.app, self.limit, self.routes = app, limit, routes or {}

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        limit, name = self.routes.get(scope.get("path", ""), (self.limit, "max_body_bytes"))
        declared = dict(scope.get("headers", [])).get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > limit):
            return await self._too_large(send, declared.decode("latin-1"), limit, name)
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client went away
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > limit:
                return await self._too_large(send, f"over {limit:,}", limit, name)
            if not message.get("more_body", False):
                break
        body, replayed = b"".join(chunks), False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # later: the disconnect a streaming response waits for

        await self.app(scope, replay, send)

    async def _too_large(self, send, size: str, limit: int, name: str) -> None:
        detail = f"the request body is {size} bytes; this server takes at most {limit:,} ({name})"
        response = JSONResponse({"detail": detail, "limit": name}, status_code=413)
        await response({"type": "http"}, _nothing, send)


async def _nothing():  # a response sent before the body was read needs no receive
    return {"type": "http.disconnect"}
