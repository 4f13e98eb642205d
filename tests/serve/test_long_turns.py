"""Several clients reading long texts on one model (issue 32): each following the documented
protocol (202: ask again; 503: ask again) gets its text read, in the order the texts arrived,
and no client's request stops another's reading. What waits is bounded (max_long_waiting, a
503 naming it), what is kept is bounded (max_long_kept_bytes, least recently used first, a 409
"POST /api/long again" after), and work nobody asks about any more (long_idle_s) is dropped.

Dropped, failed or evicted work frees its memory at once: these tests turn the garbage
collector off, so that only reference counting frees anything, and count what is still alive.
A tiny random decoder (`long_server.tiny_decoder`) reads a text in a fraction of a second."""

from __future__ import annotations

import gc
import threading
import weakref
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from fastapi.testclient import TestClient
from long_server import tiny_decoder, words

from qkv.serve import Limits, create_app, running
from qkv.serve.limits import Cancelled
from qkv.serve.long_texts import LongRun

ASKS = 400  # a client gives up after this many asks: each waits up to timeout_s / 2


@pytest.fixture(scope="module")
def tiny():
    return tiny_decoder()


@pytest.fixture
def no_gc():
    """Only reference counting frees anything while the test runs: what a cycle holds stays."""
    gc.collect()
    gc.disable()
    yield
    gc.enable()


class Reads:
    """The readings of one model's long texts, recorded as each ends: (text, error), and the
    order in which each text arrived (`number`)."""

    def __init__(self, served):
        self.done, self.numbers, self.lock = [], [], threading.Lock()
        read = served.long._read

        def recorded(pretrained, run, going):
            read(pretrained, run, going)
            with self.lock:
                self.done.append((run.text, run.error))
                self.numbers.append(run.number)

        served.long._read = recorded


def read_long(url: str, text: str, model: str = "tiny") -> tuple[httpx.Response, list]:
    """A client following serve.md's protocol: 202 or 503, ask again, until an answer."""
    statuses = []
    with httpx.Client(base_url=url, timeout=60) as client:
        for _ in range(ASKS):
            answer = client.post("/api/long", json={"model": model, "text": text})
            statuses.append((answer.status_code, answer.json()))
            if answer.status_code not in (202, 503):
                return answer, statuses
    return answer, statuses


@pytest.mark.parametrize("clients", [2, 8])
def test_clients_following_the_protocol_each_get_their_text_in_turn(tiny, clients):
    app = create_app({"tiny": tiny}, Limits(max_tokens=16, timeout_s=0.4))
    reads = Reads(app.state.qkv.models["tiny"])
    texts = [words(200 + 20 * n, seed=n) for n in range(clients)]
    with running(app) as url, ThreadPoolExecutor(clients) as pool:
        answers = list(pool.map(lambda text: read_long(url, text), texts))
    for text, (answer, statuses) in zip(texts, answers, strict=True):
        assert answer.status_code == 200, (answer.text[:200], statuses[-3:])
        assert len(answer.json()["tokens"]) == len(text.split())
        assert {status for status, _ in statuses} <= {200, 202}, statuses  # never told to go
    # each text read once, none stopped: no client's ask undid another's reading
    assert sorted(text for text, _ in reads.done) == sorted(texts)
    assert [error for _, error in reads.done] == [None] * clients
    # in turn: read in the order they arrived, so each waited for those before it alone
    assert reads.numbers == list(range(clients))


def hold(served) -> threading.Event:
    """Every reading of `served`'s long texts waits at its start until the event is set."""
    release, read = threading.Event(), served.long._read

    def waiting(pretrained, run, going):
        release.wait(30)
        read(pretrained, run, going)

    served.long._read = waiting
    return release


@pytest.fixture
def held(tiny):
    """An app whose model's reading waits at its start until `release` is set: (app, served,
    reads, release). Its requests wait up to 0.1 s for a reading, then are told 202."""
    app = create_app({"tiny": tiny}, Limits(max_tokens=16, timeout_s=0.2, max_long_waiting=1))
    served = app.state.qkv.models["tiny"]
    reads = Reads(served)
    release = hold(served)
    yield app, served, reads, release
    release.set()


