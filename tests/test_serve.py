"""`verispec serve` on tiny local models: both endpoints (JSON and streaming), the openai client,
batching that does not change answers, no leaked cache rows, errors, limits, auth and the CLI."""

import asyncio
import json

import httpx
import openai
import pytest

from tiny_hf import save_tiny_model_dir
from verispec import SamplingConfig, SpecConfig, SpeculativeDecoder
from verispec.cli import main
from verispec.serve.config import ServeConfig
from verispec.serve.server import BackgroundServer

KEY = "test-key-123"


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve_models")
    target = save_tiny_model_dir(root / "target", "llama", seed=0)
    draft = save_tiny_model_dir(root / "draft", "llama", seed=0)
    return str(target), str(draft)


@pytest.fixture(scope="module")
def decoder(model_dirs):
    return SpeculativeDecoder.load(*model_dirs)


@pytest.fixture(scope="module")
def server(decoder):
    with BackgroundServer(decoder, ServeConfig(port=0, served_model_name="tiny", max_batch_size=4)) as s:
        yield s


@pytest.fixture()
def client(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


def sse_chunks(text: str) -> list:
    lines = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def test_completion_equals_the_python_api(decoder, client):
    r = client.post("/v1/completions", json={"model": "tiny", "prompt": "hello there", "max_tokens": 20,
                                             "temperature": 0, "speculative": {"K": 3}})
    assert r.status_code == 200
    out = r.json()
    expected = decoder.generate("hello there", SamplingConfig(temperature=0), SpecConfig(max_new_tokens=20), chat=False)
    assert out["object"] == "text_completion" and out["model"] == "tiny"
    assert out["choices"][0]["text"] == expected.text
    assert out["choices"][0]["finish_reason"] == {"eos": "stop", "stop": "stop", "length": "length"}[expected.finish_reason]
    use = out["usage"]
    assert use["completion_tokens"] == len(expected.token_ids)
    assert use["prompt_tokens"] == len(expected.prompt_token_ids)
    assert use["total_tokens"] == use["prompt_tokens"] + use["completion_tokens"]
    spec = use["speculative"]
    assert 0 < spec["accepted_tokens"] <= spec["draft_tokens"]  # the draft is the (int8) target
    assert spec["tokens_per_target_pass"] > 1 and len(spec["drafted_per_position"]) == 3


def test_a_request_can_stop_its_chains_early_and_keeps_its_output(decoder, client):
    body = {"model": "tiny", "prompt": "hello there", "max_tokens": 20, "temperature": 0}
    full = client.post("/v1/completions", json={**body, "speculative": {"K": 4}}).json()
    stopped = client.post("/v1/completions", json={**body, "speculative": {"K": 4, "draft_stop": 0.9}}).json()
    assert stopped["choices"][0]["text"] == full["choices"][0]["text"]
    assert 0 < stopped["usage"]["speculative"]["draft_tokens"]


def test_chat_completion_uses_the_chat_template(decoder, client):
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi there"}],
                                                  "max_tokens": 15, "temperature": 0})
    assert r.status_code == 200
    out = r.json()
    expected = decoder.generate("hi there", SamplingConfig(temperature=0), SpecConfig(max_new_tokens=15), chat=True)
    assert out["object"] == "chat.completion"
    assert out["choices"][0]["message"] == {"role": "assistant", "content": expected.text}
    assert out["usage"]["prompt_tokens"] == len(expected.prompt_token_ids)


