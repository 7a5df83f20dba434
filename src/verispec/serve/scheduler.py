"""Continuous batching for the server: one background thread runs a DecodeBatch.

Requests arrive from the asyncio side as ready-made Sequences (`submit`), wait in a bounded queue,
join the running batch between steps while it has free rows, and leave it when they finish, are
cancelled (the client went away) or run past their deadline; a leaving sequence's cache rows are
freed before the next step. Each step's result goes back to the request's asyncio queue as an
`Update`, a snapshot the event loop may read while the thread decodes on.
"""

from __future__ import annotations

import asyncio
import collections
import copy
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from verispec.engine import DecodeBatch, SpeculativeEngine
from verispec.sequence import Sequence
from verispec.stats import GenerationStats

log = logging.getLogger("verispec.serve")


class QueueFull(Exception):
    """The waiting queue holds max_queue requests already (HTTP 429)."""


class ShuttingDown(Exception):
    """The server is stopping and admits no new requests (HTTP 503)."""


@dataclass(frozen=True)
class ServeError:
    """Why a request was cut: HTTP status, OpenAI error type and message."""

    status: int
    type: str
    message: str


@dataclass(frozen=True)
class Update:
    """A request's state after one step.

    generated: all tokens generated so far (after any stop-string cut).
    finish_reason: None while running, else "eos", "stop" or "length".
    text_end: where a stop string cut the text, if one did.
    stats: the sequence's counters, on the last update only.
    error: set (and nothing else is meaningful) when the request was cut.
    """

    generated: tuple[int, ...] = ()
    finish_reason: str | None = None
    text_end: int | None = None
    stats: GenerationStats | None = None
    error: ServeError | None = None

    @property
    def done(self) -> bool:
        return self.finish_reason is not None or self.error is not None


class Ticket:
    """One submitted request: the scheduler posts Updates; `cancel` removes it at the next step boundary."""

    def __init__(self, sequence: Sequence, loop: asyncio.AbstractEventLoop, deadline: float,
                 scheduler: Scheduler) -> None:
        self.sequence = sequence
        self.loop = loop
        self.deadline = deadline  # time.monotonic() after which the request is cut
        self.updates: asyncio.Queue[Update] = asyncio.Queue()
        self.cancelled = False
        self.finished = False
        self._scheduler = scheduler

    def cancel(self) -> None:
        """The client is gone: free the request's row (or queue place) now. No-op once finished."""
        if not self.finished and not self.cancelled:
            self.cancelled = True
            self._scheduler.wake()

    def post(self, update: Update) -> None:
        """Called from the scheduler thread."""
        if update.done:
            self.finished = True
        try:
            self.loop.call_soon_threadsafe(self.updates.put_nowait, update)
        except RuntimeError:  # the event loop has closed: nobody is listening any more
            pass


