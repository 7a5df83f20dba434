"""`verispec serve`: the OpenAI-compatible HTTP API with continuous batched speculation."""

from __future__ import annotations

import argparse
import dataclasses

from verispec.cli.options import (API_KEY_ENV, SERVE_OPTIONS, add_model_options, build_config, decoder_kwargs, default_of,
                                  load_decoder)
from verispec.config import AdaptConfig, ConstraintLimits, ServeConfig
from verispec.errors import VerispecError
from verispec.models.registry import DEFAULT_DRAFTER


def add_parser(sub) -> None:
    s = sub.add_parser("serve", help="serve an OpenAI-compatible HTTP API with continuous batched speculation")
    add_model_options(s, DEFAULT_DRAFTER)
    s.add_argument("--host", help=f"interface to bind (default: {default_of(ServeConfig, 'host')}, this machine only)")
    s.add_argument("--port", type=int, help=f"(default: {default_of(ServeConfig, 'port')})")
    s.add_argument("--api-key", help=f"require 'Authorization: Bearer <key>' (default: ${API_KEY_ENV} if set, else none)")
    s.add_argument("--api-keys-file", metavar="FILE",
                   help="more API keys, one per line, each KEY or NAME:KEY ('#' starts a comment); each key is a tenant "
                        "with its own share of the server (--key-share) and, by default, its own suffix store")
    s.add_argument("--key-share", type=float,
                   help=f"with two keys or more, the most of the rows, queue and cache one key may hold at once "
                        f"(default: {default_of(ServeConfig, 'key_share')})")
    s.add_argument("--suffix-scope", choices=("shared", "key"),
                   help="whose earlier outputs suffix decoding drafts from: every client's, or each API key's own "
                        "(default: key when API keys are set, else shared)")
    s.add_argument("--allowed-hosts", type=_names, metavar="NAME[,NAME...]",
                   help="with no API key, host names (besides IP addresses and localhost) a request's Host and Origin "
                        "may name; '*' allows any (default: none)")
    s.add_argument("--constraint-limits", type=_limits, metavar="NAME=VALUE[,...]",
                   help="bounds on structured-output constraints, e.g. max_depth=64,compile_seconds=5 (fields of "
                        "ConstraintLimits: " + ", ".join(f"{f.name}={f.default}" for f in dataclasses.fields(ConstraintLimits)) + ")")
    s.add_argument("--compile-workers", type=int,
                   help=f"threads compiling constraints (default: {default_of(ServeConfig, 'compile_workers')})")
    s.add_argument("--served-model-name", help="the model id clients send (default: the target's name)")
    s.add_argument("--max-batch-size", type=int,
                   help=f"sequences decoded together, 1 turns batching off (default: {default_of(ServeConfig, 'max_batch_size')})")
    s.add_argument("--max-queue", type=int, help=f"waiting requests before HTTP 429 (default: {default_of(ServeConfig, 'max_queue')})")
    s.add_argument("--request-timeout", type=float,
                   help=f"seconds before a request is cut (default: {default_of(ServeConfig, 'request_timeout')})")
    s.add_argument("--max-body-bytes", type=int, help=f"(default: {default_of(ServeConfig, 'max_body_bytes')})")
    s.add_argument("--max-prompt-tokens", type=int, help="(default: the context window less one)")
    s.add_argument("--max-tokens-limit", type=int, help="largest max_tokens a request may ask (default: the context window)")
    s.add_argument("--max-draft-tokens", type=int,
                   help=f"largest per-request speculative.K (default: {default_of(ServeConfig, 'max_draft_tokens')})")
    s.add_argument("--max-tree-nodes", type=int,
                   help=f"most nodes of a per-request speculative.tree (default: {default_of(ServeConfig, 'max_tree_nodes')})")
    s.add_argument("--shutdown-timeout", type=float,
                   help=f"seconds in-flight requests get on shutdown (default: {default_of(ServeConfig, 'shutdown_timeout')})")
    s.add_argument("--max-stop-strings", type=int,
                   help=f"most stop strings per request (default: {default_of(ServeConfig, 'max_stop_strings')})")
    s.add_argument("--max-stop-length", type=int,
                   help=f"longest stop string in characters (default: {default_of(ServeConfig, 'max_stop_length')})")
    s.add_argument("--max-request-tokens", type=int, help="most prompt + max_tokens per request (default: the context window)")
    s.add_argument("--max-cache-bytes", type=int,
                   help="key/value cache the running requests may reserve together; requests that do not fit wait "
                        "(default: a quarter of this machine's memory)")
    s.add_argument("--prefill-chunk", type=int,
                   help=f"prompt tokens a joining request reads per step, interleaved with the others' decoding "
                        f"(default: {default_of(ServeConfig, 'prefill_chunk')})")
    s.add_argument("--send-timeout", type=float,
                   help=f"seconds a stream waits for a client that reads nothing (default: {default_of(ServeConfig, 'send_timeout')})")
    s.add_argument("--limit-concurrency", type=int,
                   help=f"open connections and requests before HTTP 503 (default: {default_of(ServeConfig, 'limit_concurrency')})")
    s.add_argument("--timeout-keep-alive", type=float,
                   help=f"seconds an idle keep-alive connection stays open (default: {default_of(ServeConfig, 'timeout_keep_alive')})")
    s.add_argument("--header-timeout", type=float,
                   help=f"seconds a client has to send its headers (default: {default_of(ServeConfig, 'header_timeout')})")
    s.add_argument("--body-timeout", type=float,
                   help=f"seconds a client has to send its body (default: {default_of(ServeConfig, 'body_timeout')})")
    s.add_argument("--auto-k", action=argparse.BooleanOptionalAction, default=None,
                   help="choose K every step from costs measured while serving, for the whole batch: speculation "
                        "shrinks, then stops, as concurrency rises, and returns as it falls; a request naming its K "
                        f"keeps it (default: {'on' if default_of(ServeConfig, 'auto_k') else 'off'})")
    s.add_argument("--adapt", action="store_true",
                   help="online adaptation: the drafter learns from verification between requests, in the background")
    r = s.add_argument_group("scale-out on Ray Serve (pip install 'verispec[ray]')")
    r.add_argument("--ray", action="store_true", help="serve N replicas of this app under Ray Serve, each loading its "
                   "own models and batching its own requests, behind Ray's proxy on --host:--port")
    r.add_argument("--replicas", type=int, default=2, help="replicas (default: %(default)s)")
    r.add_argument("--ray-address", help="join a running Ray cluster ('auto', or HOST:6379; default: start Ray here)")
    r.add_argument("--autoscale", metavar="MIN,MAX", help="let Ray scale the replicas between MIN and MAX "
                   "(target ongoing requests per replica: --max-batch-size) instead of a fixed --replicas")
    r.add_argument("--cpus-per-replica", type=float, default=1.0, help="CPUs Ray reserves per replica (default: %(default)s)")


