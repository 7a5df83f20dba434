"""Tenants kept apart and served fairly: per-key shares under a flood, the suffix store scoped per key (no membership
oracle through acceptance counts), the Host / Origin check of a server without a key, idle sockets that cannot lock
others out, and a shutdown that admits nothing new and keeps the cut rows' outputs."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import httpx
import pytest

from tiny_hf import save_tiny_model_dir
from verispec import SpeculativeDecoder
from verispec.config import SuffixConfig
from verispec.serve.config import ServeConfig
from verispec.drafters.suffix import OutputStore
from verispec.serve.server import BackgroundServer
from verispec.serve.tenants import Keys, key_name, parse_keys

KEYS = ("alice:key-of-alice", "bob:key-of-bob")
ALICE, BOB = {"authorization": "Bearer key-of-alice"}, {"authorization": "Bearer key-of-bob"}


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return str(save_tiny_model_dir(tmp_path_factory.mktemp("tenants") / "target", "llama", seed=0))


def test_keys_name_their_tenants_without_showing_the_key():
    keys = Keys(("alice:k1", "k2"))
    assert keys.tenant(b"Bearer k1") == "alice" and keys.tenant(b"bearer k2") == key_name("k2")
    assert keys.tenant(b"Bearer k3") is None and keys.tenant(b"Basic k1") is None and keys.tenant(b"") is None
    assert "k2" not in key_name("k2") and Keys(()).tenant(b"") == ""
    with pytest.raises(Exception, match="twice"):
        parse_keys(("a:x", "b:x"))
    with pytest.raises(Exception, match="named 'a'"):
        parse_keys(("a:x", "a:y"))


async def flood_and_one(url: str, flood: int, scheduler, rows: int) -> tuple[list[tuple[float, httpx.Response]],
                                                                             tuple[float, httpx.Response]]:
    """`flood` long requests from alice, then (once `rows` of them run and two more wait) one short one from bob: each
    answer with when it arrived."""
    started = time.monotonic()

    async def post(c, headers, body):
        r = await c.post("/v1/completions", json=body, headers=headers)
        return time.monotonic() - started, r

    long = {"prompt": "abc abc", "max_tokens": 40, "ignore_eos": True, "temperature": 0, "speculative": {"drafter": "none"}}
    short = {"prompt": "hello", "max_tokens": 4, "temperature": 0, "speculative": {"drafter": "none"}}
    async with httpx.AsyncClient(base_url=url, timeout=120) as c:
        floods = [asyncio.create_task(post(c, ALICE, long)) for _ in range(flood)]
        while scheduler.running < rows or scheduler.queue_depth < 2:  # alice holds her rows and queue places
            await asyncio.sleep(0.01)
        bob = await post(c, BOB, short)
        return list(await asyncio.gather(*floods)), bob


def test_a_flood_from_one_key_leaves_room_for_another(target, monkeypatch):
    from verispec.engine import SpeculativeEngine

    step = SpeculativeEngine.step
    # 2-core CI pace or slower
    monkeypatch.setattr(SpeculativeEngine, "step", lambda self, batch: time.sleep(0.02) or step(self, batch))
    decoder = SpeculativeDecoder.load(target, "ngram")
    config = ServeConfig(port=0, api_keys=KEYS, max_batch_size=4, max_queue=8, key_share=0.5, auto_k=False)
    with BackgroundServer(decoder, config) as s:
        scheduler = s.app.state.scheduler
        floods, (bob_at, bob) = asyncio.run(flood_and_one(s.url, 12, scheduler, 2))
        assert bob.status_code == 200, bob.text
        done = [at for at, r in floods if r.status_code == 200]
        refused = [r for _, r in floods if r.status_code == 429]
        assert refused and {r.json()["error"]["code"] for r in refused} == {"key_queue_full"}
        assert len(done) >= 2 and bob_at < min(done)  # bob was not queued behind alice's flood
        assert scheduler.tenants.share.rows == 2 and not scheduler.tenants.rows and not scheduler.tenants.waiting
    # the same flood where everyone is one tenant (no keys): the plain first-come queue, the short request waits
    # behind the flood
    unfair = ServeConfig(port=0, max_batch_size=4, max_queue=16, auto_k=False)
    with BackgroundServer(decoder, unfair) as s:
        floods, (bob_at, bob) = asyncio.run(flood_and_one(s.url, 12, s.app.state.scheduler, 4))
        assert bob.status_code == 200 and bob_at > min(at for at, r in floods if r.status_code == 200)


def usage_of_bob(target: str, config: ServeConfig, alice_first: bool) -> dict:
    """Bob's speculation counts for a prompt that continues what alice was answered, with or without alice's request
    before it, on a fresh decoder (a fresh store)."""
    decoder = SpeculativeDecoder.load(target, "suffix")
    with BackgroundServer(decoder, config) as s:
        alice = {"prompt": "hello world", "max_tokens": 60, "ignore_eos": True, "temperature": 0,
                 "speculative": {"K": 4}}
        text = httpx.post(s.url + "/v1/completions", json=alice, headers=ALICE, timeout=60).json()["choices"][0]["text"]
        if not alice_first:  # a fresh server, alice's text only as bob's prompt
            decoder = SpeculativeDecoder.load(target, "suffix")
    with BackgroundServer(decoder, config) as s:
        bob = {"prompt": text[:12], "max_tokens": 24, "temperature": 0, "speculative": {"K": 4}}
        r = httpx.post(s.url + "/v1/completions", json=bob, headers=BOB, timeout=60).json()
        return {k: v for k, v in r["usage"]["speculative"].items() if "second" not in k}  # the counts, not timings


def test_a_keys_answers_say_nothing_of_another_keys_text(target):
    scoped = ServeConfig(port=0, api_keys=KEYS, auto_k=False)  # keys set: the store is scoped per key by default
    assert usage_of_bob(target, scoped, True) == usage_of_bob(target, scoped, False)
    shared = ServeConfig(port=0, api_keys=KEYS, auto_k=False, suffix_scope="shared")  # the oracle, when asked for
    assert usage_of_bob(target, shared, True)["draft_tokens"] > usage_of_bob(target, shared, False)["draft_tokens"]


def test_a_drafter_file_path_is_never_shown(target, tmp_path):
    decoder = SpeculativeDecoder.load(target, f"suffix:{tmp_path / 'store.st'}")
    with BackgroundServer(decoder, ServeConfig(port=0)) as s:
        models = httpx.get(s.url + "/v1/models").json()["data"][0]
        r = httpx.post(s.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 4}, timeout=60).json()
    assert models["drafter"] == "suffix" and r["usage"]["speculative"]["drafter"] == "suffix"
    assert str(tmp_path) not in str(models) + str(r) and models["id"] == "target"


def raw_status(url: str, head: bytes) -> int:
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(head + b"Connection: close\r\n\r\n")
        return int(sock.recv(200).split(b" ", 2)[1])


def test_a_server_without_a_key_answers_only_requests_meant_for_this_machine(target):
    decoder = SpeculativeDecoder.load(target, "none")
    with BackgroundServer(decoder, ServeConfig(port=0, allowed_hosts=("myhost.internal",))) as s:
        port = s.url.rsplit(":", 1)[1].encode()
        for host, status in ((b"evil.example", 403), (b"evil.example:" + port, 403), (b"localhost:" + port, 200),
                             (b"127.0.0.1:" + port, 200), (b"[::1]:" + port, 200), (b"myhost.internal", 200)):
            assert raw_status(s.url, b"GET /v1/models HTTP/1.1\r\nHost: " + host + b"\r\n") == status, host
        for origin, status in ((b"http://evil.example", 403), (b"null", 403), (b"http://localhost:" + port, 200)):
            head = b"GET /v1/models HTTP/1.1\r\nHost: localhost\r\nOrigin: " + origin + b"\r\n"
            assert raw_status(s.url, head) == status, origin
        r = httpx.get(s.url + "/v1/models", headers={"host": "attacker.example"})
        assert r.status_code == 403 and r.json()["error"]["code"] == "host_not_allowed"
    with BackgroundServer(decoder, ServeConfig(port=0, api_key="sesame")) as s:  # a key protects it instead
        r = httpx.get(s.url + "/v1/models", headers={"host": "api.example", "authorization": "Bearer sesame"})
        assert r.status_code == 200


def test_idle_sockets_cannot_lock_others_out(target):
    decoder = SpeculativeDecoder.load(target, "none")
    with BackgroundServer(decoder, ServeConfig(port=0, limit_concurrency=4)) as s:
        host, port = s.url.removeprefix("http://").split(":")
        idle = [socket.create_connection((host, int(port)), timeout=10) for _ in range(10)]  # open, then silent
        time.sleep(0.2)
        r = httpx.post(s.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=30)
        assert r.status_code == 200, r.text
        closed = 0
        for sock in idle:
            sock.settimeout(2)
            try:
                closed += sock.recv(10) == b""
            except (TimeoutError, OSError):
                pass
            sock.close()
        assert closed >= 6  # the oldest idle sockets were closed to stay within the limit


def test_shutdown_admits_nothing_new_and_keeps_the_cut_rows_outputs(target, tmp_path, monkeypatch):
    from verispec.engine import SpeculativeEngine

    step = SpeculativeEngine.step
    monkeypatch.setattr(SpeculativeEngine, "step", lambda self, batch: time.sleep(0.05) or step(self, batch))  # slow
    store = tmp_path / "outputs.st"
    decoder = SpeculativeDecoder.load(target, f"suffix:{store}")
    config = ServeConfig(port=0, max_batch_size=1, shutdown_timeout=1.0, auto_k=False)
    server = BackgroundServer(decoder, config).__enter__()
    body = {"prompt": "abc", "max_tokens": 100, "ignore_eos": True, "temperature": 0, "speculative": {"drafter": "none"}}

    async def three():
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as c:
            tasks = [asyncio.create_task(c.post("/v1/completions", json=body)) for _ in range(3)]
            await asyncio.sleep(1.0)  # one row running, two requests waiting
            stopping.start()
            return await asyncio.gather(*tasks)

    stopping = threading.Thread(target=server.stop)
    answers = asyncio.run(three())
    stopping.join()
    codes = sorted(r.status_code for r in answers)
    assert codes == [503, 503, 503], [r.text for r in answers]
    messages = sorted(r.json()["error"]["message"] for r in answers)
    assert messages.count("the server is shutting down") == 2  # the waiting ones were never admitted
    assert any("before this request finished" in m for m in messages)  # the running one, cut at the drain's end
    kept = OutputStore.load(store, SuffixConfig(), decoder.drafter.tokenizer, decoder.engine.target.vocab_size)
    assert sum(len(d) for d in kept.documents) > 0  # the cut row's tokens reached the store's file
