"""The OpenAI-compatible HTTP API over a SpeculativeDecoder, with continuous batching.

    POST /v1/completions, /v1/chat/completions   (JSON, or server-sent events with "stream": true)
    GET  /v1/models, /health, /metrics           (/metrics in Prometheus text format)

Every request is checked here (fields, limits, context window) and becomes one Sequence; the
Scheduler's thread decodes all running sequences together. Errors are OpenAI-style JSON
({"error": {...}}) with 4xx codes; an unexpected failure is a 500 with a one-line message, never a
traceback.
"""

from __future__ import annotations

import asyncio
import json
import time
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from verispec.api import NO_DRAFT, SpeculativeDecoder
from verispec.config import SamplingConfig, ServeConfig, SpecConfig
from verispec.errors import VerispecError
from verispec.sequence import Sequence
from verispec.serve import protocol as wire
from verispec.serve.gate import Gate
from verispec.serve.metrics import Metrics
from verispec.serve.protocol import APIError, ChatRequest, CompletionRequest, GenerationRequest
from verispec.serve.scheduler import QueueFull, Scheduler, ShuttingDown, Ticket, Update

DISCONNECT_POLL_S = 0.5  # how often a waiting non-streaming request checks that its client is still there


def create_app(decoder: SpeculativeDecoder, config: ServeConfig = ServeConfig()) -> FastAPI:
    """Build the app; its lifespan starts the scheduler thread and stops it (gracefully) at shutdown."""
    engine = decoder.engine
    adapter = decoder.adapter  # online adaptation (`serve --adapt`): updates run while the scheduler idles
    scheduler = Scheduler(engine, config.max_batch_size, config.max_queue,
                          on_idle=adapter.poke if adapter is not None else None)
    metrics = Metrics(scheduler)
    model_name = config.served_model_name or decoder.target.name
    context_window = engine.context_window
    max_prompt = min(config.max_prompt_tokens or context_window - 1, context_window - 1)
    drafter_names = {decoder.draft_name} | ({decoder.drafter.name} if decoder.drafter is not None else set())

    @asynccontextmanager
    async def lifespan(_: FastAPI):
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
    def make_sequence(body: GenerationRequest, prompt: list[int], max_tokens: int | None) -> Sequence:
        if body.model is not None and body.model != model_name:
            raise APIError(404, f"model '{body.model}' is not served here; this server serves '{model_name}'",
                           param="model", code="model_not_found")
        if body.n != 1:
            raise APIError(400, "only n=1 is supported (send several requests: the server batches them)", param="n")
        spec_options = body.speculative or wire.SpeculativeOptions()
        tree = wire.tree_config(spec_options.tree)
        drafting = decoder.drafter is not None
        if spec_options.drafter is not None:
            if spec_options.drafter in NO_DRAFT:
                drafting = False
            elif spec_options.drafter not in drafter_names:
                raise APIError(400, f"this server drafts with '{decoder.draft_name}'; speculative.drafter may be "
                               f"'{decoder.draft_name}' or 'none'", param="speculative.drafter")
        if spec_options.K is not None and spec_options.K > config.max_draft_tokens:
            raise APIError(400, f"speculative.K may be at most {config.max_draft_tokens}", param="speculative.K")
        if tree is not None:
            if not drafting:
                raise APIError(400, "speculative.tree needs a drafter; this request decodes plainly", param="speculative.tree")
            try:
                engine.check_tree_support()
            except VerispecError as err:
                raise APIError(400, str(err), param="speculative.tree") from None
            depth = tree.depth(spec_options.K or SpecConfig().num_draft_tokens)
            if tree.size_upper_bound(depth) > config.max_tree_nodes or depth > config.max_draft_tokens:
                raise APIError(400, f"speculative.tree may have at most {config.max_tree_nodes} nodes and depth "
                               f"{config.max_draft_tokens}", param="speculative.tree")
        if len(prompt) > max_prompt:
            raise APIError(400, f"the prompt has {len(prompt)} tokens; this server accepts at most {max_prompt}",
                           param="prompt", code="context_length_exceeded")
        if max_tokens is not None:
            if config.max_tokens_limit is not None and max_tokens > config.max_tokens_limit:
                raise APIError(400, f"max_tokens may be at most {config.max_tokens_limit}", param="max_tokens")
            if len(prompt) + max_tokens > context_window:
                raise APIError(400, f"the prompt ({len(prompt)} tokens) plus max_tokens ({max_tokens}) exceeds the "
                               f"context window of {context_window} tokens", param="max_tokens",
                               code="context_length_exceeded")
        spec_fields = {"stop": body.stop_strings()}
        if max_tokens is not None:
            spec_fields["max_new_tokens"] = max_tokens
        if spec_options.K is not None:
            spec_fields["num_draft_tokens"] = spec_options.K
        if spec_options.draft_stop is not None:
            spec_fields["draft_stop"] = spec_options.draft_stop
        if tree is not None:
            spec_fields["tree"] = tree
        try:
            sampling = SamplingConfig(**body.sampling_fields())
            spec = SpecConfig(**spec_fields)
            seq = engine.make_sequences([prompt], sampling, spec, [body.seed])[0]
        except VerispecError as err:
            field = str(err).split(" ", 1)[0]
            raise APIError(400, str(err), param=field if field in GenerationRequest.model_fields else None) from None
        seq.drafting = drafting
        return seq

    def completion_prompt(body: CompletionRequest) -> list[int]:
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise APIError(400, "one prompt per request (send several requests: the server batches them)",
                               param="prompt")
            prompt = prompt[0]
        if isinstance(prompt, str):
            try:
                return decoder.encode(prompt, chat=False)
            except VerispecError as err:
                raise APIError(400, str(err), param="prompt") from None
        return list(prompt)

    def chat_prompt(body: ChatRequest) -> list[int]:
        if not decoder.has_chat_template:
            raise APIError(400, f"model '{model_name}' has no chat template; use /v1/completions", param="messages")
        tok = decoder.target.tokenizer
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        try:
            text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except Exception as err:  # the template's own checks (e.g. role order) fail with its own errors
            raise APIError(400, f"the chat template rejected the messages: {err}", param="messages") from None
        return list(tok(text, add_special_tokens=False)["input_ids"])

    def submit(seq: Sequence) -> Ticket:
        try:
            return scheduler.submit(seq, config.request_timeout)
        except QueueFull:
            raise APIError(429, f"the server is busy ({config.max_queue} requests waiting); retry later",
                           "rate_limit_error", code="queue_full") from None
        except ShuttingDown:
            raise APIError(503, "the server is shutting down", "server_shutting_down") from None

    # --- answering ---------------------------------------------------------------------------------
    async def respond(request: Request, body: GenerationRequest, prompt: list[int], max_tokens: int | None,
                      chat: bool) -> Response:
        arrival = time.monotonic()
        ticket = submit(make_sequence(body, prompt, max_tokens))
        rid = wire.new_id("chatcmpl" if chat else "cmpl")
        if body.stream:
            include_usage = body.stream_options is not None and body.stream_options.include_usage
            return StreamingResponse(stream(ticket, body, rid, chat, arrival, len(prompt), include_usage),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        try:
            update = await final_update(request, ticket, arrival)
        finally:
            ticket.cancel()
        if update is None:  # the client went away; nobody reads this
            return Response(status_code=499)
        text = decoder.decode(list(update.generated))[: update.text_end]
        use = wire.usage(len(prompt), update.stats, decoder.draft_name if ticket.sequence.drafting else "none")
        metrics.finished(len(prompt), update.stats)
        make = wire.chat_body if chat else wire.completion_body
        return JSONResponse(make(rid, model_name, text, update.finish_reason, use))

    async def final_update(request: Request, ticket: Ticket, arrival: float) -> Update | None:
        first = True
        while True:
            try:
                update = await asyncio.wait_for(ticket.updates.get(), DISCONNECT_POLL_S)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    return None
                continue
            if update.error is not None:
                raise APIError(update.error.status, update.error.message, update.error.type)
            if first:
                metrics.first_token.observe(time.monotonic() - arrival)
                first = False
            if update.done:
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

        text = wire.TextStream(decoder.decode, body.stop_strings())
        first = True
        try:
            if chat:
                yield sse(wire.chat_chunk(rid, model_name, {"role": "assistant", "content": ""}, None))
            while True:
                update = await ticket.updates.get()
                if update.error is not None:
                    yield sse(APIError(update.error.status, update.error.message, update.error.type).body())
                    break
                if first:
                    metrics.first_token.observe(time.monotonic() - arrival)
                    first = False
                piece = text.delta(update.generated, update.done, update.text_end)
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
        return await respond(request, body, completion_prompt(body), body.max_tokens, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request, body: ChatRequest) -> Response:
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        return await respond(request, body, chat_prompt(body), max_tokens, chat=True)

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0, "owned_by": "verispec",
                                            "drafter": decoder.draft_name, "context_window": context_window}]}

    @app.get("/health")
    async def health() -> JSONResponse:
        body = {"status": "shutting_down" if scheduler.stopping else "ok", "running": scheduler.running,
                "queued": scheduler.queue_depth}
        if adapter is not None:
            body["adaptation"] = adapter.stats()
        return JSONResponse(body, 503 if scheduler.stopping else 200)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.text(), media_type=CONTENT_TYPE_LATEST)

    return app