def test_the_texts_that_may_wait_are_bounded_by_a_503_naming_the_limit(held):
    app, _, reads, release = held
    with TestClient(app) as client:
        ask = lambda n: client.post("/api/long", json={"text": words(200, seed=n)})  # noqa: E731
        assert ask(0).status_code == 202  # read (held at its start)
        second = ask(1)
        assert second.status_code == 202  # waits
        assert second.json()["ahead"] == 1 and "1 long text before it" in second.json()["detail"]
        third = ask(2)
        assert third.status_code == 503
        assert third.json()["detail"] == (
            "tiny has 1 long text waiting to be read, the most this server lets wait "
            "(max_long_waiting); ask again later"
        )
        assert ask(0).status_code == 202 and ask(1).status_code == 202  # theirs: still there
        release.set()
        for n in range(3):
            answer, statuses = read_long_client(client, words(200, seed=n))
            assert answer.status_code == 200, statuses[-3:]
    assert [text for text, _ in reads.done] == [words(200, seed=n) for n in range(3)]


def read_long_client(client, text: str) -> tuple:
    statuses = []
    for _ in range(ASKS):
        answer = client.post("/api/long", json={"text": text})
        statuses.append(answer.status_code)
        if answer.status_code not in (202, 503):
            break
    return answer, statuses


class Clock:
    """The long texts' clock, moved by the test: when nobody has asked for long_idle_s."""

    def __init__(self):
        self.now = 1_000.0

    def __call__(self) -> float:
        return self.now


def test_work_nobody_asks_about_any_more_is_dropped_and_freed(held, no_gc):
    app, served, reads, release = held
    clock = served.long.clock = Clock()
    idle = app.state.qkv.limits.long_idle_s
    with TestClient(app) as client:
        assert client.post("/api/long", json={"text": words(200, seed=0)}).status_code == 202
        assert client.post("/api/long", json={"text": words(200, seed=1)}).status_code == 202
        waiting = weakref.ref(served.long._runs[words(200, seed=1)])
        clock.now += idle / 2
        assert client.post("/api/long", json={"text": words(200, seed=0)}).status_code == 202
        clock.now += idle / 2 + 1  # the second text's client has not asked for long_idle_s
        third = client.post("/api/long", json={"text": words(200, seed=2)})
        assert third.status_code == 202, third.text  # its place, freed: not over max_long_waiting
        assert waiting() is None, "the dropped text is still held"
        release.set()
        for n in (0, 2):
            assert read_long_client(client, words(200, seed=n))[0].status_code == 200
    assert [text for text, _ in reads.done] == [words(200, seed=0), words(200, seed=2)]


def test_a_reading_nobody_waits_for_stops_at_its_next_layer_and_frees_its_records(tiny, no_gc):
    app = create_app({"tiny": tiny}, Limits(max_tokens=16, timeout_s=0.2))
    served = app.state.qkv.models["tiny"]
    clock = served.long.clock = Clock()
    reads, summarized, release, alive = Reads(served), threading.Event(), threading.Event(), []
    import qkv.inspect.summaries as summaries

    summarize = summaries.summarize

    def held(records, **kwargs):  # the first layer's summaries wait: the records are made
        alive.extend(weakref.ref(r.q) for r in records.values())
        summarized.set()
        release.wait(30)
        return summarize(records, **kwargs)

    summaries.summarize = held
    try:
        with TestClient(app) as client:
            assert client.post("/api/long", json={"text": words(400)}).status_code == 202
            assert summarized.wait(30)
            run = weakref.ref(served.long._runs[words(400)])
            done = run().done
            clock.now += app.state.qkv.limits.long_idle_s + 1  # nobody has asked since
            release.set()
            assert done.wait(30)
    finally:
        summaries.summarize = summarize
    assert [(text, type(error)) for text, error in reads.done] == [(words(400), Cancelled)]
    assert run() is None, "the stopped reading is still held"
    assert not [r for r in gc.get_objects() if type(r) is LongRun and r.text == words(400)]
    assert alive and all(q() is None for q in alive), "its records are still held"


FAILING = words(300, seed=99)  # a text of this test alone


