"""Continuous batching for the server: one background thread runs a DecodeBatch, and nothing stops it.

Requests arrive from the asyncio side as ready-made Sequences (`submit`), wait in a bounded queue, join the
running batch between steps while it has free rows and the key/value cache they reserve fits the budget
(`max_cache_bytes`: each request reserves its prompt plus max_tokens at admission, so N full-context requests
wait instead of running the machine out of memory), and leave it when they finish, are cancelled (the client went
away), run past their deadline, or fail. A leaving sequence's cache rows are freed before the next step.

Each step's new tokens go back to the request as an `Update`, through a mailbox (`Ticket`, `serve.tickets`) that
merges what the reader has not taken yet.

With several tenants (API keys, `serve.tenants`) each may hold a share of the rows, the queue and the cache budget,
and the next free row goes to the waiting tenant holding the fewest. Once the server is stopping nobody joins: the
waiting requests are answered 503 at once and the running ones get the drain's time.

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
from dataclasses import dataclass, field

from verispec.batch import DecodeBatch
from verispec.core.sequence import Sequence
from verispec.engine import SpeculativeEngine
from verispec.errors import is_fault
from verispec.serve.tenants import Ledger, share_of
from verispec.serve.tickets import (  # noqa: F401 - the names a caller of the scheduler meets, importable here too
    QueueFull, ServeError, ShuttingDown, Ticket, TooLarge, Unavailable, Update, error_for)
from verispec.tuning import KTuner

log = logging.getLogger("verispec.serve")


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
        key_share: with several tenants, the most of the rows, the queue and the cache budget one may hold at once
            (`serve.tenants`); None: no per-tenant limit.
    """

    IDLE_WAIT_S = 0.5  # how long the idle thread sleeps between checks when nothing wakes it
    FLUSH_S = 5.0  # how long the loop's end waits for the drafter's store to reach its file

    def __init__(self, engine: SpeculativeEngine, max_batch_size: int, max_queue: int,
                 on_idle: Callable[[], None] | None = None, prefill_chunk: int | None = None,
                 max_cache_bytes: int | None = None, tuner: KTuner | None = None,
                 key_share: float | None = None) -> None:
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
        self.tenants = Ledger(share_of(key_share, max_batch_size, max_queue, self.max_cache_bytes))
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

    def check_fits(self, tokens: int, tenant: str = "") -> None:
        """Raise TooLarge where a request holding `tokens` positions (prompt, max_tokens, one step's drafts and tree
        nodes) could never run: over the cache budget, or its tenant's share of it. Cheap: before its constraint is
        compiled."""
        needed = self.engine.cache_bytes(tokens)
        if needed > self.max_cache_bytes:
            raise TooLarge(needed, self.max_cache_bytes)
        if self.tenants.over_cache(tenant, needed):
            raise TooLarge(needed, self.tenants.share.cache_bytes, per_key=True)

    def check_room(self, tenant: str = "") -> None:
        """Raise what `submit` would for a request of this tenant now, before any work is spent on it (its prompt read,
        its constraint compiled): ShuttingDown, Unavailable or QueueFull."""
        if self._stopping:
            raise ShuttingDown()
        if not self.alive:
            raise Unavailable()
        if len(self._waiting) >= self.max_queue:
            raise QueueFull()
        if self.tenants.over_queue(tenant):
            raise QueueFull(self.tenants.share.queue)

    def submit(self, sequence: Sequence, timeout_s: float, streaming: bool = True, tenant: str = "") -> Ticket:
        """Queue a sequence (from `engine.make_sequences`) of this tenant; must be called on the running event loop."""
        reserved = self.reservation(sequence)
        if reserved > self.max_cache_bytes:
            raise TooLarge(reserved, self.max_cache_bytes)
        if self.tenants.over_cache(tenant, reserved):
            raise TooLarge(reserved, self.tenants.share.cache_bytes, per_key=True)
        ticket = Ticket(sequence, asyncio.get_running_loop(), time.monotonic() + timeout_s, self, reserved, streaming,
                        tenant)
        with self._lock:
            self.check_room(tenant)
            self._waiting.append(ticket)
            self.tenants.waiting[tenant] += 1
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
            for results in self.engine.run(self.batch, self._between, self._step_failed):
                self._deliver(results)
        except BaseException as err:  # noqa: BLE001 - the loop must say why it died, whatever it was
            self._died = err
            log.critical("the decoding loop died (%s: %s); /health answers 503", type(err).__name__, err,
                         exc_info=True)
            try:
                self._cut_all(ServeError(503, "server_unavailable", "the server stopped decoding; see its log"))
            except BaseException:  # noqa: BLE001
                pass
        finally:
            if not self.engine.drafter.traits.plain:  # what finished or was cut reaches the drafter's file (suffix:FILE)
                self._guarded("flush", lambda: self.engine.drafter.flush_store(self.FLUSH_S))
            self._ended = True

    def _between(self, batch: DecodeBatch) -> bool:
        """What the loop does before each step (`SpeculativeEngine.run`): reap, admit, and wait while the batch is
        empty; False when the loop should end."""
        if self._stop_deadline is not None and self._abort is None and time.monotonic() > self._stop_deadline:
            self._abort = ServeError(503, "server_shutting_down", "the server shut down before this request finished")
        self._guarded("reap", self._reap)
        if self._abort is not None:
            self._cut_all(self._abort)
            return False
        self._guarded("admit", self._admit)
        if not batch:
            if self._stopping and not self._waiting:
                return False
            if self.on_idle is not None:
                self._guarded("idle", self.on_idle)
            self._wake.wait(self.IDLE_WAIT_S)
            self._wake.clear()
        return True

    def _step_failed(self, err: BaseException) -> None:
        """A bug outside the step's own guards: this batch's requests are cut, and the server keeps serving."""
        self.faults.add("step", err)
        log.error("decoding step failed; the requests in the batch are cut", exc_info=err)
        self._cut_running(ServeError(500, "internal_error", "decoding failed on the server; see its log"))

    def _deliver(self, results: list) -> None:
        """After a step: count the faults the batch absorbed, send each sequence's new tokens to its request."""
        for stage, err in self.batch.faults:
            self.faults.counts[stage] += 1
        self.batch.faults.clear()
        for _, seq in results:
            self._guarded("post", lambda seq=seq: self._post(seq))

    def _guarded(self, stage: str, work: Callable[[], None]) -> None:
        try:
            work()
        except BaseException as err:  # a native panic too (`is_fault`), never an interrupt
            if not is_fault(err):
                raise
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
        logprobs = () if seq.logprobs is None else tuple(seq.logprobs[ticket.posted :])
        new, ticket.posted = tuple(generated[ticket.posted :]), len(generated)
        ticket.post(Update(new, logprobs, seq.finish_reason, seq.text_end, copy.deepcopy(seq.stats) if final else None))

    def _release(self, ticket: Ticket) -> None:
        if self._running.pop(id(ticket.sequence), None) is not None:
            self.reserved -= ticket.reserved
            self.tenants.ended(ticket.tenant, ticket.reserved)

    def _unqueue(self, tickets: list[Ticket]) -> None:
        """These tickets leave the waiting queue (under the lock)."""
        gone = {id(t) for t in tickets}
        self._waiting = collections.deque(t for t in self._waiting if id(t) not in gone)
        for ticket in tickets:
            self.tenants.waiting[ticket.tenant] -= 1
            if self.tenants.waiting[ticket.tenant] <= 0:
                del self.tenants.waiting[ticket.tenant]

    def _admit(self) -> None:
        """Let waiting requests join while rows are free: the tenant holding the fewest rows first (within its share,
        `serve.tenants`), first come first served within a tenant; nobody overtakes a request waiting for cache room.
        Once the server is stopping, nobody joins: the waiting requests are answered 503."""
        if self._stopping:
            with self._lock:
                waiting = list(self._waiting)
                self._unqueue(waiting)
            for ticket in waiting:
                ticket.post(Update(error=ServeError(503, "server_shutting_down", "the server is shutting down")))
            return
        joining: list[Ticket] = []
        # prompts a row reads now: a waiting request with the same prompt (the other n choices of one request) joins
        # once it is read and kept, and starts from that cache instead of reading it again
        reading = ({tuple(s.tokens) for s in self.batch.sequences if s.num_generated == 0}
                   if self.batch.shares_prompts() else None)
        with self._lock:
            while self._waiting and len(self.batch) + len(joining) < self.max_batch_size:
                ready = [t for t in self._waiting if not _reads_now(t, reading)] if reading else self._waiting
                ticket = self.tenants.pick(_first_of_each_tenant(ready))
                if ticket is None:
                    break  # every waiting tenant is at its share (or waits for a prompt being read)
                if (self.batch or joining) and self.reserved + ticket.reserved > self.max_cache_bytes:
                    break  # wait for room (nobody overtakes the request chosen)
                self._unqueue([ticket])
                if reading is not None:
                    reading.add(tuple(ticket.sequence.tokens))
                self.reserved += ticket.reserved
                self.tenants.started(ticket.tenant, ticket.reserved)
                joining.append(ticket)
        read: dict = {}  # (prompt, top) -> its entries: the n choices of one request read their prompt once
        joining = [t for t in joining if self._scored(t, read)]
        if not joining:
            return
        for ticket in joining:
            self._running[id(ticket.sequence)] = ticket
        try:
            self.batch.add([t.sequence for t in joining])
        except BaseException as err:
            if not is_fault(err):
                raise
            self.faults.add("admit", err)
            for ticket in joining:
                self._release(ticket)
                ticket.post(Update(error=error_for(err)))
            if self.batch.state is not None and self.batch.state.batch_size != len(self.batch):
                self._cut_running(ServeError(500, "internal_error", "the batch could not be restored; see the log"))

    def _scored(self, ticket: Ticket, read: dict) -> bool:
        """Read the prompt's log-probabilities where the request asks for them (`engine.score_prompt`) before it joins,
        once for the same prompt among the joining (`read`); False (the request answered with the error) where that
        fails: a fault there ends this request alone."""
        seq = ticket.sequence
        if not seq.spec.prompt_logprobs or seq.prompt_logprobs is not None:
            return True
        key = (tuple(seq.tokens[: seq.prompt_len]), seq.spec.logprobs)
        if key in read:
            seq.prompt_logprobs = read[key]
            return True
        try:
            self.engine.score_prompt(seq)
            read[key] = seq.prompt_logprobs
            return True
        except BaseException as err:
            if not is_fault(err):
                raise
            self.faults.add("admit", err)
            self._running[id(seq)] = ticket  # its reservation is given back as a running request's is
            self._release(ticket)
            ticket.post(Update(error=error_for(err)))
            return False

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
            gone = [t for t in self._waiting if t.cancelled or now > t.deadline]
            self._unqueue(gone)
        for ticket in gone:
            if not ticket.cancelled:
                ticket.post(Update(error=timeout))

    def _cut_running(self, error: ServeError) -> None:
        """End every running request with `error` and start a fresh batch; what the cut rows wrote so far still
        reaches the drafter's store (their rows leave it as finished ones do)."""
        if len(self.batch) and not self.engine.drafter.traits.plain:
            self._guarded("retire", self.engine.drafter.retire_all)
        for ticket in list(self._running.values()):
            self._release(ticket)
            ticket.post(Update(error=error))
        self._running.clear()
        self.reserved = 0
        self.batch.reset()

    def _cut_all(self, error: ServeError) -> None:
        with self._lock:
            waiting = list(self._waiting)
            self._unqueue(waiting)
        for ticket in waiting:
            ticket.post(Update(error=error))
        self._cut_running(error)


def _reads_now(ticket: Ticket, reading: set[tuple[int, ...]]) -> bool:
    """Whether a row reads this ticket's prompt now (its tokens compared only where a prompt of its length is read)."""
    tokens = ticket.sequence.tokens
    return any(len(key) == len(tokens) for key in reading) and tuple(tokens) in reading


def _first_of_each_tenant(waiting) -> list[Ticket]:
    """Each waiting tenant's first ticket, in arrival order."""
    heads, seen = [], set()
    for ticket in waiting:
        if ticket.tenant not in seen:
            seen.add(ticket.tenant)
            heads.append(ticket)
    return heads
