"""Continuous batching for the server: one background thread runs a DecodeBatch, and nothing stops it.

Requests arrive from the asyncio side as ready-made Sequences (`submit`), wait in a bounded queue, join the
running batch between steps while it has free rows and the key/value cache they reserve fits the budget
(`max_cache_bytes`: each request reserves its prompt plus max_tokens at admission, so N full-context requests
wait instead of running the machine out of memory), and leave it when they finish, are cancelled (the client went
away), run past their deadline, or fail. A leaving sequence's cache rows are freed before the next step.

Each step's new tokens go back to the request as an `Update`, through a mailbox (`Ticket`) that merges what the
reader has not taken yet: a stalled reader costs one pending update, never a growing queue, and posting costs the
decoding thread an append and at most one wake-up of the event loop per request.

Faults stay where they belong (see `verispec.batch` for those inside a step): a request whose admission fails is
answered with an error and the batch goes on; every other part of the loop (reaping, idling, posting) is guarded
and counted in `faults`; and if the thread dies all the same, `alive` turns False, /health says 503 and waiting
requests are answered instead of waiting forever.
"""

from __future__ import annotations

import asyncio
import collections
import copy
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from verispec.batch import DecodeBatch
from verispec.core.sequence import Sequence
from verispec.engine import SpeculativeEngine
from verispec.stats import GenerationStats
from verispec.tuning import AdaptiveK

log = logging.getLogger("verispec.serve")


class QueueFull(Exception):
    """The waiting queue holds max_queue requests already (HTTP 429)."""


class ShuttingDown(Exception):
    """The server is stopping and admits no new requests (HTTP 503)."""


class Unavailable(Exception):
    """The decoding thread is not running (HTTP 503)."""


class TooLarge(Exception):
    """The request alone would need more key/value cache than the server's budget (HTTP 400)."""

    def __init__(self, needed: int, budget: int) -> None:
        super().__init__(f"needs {needed} bytes of cache, budget {budget}")
        self.needed, self.budget = needed, budget


@dataclass(frozen=True)
class ServeError:
    """Why a request was cut: HTTP status, OpenAI error type and message."""

    status: int
    type: str
    message: str


@dataclass(frozen=True)
class Update:
    """What a request gained since the last update its reader took.

    tokens: the tokens generated since then (after any stop-string cut).
    finish_reason: None while running, else "eos", "stop" or "length".
    text_end: where a stop string cut the text, if one did.
    stats: the sequence's counters, on the last update only.
    error: set when the request was cut (tokens may still hold what came before).
    """

    tokens: tuple[int, ...] = ()
    finish_reason: str | None = None
    text_end: int | None = None
    stats: GenerationStats | None = None
    error: ServeError | None = None

    @property
    def done(self) -> bool:
        return self.finish_reason is not None or self.error is not None

    def then(self, later: Update) -> Update:
        """This update followed by a later one, as one."""
        return replace(later, tokens=self.tokens + later.tokens)


