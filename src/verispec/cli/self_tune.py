"""`verispec self-tune`: search the self-draft's skip set for a target and save it for `--draft self`."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

from verispec.console import notice
from verispec.errors import VerispecError

TUNE_OPTIONS = ("tokens", "finalists", "step", "min_agreement", "repeats")


def _default(cls, name):
    return cls.__dataclass_fields__[name].default


def add_parser(sub) -> None:
    from verispec.datasets import DEFAULT_PROMPTS
    from verispec.models.registry import DEFAULT_TARGET
    from verispec.selfspec.search import SelfTuneConfig

    t = sub.add_parser("self-tune", help="search the sublayers the target skips when it drafts for itself (--draft self)")
    t.add_argument("--target", default=DEFAULT_TARGET, help="named default or .gguf file (default: %(default)s)")
    t.add_argument("--prompts", default=str(DEFAULT_PROMPTS),
                   help="Spec-Bench JSONL, or a text file with one prompt per line (default: %(default)s)")
    t.add_argument("--categories", nargs="*", default=None, help="Spec-Bench categories to keep (default: all)")
    t.add_argument("--per-category", type=int, default=1, help="prompts per category of a JSONL file (default: %(default)s)")
    t.add_argument("--split", default="train", choices=["train", "heldout", "all"],
                   help="JSONL prompts: search on one side of the split so the other stays held out (default: %(default)s)")
    t.add_argument("--out", type=Path, default=None,
                   help="the skip file to write (default: the cache, where --draft self finds it for this target)")
    t.add_argument("--k-values", type=int, nargs="+", default=None,
                   help=f"chain lengths the finalists decode with (default: {' '.join(map(str, _default(SelfTuneConfig, 'k_values')))})")
    for name in TUNE_OPTIONS:
        t.add_argument(f"--{name.replace('_', '-')}", dest=name, type=type(_default(SelfTuneConfig, name)),
                       help=f"(default: {_default(SelfTuneConfig, name)})")
    t.add_argument("--json", action="store_true", help="print the whole report as JSON on stdout")
    t.add_argument("--threads", type=int, default=None, help="CPU threads (default: torch's choice)")


def _prompts(args: argparse.Namespace, decoder) -> list[list[int]]:
    from verispec.datasets import prompt_texts

    texts = prompt_texts(args.prompts, args.categories, args.per_category, None if args.split == "all" else args.split)
    return [decoder.encode(text) for text in texts]


def run(args: argparse.Namespace) -> int:
    from verispec.api import SpeculativeDecoder, set_threads
    from verispec.models.skip import SkipFile, SkipSet, fingerprint, tuned_folders
    from verispec.selfspec.search import SelfTuneConfig, SkipSearch

    values = {name: getattr(args, name) for name in TUNE_OPTIONS if getattr(args, name) is not None}
    if args.k_values:
        values["k_values"] = tuple(args.k_values)
    config = dataclasses.replace(SelfTuneConfig(), **values)
    if args.out is not None and args.out.is_dir():
        raise VerispecError(f"--out {args.out} is a folder; name the skip file to write")
    set_threads(args.threads)
    decoder = SpeculativeDecoder.load(args.target, "none", backend="native")
    prompts = _prompts(args, decoder)
    notice(f"searching the skip set of {decoder.target.name} on {len(prompts)} prompts, {config.tokens} tokens each")
    report = SkipSearch(decoder.runner, prompts, config).run()
    runner = decoder.runner
    skip = SkipSet.parse(report["skip"], len(runner.gguf.layers))
    out = args.out or tuned_folders()[0] / f"{Path(decoder.target.name).name}.json"
    SkipFile(skip, decoder.target.name, fingerprint(runner), report).save(out)
    best = report["best"]
    if args.json:
        print(json.dumps(report, indent=1))
    notice(f"skip {best['skip']} ({best['sublayers']} of {2 * len(runner.gguf.layers)} sublayers), K={best['k']}: "
           f"{best['tokens_per_second']} tok/s against {report['plain_tokens_per_second']} plain "
           f"({report['speedup']}x), acceptance {best['acceptance']} by position {best['acceptance_by_position']}; "
           f"searched in {report['seconds']} s")
    notice(f"saved to {out}; use it with --draft self" + ("" if args.out is None else f":{out}"))
    return 0
