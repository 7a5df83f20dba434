"""Compiling structured-output constraints off the event loop, bounded in threads, queue and time.

A constraint is checked against the server's bounds first (`verispec.constraint_bounds`, through
`Grammars.compile`), so the chains its compiler follows stay short; the compile itself runs on a few threads of this
pool, each with a stack of STACK_BYTES (the compiler recurses natively; the bounds keep its depth a small fraction of
an 8 MiB stack, and these threads have eight times that), one at a time per thread. A request waits at most
`ConstraintLimits.compile_seconds` for its compile and is answered 400 past it; a compile cannot be interrupted, so it
finishes in its thread and its result is kept (a retry then finds it compiled). More than `max_waiting` compiles
waiting is a 503: a flood of constraints costs this pool's threads, never the event loop or the decoding thread.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
from collections.abc import Callable

from verispec.errors import is_fault

log = logging.getLogger("verispec.serve")

STACK_BYTES = 64 << 20  # a compile thread's stack (reserved address space; only the pages used cost memory)
_STACK_LOCK = threading.Lock()  # threading.stack_size is process-wide: set it only around starting our threads


class Busy(Exception):
    """More compiles are waiting than the pool takes (HTTP 503)."""


class CompileTimeout(Exception):
    """The compile ran past its time budget (HTTP 400: the constraint is too costly)."""


class CompilePool:
    """`workers` daemon threads with large stacks running submitted functions, at most `max_waiting` queued.

    Args:
        workers: threads (each compiles one constraint at a time).
        max_waiting: submitted functions not yet finished, past which `submit` raises Busy.
    """

    def __init__(self, workers: int, max_waiting: int) -> None:
        self.max_waiting = max_waiting
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._pending = 0
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._workers = workers

    def _start(self) -> None:
        """Start the threads (on first use)."""
        with _STACK_LOCK:
            previous = threading.stack_size(STACK_BYTES)
            try:
                for i in range(self._workers):
                    thread = threading.Thread(target=self._work, name=f"verispec-compile-{i}", daemon=True)
                    thread.start()
                    self._threads.append(thread)
            finally:
                threading.stack_size(previous)

    def submit(self, work: Callable[[], object]) -> concurrent.futures.Future:
        with self._lock:
            if self._pending >= self.max_waiting:
                raise Busy()
            self._pending += 1
            if not self._threads:
                self._start()
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._jobs.put((work, future))
        return future

    async def run(self, work: Callable[[], object], timeout_s: float):
        """`work()` on a pool thread; raises Busy, CompileTimeout past `timeout_s`, or what `work` raised."""
        future = asyncio.wrap_future(self.submit(work))
        try:
            return await asyncio.wait_for(asyncio.shield(future), timeout_s)
        except asyncio.TimeoutError:
            future.add_done_callback(_consume)  # it finishes in its thread; nobody waits for it any more
            raise CompileTimeout() from None

    def close(self) -> None:
        """End the threads once the jobs queued before this are done (a server's shutdown)."""
        with self._lock:
            threads, self._threads = self._threads, []
        for _ in threads:
            self._jobs.put(None)

    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            work, future = job
            try:
                if future.set_running_or_notify_cancel():
                    try:
                        future.set_result(work())
                    except BaseException as err:  # a native panic too, handed to the request that asked
                        if not is_fault(err):
                            raise
                        future.set_exception(err)
            finally:
                with self._lock:
                    self._pending -= 1


def _consume(future: asyncio.Future) -> None:
    """Read an abandoned compile's outcome (so asyncio does not log it as never retrieved)."""
    if not future.cancelled() and future.exception() is not None:
        log.info("a constraint compile that ran past its budget failed: %s", future.exception())
