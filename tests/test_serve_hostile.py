"""Hostile requests against the server, round two: constraint bombs of every kind, client mistakes that gave 500s,
constraints too costly to mask; and the same bounds in the live view and on the command line.

The server half runs in a subprocess (tests/serve_hostile.py), so a request that ends the process fails the test
instead of the test run. Before these bounds, its first case (a $ref chain 4,000 deep, about 100 KB) ended the server
process with SIGSEGV, and the lone-surrogate model name, the regex with a lone surrogate, the $ref cycle, the 20,000
alternatives and the four 900 KB GBNF literals were answered 500."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient

import constraint_bombs as bombs
from serve_hostile import SENTINEL, formatted
from tiny_hf import save_tiny_model_dir
from verispec import SpeculativeDecoder
from verispec.config import ConstraintLimits
from verispec.serve.config import ServeConfig
from verispec.serve.server import BackgroundServer

HERE = Path(__file__).parent


def test_no_hostile_request_ends_the_server_and_each_is_a_4xx_naming_its_field(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, str(HERE / "serve_hostile.py"), str(tmp_path)], env=env,
                          capture_output=True, text=True, timeout=900)
    records = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert done.returncode == 0, f"the server process ended (exit {done.returncode}) after {records[-1:]}: " \
                                 f"{done.stderr[-2000:]}"
    *cases, after = records
    assert len(cases) == 17 and after["after"]
    for case in cases:
        assert set(case["statuses"]) <= set(case["expected"]), case
        assert case["sentinel"], case  # the request beside it got its solo answer
        for status, param, error in zip(case["statuses"], case["params"], case["errors"]):
            if status == 400 and case["case"] not in ("prompt with a lone surrogate", "a schema nested past the parser"):
                assert param == "response_format" and error and "\n" not in error, case
    by_name = {c["case"]: c for c in cases}
    assert "4002 deep" in by_name["$ref chain 4,000 deep"]["errors"][0]
    assert "cycle" in by_name["cycle 2"]["errors"][0]
    assert by_name["model with a lone surrogate"]["params"] == ["model"]
    assert by_name["a valid schema"]["outputs"][0].startswith('{"a": ')  # the constraint holds (cut by max_tokens)
    assert after["health"] == {"status": "ok"} and after["faults"] == {} and after["running"] == 0


# --- in this process: bounds that hold while decoding ------------------------------------------------------------
@pytest.fixture(scope="module")
def decoder(tmp_path_factory):
    target = save_tiny_model_dir(tmp_path_factory.mktemp("hostile") / "target", "llama", seed=0,
                                 vocab_chars=bombs.JSON_CHARS)
    return SpeculativeDecoder.load(str(target), "suffix")


async def beside(url: str, body: dict) -> tuple[httpx.Response, httpx.Response]:
    async with httpx.AsyncClient(base_url=url, timeout=60) as c:
        return tuple(await asyncio.gather(c.post("/v1/completions", json=body), c.post("/v1/completions", json=SENTINEL)))


def test_a_row_over_its_mask_budget_fails_alone_with_a_400(decoder):
    schema = formatted(bombs.property_chain(3)[0])
    with BackgroundServer(decoder, ServeConfig(port=0)) as s:
        solo = httpx.post(s.url + "/v1/completions", json=SENTINEL, timeout=60).json()["choices"][0]["text"]
    tight = ServeConfig(port=0, constraint_limits=ConstraintLimits(mask_ms_per_step=1e-6))
    with BackgroundServer(decoder, tight) as s:
        bad, good = asyncio.run(beside(s.url, {**schema, "max_tokens": 12}))
        assert bad.status_code == 400, bad.text
        error = bad.json()["error"]
        assert error["param"] == "response_format" and "masks took" in error["message"], error
        assert good.status_code == 200 and good.json()["choices"][0]["text"] == solo
        streamed = httpx.post(s.url + "/v1/completions", json={**schema, "stream": True}, timeout=60)
        assert '"param": "response_format"' in streamed.text and "masks took" in streamed.text
        assert httpx.get(s.url + "/health").status_code == 200
    decoder.engine.constraint_limits = ConstraintLimits()


def test_a_compile_past_its_time_budget_is_a_400_and_the_retry_finds_it_compiled(decoder, monkeypatch):
    from verispec.constraints import Grammars

    compile_ = Grammars.compile

    def slow(self, constraint, limits=None):
        time.sleep(0.5)
        return compile_(self, constraint, limits)

    monkeypatch.setattr(Grammars, "compile", slow)
    config = ServeConfig(port=0, constraint_limits=ConstraintLimits(compile_seconds=0.1))
    body = formatted(bombs.property_chain(2)[0])
    with BackgroundServer(decoder, config) as s:
        r = httpx.post(s.url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 400 and "longer than 0.1 s" in r.json()["error"]["message"], r.text
        monkeypatch.setattr(Grammars, "compile", compile_)
        time.sleep(1.0)  # the abandoned compile finishes in its thread, and its result is kept
        assert httpx.post(s.url + "/v1/completions", json=body, timeout=60).status_code == 200
    decoder.engine.constraint_limits = ConstraintLimits()


def test_a_constraint_is_compiled_once_per_content(decoder, monkeypatch):
    from verispec.constraints import Grammars

    built = []
    build = Grammars._build
    monkeypatch.setattr(Grammars, "_build", lambda self, c, limits: built.append(c) or build(self, c, limits))
    body = formatted(bombs.ref_chain(5)[0])
    with BackgroundServer(decoder, ServeConfig(port=0)) as s:
        codes = [httpx.post(s.url + "/v1/completions", json=body, timeout=60).status_code for _ in range(3)]
    assert codes == [200] * 3 and len(built) == 1


def test_a_full_queue_refuses_before_reading_the_prompt_or_compiling(decoder, monkeypatch):
    from verispec.serve.requests import RequestBuilder
    from verispec.serve.scheduler import QueueFull, Scheduler

    read = []
    monkeypatch.setattr(Scheduler, "check_room", lambda self, tenant="": (_ for _ in ()).throw(QueueFull()))
    monkeypatch.setattr(RequestBuilder, "completion_prompt", lambda self, body: read.append(body) or [5])
    with BackgroundServer(decoder, ServeConfig(port=0)) as s:
        r = httpx.post(s.url + "/v1/completions", json=formatted(bombs.ref_chain(5)[0]), timeout=60)
    assert r.status_code == 429 and not read


# --- the live view and the command line ----------------------------------------------------------------------------
def test_the_live_view_applies_the_bounds_and_guards_its_sessions(decoder):
    from verispec.viz.server import create_app

    client = TestClient(create_app(decoder), base_url="http://localhost")
    chain = bombs.property_chain(3000)[0]
    r = client.post("/api/live/start", json={"prompt": "x", "drafter": "suffix",
                                             "constraint": {"kind": "grammar", "source": bombs.lark_rule_chain(3000)[0].source}})
    assert r.status_code == 400 and "3002 deep" in r.json()["error"], r.text
    r = client.post("/api/live/start", json={"prompt": "x", "drafter": "suffix",
                                             "constraint": {"kind": "json_schema", "source": chain.source}})
    assert r.status_code == 422  # over the field's 100,000 characters
    first = client.post("/api/live/start", json={"prompt": "hello", "drafter": "suffix", "max_new_tokens": 4}).json()
    second = client.post("/api/live/start", json={"prompt": "hello", "drafter": "suffix", "max_new_tokens": 4}).json()
    assert len(first["session"]) >= 20 and first["session"] != second["session"]  # random, not 1, 2, 3
    assert client.post("/api/live/step", json={"session": first["session"]}).status_code == 400  # replaced
    assert client.post("/api/live/step", json={"session": second["session"]}).status_code == 200
    evil = TestClient(create_app(decoder), base_url="http://evil.example")
    assert evil.get("/api/info").status_code == 403  # DNS rebinding: a host name that is not this machine's
    assert client.get("/api/info", headers={"origin": "http://evil.example"}).status_code == 403
    keyed = TestClient(create_app(decoder, api_key="sesame"), base_url="http://evil.example")
    assert keyed.get("/live").status_code == 200  # the pages are public; the API needs the key
    assert keyed.get("/api/info").status_code == 401
    assert keyed.get("/api/info", headers={"authorization": "Bearer sesame"}).status_code == 200
    big = keyed.post("/api/lossless", content=b"x" * (2 << 20), headers={"authorization": "Bearer sesame"})
    assert big.status_code == 413


def test_the_command_line_applies_the_bounds_in_one_line(decoder, tmp_path):
    schema = tmp_path / "bomb.json"
    schema.write_text(bombs.ref_chain(3000)[0].source)
    target = Path(decoder.target.name)
    done = subprocess.run([sys.executable, "-m", "verispec", "generate", "--target", str(target), "--draft", "none",
                           "--prompt", "x", "--max-new-tokens", "4", "--json-schema", str(schema)],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 2, done.stderr[-2000:]
    lines = [line for line in done.stderr.strip().splitlines() if line.strip()]
    assert "3002 deep" in lines[-1] and "Traceback" not in done.stderr, done.stderr[-2000:]
