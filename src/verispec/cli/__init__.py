"""`verispec` command line: one module per command (generate, replay, analyze, viz, audit, bench, serve, ngram build,
fetch, models, and the training pipelines' distill, self-tune, collect, train-heads); `cli.options` holds what they share.
The CLI only builds the frozen configs: every default lives in `verispec.config` or `verispec.models.registry`.
"""

from __future__ import annotations

import argparse
import sys

from verispec.cli import (
    analyze,
    audit,
    bench,
    collect,
    distill,
    fetch,
    generate,
    models,
    ngram,
    replay,
    self_tune,
    serve,
    train_heads,
    viz,
)
from verispec.errors import VerispecError

COMMANDS = {"generate": generate, "replay": replay, "analyze": analyze, "viz": viz, "audit": audit, "bench": bench,
            "serve": serve, "ngram": ngram, "fetch": fetch, "models": models, "distill": distill, "self-tune": self_tune,
            "train-heads": train_heads, "collect": collect}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="verispec", description="Exact (lossless) speculative decoding.")
    sub = parser.add_subparsers(dest="command", required=True)
    for module in COMMANDS.values():
        module.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    handlers = {name: module.run for name, module in COMMANDS.items()}
    try:
        return handlers[args.command](args)
    except VerispecError as err:
        print(f"verispec: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("verispec: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