@pytest.mark.parametrize("chat", [False, True])
def test_streaming_gives_the_same_text_in_chunks(client, chat):
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body = {"max_tokens": 25, "temperature": 0, "seed": 3}
    body.update({"messages": [{"role": "user", "content": "abc"}]} if chat else {"prompt": "abc"})
    whole = client.post(path, json=body).json()
    r = client.post(path, json={**body, "stream": True, "stream_options": {"include_usage": True}})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    chunks = sse_chunks(r.text)
    *body_chunks, usage_chunk = chunks
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] == whole["usage"]["completion_tokens"]
    if chat:
        assert body_chunks[0]["choices"][0]["delta"]["role"] == "assistant"
        text = "".join(c["choices"][0]["delta"].get("content", "") for c in body_chunks)
        assert text == whole["choices"][0]["message"]["content"]
        assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    else:
        text = "".join(c["choices"][0]["text"] for c in body_chunks)
        assert text == whole["choices"][0]["text"]
    assert len(body_chunks) > 2  # text arrives in several pieces
    assert body_chunks[-1]["choices"][0]["finish_reason"] == whole["choices"][0]["finish_reason"]
    assert all(c["choices"][0]["finish_reason"] is None for c in body_chunks[:-1])


def test_stop_strings_are_never_streamed(client):
    reference = client.post("/v1/completions", json={"prompt": "abc", "max_tokens": 30, "temperature": 0}).json()
    text = reference["choices"][0]["text"]
    stop = text[8:11]
    body = {"prompt": "abc", "max_tokens": 30, "temperature": 0, "stop": [stop]}
    whole = client.post("/v1/completions", json=body).json()["choices"][0]
    streamed = sse_chunks(client.post("/v1/completions", json={**body, "stream": True}).text)
    assert whole["text"] == text[: text.find(stop)] and whole["finish_reason"] == "stop"
    assert "".join(c["choices"][0]["text"] for c in streamed) == whole["text"]


def test_the_openai_client_works_against_the_server(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    assert [m.id for m in client.models.list()] == ["tiny"]
    done = client.completions.create(model="tiny", prompt="hello", max_tokens=10, temperature=0,
                                      extra_body={"speculative": {"K": 2}, "top_k": 5})
    assert done.choices[0].finish_reason in ("stop", "length") and done.usage.completion_tokens > 0
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=10,
                                          temperature=0, seed=1)
    streamed = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                              max_tokens=10, temperature=0, seed=1, stream=True)
    text = "".join(chunk.choices[0].delta.content or "" for chunk in streamed if chunk.choices)
    assert text == chat.choices[0].message.content
    with pytest.raises(openai.BadRequestError, match="n may be from 1 to 8"):
        client.completions.create(model="tiny", prompt="hello", n=9)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt="hello")


async def post_all(url: str, bodies: list[dict]) -> list[dict]:
    async with httpx.AsyncClient(base_url=url, timeout=60) as c:
        responses = await asyncio.gather(*(c.post("/v1/completions", json=b) for b in bodies))
    assert all(r.status_code == 200 for r in responses), [r.text for r in responses]
    return [r.json() for r in responses]


def test_concurrent_requests_equal_single_requests_and_leave_no_cache_rows(server, client):
    """Greedy and seeded requests, each with its own settings, give the same tokens alone and batched (a seeded
    sampled request names its K: its draws follow K, which the server's tuner would otherwise choose by load)."""
    bodies = [
        {"prompt": "hello there", "max_tokens": 20, "temperature": 0},
        {"prompt": "a much longer prompt, with more words in it", "max_tokens": 9, "temperature": 0,
         "speculative": {"K": 5}},
        {"prompt": "abc", "max_tokens": 30, "temperature": 1.0, "seed": 11, "top_p": 0.9, "speculative": {"K": 3}},
        {"prompt": "xyz", "max_tokens": 14, "temperature": 0.7, "seed": 5, "speculative": {"drafter": "none"}},
        {"prompt": "the end", "max_tokens": 25, "temperature": 1.0, "seed": 2, "top_k": 8, "speculative": {"K": 2}},
        {"prompt": "q", "max_tokens": 3, "temperature": 0, "speculative": {"K": 1}},
    ]
    alone = [client.post("/v1/completions", json=b).json() for b in bodies]
    together = asyncio.run(post_all(server.url, bodies))
    for a, t in zip(alone, together):
        assert t["choices"][0]["text"] == a["choices"][0]["text"]
        assert t["usage"]["completion_tokens"] == a["usage"]["completion_tokens"]
    assert together[3]["usage"]["speculative"]["draft_tokens"] == 0  # plain decoding inside a speculative batch
    scheduler = server.app.state.scheduler
    assert scheduler.cache_rows() == 0 and scheduler.running == 0 and scheduler.queue_depth == 0
    drafter_state = scheduler.engine.drafter.state
    rows = getattr(drafter_state, "rows", [drafter_state])  # an int8 draft keeps one cache per row (RowStates)
    assert drafter_state.batch_size == 0 and all(row.valid.shape[1] == 0 for row in rows)
    metrics = client.get("/metrics").text
    assert "verispec_cache_rows 0.0" in metrics and "verispec_queue_depth 0.0" in metrics


