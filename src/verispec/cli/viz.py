"""`verispec viz`: serve the interactive visualizer."""

from __future__ import annotations

import argparse

from verispec.cli.options import API_KEY_ENV, add_model_options, load_decoder


def add_parser(sub) -> None:
    v = sub.add_parser("viz", help="serve the interactive visualizer (live decoding, losslessness demo, speedup calculator)")
    add_model_options(v)
    v.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    v.add_argument("--port", type=int, default=8765, help="port (default: %(default)s)")
    v.add_argument("--no-browser", action="store_true", help="do not open the default browser")
    v.add_argument("--api-key", help=f"require 'Authorization: Bearer <key>' on the API (the pages send it from the URL's "
                   f"#key=...; default: ${API_KEY_ENV} if set, else none)")


def run(args: argparse.Namespace) -> int:
    from verispec.viz.server import serve

    import os

    api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    serve(load_decoder(args), args.host, args.port, open_browser=not args.no_browser, api_key=api_key)
    return 0
