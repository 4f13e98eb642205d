"""The long texts of one served model: read one at a time, first come first served, and kept
within a memory budget.

Reading a long text takes about 30 s for 4,096 tokens of SmolLM2 on two cores, and what it
keeps (each layer's q and k, the summaries) is 0.5 GB; several clients may each want their own
text read. So each model has:

- a queue: a text asked for joins it once (asking again for the same text finds its place);
  one worker thread reads the texts in the order they came, one at a time, each to its end.
  No request stops another's reading. At most `max_long_waiting` texts wait (beyond it: 503
  naming the limit), so the time a client waits is its own text's and those ahead of it.
- kept texts: a text read is kept for /api/long/head and /api/long/region, and the texts
  least recently asked about go first once they hold more than `max_long_kept_bytes` (the one
  used last always stays). A text evicted before its client was told it is done keeps its
  table (a few kB) until it is told, so every client following the protocol gets its 200.
- work nobody waits for: a text nobody has asked about for `long_idle_s` (a client that left)
  is dropped, waiting or being read (at its next layer); nothing else ever stops a reading.

Dropped, failed or evicted work frees its memory at once: an error is kept without its
traceback (whose frames would hold the records), and once a reading ends `release_memory`
gives what glibc's allocator kept of it back to the system (without it and the server's
`bound_allocator`, its resident memory grew by gigabytes over a few texts: docs/serve.md).
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import itertools
import logging
import platform
import threading
import time
import traceback
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from qkv.serve.limits import Busy, Cancelled, Limits

log = logging.getLogger("qkv.serve")


@dataclass(eq=False)
class LongRun:
    """One long text's reading, and what it keeps once done."""

    text: str
    T: int
    num_layers: int
    number: int  # the order in which this model's texts arrived, from 0
    asked: float  # the model's clock when a request last asked about it
    stop: threading.Event = field(default_factory=threading.Event)
    done: threading.Event = field(default_factory=threading.Event)
    started: bool = False  # being read (no longer waiting)
    layers_done: int = 0
    records: dict | None = None  # {layer: its record, `weights_only`}
    summaries: object = None  # qkv.inspect.summaries.Summaries of every layer and head
    table: dict | None = None  # the /api/long answer, less the model's name
    error: BaseException | None = None  # without its traceback
    bytes: int = 0  # of records and summaries, once done
    told: bool = False  # a request has been given its outcome (its 200 or its error)


Read = Callable[[object, LongRun, Callable[[], None]], None]


class LongTexts:
    """A served model's long texts: their queue, their reading, those kept (see above).

    read(pretrained, run, going): reads run.text, setting run.table, records and summaries, or
    run.error; calls going() between its steps, which raises Cancelled when it must stop.
    """

    def __init__(self, read: Read):
        self._read = read
        self.clock = time.monotonic  # a test may move time
        self._guard = threading.Lock()  # everything below
        self._runs: OrderedDict[str, LongRun] = OrderedDict()  # least recently asked first
        self._waiting: deque[LongRun] = deque()
        self._reading: LongRun | None = None
        self._worker: threading.Thread | None = None
        self._numbers = itertools.count()

    def ask(self, served, limits: Limits, text: str, T: int, *, start: bool) -> LongRun | None:
        """The run of `text`, touched (asked about now); with start=True a new one joins the
        queue if there is none (Busy past max_long_waiting). None: not a text of this model.
        served: the `Served` model these texts are of."""
        with self._guard:
            now = self.clock()
            dropped = self._forget(now, limits)
            run = self._runs.get(text)
            if run is not None:
                self._touch(run, now)
            elif start and len(self._waiting) >= limits.max_long_waiting:
                waiting = len(self._waiting)
                raise Busy(
                    f"{served.name} has {waiting} long text{'s' * (waiting != 1)} waiting to be "
                    "read, the most this server lets wait (max_long_waiting); ask again later"
                )
            elif start:
                layers = served.pretrained.config.num_layers
                run = LongRun(text, T, layers, next(self._numbers), now)
                self._runs[text] = run
                self._waiting.append(run)
                if self._worker is None:
                    work = (served.pretrained, limits)
                    self._worker = threading.Thread(
                        target=self._work, args=work, name="qkv-long", daemon=True
                    )
                    self._worker.start()
        if dropped:
            release_memory()
        return run

    def touch(self, run: LongRun) -> None:
        """A request asked about `run` (or waits for it): it is in use, and not idle."""
        with self._guard:
            self._touch(run, self.clock())

    def ahead(self, run: LongRun) -> int:
        """How many texts will be read before `run`: the one being read, those before it."""
        with self._guard:
            if run.started or run.done.is_set():
                return 0
            before = next((i for i, r in enumerate(self._waiting) if r is run), 0)
            return before + (self._reading is not None)

    def told(self, run: LongRun) -> None:
        """A request was given `run`'s outcome: a failed or evicted run is forgotten then (the
        next ask reads it again); a run read stays as long as it is kept."""
        with self._guard:
            run.told = True
            entry = self._runs.get(run.text)
            if entry is not None and entry.number == run.number:  # it, or its table alone
                entry.told = True
                if entry.error is not None or entry.records is None:
                    del self._runs[run.text]

    def _touch(self, run: LongRun, now: float) -> None:
        run.asked = now
        if self._runs.get(run.text) is run:
            self._runs.move_to_end(run.text)

    # ------------------------------------------------------------------ the worker

    def _work(self, pretrained, limits: Limits) -> None:
        """The model's worker: reads the waiting texts in turn, until none is left."""
        while True:
            with self._guard:
                self._forget(self.clock(), limits)
                if not self._waiting:
                    self._worker = None
                    return
                run = self._reading = self._waiting.popleft()
                run.started = True
            done = self._turn(pretrained, run, limits)
            del run  # nothing of it is held here: a run dropped now is freed now
            release_memory()  # before its client is told: what it measures is what stays
            done.set()

    def _turn(self, pretrained, run: LongRun, limits: Limits) -> threading.Event:
        def going() -> None:
            if run.stop.is_set() or self.clock() - run.asked > limits.long_idle_s:
                raise Cancelled

        try:
            self._read(pretrained, run, going)
        except BaseException as error:  # read reports its own errors: this is a bug of ours
            trace = "".join(traceback.format_exception(error)).rstrip()
            log.error("reading a long text failed\n%s", trace)
            run.error = without_traceback(error)
        with self._guard:
            self._reading = None
            ours = self._runs.get(run.text) is run
            if run.error is None and ours:
                run.bytes = size(run.records, run.summaries)
                self._runs.move_to_end(run.text)  # just read: the most recently used
                self._evict(limits, run)
            elif isinstance(run.error, Cancelled) and ours:
                del self._runs[run.text]
        return run.done

    # ------------------------------------------------------------------ bounds (under _guard)

    def _forget(self, now: float, limits: Limits) -> bool:
        """Drop what nobody has asked about for long_idle_s: a text waiting or being read (it
        stops at its next layer), or an outcome its client never came back for. Texts read
        and told are not idle: they are kept, and evicted in their turn."""
        dropped = False
        for text, run in list(self._runs.items()):
            if now - run.asked <= limits.long_idle_s or (run.told and run.error is None):
                continue
            del self._runs[text]
            dropped = True
            run.stop.set()
            if run in self._waiting:
                self._waiting.remove(run)
                run.error = Cancelled()
                run.done.set()
        return dropped

    def _evict(self, limits: Limits, newest: LongRun) -> None:
        """The least recently used texts' records and summaries go while those kept hold more
        than max_long_kept_bytes; the one just read stays whatever its size."""
        kept = [r for r in self._runs.values() if r.records is not None and r is not newest]
        total = newest.bytes + sum(r.bytes for r in kept)
        for run in kept:  # least recently used first
            if total <= limits.max_long_kept_bytes:
                break
            total -= run.bytes
            if run.told:
                del self._runs[run.text]
            else:  # its client is owed the 200: a run of the table alone, until it is told
                self._runs[run.text] = dataclasses.replace(run, records=None, summaries=None,
                                                           bytes=0)  # fmt: skip


