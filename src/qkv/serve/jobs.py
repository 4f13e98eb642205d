"""Waiting for work that runs beside the event loop, with a time limit: the one way serve does it.

A request's work runs in the app's thread pool (`in_pool`): past its time limit the request is
told 504 (`TimedOut`) and the work is told to stop. Work that outlives a request runs in a
thread of its own (`in_thread`: a model's census; a model's long texts have their own worker,
`qkv.serve.long_texts`), and a request waits for it on the event loop, holding no worker, up to
a deadline (`finished`); past it the request is told to ask again (503 `Busy`, or a long
text's 202). A generation waits for its model's turn the same way (`wait_turn`).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING

from qkv.serve.limits import Busy, Cancelled, NotComputed, TimedOut

if TYPE_CHECKING:
    from fastapi import Request

LOOK_S = 0.05  # how often a request looks whether work in a thread of its own has finished


def in_thread(work: Callable[[], object], name: str) -> Future:
    """work() started in a daemon thread of its own; its outcome (result or error) the Future's."""
    future: Future = Future()

    def run() -> None:
        try:
            future.set_result(work())
        except Exception as error:  # told to every request that waits for it
            future.set_exception(error)

    threading.Thread(target=run, name=name, daemon=True).start()
    return future


async def finished(
    done: Callable[[], bool], deadline: float, between: Callable[[], None] | None = None
) -> bool:
    """Whether work in a thread of its own is done (`done()`) by `deadline` (`time.monotonic`),
    waited for on the event loop, holding no worker; between(): called at each look before the
    deadline (a long text's client is still there)."""
    while not done():
        if time.monotonic() >= deadline:
            return False
        if between is not None:
            between()
        await asyncio.sleep(LOOK_S)
    return True


async def wait_turn(lock: asyncio.Lock, served, timeout: float) -> None:
    """Take `served`'s generation lock (its turn to generate), or Busy past `timeout`."""
    try:
        await asyncio.wait_for(lock.acquire(), timeout)
    except TimeoutError:
        raise Busy(
            f"{served.name} has been generating for another request for {timeout:g} s "
            "(timeout_s); try again when it is done"
        ) from None


# the errors a request is answered with (4xx, 503): sent without the frames they were raised in
TOLD = (ValueError, Busy, NotComputed, Cancelled)


async def in_pool(
    request: Request,
    work: Callable[[threading.Event], object],
    *,
    timeout: float | None = None,
    then: Callable[[], None] | None = None,
):
    """work(stop)'s result, run in the app's thread pool. Past the time limit, TimedOut, and
    `stop` is set: the work never starts, or stops at its next step. then(): called on the
    event loop when the work has ended, however it ended (a generation's turn passes on
    then, not at the 504). An error the client is told (4xx, 503) leaves without its
    traceback, whose frames (the worker's locals: a long text's records) would otherwise stay
    alive in a cycle with the future that carried it until the garbage collector ran."""
    state = request.app.state.qkv
    timeout = state.limits.timeout_s if timeout is None else timeout
    loop, stop = asyncio.get_running_loop(), threading.Event()

    def ended(_) -> None:
        with contextlib.suppress(RuntimeError):  # the event loop has closed, its lock too
            loop.call_soon_threadsafe(then)

    try:
        future = state.pool.submit(work, stop)
    except RuntimeError:  # the pool has shut down: the server is stopping
        if then is not None:
            then()
        raise
    if then is not None:
        future.add_done_callback(ended)
    try:
        return await asyncio.wait_for(asyncio.wrap_future(future), timeout)
    except TimeoutError:
        raise TimedOut(
            f"the request took longer than this server's limit of {timeout:g} s (timeout_s) "
            "and was stopped; ask for a shorter text, or fewer layers and heads"
        ) from None
    except TOLD as error:
        raise error.with_traceback(None) from None
    finally:
        if not future.done():  # past the time limit, or the server is stopping
            stop.set()
            future.cancel()
        future = None  # this frame, kept by an error's traceback, must not keep the error
