"""`verispec train-heads`: train draft heads for a target on its own answers."""

from __future__ import annotations

import argparse
import dataclasses
import random
from pathlib import Path

from verispec.errors import VerispecError

KINDS = ("medusa", "eagle3")
HELP = {  # what each training option means; the defaults come from the kinds' config dataclasses
    "heads": "medusa: heads (draft positions); eagle3: attention heads of the head's layer",
    "layers": "ResBlocks per Medusa head", "rows": "token ids a tied Medusa head covers",
    "tokens": "answer length per prompt", "top_k": "soft-label width (the target's top-k)",
    "steps": "optimizer steps", "batch_size": "medusa: positions per head and step; eagle3: answers per step",
    "lr": "peak learning rate", "val_fraction": "answers held back for validation", "seed": "random seed",
    "draft_vocab": "target ids the head's LM head covers", "intermediate": "MLP width of the head's layer",
    "kv_heads": "key-value heads of the head's layer", "ttt": "steps the training-time test unrolls",
    "window": "prompt tokens kept before each answer", "bf16": "bfloat16 matmuls: auto, on or off",
}


def _configs():
    from verispec.head_training.eagle3_train import EagleTrainConfig
    from verispec.head_training.medusa_train import MedusaTrainConfig

    return {"medusa": MedusaTrainConfig, "eagle3": EagleTrainConfig}


def _options() -> dict[str, dict[str, object]]:
    """Option name -> {kind: default} over both kinds' training configs."""
    out: dict[str, dict[str, object]] = {}
    for kind, cls in _configs().items():
        for name, f in cls.__dataclass_fields__.items():
            out.setdefault(name, {})[kind] = f.default
    return out


def add_parser(sub) -> None:
    from verispec.datasets import DEFAULT_PROMPTS
    from verispec.models.registry import DEFAULT_TARGET

    t = sub.add_parser("train-heads", help="train draft heads (Medusa, EAGLE-3) on the target's own answers")
    t.add_argument("--kind", choices=KINDS, default="medusa", help="(default: %(default)s)")
    t.add_argument("--target", default=DEFAULT_TARGET, help="named default or .gguf file (default: %(default)s)")
    t.add_argument("--out", type=Path, required=True, help="the head folder to write (--draft medusa:OUT / eagle:OUT)")
    t.add_argument("--data", default=str(DEFAULT_PROMPTS),
                   help="training prompts: Spec-Bench JSONL (its TRAIN split only) or a text file, one per line "
                        "(default: %(default)s)")
    t.add_argument("--categories", nargs="*", default=None, help="Spec-Bench categories to keep (default: all)")
    t.add_argument("--per-category", type=int, default=None, help="prompts per category (default: all)")
    t.add_argument("--corpus", type=Path, nargs="+", default=None,
                   help="eagle3: train on corpora `verispec collect` wrote (their train splits; their held-out splits "
                        "validate) instead of collecting answers; several folders are read as one")
    t.add_argument("--corpus-tokens", type=int, default=None,
                   help="with --corpus: train on a seeded sample of its answers up to this many answer tokens (a "
                        "learning curve's point, part of any larger one; default: all)")
    t.add_argument("--code-prompts", type=int, default=0,
                   help="also answer this many instructions built from installed packages' sources (default: 0)")
    for name, defaults in _options().items():
        shown = ", ".join(f"{kind} {value}" for kind, value in defaults.items())
        t.add_argument(f"--{name.replace('_', '-')}", dest=name, type=type(next(iter(defaults.values()))),
                       help=f"{HELP.get(name, name)} (default: {shown})")
    t.add_argument("--resume", action="store_true",
                   help="go on from OUT.partial (the answers collected and the last checkpoint, every 100 steps)")
    t.add_argument("--device", default="cpu",
                   help="where the heads train: cpu or cuda (the answers are collected on the target's runner) "
                        "(default: %(default)s)")
    t.add_argument("--threads", type=int, default=None, help="CPU threads (default: torch's choice)")


