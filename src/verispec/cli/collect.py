"""`verispec collect`: the target's own answers at scale, for training draft heads (`verispec.head_training.corpus`)."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from verispec.errors import VerispecError

HELP = {
    "tokens": "the longest answer, in tokens", "batch": "rows the target answers together (one ragged pass)",
    "shard_size": "answers per shard (the unit --resume goes on from)",
    "sampled": "fraction of items answered by sampling (the rest greedily)", "temperature": "of the sampled answers",
    "top_p": "of the sampled answers and of the prompts the target writes",
    "max_prompt": "prompts longer than this many tokens are left out",
    "heldout_fraction": "items kept out of training (by a hash of the prompt), for the learning curve",
    "self_prompt_tokens": "the longest prompt the target writes", "seed": "random seed",
}


def add_parser(sub) -> None:
    from verispec.head_training.corpus import CollectConfig
    from verispec.models.registry import DEFAULT_TARGET

    c = sub.add_parser("collect", help="collect the target's answers (token ids) to train draft heads on, resumably")
    c.add_argument("--target", default=DEFAULT_TARGET, help="named default or .gguf file (default: %(default)s)")
    c.add_argument("--out", type=Path, required=True, help="the corpus folder (train-heads --corpus OUT)")
    c.add_argument("--prompts", type=Path, nargs="*", default=[],
                   help="prompt files: Spec-Bench-style JSONL (its TRAIN split only) or text, one per line")
    c.add_argument("--self-prompts", type=int, default=0, help="prompts the target writes itself (default: 0)")
    c.add_argument("--code-contexts", type=int, default=0,
                   help="stretches of Python sources shipped with Python and its packages, continued (default: 0)")
    c.add_argument("--prose-contexts", type=int, default=0,
                   help="openings of docstrings shipped with Python and its packages, continued (default: 0)")
    c.add_argument("--code-texts", type=int, default=0,
                   help="passages of Python sources whose answer is the file's own next text: labelled by the target, "
                        "never decoded: only the prefill every answer needs (default: 0)")
    c.add_argument("--prose-texts", type=int, default=0,
                   help="the same from the documentation shipped with Python's packages (default: 0)")
    for f in dataclasses.fields(CollectConfig):
        c.add_argument(f"--{f.name.replace('_', '-')}", dest=f.name, type=type(f.default), default=None,
                       help=f"{HELP.get(f.name, f.name)} (default: {f.default})")
    c.add_argument("--resume", action="store_true", help="go on from the last complete shard of OUT")
    c.add_argument("--backend", default="native", choices=("native", "torch"),
                   help="the target's runner (default: %(default)s)")
    c.add_argument("--threads", type=int, default=None, help="CPU threads (default: torch's choice)")


def run(args: argparse.Namespace) -> int:
    from verispec.api import SpeculativeDecoder, set_threads
    from verispec.console import notice
    from verispec.head_training.corpus import CollectConfig, collect, open_corpus
    from verispec.head_training.sources import (code_contexts, doc_files, file_prompts, prose_contexts, python_files,
                                        text_passages)

    given = {f.name: getattr(args, f.name) for f in dataclasses.fields(CollectConfig) if getattr(args, f.name) is not None}
    config = CollectConfig(**given)
    for name in ("self_prompts", "code_contexts", "prose_contexts", "code_texts", "prose_texts"):
        if getattr(args, name) < 0:
            raise VerispecError(f"--{name.replace('_', '-')} must be >= 0")
    prompts = []
    for path in args.prompts:
        prompts += file_prompts(path)
    if args.code_contexts or args.prose_contexts:
        files = python_files()
        if not files:
            raise VerispecError("no Python sources were found beside this Python (--code-contexts, --prose-contexts)")
        for count, make, what in ((args.code_contexts, code_contexts, "code"), (args.prose_contexts, prose_contexts, "prose")):
            if count:
                found = make(files, count, config.seed)
                if not found:
                    raise VerispecError(f"the Python sources here yield no {what} contexts")
                prompts += found
    for count, files, category in ((args.code_texts, python_files, "code"), (args.prose_texts, doc_files, "prose")):
        if count:
            found = text_passages(files(), count, config.seed, category)
            if not found:
                raise VerispecError(f"the files here yield no {category} passages (--{category}-texts)")
            prompts += found
    if not args.resume and not prompts and not args.self_prompts:
        raise VerispecError("nothing to collect: give --prompts, --self-prompts, --code-contexts, --prose-contexts, "
                            "--code-texts or --prose-texts")
    set_threads(args.threads)
    decoder = SpeculativeDecoder.load(args.target, "none", backend=args.backend)
    corpus = open_corpus(decoder, args.out, config, prompts, args.self_prompts, args.resume)
    done = collect(decoder, corpus, config)
    notice(f"{done.get('answer_tokens_total', 0)} answer tokens in {done.get('shards_done', 0)} of "
           f"{corpus.shards} shards, in {args.out} (train-heads --corpus {args.out})")
    return 0
