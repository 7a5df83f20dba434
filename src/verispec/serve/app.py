"""The OpenAI-compatible HTTP API over a SpeculativeDecoder, with continuous batching.

    POST /v1/completions, /v1/chat/completions   (JSON, or server-sent events with "stream": true)
    GET  /v1/models, /health, /metrics           (/metrics in Prometheus text format)

Every request is checked (fields, limits, context window, cache budget: `serve.requests`) and becomes one
Sequence; the Scheduler's thread decodes all running sequences together. Errors are OpenAI-style JSON
({"error": {...}}) with 4xx codes; an unexpected failure is a 500 with a one-line message, never a traceback.
A request never waits without a bound: past its deadline (the request timeout and a grace period) it is answered
408 whatever the decoding thread is doing, and at once with 503 if that thread has died.
"""

from __future__ import annotations

import asyncio
import json
import time
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from verispec.api import SpeculativeDecoder
from verispec.config import ServeConfig
from verispec.core.sequence import Sequence
from verispec.serve import protocol as wire
from verispec.serve.gate import Gate
from verispec.serve.metrics import Metrics
from verispec.serve.protocol import APIError, ChatRequest, CompletionRequest, GenerationRequest
from verispec.serve.requests import RequestBuilder
from verispec.serve.scheduler import QueueFull, Scheduler, ShuttingDown, Ticket, TooLarge, Unavailable, Update
from verispec.serve.streaming import TextStream, TimedStreamingResponse

POLL_S = 0.5  # how often a waiting request checks its client, its deadline and the decoding thread
DEADLINE_GRACE_S = 5.0  # past the request timeout, the scheduler has this long to answer before the request does