def run(args: argparse.Namespace) -> int:
    from verispec.api import SpeculativeDecoder, set_threads
    from verispec.datasets import TRAIN, prompt_texts

    cls = _configs()[args.kind]
    given = {name for name in _options() if getattr(args, name) is not None}
    foreign = sorted(given - set(cls.__dataclass_fields__))
    if foreign:
        raise VerispecError(f"--{foreign[0].replace('_', '-')} does not apply to --kind {args.kind}")
    config = dataclasses.replace(cls(), **{name: getattr(args, name) for name in given})
    if args.out.exists() and any(args.out.iterdir()):
        raise VerispecError(f"--out {args.out} exists and is not empty; name a new folder")
    import torch

    if args.device not in ("cpu", "cuda") and not args.device.startswith("cuda:"):
        raise VerispecError(f"--device {args.device}: choose cpu or cuda")
    if args.device != "cpu" and not torch.cuda.is_available():
        raise VerispecError(f"--device {args.device}: no CUDA device is visible to torch")
    from verispec.head_training.common import Partial

    partial = Partial(args.out, args.resume)
    if args.corpus is not None:
        return _train_on_corpus(args, config, partial)
    texts = prompt_texts(args.data, args.categories, args.per_category, TRAIN if args.data.endswith(".jsonl") else None)
    if args.code_prompts:
        from verispec.distill.data import package_files, synthetic_prompts

        texts += synthetic_prompts(package_files(), args.code_prompts, config.seed)
    set_threads(args.threads)
    decoder = SpeculativeDecoder.load(args.target, "none", target_weights="dense")
    runner = decoder.runner
    from verispec.core.protocols import FeatureRunner

    if not isinstance(runner, FeatureRunner):
        raise VerispecError("train-heads needs the target on the native or torch runner")
    prompts = [ids for ids in (decoder.encode(text) for text in texts) if ids]
    if not prompts:
        raise VerispecError(f"the prompts in {args.data} tokenise to nothing")
    if args.kind == "eagle3":
        from verispec.head_training.eagle3_run import train_eagle3

        return train_eagle3(decoder, prompts, config, partial, args.device)
    from verispec.head_training.medusa_run import train_medusa

    return train_medusa(decoder, prompts, config, partial, args.device)


def _train_on_corpus(args: argparse.Namespace, config, partial) -> int:
    """--corpus: an EAGLE-3 head trained on a collected corpus, from this target only."""
    from verispec.api import SpeculativeDecoder, set_threads
    from verispec.head_training.corpus import foreign, identity, read_corpus

    if args.kind != "eagle3":
        raise VerispecError("--corpus trains --kind eagle3 (Medusa heads collect their own answers)")
    read = [(folder, *read_corpus(folder)) for folder in args.corpus]
    set_threads(args.threads)
    decoder = SpeculativeDecoder.load(args.target, "none", target_weights="dense")
    who, records, seen = identity(decoder), [], set()
    for folder, manifest, found in read:
        theirs = manifest.get("identity", {})
        if foreign(theirs, who) is not None:
            raise VerispecError(f"--corpus {folder} holds the answers of {theirs.get('target', 'another target')}, "
                                f"not of {decoder.target.name}: collect one with this --target")
        for record in found:  # an answer two corpora both hold counts once
            key = (tuple(record["prompt"]), tuple(record["answer"]))
            if key not in seen:
                seen.add(key)
                records.append(record)
    from verispec.core.protocols import FeatureRunner

    if not isinstance(decoder.runner, FeatureRunner):
        raise VerispecError("train-heads needs the target on the native or torch runner")
    train = [r for r in records if r["split"] == "train"]
    val = [r for r in records if r["split"] == "heldout"]
    if args.corpus_tokens is not None:
        if args.corpus_tokens < 1:
            raise VerispecError("--corpus-tokens must be >= 1")
        kept, total = [], 0
        order = list(train)
        random.Random(config.seed).shuffle(order)  # a sample of the whole mix (the plan lists source by source);
        for record in order:  # with one seed, a smaller point's answers are part of a larger one's
            if total >= args.corpus_tokens:
                break
            kept.append(record)
            total += len(record["answer"][: config.tokens])
        train = kept
    if not train or not val:
        raise VerispecError(f"--corpus {' '.join(map(str, args.corpus))} has {len(train)} training and {len(val)} "
                            "held-out answers; "
                            "both are needed (collect more, or with --heldout-fraction > 0)")
    from verispec.head_training.eagle3_run import train_eagle3

    return train_eagle3(decoder, [], config, partial, args.device, corpus=(train, val))
