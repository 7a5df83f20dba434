"""OpenAI tool calling (`serve.tools`): the Hermes syntax parsed, the tools and the history's calls rendered by the
template, and a required or named call constrained by the tools' schemas: every call parses and validates, streamed
and not, with the official client; bad tool requests are one 400 line."""

import json
import string

import jsonschema
import openai
import pytest
import torch

from conftest import tiny_model
from tiny_hf import char_tokenizer
from verispec import SpeculativeDecoder
from verispec.serve.config import ServeConfig
from verispec.serve.server import BackgroundServer
from verispec.serve.tools import call_grammar, parse_calls

TEMPLATE = (
    "{% if tools %}<s>system: {{ tools | tojson }}\n{% endif %}"
    "{% for m in messages %}<s>{{ m['role'] }}: "
    "{% if m.get('tool_calls') %}{% for c in m['tool_calls'] %}<tool_call>\n"
    "{{ {'name': c['function']['name'], 'arguments': c['function']['arguments']} | tojson }}\n</tool_call>{% endfor %}"
    "{% else %}{{ m['content'] }}{% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant: {% endif %}"
)
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "the weather in a city",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string", "maxLength": 12},
                                                "unit": {"enum": ["c", "f"]}},
                                                "required": ["city", "unit"], "additionalProperties": False}}}
ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                     "b": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["a", "b"], "additionalProperties": False}}}
TOOLS = [WEATHER, ADD]


def test_hermes_calls_are_parsed_and_broken_ones_stay_content():
    text = 'Let me check.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n' \
           '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}\n</tool_call>'
    content, calls = parse_calls(text)
    assert content == "Let me check."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("add", {"a": 1, "b": 2}), ("get_weather", {"city": "Oslo", "unit": "c"})]
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in calls)
    assert parse_calls("no calls here") == ("no calls here", [])
    assert parse_calls('<tool_call>\n{"name": "add", "argu')[1] == []  # cut short: content, not a call


@pytest.fixture(scope="module")
def decoder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tools") / "target"
    tokenizer = char_tokenizer(True, list(string.printable))
    tokenizer.chat_template = TEMPLATE
    model = tiny_model("llama", vocab=len(tokenizer), seed=0, sharpness=3.0)
    model.config.max_position_embeddings = 2048  # the tools' JSON, a character a token
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(str(folder))
    tokenizer.save_pretrained(str(folder))
    return SpeculativeDecoder.load(str(folder), "ngram")


@pytest.fixture(scope="module")
def client(decoder):
    with BackgroundServer(decoder, ServeConfig(port=0, served_model_name="tiny")) as server:
        yield openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120), server


def check_calls(calls, names):
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    assert calls and all(c.function.name in names for c in calls)
    for call in calls:
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_required_and_named_calls_always_parse_and_validate(client, temperature):
    openai_client, _ = client
    messages = [{"role": "user", "content": "what is 2 + 3, and the weather in oslo?"}]
    for seed in range(4):
        out = openai_client.chat.completions.create(model="tiny", messages=messages, tools=TOOLS, tool_choice="required",
                                                    temperature=temperature, seed=seed, max_tokens=800)
        choice = out.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        check_calls(choice.message.tool_calls, {"add", "get_weather"})
        named = openai_client.chat.completions.create(
            model="tiny", messages=messages, tools=TOOLS, temperature=temperature, seed=seed, max_tokens=120,
            tool_choice={"type": "function", "function": {"name": "add"}}, parallel_tool_calls=False)
        assert len(named.choices[0].message.tool_calls) == 1
        check_calls(named.choices[0].message.tool_calls, {"add"})


@pytest.fixture(scope="module")
def marker_client(tmp_path_factory):
    """A server whose tokenizer has the call markers as tokens of their own (as Qwen's has), and that tokenizer."""
    folder = tmp_path_factory.mktemp("tool_markers") / "target"
    tokenizer = char_tokenizer(True, list(string.printable))
    tokenizer.add_tokens(["<tool_call>", "</tool_call>"])  # added, not special: decoded into the text, as Qwen's
    tokenizer.chat_template = TEMPLATE
    model = tiny_model("llama", vocab=len(tokenizer), seed=0, sharpness=3.0)
    model.config.max_position_embeddings = 2048
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(str(folder))
    tokenizer.save_pretrained(str(folder))
    decoder = SpeculativeDecoder.load(str(folder), "ngram")
    with BackgroundServer(decoder, ServeConfig(port=0, served_model_name="tiny")) as server:
        yield openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120), tokenizer


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_auto_calls_are_constrained_once_opened_and_the_text_stays_free(marker_client, temperature):
    """tool_choice "auto": the model is pushed to open a call at once (a logit bias on the opening marker); the call it
    then writes parses and validates against its tool's schema, which a random model would never do unconstrained.
    Without the push the answer is free text."""
    openai_client, tokenizer = marker_client
    opening = tokenizer.convert_tokens_to_ids("<tool_call>")
    messages = [{"role": "user", "content": "what is 2 + 3?"}]
    for seed in range(3):
        out = openai_client.chat.completions.create(
            model="tiny", messages=messages, tools=TOOLS, tool_choice="auto", temperature=temperature, seed=seed,
            max_tokens=300, parallel_tool_calls=False, logit_bias={str(opening): 100})
        choice = out.choices[0]
        assert choice.finish_reason == "tool_calls", choice.message.content
        assert len(choice.message.tool_calls) == 1
        check_calls(choice.message.tool_calls, {"add", "get_weather"})
    free = openai_client.chat.completions.create(model="tiny", messages=messages, tools=TOOLS, temperature=1.0, seed=0,
                                                 max_tokens=30)
    assert free.choices[0].message.content and free.choices[0].finish_reason in ("stop", "length")


