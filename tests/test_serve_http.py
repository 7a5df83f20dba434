"""HTTP hygiene over real sockets on loopback: an oversized body gets a readable 413 in every transport (the body
is drained, so no client sees a reset), slow or silent clients are cut by the header and body clocks, connections
past limit_concurrency get a 503 and idle keep-alive connections close, and a public bind without an API key is
warned about. Every wait here is bounded, and no check depends on how fast the machine answers."""

import json
import logging
import socket
import time

import httpx
import openai
import pytest

from tiny_hf import save_tiny_model_dir
from verispec import SpeculativeDecoder
from verispec.serve.config import ServeConfig
from verispec.serve.server import BackgroundServer, uvicorn_config

KEY = "test-key-123"
BIG = 20_000_000  # bytes: twenty times the default body limit


@pytest.fixture(scope="module")
def decoder(tmp_path_factory):
    target = save_tiny_model_dir(tmp_path_factory.mktemp("http_models") / "target", "llama", seed=0)
    return SpeculativeDecoder.load(str(target), "ngram")


def connect(server: BackgroundServer, timeout: float = 10.0) -> socket.socket:
    host, port = server.url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=timeout)


def read_response(sock: socket.socket) -> tuple[int, dict, bytes]:
    """One HTTP/1.1 response with a Content-Length: (status, headers, body)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"the server closed before answering: {data!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    status_line, *lines = head.decode().split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, v in (line.split(":", 1) for line in lines)}
    while len(body) < int(headers["content-length"]):
        chunk = sock.recv(65536)
        assert chunk, "the server closed in the middle of its answer"
        body += chunk
    return int(status_line.split()[1]), headers, body


def closed_by_the_server(sock: socket.socket, trickle: bytes = b"", bound_s: float = 30.0) -> tuple[bool, int]:
    """Whether the server closed `sock` (waiting at most `bound_s`, a bound only, so that a server that never
    closes fails the test instead of hanging it), sending `trickle` one byte about every 0.1 s meanwhile; and how
    many of those bytes were sent before it did."""
    start, sent = time.monotonic(), 0
    sock.settimeout(0.1)
    while time.monotonic() - start < bound_s:
        try:
            if sent < len(trickle):
                sock.sendall(trickle[sent : sent + 1])
                sent += 1
            if sock.recv(65536) == b"":
                return True, sent
        except socket.timeout:
            continue
        except (ConnectionResetError, BrokenPipeError):
            return True, sent
    return False, sent


def send_big(sock: socket.socket, chunked: bool, headers: bytes = b"") -> None:
    """POST a BIG-byte body with `Connection: close`, in 64 KiB pieces, the whole of it (a reset fails here)."""
    head = b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nConnection: close\r\n"
    head += headers + (b"Transfer-Encoding: chunked\r\n\r\n" if chunked else b"Content-Length: %d\r\n\r\n" % BIG)
    sock.sendall(head)
    piece, sent = b"x" * 65536, 0
    while sent < BIG:
        part = piece[: BIG - sent]
        sock.sendall(b"%x\r\n%s\r\n" % (len(part), part) if chunked else part)
        sent += len(part)
    if chunked:
        sock.sendall(b"0\r\n\r\n")


def test_an_oversized_body_gets_a_readable_413_in_every_transport(decoder):
    """The 413 goes out at once with `Connection: close`, and the server reads (and drops) the rest of the body before
    closing: closing on unread bytes makes the client's TCP stack reset the connection mid-upload."""
    with BackgroundServer(decoder, ServeConfig(port=0, api_key=KEY)) as s:
        auth = b"Authorization: Bearer %s\r\n" % KEY.encode()
        for chunked, headers, status in ((False, auth, 413), (True, auth, 413), (False, b"", 401)):
            with connect(s) as sock:
                send_big(sock, chunked, headers)  # the whole body goes through: no reset, no broken pipe
                code, got, body = read_response(sock)
                assert code == status and got["connection"] == "close", (chunked, headers, code)
                assert json.loads(body)["error"]["message"]
                assert sock.recv(65536) == b""  # then the server closes, cleanly (within the socket's timeout)
        big = {"prompt": "x" * BIG}
        r = httpx.post(s.url + "/v1/completions", json=big, headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
        assert r.status_code == 413 and "larger than" in r.json()["error"]["message"]
        client = openai.OpenAI(base_url=s.url + "/v1", api_key=KEY, max_retries=0, timeout=30)
        with pytest.raises(openai.APIStatusError) as err:
            client.completions.create(model="tiny", prompt="x" * BIG)
        assert err.value.status_code == 413 and "larger than" in err.value.message
        assert httpx.get(s.url + "/health").status_code == 200


def test_slow_headers_and_stalled_bodies_are_cut(decoder):
    """The clocks cut what is too slow, whatever the machine's load: headers trickled a byte every 0.1 s are cut
    while bytes are still arriving (so by the header clock, which more bytes do not restart, and not by an idle
    timeout), a silent connection is closed, a stalled body gets its 408. None of them before its clock's 0.5 s,
    counted from before the client began (a clock can only start later than that)."""
    config = ServeConfig(port=0, header_timeout=0.5, body_timeout=0.5)
    trickle = b"POST /v1/completions HTTP/1.1\r\nX-Slow: " + b"a" * 300  # 33 s of headers at a byte per 0.1 s
    with BackgroundServer(decoder, config) as s:
        started = time.monotonic()
        with connect(s) as sock:  # headers byte by byte, each byte well inside the timeout, the whole too slow
            closed, sent = closed_by_the_server(sock, trickle)
            assert closed and sent < len(trickle), sent  # cut while the client was still sending
            assert time.monotonic() - started >= 0.4
        started = time.monotonic()
        with connect(s) as sock:  # a connection that never sends a byte
            assert closed_by_the_server(sock) == (True, 0)
            assert time.monotonic() - started >= 0.4
        with connect(s) as sock:  # headers, then part of the body, then nothing
            started = time.monotonic()
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 100\r\n\r\n{\"prompt\": ")
            code, headers, body = read_response(sock)  # within the socket's timeout
            assert code == 408 and headers["connection"] == "close" and json.loads(body)["error"]["type"] == "timeout"
            assert time.monotonic() - started >= 0.4 and sock.recv(65536) == b""
        r = httpx.post(s.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 3}, timeout=30)
        assert r.status_code == 200  # a client that sends in time is served as ever


