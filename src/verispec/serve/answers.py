"""Answering a submitted request: the whole JSON answer, or its server-sent events as tokens are committed.

A request never waits without a bound: past its deadline (the request timeout and a grace period) it is answered
408 whatever the decoding thread is doing, and at once with 503 if that thread has died. A client that goes away
frees its row before the next step.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from verispec.api import SpeculativeDecoder
from verispec.serve.config import ServeConfig
from verispec.core.sequence import Sequence
from verispec.serve import protocol as wire
from verispec.serve.metrics import Metrics
from verispec.serve.protocol import APIError, GenerationRequest
from verispec.serve.scheduler import Scheduler
from verispec.serve.tickets import QueueFull, ShuttingDown, Ticket, TooLarge, Unavailable, Update
from verispec.stats import GenerationStats
from verispec.serve.streaming import TextStream, TimedStreamingResponse
from verispec.serve.tools import CLOSE, OPEN, call_head, new_call, parse_calls, raw_arguments

POLL_S = 0.5  # how often a waiting request checks its client, its deadline and the decoding thread
DEADLINE_GRACE_S = 5.0  # past the request timeout, the scheduler has this long to answer before the request does


def refusal(err: Exception, config: ServeConfig) -> APIError:
    """The answer to a request the scheduler would not take (`Scheduler.submit`'s exceptions)."""
    if isinstance(err, QueueFull) and err.tenant_share is not None:
        return APIError(429, f"this API key has {err.tenant_share} requests waiting already, its share of the queue; "
                        "retry later", "rate_limit_error", code="key_queue_full")
    if isinstance(err, QueueFull):
        return APIError(429, f"the server is busy ({config.max_queue} requests waiting); retry later",
                        "rate_limit_error", code="queue_full")
    if isinstance(err, ShuttingDown):
        return APIError(503, "the server is shutting down", "server_shutting_down")
    if isinstance(err, Unavailable):
        return APIError(503, "the server is not decoding (its decoding thread stopped); see its log",
                        "server_unavailable")
    if isinstance(err, TooLarge):
        whose = "this API key's share of this server's budget" if err.per_key else "this server's budget"
        return APIError(400, f"this request's prompt and max_tokens need {err.needed / 2**20:.0f} MiB of key/value "
                        f"cache, more than {whose} of {err.budget / 2**20:.0f} MiB; ask for fewer tokens",
                        param="max_tokens", code="context_length_exceeded")
    raise err


def sse(obj) -> str:
    return f"data: {json.dumps(obj)}\n\n"


class Answers:
    """Submits sequences to the scheduler and answers their requests (one per app)."""

    def __init__(self, decoder: SpeculativeDecoder, scheduler: Scheduler, metrics: Metrics, config: ServeConfig,
                 model_name: str) -> None:
        self.decoder, self.scheduler, self.metrics = decoder, scheduler, metrics
        self.config, self.model_name = config, model_name
        self.drafter_name = wire.public_drafter_name(decoder.draft_name)

    def submit(self, seq: Sequence, streaming: bool, tenant: str = "") -> Ticket:
        try:
            return self.scheduler.submit(seq, self.config.request_timeout, streaming, tenant)
        except (QueueFull, ShuttingDown, Unavailable, TooLarge) as err:
            raise refusal(err, self.config) from None

    async def respond(self, request: Request, body: GenerationRequest, seqs: list[Sequence], chat: bool,
                      tenant: str = "") -> Response:
        """Submit the request's sequences (one per choice: `n`; built from `body`, for this tenant) and answer: JSON
        when every choice is done, or a stream of events."""
        arrival, prompt_len = time.monotonic(), seqs[0].prompt_len
        tickets: list[Ticket] = []
        try:
            for seq in seqs:
                tickets.append(self.submit(seq, body.stream, tenant))
        except BaseException:
            for ticket in tickets:  # all choices or none
                ticket.cancel()
            raise
        rid = wire.new_id("chatcmpl" if chat else "cmpl")
        if body.stream:
            include_usage = body.stream_options is not None and body.stream_options.include_usage
            return TimedStreamingResponse(self.stream(tickets, body, rid, chat, arrival, prompt_len, include_usage),
                                          send_timeout=self.config.send_timeout, media_type="text/event-stream",
                                          headers={"Cache-Control": "no-cache"})
        generated: list[list[int]] = [[] for _ in tickets]
        logprobs: list[list] = [[] for _ in tickets]
        try:
            updates = await asyncio.gather(*(self.final_update(request, ticket, arrival, generated[i], logprobs[i])
                                             for i, ticket in enumerate(tickets)))
        finally:
            for ticket in tickets:
                ticket.cancel()
        if any(update is None for update in updates):  # the client went away; nobody reads this
            return Response(status_code=499)
        echo = self.echo(body, seqs[0])
        choices = []
        for i, (ticket, update) in enumerate(zip(tickets, updates)):
            text = self.decoder.decode(generated[i])[: update.text_end]
            entries = None
            if ticket.sequence.logprobs is not None:
                entries = (self.echoed_logprobs(ticket.sequence, logprobs[i]) if echo else
                           self.logprobs(logprobs[i], chat))
            if chat and body.calls_parsed():  # the answer's tool calls, parsed from the model's own syntax
                content, calls = parse_calls(text, cut=True)  # a call the end cut is a call, as streamed
                choices.append(wire.chat_choice(i, content, update.finish_reason, entries, calls))
            elif chat:
                choices.append(wire.chat_choice(i, text, update.finish_reason, entries))
            else:
                choices.append(wire.completion_choice(i, echo + text, update.finish_reason, entries))
        stats = GenerationStats.merge([update.stats for update in updates])
        for update in updates:
            self.metrics.finished(prompt_len, update.stats)
        use = wire.usage(prompt_len, stats, self._drafter(tickets[0]))
        make = wire.chat_body if chat else wire.completion_body
        return JSONResponse(make(rid, self.model_name, choices, use))

    def echo(self, body: GenerationRequest, seq: Sequence) -> str:
        """The prompt's text where a completion request asks for it back (`echo`), else ""."""
        return self.decoder.decode(seq.tokens[: seq.prompt_len]) if getattr(body, "echo", False) else ""

    def echoed_logprobs(self, seq: Sequence, entries: list) -> dict:
        """A completion's `logprobs` with its prompt echoed: the prompt's tokens (the first with null log-probabilities,
        the others from `engine.score_prompt`), then the generated ones, offsets from the start of the prompt's text."""
        prompt = seq.prompt_logprobs or []
        return wire.completion_logprobs(list(prompt) + list(entries), self.token_text, 0, first=seq.tokens[0])

    def token_text(self, token: int) -> str:
        return self.decoder.decode([token])

    def logprobs(self, entries: list, chat: bool, offset: int = 0) -> dict:
        """The answer's `logprobs` in the endpoint's format."""
        if chat:
            return wire.chat_logprobs(entries, self.token_text)
        return wire.completion_logprobs(entries, self.token_text, offset)

    def _drafter(self, ticket: Ticket) -> str:
        return self.drafter_name if ticket.sequence.drafting else "none"

    async def next_update(self, ticket: Ticket) -> Update | None:
        """The ticket's next update, or None after POLL_S; raises the answer a request gets when the decoding
        thread has died or the request's deadline (and its grace) has passed without the thread answering."""
        update = await ticket.next(POLL_S)
        if update is not None:
            return update
        if not self.scheduler.alive:
            raise APIError(503, "the server stopped decoding; see its log", "server_unavailable")
        if time.monotonic() > ticket.deadline + DEADLINE_GRACE_S:
            ticket.cancel()
            raise APIError(408, "the request ran past the server's request timeout", "timeout")
        return None

    async def final_update(self, request: Request, ticket: Ticket, arrival: float,
                           generated: list[int], logprobs: list) -> Update | None:
        """The request's last update (its mailbox wakes the loop only then), with the tokens (and their logprobs)
        gathered on the way."""
        while True:
            update = await self.next_update(ticket)
            if update is None:
                if await request.is_disconnected():
                    return None
                continue
            if update.error is not None:
                raise APIError(update.error.status, update.error.message, update.error.type, update.error.param)
            generated.extend(update.tokens)
            logprobs.extend(update.logprobs)
            if update.done:
                if ticket.first_token_at is not None:
                    self.metrics.first_token.observe(ticket.first_token_at - arrival)
                self.metrics.latency.observe(time.monotonic() - arrival)
                return update

    async def stream(self, tickets: list[Ticket], body: GenerationRequest, rid: str, chat: bool, arrival: float,
                     prompt_len: int, include_usage: bool) -> AsyncIterator[str]:
        """The answer as server-sent events: each choice's text deltas (stop strings held back until decided; with
        n > 1 the choices' events interleave as their tokens come), then its finish reason; usage if asked for, and
        [DONE]; an error mid-stream is one error event, which ends the stream."""
        events: asyncio.Queue = asyncio.Queue()
        finals: list = [None] * len(tickets)

        async def follow(i: int, ticket: Ticket) -> None:
            try:
                async for event in self.choice_events(ticket, i, body, rid, chat, arrival):
                    if isinstance(event, Update):
                        finals[i] = event
                    else:
                        await events.put(event)
            finally:
                await events.put(None)

        tasks = [asyncio.create_task(follow(i, ticket)) for i, ticket in enumerate(tickets)]
        try:
            if chat:
                for i in range(len(tickets)):
                    yield sse(wire.chat_chunk(rid, self.model_name, {"role": "assistant", "content": ""}, None, index=i))
            running, failed = len(tasks), False
            while running:
                event = await events.get()
                if event is None:
                    running -= 1
                    continue
                yield event
                if event.startswith('data: {"error"'):
                    failed = True
                    break
            if not failed and include_usage and all(final is not None for final in finals):
                stats = GenerationStats.merge([final.stats for final in finals])
                use = wire.usage(prompt_len, stats, self._drafter(tickets[0]))
                yield sse((wire.chat_chunk if chat else wire.completion_chunk)(rid, self.model_name, None, None, use))
            yield "data: [DONE]\n\n"
        finally:
            for task in tasks:
                task.cancel()
            for ticket in tickets:
                ticket.cancel()  # a disconnected client's rows are freed before the next step

    async def choice_events(self, ticket: Ticket, index: int, body: GenerationRequest, rid: str, chat: bool,
                            arrival: float) -> AsyncIterator:
        """One choice's events (server-sent event strings), then its last Update (for the usage), or an error event."""
        asked = ticket.sequence.logprobs is not None
        offset = 0  # completions' text_offset: characters sent before a chunk's tokens

        def call_events(pieces: list[dict]) -> list[str]:  # an event for each tool call's piece (`CallStream.pieces`)
            return [sse(wire.chat_chunk(rid, self.model_name, {"tool_calls": [piece]}, None, None, None, index))
                    for piece in pieces]

        def chunk(text: str, finish: str | None, entries=()) -> str:
            nonlocal offset
            logprobs = self.logprobs(list(entries), chat, offset) if asked else None
            offset += len(text)
            if chat:
                delta = {"content": text} if text or not finish else {}
                return sse(wire.chat_chunk(rid, self.model_name, delta, finish, None, logprobs, index))
            return sse(wire.completion_chunk(rid, self.model_name, text, finish, None, logprobs, index))

        text = TextStream(self.decoder.decode, body.stop_strings())
        calls = chat and body.calls_parsed()
        if calls:  # the content is streamed up to where a call may begin; the calls as OpenAI streams them
            text = CallStream(text)
        first = True
        echo = self.echo(body, ticket.sequence)
        scored = bool(echo) and ticket.sequence.spec.prompt_logprobs  # the prompt's log-probabilities go first
        if echo and not scored:
            yield chunk(echo, None)
        while True:
            try:
                update = await self.next_update(ticket)
            except APIError as err:
                yield sse(err.body())
                return
            if update is None:
                continue
            if update.error is not None:
                error = update.error
                yield sse(APIError(error.status, error.message, error.type, error.param).body())
                return
            if first:
                self.metrics.first_token.observe(time.monotonic() - arrival)
                first = False
            if scored:  # read before the sequence joined: here with its first update
                yield sse(wire.completion_chunk(rid, self.model_name, echo, None, None,
                                                self.echoed_logprobs(ticket.sequence, []), index))
                offset += len(echo)
                scored = False
            piece = text.delta(update.tokens, update.done, update.text_end)
            if not update.done:
                if piece or (asked and update.logprobs):  # a token's logprobs go out with the step that made it
                    yield chunk(piece, None, update.logprobs)
                for event in call_events(text.pieces()) if calls else ():  # the calls as they are written
                    yield event
                continue
            self.metrics.latency.observe(time.monotonic() - arrival)
            self.metrics.finished(ticket.sequence.prompt_len, update.stats)
            if calls and text.calls:
                if piece or update.logprobs:
                    yield chunk(piece, None, update.logprobs)
                for event in call_events(text.last):
                    yield event
                finish = "tool_calls" if update.finish_reason in ("eos", "stop") else update.finish_reason
                yield sse(wire.chat_chunk(rid, self.model_name, {}, finish, None, None, index))
            else:
                yield chunk(piece, update.finish_reason, update.logprobs)
            yield update
            return


TAIL = "}\n" + CLOSE  # how a call in the grammar's form ends after its arguments


class CallStream:
    """A TextStream whose content deltas stop where a tool call may begin (`serve.tools.OPEN`, held back until decided),
    and whose calls stream as OpenAI streams them (`pieces`): a call's id and name once its head is written, then its
    arguments piece by piece as the model writes them; a call whose head is not in the grammar's form goes out whole
    once its closing tag is written and it parses. At the end, `calls` holds the answer's calls (the ids already sent
    kept) and the last delta the content not yet sent."""

    def __init__(self, text: TextStream) -> None:
        self.text, self.whole, self.sent, self.calls = text, "", 0, []
        self.next_at = 0  # where the next call may begin: after the last one closed
        self.open: tuple[int, str, str, int] | None = None  # the call streaming now: (index, id, name, arguments' start)
        self.args_sent = ""  # its arguments sent so far
        self.last: list[dict] = []  # at the end: the calls' pieces not yet sent

    def pieces(self, cut: bool = False) -> list[dict]:
        """The tool_calls deltas written since the last call (each with its call's index). `cut` (the answer ended
        by its length or a stop string): a call left open ends with the arguments written."""
        out = []
        while True:
            if self.open is None:
                at = self.whole.find(OPEN, self.next_at)
                end = self.whole.find(CLOSE, at) if at >= 0 else -1
                head = call_head(self.whole, at + len(OPEN)) if at >= 0 else None
                if head is None:  # no call, its head not yet whole, or not in the grammar's form: whole, once parsed
                    if end < 0:
                        break
                    _, parsed = parse_calls(self.whole[at : end + len(CLOSE)])
                    if not parsed:
                        break
                    out.append({"index": len(self.calls), **parsed[0]})
                    self.calls.append(parsed[0])
                    self.next_at = end + len(CLOSE)
                    continue
                call = new_call(head[0], "")
                self.open, self.args_sent = (len(self.calls), call["id"], head[0], head[1]), ""
                out.append({"index": len(self.calls), **call})
            index, call_id, name, start = self.open
            end = self.whole.find(CLOSE, start)
            if end < 0 and not cut:
                written = self.whole[start:]
                held = next((n for n in range(min(len(written), len(TAIL)), 0, -1) if TAIL.startswith(written[-n:])), 0)
                ready = written[: len(written) - held]  # what may still be the call's closing brace and marker: held
                if len(ready) > len(self.args_sent):
                    out.append({"index": index, "function": {"arguments": ready[len(self.args_sent) :]}})
                    self.args_sent = ready
                break
            arguments = raw_arguments(self.whole, start, end) if end >= 0 else self.whole[start:]
            if arguments.startswith(self.args_sent) and len(arguments) > len(self.args_sent):
                out.append({"index": index, "function": {"arguments": arguments[len(self.args_sent) :]}})
            self.calls.append(new_call(name, arguments, call_id))
            self.open = None
            if end < 0:
                break
            self.next_at = end + len(CLOSE)
        return out

    def delta(self, new_tokens: tuple[int, ...], done: bool, text_end: int | None) -> str:
        self.whole += self.text.delta(new_tokens, done, text_end)
        if done:
            self.last = self.pieces(cut=True)  # the calls' last pieces (a call left open ends where the answer did)
            content = self.whole[: self.whole.find(OPEN)].strip() if OPEN in self.whole else self.whole
            final = self.whole if not self.calls and self.open is None else (content or "")
            piece, self.sent = final[self.sent :], len(final)
            return piece
        start = self.whole.find(OPEN)
        end = start if start >= 0 else max(self.sent, len(self.whole) - len(OPEN) + 1)
        piece, self.sent = self.whole[self.sent : end], max(self.sent, end)
        return piece
