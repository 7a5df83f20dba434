"""`verispec ngram build`: count the n-grams of a text corpus, tokenized with the target's tokenizer.

The corpus is files and directories: a directory is walked for the configured suffixes (.py, .md,
.txt, .rst by default; hidden folders and files over 1 MiB are skipped), and a .jsonl file contributes every string in each line's JSON (a prompt set
such as Spec-Bench's). N-grams never cross a file (or a JSONL string) boundary. Counting runs in
chunks: each chunk's packed (context hash, next token) keys are reduced with `np.unique`, then merged
into the running totals, so memory follows the number of distinct n-grams, not the corpus size.
At the end rare n-grams (count < min_count) are dropped and each context keeps only its top_k most
frequent continuations, which is what drafting uses.
"""

from __future__ import annotations

import hashlib
import json
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from verispec.errors import VerispecError
from verispec.ngram.table import NGramTable, context_hashes, tokenizer_fingerprint, vocab_bits

MAX_ORDER = 8


@dataclass(frozen=True)
class NGramBuildConfig:
    """How a corpus n-gram table is built.

    max_n: the longest n-gram counted (contexts of max_n - 1 tokens), 2..8. Default 4.
    min_count: n-grams seen fewer times are dropped. Default 2.
    top_k: continuations kept per context (the most frequent). Default 8.
    max_files: read at most this many files (None: all).
    max_tokens: stop after about this many corpus tokens (None: no limit).
    suffixes: file name endings read when walking a directory.
    max_file_bytes: larger files found in a directory are skipped (generated or data files). Default 1 MiB.
    """

    max_n: int = 4
    min_count: int = 2
    top_k: int = 8
    max_files: int | None = None
    max_tokens: int | None = None
    suffixes: tuple[str, ...] = (".py", ".md", ".txt", ".rst")
    max_file_bytes: int = 1 << 20

    def __post_init__(self) -> None:
        if int(self.max_n) != self.max_n or not (2 <= self.max_n <= MAX_ORDER):
            raise VerispecError(f"max_n must be an integer in 2..{MAX_ORDER}, got {self.max_n}")
        if int(self.min_count) != self.min_count or self.min_count < 1:
            raise VerispecError(f"min_count must be an integer >= 1, got {self.min_count}")
        if int(self.top_k) != self.top_k or self.top_k < 1:
            raise VerispecError(f"top_k must be an integer >= 1, got {self.top_k}")
        for name in ("max_files", "max_tokens", "max_file_bytes"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise VerispecError(f"{name} must be >= 1, got {value}")


def default_corpus() -> list[Path]:
    """Python sources and docs of the installed packages: real code and prose, available offline."""
    return [Path(sysconfig.get_paths()["purelib"])]


def corpus_files(paths: list[str | Path], config: NGramBuildConfig) -> list[Path]:
    """The files to read, in a stable order: given files as they are, directories walked."""
    if not paths:
        raise VerispecError("no corpus given")
    files: list[Path] = []
    for raw in paths:
        path = Path(raw).expanduser()
        if path.is_file():
            files.append(path)
        elif path.is_dir():
            found = [f for f in path.rglob("*") if f.suffix in config.suffixes and f.is_file()
                     and not any(part.startswith(".") for part in f.relative_to(path).parts)
                     and f.stat().st_size <= config.max_file_bytes]
            # A stable shuffled order, so that --max-files / --max-tokens sample the whole tree.
            files.extend(sorted(found, key=lambda f: hashlib.sha1(str(f.relative_to(path)).encode()).hexdigest()))
        else:
            raise VerispecError(f"corpus path not found: {raw}")
    if config.max_files is not None:
        files = files[: config.max_files]
    if not files:
        raise VerispecError(f"no corpus files ({', '.join(config.suffixes)} or .jsonl) under {', '.join(map(str, paths))}")
    return files


def _strings(value) -> Iterator[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, list):
        for v in value:
            yield from _strings(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _strings(v)


def file_texts(path: Path) -> list[str]:
    """The texts of one corpus file (JSONL: every string of every line); [] for unreadable or binary files."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return []
    if path.suffix != ".jsonl":
        return [text] if text.strip() else []
    texts = []
    for line in text.splitlines():
        if line.strip():
            try:
                texts.extend(s for s in _strings(json.loads(line)) if s.strip())
            except json.JSONDecodeError:
                raise VerispecError(f"{path} is not JSONL: a line is not valid JSON") from None
    return texts


class NGramCounter:
    """Running counts of packed (context hash, next token) keys for orders 1..max_n."""

    CHUNK = 1 << 22  # keys gathered before they are reduced and merged

    def __init__(self, max_n: int, vocab_size: int) -> None:
        self.max_n, self.bits = max_n, vocab_bits(vocab_size)
        self.keys = [np.zeros(0, dtype=np.uint64) for _ in range(max_n + 1)]  # sorted, unique
        self.counts = [np.zeros(0, dtype=np.int64) for _ in range(max_n + 1)]
        self._pending: list[list[np.ndarray]] = [[] for _ in range(max_n + 1)]
        self._pending_size = 0
        self.tokens = 0

    def add(self, tokens: np.ndarray) -> None:
        """Count every n-gram of one document. tokens: (T,) int."""
        T = tokens.shape[0]
        self.tokens += T
        bits = np.uint64(self.bits)
        for n in range(1, self.max_n + 1):
            if T < n:
                break
            hashes = context_hashes(tokens[: T - 1], n - 1) if n > 1 else context_hashes(tokens[:0], 0).repeat(T)
            packed = ((hashes[: T - n + 1] >> bits) << bits) | tokens[n - 1 :].astype(np.uint64)  # (T - n + 1,)
            self._pending[n].append(packed)
            self._pending_size += packed.size
        if self._pending_size >= self.CHUNK:
            self.flush()

    def flush(self) -> None:
        for n in range(1, self.max_n + 1):
            if not self._pending[n]:
                continue
            new_keys, new_counts = np.unique(np.concatenate(self._pending[n]), return_counts=True)
            self._pending[n] = []
            keys = np.concatenate([self.keys[n], new_keys])
            counts = np.concatenate([self.counts[n], new_counts.astype(np.int64)])
            order = np.argsort(keys, kind="stable")
            keys, counts = keys[order], counts[order]
            starts = np.flatnonzero(np.r_[True, keys[1:] != keys[:-1]])
            self.keys[n], self.counts[n] = keys[starts], np.add.reduceat(counts, starts)
        self._pending_size = 0

    def table(self, config: NGramBuildConfig, vocab_size: int, header: dict) -> NGramTable:
        """Prune (min_count, top_k per context) and freeze into an NGramTable."""
        self.flush()
        bits = np.uint64(self.bits)
        keys_out, counts_out = [np.zeros(0, dtype=np.uint64)], [np.zeros(0, dtype=np.uint32)]
        for n in range(1, self.max_n + 1):
            keep = self.counts[n] >= config.min_count
            keys, counts = self.keys[n][keep], self.counts[n][keep]
            contexts = keys >> bits
            order = np.lexsort((-counts, contexts))  # by context, most frequent first
            contexts_sorted = contexts[order]
            starts = np.r_[True, contexts_sorted[1:] != contexts_sorted[:-1]]  # (R,) first row of each context
            first = np.maximum.accumulate(np.where(starts, np.arange(order.size), 0))
            ranked = order[np.arange(order.size) - first < config.top_k]
            ranked.sort()  # back to key order
            keys_out.append(keys[ranked])
            counts_out.append(np.minimum(counts[ranked], np.iinfo(np.uint32).max).astype(np.uint32))
        return NGramTable(self.max_n, vocab_size, keys_out, counts_out, header)


def build_table(tokenizer, paths: list[str | Path], config: NGramBuildConfig = NGramBuildConfig(),
                tokenizer_name: str = "", show_progress: bool = True) -> tuple[NGramTable, dict]:
    """Tokenize the corpus and count its n-grams; returns the table and a summary (files, tokens, n-grams)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    from verispec.console import stderr_console

    files = corpus_files(paths, config)
    vocab_size = len(tokenizer)
    counter = NGramCounter(config.max_n, vocab_size)
    used = 0
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn())
    with Progress(*columns, console=stderr_console(), disable=not show_progress, transient=True) as progress:
        task = progress.add_task("counting n-grams", total=len(files))
        batch: list[str] = []
        for i, path in enumerate(files):
            batch.extend(file_texts(path))
            used += 1
            if sum(map(len, batch)) >= 1 << 20 or i == len(files) - 1:
                for ids in tokenizer(batch, add_special_tokens=False)["input_ids"] if batch else []:
                    counter.add(np.asarray(ids, dtype=np.int64))
                batch = []
                progress.update(task, completed=i + 1, description=f"counting n-grams: {counter.tokens:,} tokens")
                if config.max_tokens is not None and counter.tokens >= config.max_tokens:
                    break
    if counter.tokens == 0:
        raise VerispecError(f"the corpus has no text to count ({len(files)} file(s) read, all empty or unreadable)")
    header = {"tokenizer": tokenizer_name, "tokenizer_sha256": tokenizer_fingerprint(tokenizer),
              "corpus": [str(p) for p in paths], "files": used, "tokens": counter.tokens,
              "min_count": config.min_count, "top_k": config.top_k}
    table = counter.table(config, vocab_size, header)
    return table, {"files": used, "tokens": counter.tokens, "ngrams": table.num_ngrams}
