"""`verispec train-heads`: train draft heads for a target on its own answers."""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import shutil
from pathlib import Path

from verispec.console import notice
from verispec.errors import VerispecError

TRAIN_OPTIONS = ("heads", "layers", "rows", "tokens", "top_k", "steps", "batch_size", "lr", "val_fraction", "seed")
KINDS = ("medusa", "eagle3")


def _default(cls, name):
    return cls.__dataclass_fields__[name].default


def add_parser(sub) -> None:
    from verispec.bench.runner import DEFAULT_PROMPTS
    from verispec.heads.medusa_train import MedusaTrainConfig
    from verispec.models.registry import DEFAULT_TARGET

    t = sub.add_parser("train-heads", help="train draft heads (Medusa) on the target's own answers")
    t.add_argument("--kind", choices=KINDS, default="medusa", help="(default: %(default)s)")
    t.add_argument("--target", default=DEFAULT_TARGET, help="named default or .gguf file (default: %(default)s)")
    t.add_argument("--out", type=Path, required=True, help="the head folder to write (--draft medusa:OUT)")
    t.add_argument("--data", default=str(DEFAULT_PROMPTS),
                   help="training prompts: Spec-Bench JSONL (its TRAIN split only) or a text file, one per line "
                        "(default: %(default)s)")
    t.add_argument("--categories", nargs="*", default=None, help="Spec-Bench categories to keep (default: all)")
    t.add_argument("--per-category", type=int, default=None, help="prompts per category (default: all)")
    for name in TRAIN_OPTIONS:
        t.add_argument(f"--{name.replace('_', '-')}", dest=name, type=type(_default(MedusaTrainConfig, name)),
                       help=f"(default: {_default(MedusaTrainConfig, name)})")
    t.add_argument("--threads", type=int, default=None, help="CPU threads (default: torch's choice)")


def run(args: argparse.Namespace) -> int:
    from verispec.api import SpeculativeDecoder, set_threads
    from verispec.datasets import TRAIN, prompt_texts
    from verispec.heads.medusa_train import MedusaTrainConfig, split, target_answers, train_heads

    if args.kind == "eagle3":
        raise VerispecError("EAGLE-3 heads cannot be trained by verispec yet; --kind medusa can")
    values = {name: getattr(args, name) for name in TRAIN_OPTIONS if getattr(args, name) is not None}
    config = dataclasses.replace(MedusaTrainConfig(), **values)
    if args.out.exists() and any(args.out.iterdir()):
        raise VerispecError(f"--out {args.out} exists and is not empty; name a new folder")
    set_threads(args.threads)
    decoder = SpeculativeDecoder.load(args.target, "none", target_weights="dense")
    runner = decoder.runner
    if not hasattr(runner, "head_logits") or not hasattr(runner, "keep_features"):
        raise VerispecError("train-heads needs the target on the native or torch runner")
    texts = prompt_texts(args.data, args.categories, args.per_category, TRAIN if args.data.endswith(".jsonl") else None)
    prompts = [ids for ids in (decoder.encode(text) for text in texts) if ids]
    if not prompts:
        raise VerispecError(f"the prompts in {args.data} tokenise to nothing")
    rows = min(config.rows, runner.vocab_size)
    lm_head = _head_rows(runner, rows)
    notice(f"training {config.heads} tied Medusa heads for {decoder.target.name} on its answers to {len(prompts)} "
           f"prompts ({config.tokens} tokens each), LM head rows 0..{rows - 1}")
    train, val = split(target_answers(runner, prompts, config), config.val_fraction, config.seed)
    heads, log = train_heads(train, val, lm_head, runner.vocab_size, config)
    tmp = args.out.with_name(args.out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    heads.save(tmp, base_model=decoder.target.name)
    log.update(config=dataclasses.asdict(config), train_answers=len(train), val_answers=len(val))
    (tmp / "training.json").write_text(json.dumps(log, indent=1) + "\n")
    manifest = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(tmp.iterdir())}
    (tmp / "manifest.json").write_text(json.dumps({"sha256": manifest}, indent=1) + "\n")
    if args.out.exists():
        args.out.rmdir()
    tmp.rename(args.out)
    notice(f"validation agreement by head (greedy, target's own answers): {log['validation_agreement']}; "
           f"trained in {log['seconds']} s; saved to {args.out} (--draft medusa:{args.out})")
    return 0


def _head_rows(runner, rows: int):
    """(rows, E) float32: the target's LM head over its first `rows` token ids."""
    import numpy as np
    import torch

    gguf = getattr(runner, "gguf", None)
    if gguf is not None:
        return torch.from_numpy(gguf.head.take_rows(np.arange(rows, dtype=np.int64)))
    weight = runner.model.get_output_embeddings().weight
    if weight.device.type == "meta":
        raise VerispecError("train-heads reads the target's LM head: run it with --target-weights dense or on a GGUF")
    return weight[:rows].detach().float()
