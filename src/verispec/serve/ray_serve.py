"""Scale-out on Ray Serve (`verispec serve --ray --replicas N`; the optional extra `verispec[ray]`).

Each replica is a Ray actor that loads its own models (`SpeculativeDecoder.load` with the same arguments as
`verispec serve`) and runs the same OpenAI-compatible app as a single server (`serve.app.create_app`): its own
scheduler, continuous batching, API key, body limit, metrics. Ray Serve's proxy spreads requests over the replicas
(at most `max_ongoing_requests` each, so a busy replica's requests wait in Ray's queue, not in its batch); that
queue holds at most `max_queue` requests (`max_queued_requests`), past which the proxy answers 503 at once. Ray
restarts a replica whose health check fails or whose process dies, and scales the count between autoscaling bounds
when they are given. A replica's health check is the app's own `/health` (503 while it drains).

The app runs on the proxy's ASGI messages directly (`AppCall`): the key and Content-Length are checked from the
headers before any body is read, and streamed answers reach the client chunk by chunk. Header and body timeouts and
the connection limit of a single server (`serve.server`) are not applied: Ray's proxy owns the sockets.

A request that was running on a replica when it died fails with an error status from Ray's proxy; the proxy does
not replay it (generation is not idempotent unless seeded). Clients retry: the OpenAI client does by default on
5xx and connection errors, and a seeded request gives the same tokens wherever it is retried.

Across machines: start a Ray cluster (`ray start --head` on one, `ray start --address HEAD:6379` on the others),
then `verispec serve --ray --ray-address auto ...` on the head; every replica loads the models on the machine Ray
puts it on (they must be there: a named default fetched, or the same path on every machine).
"""

from __future__ import annotations

import asyncio
from contextlib import AsyncExitStack
from dataclasses import replace

from starlette.responses import Response

from verispec.config import AdaptConfig
from verispec.serve.config import ServeConfig
from verispec.errors import VerispecError

DEPLOYMENT = "verispec"
REPLICA_HEADER = b"x-verispec-replica"  # names the replica (its Ray actor) that answered


def ray_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("ray") is not None and importlib.util.find_spec("ray.serve") is not None


class AppCall(Response):
    """A replica's answer to one request: the app itself. Ray Serve runs a returned Response as an ASGI app on the
    proxy's own receive and send, so the app reads the body itself, as it arrives (its gate refuses a bad key or
    an oversized Content-Length before reading any), and every message it sends goes to the proxy as it is sent:
    a stream's chunks reach the client as they are made. Nothing is buffered here."""

    def __init__(self, app, replica: str) -> None:
        super().__init__()
        self.app, self.replica = app, replica.encode()

    async def __call__(self, scope, receive, send) -> None:
        async def named(message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), (REPLICA_HEADER, self.replica)]}
            await send(message)

        await self.app(scope, receive, named)


async def status_of(app, path: str) -> int:
    """The status `app` answers to GET `path`, asked in-process (an ASGI call, no socket)."""
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "GET", "scheme": "http",
             "path": path, "raw_path": path.encode(), "root_path": "", "query_string": b"", "headers": [],
             "client": None, "server": None}
    statuses: list[int] = []

    async def receive() -> dict:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message) -> None:
        if message["type"] == "http.response.start":
            statuses.append(message["status"])

    await app(scope, receive, send)
    return statuses[0]


class Replica:
    """One replica: its own decoder and app; each request is handed to the app's ASGI interface (`AppCall`)."""

    def __init__(self, load: dict, config: ServeConfig, adapt: bool = False, threads: int | None = None) -> None:
        import ray

        from verispec.api import SpeculativeDecoder, set_threads
        from verispec.serve.app import create_app

        set_threads(threads)
        decoder = SpeculativeDecoder.load(**load)
        if adapt:
            decoder.enable_adaptation(AdaptConfig())
        self.app = create_app(decoder, config)
        self.name = ray.get_runtime_context().get_actor_name() or "replica"
        self._started: AsyncExitStack | None = None
        self._lock = asyncio.Lock()

    async def _start(self) -> None:
        """Run the app's lifespan (its scheduler thread) once, inside the replica's event loop."""
        async with self._lock:
            if self._started is None:
                stack = AsyncExitStack()
                await stack.enter_async_context(self.app.router.lifespan_context(self.app))
                self._started = stack

    async def __call__(self, request) -> AppCall:
        await self._start()
        return AppCall(self.app, self.name)

    async def check_health(self) -> None:
        """Ray Serve's health check: the app's own /health must answer 200."""
        await self._start()
        status = await status_of(self.app, "/health")
        if status != 200:
            raise RuntimeError(f"/health answered {status}")


def build_app(load: dict, config: ServeConfig, replicas: int = 2, adapt: bool = False, threads: int | None = None,
              autoscaling: dict | None = None, cpus_per_replica: float = 1.0, max_ongoing_requests: int | None = None):
    """The Ray Serve application: `replicas` copies of the app (or `autoscaling`, Ray's autoscaling_config:
    min_replicas, max_replicas, target_ongoing_requests, ...), each with `cpus_per_replica` CPUs."""
    from ray import serve

    if replicas < 1:
        raise VerispecError(f"--replicas must be >= 1, got {replicas}")
    ongoing = max_ongoing_requests or config.max_batch_size + config.max_queue
    options = {"name": DEPLOYMENT, "ray_actor_options": {"num_cpus": cpus_per_replica},
               "health_check_period_s": 5, "health_check_timeout_s": 30,
               "max_ongoing_requests": ongoing, "max_queued_requests": config.max_queue}
    if autoscaling:
        options["autoscaling_config"] = autoscaling
    else:
        options["num_replicas"] = replicas
    # A replica holds at most `ongoing` requests, but its scheduler can see more than max_queue of them waiting: a
    # step that finishes k requests lets Ray send k more before the scheduler admits any. Its queue is made `ongoing`
    # long so that it never refuses (429) what Ray handed it; Ray's queue in front (max_queue) is the one that fills.
    replica_config = replace(config, max_queue=ongoing)
    return serve.deployment(Replica).options(**options).bind(load, replica_config, adapt, threads)


def run(load: dict, config: ServeConfig, replicas: int = 2, address: str | None = None, adapt: bool = False,
        threads: int | None = None, autoscaling: dict | None = None, cpus_per_replica: float = 1.0,
        blocking: bool = True):
    """Start (or join, `address`) Ray, serve the app on config.host:config.port through Ray Serve's proxy.
    blocking=False returns once the replicas are up (tests); True serves until interrupted."""
    if replicas < 1:
        raise VerispecError(f"--replicas must be >= 1, got {replicas}")
    if not ray_available():
        raise VerispecError("verispec serve --ray needs Ray Serve: pip install 'verispec[ray]'")
    import ray
    from ray import serve

    from verispec.serve.server import warn_if_public

    warn_if_public(config)
    if not ray.is_initialized():
        ray.init(address=address, include_dashboard=False, log_to_driver=False,
                 **({} if address else {"num_cpus": max(2, int(replicas * cpus_per_replica + 1))}))
    serve.start(http_options={"host": config.host, "port": config.port})
    app = build_app(load, config, replicas, adapt, threads, autoscaling, cpus_per_replica)
    handle = serve.run(app, name=DEPLOYMENT, route_prefix="/", blocking=blocking)
    return handle
