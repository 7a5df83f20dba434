"""`verispec audit`: check that speculative sampling reproduces the target's distribution (chi-square)."""

from __future__ import annotations

import argparse
import json

from verispec.cli.options import add_decoding_options, build_config, load_decoder, read_prompt, sampling_config, tree_config
from verispec.config import SpecConfig


def add_parser(sub) -> None:
    a = sub.add_parser("audit", help="check that speculative sampling reproduces the target's distribution")
    add_decoding_options(a)
    a.add_argument("--samples", type=int, default=2000, help="continuations sampled (default: %(default)s)")
    a.add_argument("--batch-size", type=int, default=32, help="sequences decoded together (default: %(default)s)")
    a.add_argument("--alpha", type=float, default=0.01, help="family-wise significance level (default: %(default)s)")
    a.add_argument("--json", action="store_true", help="print the report as JSON")


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.progress import Progress
    from rich.table import Table

    from verispec.audit import run_audit

    sampling = sampling_config(args)
    spec = build_config(SpecConfig, args, {"num_draft_tokens": "num_draft_tokens", "draft_stop": "draft_stop"})
    tree = tree_config(args)
    decoder = load_decoder(args)
    prompt = decoder.encode(read_prompt(args), args.chat)
    console = Console(stderr=args.json)
    with Progress(console=Console(stderr=True), transient=True) as progress:
        task = progress.add_task("sampling", total=args.samples)
        report = run_audit(decoder, prompt, sampling, spec.num_draft_tokens, args.samples, args.batch_size,
                           args.seed or 0, args.alpha, on_progress=lambda n: progress.advance(task, n), tree=tree,
                           draft_stop=spec.draft_stop)
    if args.json:
        print(json.dumps(report.to_dict()))
        return 0 if report.passed else 1
    table = Table(title=f"losslessness audit: {args.samples} samples, K={spec.num_draft_tokens}, {sampling}")
    for col in ("position", "after", "chi-square", "dof", "p-value", "TV distance", "result"):
        table.add_column(col)
    for c in report.checks:
        after = decoder.target.tokenizer.decode(c.prefix) if c.prefix else "prompt"
        table.add_row(str(c.position), repr(after), f"{c.fit.statistic:.2f}", str(c.fit.dof), f"{c.fit.p_value:.4f}",
                      f"{c.fit.tv_distance:.4f}", "[green]pass[/green]" if c.passed else "[red]FAIL[/red]")
    console.print(table)
    console.print(f"acceptance rate during the audit: {report.acceptance_rate:.1%}")
    verdict = "[bold green]PASS[/bold green]" if report.passed else "[bold red]FAIL[/bold red]"
    console.print(f"{verdict}: every p-value above alpha / tests = {args.alpha / len(report.checks):.4g}" if report.passed
                  else f"{verdict}: a p-value fell below alpha / tests = {args.alpha / len(report.checks):.4g}")
    return 0 if report.passed else 1