class Scheduler:
    """Runs `engine` over a continuously changing batch in one background thread.

    Args:
        engine: the engine whose target and drafter decode every request (used by this thread only).
        max_batch_size: rows decoded together (1: requests one after another).
        max_queue: requests waiting for a row; `submit` raises QueueFull beyond it.
        on_idle: called by this thread whenever the batch is empty (e.g. `OnlineAdapter.poke`, which
            starts a background update of the drafter between requests).
    """

    IDLE_WAIT_S = 0.5  # how long the idle thread sleeps between checks when nothing wakes it

    def __init__(self, engine: SpeculativeEngine, max_batch_size: int, max_queue: int,
                 on_idle: Callable[[], None] | None = None) -> None:
        self.engine = engine
        self.on_idle = on_idle
        self.max_batch_size = max_batch_size
        self.max_queue = max_queue
        self.batch = DecodeBatch(engine)
        self._waiting: collections.deque[Ticket] = collections.deque()
        self._running: dict[int, Ticket] = {}  # id(sequence) -> ticket
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stopping = False  # no new requests; finish the rest
        self._abort: ServeError | None = None  # cut everything with this error and exit
        self._thread = threading.Thread(target=self._loop, name="verispec-scheduler", daemon=True)

    # --- the asyncio side ----------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def submit(self, sequence: Sequence, timeout_s: float) -> Ticket:
        """Queue a sequence (from `engine.make_sequences`); must be called on the running event loop."""
        ticket = Ticket(sequence, asyncio.get_running_loop(), time.monotonic() + timeout_s, self)
        with self._lock:
            if self._stopping:
                raise ShuttingDown()
            if len(self._waiting) >= self.max_queue:
                raise QueueFull()
            self._waiting.append(ticket)
        self.wake()
        return ticket

    def wake(self) -> None:
        self._wake.set()

    @property
    def queue_depth(self) -> int:
        return len(self._waiting)

    @property
    def running(self) -> int:
        return len(self._running)

    @property
    def stopping(self) -> bool:
        return self._stopping

    def cache_rows(self) -> int:
        """Rows held in the target's KV cache (0 when idle: nothing leaks between requests)."""
        state = self.batch.state
        return 0 if state is None else state.batch_size

    def stop(self, timeout_s: float) -> None:
        """Admit nothing new, let in-flight requests finish for up to timeout_s, then cut the rest."""
        with self._lock:
            self._stopping = True
        self.wake()
        if not self._thread.is_alive():
            return
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            self._abort = ServeError(503, "server_shutting_down", "the server shut down before this request finished")
            self.wake()
            self._thread.join()

    # --- the decoding thread -------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            self._reap()
            if self._abort is not None:
                self._cut_all(self._abort)
                return
            self._admit()
            if not self.batch:
                if self._stopping and not self._waiting:
                    return
                if self.on_idle is not None:
                    self.on_idle()
                self._wake.wait(self.IDLE_WAIT_S)
                self._wake.clear()
                continue
            try:
                results = self.batch.step()
            except Exception:  # a bug must not take the server down: fail this batch, keep serving
                log.exception("decoding step failed; the requests in the batch are cut")
                self._cut_all(ServeError(500, "internal_error", "decoding failed on the server; see its log"))
                continue
            for _, seq in results:
                ticket = self._running[id(seq)]
                final = seq.finish_reason is not None
                if final:  # before posting: a client that has its answer never sees the request still running
                    del self._running[id(seq)]
                ticket.post(Update(tuple(seq.generated), seq.finish_reason, seq.text_end,
                                   copy.deepcopy(seq.stats) if final else None))

    def _admit(self) -> None:
        joining = []
        with self._lock:
            while self._waiting and len(self.batch) + len(joining) < self.max_batch_size:
                joining.append(self._waiting.popleft())
        for ticket in joining:
            self._running[id(ticket.sequence)] = ticket
        self.batch.add([t.sequence for t in joining])

    def _reap(self) -> None:
        """Drop cancelled and expired requests, running or waiting, before the next step."""
        now = time.monotonic()
        timeout = ServeError(408, "timeout", "the request ran past the server's request timeout")
        for ticket in list(self._running.values()):
            if ticket.cancelled or now > ticket.deadline:
                self.batch.cancel(ticket.sequence)
                del self._running[id(ticket.sequence)]
                if not ticket.cancelled:
                    ticket.post(Update(error=timeout))
        with self._lock:
            waiting = list(self._waiting)
            self._waiting = collections.deque(t for t in waiting if not t.cancelled and now <= t.deadline)
        for ticket in waiting:
            if not ticket.cancelled and now > ticket.deadline:
                ticket.post(Update(error=timeout))

    def _cut_all(self, error: ServeError) -> None:
        with self._lock:
            waiting, self._waiting = list(self._waiting), collections.deque()
        for ticket in [*self._running.values(), *waiting]:
            ticket.post(Update(error=error))
        self._running.clear()
        self.batch = DecodeBatch(self.engine)
