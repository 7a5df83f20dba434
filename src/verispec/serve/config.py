"""`ServeConfig`: where the server listens and the limits that keep it safe, beside the server that reads it.

Each field that `verispec serve` sets carries its command-line option in its metadata (`config.option`): the CLI
generates its options from these fields (`cli.options.add_config_options`), so a limit is named, typed, explained
and defaulted here once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

from verispec.config import PREFIX_CACHE_BYTES, ConstraintLimits, is_count, option
from verispec.errors import VerispecError


def names_from_text(text: str) -> tuple[str, ...]:
    """"a, b,c" -> ("a", "b", "c") (empty names dropped)."""
    return tuple(name.strip() for name in text.split(",") if name.strip())


def limits_from_text(text: str) -> ConstraintLimits:
    """NAME=VALUE,... -> ConstraintLimits; an unknown name or a bad value is one line (VerispecError)."""
    known = {f.name: f.type for f in fields(ConstraintLimits)}
    values = {}
    for item in names_from_text(text):
        name, _, value = item.partition("=")
        if name not in known:
            raise VerispecError(f"unknown constraint limit '{name}' (known: {', '.join(known)})")
        try:
            values[name] = float(value) if known[name] == "float" else int(value)
        except ValueError:
            raise VerispecError(f"constraint limit {name} takes a number, got '{value}'") from None
    return ConstraintLimits(**values)


@dataclass(frozen=True)
class ServeConfig:
    """`verispec serve`: where the server listens and the limits that keep it safe.

    Attributes:
        host: interface to bind; the default serves this machine only. Default "127.0.0.1".
        port: TCP port. Default 8000.
        api_key: if set, every /v1 and /metrics request needs `Authorization: Bearer <api_key>`.
        api_keys: more keys, each "KEY" or "NAME:KEY" (NAME: letters, digits, '_', '.', '-'); each key is a tenant,
            known by its name (never the key: `serve.tenants`). Default none.
        key_share: with two keys or more, the most of the batch's rows, of the queue and of the cache budget one key
            may hold at once, so that a flood from one key leaves room for the others. Default 0.75.
        suffix_scope: whose earlier outputs the suffix drafter drafts from: "shared" (every client's) or "key"
            (each key's own; rows of no key share one store). None: "key" when keys are set, else "shared".
        allowed_hosts: with no key, the Host (and any Origin) a request may name; a web page cannot then drive a
            local server through DNS rebinding. Always allowed: localhost, loopback addresses and the bound host.
            "*" allows any. Default none more.
        constraint_limits: what a structured-output constraint may cost (`ConstraintLimits`): its size and the
            chains its compiler would follow, checked before compiling (400 past them); its compile time; its mask
            work per step.
        compile_workers: threads that compile constraints (each with a stack the bounds leave far from full); a
            request waits for one, and gets a 503 when more than max_queue wait. Default 1.
        prefix_cache_bytes: the target cache of finished requests (and of prompts just read) kept by their token
            ids, least recently used out first, so that a request whose prompt begins as an earlier one's (a
            conversation's next turn, a shared system prompt) reads only the rest (`verispec.core.prefix`; the native
            runner, where a reused position is the same bits). 0 turns it off. Default 1 GiB.
        max_n: the most choices (`n`) one request may ask for; each is a sequence of its own, seeded `seed + i`,
            admitted (queue place, cache reservation) as a request is. Default 8.
        served_model_name: the model id clients name (None: the target's name).
        max_batch_size: sequences decoded together; 1 turns continuous batching off. Default 8.
        max_queue: requests waiting for a batch slot; more get HTTP 429. Default 64.
        request_timeout: seconds from arrival to the last token before a request is cut. Default 300.
        max_body_bytes: largest request body; larger gets HTTP 413. Default 1 MiB.
        max_prompt_tokens: longest prompt in tokens (None: the context window less one token).
        max_tokens_limit: largest max_tokens a request may ask (None: up to the context window).
        max_draft_tokens: largest per-request K (`speculative.K`), and deepest tree. Default 16.
        max_tree_nodes: most nodes a request's draft tree (`speculative.tree`) may have. Default 64.
        shutdown_timeout: seconds in-flight requests get to finish on shutdown before being cut. Default 10.
        max_stop_strings: most stop strings a request may send (OpenAI's limit). Default 4.
        max_stop_length: longest stop string, in characters. Default 128.
        max_request_tokens: most tokens one request may hold, prompt plus max_tokens (None: the context window).
        max_cache_bytes: key/value cache the running requests may hold together, reserved at admission for each
            request's prompt plus max_tokens; a request that would not fit waits in the queue, one that could
            never fit is refused (400). None: a quarter of this machine's memory.
        prefill_chunk: prompt tokens a joining request reads per step, so a long prompt is read over several
            steps interleaved with the other rows' decoding instead of stalling them. Default 64 (measured with
            the default target: a 1,500-token prompt arriving beside three decoding streams made them wait at
            most 0.7 s between tokens, against 16 s when read in one step, and got its own first token sooner).
        send_timeout: seconds a streamed chunk may wait for a client that reads nothing before the request is
            cut. Default 30.
        limit_concurrency: open connections and requests at once; more get HTTP 503. Default 128.
        timeout_keep_alive: seconds an idle keep-alive connection stays open. Default 5.
        header_timeout: seconds a client has to send a request's headers before its connection is closed
            (clients that trickle headers byte by byte hold no connection for long). Default 10.
        body_timeout: seconds a client has to send a request's body once its headers arrived. Default 30.
        auto_k: choose K every step from costs measured while serving (`tuning.KTuner`), for the batch's rows
            together: the pass over every row's drafts against the plain pass over the rows, so speculation
            shrinks, then stops, as concurrency fills the machine, and returns as it falls. A request that names
            its K or a tree keeps it (a seeded sampled request's draws follow K: naming K keeps its tokens the same
            alone or batched). Default True (measured with the 0.5B draft at 8 clients: 40.3 tok/s against 26.1 with
            each request's fixed K; plain decoding 42.8).
    """

    host: str = option("127.0.0.1", "interface to bind", default_text="127.0.0.1, this machine only")
    port: int = option(8000, "TCP port")
    api_key: str | None = option(None, "require 'Authorization: Bearer <key>'",
                                 default_text="$VERISPEC_API_KEY if set, else none")
    served_model_name: str | None = option(None, "the model id clients send", default_text="the target's name")
    max_batch_size: int = option(8, "sequences decoded together, 1 turns batching off")
    max_queue: int = option(64, "waiting requests before HTTP 429")
    request_timeout: float = option(300.0, "seconds before a request is cut")
    max_body_bytes: int = option(1 << 20, "largest request body in bytes")
    max_prompt_tokens: int | None = option(None, "longest prompt in tokens", default_text="the context window less one")
    max_tokens_limit: int | None = option(None, "largest max_tokens a request may ask", default_text="the context window")
    max_draft_tokens: int = option(16, "largest per-request speculative.K")
    max_tree_nodes: int = option(64, "most nodes of a per-request speculative.tree")
    shutdown_timeout: float = option(10.0, "seconds in-flight requests get on shutdown")
    max_stop_strings: int = option(4, "most stop strings per request")
    max_stop_length: int = option(128, "longest stop string in characters")
    max_request_tokens: int | None = option(None, "most prompt + max_tokens per request", default_text="the context window")
    max_cache_bytes: int | None = option(None, "key/value cache the running requests may reserve together; requests "
                                         "that do not fit wait", default_text="a quarter of this machine's memory")
    prefill_chunk: int = option(64, "prompt tokens a joining request reads per step, interleaved with the others' "
                                "decoding")
    send_timeout: float = option(30.0, "seconds a stream waits for a client that reads nothing")
    limit_concurrency: int = option(128, "open connections and requests before HTTP 503")
    timeout_keep_alive: float = option(5.0, "seconds an idle keep-alive connection stays open")
    header_timeout: float = option(10.0, "seconds a client has to send its headers")
    body_timeout: float = option(30.0, "seconds a client has to send its body")
    auto_k: bool = option(True, "choose K every step from costs measured while serving, for the whole batch: "
                          "speculation shrinks, then stops, as concurrency rises, and returns as it falls; a request "
                          "naming its K keeps it", switch=True)
    api_keys: tuple[str, ...] = ()  # the CLI reads them from --api-keys-file
    key_share: float = option(0.75, "with two keys or more, the most of the rows, queue and cache one key may hold "
                              "at once")
    suffix_scope: str | None = option(None, "whose earlier outputs suffix decoding drafts from: every client's, or "
                                      "each API key's own", choices=("shared", "key"),
                                      default_text="key when API keys are set, else shared")
    allowed_hosts: tuple[str, ...] = option((), "with no API key, host names (besides IP addresses and localhost) a "
                                            "request's Host and Origin may name; '*' allows any",
                                            parse=names_from_text, metavar="NAME[,NAME...]", default_text="none")
    constraint_limits: ConstraintLimits = option(
        ConstraintLimits(), "bounds on structured-output constraints, e.g. max_depth=64,compile_seconds=5 (fields of "
        "ConstraintLimits: " + ", ".join(f"{f.name}={f.default}" for f in fields(ConstraintLimits)) + ")",
        parse=limits_from_text, metavar="NAME=VALUE[,...]", default_text="the values listed")
    compile_workers: int = option(1, "threads compiling constraints")
    max_n: int = option(8, "most choices (n) one request may ask for")
    prefix_cache_bytes: int = option(PREFIX_CACHE_BYTES, "target cache of finished requests kept by their tokens, so "
                                     "a request that begins as an earlier one did reads only the rest; 0 turns it off",
                                     default_text="1 GiB")

    def __post_init__(self) -> None:
        if not (0 <= self.port <= 65535):
            raise VerispecError(f"port must be in 0..65535, got {self.port}")
        if self.api_key is not None and not self.api_key.strip():
            raise VerispecError("the API key is empty")
        for name in ("max_batch_size", "max_queue", "max_body_bytes", "max_draft_tokens", "max_tree_nodes",
                     "max_stop_strings", "max_stop_length", "prefill_chunk", "limit_concurrency", "compile_workers",
                     "max_n"):
            if not is_count(getattr(self, name), 1):
                raise VerispecError(f"{name} must be an integer >= 1, got {getattr(self, name)}")
        for name in ("max_prompt_tokens", "max_tokens_limit", "max_request_tokens", "max_cache_bytes"):
            if getattr(self, name) is not None and not is_count(getattr(self, name), 1):
                raise VerispecError(f"{name} must be an integer >= 1, got {getattr(self, name)}")
        for name in ("request_timeout", "shutdown_timeout", "send_timeout", "timeout_keep_alive", "header_timeout",
                     "body_timeout"):
            if not math.isfinite(getattr(self, name)) or getattr(self, name) <= 0:
                raise VerispecError(f"{name} must be a positive number of seconds, got {getattr(self, name)}")
        if not (isinstance(self.key_share, (int, float)) and 0 < self.key_share <= 1):
            raise VerispecError(f"key_share must be in (0, 1], got {self.key_share}")
        if self.suffix_scope not in (None, "shared", "key"):
            raise VerispecError(f"suffix_scope is 'shared' or 'key', got '{self.suffix_scope}'")
        if not is_count(self.prefix_cache_bytes, 0):
            raise VerispecError(f"prefix_cache_bytes must be an integer >= 0, got {self.prefix_cache_bytes}")
        if not isinstance(self.constraint_limits, ConstraintLimits):
            raise VerispecError("constraint_limits must be a ConstraintLimits")
        if isinstance(self.api_keys, str) or isinstance(self.allowed_hosts, str):
            raise VerispecError("api_keys and allowed_hosts are tuples of strings")

    @property
    def keys(self) -> tuple[str, ...]:
        """Every API key entry (`api_key` first)."""
        return ((self.api_key,) if self.api_key else ()) + tuple(self.api_keys)

    @property
    def scope_by_key(self) -> bool:
        """Whether the suffix store keeps each key's outputs apart (`suffix_scope`, or keys set and no choice)."""
        return self.suffix_scope == "key" or (self.suffix_scope is None and bool(self.keys))