class Ticket:
    """One submitted request: the scheduler posts Updates into its mailbox; the reader takes them with `next`.

    Args:
        sequence: the request's sequence.
        loop: the event loop its reader runs on.
        deadline: time.monotonic() after which the request is cut.
        scheduler: to wake on `cancel`.
        reserved: bytes of key/value cache the request reserves while it runs.
        streaming: wake the reader at every post (a stream sends each step's text); False wakes it only at the
            end, so a request answered in one piece costs the event loop nothing while it decodes.
    """

    def __init__(self, sequence: Sequence, loop: asyncio.AbstractEventLoop, deadline: float, scheduler: Scheduler,
                 reserved: int = 0, streaming: bool = True) -> None:
        self.sequence = sequence
        self.loop = loop
        self.deadline = deadline
        self.reserved = reserved
        self.cancelled = False
        self.finished = False
        self.posted = 0  # tokens of sequence.generated posted so far (scheduler thread)
        self.first_token_at: float | None = None  # time.monotonic() when its first token was posted
        self.streaming = streaming
        self._scheduler = scheduler
        self._lock = threading.Lock()
        self._pending: Update | None = None
        self._woken = False  # a wake-up is on its way to the reader, or it has not taken the mail since
        self._ready = asyncio.Event()

    def cancel(self) -> None:
        """The client is gone: free the request's row (or queue place) now. No-op once finished."""
        if not self.finished and not self.cancelled:
            self.cancelled = True
            self._scheduler.wake()

    def post(self, update: Update) -> None:
        """Called from the scheduler thread: merge into the mailbox; wake the reader unless a wake-up is already
        on its way (or, when not streaming, until the request is done)."""
        with self._lock:
            self._pending = update if self._pending is None else self._pending.then(update)
            if update.done:
                self.finished = True
            wake = not self._woken and (self.streaming or update.done)
            self._woken = self._woken or wake
        if wake:
            try:
                self.loop.call_soon_threadsafe(self._ready.set)
            except RuntimeError:  # the event loop has closed: nobody is listening any more
                pass

    async def next(self, timeout: float | None = None) -> Update | None:
        """The updates posted since the last call, merged (waiting up to `timeout` s for one; None if none came)."""
        if timeout is None:
            await self._ready.wait()
        else:
            try:
                await asyncio.wait_for(self._ready.wait(), timeout)
            except asyncio.TimeoutError:
                return None
        with self._lock:
            update, self._pending = self._pending, None
            self._ready.clear()
            self._woken = False
        return update


