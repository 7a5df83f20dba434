"""`verispec replay`: re-play a trace saved by `generate --trace` step by step."""

from __future__ import annotations

import argparse
import time
from pathlib import Path




def add_parser(sub) -> None:
    r = sub.add_parser("replay", help="re-play a trace saved by `generate --trace` step by step")
    r.add_argument("file", type=Path, help="the trace JSON")
    r.add_argument("--delay", type=float, default=0.15, help="seconds between steps (default: %(default)s)")
    r.add_argument("--details", action="store_true", help="also print each draft token's p, q, min(1, p/q), u and verdict "
                   "(for a tree: the accepted path and every tried node)")
    r.add_argument("--no-color", action="store_true", help="plain text output")


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from verispec.render import legend, print_pieces, result_from_dict, stats_table, step_details, tree_summary
    from verispec.trace import load_trace

    document = load_trace(args.file)
    console = Console(no_color=args.no_color, highlight=False)
    plain = document["draft"] == "none"
    console.print(legend(plain))
    tree = (document.get("spec") or {}).get("tree")
    if tree:
        console.print(tree_summary(tree, document["spec"].get("num_draft_tokens")))
    for step in document["steps"]:
        if args.details:
            console.print(step_details(step))
        print_pieces(console, [tuple(p) for p in step.get("pieces", [])])
        if args.details:
            console.print()
        time.sleep(max(0.0, args.delay))
    console.print()
    console.print(stats_table(result_from_dict(document["result"])))
    return 0