def create_app(decoder: SpeculativeDecoder, config: ServeConfig = ServeConfig(), scheduler_thread: bool = True) -> FastAPI:
    """Build the app. With `scheduler_thread` its lifespan runs the scheduler in a thread of its own and stops it
    (gracefully) at shutdown; without, the caller runs `app.state.scheduler.run()` itself (on the main thread:
    `serve.server.run_server`) and stops it."""
    engine = decoder.engine
    adapter = decoder.adapter  # online adaptation (`serve --adapt`): updates run while the scheduler idles
    scheduler = Scheduler(engine, config.max_batch_size, config.max_queue,
                          on_idle=adapter.poke if adapter is not None else None, prefill_chunk=config.prefill_chunk,
                          max_cache_bytes=config.max_cache_bytes)
    metrics = Metrics(scheduler, adapter)
    model_name = config.served_model_name or decoder.target.name
    context_window = engine.context_window
    requests = RequestBuilder(decoder, config, model_name)

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        if not scheduler_thread:  # the caller runs the loop and stops it
            yield
            return
        scheduler.start()
        yield
        await asyncio.to_thread(scheduler.stop, config.shutdown_timeout)
        if adapter is not None:
            await asyncio.to_thread(adapter.close)

    app = FastAPI(title="verispec", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.scheduler, app.state.metrics = scheduler, metrics
    app.add_middleware(Gate, api_key=config.api_key, max_body_bytes=config.max_body_bytes, metrics=metrics)

    # --- errors ----------------------------------------------------------------------------------
    @app.exception_handler(APIError)
    async def api_error(_: Request, err: APIError) -> JSONResponse:
        return JSONResponse(err.body(), err.status)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(_: Request, err: RequestValidationError) -> JSONResponse:
        first = err.errors()[0]
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        if first.get("type") == "json_invalid":
            message, param = f"malformed JSON in the request body: {first.get('ctx', {}).get('error', '')}", None
        elif first.get("type") == "extra_forbidden":
            message, param = f"unsupported field '{'.'.join(loc)}'", ".".join(loc)
        else:
            message, param = f"{'.'.join(loc) or 'body'}: {first.get('msg', 'invalid value')}", ".".join(loc) or None
        return JSONResponse(APIError(400, message, param=param).body(), 400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, err: StarletteHTTPException) -> JSONResponse:
        message = {404: "no such endpoint", 405: "method not allowed",
                   413: f"request body larger than {config.max_body_bytes} bytes"}.get(err.status_code, str(err.detail))
        return JSONResponse(APIError(err.status_code, message).body(), err.status_code)

    @app.exception_handler(Exception)
    async def internal_error(_: Request, err: Exception) -> JSONResponse:
        return JSONResponse(APIError(500, "internal server error; see the server log", "internal_error").body(), 500)

    # --- requests -> sequences ---------------------------------------------------------------------
    def submit(seq: Sequence, streaming: bool) -> Ticket:
        try:
            return scheduler.submit(seq, config.request_timeout, streaming)
        except QueueFull:
            raise APIError(429, f"the server is busy ({config.max_queue} requests waiting); retry later",
                           "rate_limit_error", code="queue_full") from None
        except ShuttingDown:
            raise APIError(503, "the server is shutting down", "server_shutting_down") from None
        except Unavailable:
            raise APIError(503, "the server is not decoding (its decoding thread stopped); see its log",
                           "server_unavailable") from None
        except TooLarge as err:
            raise APIError(400, f"this request's prompt and max_tokens need {err.needed / 2**20:.0f} MiB of key/value "
                           f"cache, more than this server's budget of {err.budget / 2**20:.0f} MiB; ask for fewer "
                           "tokens", param="max_tokens", code="context_length_exceeded") from None

    # --- answering ---------------------------------------------------------------------------------
    async def respond(request: Request, body: GenerationRequest, prompt: list[int], max_tokens: int | None,
                      chat: bool) -> Response:
        arrival = time.monotonic()
        ticket = submit(requests.sequence(body, prompt, max_tokens), body.stream)
        rid = wire.new_id("chatcmpl" if chat else "cmpl")
        if body.stream:
            include_usage = body.stream_options is not None and body.stream_options.include_usage
            return TimedStreamingResponse(stream(ticket, body, rid, chat, arrival, len(prompt), include_usage),
                                          send_timeout=config.send_timeout, media_type="text/event-stream",
                                          headers={"Cache-Control": "no-cache"})
        generated: list[int] = []
        try:
            update = await final_update(request, ticket, arrival, generated)
        finally:
            ticket.cancel()
        if update is None:  # the client went away; nobody reads this
            return Response(status_code=499)
        text = decoder.decode(generated)[: update.text_end]
        use = wire.usage(len(prompt), update.stats, decoder.draft_name if ticket.sequence.drafting else "none")
        metrics.finished(len(prompt), update.stats)
        make = wire.chat_body if chat else wire.completion_body
        return JSONResponse(make(rid, model_name, text, update.finish_reason, use))

    async def next_update(ticket: Ticket) -> Update | None:
        """The ticket's next update, or None after POLL_S; raises the answer a request gets when the decoding
        thread has died or the request's deadline (and its grace) has passed without the thread answering."""
        update = await ticket.next(POLL_S)
        if update is not None:
            return update
        if not scheduler.alive:
            raise APIError(503, "the server stopped decoding; see its log", "server_unavailable")
        if time.monotonic() > ticket.deadline + DEADLINE_GRACE_S:
            ticket.cancel()
            raise APIError(408, "the request ran past the server's request timeout", "timeout")
        return None

    async def final_update(request: Request, ticket: Ticket, arrival: float, generated: list[int]) -> Update | None:
        """The request's last update (its mailbox wakes the loop only then), with the tokens gathered on the way."""
        while True:
            update = await next_update(ticket)
            if update is None:
                if await request.is_disconnected():
                    return None
                continue
            if update.error is not None:
                raise APIError(update.error.status, update.error.message, update.error.type)
            generated.extend(update.tokens)
            if update.done:
                if ticket.first_token_at is not None:
                    metrics.first_token.observe(ticket.first_token_at - arrival)
                metrics.latency.observe(time.monotonic() - arrival)
                return update

    async def stream(ticket: Ticket, body: GenerationRequest, rid: str, chat: bool, arrival: float,
                     prompt_len: int, include_usage: bool):
        def sse(obj) -> str:
            return f"data: {json.dumps(obj)}\n\n"

        def chunk(text: str | None, finish: str | None, use: dict | None = None) -> str:
            if chat:
                delta = None if text is None else ({"content": text} if text or not finish else {})
                return sse(wire.chat_chunk(rid, model_name, delta, finish, use))
            return sse(wire.completion_chunk(rid, model_name, text, finish, use))

        text = TextStream(decoder.decode, body.stop_strings())
        first = True
        try:
            if chat:
                yield sse(wire.chat_chunk(rid, model_name, {"role": "assistant", "content": ""}, None))
            while True:
                try:
                    update = await next_update(ticket)
                except APIError as err:
                    yield sse(err.body())
                    break
                if update is None:
                    continue
                if update.error is not None:
                    yield sse(APIError(update.error.status, update.error.message, update.error.type).body())
                    break
                if first:
                    metrics.first_token.observe(time.monotonic() - arrival)
                    first = False
                piece = text.delta(update.tokens, update.done, update.text_end)
                if not update.done:
                    if piece:
                        yield chunk(piece, None)
                    continue
                metrics.latency.observe(time.monotonic() - arrival)
                metrics.finished(prompt_len, update.stats)
                yield chunk(piece, update.finish_reason)
                if include_usage:
                    drafter = decoder.draft_name if ticket.sequence.drafting else "none"
                    yield chunk(None, None, wire.usage(prompt_len, update.stats, drafter))
                break
            yield "data: [DONE]\n\n"
        finally:
            ticket.cancel()  # a disconnected client's row is freed before the next step

    @app.post("/v1/completions")
    async def completions(request: Request, body: CompletionRequest) -> Response:
        return await respond(request, body, requests.completion_prompt(body), body.max_tokens, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request, body: ChatRequest) -> Response:
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        return await respond(request, body, requests.chat_prompt(body), max_tokens, chat=True)

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0, "owned_by": "verispec",
                                            "drafter": decoder.draft_name, "context_window": context_window}]}

    @app.get("/health")
    async def health() -> JSONResponse:
        """ok, or 503 while shutting down or once the decoding thread has stopped (so a monitor or Ray Serve replaces
        the replica). Nothing internal: queue depth, running requests and faults are at /metrics."""
        if not scheduler.alive:
            return JSONResponse({"status": "unavailable"}, 503)
        if scheduler.stopping:
            return JSONResponse({"status": "shutting_down"}, 503)
        return JSONResponse({"status": "ok"}, 200)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.text(), media_type=CONTENT_TYPE_LATEST)

    return app
