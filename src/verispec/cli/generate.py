"""`verispec generate`: generate text speculatively and show how it was produced (stream, JSON, trace)."""

from __future__ import annotations

import argparse
import dataclasses
import json
from contextlib import nullcontext
from pathlib import Path

from verispec.cli.options import (
    SPEC_OPTIONS,
    add_decoding_options,
    build_config,
    default_of,
    load_decoder,
    read_prompt,
    read_text_file,
    sampling_config,
    tree_config,
)
from verispec.config import AdaptConfig, SpecConfig, check_tree_request
from verispec.models.registry import DEFAULT_DRAFTER


def add_parser(sub) -> None:
    g = sub.add_parser("generate", help="generate text speculatively and show how it was produced")
    add_decoding_options(g, DEFAULT_DRAFTER)
    g.add_argument("--max-new-tokens", type=int, help=f"(default: {default_of(SpecConfig, 'max_new_tokens')})")
    g.add_argument("--stop", action="append", help="stop string (repeatable)")
    g.add_argument("--auto-k", action=argparse.BooleanOptionalAction, default=None,
                   help="choose K each step from pass costs (measured once per machine and model, then while decoding) "
                        "and acceptance, speculation off where it cannot win; with --tree-budget, keep only the tree "
                        "nodes that pay for their share of the target pass (default: on, unless -k or --tree-shape is "
                        "given, or --seed with sampling: a seeded sampled answer's draws follow K, so it repeats with a "
                        "fixed K)")
    g.add_argument("--prediction", type=Path, metavar="FILE",
                   help="a predicted output: text the answer is expected to repeat (the file being edited, say), "
                        "drafted from while the answer follows it; the answer is the target's either way")
    g.add_argument("--logprobs", type=int, metavar="N",
                   help="report each generated token's log-probability and its N likeliest alternatives (in --json)")
    g.add_argument("--logprobs-mode", choices=("raw", "processed"),
                   help="the target's logits alone (raw, the default) or the distribution each token was drawn from "
                        "(processed: after penalties, temperature, top-k / top-p / min-p)")
    g.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    g.add_argument("--no-color", action="store_true", help="plain text output")
    g.add_argument("--trace", type=Path, help="save every step's verification (p, q, min(1, p/q), u, verdict; for a tree every node) as JSON")
    g.add_argument("--adapt", action="store_true",
                   help="online adaptation: the drafter learns from the target's distributions where drafts failed, "
                        "between steps (output distribution unchanged; mostly useful for serve and bench)")


def default_auto_k(args: argparse.Namespace, sampling, tree) -> bool:
    """--auto-k unless the user fixed K (-k), drafts a static tree, or asked for a repeatable sampled answer (--seed)."""
    return (args.num_draft_tokens is None and (tree is None or tree.budget is not None)
            and not (args.seed is not None and not sampling.greedy))


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from verispec.render import StreamPrinter, legend, stats_table
    from verispec.trace import Tracer, save_trace, trace_document, tracing

    sampling = sampling_config(args)
    if args.stop:
        args.stop = tuple(args.stop)
    tree = tree_config(args)
    spec = dataclasses.replace(build_config(SpecConfig, args, SPEC_OPTIONS), tree=tree)
    if tree is not None:  # refused before any model is loaded
        from verispec.drafters.registry import NO_DRAFT

        check_tree_request(tree, args.draft not in NO_DRAFT, auto_k=bool(args.auto_k))
    auto_k = args.auto_k if args.auto_k is not None else default_auto_k(args, sampling, tree)
    prompt = read_prompt(args)
    prediction = read_text_file(args.prediction, "--prediction") if args.prediction is not None else None
    decoder = load_decoder(args)
    k_max = max(8, spec.num_draft_tokens, (tree.budget or 0) if tree is not None else 0)  # a tree pass's widths
    tuner = decoder.auto_tuner(k_max, cache=True) if auto_k and not decoder.drafter.traits.plain else None
    adapter = decoder.enable_adaptation(AdaptConfig(background=False)) if args.adapt else None
    console = Console(no_color=args.no_color, highlight=False)
    show = not args.json
    printer = StreamPrinter(console if show else None, decoder.decode, plain_decoding=decoder.drafter.traits.plain)
    tracer = Tracer(token_text=lambda t: decoder.target.tokenizer.decode([t])) if args.trace else None
    if show:
        console.print(legend(decoder.drafter.traits.plain, sampling.constraint is not None))
    steps, seq = [], None
    with tracing(decoder.engine, tracer) if tracer else nullcontext():
        for event, seq in decoder.stream(prompt, sampling, spec, args.seed, args.chat, tuner, prediction):
            n_acc = min(len(event.accepted), len(event.committed))
            if show or tracer:
                pieces = printer.step(seq.generated, n_acc, event.bonus, len(event.committed), seq.text_end,
                                      event.forced)
            if tracer:
                steps.append(tracer.step(event, seq, pieces))
            if adapter is not None:
                adapter.poke()  # between steps: the stream is paused here
    if not decoder.drafter.traits.plain:
        decoder.drafter.flush_store(30.0)  # a store file (suffix:FILE) holds this output when the command returns
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
