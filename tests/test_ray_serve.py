"""Scale-out on Ray Serve (`verispec serve --ray`, `serve/ray_serve.py`; runs where the `ray` extra is installed, as
the README's test command does): a local Ray instance on loopback with 2 replicas of a tiny model answers every
concurrent request, greedy answers equal a single process's, a replica killed mid-run is replaced and the client's
retries lose no request, and the API key is enforced through Ray's proxy."""

import socket
import threading
import time

import httpx
import pytest

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")

from tiny_hf import save_tiny_model_dir  # noqa: E402

from verispec import SpeculativeDecoder  # noqa: E402
from verispec.config import ServeConfig  # noqa: E402
from verispec.serve import ray_serve  # noqa: E402
from verispec.serve.server import BackgroundServer  # noqa: E402

KEY = "secret"
PROMPTS = ["hello there", "a b c d", "the cache", "abc abc abc", "speculative", "exact", "tree of tokens", "zz"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def body(prompt: str) -> dict:
    return {"model": "tiny", "prompt": prompt, "max_tokens": 48, "temperature": 0}


def ask(url: str, prompt: str, retries: int = 30) -> tuple[str, int]:
    """A client that retries on 5xx and connection errors (as the OpenAI client does); returns (text, tries)."""
    for attempt in range(1, retries + 1):
        try:
            r = httpx.post(url + "/v1/completions", json=body(prompt), headers={"Authorization": f"Bearer {KEY}"},
                           timeout=60)
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


def replica_actors() -> list:
    names = [a for a in ray.util.list_named_actors(all_namespaces=True) if "SERVE_REPLICA" in a["name"]]
    return [ray.get_actor(a["name"], namespace=a["namespace"]) for a in names]


def test_two_replicas_answer_everything_survive_a_killed_replica_and_enforce_the_key(tmp_path):
    target = save_tiny_model_dir(tmp_path / "target", "llama", seed=0)
    load = {"target": str(target), "draft": "ngram"}
    config = ServeConfig(host="127.0.0.1", port=0, api_key=KEY, served_model_name="tiny", max_batch_size=4)
    with BackgroundServer(SpeculativeDecoder.load(**load), config) as single:
        expected = {p: ask(single.url, p)[0] for p in PROMPTS}
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    try:
        ray_serve.run(load, ServeConfig(host="127.0.0.1", port=port, api_key=KEY, served_model_name="tiny",
                                        max_batch_size=4), replicas=2, cpus_per_replica=0.5, blocking=False)
        assert len(replica_actors()) == 2
        assert httpx.post(url + "/v1/completions", json=body("hi"), timeout=60).status_code == 401
        assert httpx.get(url + "/health", timeout=60).status_code == 200
        answers = answer_all(url, PROMPTS)
        assert {p: a[0] for p, a in answers.items()} == expected

        killed = replica_actors()[0]
        results: list = []
        many = [p for p in PROMPTS for _ in range(4)]
        threads = [threading.Thread(target=lambda p=p: results.append((p, *ask(url, p)))) for p in many]
        for t in threads:
            t.start()
        while not results:  # requests are being answered: kill one replica mid-run
            time.sleep(0.01)
        ray.kill(killed, no_restart=True)  # Ray Serve's controller starts a replacement
        for t in threads:
            t.join()
        assert len(results) == len(many) and all(text == expected[p] for p, text, _ in results)  # none lost
        assert len(results) - sum(tries == 1 for _, _, tries in results) >= 1  # the kill cut some: they were retried
        deadline = time.time() + 120
        while time.time() < deadline and len(replica_actors()) < 2:
            time.sleep(1)
        assert len(replica_actors()) == 2  # replaced
        assert {p: a[0] for p, a in answer_all(url, PROMPTS[:4]).items()} == {p: expected[p] for p in PROMPTS[:4]}
    finally:
        serve.shutdown()
        ray.shutdown()


def test_bad_scale_out_options_are_one_line(tmp_path, capsys):
    from verispec.cli import main

    target = save_tiny_model_dir(tmp_path / "target", "llama", seed=0)
    for option, message in ((["--autoscale", "3,1"], "--autoscale needs 1 <= MIN <= MAX, got 3,1"),
                            (["--autoscale", "many"], "--autoscale takes MIN,MAX replica counts, got 'many'"),
                            (["--replicas", "0"], "--replicas must be >= 1, got 0")):
        assert main(["serve", "--ray", "--target", str(target), "--draft", "ngram", *option]) == 2
        assert message in capsys.readouterr().err
    assert not ray.is_initialized()  # refused before Ray started
