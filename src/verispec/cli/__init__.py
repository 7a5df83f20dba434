"""`verispec` command line: one module per command (generate, replay, analyze, viz, audit, bench, serve, ngram build,
fetch, models) beside the training pipelines' own (distill, self-tune, train-heads); `cli.options` holds what they
share. The CLI only builds the frozen configs: every default lives in `verispec.config` or `verispec.models.registry`.
"""

from __future__ import annotations

import argparse
import sys

from verispec.cli import analyze, audit, bench, fetch, generate, models, ngram, replay, serve, viz
from verispec.errors import VerispecError

COMMANDS = {"generate": generate, "replay": replay, "analyze": analyze, "viz": viz, "audit": audit, "bench": bench,
            "serve": serve, "ngram": ngram, "fetch": fetch, "models": models}


def build_parser() -> argparse.ArgumentParser:
    from verispec.distill import cli as distill_cli
    from verispec.heads import cli as heads_cli
    from verispec.selfspec import cli as selfspec_cli

    parser = argparse.ArgumentParser(prog="verispec", description="Exact (lossless) speculative decoding.")
    sub = parser.add_subparsers(dest="command", required=True)
    for module in COMMANDS.values():
        module.add_parser(sub)
    distill_cli.add_parser(sub)
    selfspec_cli.add_parser(sub)
    heads_cli.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    from verispec.distill import cli as distill_cli
    from verispec.heads import cli as heads_cli
    from verispec.selfspec import cli as selfspec_cli

    args = build_parser().parse_args(argv)
    handlers = {name: module.run for name, module in COMMANDS.items()}
    handlers.update({"distill": distill_cli.run, "self-tune": selfspec_cli.run, "train-heads": heads_cli.run})
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