def test_streamed_calls_equal_the_whole_answers(client):
    openai_client, _ = client
    kwargs = dict(model="tiny", messages=[{"role": "user", "content": "add 1 and 2"}], tools=TOOLS,
                  tool_choice="required", temperature=0, max_tokens=120)
    whole = openai_client.chat.completions.create(**kwargs).choices[0]
    chunks = list(openai_client.chat.completions.create(**kwargs, stream=True))
    deltas = [d for c in chunks if c.choices for d in (c.choices[0].delta.tool_calls or [])]
    streamed = {}  # index -> [name, arguments], put together from the pieces as a client does
    for d in deltas:
        call = streamed.setdefault(d.index, [d.function.name, ""])
        call[1] += d.function.arguments or ""
    assert [tuple(streamed[k]) for k in sorted(streamed)] == \
        [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]
    assert len(deltas) > 2 * len(streamed)  # the arguments came in pieces, not whole
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"


def test_calls_stream_as_they_are_written_and_a_cut_call_ends_the_answer():
    """A call's id and name go out once its head is written, its arguments piece by piece (never the call's own closing
    brace or marker), the next call after it; the pieces put together are the whole answer's calls (the same ids).
    A call cut by the answer's end is a call with the arguments written, streamed and whole."""
    from verispec.serve.answers import CallStream
    from verispec.serve.tools import parse_calls

    class Pieces:  # a TextStream over given text pieces
        def __init__(self, pieces):
            self.pieces = iter(pieces)

        def delta(self, new_tokens, done, text_end):
            return next(self.pieces, "")

    first = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    second = '\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "oslo"}}\n</tool_call>'
    cuts = ["<tool_", first[6:30], first[30:44], first[44:52], first[52:], second[:20], second[20:60], second[60:]]
    stream = CallStream(Pieces(cuts + [""]))
    steps = []
    for _ in cuts:
        assert stream.delta((), False, None) == ""
        steps.append(stream.pieces())
    assert steps[0] == [] and steps[1] == [] and steps[2][0]["function"] == {"name": "add", "arguments": ""}
    assert [[p["function"]["arguments"] for p in step] for step in steps[2:]] == [
        ["", '{"a'], ['": 1, "b'], ['": 2}'], [], ["", '{"city": "'], ['oslo"}']]
    held = CallStream(Pieces(['<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool', ""]))
    held.delta((), False, None)  # the call's own brace and what may be its marker: held until the marker shows
    assert [p["function"]["arguments"] for p in held.pieces()] == ["", '{"a": 1}']
    assert stream.delta((), True, None) == "" and stream.last == []
    pieces = [p for step in steps for p in step]
    joined = {}
    for p in pieces:
        joined.setdefault(p["index"], [p.get("id"), p["function"].get("name"), ""])[2] += p["function"]["arguments"]
    assert [tuple(v) for _, v in sorted(joined.items())] == [
        (c["id"], c["function"]["name"], c["function"]["arguments"]) for c in stream.calls]
    assert [c["function"]["arguments"] for c in stream.calls] == ['{"a": 1, "b": 2}', '{"city": "oslo"}']
    assert [c["function"]["arguments"] for c in parse_calls(first + second)[1]] == ['{"a": 1, "b": 2}', '{"city": "oslo"}']

    cut = first + '\n<tool_call>\n{"name": "add", "arguments": {"a": 4'
    stream = CallStream(Pieces([cut, ""]))
    stream.delta((), False, None)
    sent = stream.pieces()
    assert stream.delta((), True, None) == ""
    joined = "".join(p["function"]["arguments"] for p in sent + stream.last if p["index"] == 1)
    assert joined == '{"a": 4' == stream.calls[1]["function"]["arguments"]
    assert [c["function"]["arguments"] for c in parse_calls(cut, cut=True)[1]] == ['{"a": 1, "b": 2}', '{"a": 4']
    assert len(parse_calls(cut)[1]) == 1  # not cut: an open call is not a call


