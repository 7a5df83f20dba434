"""`verispec distill {labels,corpus,train}`: the command line of the distillation pipeline."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import torch

from verispec.atomic import atomic_path
from verispec.console import notice
from verispec.errors import VerispecError

LABEL_OPTIONS = ("prompts", "split", "per_category", "synthetic", "max_new_tokens", "temperature", "k", "slots", "seed")
SHAPE_OPTIONS = {"draft_vocab_size": "draft_vocab", "hidden_size": "hidden_size", "intermediate_size": "intermediate_size",
                 "num_layers": "layers", "num_heads": "heads", "num_kv_heads": "kv_heads"}
TRAIN_OPTIONS = ("steps", "batch_size", "seq_len", "lr", "eval_every", "checkpoint_every", "labelled_fraction", "seed")


def _default(cls, name):
    return cls.__dataclass_fields__[name].default


def add_parser(sub) -> None:
    from verispec.models.distilled import TinyDraftConfig
    from verispec.distill.pipeline import LabelConfig
    from verispec.distill.train import TrainConfig
    from verispec.models.registry import DEFAULT_TARGET

    d = sub.add_parser("distill", help="train a tiny draft from the target's distributions (DistillSpec)")
    stages = d.add_subparsers(dest="stage", required=True)
    lab = stages.add_parser("labels", help="the target answers prompts; keep its top-k next-token distributions")
    lab.add_argument("--target", default=DEFAULT_TARGET, help="the teacher (default: %(default)s)")
    lab.add_argument("--backend", default="torch", choices=["torch", "llama.cpp"],
                     help="llama.cpp decodes many prompts per batch with the GGUF's kernels (default: %(default)s)")
    lab.add_argument("--out", type=Path, required=True, help="folder for the labelled shards (resumes if present)")
    for name in LABEL_OPTIONS:
        kind = type(_default(LabelConfig, name)) if _default(LabelConfig, name) is not None else int
        flag = "--top-k-labels" if name == "k" else f"--{name.replace('_', '-')}"
        lab.add_argument(flag, dest=name, type=kind, help=f"(default: {_default(LabelConfig, name)})")
    cor = stages.add_parser("corpus", help="tokenize installed packages' sources and docs as plain training text")
    cor.add_argument("--target", default=DEFAULT_TARGET, help="whose tokenizer (default: %(default)s)")
    cor.add_argument("--out", type=Path, required=True)
    cor.add_argument("--max-tokens", type=int, default=2_000_000, help="(default: %(default)s)")
    cor.add_argument("--root", type=Path, default=None, help="folder to read (default: this Python's site-packages)")
    tr = stages.add_parser("train", help="distil a tiny draft on labelled (and plain) shards; checkpoints and resumes")
    tr.add_argument("--target", default=DEFAULT_TARGET, help="the target the draft is for (tokenizer, embeddings)")
    tr.add_argument("--data", nargs="+", required=True, help="folders of shards (labels and/or corpus)")
    tr.add_argument("--val", nargs="*", default=None, help="folders of labelled validation shards "
                    "(default: 5%% of the labelled training sequences)")
    tr.add_argument("--out", type=Path, required=True, help="run folder: checkpoint, log.jsonl, and the draft in out/draft")
    tr.add_argument("--no-resume", action="store_true", help="start over even if a checkpoint exists")
    tr.add_argument("--no-init-embeddings", action="store_true", help="do not start the embedding from the target's")
    for field, opt in SHAPE_OPTIONS.items():
        tr.add_argument(f"--{opt.replace('_', '-')}", dest=opt, type=int, help=f"(default: {_default(TinyDraftConfig, field)})")
    for name in TRAIN_OPTIONS:
        tr.add_argument(f"--{name.replace('_', '-')}", dest=name, type=type(_default(TrainConfig, name)),
                        help=f"(default: {_default(TrainConfig, name)})")


def _tokenizer(spec: str):
    from verispec.models.loading import load_tokenizer

    return load_tokenizer(spec)


def eos_ids(tokenizer) -> set[int]:
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    for name in ("<|im_end|>", "<|endoftext|>", "<|eot_id|>"):
        idx = tokenizer.convert_tokens_to_ids(name)
        if isinstance(idx, int) and idx != tokenizer.unk_token_id and idx is not None:
            ids.add(idx)
    return ids


def run(args: argparse.Namespace) -> int:
    if args.stage == "labels":
        return _labels(args)
    if args.stage == "corpus":
        from verispec.distill.pipeline import run_corpus

        total = run_corpus(_tokenizer(args.target), args.out, args.max_tokens, root=args.root)
        notice(f"wrote {total} tokens of package text to {args.out}")
        return 0
    return _train(args)


def _labels(args: argparse.Namespace) -> int:
    from verispec.distill.pipeline import LabelConfig, run_labels
    from verispec.distill.teacher import LlamaCppTeacher, TorchTeacher
    from verispec.models.loading import load_model

    config = LabelConfig(**{n: getattr(args, n) for n in LABEL_OPTIONS if getattr(args, n) is not None})
    if args.backend == "llama.cpp":
        target = load_model(args.target, backend="llama.cpp")
        teacher = LlamaCppTeacher(target.source, eos_ids(target.tokenizer), slots=config.slots)
    else:
        target = load_model(args.target)
        eos = target.eos_token_ids() | eos_ids(target.tokenizer)
        teacher = TorchTeacher(target.make_runner(), eos, slots=config.slots)
    n = run_labels(config, teacher, target.tokenizer, args.out)
    notice(f"labelled {n} prompts into {args.out}")
    return 0


def target_embeddings(spec: str) -> torch.Tensor:
    """The target's input embedding matrix (Vt, H): read from the GGUF file or the model directory."""
    from verispec.models.loading import resolve

    kind, path = resolve(spec)
    if kind == "gguf":
        import gguf
        import numpy as np

        reader = gguf.GGUFReader(str(path))
        tensor = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
        if tensor is None:
            raise VerispecError(f"{path} has no token_embd.weight tensor")
        return torch.from_numpy(np.ascontiguousarray(gguf.quants.dequantize(tensor.data, tensor.tensor_type)))
    from verispec.models.loading import load_model

    return load_model(spec).model.get_input_embeddings().weight.detach()


