"""Scale-out on Ray Serve (`verispec serve --ray --replicas N`; the optional extra `verispec[ray]`).

Each replica is a Ray actor that loads its own models (`SpeculativeDecoder.load` with the same arguments as
`verispec serve`) and runs the same OpenAI-compatible app as a single server (`serve.app.create_app`): its own
scheduler, continuous batching, API key, metrics. Ray Serve's proxy spreads requests over the replicas (at most
`max_ongoing_requests` each, so a busy replica's requests wait in Ray's queue, not in its batch), restarts a
replica whose health check fails or whose process dies, and scales the count between autoscaling bounds when
they are given. A replica's health check is the app's own `/health` (503 while it drains).

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

from verispec.config import AdaptConfig, ServeConfig
from verispec.errors import VerispecError

DEPLOYMENT = "verispec"


def ray_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("ray") is not None and importlib.util.find_spec("ray.serve") is not None


class Replica:
    """One replica: its own decoder and app; requests are handed to the app as they came (ASGI)."""

    def __init__(self, load: dict, config: ServeConfig, adapt: bool = False, threads: int | None = None) -> None:
        import httpx

        from verispec.api import SpeculativeDecoder, set_threads
        from verispec.serve.app import create_app

        set_threads(threads)
        decoder = SpeculativeDecoder.load(**load)
        if adapt:
            decoder.enable_adaptation(AdaptConfig())
        self.app = create_app(decoder, config)
        self.client = httpx.AsyncClient(transport=httpx.ASGITransport(app=self.app), base_url="http://replica",
                                        timeout=None)
        self._started: AsyncExitStack | None = None
        self._lock = asyncio.Lock()

    async def _start(self) -> None:
        """Run the app's lifespan (its scheduler thread) once, inside the replica's event loop."""
        async with self._lock:
            if self._started is None:
                stack = AsyncExitStack()
                await stack.enter_async_context(self.app.router.lifespan_context(self.app))
                self._started = stack

    async def __call__(self, request):
        from starlette.responses import StreamingResponse

        await self._start()
        body = await request.body()
        path = request.url.path + (f"?{request.url.query}" if request.url.query else "")
        forwarded = self.client.build_request(request.method, path, headers=request.headers.raw, content=body)
        response = await self.client.send(forwarded, stream=True)
        headers = {k: v for k, v in response.headers.items() if k.lower() not in ("content-length", "transfer-encoding")}

        async def chunks():
            try:
                async for chunk in response.aiter_raw():
                    yield chunk
            finally:
                await response.aclose()

        return StreamingResponse(chunks(), status_code=response.status_code, headers=headers)

    async def check_health(self) -> None:
        """Ray Serve's health check: the app's own /health must answer 200."""
        await self._start()
        response = await self.client.get("/health")
        if response.status_code != 200:
            raise RuntimeError(f"/health answered {response.status_code}")


def build_app(load: dict, config: ServeConfig, replicas: int = 2, adapt: bool = False, threads: int | None = None,
              autoscaling: dict | None = None, cpus_per_replica: float = 1.0, max_ongoing_requests: int | None = None):
    """The Ray Serve application: `replicas` copies of the app (or `autoscaling`, Ray's autoscaling_config:
    min_replicas, max_replicas, target_ongoing_requests, ...), each with `cpus_per_replica` CPUs."""
    from ray import serve

    if replicas < 1:
        raise VerispecError(f"--replicas must be >= 1, got {replicas}")
    options = {"name": DEPLOYMENT, "ray_actor_options": {"num_cpus": cpus_per_replica},
               "health_check_period_s": 5, "health_check_timeout_s": 30,
               "max_ongoing_requests": max_ongoing_requests or config.max_batch_size + config.max_queue}
    if autoscaling:
        options["autoscaling_config"] = autoscaling
    else:
        options["num_replicas"] = replicas
    return serve.deployment(Replica).options(**options).bind(load, config, adapt, threads)


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

    if not ray.is_initialized():
        ray.init(address=address, include_dashboard=False, log_to_driver=False,
                 **({} if address else {"num_cpus": max(2, int(replicas * cpus_per_replica + 1))}))
    serve.start(http_options={"host": config.host, "port": config.port})
    app = build_app(load, config, replicas, adapt, threads, autoscaling, cpus_per_replica)
    handle = serve.run(app, name=DEPLOYMENT, route_prefix="/", blocking=blocking)
    return handle
