"""`verispec train-heads`: train draft heads for a target on its own answers."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

from verispec.console import notice
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
    from verispec.heads.eagle3_train import EagleTrainConfig
    from verispec.heads.medusa_train import MedusaTrainConfig

    return {"medusa": MedusaTrainConfig, "eagle3": EagleTrainConfig}


def _options() -> dict[str, dict[str, object]]:
    """Option name -> {kind: default} over both kinds' training configs."""
    out: dict[str, dict[str, object]] = {}
    for kind, cls in _configs().items():
        for name, f in cls.__dataclass_fields__.items():
            out.setdefault(name, {})[kind] = f.default
    return out


def add_parser(sub) -> None:
    from verispec.bench.runner import DEFAULT_PROMPTS
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
    partial = args.out.with_name(args.out.name + ".partial")
    if args.resume and not partial.is_dir():
        raise VerispecError(f"--resume: {partial} does not exist (nothing to go on from)")
    texts = prompt_texts(args.data, args.categories, args.per_category, TRAIN if args.data.endswith(".jsonl") else None)
    if args.code_prompts:
        from verispec.distill.data import package_files, synthetic_prompts

        texts += synthetic_prompts(package_files(), args.code_prompts, config.seed)
    set_threads(args.threads)
    decoder = SpeculativeDecoder.load(args.target, "none", target_weights="dense")
    runner = decoder.runner
    if not hasattr(runner, "head_logits") or not hasattr(runner, "keep_features"):
        raise VerispecError("train-heads needs the target on the native or torch runner")
    prompts = [ids for ids in (decoder.encode(text) for text in texts) if ids]
    if not prompts:
        raise VerispecError(f"the prompts in {args.data} tokenise to nothing")
    if args.kind == "eagle3":
        from verispec.heads.eagle3_cli import train_eagle3

        return train_eagle3(decoder, prompts, config, args.out, partial, args.resume, args.device)
    from verispec.heads.medusa_train import Answers, split, target_answers, train_heads

    rows = min(config.rows, runner.vocab_size)
    lm_head = _head_rows(runner, rows)
    partial.mkdir(parents=True, exist_ok=True)
    if args.resume and (partial / "answers.pt").is_file():
        answers = Answers(**torch.load(partial / "answers.pt", weights_only=True))
        notice(f"resuming: {len(answers)} answers read from {partial / 'answers.pt'}")
    else:
        notice(f"training {config.heads} tied Medusa heads for {decoder.target.name} on its answers to "
               f"{len(prompts)} prompts ({config.tokens} tokens each), LM head rows 0..{rows - 1}")
        answers = target_answers(runner, prompts, config)
        torch.save(dataclasses.asdict(answers), partial / "answers.pt")
    saved = torch.load(partial / "checkpoint.pt", weights_only=True) if args.resume and (partial / "checkpoint.pt").is_file() else None
    if saved is not None:
        notice(f"resuming at step {saved['step']} of {config.steps}")

    def checkpoint(heads, optimizer, step: int) -> None:
        torch.save({"heads": heads.state_dict(), "optimizer": optimizer.state_dict(), "step": step},
                   partial / "checkpoint.pt.tmp")
        (partial / "checkpoint.pt.tmp").replace(partial / "checkpoint.pt")

    train, val = split(answers, config.val_fraction, config.seed)
    heads, log = train_heads(train, val, lm_head, runner.vocab_size, config, resume=saved, checkpoint=checkpoint,
                             device=args.device)
    for name in ("answers.pt", "checkpoint.pt"):
        (partial / name).unlink(missing_ok=True)
    heads.save(partial, base_model=decoder.target.name)
    log.update(config=dataclasses.asdict(config), device=args.device, train_answers=len(train), val_answers=len(val))
    finish(partial, args.out, runner, decoder.target.name, log)
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


def finish(partial: Path, out: Path, runner, target_name: str, log: dict) -> None:
    """training.json and the manifest (sha256, the target's fingerprint) into `partial`, then rename it to `out`:
    the folder appears only complete."""
    from verispec.models.heads import write_manifest

    (partial / "training.json").write_text(json.dumps(log, indent=1) + "\n")
    write_manifest(partial, runner, {"target": target_name})
    if out.exists():
        out.rmdir()
    partial.rename(out)
