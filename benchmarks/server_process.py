"""A server in a process of its own for the serving benchmarks (`conversation.py`, `lm_eval_server.py`)."""

from __future__ import annotations

import socket
import subprocess
import time
from contextlib import contextmanager

import httpx


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@contextmanager
def server(command: list[str], port: int, log: str):
    """A server process on `port`, once it answers; stopped on exit."""
    with open(log, "w") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 900
            while True:
                if process.poll() is not None:
                    raise SystemExit(f"{command[:4]} exited; see {log}")
                try:
                    if httpx.get(url + "/v1/models", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise SystemExit(f"{command[:4]} did not start; see {log}")
                time.sleep(0.5)
            yield url
        finally:
            process.terminate()
            process.wait(60)