def test_tree_requests_equal_chains_and_batch_with_them(server, client):
    """speculative.tree drafts a tree per step: greedy answers equal plain decoding, usage reports the tree's
    stats, and tree and chain requests batched together answer as they do alone."""
    base = {"prompt": "hello there", "max_tokens": 20, "temperature": 0}
    plain = client.post("/v1/completions", json={**base, "speculative": {"drafter": "none"}}).json()
    for tree in ({"shape": [3, 2, 1]}, {"budget": 8, "top_k": 2, "children": "iid"}):
        r = client.post("/v1/completions", json={**base, "speculative": {"tree": tree}})
        assert r.status_code == 200, r.text
        out = r.json()
        assert out["choices"][0]["text"] == plain["choices"][0]["text"]
        spec = out["usage"]["speculative"]
        assert spec["mean_accepted_length"] > 0 and len(spec["drafted_per_position"]) == 3 + ("budget" in tree)
    bodies = [
        {"prompt": "abc", "max_tokens": 24, "temperature": 1.0, "seed": 3, "speculative": {"tree": {"shape": [2, 2]}}},
        {"prompt": "the end", "max_tokens": 18, "temperature": 1.0, "seed": 2, "top_k": 8, "speculative": {"K": 3}},
        {**base, "speculative": {"tree": {"budget": 6}}},
    ]
    alone = [client.post("/v1/completions", json=b).json() for b in bodies]
    together = asyncio.run(post_all(server.url, bodies))
    for a, t in zip(alone, together):
        assert t["choices"][0]["text"] == a["choices"][0]["text"]
    assert server.app.state.scheduler.cache_rows() == 0


def counter(text: str, name: str) -> float:
    return next(float(line.split()[1]) for line in text.splitlines() if line.startswith(name + " "))


def test_metrics_count_requests_tokens_and_latency(client):
    before = client.get("/metrics").text
    client.post("/v1/completions", json={"prompt": "abc", "max_tokens": 24, "temperature": 0,
                                         "speculative": {"K": 4}})
    text = client.get("/metrics").text
    for name in ("verispec_requests_total", "verispec_generated_tokens_total", "verispec_draft_tokens_total",
                 "verispec_accepted_tokens_total", "verispec_acceptance_rate", "verispec_tokens_per_target_pass",
                 "verispec_request_latency_seconds_bucket", "verispec_time_to_first_token_seconds_bucket",
                 "verispec_queue_depth", "verispec_running_sequences"):
        assert name in text
    assert 'verispec_requests_total{endpoint="/v1/completions",status="200"}' in text
    rate = counter(text, "verispec_acceptance_rate")  # over every request the module's server answered
    assert 0.0 < rate <= 1.0
    drafted = counter(text, "verispec_draft_tokens_total") - counter(before, "verispec_draft_tokens_total")
    accepted = counter(text, "verispec_accepted_tokens_total") - counter(before, "verispec_accepted_tokens_total")
    assert drafted > 0 and 0.5 < accepted / drafted <= 1.0  # this request's: the draft is the target (int8-quantized)


