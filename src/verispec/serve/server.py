"""Running the app with uvicorn: in the foreground (`verispec serve`) or in a background thread
(tests and the load benchmark)."""

from __future__ import annotations

import threading
import time

import uvicorn

from verispec.api import SpeculativeDecoder
from verispec.config import ServeConfig
from verispec.errors import VerispecError
from verispec.serve.app import create_app


def run_server(decoder: SpeculativeDecoder, config: ServeConfig) -> None:
    """Serve until interrupted; on SIGINT / SIGTERM in-flight requests get `config.shutdown_timeout` to finish."""
    uvicorn.run(create_app(decoder, config), host=config.host, port=config.port,
                timeout_graceful_shutdown=config.shutdown_timeout, log_level="info")


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
        self.server = uvicorn.Server(uvicorn.Config(self.app, host=config.host, port=config.port, log_level="warning",
                                                    timeout_graceful_shutdown=config.shutdown_timeout))
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
        """Shut down gracefully and wait for it (bounded by the shutdown timeout)."""
        self.server.should_exit = True
        self.thread.join(self.config.shutdown_timeout * 2 + 5)

    def __exit__(self, *exc) -> None:
        self.stop()