def default_cache_budget() -> int:
    """A quarter of this machine's physical memory, in bytes."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 4
    except (ValueError, OSError, AttributeError):  # pragma: no cover - not POSIX
        return 4 << 30


@dataclass
class _Faults:
    """Faults the scheduler absorbed, by stage (exposed at /metrics)."""

    counts: collections.Counter = field(default_factory=collections.Counter)

    def add(self, stage: str, err: BaseException) -> None:
        self.counts[stage] += 1
        log.warning("fault in %s: %s: %s", stage, type(err).__name__, err)


class Scheduler:
    """Runs `engine` over a continuously changing batch in one background thread.

    Args:
        engine: the engine whose target and drafter decode every request (used by this thread only).
        max_batch_size: rows decoded together (1: requests one after another).
        max_queue: requests waiting for a row; `submit` raises QueueFull beyond it.
        on_idle: called by this thread whenever the batch is empty (e.g. `OnlineAdapter.poke`, which
            starts a background update of the drafter between requests).
        prefill_chunk: prompt tokens a joining request reads per step (None: a whole prompt in one step).
        max_cache_bytes: key/value cache the running requests may reserve together (None: `default_cache_budget`).
        tuner: chooses K each step for every row from measured costs (None: each request's own K).
    """

    IDLE_WAIT_S = 0.5  # how long the idle thread sleeps between checks when nothing wakes it

    def __init__(self, engine: SpeculativeEngine, max_batch_size: int, max_queue: int,
                 on_idle: Callable[[], None] | None = None, prefill_chunk: int | None = None,
                 max_cache_bytes: int | None = None, tuner: AdaptiveK | None = None) -> None:
        self.engine = engine
        self.on_idle = on_idle
        self.max_batch_size = max_batch_size
        self.max_queue = max_queue
        self.prefill_chunk = prefill_chunk
        self.max_cache_bytes = max_cache_bytes or default_cache_budget()
        self.tuner = tuner  # K per step from measured costs, for all rows together (ServeConfig.auto_k)
        self.batch = DecodeBatch(engine, tuner, prefill_chunk=prefill_chunk)
        self.faults = _Faults()
        self.reserved = 0  # bytes reserved by the running requests
        self._waiting: collections.deque[Ticket] = collections.deque()
        self._running: dict[int, Ticket] = {}  # id(sequence) -> ticket
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stopping = False  # no new requests; finish the rest
        self._stop_deadline: float | None = None  # time.monotonic() past which the rest is cut
        self._abort: ServeError | None = None  # cut everything with this error and exit
        self._died: BaseException | None = None  # what ended the loop, if it died
        self._ended = False  # the loop has returned
        self._thread: threading.Thread | None = None

    # --- running the loop ----------------------------------------------------------------------
    def start(self) -> None:
        """Run the decoding loop in a thread of its own."""
        self._thread = threading.Thread(target=self.run, name="verispec-scheduler", daemon=True)
        self._thread.start()

    def run(self) -> None:
        """Run the decoding loop in the calling thread until it is stopped. `verispec serve` runs it on the main
        thread: the kernels' OpenMP parallel regions cost 2-4x more when started from another thread (measured
        with libgomp here: 2-3 us a region from the main thread, 7-9 us from a second one), which made decoding
        through the server 10% slower than `verispec generate`."""
        self._loop()

    def reservation(self, sequence: Sequence) -> int:
        """Bytes of cache a request reserves: its prompt, max_new_tokens and one step's drafts, in every model."""
        spec = sequence.spec
        drafts = spec.tree.size_upper_bound(spec.tree.depth(spec.num_draft_tokens)) if spec.tree else spec.num_draft_tokens
        return self.engine.cache_bytes(len(sequence.tokens) + sequence.max_new_tokens + drafts + 1)

    def submit(self, sequence: Sequence, timeout_s: float, streaming: bool = True) -> Ticket:
        """Queue a sequence (from `engine.make_sequences`); must be called on the running event loop."""
        reserved = self.reservation(sequence)
        if reserved > self.max_cache_bytes:
            raise TooLarge(reserved, self.max_cache_bytes)
        ticket = Ticket(sequence, asyncio.get_running_loop(), time.monotonic() + timeout_s, self, reserved, streaming)
        with self._lock:
            if self._stopping:
                raise ShuttingDown()
            if not self.alive:
                raise Unavailable()
            if len(self._waiting) >= self.max_queue:
                raise QueueFull()
            self._waiting.append(ticket)
        self.wake()
        return ticket

    def wake(self) -> None:
        self._wake.set()

    @property
    def died(self) -> BaseException | None:
        """What ended the decoding loop, if something did (None while it runs, and after a clean stop)."""
        return self._died

    @property
    def alive(self) -> bool:
        """Whether the decoding loop runs (or has not started yet): False once it has died or stopped."""
        return self._died is None and not self._ended

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

    def request_stop(self, timeout_s: float) -> None:
        """Admit nothing new; the loop lets in-flight requests finish for up to timeout_s, cuts the rest and returns.
        Safe from any thread (and from a signal handler)."""
        with self._lock:
            self._stopping = True
            deadline = time.monotonic() + timeout_s
            self._stop_deadline = deadline if self._stop_deadline is None else min(self._stop_deadline, deadline)
        self.wake()

    def stop(self, timeout_s: float) -> None:
        """`request_stop`, then wait for the loop's thread to end (when it runs in one)."""
        self.request_stop(timeout_s)
        if self._thread is not None and self._thread.is_alive():
            self._thread.join(timeout_s + 30)

    # --- the decoding thread -------------------------------------------------------------------
    def _loop(self) -> None:
        try:
            while self._iterate():
                pass
        except BaseException as err:  # noqa: BLE001 - the loop must say why it died, whatever it was
            self._died = err
            log.critical("the decoding loop died (%s: %s); /health answers 503", type(err).__name__, err,
                         exc_info=True)
            try:
                self._cut_all(ServeError(503, "server_unavailable", "the server stopped decoding; see its log"))
            except BaseException:  # noqa: BLE001
                pass
        finally:
            self._ended = True

    def _iterate(self) -> bool:
        """One turn of the loop; False when the loop should end."""
        if self._stop_deadline is not None and self._abort is None and time.monotonic() > self._stop_deadline:
            self._abort = ServeError(503, "server_shutting_down", "the server shut down before this request finished")
        self._guarded("reap", self._reap)
        if self._abort is not None:
            self._cut_all(self._abort)
            return False
        self._guarded("admit", self._admit)
        if not self.batch:
            if self._stopping and not self._waiting:
                return False
            if self.on_idle is not None:
                self._guarded("idle", self.on_idle)
            self._wake.wait(self.IDLE_WAIT_S)
            self._wake.clear()
            return True
        try:
            results = self.batch.step()
        except Exception as err:  # a bug outside the step's own guards: cut this batch, keep serving
            self.faults.add("step", err)
            log.exception("decoding step failed; the requests in the batch are cut")
            self._cut_running(ServeError(500, "internal_error", "decoding failed on the server; see its log"))
            return True
        for stage, err in self.batch.faults:
            self.faults.counts[stage] += 1
        self.batch.faults.clear()
        for _, seq in results:
            self._guarded("post", lambda seq=seq: self._post(seq))
        return True

    def _guarded(self, stage: str, work: Callable[[], None]) -> None:
        try:
            work()
        except Exception as err:
            self.faults.add(stage, err)

    def _post(self, seq: Sequence) -> None:
        """Send a sequence's new tokens (and its end) to its request."""
        ticket = self._running.get(id(seq))
        if ticket is None:
            return
        final = seq.finish_reason is not None
        if final:  # before posting: a client that has its answer never sees the request still running
            self._release(ticket)
        if seq.error is not None:
            ticket.post(Update(error=error_for(seq.error)))
            return
        generated = seq.generated
        if ticket.first_token_at is None and generated:
            ticket.first_token_at = time.monotonic()
        new, ticket.posted = tuple(generated[ticket.posted :]), len(generated)
        ticket.post(Update(new, seq.finish_reason, seq.text_end, copy.deepcopy(seq.stats) if final else None))

    def _release(self, ticket: Ticket) -> None:
        if self._running.pop(id(ticket.sequence), None) is not None:
            self.reserved -= ticket.reserved

    def _admit(self) -> None:
        joining: list[Ticket] = []
        with self._lock:
            while self._waiting and len(self.batch) + len(joining) < self.max_batch_size:
                head = self._waiting[0]
                if (self.batch or joining) and self.reserved + head.reserved > self.max_cache_bytes:
                    break  # wait for room (first come, first served: nobody overtakes the head)
                self._waiting.popleft()
                self.reserved += head.reserved
                joining.append(head)
        if not joining:
            return
        for ticket in joining:
            self._running[id(ticket.sequence)] = ticket
        try:
            self.batch.add([t.sequence for t in joining])
        except Exception as err:
            self.faults.add("admit", err)
            for ticket in joining:
                self._release(ticket)
                ticket.post(Update(error=error_for(err)))
            if self.batch.state is not None and self.batch.state.batch_size != len(self.batch):
                self._cut_running(ServeError(500, "internal_error", "the batch could not be restored; see the log"))

    def _reap(self) -> None:
        """Drop cancelled and expired requests, running or waiting, before the next step."""
        now = time.monotonic()
        timeout = ServeError(408, "timeout", "the request ran past the server's request timeout")
        for ticket in list(self._running.values()):
            if ticket.cancelled or now > ticket.deadline:
                self._release(ticket)
                self.batch.cancel(ticket.sequence)
                if not ticket.cancelled:
                    ticket.post(Update(error=timeout))
        with self._lock:
            waiting = list(self._waiting)
            self._waiting = collections.deque(t for t in waiting if not t.cancelled and now <= t.deadline)
        for ticket in waiting:
            if not ticket.cancelled and now > ticket.deadline:
                ticket.post(Update(error=timeout))

    def _cut_running(self, error: ServeError) -> None:
        for ticket in list(self._running.values()):
            ticket.post(Update(error=error))
        self._running.clear()
        self.reserved = 0
        self.batch = DecodeBatch(self.engine, self.tuner, prefill_chunk=self.prefill_chunk)

    def _cut_all(self, error: ServeError) -> None:
        with self._lock:
            waiting, self._waiting = list(self._waiting), collections.deque()
        for ticket in waiting:
            ticket.post(Update(error=error))
        self._cut_running(error)


def error_for(err: BaseException) -> ServeError:
    """The answer to a request that a fault ended."""
    if isinstance(err, MemoryError):
        return ServeError(503, "server_overloaded", "the server ran out of memory for this request; retry later")
    return ServeError(500, "internal_error", f"decoding this request failed ({type(err).__name__}); see the server log")
