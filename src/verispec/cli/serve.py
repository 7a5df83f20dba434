"""`verispec serve`: the OpenAI-compatible HTTP API with continuous batched speculation."""

from __future__ import annotations

import argparse

from verispec.cli.options import API_KEY_ENV, SERVE_OPTIONS, add_model_options, build_config, default_of, load_decoder
from verispec.config import AdaptConfig, ServeConfig
from verispec.errors import VerispecError


def add_parser(sub) -> None:
    s = sub.add_parser("serve", help="serve an OpenAI-compatible HTTP API with continuous batched speculation")
    add_model_options(s)
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
    s.add_argument("--adapt", action="store_true",
                   help="online adaptation: the drafter learns from verification between requests, in the background")


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
    decoder = load_decoder(args)
    if args.adapt:
        decoder.enable_adaptation(AdaptConfig())
    run_server(decoder, config)
    return 0
