"""`verispec serve`: the OpenAI-compatible HTTP API with continuous batched speculation."""

from __future__ import annotations

import argparse

from verispec.cli.options import (API_KEY_ENV, SERVE_OPTIONS, add_model_options, build_config, decoder_kwargs, default_of,
                                  load_decoder)
from verispec.config import AdaptConfig, ServeConfig
from verispec.errors import VerispecError
from verispec.models.registry import DEFAULT_DRAFTER


def add_parser(sub) -> None:
    s = sub.add_parser("serve", help="serve an OpenAI-compatible HTTP API with continuous batched speculation")
    add_model_options(s, DEFAULT_DRAFTER)
    s.add_argument("--host", help=f"interface to bind (default: {default_of(ServeConfig, 'host')}, this machine only)")
    s.add_argument("--port", type=int, help=f"(default: {default_of(ServeConfig, 'port')})")
    s.add_argument("--api-key", help=f"require 'Authorization: Bearer <key>' (default: ${API_KEY_ENV} if set, else none)")
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
    config = build_config(ServeConfig, args, SERVE_OPTIONS)
    if args.backend == "llama.cpp" and config.max_batch_size != 1:
        raise VerispecError("the llama.cpp backend decodes one sequence at a time: add --max-batch-size 1")
    if args.ray:
        return _run_on_ray(args, config)
    decoder = load_decoder(args)
    if args.adapt:
        decoder.enable_adaptation(AdaptConfig())
    run_server(decoder, config)
    return 0


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
    ray_serve.run(decoder_kwargs(args), config, args.replicas, args.ray_address, args.adapt, args.threads,
                  autoscaling, args.cpus_per_replica, blocking=True)
    return 0
