"""OpenAI tool calling over the model's own tool-call syntax: the tools and the calls in the history rendered by its
chat template, the answer's calls parsed back into `tool_calls`, and, where the request requires a call, the call
constrained by the tools' JSON schemas under exact speculation (the structured-output path: `Constraint("grammar")`).

Syntax: the Hermes format, which Qwen2.5 / Qwen3 and Hermes models write and their templates render: each call is
`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, several one after another (separated by a newline).
A template that does not render `<tool_call>` has no syntax verispec parses; a request with tools is then refused.

`tool_choice`: "none" (tools shown, nothing parsed), "auto" (free text, then, where the model opens a call, calls of
any tool, each valid against its tool's parameters: the text is free, the calls are constrained as required ones are),
"required" (one call or more, of any tool, nothing around them) or {"type": "function", "function": {"name": N}} (one
call of N). `parallel_tool_calls` false: one call at most.
"""

from __future__ import annotations

import json
import re
import uuid

OPEN, CLOSE = "<tool_call>", "</tool_call>"
MAX_CALLS = 8  # calls one required answer may hold (a bound: the grammar ends, and the answer with it)
JSON_SEPARATORS = {"separators": (", ", ": ")}  # as verispec's JSON constraints write it (`constraints.JSON_OPTIONS`)


def has_tool_syntax(tokenizer) -> bool:
    """Whether the chat template renders Hermes tool calls (the syntax `parse_calls` reads)."""
    template = getattr(tokenizer, "chat_template", None) or ""
    return isinstance(template, str) and OPEN in template


def call_schema(tool: dict) -> dict:
    """The JSON schema of one call of `tool` ({"type": "function", "function": {...}}): its name and arguments."""
    function = tool["function"]
    parameters = function.get("parameters") or {"type": "object"}
    return {"type": "object", "properties": {"name": {"const": function["name"]}, "arguments": parameters},
            "required": ["name", "arguments"], "additionalProperties": False}


def markers(tokenizer) -> tuple[str, str]:
    """The call markers as the grammar writes them: as tokens (`<tool_call>`) where the tokenizer has them as tokens
    of their own (Qwen's added tokens: llguidance lets only that token write their text), else as quoted text."""
    added = {str(t) for t in getattr(tokenizer, "added_tokens_decoder", {}).values()}
    return tuple(m if m in added else json.dumps(m) for m in (OPEN, CLOSE))


def call_grammar(tools: list[dict], name: str | None, parallel: bool, marks: tuple[str, str] | None = None,
                 text_first: bool = False) -> str:
    """A Lark grammar (llguidance's, with `%json`) for the answer: one call of the named tool, or one call (up to
    MAX_CALLS where `parallel`) of any tool, nothing around them; `text_first` (tool_choice "auto"): free text (any
    text without the opening marker), then no call or the calls, nothing after them."""
    chosen = [t for t in tools if name is None or t["function"]["name"] == name]
    schema = call_schema(chosen[0]) if len(chosen) == 1 else {"anyOf": [call_schema(t) for t in chosen]}
    # JSON written as verispec's JSON constraints write it: fixed separators, no free whitespace (a model cannot
    # spend the answer on blanks)
    schema = {**schema, "x-guidance": {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}}
    calls = f'call ("\\n" call)~0..{MAX_CALLS - 1}' if parallel and name is None else "call"
    opening, closing = marks or (json.dumps(OPEN), json.dumps(CLOSE))
    start = f"start: {calls}\n"
    if text_first:  # the text may not hold the marker's text (where the marker is text, not a token of its own)
        start = (f"start: TEXT? ({calls})?\n"
                 f"TEXT: /(?s:.+)/ & ~/(?s:.*){re.escape(OPEN)}(?s:.*)/\n")
    return (start +
            f'call: {opening} "\\n" body "\\n" {closing}\n'
            f"body: %json {json.dumps(schema)}\n")


# a call's head as the grammar writes it (`call_schema`'s order, `JSON_SEPARATORS`): its arguments follow
HEAD = re.compile(r'\s*\{"name": ("(?:[^"\\]|\\.)*"), "arguments": ')


def new_call(name: str, arguments: str, call_id: str | None = None) -> dict:
    """An OpenAI tool call, with `call_id` (one already sent) or a fresh id."""
    return {"id": call_id or f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": arguments}}


def call_head(text: str, at: int) -> tuple[str, int] | None:
    """(name, where the arguments begin) of a call whose body begins at `at` (after the opening marker), where its
    head is written whole in the grammar's form; else None."""
    match = HEAD.match(text, at)
    if match is None:
        return None
    try:
        name = json.loads(match.group(1))
    except json.JSONDecodeError:
        return None
    return name, match.end()


def raw_arguments(text: str, start: int, end: int) -> str:
    """The arguments as the model wrote them: the text from `start` to the closing marker at `end`, less the call's
    own closing brace (and the blank before the marker)."""
    raw = text[start:end].rstrip()
    return raw[:-1] if raw.endswith("}") else raw


def parse_calls(text: str, cut: bool = False) -> tuple[str | None, list[dict]]:
    """The answer's text before its first call (None if empty) and its calls as OpenAI `tool_calls`, each call's
    arguments as the model wrote them (where its head is in the grammar's form; else its arguments written again as
    JSON). A call whose JSON cannot be read, or has no name, ends the parse: it and what follows stay in the content.
    `cut` (the answer ended at its length, or a stop string): a last call left open whose head is written whole is a
    call too, with the arguments written so far (as OpenAI reports a cut call)."""
    start = text.find(OPEN)
    if start < 0:
        return text, []
    calls, at = [], start
    while at >= 0:
        end = text.find(CLOSE, at)
        if end < 0:
            head = call_head(text, at + len(OPEN)) if cut else None
            if head is not None:
                calls.append(new_call(head[0], text[head[1] :]))
            break
        try:
            body = json.loads(text[at + len(OPEN) : end])
        except json.JSONDecodeError:
            break
        if not isinstance(body, dict) or not isinstance(body.get("name"), str):
            break
        head = call_head(text, at + len(OPEN))
        if head is not None and head[0] == body["name"]:
            arguments = raw_arguments(text, head[1], end)
        else:
            arguments = body.get("arguments", body.get("parameters", {}))
            arguments = arguments if isinstance(arguments, str) else json.dumps(arguments, **JSON_SEPARATORS)
        calls.append(new_call(body["name"], arguments))
        at = text.find(OPEN, end + len(CLOSE))
    if not calls:
        return text, []
    content = text[:start].strip()
    return content or None, calls


def template_message(message: dict) -> dict:
    """An OpenAI message as chat templates take it: an assistant's calls with their arguments as objects (templates
    write them with `tojson`), a tool's answer with its call id."""
    out = {"role": message["role"], "content": message.get("content") or ""}
    if message.get("tool_calls"):
        calls = []
        for call in message["tool_calls"]:
            arguments = call["function"]["arguments"]
            try:
                arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
            except json.JSONDecodeError:
                pass  # the template writes the string as it is
            calls.append({"type": "function", "id": call.get("id"),
                          "function": {"name": call["function"]["name"], "arguments": arguments}})
        out["tool_calls"] = calls
    if message.get("tool_call_id"):
        out["tool_call_id"] = message["tool_call_id"]
    if message.get("name"):
        out["name"] = message["name"]
    return out
