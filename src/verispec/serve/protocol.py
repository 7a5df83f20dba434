"""The OpenAI wire format: request models (validated by pydantic), errors and response bodies.

Unknown request fields are refused (400) rather than ignored, so a client never silently gets
something other than what it asked for. Fields left out keep verispec's own defaults
(`SamplingConfig`, `SpecConfig`): only the fields a client sets are passed on.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from verispec.config import MAX_LOGPROBS, MAX_TEMPERATURE, PENALTY_RANGE, Constraint, TreeConfig
from verispec.errors import VerispecError
from verispec.serve.tools import template_message
from verispec.stats import GenerationStats

TREE_FIELDS = ("shape", "budget", "top_k", "children")


class APIError(Exception):
    """An OpenAI-style error answer: {"error": {"message", "type", "param", "code"}} with an HTTP status.

    Its text may quote what the client sent; lone surrogates there (which JSON cannot encode as UTF-8) are written as
    escapes, so the answer can always be sent."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None) -> None:
        message = printable(message)
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def printable(text: str) -> str:
    """`text` with lone surrogates as backslash escapes (valid UTF-8 whatever a client sent)."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def public_drafter_name(name: str) -> str:
    """A drafter's (or a model's) name as clients see it: no file paths (`suffix:/srv/store.st` is "suffix", a model
    named by its file or folder is that file's or folder's name), so a response never tells a client where the server
    keeps its files."""
    parts = []
    for part in name.split("+"):
        kind, sep, _ = part.partition(":")
        if sep:
            parts.append(kind)
        elif "/" in part or "\\" in part:
            parts.append(part.replace("\\", "/").rstrip("/").rsplit("/", 1)[-1])
        else:
            parts.append(part)
    return "+".join(parts)


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class SpeculativeOptions(Strict):
    """Per-request speculation: `drafter` (the server's drafter, or "none" for plain decoding), `K`
    draft tokens per step, `tree` (tree speculation: {"shape": [3, 2, 1]} or {"budget": 16}, optionally
    with "top_k" and "children"; see `TreeConfig`, read by `tree_config`), `draft_stop` (chains stop
    early below this estimated chance that all their drafts are accepted; see `SpecConfig.draft_stop`)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    drafter: str | None = None
    K: int | None = Field(default=None, ge=1)
    tree: Any = None
    draft_stop: float | None = Field(default=None, ge=0.0, lt=1.0)


def tree_config(value: Any) -> TreeConfig | None:
    """`speculative.tree` as a TreeConfig (None or false: a chain); bad values are a 400 naming the field."""
    if value is None or value is False:
        return None
    if not isinstance(value, dict):
        raise APIError(400, 'speculative.tree takes an object like {"shape": [3, 2, 1]} or {"budget": 16}',
                       param="speculative.tree")
    unknown = sorted(set(value) - set(TREE_FIELDS))
    if unknown:
        raise APIError(400, f"unsupported field 'speculative.tree.{unknown[0]}' (known: {', '.join(TREE_FIELDS)})",
                       param="speculative.tree")
    try:
        return TreeConfig(**value)
    except (VerispecError, TypeError) as err:
        raise APIError(400, f"speculative.tree: {err}", param="speculative.tree") from None


class JsonSchemaFormat(Strict):
    """response_format.json_schema: OpenAI's {"name", "description", "schema", "strict"}. The schema is always
    enforced (strict or not): every answer is valid against it unless cut by max_tokens (finish_reason "length")."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    name: str = Field(default="response", max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(Strict):
    """Structured output: OpenAI's {"type": "text" | "json_object" | "json_schema"}, and verispec's own
    {"type": "regex", "regex": ...} and {"type": "grammar", "grammar": ...} (Lark, or llama.cpp's GBNF)."""

    type: Literal["text", "json_object", "json_schema", "regex", "grammar"]
    json_schema: JsonSchemaFormat | None = None
    regex: str | None = None
    grammar: str | None = None

    def constraint(self) -> Constraint | None:
        """The Constraint this format asks for (None for text); a missing or misplaced part is a 400."""
        given = {name for name in ("json_schema", "regex", "grammar") if getattr(self, name) is not None}
        wanted = {self.type} & {"json_schema", "regex", "grammar"}
        if given - wanted:
            raise APIError(400, f"response_format.{sorted(given - wanted)[0]} does not go with type '{self.type}'",
                           param="response_format")
        if self.type == "text":
            return None
        if self.type == "json_object":
            return Constraint("json_object")
        if self.type == "json_schema":
            if self.json_schema is None or self.json_schema.schema_ is None:
                raise APIError(400, "response_format type 'json_schema' needs json_schema.schema",
                               param="response_format")
            return Constraint("json_schema", json.dumps(self.json_schema.schema_))
        source = getattr(self, self.type)
        if source is None or not source.strip():
            raise APIError(400, f"response_format type '{self.type}' needs a non-empty '{self.type}'",
                           param="response_format")
        return Constraint(self.type, source)


class TextPart(Strict):
    type: Literal["text"]
    text: str


def content_text(content: str | list[TextPart] | None) -> str:
    """A message's (or a prediction's) content as one text: its text parts joined; "" for none."""
    if content is None:
        return ""
    return content if isinstance(content, str) else "".join(p.text for p in content)


class Prediction(Strict):
    """OpenAI's predicted output: {"type": "content", "content": text or text parts}, the text the answer is expected
    to repeat (the file being edited); drafted from while the answer follows it, exact either way."""

    type: Literal["content"]
    content: str | list[TextPart]

    def text(self) -> str:
        return content_text(self.content)


class StreamOptions(Strict):
    include_usage: bool = False


MAX_TOP_K = 2**31 - 1
MAX_LOGIT_BIAS = 300  # tokens one request may bias (OpenAI's limit)


class GenerationRequest(Strict):
    """Fields common to /v1/completions and /v1/chat/completions."""

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=MAX_TEMPERATURE)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0, le=MAX_TOP_K)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(default=None, ge=PENALTY_RANGE[0], le=PENALTY_RANGE[1])
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = Field(default=None, max_length=MAX_LOGIT_BIAS)
    seed: int | None = Field(default=None, ge=-(2**63), lt=2**64)
    stop: str | list[str] | None = None
    ignore_eos: bool = False  # vLLM's extension: decode past the end-of-sequence token (benchmarks)
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    speculative: SpeculativeOptions | None = None
    response_format: ResponseFormat | None = None
    prediction: Prediction | None = None
    logprobs_mode: Literal["raw", "processed"] | None = None  # verispec's: which distribution logprobs come from
    user: str | None = None

    def top_logprobs_asked(self) -> int | None:
        """How many alternatives each token's log-probabilities list (0: the token's alone), None: no logprobs."""
        return None

    def sampling_fields(self, vocab_size: int) -> dict:
        names = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")
        fields = {name: getattr(self, name) for name in names if getattr(self, name) is not None}
        if self.logit_bias:
            bias = {}
            for key, value in self.logit_bias.items():
                if not key.strip().isdigit() or not 0 <= int(key) < vocab_size:
                    raise APIError(400, f"logit_bias keys are token ids from 0 to {vocab_size - 1}, got '{key}'",
                                   param="logit_bias")
                if not -100.0 <= value <= 100.0:
                    raise APIError(400, f"logit_bias values are in [-100, 100], got {value}", param="logit_bias")
                bias[int(key)] = value
            fields["logit_bias"] = tuple(sorted(bias.items()))
        return fields

    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)