def run(args: argparse.Namespace) -> int:
    import os

    try:
        from verispec.serve.server import run_server
    except ImportError as err:
        raise VerispecError(f"verispec serve needs the 'serve' extra (pip install 'verispec[serve]'): {err}") from None

    if args.api_key is None:
        args.api_key = os.environ.get(API_KEY_ENV) or None
    args.api_keys = _read_keys(args.api_keys_file) if args.api_keys_file else None
    config = build_config(ServeConfig, args, SERVE_OPTIONS)
    if args.backend == "llama.cpp" and config.max_batch_size != 1:
        raise VerispecError("the llama.cpp backend decodes one sequence at a time: add --max-batch-size 1")
    if args.ray:
        return _run_on_ray(args, config)
    decoder = load_decoder(args, suffix_scope="key" if config.scope_by_key else "shared")
    if args.adapt:
        decoder.enable_adaptation(AdaptConfig())
    run_server(decoder, config)
    return 0


def _names(text: str) -> tuple[str, ...]:
    return tuple(name.strip() for name in text.split(",") if name.strip())


def _limits(text: str) -> ConstraintLimits:
    """NAME=VALUE,... -> ConstraintLimits (an unknown name or a bad value is one line)."""
    fields = {f.name: f.type for f in dataclasses.fields(ConstraintLimits)}
    values = {}
    for item in _names(text):
        name, _, value = item.partition("=")
        if name not in fields:
            raise argparse.ArgumentTypeError(f"unknown constraint limit '{name}' (known: {', '.join(fields)})")
        try:
            values[name] = float(value) if fields[name] == "float" else int(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"constraint limit {name} takes a number, got '{value}'") from None
    try:
        return ConstraintLimits(**values)
    except VerispecError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _read_keys(path: str) -> tuple[str, ...]:
    """The keys of an --api-keys-file: one per line, comments and blank lines skipped."""
    try:
        lines = open(path, encoding="utf-8").read().splitlines()
    except (OSError, UnicodeDecodeError) as err:
        raise VerispecError(f"cannot read --api-keys-file {path}: {err}") from None
    keys = tuple(line.strip() for line in lines if line.strip() and not line.strip().startswith("#"))
    if not keys:
        raise VerispecError(f"--api-keys-file {path} holds no key")
    return keys


def _run_on_ray(args: argparse.Namespace, config: ServeConfig) -> int:
    from verispec.serve import ray_serve

    autoscaling = None
    if args.autoscale:
        try:
            low, high = (int(x) for x in args.autoscale.split(","))
        except ValueError:
            raise VerispecError(f"--autoscale takes MIN,MAX replica counts, got '{args.autoscale}'") from None
        if not 1 <= low <= high:
            raise VerispecError(f"--autoscale needs 1 <= MIN <= MAX, got {low},{high}")
        autoscaling = {"min_replicas": low, "max_replicas": high, "target_ongoing_requests": config.max_batch_size}
    kwargs = decoder_kwargs(args, "key" if config.scope_by_key else "shared")
    ray_serve.run(kwargs, config, args.replicas, args.ray_address, args.adapt, args.threads,
                  autoscaling, args.cpus_per_replica, blocking=True)
    return 0
