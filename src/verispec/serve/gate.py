"""The HTTP gate in front of the app: API key (and so the tenant), Host and Origin, body size and per-endpoint answer
counts, before any handler runs.

With API keys, a request names its tenant by its key (`serve.tenants`; the gate puts the tenant's name in the ASGI
scope's state as "tenant"). With none, the server trusts whoever can reach it, so it checks where a request is meant
for: its Host must be an IP address, "localhost" or one of `allowed_hosts`, and so must an Origin it sends. A web page
on another site cannot then drive a server on loopback through DNS rebinding (its requests carry the attacker's
host name) nor post to it from its own origin.

A refused request is answered with `refuse`: the OpenAI-style error, `Connection: close`, and the rest of the body
the client is still sending read and dropped before the connection closes. A server that closes a connection with
unread bytes in it makes its TCP stack send a reset; the client, still uploading, then sees "connection reset" (or a
broken pipe) instead of the answer waiting in its buffer. Reading the rest costs bandwidth, so it is bounded:
DRAIN_LIMIT_BYTES and DRAIN_LIMIT_S, after which the connection closes anyway.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import time
from urllib.parse import urlsplit

from starlette.exceptions import HTTPException as StarletteHTTPException

from verispec.serve.metrics import Metrics
from verispec.serve.protocol import APIError
from verispec.serve.tenants import Keys

ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/tokenize", "/detokenize", "/tokenizer_info",
             "/health", "/metrics")
DRAIN_LIMIT_BYTES = 64 << 20  # most of a refused body read and dropped so that its client can read the answer
DRAIN_LIMIT_S = 10.0  # longest time spent doing so


async def drain(receive, limit_bytes: int = DRAIN_LIMIT_BYTES, limit_s: float = DRAIN_LIMIT_S) -> int:
    """Read and drop the rest of a request's body: until its end, the client leaving, `limit_bytes` or `limit_s`.
    Returns the bytes dropped."""
    dropped, deadline = 0, time.monotonic() + limit_s
    while dropped <= limit_bytes and time.monotonic() < deadline:
        try:
            message = await asyncio.wait_for(receive(), deadline - time.monotonic())
        except asyncio.TimeoutError:
            break
        if message["type"] != "http.request":
            break
        dropped += len(message.get("body", b""))
        if not message.get("more_body", False):
            break
    return dropped


async def refuse(error: APIError, receive, send) -> None:
    """Answer `error` (OpenAI-style JSON) with `Connection: close`, draining the request's body before the end.

    The whole answer is sent first (its Content-Length met), so a client that reads while it uploads has it at
    once; the response is only completed, and the connection closed, once the body is drained."""
    body = json.dumps(error.body()).encode()
    await send({"type": "http.response.start", "status": error.status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body)),
                            (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body, "more_body": True})
    await drain(receive)
    await send({"type": "http.response.body", "body": b"", "more_body": False})


def host_allowed(host: str, allowed: frozenset[str]) -> bool:
    """Whether a Host or Origin host name may reach a server with no key: an IP address (a page loaded from it is the
    server's own origin), "localhost", or a name in `allowed` ("*": any)."""
    if "*" in allowed or host in allowed or host == "localhost":
        return True
    try:
        ipaddress.ip_address(host.strip("[]"))
        return True
    except ValueError:
        return False


def _host_of(value: bytes, origin: bool) -> str | None:
    """The host name of a Host header ("name:port", "[::1]:8000") or an Origin ("http://name:port"); None if unreadable."""
    try:
        text = value.decode("ascii").strip().lower()
        return urlsplit(text if origin else "//" + text).hostname
    except (UnicodeDecodeError, ValueError):
        return None


class Gate:
    """ASGI middleware: checks the API key (naming the request's tenant) or, with no key, its Host and Origin before a
    body is read, limits the body's size (by its Content-Length, and by counting when it is sent in chunks), and
    counts answers per endpoint. (Starlette's own body limit answers in plain text, not in the OpenAI error format.)

    Args:
        keys: the server's API keys (none: every request is tenant "").
        max_body_bytes: the largest body.
        metrics: counts answers per endpoint (None: not counted).
        allowed_hosts: host names a keyless server answers besides IP addresses and localhost.
        public: paths that need no key ("/static/": every path under it; "/" is the root page alone).
    """

    def __init__(self, app, keys: Keys, max_body_bytes: int, metrics: Metrics | None,
                 allowed_hosts: tuple[str, ...] = (), public: tuple[str, ...] = ("/health",)) -> None:
        self.app, self.keys, self.metrics = app, keys, metrics
        self.max_body_bytes = max_body_bytes
        self.allowed_hosts = frozenset(h.lower() for h in allowed_hosts)
        self.public = public

    def _tenant(self, scope) -> str | None:
        path = scope["path"]
        if any(path == p or (len(p) > 1 and p.endswith("/") and path.startswith(p)) for p in self.public):
            return ""
        return self.keys.tenant(dict(scope["headers"]).get(b"authorization", b""))

    def _misdirected(self, headers: dict) -> str | None:
        """With no key: why the request's Host or Origin is refused, or None."""
        if self.keys.required:
            return None
        for name, origin in ((b"host", False), (b"origin", True)):
            if name not in headers:  # (an Origin of "null", a sandboxed page's, is refused)
                continue
            host = _host_of(headers[name], origin)
            if host is None or not host_allowed(host, self.allowed_hosts):
                return f"{name.decode().capitalize()} '{headers[name][:100].decode('latin-1')}'"
        return None

    def check_headers(self, scope) -> APIError | None:
        """The refusal a request earns from its headers alone (key, Host / Origin, Content-Length), or None. Notes the
        tenant in scope["state"]["tenant"]."""
        headers = dict(scope["headers"])
        length = headers.get(b"content-length", b"0")
        tenant = self._tenant(scope)
        if tenant is None:
            return APIError(401, "invalid or missing API key (send 'Authorization: Bearer <key>')",
                            "authentication_error", code="invalid_api_key")
        scope.setdefault("state", {})["tenant"] = tenant
        misdirected = self._misdirected(headers)
        if misdirected is not None:
            return APIError(403, f"this server answers requests for this machine only, not for {misdirected} (a server "
                            "without an API key checks where a request is meant for; see --allowed-hosts)",
                            "permission_error", code="host_not_allowed")
        if not length.isdigit():
            return APIError(400, "invalid Content-Length header")
        if int(length) > self.max_body_bytes:
            return APIError(413, f"request body larger than {self.max_body_bytes} bytes")
        return None

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        request = _Request(receive, send, self.max_body_bytes)
        try:
            error = self.check_headers(scope)
            if error is not None:
                await refuse(error, receive, request.forward)
            else:
                await self.app(scope, request.receive, request.send)
        finally:
            if self.metrics is not None:
                endpoint = scope["path"] if scope["path"] in ENDPOINTS else "other"
                self.metrics.requests.labels(endpoint, str(request.status)).inc()


class _Request:
    """One request through the gate: counts its body as the app reads it, and notes the answer's status.

    A body that grows past the limit stops the app's read (an HTTPException the app answers); the app's answer is
    then dropped and the gate's own `refuse` goes out instead, with the drain and `Connection: close`."""

    def __init__(self, receive, send, max_body_bytes: int) -> None:
        self._receive, self._send, self.max_body_bytes = receive, send, max_body_bytes
        self.received = 0
        self.refused: APIError | None = None
        self.status = 500

    async def receive(self):
        message = await self._receive()
        if message["type"] == "http.request":
            self.received += len(message.get("body", b""))
            if self.received > self.max_body_bytes:
                self.refused = APIError(413, f"request body larger than {self.max_body_bytes} bytes")
                raise StarletteHTTPException(413)
        return message

    async def send(self, message) -> None:
        if self.refused is None:
            await self.forward(message)
        elif message["type"] == "http.response.start":  # the app's answer to a refused body: the gate's goes instead
            await refuse(self.refused, self._receive, self.forward)

    async def forward(self, message) -> None:
        if message["type"] == "http.response.start":
            self.status = message["status"]
        await self._send(message)
