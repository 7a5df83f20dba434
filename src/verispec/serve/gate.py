"""The HTTP gate in front of the app: API key, body size and per-endpoint answer counts, before any handler runs."""

from __future__ import annotations

import hmac

from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from verispec.serve.metrics import Metrics
from verispec.serve.protocol import APIError

ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics")


class Gate:
    """ASGI middleware: checks the API key before a body is read, limits the body's size (by its
    Content-Length, and by counting when it is sent in chunks), and counts answers per endpoint.
    (Starlette's own body limit answers in plain text, not in the OpenAI error format.)"""

    def __init__(self, app, api_key: str | None, max_body_bytes: int, metrics: Metrics) -> None:
        self.app, self.key, self.metrics = app, api_key.encode() if api_key else None, metrics
        self.max_body_bytes = max_body_bytes

    def _too_large(self) -> APIError:
        return APIError(413, f"request body larger than {self.max_body_bytes} bytes")

    def _limited(self, receive):
        received = 0

        async def limited_receive():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_body_bytes:
                    raise StarletteHTTPException(413)  # FastAPI passes it on to the handler below
            return message

        return limited_receive

    def _authorized(self, scope) -> bool:
        if self.key is None or scope["path"] == "/health":
            return True
        header = dict(scope["headers"]).get(b"authorization", b"")
        scheme, _, given = header.partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(given.strip(), self.key)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = 500

        async def counted(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            length = dict(scope["headers"]).get(b"content-length", b"0")
            if not self._authorized(scope):
                error = APIError(401, "invalid or missing API key (send 'Authorization: Bearer <key>')",
                                 "authentication_error", code="invalid_api_key")
            elif not length.isdigit():
                error = APIError(400, "invalid Content-Length header")
            elif int(length) > self.max_body_bytes:
                error = self._too_large()
            else:
                return await self.app(scope, self._limited(receive), counted)
            await JSONResponse(error.body(), error.status)(scope, receive, counted)
        finally:
            endpoint = scope["path"] if scope["path"] in ENDPOINTS else "other"
            self.metrics.requests.labels(endpoint, str(status)).inc()
