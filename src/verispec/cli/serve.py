"""`verispec serve`: the OpenAI-compatible HTTP API with continuous batched speculation."""

from __future__ import annotations

import argparse

from verispec.cli.options import (API_KEY_ENV, SERVE_OPTIONS, add_config_options, add_model_options, build_config,
                                  decoder_kwargs, load_decoder)
from verispec.config import AdaptConfig
from verispec.serve.config import ServeConfig
from verispec.errors import VerispecError
from verispec.models.registry import DEFAULT_DRAFTER


def add_parser(sub) -> None:
    s = sub.add_parser("serve", help="serve an OpenAI-compatible HTTP API with continuous batched speculation")
    add_model_options(s, DEFAULT_DRAFTER)
    add_config_options(s, ServeConfig)  # every server setting, from its field (serve.config)
    s.add_argument("--api-keys-file", metavar="FILE",
                   help="more API keys, one per line, each KEY or NAME:KEY ('#' starts a comment); each key is a tenant "
                        "with its own share of the server (--key-share) and, by default, its own suffix store")
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