class CompletionRequest(GenerationRequest):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False

    def top_logprobs_asked(self) -> int | None:
        return self.logprobs


class CallFunction(Strict):
    name: str
    arguments: str


class ToolCall(Strict):
    """A call an assistant message made (in the history a client resends)."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: CallFunction


class ChatMessage(Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's calls
    tool_call_id: str | None = None  # a tool's answer: the call it answers

    def text(self) -> str:
        return content_text(self.content)

    def template_dict(self) -> dict:
        """The message as chat templates take it (`serve.tools.template_message`)."""
        return template_message({"role": self.role, "content": self.text(), "name": self.name,
                                 "tool_calls": [c.model_dump() for c in self.tool_calls] if self.tool_calls else None,
                                 "tool_call_id": self.tool_call_id})


class FunctionDef(Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(Strict):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(Strict):
    name: str


class NamedToolChoice(Strict):
    type: Literal["function"]
    function: NamedFunction


MAX_TOOLS = 128  # OpenAI's limit


class ChatRequest(GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    tools: list[Tool] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: Literal["auto", "none", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True

    def tool_dicts(self) -> list[dict] | None:
        return [t.model_dump(exclude_none=True) for t in self.tools] if self.tools else None

    def calls_parsed(self) -> bool:
        """Whether the answer's tool calls are parsed into `tool_calls` (tools given and tool_choice not "none")."""
        return bool(self.tools) and self.tool_choice != "none"

    def required_call(self) -> tuple[bool, str | None] | None:
        """(parallel, name) where the answer must be calls (tool_choice "required", or a named function: name),
        else None."""
        if not self.tools:
            return None
        if self.tool_choice == "required":
            return self.parallel_tool_calls, None
        if isinstance(self.tool_choice, NamedToolChoice):
            return False, self.tool_choice.function.name
        return None

    def top_logprobs_asked(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None


class TokenizeRequest(Strict):
    """/tokenize (vLLM's): a completion's `prompt` or a chat's `messages` (templated, as /v1/chat/completions does)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True


class DetokenizeRequest(Strict):
    model: str | None = None
    tokens: list[int]


# --- responses -----------------------------------------------------------------------------------
FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length"}


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, stats: GenerationStats, drafter: str) -> dict:
    """OpenAI usage plus `speculative`: how the tokens were produced (for n > 1, the choices' stats merged)."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": stats.new_tokens,
        "total_tokens": prompt_tokens + stats.new_tokens,
        "prompt_tokens_details": {"cached_tokens": stats.cached_tokens},
        "completion_tokens_details": {"reasoning_tokens": 0,
                                      "accepted_prediction_tokens": stats.accepted_prediction_tokens,
                                      "rejected_prediction_tokens": stats.rejected_prediction_tokens},
        "speculative": {"drafter": drafter, **stats.to_dict()},
    }


LOGPROB_FLOOR = -9999.0  # a log-probability of -inf (a token the processed distribution excludes), as OpenAI writes it


def _finite(value: float) -> float:
    return value if value > LOGPROB_FLOOR else LOGPROB_FLOOR


def chat_logprobs(entries, token_text) -> dict:
    """OpenAI's chat `logprobs` for TokenLogprob entries; token_text: id -> the token's text."""

    def one(token: int, logprob: float) -> dict:
        text = token_text(token)
        return {"token": text, "logprob": _finite(logprob), "bytes": list(text.encode("utf-8"))}

    return {"content": [{**one(e.token, e.logprob), "top_logprobs": [one(t, v) for t, v in e.top]} for e in entries],
            "refusal": None}


def completion_logprobs(entries, token_text, offset: int = 0, first: int | None = None) -> dict:
    """OpenAI's (legacy) completions `logprobs` for TokenLogprob entries, text offsets counted from `offset`; `first`:
    an echoed prompt's first token, which comes first with null log-probabilities (nothing precedes it)."""
    texts = ([] if first is None else [token_text(first)]) + [token_text(e.token) for e in entries]
    offsets, at = [], offset
    for text in texts:
        offsets.append(at)
        at += len(text)
    lead = [] if first is None else [None]
    return {"tokens": texts, "token_logprobs": lead + [_finite(e.logprob) for e in entries],
            "top_logprobs": lead + [{token_text(t): _finite(v) for t, v in e.top} for e in entries],
            "text_offset": offsets}


def completion_choice(index: int, text: str, finish: str, logprobs: dict | None = None) -> dict:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": FINISH_REASONS[finish]}


def chat_choice(index: int, text: str | None, finish: str, logprobs: dict | None = None,
                tool_calls: list[dict] | None = None) -> dict:
    message = {"role": "assistant", "content": text}
    if tool_calls:
        message["tool_calls"] = tool_calls
    return {"index": index, "message": message, "logprobs": logprobs,
            "finish_reason": "tool_calls" if tool_calls and finish in ("eos", "stop") else FINISH_REASONS[finish]}


def completion_body(rid: str, model: str, choices: list[dict], use: dict) -> dict:
    return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": choices, "usage": use}


def chat_body(rid: str, model: str, choices: list[dict], use: dict) -> dict:
    return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": choices, "usage": use}


def completion_chunk(rid: str, model: str, text: str | None, finish: str | None, use: dict | None = None,
                     logprobs: dict | None = None, index: int = 0) -> dict:
    choices = [] if text is None else [{"index": index, "text": text, "logprobs": logprobs,
                                        "finish_reason": FINISH_REASONS.get(finish) if finish else None}]
    return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": choices, "usage": use}


def chat_chunk(rid: str, model: str, delta: dict | None, finish: str | None, use: dict | None = None,
               logprobs: dict | None = None, index: int = 0) -> dict:
    reason = FINISH_REASONS.get(finish, finish) if finish else None  # "tool_calls" as it is
    choices = [] if delta is None else [{"index": index, "delta": delta, "logprobs": logprobs,
                                         "finish_reason": reason}]
    return {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()), "model": model,
            "choices": choices, "usage": use}
