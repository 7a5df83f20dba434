"""Per-request bounds and the parts of the server that keep one request's cost its own: the cache budget at
admission, the per-request token budget, stop-string limits, chunked prefill through the server, the ticket
mailbox a stalled reader cannot grow, and the send timeout of a stream nobody reads."""

import asyncio
import threading
import time

import httpx
import pytest

from tiny_hf import save_tiny_model_dir
from verispec import SpeculativeDecoder
from verispec.serve.config import ServeConfig
from verispec.serve.scheduler import Scheduler, Ticket, Update
from verispec.serve.server import BackgroundServer
from verispec.serve.streaming import TextStream, TimedStreamingResponse

BODY = {"prompt": "hello there", "max_tokens": 24, "temperature": 0}


@pytest.fixture(scope="module")
def decoder(tmp_path_factory):
    root = tmp_path_factory.mktemp("limit_models")
    return SpeculativeDecoder.load(str(save_tiny_model_dir(root / "target", "llama", seed=0)),
                                   str(save_tiny_model_dir(root / "draft", "llama", seed=1)))


@pytest.fixture(scope="module")
def solo(decoder):
    with BackgroundServer(decoder, ServeConfig(port=0)) as s:
        return httpx.post(s.url + "/v1/completions", json=BODY, timeout=60).json()["choices"][0]["text"]


def test_admission_keeps_the_reserved_cache_within_the_budget(decoder, solo, monkeypatch):
    """Requests reserve their prompt + max_tokens of cache at admission; past the budget they wait in the queue
    (N full-context requests used to be admitted together, ~1.9 GB a row on the 1.5B target at 32k tokens)."""
    need = decoder.engine.cache_bytes(len(decoder.encode("hello there", chat=False)) + 24 + 4 + 1)
    peak = {"reserved": 0, "running": 0}
    admit = Scheduler._admit

    def watched(self):
        admit(self)
        peak["reserved"] = max(peak["reserved"], self.reserved)
        peak["running"] = max(peak["running"], len(self.batch))

    monkeypatch.setattr(Scheduler, "_admit", watched)
    with BackgroundServer(decoder, ServeConfig(port=0, max_cache_bytes=int(need * 1.5))) as s:
        async def three():
            async with httpx.AsyncClient(base_url=s.url, timeout=60) as c:
                return await asyncio.gather(*(c.post("/v1/completions", json=BODY) for _ in range(3)))

        rs = asyncio.run(three())
        assert [r.json()["choices"][0]["text"] for r in rs] == [solo] * 3  # all answered, in turn
        assert peak["running"] == 1 and need <= peak["reserved"] <= 1.5 * need
        assert s.app.state.scheduler.reserved == 0
        r = httpx.post(s.url + "/v1/completions", json={**BODY, "max_tokens": 100}, timeout=60)  # could never fit
        assert r.status_code == 400 and "key/value cache" in r.json()["error"]["message"]
        assert "verispec_cache_budget_bytes" in httpx.get(s.url + "/metrics").text


def test_per_request_token_budget_and_stop_string_limits(decoder):
    config = ServeConfig(port=0, max_request_tokens=30, max_stop_strings=2, max_stop_length=5)
    with BackgroundServer(decoder, config) as s, httpx.Client(base_url=s.url, timeout=60) as c:
        r = c.post("/v1/completions", json={**BODY, "max_tokens": 25})  # 11 prompt tokens + 25 > 30
        assert r.status_code == 400 and "limit of 30 tokens per request" in r.json()["error"]["message"]
        r = c.post("/v1/completions", json={"prompt": "hello there"})  # the default 128 new tokens is over it too
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
        assert c.post("/v1/completions", json={**BODY, "max_tokens": 19}).status_code == 200
        r = c.post("/v1/completions", json={**BODY, "max_tokens": 5, "stop": ["a", "b", "c"]})
        assert r.status_code == 400 and "at most 2 stop strings" in r.json()["error"]["message"]
        r = c.post("/v1/completions", json={**BODY, "max_tokens": 5, "stop": "abcdef"})
        assert r.status_code == 400 and "at most 5 characters" in r.json()["error"]["message"]


