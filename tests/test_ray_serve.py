"""Scale-out on Ray Serve (`verispec serve --ray`, `serve/ray_serve.py`; runs where the `ray` extra is installed, as
the README's test command does). One local Ray instance on loopback, 2 replicas of a tiny model, shared by the
module: every concurrent request is answered with the tokens a single process gives and the API key is enforced
through Ray's proxy; streamed chunks arrive as they are made; a bad key or an oversized Content-Length is refused
before the body is sent; a flood past the queue is refused at once; a replica killed mid-stream is replaced and
the client's retries lose no request; a replica whose decoding thread died fails its health check and is replaced.
No check depends on how fast the machine is: where an order matters it is made so (decoding held on an event), or
every outcome of the race is accepted and checked."""

import asyncio
import json
import socket
import sys
import threading
import time
from dataclasses import dataclass, replace

import httpx
import pytest

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")

from test_serve_http import read_response  # noqa: E402
from tiny_hf import save_tiny_model_dir  # noqa: E402

from verispec import SpeculativeDecoder  # noqa: E402
from verispec.serve.config import ServeConfig  # noqa: E402
from verispec.serve import ray_serve  # noqa: E402
from verispec.serve.server import BackgroundServer  # noqa: E402

KEY = "secret"
AUTH = {"Authorization": f"Bearer {KEY}"}
PROMPTS = ["hello there", "a b c d", "the cache", "abc abc abc", "speculative", "exact", "tree of tokens", "zz"]
CONFIG = ServeConfig(host="127.0.0.1", port=0, api_key=KEY, served_model_name="tiny", max_batch_size=4, max_queue=4)
# Each replica holds max_batch_size + max_queue = 8 requests, Ray's proxy queues max_queue = 4 more: 20 in all.


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def body(prompt: str, **fields) -> dict:
    return {"model": "tiny", "prompt": prompt, "max_tokens": 48, "temperature": 0, **fields}


def ask(url: str, prompt: str, retries: int = 30) -> tuple[str, int]:
    """A client that retries on 5xx and connection errors (as the OpenAI client does); returns (text, tries)."""
    for attempt in range(1, retries + 1):
        try:
            r = httpx.post(url + "/v1/completions", json=body(prompt), headers=AUTH, timeout=60)
            if r.status_code < 500:
                assert r.status_code == 200, r.text
                return r.json()["choices"][0]["text"], attempt
        except httpx.TransportError:
            pass
        time.sleep(1)
    raise AssertionError(f"no answer for {prompt!r} after {retries} tries")


