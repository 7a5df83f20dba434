"""Running the app with uvicorn: in the foreground (`verispec serve`) or in a background thread
(tests and the load benchmark). Both take their uvicorn settings from `uvicorn_config`.

uvicorn bounds idle keep-alive connections and nothing else a client controls. `GuardedH11Protocol` adds the
rest, per connection:

- a header clock: a request's headers must be complete within header_timeout of the connection opening (or of
  the request's first byte, on a kept-alive connection), or the connection is closed. A clock that is running is
  not restarted by more bytes, so headers trickled a byte at a time hold a connection no longer than silence does;
- a body clock: once the headers are in, the body must be complete within body_timeout, or the client gets a 408
  (when nothing was answered yet) and the connection is closed. It runs whether or not the app reads the body: a
  body the app never reads (a 404, a refusal) is still received to its end before the connection is reused;
- a concurrency limit that idle sockets cannot exhaust: when more than limit_concurrency connections are open, the
  idle ones (no request on them: waiting for a first request's headers, or kept alive between requests) are closed,
  the oldest first, so sockets opened and left silent never lock others out; a request gets an OpenAI-style 503 only
  while more than limit_concurrency connections are busy or requests running (uvicorn's own limit counts idle
  sockets and the asking connection against itself, and answers in plain text).
"""

from __future__ import annotations

import functools
import ipaddress
import json
import logging
import signal
import threading
import time

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from verispec.api import SpeculativeDecoder
from verispec.serve.config import ServeConfig
from verispec.errors import VerispecError
from verispec.serve.app import create_app
from verispec.serve.gate import refuse
from verispec.serve.protocol import APIError

log = logging.getLogger("verispec.serve")
SHUTDOWN_GRACE_S = 5.0  # uvicorn's grace period beyond the drain (`shutdown_timeout`), for the last answers to go out


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a header clock, a body clock and an OpenAI-style concurrency limit (see the
    module's docstring). uvicorn makes one per connection: `uvicorn_config` passes the three limits in."""

    def __init__(self, config: uvicorn.Config, server_state, app_state: dict, _loop=None, *, header_timeout: float,
                 body_timeout: float, limit_concurrency: int) -> None:
        super().__init__(config, server_state, app_state, _loop)
        self.header_timeout, self.body_timeout, self.concurrency = header_timeout, body_timeout, limit_concurrency
        self.app = functools.partial(self._admit, self.app)
        self._clock: str | None = None  # "headers", "body" or None
        self._alarm = None  # the running clock's asyncio.TimerHandle

    # --- the clocks ---------------------------------------------------------------------------------
    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._opened = self.loop.time()
        self._start("headers")
        if len(self.connections) > self.concurrency:
            self._close_idle()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._follow(idle_means_headers=True)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._follow(idle_means_headers=False)  # idle between requests: uvicorn's keep-alive timer runs

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop()
        super().connection_lost(exc)

    def _follow(self, idle_means_headers: bool) -> None:
        """Run the clock the client's side of the connection is on: waiting for headers, or for a body."""
        state = self.conn.their_state
        if state is h11.IDLE and idle_means_headers:
            self._start("headers")
        elif state is h11.SEND_BODY:
            self._start("body")
        else:
            self._stop()

    def _start(self, clock: str) -> None:
        if self._clock == clock:  # already running: more bytes buy no more time
            return
        self._stop()
        seconds = self.header_timeout if clock == "headers" else self.body_timeout
        self._clock, self._alarm = clock, self.loop.call_later(seconds, self._late)

    def _stop(self) -> None:
        if self._alarm is not None:
            self._alarm.cancel()
        self._clock = self._alarm = None

    def _late(self) -> None:
        clock, self._clock, self._alarm = self._clock, None, None
        if self.transport.is_closing():
            return
        cycle = self.cycle
        if clock == "body" and cycle is not None and not cycle.response_started and not cycle.disconnected:
            error = APIError(408, f"the request body did not arrive within {self.body_timeout:g} seconds", "timeout")
            body = json.dumps(error.body()).encode()
            headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body)),
                       (b"connection", b"close")]
            for event in (h11.Response(status_code=408, headers=headers, reason=b"Request Timeout"), h11.Data(data=body),
                          h11.EndOfMessage()):
                self.transport.write(self.conn.send(event))
        if cycle is not None:  # the app's receive now reports the client gone, and whatever it sends is dropped
            cycle.disconnected = True
            cycle.message_event.set()
        self.transport.close()

    # --- the concurrency limit ----------------------------------------------------------------------
    @property
    def idle(self) -> bool:
        """No request on this connection now (none yet, or the last one answered)."""
        return self.cycle is None or self.cycle.response_complete

    def _close_idle(self) -> None:
        """Close idle connections, oldest first, until at most limit_concurrency are open (this one is kept)."""
        idle = sorted((c for c in self.connections if c is not self and getattr(c, "idle", False)),
                      key=lambda c: c._opened)
        for other in idle[: len(self.connections) - self.concurrency]:
            other._stop()
            other.transport.close()

    async def _admit(self, app, scope, receive, send) -> None:
        """The app as this connection runs it. `connections` and `tasks` include this connection and request."""
        if len(self.connections) > self.concurrency:
            self._close_idle()
        if len(self.connections) > self.concurrency or len(self.tasks) > self.concurrency:
            log.warning("more than %d connections or requests at once: answered 503", self.concurrency)
            error = APIError(503, f"the server is at its limit of {self.concurrency} connections; retry later",
                             "server_error", code="too_many_connections")
            return await refuse(error, receive, send)
        await app(scope, receive, send)


