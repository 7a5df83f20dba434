"""Prompt sets in the Spec-Bench JSONL format: {"question_id", "category", "turns": [first, ...]}."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from verispec.errors import VerispecError

DEFAULT_PROMPTS = Path("../shared/datasets/spec_bench/question.jsonl")  # Spec-Bench, beside the repository
# shipped: code-editing and agent-loop prompts (scripts/build_edit_prompts.py; SOURCE.txt beside it)
EDITING_PROMPTS = Path(__file__).resolve().parent / "bench" / "data" / "editing.jsonl"
# shipped: structured-output prompts, each with the JSON schema its answer must follow (scripts/build_structured_prompts.py)
STRUCTURED_PROMPTS = Path(__file__).resolve().parent / "bench" / "data" / "structured.jsonl"
# Spec-Bench's six categories; its first 80 questions are MT-Bench's eight categories.
MT_BENCH_CATEGORIES = {"writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"}


@dataclass(frozen=True)
class Prompt:
    """schema: the JSON schema (as JSON text) the answer must follow, for structured-output prompts; else None."""

    question_id: int
    category: str
    text: str
    schema: str | None = None


TRAIN, HELDOUT = "train", "heldout"
SPLIT_RULE = "Spec-Bench question_id: even -> train, odd -> heldout"


def split_of(question_id: int) -> str:
    """The distillation split of a question (SPLIT_RULE): the distilled draft never trains on HELDOUT."""
    return TRAIN if question_id % 2 == 0 else HELDOUT


def spec_bench_category(category: str) -> str:
    return "mt_bench" if category in MT_BENCH_CATEGORIES else category


def load_prompts(path: str | Path | Sequence[str | Path], categories: list[str] | None = None,
                 per_category: int | None = None, split: str | None = None) -> list[Prompt]:
    """First turns of Spec-Bench-style JSONL files, grouped into Spec-Bench's categories.

    Args:
        path: the JSONL file, or several read as one (their question ids must not repeat).
        categories: keep only these (Spec-Bench names: mt_bench, translation, summarization, qa,
            math_reasoning, rag; or one of MT-Bench's eight, e.g. coding or extraction, which keeps that
            part of mt_bench under its own name); None keeps all.
        per_category: keep the first N prompts of each category; None keeps all.
        split: HELDOUT or TRAIN keeps one side of the distillation split (`split_of`); None keeps both.
    """
    paths = [Path(path)] if isinstance(path, (str, Path)) else [Path(p) for p in path]
    path = ", ".join(str(p) for p in paths)  # for the messages below
    prompts: list[Prompt] = []
    raw: list[str] = []  # each prompt's category as the file names it (MT-Bench's own for mt_bench rows)
    for one in paths:
        _read_rows(one, prompts, raw)
    ids = [p.question_id for p in prompts]
    if len(set(ids)) != len(ids):
        raise VerispecError(f"question ids repeat across {path}: each prompt needs its own")
    known = sorted({p.category for p in prompts} | (set(raw) & MT_BENCH_CATEGORIES))
    if categories:
        unknown = set(categories) - set(known)
        if unknown:
            raise VerispecError(f"unknown categories {sorted(unknown)}; {path} has {known}")
        # an MT-Bench category asked for by name keeps its name (reported apart from the rest of mt_bench)
        prompts = [Prompt(p.question_id, r, p.text, p.schema) if r in categories and r in MT_BENCH_CATEGORIES else p
                   for p, r in zip(prompts, raw) if r in categories or p.category in categories]
    if split is not None:
        prompts = [p for p in prompts if split_of(p.question_id) == split]
    if per_category is not None:
        taken: dict[str, int] = {}
        kept = []
        for p in prompts:
            if taken.get(p.category, 0) < per_category:
                kept.append(p)
                taken[p.category] = taken.get(p.category, 0) + 1
        prompts = kept
    return prompts


def _read_rows(path: Path, prompts: list[Prompt], raw: list[str]) -> None:
    """Append a Spec-Bench JSONL file's first turns to `prompts` and their categories as written to `raw`."""
    if not path.is_file():
        raise VerispecError(f"prompt file not found: {path}")
    with open(path) as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                schema = row.get("schema")
                prompts.append(Prompt(int(row["question_id"]), spec_bench_category(row["category"]), row["turns"][0],
                                      None if schema is None else json.dumps(schema)))
                raw.append(str(row["category"]))
            except (ValueError, KeyError, IndexError, TypeError) as err:
                raise VerispecError(f"{path}:{line_no}: not a Spec-Bench row ({type(err).__name__}: {err})") from None


def prompt_texts(path: str | Path, categories: list[str] | None = None, per_category: int | None = None,
                 split: str | None = None) -> list[str]:
    """Prompt texts from a Spec-Bench JSONL file (filtered as `load_prompts`) or a text file, one per line."""
    path = Path(path)
    if path.suffix == ".jsonl":
        texts = [p.text for p in load_prompts(path, categories, per_category, split)]
    else:
        try:
            texts = [line.strip() for line in path.read_text().splitlines() if line.strip()]
        except OSError as err:
            raise VerispecError(f"cannot read prompts from {path}: {err.strerror}") from None
    if not texts:
        raise VerispecError(f"no prompts in {path} (after the category and split filters)")
    return texts