def test_a_history_with_calls_and_tool_answers_is_rendered_by_the_template(decoder, client):
    openai_client, server = client
    call = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}
    messages = [{"role": "user", "content": "what is 2 + 3?"}, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "5"}]
    import httpx

    ids = httpx.post(server.url + "/tokenize", json={"messages": messages}).json()["tokens"]
    text = decoder.target.tokenizer.decode(ids)
    assert '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>' in text and "tool: 5" in text
    out = openai_client.chat.completions.create(model="tiny", messages=messages, tools=TOOLS, temperature=0,
                                                max_tokens=20)  # auto: whatever the model writes, parsed or content
    assert out.choices[0].finish_reason in ("stop", "length", "tool_calls")


@pytest.mark.parametrize("extra, param", [
    ({"tool_choice": "required"}, "tool_choice"),  # no tools
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [ADD, ADD]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": f"f{i}"}} for i in range(129)]}, "tools"),  # OpenAI's 128
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools.0.function.name"),
])
def test_bad_tool_requests_are_one_line(client, extra, param):
    import httpx

    _, server = client
    r = httpx.post(server.url + "/v1/chat/completions",
                   json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, **extra})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_a_template_without_a_tool_syntax_refuses_tools(tmp_path):
    from tiny_hf import save_tiny_model_dir
    import httpx

    decoder = SpeculativeDecoder.load(str(save_tiny_model_dir(tmp_path / "m", "llama", seed=0)), "none")
    with BackgroundServer(decoder, ServeConfig(port=0)) as server:
        r = httpx.post(server.url + "/v1/chat/completions",
                       json={"messages": [{"role": "user", "content": "hi"}], "tools": TOOLS, "max_tokens": 5})
    assert r.status_code == 400 and "no tool-call syntax" in r.json()["error"]["message"]


def test_the_call_grammar_names_the_tools():
    grammar = call_grammar(TOOLS, "add", parallel=True)
    assert '"const": "add"' in grammar and "get_weather" not in grammar and '~0..' not in grammar
    assert 'call ("\\n" call)~0..7' in call_grammar(TOOLS, None, parallel=True)
    auto = call_grammar(TOOLS, None, parallel=False, text_first=True)
    assert auto.startswith("start: TEXT? (call)?") and "~/(?s:.*)<tool_call>(?s:.*)/" in auto
    assert torch is not None


def test_an_agent_loop_with_two_tools_gets_a_plain_servers_answers_every_turn(decoder, tmp_path):
    """A small agent of our own: a calculator and a file reader, the model required to call a tool each turn, the
    tool answered, the conversation resent, for three turns; every turn's calls (and the final answer) equal those of
    a plain server (no drafter, no prefix reuse): speculation, the forced call text and the reused prefix change
    nothing."""
    (tmp_path / "notes.txt").write_text("the answer is 42")
    tools = [ADD, {"type": "function", "function": {"name": "read_file", "parameters": {
        "type": "object", "properties": {"path": {"enum": ["notes.txt"]}}, "required": ["path"],
        "additionalProperties": False}}}]

    def run_tool(name, arguments):
        if name == "add":
            return str(arguments["a"] + arguments["b"])
        return (tmp_path / arguments["path"]).read_text()

    def agent(url):
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
        messages, seen = [{"role": "user", "content": "read notes.txt and add 1 to the answer"}], []
        for turn in range(3):
            out = client.chat.completions.create(model="tiny", messages=messages, tools=tools, temperature=0,
                                                 max_tokens=200, tool_choice="required", parallel_tool_calls=False)
            calls = out.choices[0].message.tool_calls
            seen.append([(c.function.name, c.function.arguments) for c in calls])
            messages.append({"role": "assistant", "content": None, "tool_calls": [c.model_dump() for c in calls]})
            messages += [{"role": "tool", "tool_call_id": c.id,
                          "content": run_tool(c.function.name, json.loads(c.function.arguments))} for c in calls]
        final = client.chat.completions.create(model="tiny", messages=messages, tools=tools, temperature=0,
                                               max_tokens=30, tool_choice="none")
        return seen, final.choices[0].message.content

    with BackgroundServer(decoder, ServeConfig(port=0, served_model_name="tiny")) as fast:
        speculative = agent(fast.url)
    plain = SpeculativeDecoder(decoder.target, "none")
    with BackgroundServer(plain, ServeConfig(port=0, served_model_name="tiny", prefix_cache_bytes=0)) as slow:
        reference = agent(slow.url)
    assert speculative == reference
    assert all(len(calls) == 1 for calls in speculative[0])