def test_idle_connections_make_room_and_busy_ones_past_the_limit_get_503(decoder):
    config = ServeConfig(port=0, limit_concurrency=3, timeout_keep_alive=0.5)
    with BackgroundServer(decoder, config) as s:
        held = [connect(s) for _ in range(3)]  # open, and silent (the header clock is 10 s)
        time.sleep(0.1)
        with connect(s) as extra:  # past the limit: the oldest idle connection is closed to make room
            extra.sendall(b"GET /v1/models HTTP/1.1\r\nHost: localhost\r\n\r\n")
            code, headers, body = read_response(extra)
            assert code == 200, body
        assert closed_by_the_server(held[0])[0]  # (before: 503 while idle sockets held every place)
        for sock in held:
            sock.close()
        busy = []
        for _ in range(3):  # three requests in progress (headers in, body still coming): the limit
            sock = connect(s)
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 100\r\n\r\n{")
            busy.append(sock)
        time.sleep(0.2)
        with connect(s) as extra:
            extra.sendall(b"GET /v1/models HTTP/1.1\r\nHost: localhost\r\n\r\n")
            code, headers, body = read_response(extra)
            assert code == 503 and headers["connection"] == "close" and json.loads(body)["error"]["message"]
        for sock in busy:
            sock.close()
        deadline = time.monotonic() + 30  # a bound only: the server notices the closed connections within a moment
        while time.monotonic() < deadline:
            if httpx.get(s.url + "/v1/models", timeout=10).status_code == 200:
                break
            time.sleep(0.05)
        else:
            raise AssertionError("the server did not answer after the busy connections closed")
        with connect(s) as sock:  # a keep-alive connection, idle after its answer, is closed
            started = time.monotonic()  # before the request: the keep-alive clock starts after its answer
            sock.sendall(b"GET /v1/models HTTP/1.1\r\nHost: localhost\r\n\r\n")
            code, headers, _ = read_response(sock)
            assert code == 200 and headers.get("connection") != "close"
            assert closed_by_the_server(sock) == (True, 0)
            assert time.monotonic() - started >= 0.4


def test_a_public_bind_without_a_key_is_warned_about(caplog):
    app = object()
    with caplog.at_level(logging.WARNING, logger="verispec.serve"):
        for host, key in (("127.0.0.1", None), ("localhost", None), ("::1", None), ("0.0.0.0", KEY)):
            uvicorn_config(app, ServeConfig(host=host, api_key=key))
        assert caplog.records == []
        uvicorn_config(app, ServeConfig(host="0.0.0.0"))
    assert len(caplog.records) == 1 and "0.0.0.0" in caplog.records[0].getMessage()
    assert "\n" not in caplog.records[0].getMessage()
