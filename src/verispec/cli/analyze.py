"""`verispec analyze`: the speedup calculator (expected tokens per target pass and speedup over alpha and K)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from verispec.cli.options import default_of
from verispec.errors import VerispecError


def add_parser(sub) -> None:
    from verispec.analyze import AnalyzeConfig

    n = sub.add_parser("analyze", help="expected tokens per target pass and speedup over alpha and K (the speedup calculator)")
    n.add_argument("--alpha", help=f"comma-separated acceptance rates (default: {','.join(map(str, default_of(AnalyzeConfig, 'alphas')))})")
    n.add_argument("--k-max", type=int, help=f"largest K in the table (default: {default_of(AnalyzeConfig, 'k_max')})")
    n.add_argument("-c", "--cost-ratio", type=float, help=f"draft token cost / target pass cost (default: {default_of(AnalyzeConfig, 'c')})")
    n.add_argument("--bench", type=Path, help="take alpha and c from a `verispec bench` JSON (measured mode)")
    n.add_argument("--system", help="bench system to measure (default: verispec-draft, else the first that drafted)")
    n.add_argument("--plot", type=Path, help="write the speedup plot as a PNG here")
    n.add_argument("--json", action="store_true", help="print the table as JSON")


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from verispec.analyze import AnalyzeConfig, measured_from_bench, plot_speedup_table, read_bench, speedup_table

    values: dict = {}
    if args.alpha is not None:
        try:
            values["alphas"] = tuple(float(a) for a in args.alpha.split(",") if a.strip())
        except ValueError:
            raise VerispecError(f"--alpha takes comma-separated numbers, got '{args.alpha}'") from None
    if args.k_max is not None:
        values["k_max"] = args.k_max
    if args.cost_ratio is not None:
        values["c"] = args.cost_ratio
    measured = None
    if args.bench is not None:
        measured = measured_from_bench(read_bench(args.bench), args.system)
        values.update(alphas=(measured["alpha"],), c=measured["c"])
    elif args.system is not None:
        raise VerispecError("--system needs --bench")
    table = speedup_table(AnalyzeConfig(**values))
    if args.plot is not None:
        plot_speedup_table(table, args.plot)
    if args.json:
        print(json.dumps({**table, "measured": measured}))
        return 0
    console = Console(highlight=False)
    console.width = max(console.width, 40 + 8 * (len(table["ks"]) + 2))  # the whole table, never cropped
    if measured:
        console.print(f"measured from {args.bench} ({measured['system']}): alpha = {measured['alpha']:.4f}, "
                      f"c = {measured['c']:.4f}")
    out = Table(title=f"expected speedup over plain decoding, c = {table['c']:g} (* best K)", title_justify="left")
    out.add_column("alpha", justify="right")
    for k in table["ks"]:
        out.add_column(f"K={k}", justify="right")
    out.add_column("best K", justify="right")
    out.add_column("E\\[tokens/pass]", justify="right")
    for row in table["rows"]:
        best = row["best_k"]
        cells = [f"[bold green]*{s:.2f}[/bold green]" if k == best else f"{s:.2f}" for k, s in zip(table["ks"], row["speedup"])]
        out.add_row(f"{row['alpha']:g}", *cells, str(best) if best else "0 (off)",
                    f"{row['tokens'][best - 1]:.2f}" if best else "1.00")
    console.print(out)
    if args.plot is not None:
        console.print(f"written: {args.plot}")
    return 0
