"""A server in a process of its own for the serving benchmarks (`conversation.py`, `lm_eval_server.py`,
`serve_overhead.py`, `serve_tenants.py`)."""

from __future__ import annotations

import socket
import subprocess
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@contextmanager
def server(command: list[str], port: int, log: str | None = None, timeout_s: float = 900):
    """A server process on `port`, once it answers /v1/models; stopped on exit. Its output goes to `log` (None: a
    temporary file); a server that exits or does not start within `timeout_s` ends the benchmark with its log's end."""
    with tempfile.TemporaryDirectory() as tmp, open(log or Path(tmp) / "server.log", "w") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"

        def fail(what: str) -> SystemExit:
            out.flush()
            return SystemExit(f"{command[:4]} {what}: {Path(out.name).read_text()[-2000:]}")

        try:
            deadline = time.monotonic() + timeout_s
            while True:
                if process.poll() is not None:
                    raise fail("exited")
                try:
                    if httpx.get(url + "/v1/models", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise fail(f"did not start in {timeout_s:.0f} s")
                time.sleep(0.5)
            yield url
        finally:
            process.terminate()
            process.wait(60)
