"""`verispec ngram build`: count a corpus's n-grams into a .ngram table."""

from __future__ import annotations

import argparse
from pathlib import Path

from verispec.cli.options import build_config, default_of
from verispec.models.registry import DEFAULT_TARGET


def add_parser(sub) -> None:
    from verispec.ngram.build import NGramBuildConfig

    ng = sub.add_parser("ngram", help="corpus n-gram tables for --draft ngram-corpus")
    ngsub = ng.add_subparsers(dest="ngram_command", required=True)
    nb = ngsub.add_parser("build", help="count a corpus's n-grams with the target's tokenizer into a .ngram table")
    nb.add_argument("--tokenizer", default=DEFAULT_TARGET, help="model spec whose tokenizer is used, as --target (default: %(default)s)")
    nb.add_argument("--corpus", nargs="+", help="text files, directories (walked for .py .md .txt .rst) and .jsonl "
                                                "prompt sets (default: the installed packages' sources and docs)")
    nb.add_argument("--out", type=Path, required=True, help="the table file to write (e.g. code.ngram)")
    nb.add_argument("--max-n", type=int, help=f"longest n-gram counted (default: {default_of(NGramBuildConfig, 'max_n')})")
    nb.add_argument("--min-count", type=int, help=f"drop rarer n-grams (default: {default_of(NGramBuildConfig, 'min_count')})")
    nb.add_argument("--top-k", type=int, help=f"continuations kept per context (default: {default_of(NGramBuildConfig, 'top_k')})")
    nb.add_argument("--max-files", type=int, help="read at most N files (default: all)")
    nb.add_argument("--max-tokens", type=int, help="stop after about N corpus tokens (default: no limit)")


def run(args: argparse.Namespace) -> int:
    from verispec.models.loading import load_tokenizer
    from verispec.ngram.build import NGramBuildConfig, build_table, default_corpus

    config = build_config(NGramBuildConfig, args, {"max_n": "max_n", "min_count": "min_count", "top_k": "top_k",
                                             "max_files": "max_files", "max_tokens": "max_tokens"})
    corpus = args.corpus or default_corpus()
    tokenizer = load_tokenizer(args.tokenizer)
    table, summary = build_table(tokenizer, corpus, config, tokenizer_name=args.tokenizer)
    size = table.save(args.out)
    print(f"wrote {args.out}: {summary['files']:,} files, {summary['tokens']:,} tokens, {summary['ngrams']:,} n-grams "
          f"kept (n = 1..{config.max_n}, count >= {config.min_count}, top {config.top_k} per context), "
          f"{size / 1e6:.1f} MB")
    return 0
