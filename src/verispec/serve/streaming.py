"""Streaming answers: text deltas decoded incrementally, and a response that gives up on a client that reads nothing.

`TextStream` turns the tokens each update adds into text that is safe to send: decoded a few tokens at a time
(`verispec.detokenize`: a step costs the same however long the answer), holding back what could still become the
start of a stop string. `TimedStreamingResponse` bounds every send: uvicorn's send waits while a client's socket
is full, and a client that stops reading would otherwise hold its request (and its batch row) until the request
timeout; after `send_timeout` seconds the stream ends and the request is cancelled.
"""

from __future__ import annotations

import asyncio
import logging

from starlette.responses import StreamingResponse
from starlette.types import Send

from verispec.detokenize import IncrementalText

log = logging.getLogger("verispec.serve")


class TextStream:
    """Growing token lists -> text deltas that are safe to send.

    Args:
        decode: token ids -> text.
        stops: the request's stop strings (text that could still begin one is held back until decided).
    """

    def __init__(self, decode, stops: tuple[str, ...]) -> None:
        self.text = IncrementalText(decode)
        self.tokens: list[int] = []
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.sent = 0

    def delta(self, new_tokens: tuple[int, ...], done: bool, text_end: int | None) -> str:
        """The text to send after these new tokens (done: the answer is complete, cut at text_end if given)."""
        self.tokens.extend(new_tokens)
        if done:
            self.text.finish(self.tokens)
            end = len(self.text.text) if text_end is None else text_end
        else:
            self.text.update(self.tokens)
            end = len(self.text.text) - self.hold
        if end <= self.sent:
            return ""
        piece, self.sent = self.text.text[self.sent : end], end
        return piece


class SendTimeout(Exception):
    """A client read nothing for `send_timeout` seconds."""


class TimedStreamingResponse(StreamingResponse):
    """A StreamingResponse whose every send must complete within `send_timeout` seconds; past it the stream ends
    and its body iterator is closed (which cancels the request)."""

    def __init__(self, content, send_timeout: float, **kwargs) -> None:
        super().__init__(content, **kwargs)
        self.send_timeout = send_timeout

    async def stream_response(self, send: Send) -> None:
        async def timed(message) -> None:
            try:
                await asyncio.wait_for(send(message), self.send_timeout)
            except asyncio.TimeoutError:
                log.warning("a streaming client read nothing for %.0f s; its request is cancelled", self.send_timeout)
                raise SendTimeout() from None

        try:
            await super().stream_response(timed)
        except SendTimeout:
            pass
        finally:
            close = getattr(self.body_iterator, "aclose", None)
            if close is not None:
                await close()
