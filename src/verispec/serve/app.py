"""The OpenAI-compatible HTTP API over a SpeculativeDecoder, with continuous batching.

    POST /v1/completions, /v1/chat/completions   (JSON, or server-sent events with "stream": true)
    POST /tokenize, /detokenize                  (vLLM's: a prompt's or a chat's token ids, and back)
    GET  /tokenizer_info                         (vLLM's: the special tokens and the chat template)
    GET  /v1/models, /health, /metrics           (/metrics in Prometheus text format)

Every request is checked (fields, limits, context window, cache budget: `serve.requests`, no app needed) and becomes
one Sequence; the Scheduler's thread decodes all running sequences together; `serve.answers` answers each request
(bounded waits, streaming). Errors are OpenAI-style JSON ({"error": {...}}) with 4xx codes; an unexpected failure is
a 500 with a one-line message, never a traceback.

A request's work is done cheapest first and never on the event loop when it can be large: its fields and whether its
tenant's queue has room (event loop), then its prompt templated and tokenized (a worker thread, after a size check),
then its constraint compiled (the compile pool, `serve.compile`, within a time budget), then its place in the queue.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from verispec.api import SpeculativeDecoder
from verispec.serve.config import ServeConfig
from verispec.serve.answers import Answers, refusal
from verispec.serve.compile import Busy, CompilePool, CompileTimeout
from verispec.serve.gate import Gate
from verispec.serve.metrics import Metrics
from verispec.serve import protocol as wire
from verispec.serve.protocol import APIError, ChatRequest, CompletionRequest
from verispec.serve.requests import RequestBuilder
from verispec.serve.scheduler import Scheduler
from verispec.serve.tickets import QueueFull, ShuttingDown, TooLarge, Unavailable
from verispec.serve.tenants import Keys


def create_app(decoder: SpeculativeDecoder, config: ServeConfig = ServeConfig(), scheduler_thread: bool = True) -> FastAPI:
    """Build the app. With `scheduler_thread` its lifespan runs the scheduler in a thread of its own and stops it
    (gracefully) at shutdown; without, the caller runs `app.state.scheduler.run()` itself (on the main thread:
    `serve.server.run_server`) and stops it."""
    engine = decoder.engine
    engine.constraint_limits = config.constraint_limits
    decoder.reuse_prefixes(config.prefix_cache_bytes)
    keys = Keys(config.keys)
    adapter = decoder.adapter  # online adaptation (`serve --adapt`): updates run while the scheduler idles
    tuner = decoder.auto_tuner() if config.auto_k and not decoder.drafter.traits.plain else None  # costs measured now
    scheduler = Scheduler(engine, config.max_batch_size, config.max_queue,
                          on_idle=adapter.poke if adapter is not None else None, prefill_chunk=config.prefill_chunk,
                          max_cache_bytes=config.max_cache_bytes, tuner=tuner,
                          key_share=config.key_share if len(keys.keys) > 1 else None)
    metrics = Metrics(scheduler, adapter)
    model_name = config.served_model_name or wire.public_drafter_name(decoder.target.name)  # no paths shown
    requests = RequestBuilder(decoder, config, model_name)
    answers = Answers(decoder, scheduler, metrics, config, model_name)
    compiler = CompilePool(config.compile_workers, config.max_queue)
    # templating and tokenizing (up to a MiB of text): off the event loop, on a few threads of their own
    prep = concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="verispec-prep")

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        if not scheduler_thread:  # the caller runs the loop and stops it
            yield
            prep.shutdown(wait=False)
            compiler.close()
            return
        scheduler.start()
        yield
        await asyncio.to_thread(scheduler.stop, config.shutdown_timeout)
        prep.shutdown(wait=False)
        compiler.close()
        if adapter is not None:
            await asyncio.to_thread(adapter.close)

    app = FastAPI(title="verispec", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.scheduler, app.state.metrics, app.state.compiler = scheduler, metrics, compiler
    app.add_middleware(Gate, keys=keys, max_body_bytes=config.max_body_bytes, metrics=metrics,
                       allowed_hosts=config.allowed_hosts)
    add_error_handlers(app, config)

    async def answer(request: Request, body, max_tokens: int | None, chat: bool) -> Response:
        """Check, read the prompt, compile, submit and answer: cheapest first (see the module doc)."""
        tenant = request.scope.get("state", {}).get("tenant", "")
        requests.check(body, max_tokens)
        try:
            scheduler.check_room(tenant)  # a full server refuses before reading the prompt or compiling anything
        except (QueueFull, ShuttingDown, Unavailable) as err:
            raise refusal(err, config) from None
        read = requests.chat_prompt if chat else requests.completion_prompt
        prompt, prediction = await asyncio.get_running_loop().run_in_executor(
            prep, lambda: (read(body), requests.prediction(body)))
        constraint = requests.constraint(body)[0] is not None  # compiled on the compile pool below
        try:  # its worst case against the cache budget and its key's share, before anything is compiled
            scheduler.check_fits(requests.worst_case_tokens(body, len(prompt), max_tokens), tenant)
        except TooLarge as err:
            raise refusal(err, config) from None
        if not constraint:
            seqs = requests.sequences(body, prompt, max_tokens, tenant, prediction)
        else:  # compiled once per content, on the compile pool, within the time budget
            seconds = config.constraint_limits.compile_seconds
            try:
                seqs = await compiler.run(lambda: requests.sequences(body, prompt, max_tokens, tenant, prediction),
                                          seconds)
            except CompileTimeout:
                raise APIError(400, f"compiling the constraint took longer than {seconds:g} s: simplify the schema "
                               "or grammar", param="response_format") from None
            except Busy:
                raise APIError(503, "too many constraints are being compiled; retry later", "server_overloaded",
                               code="compile_queue_full") from None
        return await answers.respond(request, body, seqs, chat=chat, tenant=tenant)

    @app.post("/v1/completions")
    async def completions(request: Request, body: CompletionRequest) -> Response:
        return await answer(request, body, body.max_tokens, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request, body: ChatRequest) -> Response:
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        return await answer(request, body, max_tokens, chat=True)

    @app.post("/tokenize")
    async def tokenize(body: wire.TokenizeRequest) -> dict:
        """The token ids a prompt (or a chat's messages, templated) becomes here, as the generation endpoints read it."""
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "/tokenize takes either 'prompt' or 'messages'", param="prompt")
        requests.check_model(body.model)
        if body.messages is not None:
            chat = wire.ChatRequest(messages=body.messages)
            ids = await asyncio.get_running_loop().run_in_executor(prep, requests.chat_prompt, chat)
        else:
            ids = await asyncio.get_running_loop().run_in_executor(
                prep, requests.tokenize, body.prompt, body.add_special_tokens)
        return {"count": len(ids), "max_model_len": engine.context_window, "tokens": ids}

    @app.post("/detokenize")
    async def detokenize(body: wire.DetokenizeRequest) -> dict:
        requests.check_model(body.model)
        vocab = engine.target.vocab_size
        if any(not 0 <= t < vocab for t in body.tokens):
            raise APIError(400, f"tokens holds ids outside the vocabulary (0..{vocab - 1})", param="tokens")
        if len(body.tokens) > engine.context_window:
            raise APIError(400, f"at most {engine.context_window} tokens (the context window)", param="tokens")
        text = await asyncio.get_running_loop().run_in_executor(prep, decoder.decode, body.tokens)
        return {"prompt": text}

    @app.get("/tokenizer_info")
    async def tokenizer_info() -> dict:
        """The tokenizer's special tokens and chat template (vLLM's endpoint, with /tokenize and /detokenize: what
        clients that tokenize through the server read, lm-evaluation-harness's remote tokenizer among them)."""
        tok = decoder.target.tokenizer

        def special(name: str) -> str | None:
            value = getattr(tok, name, None)  # a tokenizer without that token has None
            return value if isinstance(value, str) else None

        return {"tokenizer_class": type(tok).__name__, "eos_token": special("eos_token"),
                "bos_token": special("bos_token"), "pad_token": special("pad_token"),
                "chat_template": getattr(tok, "chat_template", None), "model_max_length": engine.context_window}

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0, "owned_by": "verispec",
                                            "drafter": requests.drafter_name, "context_window": engine.context_window}]}

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


def add_error_handlers(app: FastAPI, config: ServeConfig) -> None:
    """Every error as OpenAI-style JSON: ours (APIError), a body that fails validation, HTTP errors, and anything
    unexpected as a 500 with one line."""

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
