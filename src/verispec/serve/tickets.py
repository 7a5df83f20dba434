"""What the server's decoding thread and a request's handler pass each other: the request's mailbox (`Ticket`), what
it gained since it last looked (`Update`), why it was cut (`ServeError`), and why it was not taken (the exceptions
`Scheduler.submit` raises).

A ticket merges what its reader has not taken yet: a stalled reader costs one pending update, never a growing queue,
and posting costs the decoding thread an append and at most one wake-up of the event loop per request.
"""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from verispec.core.sequence import Sequence
from verispec.errors import ConstraintError
from verispec.stats import GenerationStats

if TYPE_CHECKING:
    from verispec.serve.scheduler import Scheduler


class QueueFull(Exception):
    """The waiting queue holds max_queue requests already, or the tenant's share of it (HTTP 429)."""

    def __init__(self, tenant_share: int | None = None) -> None:
        super().__init__("queue full" if tenant_share is None else f"the key's {tenant_share} places are taken")
        self.tenant_share = tenant_share


class ShuttingDown(Exception):
    """The server is stopping and admits no new requests (HTTP 503)."""


class Unavailable(Exception):
    """The decoding thread is not running (HTTP 503)."""


class TooLarge(Exception):
    """The request alone would need more key/value cache than the server's budget, or its key's share of it
    (HTTP 400)."""

    def __init__(self, needed: int, budget: int, per_key: bool = False) -> None:
        super().__init__(f"needs {needed} bytes of cache, budget {budget}")
        self.needed, self.budget, self.per_key = needed, budget, per_key


@dataclass(frozen=True)
class ServeError:
    """Why a request was cut: HTTP status, OpenAI error type and message."""

    status: int
    type: str
    message: str
    param: str | None = None


@dataclass(frozen=True)
class Update:
    """What a request gained since the last update its reader took.

    tokens: the tokens generated since then (after any stop-string cut).
    finish_reason: None while running, else "eos", "stop" or "length".
    text_end: where a stop string cut the text, if one did.
    logprobs: the tokens' log-probabilities (`core.sequence.TokenLogprob`), where the request asked for them.
    stats: the sequence's counters, on the last update only.
    error: set when the request was cut (tokens may still hold what came before).
    """

    tokens: tuple[int, ...] = ()
    logprobs: tuple = ()  # the tokens' TokenLogprob entries, where the request asked for them
    finish_reason: str | None = None
    text_end: int | None = None
    stats: GenerationStats | None = None
    error: ServeError | None = None

    @property
    def done(self) -> bool:
        return self.finish_reason is not None or self.error is not None

    def then(self, later: Update) -> Update:
        """This update followed by a later one, as one."""
        return replace(later, tokens=self.tokens + later.tokens, logprobs=self.logprobs + later.logprobs)


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
        tenant: who asked (`serve.tenants`: the API key's name; "" without keys).
    """

    def __init__(self, sequence: Sequence, loop: asyncio.AbstractEventLoop, deadline: float, scheduler: Scheduler,
                 reserved: int = 0, streaming: bool = True, tenant: str = "") -> None:
        self.sequence = sequence
        self.tenant = tenant
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


def error_for(err: BaseException) -> ServeError:
    """The answer to a request that a fault ended: a constraint's own failure is the client's (400)."""
    if isinstance(err, ConstraintError):
        return ServeError(400, "invalid_request_error", str(err), "response_format")
    if isinstance(err, MemoryError):
        return ServeError(503, "server_overloaded", "the server ran out of memory for this request; retry later")
    return ServeError(500, "internal_error", f"decoding this request failed ({type(err).__name__}); see the server log")