def is_loopback(host: str) -> bool:
    """Whether `host` is reachable from this machine only ("localhost", 127.0.0.0/8, ::1)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve to anything
        return False


def warn_if_public(config: ServeConfig) -> None:
    """Log one warning line when the server will be reachable from other machines and asks no API key."""
    if not is_loopback(config.host) and config.api_key is None:
        log.warning("serving on %s, reachable from other machines, without an API key: anyone who can reach it "
                    "can use it (set --api-key or VERISPEC_API_KEY)", config.host)


def uvicorn_config(app, config: ServeConfig, log_level: str = "info") -> uvicorn.Config:
    """The uvicorn settings every way of serving uses: the limits from `config` and the guarded protocol (and
    `warn_if_public`)."""
    warn_if_public(config)
    protocol = functools.partial(GuardedH11Protocol, header_timeout=config.header_timeout,
                                 body_timeout=config.body_timeout, limit_concurrency=config.limit_concurrency)
    # uvicorn closes what is still open past its grace period; it is longer than the scheduler's drain, so a request
    # cut at the drain's end still gets its 503 instead of a closed connection
    return uvicorn.Config(app, host=config.host, port=config.port, http=protocol, log_level=log_level,
                          timeout_keep_alive=config.timeout_keep_alive,
                          timeout_graceful_shutdown=config.shutdown_timeout + SHUTDOWN_GRACE_S)


def run_server(decoder: SpeculativeDecoder, config: ServeConfig) -> None:
    """Serve until interrupted; on SIGINT / SIGTERM in-flight requests get `config.shutdown_timeout` to finish.

    The decoding loop runs on this (the main) thread and uvicorn's event loop in a second one: the kernels' OpenMP
    regions started from a thread other than the main one cost 2-4x more (see `Scheduler.run`), which made a
    request through the server decode 10% slower than `verispec generate`."""
    app = create_app(decoder, config, scheduler_thread=False)
    scheduler = app.state.scheduler
    server = uvicorn.Server(uvicorn_config(app, config))
    web = threading.Thread(target=server.run, name="verispec-http", daemon=True)

    def shut_down(signum, _frame) -> None:
        log.info("shutting down (signal %d): in-flight requests get %g s", signum, config.shutdown_timeout)
        server.should_exit = True  # stop listening; uvicorn waits for the answers in flight
        scheduler.request_stop(config.shutdown_timeout)  # the loop finishes them, then returns

    def watch_web() -> None:  # uvicorn ended on its own (it could not bind, say): stop decoding too
        web.join()
        scheduler.request_stop(config.shutdown_timeout)

    previous = {sig: signal.signal(sig, shut_down) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        web.start()
        threading.Thread(target=watch_web, name="verispec-http-watch", daemon=True).start()
        scheduler.run()  # until shut down
        web.join(config.shutdown_timeout + SHUTDOWN_GRACE_S + 5)
        if scheduler.died is not None:
            raise VerispecError(f"the decoding loop died ({type(scheduler.died).__name__}: {scheduler.died}); "
                                "see the log above")
        if not server.started:
            raise VerispecError(f"the server could not start on {config.host}:{config.port} (see the log above)")
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        server.should_exit = True
        if decoder.adapter is not None:
            decoder.adapter.close()


class BackgroundServer:
    """Serve in a thread on config.host and a free port (port 0) or config.port; a context manager.

        with BackgroundServer(decoder, ServeConfig(port=0)) as server:
            httpx.get(server.url + "/health")

    Args:
        decoder: the loaded decoder.
        config: server settings.
        start_timeout: seconds to wait for the server to listen. Default 30.
    """

    def __init__(self, decoder: SpeculativeDecoder, config: ServeConfig = ServeConfig(port=0),
                 start_timeout: float = 30.0) -> None:
        self.app = create_app(decoder, config)
        self.config = config
        self.server = uvicorn.Server(uvicorn_config(self.app, config, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, name="verispec-uvicorn", daemon=True)
        self.start_timeout = start_timeout
        self.url = ""

    def __enter__(self) -> BackgroundServer:
        self.thread.start()
        deadline = time.monotonic() + self.start_timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise VerispecError(f"the server did not start on {self.config.host}:{self.config.port}")
            time.sleep(0.02)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://{self.config.host}:{port}"
        return self

    def stop(self) -> None:
        """Shut down gracefully and wait for it (bounded by the shutdown timeout): as `serve` does on a signal, the
        listener closes and the scheduler admits nothing new (503) while the requests in flight finish."""
        self.server.should_exit = True
        self.app.state.scheduler.request_stop(self.config.shutdown_timeout)
        self.thread.join(self.config.shutdown_timeout * 2 + 5)

    def __exit__(self, *exc) -> None:
        self.stop()