def test_a_failed_reading_keeps_its_error_but_not_its_records(tiny, no_gc, monkeypatch):
    app = create_app({"tiny": tiny}, Limits(max_tokens=16))
    import qkv.inspect.summaries as summaries

    summarize, alive = summaries.summarize, []

    def failing(records, **kwargs):
        alive.extend(weakref.ref(r.q) for r in records.values())
        if len(alive) == 2:
            raise RuntimeError("out of memory, say")
        return summarize(records, **kwargs)

    monkeypatch.setattr(summaries, "summarize", failing)
    with TestClient(app, raise_server_exceptions=False) as client:
        answer = client.post("/api/long", json={"text": FAILING})
        assert answer.status_code == 500 and "RuntimeError" in answer.json()["detail"]
        runs = [r for r in gc.get_objects() if type(r) is LongRun and r.text == FAILING]
        assert all(r.records is None and r.error.__traceback__ is None for r in runs)
        assert alive and all(q() is None for q in alive), "the failed reading's records are held"
        monkeypatch.setattr(summaries, "summarize", summarize)
        assert client.post("/api/long", json={"text": FAILING}).status_code == 200  # again


def test_kept_texts_are_bounded_least_recently_used_first_and_evicted_ones_freed(tiny, no_gc):
    app = create_app({"tiny": tiny}, Limits(max_tokens=16, timeout_s=0.2))
    served = app.state.qkv.models["tiny"]
    with TestClient(app) as client:
        assert read_long_client(client, words(300, seed=0))[0].status_code == 200
        size = served.long._runs[words(300, seed=0)].bytes
    assert size > 0
    # room for two texts of 300 tokens: the third evicts the one used least recently
    app = create_app({"tiny": tiny}, Limits(max_tokens=16, timeout_s=0.2,
                                            max_long_kept_bytes=2 * size + size // 2))  # fmt: skip
    served = app.state.qkv.models["tiny"]
    head = lambda n: client.post(  # noqa: E731
        "/api/long/head", json={"text": words(300, seed=n), "layer": 0, "head": 0}
    )
    release = hold(served)
    with TestClient(app) as client:
        # text 1 is told 202 first (whose answer once held the run in a cycle, issue 32)
        assert client.post("/api/long", json={"text": words(300, seed=1)}).status_code == 202
        release.set()
        for n in (1, 0):
            assert read_long_client(client, words(300, seed=n))[0].status_code == 200
        runs = {n: weakref.ref(served.long._runs[words(300, seed=n)]) for n in (0, 1)}
        assert head(0).status_code == 200  # text 0 used last: text 1 goes first
        assert read_long_client(client, words(300, seed=2))[0].status_code == 200
        assert head(0).status_code == 200 and head(2).status_code == 200
        evicted = head(1)
        assert evicted.status_code == 409 and "POST /api/long" in evicted.json()["detail"]
        assert runs[1]() is None, "the evicted text is still held"
        assert runs[0]() is not None
        assert read_long_client(client, words(300, seed=1))[0].status_code == 200  # read again
        assert head(1).status_code == 200
        kept = sum(r.bytes for r in served.long._runs.values() if r.records is not None)
        assert kept <= 2 * size + size // 2


def test_a_finished_text_evicted_before_its_client_asked_again_is_still_answered(tiny):
    """Its client is owed the 200 of the protocol: the table is kept for it (not the records),
    and a head or region of it is 409 afterwards."""
    app = create_app({"tiny": tiny}, Limits(max_tokens=16, timeout_s=0.2,
                                            max_long_kept_bytes=1))  # fmt: skip
    served = app.state.qkv.models["tiny"]
    release = hold(served)
    with TestClient(app) as client:
        assert client.post("/api/long", json={"text": words(300, seed=0)}).status_code == 202
        release.set()
        assert read_long_client(client, words(300, seed=1))[0].status_code == 200
        assert served.long._runs[words(300, seed=0)].records is None  # evicted, not yet told
        told = client.post("/api/long", json={"text": words(300, seed=0)})
        assert told.status_code == 200 and len(told.json()["tokens"]) == 300
        body = {"text": words(300, seed=0), "layer": 0, "head": 0}
        assert client.post("/api/long/head", json=body).status_code == 409


def test_the_limits_are_checked(tiny):
    for name in ("max_long_waiting", "max_long_kept_bytes"):
        with pytest.raises(ValueError, match=f"{name} must be an integer >= 1, got 0"):
            Limits(**{name: 0})
    with pytest.raises(ValueError, match="long_idle_s must be a number > 0"):
        Limits(long_idle_s=-1.0)
