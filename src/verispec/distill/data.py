"""Training data for the distilled draft: offline corpora, prompts, and labelled shards on disk.

Everything comes from this machine, no hub:
  * text: Python sources and documentation shipped inside installed packages (site-packages);
  * prompts: synthetic instructions built from that text (write / explain a function, summarise a
    document), plus the TRAIN split of a Spec-Bench-style prompt file.

The Spec-Bench split is by question id: even ids are TRAIN (prompts the draft may learn from),
odd ids are HELDOUT (acceptance is reported on those only; `verispec bench --split heldout`).

A labelled sequence (`Record`) holds token ids and, from `label_start` on, the target's top-k
log-probabilities of the next token at each position (position i predicts token i + 1).
Positions before `label_start` are plain text (next-token cross-entropy only).
"""

from __future__ import annotations

import ast
import random
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from verispec.atomic import atomic_path, atomic_write_json
from verispec.chat import chat_ids, user_turn
from verispec.datasets import HELDOUT, SPLIT_RULE, TRAIN, load_prompts, split_of  # noqa: F401 (re-exported)


@dataclass
class Record:
    """One sequence. tokens: (T,) long. topk_ids: (L, k) long and topk_logprobs: (L, k) float for
    positions label_start .. label_start + L - 1 (each predicts the token after it); L may be 0."""

    tokens: torch.Tensor
    label_start: int
    topk_ids: torch.Tensor
    topk_logprobs: torch.Tensor

    @classmethod
    def unlabelled(cls, tokens: list[int], k: int = 1) -> Record:
        return cls(torch.as_tensor(tokens, dtype=torch.long), len(tokens), torch.zeros(0, k, dtype=torch.long),
                   torch.zeros(0, k))


def save_shard(path: Path, records: list[Record]) -> None:
    """Concatenate records into one safetensors file (ids int32, log-probs float16)."""
    from safetensors.torch import save_file

    k = max((r.topk_ids.shape[1] for r in records if r.topk_ids.numel()), default=1)
    lengths = torch.tensor([r.tokens.numel() for r in records])
    labels = torch.tensor([r.topk_ids.shape[0] for r in records])
    pad = lambda t, fill: torch.nn.functional.pad(t, (0, k - t.shape[1]), value=fill) if t.shape[1] < k else t
    tensors = {
        "tokens": torch.cat([r.tokens for r in records]).to(torch.int32),
        "seq_offsets": torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)]),
        "label_offsets": torch.cat([torch.zeros(1, dtype=torch.long), labels.cumsum(0)]),
        "label_start": torch.tensor([r.label_start for r in records]),
        "topk_ids": torch.cat([pad(r.topk_ids.reshape(-1, r.topk_ids.shape[1] or 1), 0) for r in records]).to(torch.int32),
        "topk_logprobs": torch.cat([pad(r.topk_logprobs.reshape(-1, r.topk_logprobs.shape[1] or 1), float("-inf"))
                                    for r in records]).to(torch.float16),
    }
    with atomic_path(path) as tmp:
        save_file({k_: v.contiguous() for k_, v in tensors.items()}, str(tmp))


def load_shard(path: Path) -> list[Record]:
    from safetensors.torch import load_file

    t = load_file(str(path))
    so, lo = t["seq_offsets"].tolist(), t["label_offsets"].tolist()
    return [Record(t["tokens"][so[i]:so[i + 1]].long(), int(t["label_start"][i]),
                   t["topk_ids"][lo[i]:lo[i + 1]].long(), t["topk_logprobs"][lo[i]:lo[i + 1]].float())
            for i in range(len(so) - 1)]


def load_records(data_dir: Path) -> list[Record]:
    records: list[Record] = []
    for shard in sorted(Path(data_dir).glob("*.safetensors")):
        records.extend(load_shard(shard))
    return records


# --- offline text ------------------------------------------------------------------------------------

TEXT_SUFFIXES = (".py", ".md", ".rst", ".txt")


def package_files(root: Path | None = None, max_bytes: int = 100_000, seed: int = 0) -> list[Path]:
    """Source and documentation files of installed packages, in a seeded random order."""
    root = Path(root or sysconfig.get_paths()["purelib"])
    files = [p for p in root.rglob("*") if p.suffix in TEXT_SUFFIXES and p.is_file()
             and 200 <= p.stat().st_size <= max_bytes and "verispec" not in p.parts]
    files.sort()
    random.Random(seed).shuffle(files)
    return files


def read_text(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return None


def _function_prompts(source: str) -> Iterator[str]:
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return
    lines = source.splitlines()
    for node in ast.walk(tree):
        if not isinstance(node, ast.FunctionDef) or node.name.startswith("_"):
            continue
        doc = ast.get_docstring(node)
        body = "\n".join(lines[node.lineno - 1 : node.end_lineno])
        if doc and 40 <= len(doc) <= 600:
            first = doc.strip().split("\n\n")[0].replace("\n", " ")
            yield f"Write a Python function `{node.name}` that does the following: {first}"
        if 5 <= (node.end_lineno or 0) - node.lineno <= 40:
            yield f"Explain what this Python code does:\n\n```python\n{body}\n```"


def _document_prompts(text: str) -> Iterator[str]:
    paragraphs = [p.strip() for p in text.split("\n\n") if len(p.strip()) > 200]
    for i in range(0, len(paragraphs) - 2, 3):
        chunk = "\n\n".join(paragraphs[i : i + 3])
        if len(chunk) <= 2500:
            yield f"Summarize the following text in a few sentences.\n\n{chunk}"


def synthetic_prompts(files: list[Path], count: int, seed: int = 0) -> list[str]:
    """Instructions built from package files: write / explain functions, summarise documents."""
    rng = random.Random(seed)
    prompts: list[str] = []
    for path in files:
        text = read_text(path)
        if not text:
            continue
        found = list(_function_prompts(text) if path.suffix == ".py" else _document_prompts(text))
        rng.shuffle(found)
        prompts.extend(found[:2])
        if len(prompts) >= count:
            break
    return prompts[:count]


def chat_prompt_ids(tokenizer, prompt: str) -> list[int]:
    return chat_ids(tokenizer, user_turn(prompt))


def write_json(path: Path, obj) -> None:
    atomic_write_json(path, obj, indent=2)