BAD_REQUESTS = [
    ({"prompt": "hi", "n": 9}, 400, "n"),
    ({"prompt": "hi", "n": 0}, 400, "n"),
    ({"prompt": "hi", "model": "other"}, 404, "model"),
    ({"prompt": "hi", "speculative": {"tree": {"width": 2}}}, 400, "speculative.tree"),
    ({"prompt": "hi", "speculative": {"tree": {"shape": [3, 0]}}}, 400, "speculative.tree"),
    ({"prompt": "hi", "speculative": {"tree": {"shape": "3,2"}}}, 400, "speculative.tree"),
    ({"prompt": "hi", "speculative": {"tree": {"budget": 65}}}, 400, "speculative.tree"),
    ({"prompt": "hi", "speculative": {"tree": {"shape": [1] * 17}}}, 400, "speculative.tree"),
    ({"prompt": "hi", "speculative": {"tree": True}}, 400, "speculative.tree"),
    ({"prompt": "hi", "speculative": {"tree": {"budget": 4}, "drafter": "none"}}, 400, "speculative.tree"),
    ({"prompt": "hi", "speculative": {"drafter": "eagle"}}, 400, "speculative.drafter"),
    ({"prompt": "hi", "speculative": {"K": 17}}, 400, "speculative.K"),
    ({"prompt": "hi", "speculative": {"K": 0}}, 400, "speculative.K"),
    ({"prompt": "hi", "speculative": {"draft_stop": 1.0}}, 400, "speculative.draft_stop"),
    ({"prompt": "hi", "max_tokens": 127}, 400, "max_tokens"),  # 2 prompt tokens + 127 > 128
    ({"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ({"prompt": "a" * 200}, 400, "prompt"),
    ({"prompt": ""}, 400, "prompt"),
    ({"prompt": ["a", "b"]}, 400, "prompt"),
    ({"prompt": [1, 999]}, 400, None),
    ({"prompt": "hi", "temperature": -1}, 400, "temperature"),
    ({"prompt": "hi", "top_p": 0}, 400, "top_p"),
    ({"prompt": "hi", "temperature": "hot"}, 400, "temperature"),
    ({"prompt": "hi", "seed": 2**70}, 400, "seed"),
    ({"prompt": "hi", "logprobs": 21}, 400, "logprobs"),
    ({"prompt": "hi", "logprobs": 1, "echo": True, "logprobs_mode": "processed"}, 400, "logprobs_mode"),
    ({"prompt": "hi", "logit_bias": {str(i): 1 for i in range(301)}}, 400, "logit_bias"),  # OpenAI's 300
    ({"prompt": "hi", "prediction": {"type": "content", "content": "a" * 200}}, 400, "prediction"),  # > a prompt
    ({"prompt": "hi", "frequency_penalty": -2.5}, 400, "frequency_penalty"),
    ({"prompt": "hi", "stop": [""]}, 400, None),
    ({"max_tokens": 3}, 400, "prompt"),
]


@pytest.mark.parametrize("body,status,param", BAD_REQUESTS)
def test_bad_requests_get_openai_style_errors(client, body, status, param):
    r = client.post("/v1/completions", json=body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert param is None or error["param"] == param
    if param == "max_tokens" and body.get("max_tokens") == 127:
        assert error["code"] == "context_length_exceeded"


def test_chat_errors_and_unknown_routes(client):
    r = client.post("/v1/chat/completions", json={"messages": []})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "robot", "content": "x"}]})
    assert r.status_code == 400
    assert client.get("/v1/nothing").status_code == 404 and client.get("/v1/nothing").json()["error"]
    assert client.get("/v1/completions").status_code == 405


def test_limits_from_the_config(decoder):
    config = ServeConfig(port=0, max_prompt_tokens=10, max_tokens_limit=8, max_draft_tokens=2, max_body_bytes=300)
    with BackgroundServer(decoder, config) as s, httpx.Client(base_url=s.url, timeout=30) as c:
        assert c.post("/v1/completions", json={"prompt": "x" * 12}).json()["error"]["code"] == "context_length_exceeded"
        assert c.post("/v1/completions", json={"prompt": "x", "max_tokens": 9}).status_code == 400
        assert c.post("/v1/completions", json={"prompt": "x", "speculative": {"K": 3}}).status_code == 400
        assert c.post("/v1/completions", json={"prompt": "x", "max_tokens": 8}).status_code == 200
        r = c.post("/v1/completions", json={"prompt": "x", "user": "u" * 400})
        assert r.status_code == 413 and "larger than 300 bytes" in r.json()["error"]["message"]


