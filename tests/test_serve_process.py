"""`verispec serve` as users run it, in a process of its own: the decoding loop on the main thread, uvicorn in a
second one. It answers, a SIGTERM lets the request in flight finish and the process exits 0, and a port that is
taken is one clear line and exit status 2 (the CLI's status for an error it explains)."""

import json
import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

from tiny_hf import save_tiny_model_dir


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(save_tiny_model_dir(tmp_path_factory.mktemp("process_models") / "target", "llama", seed=0))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve(model_dir: str, port: int, *extra: str) -> subprocess.Popen:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.Popen([sys.executable, "-m", "verispec", "serve", "--target", model_dir, "--draft", "ngram",
                             "--port", str(port), "--shutdown-timeout", "20", *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def wait_healthy(url: str, process: subprocess.Popen, seconds: float = 120) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        assert process.poll() is None, process.communicate()[1][-2000:]
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise AssertionError("the server did not come up")


def test_serve_answers_and_a_sigterm_lets_the_request_in_flight_finish(model_dir):
    port = free_port()
    process = serve(model_dir, port)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, process)
        r = httpx.post(url + "/v1/completions", json={"prompt": "hello", "max_tokens": 8, "temperature": 0}, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8
        body = {"prompt": "hello", "max_tokens": 100, "temperature": 0, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}
        with httpx.Client(timeout=60) as c, c.stream("POST", url + "/v1/completions", json=body) as r:
            lines = (line for line in r.iter_lines() if line.startswith("data: "))
            first = next(lines)  # the answer has begun: the request is in flight, however fast the machine
            process.send_signal(signal.SIGTERM)
            rest = list(lines)
        assert r.status_code == 200 and rest[-1] == "data: [DONE]"
        chunks = [json.loads(line.removeprefix("data: ")) for line in [first, *rest[:-1]]]
        assert chunks[-1]["usage"]["completion_tokens"] == 100  # the whole answer, after the SIGTERM
        assert process.wait(60) == 0
    finally:
        if process.poll() is None:
            process.kill()


def test_a_port_in_use_is_one_line_and_exit_status_2(model_dir):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        process = serve(model_dir, port)
        _, err = process.communicate(timeout=120)
    assert process.returncode == 2, err[-2000:]
    assert "could not start on 127.0.0.1" in err and "Traceback" not in err