def test_a_long_prompt_in_chunks_through_the_server_gives_its_solo_answer(decoder):
    long = {"prompt": "the cat sat on the mat. " * 3, "max_tokens": 20, "temperature": 0}
    with BackgroundServer(decoder, ServeConfig(port=0)) as s:
        alone = httpx.post(s.url + "/v1/completions", json=long, timeout=60).json()["choices"][0]["text"]
    with BackgroundServer(decoder, ServeConfig(port=0, prefill_chunk=4)) as s:
        async def both():
            async with httpx.AsyncClient(base_url=s.url, timeout=60) as c:
                return await asyncio.gather(c.post("/v1/completions", json=long), c.post("/v1/completions", json=BODY))

        rs = asyncio.run(both())
        assert rs[0].json()["choices"][0]["text"] == alone and rs[1].status_code == 200


def test_a_stalled_reader_costs_one_pending_update_not_a_queue():
    """The scheduler posted a full copy of the tokens every step into an unbounded queue; now a ticket merges
    what its reader has not taken, and wakes the event loop once per batch of posts."""
    async def run():
        loop = asyncio.get_running_loop()
        wakes = []
        original = loop.call_soon_threadsafe

        def counting(callback, *args):
            wakes.append(callback)
            return original(callback, *args)

        loop.call_soon_threadsafe = counting
        ticket = Ticket(None, loop, time.monotonic() + 60, scheduler=type("S", (), {"wake": lambda self: None})())
        poster = threading.Thread(target=lambda: [ticket.post(Update((i,))) for i in range(10_000)])
        poster.start()
        poster.join()
        update = await ticket.next(5)
        assert update.tokens == tuple(range(10_000)) and len(wakes) == 1
        ticket.post(Update((7,), finish_reason="length"))
        final = await ticket.next(5)
        assert final.tokens == (7,) and final.done and len(wakes) == 2
        assert await ticket.next(0.05) is None
        whole = Ticket(None, loop, time.monotonic() + 60, ticket._scheduler, streaming=False)  # answered in one piece
        for i in range(100):
            whole.post(Update((i,)))
        assert len(wakes) == 2 and await whole.next(0.05) is None  # the loop sleeps while it decodes
        whole.post(Update((100,), finish_reason="length"))
        update = await whole.next(5)
        assert update.tokens == tuple(range(101)) and update.done and len(wakes) == 3

    asyncio.run(run())


def test_a_stream_whose_client_reads_nothing_ends_after_the_send_timeout():
    """A send that never completes (a full socket) ends the response by the send timeout: the response returns while
    that send is still blocked, and the stream is closed. (The 30 s wait_for only bounds a broken test.)"""
    closed = threading.Event()

    async def forever():
        try:
            while True:
                yield "data: x\n\n"
                await asyncio.sleep(0)
        finally:
            closed.set()  # where the app cancels the request

    async def run():
        sent, blocked, unblocked = [], asyncio.Event(), asyncio.Event()

        async def blocked_send(message):
            sent.append(message["type"])
            if message["type"] == "http.response.body" and len(sent) > 3:
                blocked.set()
                await unblocked.wait()  # a full socket: the client reads nothing, ever

        response = TimedStreamingResponse(forever(), send_timeout=0.2, media_type="text/event-stream")
        await asyncio.wait_for(response.stream_response(blocked_send), 30)
        return blocked.is_set() and not unblocked.is_set()

    assert asyncio.run(run())  # it returned while its send was blocked
    assert closed.is_set()


def test_text_stream_holds_back_what_could_begin_a_stop_string():
    decode = lambda ids: "".join(chr(96 + i) for i in ids)  # noqa: E731: 1 -> 'a', 2 -> 'b', ...
    stream = TextStream(decode, ("cd",))
    assert stream.delta((1, 2, 3), False, None) == "ab"  # 'c' may begin "cd": held back
    assert stream.delta((5,), False, None) == "c"  # the last character always waits (the longest stop is 2)
    assert stream.delta((3, 4), True, 4) == "e"  # "cd" came: the text ends where the stop string began