def test_api_key_is_required_when_set(decoder):
    with BackgroundServer(decoder, ServeConfig(port=0, api_key=KEY)) as s, httpx.Client(base_url=s.url) as c:
        body = {"prompt": "hi", "max_tokens": 3}
        assert c.post("/v1/completions", json=body).status_code == 401
        r = c.post("/v1/completions", json=body, headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        assert c.get("/metrics").status_code == 401
        assert c.get("/health").status_code == 200  # load balancers probe without a key
        assert c.post("/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
        client = openai.OpenAI(base_url=s.url + "/v1", api_key=KEY, max_retries=0)
        assert client.completions.create(model=decoder.target.name, prompt="hi", max_tokens=3).usage.completion_tokens
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=s.url + "/v1", api_key="nope", max_retries=0).models.list()


def test_serve_cli_builds_the_config_with_safe_defaults(model_dirs, monkeypatch):
    seen = {}
    monkeypatch.setattr("verispec.serve.server.run_server", lambda decoder, config: seen.update(config=config))
    monkeypatch.setenv("VERISPEC_API_KEY", "from-env")
    assert main(["serve", "--target", model_dirs[0], "--draft", "ngram", "--port", "0"]) == 0
    assert seen["config"] == ServeConfig(port=0, api_key="from-env")
    assert seen["config"].host == "127.0.0.1"
    assert main(["serve", "--target", model_dirs[0], "--draft", "none", "--api-key", "flag", "--max-batch-size", "2"]) == 0
    assert seen["config"].api_key == "flag" and seen["config"].max_batch_size == 2
    assert main(["serve", "--target", model_dirs[0], "--max-queue", "0"]) == 2


def test_every_server_setting_is_a_serve_option_generated_from_its_field(model_dirs, monkeypatch, capsys):
    """`verispec serve` writes no option by hand: each ServeConfig field but the keys file's is --its-name, typed by
    its field or its parser, its help ending with the field's default."""
    import dataclasses

    from verispec.cli import build_parser

    serve = next(a for a in build_parser()._subparsers._group_actions[0].choices.values() if a.prog.endswith("serve"))
    flags = {opt: action for action in serve._actions for opt in action.option_strings}
    for f in dataclasses.fields(ServeConfig):
        if f.name == "api_keys":  # read from --api-keys-file
            assert "option" not in f.metadata and "--api-keys-file" in flags
            continue
        action = flags["--" + f.name.replace("_", "-")]
        assert action.dest == f.name and action.help.endswith(")") and "(default: " in action.help
    seen = {}
    monkeypatch.setattr("verispec.serve.server.run_server", lambda decoder, config: seen.update(config=config))
    assert main(["serve", "--target", model_dirs[0], "--draft", "none", "--no-auto-k", "--request-timeout", "2.5",
                 "--allowed-hosts", "a.example, b.example", "--constraint-limits", "max_depth=7,compile_seconds=1.5",
                 "--suffix-scope", "key", "--served-model-name", "m"]) == 0
    config = seen["config"]
    assert (config.auto_k, config.request_timeout, config.allowed_hosts, config.suffix_scope, config.served_model_name) \
        == (False, 2.5, ("a.example", "b.example"), "key", "m")
    assert (config.constraint_limits.max_depth, config.constraint_limits.compile_seconds) == (7, 1.5)
    assert dataclasses.replace(config, auto_k=True, request_timeout=300.0, allowed_hosts=(), suffix_scope=None,
                               served_model_name=None, constraint_limits=ServeConfig().constraint_limits) == ServeConfig()
    capsys.readouterr()
    with pytest.raises(SystemExit) as stopped:  # argparse's usage error: one line naming the option
        main(["serve", "--target", model_dirs[0], "--constraint-limits", "depth=3"])
    assert stopped.value.code == 2
    assert "--constraint-limits: unknown constraint limit 'depth'" in capsys.readouterr().err


def assert_served_together_as_alone(decoder, bodies: list[dict] | None = None) -> None:
    """Requests answered together (continuous batching) get the texts they get alone, greedy and seeded."""
    import httpx

    from verispec.serve.config import ServeConfig
    from verispec.serve.server import BackgroundServer

    bodies = bodies or [{"prompt": "hello there", "max_tokens": 20, "temperature": 0},
                        {"prompt": "a longer prompt, with more words", "max_tokens": 9, "temperature": 0,
                         "speculative": {"K": 5}},
                        {"prompt": "abc", "max_tokens": 30, "temperature": 1.0, "seed": 11, "top_p": 0.9,
                         "speculative": {"K": 3}}]  # a seeded sampled request names K (its draws follow K)
    with BackgroundServer(decoder, ServeConfig(port=0, served_model_name="tiny", max_batch_size=4)) as server:
        with httpx.Client(base_url=server.url, timeout=60) as client:
            alone = [client.post("/v1/completions", json={"model": "tiny", **b}).json() for b in bodies]
        together = asyncio.run(post_all(server.url, [{"model": "tiny", **b} for b in bodies]))
    for b, a, t in zip(bodies, alone, together):
        assert t["choices"][0]["text"] == a["choices"][0]["text"], b


@pytest.mark.parametrize("chat", [False, True])
def test_n_choices_are_the_requests_seeded_seed_plus_i_streamed_or_not(server, client, chat):
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body = {"max_tokens": 12, "temperature": 1.0, "seed": 40, "speculative": {"K": 3}}
    body.update({"messages": [{"role": "user", "content": "abc"}]} if chat else {"prompt": "abc"})

    def text(choice):
        return choice["message"]["content"] if chat else choice["text"]

    alone = [text(client.post(path, json={**body, "seed": 40 + i}).json()["choices"][0]) for i in range(3)]
    together = client.post(path, json={**body, "n": 3}).json()
    assert [c["index"] for c in together["choices"]] == [0, 1, 2]
    assert [text(c) for c in together["choices"]] == alone
    assert together["usage"]["completion_tokens"] == sum(
        client.post(path, json={**body, "seed": 40 + i}).json()["usage"]["completion_tokens"] for i in range(3))
    chunks = sse_chunks(client.post(path, json={**body, "n": 3, "stream": True,
                                                "stream_options": {"include_usage": True}}).text)
    streamed = ["", "", ""]
    for c in chunks[:-1]:
        for choice in c["choices"]:
            streamed[choice["index"]] += choice["delta"].get("content", "") if chat else choice["text"]
    assert streamed == alone
    assert chunks[-1]["usage"]["completion_tokens"] == together["usage"]["completion_tokens"]


def test_presence_frequency_penalties_and_logit_bias_are_the_python_apis(decoder, client):
    body = {"prompt": "hello there", "max_tokens": 16, "temperature": 0}
    plain = client.post("/v1/completions", json=body).json()["choices"][0]["text"]
    first = decoder.encode("hello there", chat=False)
    settings = {"presence_penalty": 1.5, "frequency_penalty": 1.0, "logit_bias": {"5": 100, "7": -100}}
    out = client.post("/v1/completions", json={**body, **settings, "speculative": {"K": 3}}).json()
    expected = decoder.generate(first, SamplingConfig(temperature=0, presence_penalty=1.5, frequency_penalty=1.0,
                                                      logit_bias={5: 100.0, 7: -100.0}), SpecConfig(max_new_tokens=16))
    assert out["choices"][0]["text"] == expected.text != plain
    assert 5 in expected.token_ids and 7 not in expected.token_ids  # +100 wins the argmax; -100 never does
    for bad in ({"logit_bias": {"x": 1}}, {"logit_bias": {"999999": 1}}, {"logit_bias": {"5": 101}},
                {"presence_penalty": 3}):
        r = client.post("/v1/completions", json={**body, **bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == next(iter(bad)), r.text
