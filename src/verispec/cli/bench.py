"""`verispec bench`: verispec side by side with Hugging Face and llama.cpp on a prompt set."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from verispec.cli.options import (
    CROSS_OPTIONS,
    LOOKUP_OPTIONS,
    add_model_options,
    add_tree_options,
    build_config,
    default_of,
    suffix_config,
    tree_config,
)
from verispec.config import CrossTokenizerConfig, PromptLookupConfig, SamplingConfig
from verispec.errors import VerispecError


def add_parser(sub) -> None:
    b = sub.add_parser("bench", help="measure verispec side by side with Hugging Face (and llama.cpp) on a prompt set")
    add_model_options(b)
    from verispec.bench.catalog import SYSTEMS
    from verispec.bench.runner import BenchConfig

    b.add_argument("--prompts", nargs="+", help="Spec-Bench-format JSONL files, read as one (default: "
                   f"{' and '.join(default_of(BenchConfig, 'prompts'))})")
    b.add_argument("--categories", help="comma-separated Spec-Bench categories, or MT-Bench ones (coding, extraction, ...) to report them apart from mt_bench (default: all)")
    b.add_argument("--per-category", type=int, help=f"prompts per category (default: {default_of(BenchConfig, 'per_category')})")
    b.add_argument("--max-new-tokens", type=int, help=f"(default: {default_of(BenchConfig, 'max_new_tokens')})")
    b.add_argument("--temperature", type=float, help="0 is greedy (default: 0)")
    b.add_argument("--seed", type=int, help="base seed; prompt q gets seed + q (default: 0)")
    b.add_argument("-k", "--num-draft-tokens", type=int, help=f"K for fixed-K systems (default: {default_of(BenchConfig, 'num_draft_tokens')})")
    b.add_argument("--systems", help=f"comma-separated subset of: {', '.join(SYSTEMS)} (default: all)")
    b.add_argument("--peer-k", help="comma-separated K values for the peers' speculative decoding (llama.cpp's and Hugging Face's "
                                    "prompt lookup, llama.cpp's draft model), "
                                    "each run as its own system; the report takes the fastest as the peer's best "
                                    "speculative setting (default: -k)")
    add_tree_options(b)  # the tree of the *-tree systems (default: a dynamic tree of 16 nodes, depth K)
    b.add_argument("--out", help=f"output folder for bench.json, bench.md and plots (default: {default_of(BenchConfig, 'out_dir')})")
    b.add_argument("--split", choices=["all", "heldout", "train"],
                   help="heldout: only prompts the distilled draft never trained on (odd question ids) (default: all)")
    b.add_argument("--distilled", help=f"distilled draft of the verispec-*distilled* systems (default: {default_of(BenchConfig, 'distilled')})")
    b.add_argument("--ngram-table", help="table of the verispec-ngram-corpus system (default: --draft when it is "
                                         "ngram-corpus[:TABLE] or a .ngram file, else the table shipped with verispec)")
    b.add_argument("--adapt", action="store_true", default=None,
                   help="verispec systems whose drafter can adapt learn online between prompts")
    b.add_argument("--report", type=Path, metavar="BENCH_JSON",
                   help="run nothing: rebuild the tables and plots from a bench.json (a finished bench or one cut "
                        "short) into its folder, or into --out")


def run(args: argparse.Namespace) -> int:
    from verispec.api import set_threads
    from verispec.bench.catalog import BY_NAME, HF, SYSTEMS
    from verispec.bench.runner import BenchConfig, run_bench
    from verispec.drafters.registry import CORPUS, EAGLE, SELF, SUFFIX, parse_draft
    from verispec.models.loading import load_model

    if args.report is not None:
        from verispec.bench.results import report_from_json

        return _show_bench_report(report_from_json(args.report, args.out))
    split = lambda text: tuple(x.strip() for x in text.split(",") if x.strip()) if text else None  # noqa: E731
    args.categories, args.systems = split(args.categories), split(args.systems)
    args.prompts = tuple(args.prompts) if args.prompts else None
    try:
        args.peer_k = tuple(int(k) for k in split(args.peer_k)) if args.peer_k else None
    except ValueError:
        raise VerispecError(f"--peer-k takes comma-separated integers, got '{args.peer_k}'") from None
    config = build_config(BenchConfig, args, {"prompts": "prompts", "categories": "categories", "per_category": "per_category",
                                        "max_new_tokens": "max_new_tokens", "temperature": "temperature", "seed": "seed",
                                        "num_draft_tokens": "num_draft_tokens", "systems": "systems", "out_dir": "out",
                                        "split": "split", "distilled": "distilled", "distilled_weights": "draft_weights",
                                        "ngram_table": "ngram_table", "adapt": "adapt",
                                        "draft_context": "draft_context", "draft_vocab": "draft_vocab",
                                        "draft_lookup": "draft_lookup", "peer_num_draft_tokens": "peer_k"})
    config = dataclasses.replace(config, cross=build_config(CrossTokenizerConfig, args, CROSS_OPTIONS),
                                 prompt_lookup=build_config(PromptLookupConfig, args, LOOKUP_OPTIONS),
                                 suffix=suffix_config(args))
    tree = tree_config(args)
    if tree is not None:
        config = dataclasses.replace(config, tree=tree)
    SamplingConfig(temperature=config.temperature)  # validates it before minutes of loading
    set_threads(args.threads)
    draft = parse_draft(args.draft)  # the bench's own systems name the other kinds; --draft sets them up
    store = next((part.arg for part in draft.parts if part.kind == SUFFIX and part.arg), None)
    if store is not None:  # suffix:FILE: the suffix systems start from its outputs
        config = dataclasses.replace(config, suffix_store=store)
    if draft.kind == CORPUS and config.ngram_table is None:
        config = dataclasses.replace(config, ngram_table=draft.text)
    if draft.kind == SELF:
        config = dataclasses.replace(config, self_draft=draft.text)
    if draft.is_head:
        config = dataclasses.replace(config, **{"eagle" if draft.kind == EAGLE else "medusa": draft.text})
    has_draft = draft.loads_model
    # the draft model systems draft with the model a composite names (suffix:FILE+MODEL: the rest set up above)
    draft_model = next((part.text for part in draft.parts if part.loads_model), args.draft)
    draft_dtype = args.draft_dtype or args.dtype
    # Hugging Face systems run the models as loaded, on torch (loaded only when one of them runs);
    # verispec's run on --backend (auto: GGUF files on verispec's own quantized CPU runner).
    wants_hf = any(BY_NAME[name].family == HF for name in (config.systems or SYSTEMS))
    device, compiled = args.device, args.compile
    hf_device = device if device != "auto" or args.backend in ("auto", "torch") else "cpu"
    models = {"hf_target": load_model(args.target, args.dtype, backend="torch", device=hf_device) if wants_hf else None,
              "hf_draft": load_model(draft_model, draft_dtype, backend="torch", device=hf_device)
              if wants_hf and has_draft else None,
              "target": load_model(args.target, args.dtype, args.target_weights, args.backend, device, compiled,
                                  kv_cache=args.kv_cache),
              "draft": load_model(draft_model, draft_dtype, args.draft_weights, args.backend, device, compiled)
              if has_draft else None}
    return _show_bench_report(run_bench(config, **models))


def _show_bench_report(report: dict) -> int:
    """Print a bench report's tables and the files it wrote (beside its plots)."""
    from rich.console import Console
    from rich.markdown import Markdown

    Console().print(Markdown(report["markdown"]))
    print(f"written: {Path(report['plots'][0]).parent}/bench.json, bench.md, " + ", ".join(Path(p).name for p in report["plots"]))
    return 0
