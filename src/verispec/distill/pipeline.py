"""The stages of `verispec distill`: label prompts with the target, tokenize corpus text, train, export.

    verispec distill labels  --out data/train            target answers TRAIN prompts (top-k labels)
    verispec distill labels  --out data/val --split heldout --per-category 10
    verispec distill corpus  --out data/corpus           package sources / docs as plain text
    verispec distill train   --data data/train data/corpus --val data/val --out runs/d1

Every stage writes shards as it goes and resumes where it stopped.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

import torch

from verispec.atomic import atomic_write_json
from verispec.console import notice, stderr_console
from verispec.datasets import DEFAULT_PROMPTS
from verispec.distill.data import (
    HELDOUT,
    SPLIT_RULE,
    TRAIN,
    Record,
    chat_prompt_ids,
    load_records,
    package_files,
    read_text,
    save_shard,
    synthetic_prompts,
)
from verispec.errors import VerispecError


@dataclass(frozen=True)
class LabelConfig:
    """What `distill labels` generates: prompts from `prompts` (a Spec-Bench JSONL) in `split`
    (at most `per_category` per category), plus `synthetic` instructions built from package files;
    answers of at most `max_new_tokens` at `temperature` (0: greedy); top-`k` labels per position."""

    prompts: str = str(DEFAULT_PROMPTS)
    split: str = TRAIN
    per_category: int | None = None
    synthetic: int = 0
    max_new_tokens: int = 192
    temperature: float = 0.0
    k: int = 32
    slots: int = 16
    shard_size: int = 32
    seed: int = 0

    def __post_init__(self) -> None:
        if self.split not in (TRAIN, HELDOUT):
            raise VerispecError(f"split must be '{TRAIN}' or '{HELDOUT}', got '{self.split}'")
        if self.max_new_tokens < 1 or self.k < 1 or self.slots < 1 or self.shard_size < 1:
            raise VerispecError("max_new_tokens, k, slots and shard_size must be >= 1")


def label_prompts(config: LabelConfig) -> list[str]:
    """The prompt texts of a labels run, in a fixed order."""
    from verispec.datasets import load_prompts

    texts: list[str] = []
    if Path(config.prompts).is_file():
        texts += [p.text for p in load_prompts(config.prompts, per_category=config.per_category, split=config.split)]
    elif config.synthetic == 0:
        raise VerispecError(f"prompt file not found: {config.prompts} (and no --synthetic prompts asked for)")
    if config.synthetic:
        texts += synthetic_prompts(package_files(seed=config.seed), config.synthetic, seed=config.seed)
    if not texts:
        raise VerispecError("no prompts to label")
    return texts


def run_labels(config: LabelConfig, teacher, tokenizer, out: Path) -> int:
    """Have `teacher` answer the prompts; write shards of labelled records to `out`. Returns records written."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    texts = label_prompts(config)
    state_file = out / "labels.json"
    done = set(json.loads(state_file.read_text())["done"]) if state_file.is_file() else set()
    todo = [i for i in range(len(texts)) if i not in done]
    notice(f"{len(texts)} prompts ({config.split} split: {SPLIT_RULE}); {len(done)} already labelled, {len(todo)} to go")
    prompts = [chat_prompt_ids(tokenizer, texts[i]) for i in todo]
    pending: list[tuple[int, Record]] = []
    shard = len(list(out.glob("shard_*.safetensors")))

    def flush() -> None:
        nonlocal shard
        if pending:
            save_shard(out / f"shard_{shard:05d}.safetensors", [r for _, r in pending])
            done.update(todo[j] for j, _ in pending)
            # atomically: a reader (or a crash) never sees half a file
            atomic_write_json(state_file, {"config": config.__dict__, "done": sorted(done)})
            shard += 1
            pending.clear()

    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn())
    with Progress(*columns, console=stderr_console()) as progress:
        task = progress.add_task("labelling", total=len(todo))

        def on_record(j: int, rec: Record) -> None:
            pending.append((j, rec))
            progress.advance(task)
            if len(pending) >= config.shard_size:
                flush()

        generator = torch.Generator().manual_seed(config.seed)
        teacher.answer_all(prompts, config.max_new_tokens, config.k, config.temperature, generator, on_record)
        flush()
    return len(todo)


def run_corpus(tokenizer, out: Path, max_tokens: int, seq_len: int = 1024, seed: int = 0, root: Path | None = None) -> int:
    """Tokenize package sources and docs into unlabelled records of at most seq_len tokens."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    records, total, shard = [], 0, 0
    eos = tokenizer.eos_token_id
    for path in package_files(root, seed=seed):
        text = read_text(path)
        if not text:
            continue
        ids = tokenizer(text, add_special_tokens=False)["input_ids"] + ([eos] if eos is not None else [])
        for start in range(0, len(ids), seq_len):
            piece = ids[start : start + seq_len]
            if len(piece) > 16:
                records.append(Record.unlabelled(piece))
                total += len(piece)
        if len(records) >= 256:
            save_shard(out / f"shard_{shard:05d}.safetensors", records)
            shard, records = shard + 1, []
        if total >= max_tokens:
            break
    if records:
        save_shard(out / f"shard_{shard:05d}.safetensors", records)
    return total


def split_validation(records: list[Record], fraction: float, seed: int) -> tuple[list[Record], list[Record]]:
    """Hold out a seeded fraction of labelled records (whole sequences) for validation."""
    labelled = [i for i, r in enumerate(records) if r.topk_ids.shape[0] > 0]
    rng = random.Random(seed)
    count = max(1, int(len(labelled) * fraction)) if len(labelled) >= 2 else 0  # at least one, if any can be spared
    held = set(rng.sample(labelled, count))
    return [r for i, r in enumerate(records) if i not in held], [records[i] for i in sorted(held)]


def load_data(dirs: list[str]) -> list[Record]:
    records: list[Record] = []
    for d in dirs:
        if not Path(d).is_dir():
            raise VerispecError(f"training data directory not found: {d}")
        found = load_records(Path(d))
        if not found:
            raise VerispecError(f"no shards (*.safetensors) in {d}")
        records += found
    return records
