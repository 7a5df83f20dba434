"""Faults against a live server on loopback: clients leaving mid-stream, malformed and oversized
bodies, a flood past the queue limit, timeouts and shutdown; the server stays up and keeps
answering correctly. Every loop here is bounded in count and in time."""

import asyncio
import json
import importlib.util
import socket
import threading
import time
from pathlib import Path

import httpx
import pytest

from tiny_hf import save_tiny_model_dir
from verispec import SpeculativeDecoder
from verispec.config import SamplingConfig, SpecConfig
from verispec.serve.config import ServeConfig
from verispec.serve.scheduler import Scheduler, ShuttingDown
from verispec.serve.server import BackgroundServer

LONG = {"prompt": "abc", "max_tokens": 100, "temperature": 1.0, "seed": 1}


@pytest.fixture(scope="module")
def decoder(tmp_path_factory):
    root = tmp_path_factory.mktemp("fault_models")
    target = save_tiny_model_dir(root / "target", "llama", seed=0)
    draft = save_tiny_model_dir(root / "draft", "llama", seed=1)  # a different model: mixed acceptance
    return SpeculativeDecoder.load(str(target), str(draft))


def wait_until(condition, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return False


def hold_steps(scheduler: Scheduler, monkeypatch) -> tuple[threading.Event, threading.Event]:
    """Make the scheduler's decoding step wait until `released` is set; `stepping` is set when a step begins."""
    stepping, released = threading.Event(), threading.Event()
    step = scheduler.engine.step

    def held_step(batch):
        stepping.set()
        released.wait(60)  # a bound only: released once the stop has been asked for
        return step(batch)

    monkeypatch.setattr(scheduler.engine, "step", held_step)  # the engine's loop calls it (`SpeculativeEngine.run`)
    return stepping, released


def still_answers(url: str, expected: str) -> None:
    body = {"prompt": "hello", "max_tokens": 12, "temperature": 0}
    r = httpx.post(url + "/v1/completions", json=body, timeout=30)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == expected


def test_faults_leave_the_server_up_and_correct(decoder):
    with BackgroundServer(decoder, ServeConfig(port=0, max_body_bytes=2000)) as s:
        scheduler = s.app.state.scheduler
        reference = httpx.post(s.url + "/v1/completions", json={"prompt": "hello", "max_tokens": 12, "temperature": 0},
                               timeout=30).json()["choices"][0]["text"]
        # A client leaves mid-stream: its row is freed long before its 100 tokens would be done.
        for _ in range(3):
            with httpx.Client(base_url=s.url, timeout=30) as c:
                with c.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as r:
                    lines = r.iter_lines()
                    assert next(line for line in lines if line.startswith("data: "))
            assert wait_until(lambda: scheduler.running == 0 and scheduler.cache_rows() == 0)
        still_answers(s.url, reference)
        # Malformed, truncated, wrong-typed and oversized bodies.
        raw = [b"{", b"not json", b'{"prompt": "x", "max_tokens": }', b"[]", b'"just a string"', b"\xff\xfe"]
        for body in raw:
            r = httpx.post(s.url + "/v1/completions", content=body, headers={"content-type": "application/json"})
            assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", body
        r = httpx.post(s.url + "/v1/completions", content=b"x" * 5000, headers={"content-type": "application/json"})
        assert r.status_code == 413 and r.json()["error"]
        chunks = (b'{"prompt": "' + b"y" * 500 for _ in range(8))  # no Content-Length: counted as it arrives
        r = httpx.post(s.url + "/v1/completions", content=chunks, headers={"content-type": "application/json"})
        assert r.status_code == 413 and r.json()["error"]
        still_answers(s.url, reference)


def test_a_client_that_vanishes_at_the_socket_level_frees_its_row(decoder):
    with BackgroundServer(decoder, ServeConfig(port=0)) as s:
        host, port = s.url.removeprefix("http://").split(":")
        body = b'{"prompt": "abc", "max_tokens": 100, "stream": true}'
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
            assert b"200 OK" in sock.recv(4096)
        scheduler = s.app.state.scheduler
        assert wait_until(lambda: scheduler.running == 0 and scheduler.cache_rows() == 0)


async def flood(url: str, n: int) -> list[httpx.Response]:
    async with httpx.AsyncClient(base_url=url, timeout=60) as c:
        return await asyncio.gather(*(c.post("/v1/completions", json={**LONG, "seed": i}) for i in range(n)))


def test_a_flood_past_the_queue_gets_429_and_the_rest_complete(decoder):
    with BackgroundServer(decoder, ServeConfig(port=0, max_batch_size=1, max_queue=2)) as s:
        responses = asyncio.run(flood(s.url, 24))
        codes = [r.status_code for r in responses]
        # at least the queue's two places are answered (a third when the decoding thread takes the first from the
        # queue before the others arrive: they are read and tokenized off the event loop, so they arrive together)
        assert set(codes) <= {200, 429} and codes.count(429) >= 1 and codes.count(200) >= 2
        for r in responses:
            if r.status_code == 429:
                assert r.json()["error"]["type"] == "rate_limit_error"
            else:  # every admitted request got its whole answer
                out = r.json()
                assert out["usage"]["completion_tokens"] == 100 or out["choices"][0]["finish_reason"] == "stop"
        scheduler = s.app.state.scheduler
        assert scheduler.cache_rows() == 0 and scheduler.queue_depth == 0
        assert httpx.get(s.url + "/health").json() == {"status": "ok"}


def test_requests_past_the_timeout_are_cut_with_408(decoder, monkeypatch):
    """Every decoding step outlasts the 0.02 s request timeout (it sleeps 0.1 s first), so a request of 100 tokens
    is past its deadline after its first step whatever the machine's speed, and is cut before its second."""
    with BackgroundServer(decoder, ServeConfig(port=0, request_timeout=0.02)) as s:
        engine = s.app.state.scheduler.engine
        step = engine.step
        monkeypatch.setattr(engine, "step", lambda batch: time.sleep(0.1) or step(batch))
        r = httpx.post(s.url + "/v1/completions", json=LONG, timeout=30)
        assert r.status_code == 408 and r.json()["error"]["type"] == "timeout"
        streamed = httpx.post(s.url + "/v1/completions", json={**LONG, "stream": True}, timeout=30).text
        assert '"type": "timeout"' in streamed and streamed.rstrip().endswith("data: [DONE]")
        assert s.app.state.scheduler.cache_rows() == 0


def test_shutdown_finishes_in_flight_requests_and_refuses_new_ones(decoder, monkeypatch):
    """The decoding step is held on an event until the scheduler reports that it is stopping, so the request is
    still in flight when the stop arrives however fast the machine (with K tuned per request, 100 tokens of the
    tiny model can finish before a poll sees them); it still ends whole, with 200, and the server thread ends."""
    server = BackgroundServer(decoder, ServeConfig(port=0, shutdown_timeout=20))
    with server:
        scheduler = server.app.state.scheduler
        stepping, released = hold_steps(scheduler, monkeypatch)

        async def in_flight_then_stop():
            async with httpx.AsyncClient(base_url=server.url, timeout=60) as c:
                pending = asyncio.ensure_future(c.post("/v1/completions", json=LONG))
                assert await asyncio.to_thread(stepping.wait, 60)
                assert scheduler.running == 1
                stopping = asyncio.ensure_future(asyncio.to_thread(server.stop))
                assert await asyncio.to_thread(wait_until, lambda: scheduler.stopping, 30)
                late = decoder.engine.make_sequences([[5, 6, 7]], SamplingConfig(), SpecConfig(), [0])[0]
                with pytest.raises(ShuttingDown):  # the server answers it with 503
                    scheduler.submit(late, 60)
                released.set()
                await stopping
                return await pending

        r = asyncio.run(in_flight_then_stop())
    out = r.json()
    assert r.status_code == 200 and (out["usage"]["completion_tokens"] == 100 or out["choices"][0]["finish_reason"] == "stop")
    assert not server.thread.is_alive()


def test_shutdown_past_its_timeout_cuts_requests_with_503(decoder, monkeypatch):
    """A stop with no time left, asked for while requests are in flight: the decoding step is held on an event until
    the stop has been asked for, so no request can finish first however fast the machine; each ends with the
    shutdown's 503 short of its 120 tokens, and the loop ends."""
    async def run():
        scheduler = Scheduler(decoder.engine, max_batch_size=2, max_queue=4)
        stepping, released = hold_steps(scheduler, monkeypatch)
        spec = SpecConfig(max_new_tokens=120)
        seqs = [decoder.engine.make_sequences([[5, 6, 7]], SamplingConfig(), spec, [i])[0] for i in range(3)]
        scheduler.start()
        tickets = [scheduler.submit(seq, 60) for seq in seqs]
        assert await asyncio.to_thread(stepping.wait, 60)  # two requests admitted, the third waiting
        scheduler.request_stop(0.0)
        released.set()
        await asyncio.to_thread(scheduler.stop, 0.0)
        last = []
        for t in tickets:
            update = await t.next(10)
            while update is not None and not update.done:
                update = await t.next(10)
            last.append(update)
        return scheduler, seqs, last

    scheduler, seqs, last = asyncio.run(run())
    assert [(u.error.status, u.error.type) for u in last] == [(503, "server_shutting_down")] * 3
    assert all(seq.num_generated < 120 for seq in seqs)  # cut, not finished
    assert not scheduler._thread.is_alive() and scheduler.cache_rows() == 0


def test_load_script_reports_percentiles_and_finds_no_mismatch(decoder, capsys):
    spec = importlib.util.spec_from_file_location("serve_load", Path(__file__).parent.parent / "benchmarks/serve_load.py")
    serve_load = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(serve_load)
    summaries = serve_load.run_load(decoder, clients=4, num_requests=8, max_new_tokens=(6, 14), timeout_s=60,
                                    time_limit_s=120)
    assert [(s["batching"], s["speculation"]) for s in summaries] == [(False, True), (True, True), (False, False),
                                                                      (True, False)]
    for s in summaries:
        assert s["completed"] == 8 and s["mismatches"] == 0 and s["leaked_cache_rows"] == 0
        assert s["tokens_per_second"] > 0 and s["latency_p50"] <= s["latency_p99"]
    assert "latency_p90" in serve_load.markdown(summaries)


def test_the_server_sizes_speculation_from_costs_it_measures_and_stays_exact(decoder):
    """ServeConfig.auto_k (the default): the scheduler's batch gets a tuner fed by every pass; batched and
    one-at-a-time runs still give every greedy request the same text."""
    from verispec.serve.config import ServeConfig
    from verispec.serve.app import create_app

    app = create_app(decoder, ServeConfig(), scheduler_thread=False)  # on by default
    tuner = app.state.scheduler.tuner
    assert tuner is not None and app.state.scheduler.batch.tuner is tuner
    assert create_app(decoder, ServeConfig(auto_k=False), scheduler_thread=False).state.scheduler.tuner is None
    spec = importlib.util.spec_from_file_location("serve_load", Path(__file__).parent.parent / "benchmarks/serve_load.py")
    serve_load = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(serve_load)
    summaries = serve_load.run_load(decoder, clients=4, num_requests=8, max_new_tokens=(6, 14), timeout_s=60,
                                    time_limit_s=120, speculation=(True,), auto_k=True)
    for s in summaries:
        assert s["auto_k"] and s["completed"] == 8 and s["mismatches"] == 0 and s["leaked_cache_rows"] == 0


def test_a_fault_reading_the_prompts_logprobs_fails_that_request_alone(decoder, monkeypatch):
    """`echo` with `logprobs` reads the prompt before the request joins; a fault there answers that request with a
    500, gives its cache reservation back, and the others (and later ones) are answered as before."""
    engine = decoder.engine
    real = engine.score_prompt

    def broken(seq):
        if len(seq.tokens) > 3:  # only the long prompt's
            raise RuntimeError("injected")
        return real(seq)

    monkeypatch.setattr(engine, "score_prompt", broken)
    with BackgroundServer(decoder, ServeConfig(port=0)) as server:
        expected = httpx.post(server.url + "/v1/completions", json={"prompt": "hello", "max_tokens": 12,
                                                                     "temperature": 0}, timeout=30).json()
        bad = {"prompt": "hello there, friend", "max_tokens": 4, "temperature": 0, "logprobs": 1, "echo": True}
        good = {"prompt": "hi", "max_tokens": 4, "temperature": 0, "logprobs": 1, "echo": True}
        with httpx.Client(base_url=server.url, timeout=30) as http:
            r = http.post("/v1/completions", json=bad)
            assert r.status_code == 500 and "error" in r.json()
            ok = http.post("/v1/completions", json=good)
            assert ok.status_code == 200 and ok.json()["choices"][0]["logprobs"]["token_logprobs"][0] is None
        # the same fault while another request decodes beside it: that one's answer is its answer alone
        beside = {"prompt": "hello", "max_tokens": 40, "temperature": 0, "ignore_eos": True}
        solo = httpx.post(server.url + "/v1/completions", json=beside, timeout=30).json()["choices"][0]["text"]
        refused = {}
        step = engine.step
        monkeypatch.setattr(engine, "step", lambda batch: time.sleep(0.02) or step(batch))  # 40 steps: 0.8 s at least
        with httpx.Client(base_url=server.url, timeout=30) as http:
            with http.stream("POST", "/v1/completions", json={**beside, "stream": True}) as r:
                lines = r.iter_lines()
                text = ""
                for line in lines:  # once it decodes, the faulty request arrives
                    if line.startswith("data: ") and line != "data: [DONE]":
                        text += json.loads(line[6:])["choices"][0]["text"]
                        if "status" not in refused:
                            thread = threading.Thread(target=lambda: refused.update(
                                status=httpx.post(server.url + "/v1/completions", json=bad, timeout=30).status_code,
                                at=time.monotonic()))
                            thread.start()
                ended = time.monotonic()
            thread.join(30)
        assert refused["status"] == 500 and refused["at"] < ended and text == solo
        scheduler = server.app.state.scheduler
        assert wait_until(lambda: scheduler.reserved == 0 and scheduler.running == 0)
        still_answers(server.url, expected["choices"][0]["text"])
