"""Structured output through the interfaces: the server's response_format (OpenAI's json_object / json_schema, and
regex / grammar), the CLI's --json-schema / --json-object / --regex / --grammar, and the live view; bad constraints
get one clear 400 or one clear line."""

import json
import re

import httpx
import openai
import pytest

from tiny_hf import CHARS, save_tiny_model_dir
from verispec import SpeculativeDecoder
from verispec.cli import main
from verispec.config import Constraint, SamplingConfig, SpecConfig
from verispec.serve.config import ServeConfig
from verispec.serve.server import BackgroundServer

JSON_CHARS = CHARS + list('{}[]"-')
SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6},
                                           "zip": {"type": "string", "pattern": "^[0-9]{3}$"}},
          "required": ["city", "zip"], "additionalProperties": False}


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("structured_models")
    return (str(save_tiny_model_dir(root / "target", "llama", seed=0, vocab_chars=JSON_CHARS)),
            str(save_tiny_model_dir(root / "draft", "llama", seed=0, vocab_chars=JSON_CHARS)))


@pytest.fixture(scope="module")
def decoder(model_dirs):
    return SpeculativeDecoder.load(*model_dirs)


@pytest.fixture(scope="module")
def server(decoder):
    with BackgroundServer(decoder, ServeConfig(port=0, served_model_name="tiny", max_batch_size=4)) as s:
        yield s


def matches_schema(text: str) -> bool:
    value = json.loads(text)
    return (set(value) == {"city", "zip"} and isinstance(value["city"], str) and len(value["city"]) <= 6
            and re.fullmatch("[0-9]{3}", value["zip"]) is not None)


def test_response_format_json_schema_equals_the_python_api_and_validates(decoder, server):
    body = {"prompt": "where?", "max_tokens": 60, "temperature": 0,
            "response_format": {"type": "json_schema", "json_schema": {"name": "place", "schema": SCHEMA,
                                                                        "strict": True}}}
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    text = r.json()["choices"][0]["text"]
    assert matches_schema(text) and r.json()["choices"][0]["finish_reason"] == "stop"
    local = decoder.generate("where?", SamplingConfig(temperature=0.0, constraint=Constraint("json_schema",
                                                                                         json.dumps(SCHEMA))),
                             SpecConfig(max_new_tokens=60), chat=False)
    assert text == local.text
    streamed = httpx.post(server.url + "/v1/completions", json={**body, "stream": True}, timeout=60).text
    pieces = [json.loads(line[6:]) for line in streamed.splitlines() if line.startswith("data: {")]
    assert "".join(p["choices"][0]["text"] for p in pieces) == text


def test_the_openai_client_gets_json_objects_and_regex_answers(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    for seed in range(3):
        chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                              max_tokens=80, temperature=1.0, seed=seed,
                                              response_format={"type": "json_object"})
        if chat.choices[0].finish_reason == "stop":
            assert isinstance(json.loads(chat.choices[0].message.content), dict)
    done = client.completions.create(model="tiny", prompt="code", max_tokens=20, temperature=0.8, seed=4,
                                     extra_body={"response_format": {"type": "regex", "regex": "[a-z]{3}-[0-9]{4}"}})
    assert re.fullmatch("[a-z]{3}-[0-9]{4}", done.choices[0].text)


@pytest.mark.parametrize("response_format, message", [
    ({"type": "json_schema"}, "needs json_schema.schema"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}, "invalid JSON schema"),
    ({"type": "regex", "regex": "[a-"}, "invalid regex"),
    ({"type": "regex"}, "needs a non-empty 'regex'"),
    ({"type": "text", "regex": "a+"}, "does not go with type 'text'"),
    ({"type": "grammar", "grammar": "start: ("}, "invalid grammar"),
    ({"type": "xml"}, None),
])
def test_bad_response_formats_get_one_clear_400(server, response_format, message):
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 5,
                                                         "response_format": response_format}, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and "\n" not in error["message"]
    if message is not None:
        assert message in error["message"] and error["param"] == "response_format"
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}  # and the server goes on