def size(*held) -> int:
    """Bytes of the tensors in `held` (dicts, dataclasses, lists of them), each storage once."""
    storages: dict[int, int] = {}

    def visit(value) -> None:
        if isinstance(value, torch.Tensor):
            storage = value.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
        elif isinstance(value, dict):
            for item in value.values():
                visit(item)
        elif isinstance(value, list | tuple):
            for item in value:
                visit(item)
        elif dataclasses.is_dataclass(value) and not isinstance(value, type):
            for f in dataclasses.fields(value):
                visit(getattr(value, f.name))

    for value in held:
        visit(value)
    return sum(storages.values())


def without_traceback(error: BaseException) -> BaseException:
    """`error` with no traceback, nor any in its causes: a traceback's frames hold their
    locals (a reading's records), and an error that refers to them keeps them alive."""
    if isinstance(error, Cancelled):
        return Cancelled()
    links, seen = [error], set()
    while links:
        link = links.pop()
        if link is None or id(link) in seen:
            continue
        seen.add(id(link))
        link.__traceback__ = None
        links += [link.__cause__, link.__context__]
    return error


M_MMAP_THRESHOLD = -3  # mallopt's parameter (malloc.h)
# bytes: a block this large or larger is mapped, and unmapped when freed; smaller ones come
# from glibc's arenas (a reading's chunks of weights, 38 MB at 4,096 tokens of SmolLM2, are
# reused there: at 1 MiB each was mapped afresh, and reading took 1.8x as long)
MMAP_THRESHOLD = 64 << 20


@functools.cache
def _glibc():
    """glibc, or None elsewhere (musl, macOS, Windows): what `release_memory` asks of it."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    try:
        libc = ctypes.CDLL("libc.so.6")
        return libc if hasattr(libc, "malloc_trim") and hasattr(libc, "mallopt") else None
    except OSError:
        return None


@functools.cache
def bound_allocator() -> None:
    """Once per process, by the server's own process (`qkv.serve.server`: a program that
    only imports the app keeps its allocator as it chose): glibc's mmap threshold fixed (at
    MMAP_THRESHOLD), which also stops glibc moving its thresholds as large blocks are freed.
    Left to move, which freed blocks stay resident after a reading depends on the order of
    the allocations before it: the tiny server of tests/serve/test_long_memory.py ended a
    text anywhere from 316 to 358 MB (trimmed each time); fixed, at 316 to 319."""
    libc = _glibc()
    if libc is not None:
        libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)


def release_memory() -> None:
    """Give what glibc keeps of freed memory (below the mmap threshold) back to the system:
    with `bound_allocator`, a server's resident memory after ten texts of 4,096 tokens is
    what it was after the first (docs/serve.md); without them it grew from 2.8 to 6.8 GB over
    four. No-op off glibc."""
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)