def answer_all(url: str, prompts: list[str]) -> dict[str, tuple[str, int]]:
    out: dict[str, tuple[str, int]] = {}
    threads = [threading.Thread(target=lambda p=p: out.__setitem__(p, ask(url, p))) for p in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def replica_actors() -> dict:
    """The live replicas' actors, by actor name (what the answers' x-verispec-replica header says)."""
    names = [a for a in ray.util.list_named_actors(all_namespaces=True) if "SERVE_REPLICA" in a["name"]]
    return {a["name"]: ray.get_actor(a["name"], namespace=a["namespace"]) for a in names}


def running_replicas() -> dict:
    """Serve's count of the deployment's replicas by state (RUNNING: constructed, model loaded). Ray's own health
    check cannot say it: while a new replica's constructor runs, it answers healthy without calling ours (Ray 2.60)."""
    app = serve.status().applications.get(ray_serve.DEPLOYMENT)
    deployment = app.deployments.get(ray_serve.DEPLOYMENT) if app else None
    return dict(deployment.replica_states) if deployment else {}


def wait_for_replicas(count: int, timeout_s: float = 120.0) -> None:
    """Until `count` replicas are listed and Serve counts `count` of them running (a new replica is listed before it
    has loaded its model); the timeout is a bound only."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if len(replica_actors()) == count and running_replicas() == {"RUNNING": count}:
            return
        time.sleep(0.5)
    raise AssertionError(f"{count} running replicas were wanted, found {len(replica_actors())} replicas, "
                         f"states {running_replicas()}")


@dataclass
class Cluster:
    url: str
    expected: dict[str, str]  # prompt -> a single process's greedy answer


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    target = save_tiny_model_dir(tmp_path_factory.mktemp("ray_models") / "target", "llama", seed=0)
    load = {"target": str(target), "draft": "ngram"}
    with BackgroundServer(SpeculativeDecoder.load(**load), CONFIG) as single:
        expected = {p: ask(single.url, p)[0] for p in PROMPTS}
    port = free_port()
    try:
        ray_serve.run(load, replace(CONFIG, port=port), replicas=2, cpus_per_replica=0.5, blocking=False)
        wait_for_replicas(2)
        yield Cluster(f"http://127.0.0.1:{port}", expected)
    finally:
        serve.shutdown()
        ray.shutdown()


def test_bad_scale_out_options_are_one_line(tmp_path, capsys, monkeypatch):
    from verispec.cli import main

    started = []
    monkeypatch.setattr(ray, "init", lambda *a, **k: started.append(1))
    target = save_tiny_model_dir(tmp_path / "target", "llama", seed=0)
    for option, message in ((["--autoscale", "3,1"], "--autoscale needs 1 <= MIN <= MAX, got 3,1"),
                            (["--autoscale", "many"], "--autoscale takes MIN,MAX replica counts, got 'many'"),
                            (["--replicas", "0"], "--replicas must be >= 1, got 0")):
        assert main(["serve", "--ray", "--target", str(target), "--draft", "ngram", *option]) == 2
        assert message in capsys.readouterr().err
    assert not started  # refused before Ray started


def test_replicas_answer_as_one_process_does_and_enforce_the_key(cluster):
    assert httpx.post(cluster.url + "/v1/completions", json=body("hi"), timeout=60).status_code == 401
    assert httpx.get(cluster.url + "/health", timeout=60).status_code == 200
    answers = answer_all(cluster.url, PROMPTS)
    assert {p: a[0] for p, a in answers.items()} == cluster.expected


FREE_STEPS = 10  # decoding steps a replica runs before gate_decoding holds the next


def gate_decoding(_replica_actor, hold: bool) -> tuple[int, bool]:
    """Run inside a replica (`__ray_call__`). hold: let the next FREE_STEPS decoding steps run, then hold every later
    one until called again without hold (each waits 60 s at most, a bound only). Without hold: release the held steps,
    restore the step and return how many steps had begun and whether any wait ran out (the steps then went on
    without being released)."""
    import threading

    from verispec.engine import SpeculativeEngine

    if hold:
        gate = {"open": threading.Event(), "steps": 0, "ran_out": False, "step": SpeculativeEngine.step}

        def held(self, batch):
            gate["steps"] += 1
            if gate["steps"] > FREE_STEPS and not gate["open"].wait(60):
                gate["ran_out"] = True
            return gate["step"](self, batch)

        SpeculativeEngine.step, SpeculativeEngine.test_gate = held, gate
        return 0, False
    gate = SpeculativeEngine.__dict__.get("test_gate")
    if gate is None:
        return 0, False
    gate["open"].set()
    SpeculativeEngine.step = gate["step"]
    del SpeculativeEngine.test_gate
    return gate["steps"], gate["ran_out"]


def test_streamed_chunks_arrive_as_they_are_made(cluster):
    """Through Ray's proxy each SSE chunk reaches the client when the replica sends it, not all at the end: the
    replicas' decoding is held after 10 steps of a 120-token answer (one token a step, no drafter) until the client
    has its first chunk, so that chunk cannot come from a finished answer, however fast the machine."""
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    actors = list(replica_actors().values())
    texts, gates = [], []
    request = body("zz", max_tokens=120, stream=True, speculative={"drafter": "none"})  # one token per chunk
    ray.get([a.__ray_call__.remote(gate_decoding, True) for a in actors])
    try:
        with httpx.stream("POST", cluster.url + "/v1/completions", json=request, headers=AUTH, timeout=60) as r:
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
            lines = (line for line in r.iter_lines() if line.startswith("data: {"))
            texts.append(json.loads(next(lines)[6:])["choices"][0]["text"])  # while the answer is held unfinished
            gates = ray.get([a.__ray_call__.remote(gate_decoding, False) for a in actors])
            texts += [json.loads(line[6:])["choices"][0]["text"] for line in lines]
    finally:
        ray.get([a.__ray_call__.remote(gate_decoding, False) for a in actors])
    steps = sum(n for n, _ in gates)
    assert 1 <= steps <= FREE_STEPS + 1, gates  # the gate counted the answer's steps: at most 11 of 120 had begun
    assert not any(ran_out for _, ran_out in gates)  # released by the client's first chunk, not by the gate's bound
    assert len(texts) > 10
    assert "".join(texts).startswith(cluster.expected["zz"])  # greedy: the 48-token answer, continued


def test_a_bad_key_or_an_oversized_body_is_refused_before_the_body_is_sent(cluster):
    host, port = cluster.url.removeprefix("http://").split(":")
    for auth, length, status in ((b"Bearer wrong", 100, 401), (f"Bearer {KEY}".encode(), 50_000_000, 413)):
        with socket.create_connection((host, int(port)), timeout=30) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                         b"Authorization: %s\r\nContent-Length: %d\r\n\r\n" % (auth, length))  # and no body
            code, _, answer = read_response(sock)  # answered though no byte of the body was ever sent
            assert code == status and b'"error"' in answer


async def flood(url: str, n: int) -> list[tuple[int, int]]:
    """n requests at once: (status, the order in which its answer came, 0 first)."""
    done = []

    async def one(client: httpx.AsyncClient, i: int) -> tuple[int, int]:
        r = await client.post("/v1/completions", json=body(PROMPTS[i % 8], max_tokens=100, temperature=1.0, seed=i),
                              headers=AUTH)
        done.append(i)
        return r.status_code, len(done) - 1

    limits = httpx.Limits(max_connections=n)
    async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as client:
        return await asyncio.gather(*(one(client, i) for i in range(n)))


def test_a_flood_past_the_queue_is_refused_at_once(cluster):
    """40 requests at once where at most 20 fit (2 replicas x (batch 4 + queue 4), and Ray's queue of 4): the rest
    get 503 at once instead of waiting in an unbounded queue, and the admitted ones are answered. (Ray counts a
    request as queued until a replica takes it, so of a burst it admits about max_queue, not 20.) "At once" by
    order, not by a clock: every refusal comes before the last admitted request is answered, so none of them waited
    for a place to free up."""
    results = asyncio.run(flood(cluster.url, 40))
    refused = [order for code, order in results if code == 503]
    served = [order for code, order in results if code == 200]
    assert len(refused) + len(served) == 40 and len(refused) >= 10 and len(served) >= CONFIG.max_queue
    assert max(refused) < max(served)


def stream_outcome(url: str, request: dict, on_first_chunk) -> tuple[str, str]:
    """Stream `request`; call on_first_chunk(replica name) at its first chunk. Returns how it ended, as a client sees
    it ("done": the whole answer; "cut": the connection broke or the stream ended without [DONE]; or the HTTP status
    of an error answer), and the text that came."""
    texts = []
    try:
        with httpx.stream("POST", url + "/v1/completions", json=request, headers=AUTH, timeout=60) as r:
            if r.status_code != 200:
                return str(r.status_code), ""
            lines = (line for line in r.iter_lines() if line.startswith("data: "))
            first = next(lines)
            on_first_chunk(r.headers["x-verispec-replica"])
            for line in [first, *lines]:
                if line == "data: [DONE]":
                    return "done", "".join(texts)
                texts.append(json.loads(line[6:])["choices"][0]["text"])
    except httpx.TransportError:
        pass
    return "cut", "".join(texts)


def test_a_replica_killed_mid_stream_is_replaced_and_no_request_is_lost(cluster):
    """A replica is killed while it streams an answer and other requests are arriving. Whether the kill lands before
    that answer ends, and before or after each other request reached that replica, is a race the test does not
    decide: the stream ends as documented (cut, Ray's 500, or whole if it finished first), every request gets its
    single-process answer within its client's retries (`ask`: 30 tries), and the replica is replaced."""
    request = body("zz", max_tokens=120, stream=True, speculative={"drafter": "none"})
    results: list = []
    many = [p for p in PROMPTS for _ in range(2)]
    threads = [threading.Thread(target=lambda p=p: results.append((p, *ask(cluster.url, p)))) for p in many]
    killed = []

    def kill(replica: str) -> None:
        for t in threads:
            t.start()
        killed.append(replica)
        ray.kill(replica_actors()[replica], no_restart=True)  # Ray starts another

    outcome, text = stream_outcome(cluster.url, request, kill)
    for t in threads:
        t.join()
    assert killed and outcome in ("cut", "500", "done"), outcome
    assert text.startswith(cluster.expected["zz"]) or cluster.expected["zz"].startswith(text)  # as far as it came
    assert len(results) == len(many) and all(text == cluster.expected[p] for p, text, _ in results)  # none lost
    deadline = time.monotonic() + 120  # a bound only
    while time.monotonic() < deadline and (killed[0] in replica_actors() or len(replica_actors()) != 2):
        time.sleep(0.5)
    assert killed[0] not in replica_actors()
    wait_for_replicas(2)  # replaced
    answers = answer_all(cluster.url, PROMPTS[:4])
    assert {p: a[0] for p, a in answers.items()} == {p: cluster.expected[p] for p in PROMPTS[:4]}


def stop_decoding(_replica_actor) -> int:
    """Run inside a replica (`__ray_call__`): raise, in its scheduler thread, an exception no guard catches (Ray's
    worker freezes its objects out of `gc`'s reach, so the thread is found by name). Returns the threads hit."""
    import ctypes
    import threading

    class Died(BaseException):
        pass

    hit = 0
    for thread in threading.enumerate():
        if thread.name == "verispec-scheduler":
            hit += ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread.ident), ctypes.py_object(Died))
    return hit


def test_a_replica_whose_decoding_thread_died_is_replaced(cluster):
    """The app's /health answers 503 once its scheduler thread is dead; Ray's health check (that /health) fails and
    Ray replaces the replica, where the process itself lives on."""
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    name, actor = next(iter(replica_actors().items()))
    ray.get(actor.check_health.remote())  # healthy; and the app's lifespan (its scheduler thread) has started
    assert ray.get(actor.__ray_call__.remote(stop_decoding)) == 1
    failure, deadline = "", time.monotonic() + 60  # a bound only
    while not failure and time.monotonic() < deadline:  # Ray's own health check of that replica fails, and why
        try:
            ray.get(actor.check_health.remote())
            time.sleep(0.2)
        except ray.exceptions.RayError as err:
            failure = str(err)
    assert "/health answered 503" in failure
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and name in replica_actors():
        time.sleep(0.5)
    assert name not in replica_actors()
    wait_for_replicas(2)
    answers = answer_all(cluster.url, PROMPTS[:4])
    assert {p: a[0] for p, a in answers.items()} == {p: cluster.expected[p] for p in PROMPTS[:4]}