def test_cli_generate_with_each_constraint_option(model_dirs, tmp_path, capsys):
    target, draft = model_dirs
    base = ["generate", "--json", "--target", target, "--draft", draft, "--prompt", "hi", "--max-new-tokens", "60",
            "--temperature", "0"]
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps(SCHEMA))
    grammar = tmp_path / "yesno.gbnf"
    grammar.write_text('root ::= "yes" | "no"')
    for extra, check in ((["--json-schema", str(schema)], matches_schema),
                         (["--json-object"], lambda t: isinstance(json.loads(t), dict)),
                         (["--regex", "[0-9]{2}x"], lambda t: re.fullmatch("[0-9]{2}x", t)),
                         (["--grammar", str(grammar)], lambda t: t in ("yes", "no"))):
        assert main([*base, *extra]) == 0
        out = json.loads(capsys.readouterr().out)
        assert check(out["text"]), (extra, out["text"])


@pytest.mark.parametrize("extra, message", [
    (["--json-schema", "/nonexistent/schema.json"], "cannot read --json-schema"),
    (["--regex", "[a-"], "invalid regex"),
])
def test_cli_bad_constraints_are_one_line(model_dirs, capsys, extra, message):
    target, draft = model_dirs
    code = main(["generate", "--target", target, "--draft", draft, "--prompt", "hi", "--max-new-tokens", "8", *extra])
    err = capsys.readouterr().err
    assert code == 2 and message in err and "Traceback" not in err
    with pytest.raises(SystemExit):  # one constraint at a time
        main(["generate", "--target", target, "--prompt", "hi", "--regex", "a", "--json-object"])
    assert "not allowed with" in capsys.readouterr().err


def test_the_live_view_decodes_under_a_constraint_and_shows_forced_tokens(decoder):
    from fastapi.testclient import TestClient

    from verispec.viz.server import create_app

    with TestClient(create_app(decoder), base_url="http://localhost") as client:
        start = client.post("/api/live/start", json={"prompt": "hi", "drafter": decoder.draft_name, "k": 3,
                                                     "temperature": 0, "max_new_tokens": 60,
                                                     "constraint": {"kind": "json_schema", "source": json.dumps(SCHEMA)}})
        assert start.status_code == 200, start.text
        kinds, text, done = set(), "", False
        while not done:
            step = client.post("/api/live/step", json={"session": start.json()["session"]}).json()
            done = step["done"]
            if step["record"]:
                for piece, kind in step["record"]["pieces"]:
                    kinds.add(kind)
                    text += piece
        assert matches_schema(text) and "forced" in kinds
        bad = client.post("/api/live/start", json={"prompt": "hi", "drafter": decoder.draft_name,
                                                   "constraint": {"kind": "regex", "source": "[a-"}})
        assert bad.status_code == 400 and "invalid regex" in bad.json()["error"]


def test_the_bench_decodes_structured_prompts_under_their_schemas(model_dirs, tmp_path):
    """Every system, Hugging Face's included (the schema as a logits processor), decodes a prompt with a "schema" under
    it: greedy outputs equal verispec's constrained plain decoding and all of them are valid."""
    from verispec.bench.runner import BenchConfig, run_bench
    from verispec.models import load_model

    prompts = tmp_path / "structured.jsonl"
    prompts.write_text("".join(json.dumps({"question_id": i, "category": "json_extraction", "turns": [text],
                                           "schema": SCHEMA}) + "\n" for i, text in enumerate(["where?", "a place"])))
    systems = ("verispec-plain", "verispec-draft", "verispec-suffix", "hf-generate", "hf-assisted")
    config = BenchConfig(prompts=str(prompts), max_new_tokens=60, out_dir=str(tmp_path / "out"), systems=systems)
    report = run_bench(config, load_model(model_dirs[0]), load_model(model_dirs[1]))
    assert not report["failures"] and set(report["summary"]) == set(systems)
    for system in systems:
        assert report["summary"][system]["all"]["greedy_equal_to_plain"] == "2/2", system
    tokenizer = SpeculativeDecoder.load(model_dirs[0], "none").target.tokenizer
    for run in report["runs"]:
        assert matches_schema(tokenizer.decode(run["token_ids"], skip_special_tokens=True)), run["system"]