def draft_vocabulary(vocab_file: Path, resume: bool, choose) -> torch.Tensor:
    """The run's draft vocabulary, (Vd,) target token ids: the one saved in `vocab_file` when resuming, else
    choose()'s, saved there atomically (`verispec.atomic`: a kill leaves the previous file or none). A file
    that cannot be read as one (damaged, or not a vocabulary) is chosen again: the choice is deterministic."""
    if resume and vocab_file.is_file():
        try:
            to_target = torch.load(vocab_file, weights_only=True)  # a tensor: nothing to unpickle
            if isinstance(to_target, torch.Tensor) and to_target.dim() == 1 and not to_target.is_floating_point():
                return to_target
            notice(f"[yellow]{vocab_file} holds no draft vocabulary[/yellow]; choosing it again")
        except Exception as err:  # noqa: BLE001 - any unreadable file is chosen again, with one line
            notice(f"[yellow]{vocab_file} cannot be read[/yellow] ({type(err).__name__}); choosing it again")
    to_target = choose()
    with atomic_path(vocab_file) as tmp:
        torch.save(to_target, tmp)
    return to_target


def _train(args: argparse.Namespace) -> int:
    from verispec.distill.data import SPLIT_RULE
    from verispec.models.distilled import TinyDraftConfig, VocabMap, choose_vocabulary, vocab_fingerprint
    from verispec.distill.pipeline import load_data, split_validation
    from verispec.distill.train import TrainConfig, init_embeddings_from_target, train

    shape = TinyDraftConfig(**{f: getattr(args, o) for f, o in SHAPE_OPTIONS.items() if getattr(args, o) is not None})
    cfg = TrainConfig(**{n: getattr(args, n) for n in TRAIN_OPTIONS if getattr(args, n) is not None})
    tokenizer = _tokenizer(args.target)
    records = load_data(args.data)
    val = load_data(args.val) if args.val else None
    if val is None:
        records, val = split_validation(records, 0.05, cfg.seed)
    target_vocab = len(tokenizer)
    args.out.mkdir(parents=True, exist_ok=True)
    always = sorted(set(tokenizer.all_special_ids) | eos_ids(tokenizer))
    to_target = draft_vocabulary(
        args.out / "vocab.pt", not args.no_resume,
        lambda: choose_vocabulary((r.tokens for r in records), shape.draft_vocab_size, always, target_vocab))
    vocab = VocabMap.from_target_ids(to_target, target_vocab)
    if vocab.draft_vocab_size != shape.draft_vocab_size:
        shape = dataclasses.replace(shape, draft_vocab_size=vocab.draft_vocab_size)
    covered = sum(int((vocab.to_draft[r.tokens] != vocab.other).sum()) for r in records)
    total = sum(r.tokens.numel() for r in records)
    notice(f"{len(records)} training sequences ({total} tokens), {len(val)} validation; draft vocabulary "
           f"{vocab.draft_vocab_size} tokens covers {covered / max(total, 1):.1%} of the training tokens")
    torch.manual_seed(cfg.seed)
    model = shape.build()
    if not args.no_init_embeddings:
        init_embeddings_from_target(model, target_embeddings(args.target), vocab)
    meta = {"target": args.target, "target_vocab_sha256": vocab_fingerprint(tokenizer), "target_vocab_size": target_vocab,
            "split": SPLIT_RULE, "data": [str(d) for d in args.data], "val": [str(d) for d in args.val or []],
            "parameters": sum(p.numel() for p in model.parameters())}
    summary = train(model, shape, vocab, records, val, cfg, args.out, meta, resume=not args.no_resume, log=notice)
    notice(f"distilled draft written to {args.out / 'draft'} (last evaluation: {summary['history'][-1] if summary['history'] else '-'})")
    return 0
