"""N-gram count tables: the frozen corpus table (a `.ngram` file) and mutable in-memory counts.

An n-gram of order n is a context of n - 1 tokens followed by a next token. A context is hashed to
an unsigned integer (`context_hash`); the corpus table packs each (context, next token) pair into one
uint64 key = (hash << vocab_bits) | token and keeps, per order, the keys sorted with their counts:

    keys_{n}    (R_n,) uint64, sorted: every context's continuations are one contiguous run
    counts_{n}  (R_n,) uint32

A lookup is two binary searches. Hash collisions (two contexts sharing a hash) are possible in
principle (64 - vocab_bits bits, about 2^46 for a 150k vocabulary) and harmless to exactness: a
drafter may propose anything as long as it reports the distribution it drew from.

The file is safetensors (those arrays) with a JSON header in its metadata: format and version,
max_n, the vocabulary size and a sha256 of the tokenizer's vocabulary, so that a table built with
another tokenizer is refused by name instead of drafting nonsense ids.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from verispec.errors import VerispecError

FORMAT = "verispec-ngram"
VERSION = 1
MASK64 = (1 << 64) - 1
_MULT = 0x9E3779B97F4A7C15
_MIX1, _MIX2 = 0xFF51AFD7ED558CCD, 0xC4CEB9FE1A85EC53


def vocab_bits(vocab_size: int) -> int:
    """Bits needed to hold any token id below vocab_size."""
    return max(1, int(vocab_size - 1).bit_length())


def _fmix(x: int) -> int:
    x ^= x >> 33
    x = (x * _MIX1) & MASK64
    x ^= x >> 33
    x = (x * _MIX2) & MASK64
    return x ^ (x >> 33)


def context_hash(context: tuple[int, ...] | list[int]) -> int:
    """64-bit hash of a context (oldest token first); the empty context (unigrams) hashes to a constant."""
    h = _fmix((len(context) + 1) * _MULT & MASK64)
    for t in context:
        h = _fmix(((h ^ (int(t) + 1)) * _MULT) & MASK64)
    return h


def context_hashes(tokens: np.ndarray, length: int) -> np.ndarray:
    """Hashes of every window of `length` tokens, equal to `context_hash` on each window.

    tokens: (T,) int -> (T - length + 1,) uint64, element i hashing tokens[i : i + length].
    """
    T = tokens.shape[0]
    count = T - length + 1
    if count <= 0:
        return np.zeros(0, dtype=np.uint64)
    with np.errstate(over="ignore"):
        h = np.full(count, _fmix((length + 1) * _MULT & MASK64), dtype=np.uint64)  # (count,)
        for j in range(length):
            x = (h ^ (tokens[j : j + count].astype(np.uint64) + np.uint64(1))) * np.uint64(_MULT)
            x ^= x >> np.uint64(33)
            x *= np.uint64(_MIX1)
            x ^= x >> np.uint64(33)
            x *= np.uint64(_MIX2)
            h = x ^ (x >> np.uint64(33))
    return h


def tokenizer_fingerprint(tokenizer) -> str:
    """sha256 of the tokenizer's vocabulary (every token string with its id)."""
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: (kv[1], kv[0]))
    return hashlib.sha256(json.dumps(vocab, ensure_ascii=False).encode()).hexdigest()


@dataclass
class NGramTable:
    """Corpus n-gram counts for orders 1..max_n (see the module docstring for the layout).

    keys[n], counts[n]: the sorted packed keys and counts of order n (keys[0] is unused).
    header: the JSON header (tokenizer fingerprint, corpus summary, build settings).
    """

    max_n: int
    vocab_size: int
    keys: list[np.ndarray]
    counts: list[np.ndarray]
    header: dict

    def __post_init__(self) -> None:
        self.bits = vocab_bits(self.vocab_size)
        self._token_mask = np.uint64((1 << self.bits) - 1)

    @property
    def num_ngrams(self) -> int:
        return sum(int(k.size) for k in self.keys[1:])

    def continuations(self, context: tuple[int, ...] | list[int]) -> tuple[np.ndarray, np.ndarray]:
        """Next tokens seen after `context` (order len(context) + 1) and their counts, most frequent first.

        Returns (tokens (m,) int64, counts (m,) int64); both empty when the context was never seen.
        """
        n = len(context) + 1
        if n > self.max_n:
            raise ValueError(f"context of {len(context)} tokens is longer than this table's max_n - 1 = {self.max_n - 1}")
        keys = self.keys[n]
        base = (context_hash(context) >> self.bits) << self.bits
        lo = int(np.searchsorted(keys, np.uint64(base), side="left"))
        hi = int(np.searchsorted(keys, np.uint64(base + (1 << self.bits) - 1), side="right"))
        if hi <= lo:
            return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
        tokens = (keys[lo:hi] & self._token_mask).astype(np.int64)
        counts = self.counts[n][lo:hi].astype(np.int64)
        order = np.argsort(-counts, kind="stable")
        return tokens[order], counts[order]

    # --- file ------------------------------------------------------------------------------------
    def save(self, path: str | Path) -> int:
        """Write the table atomically (`verispec.atomic`: a kill leaves the previous table); returns the file
        size in bytes."""
        from safetensors.numpy import save_file

        from verispec.atomic import atomic_path

        tensors = {}
        for n in range(1, self.max_n + 1):
            tensors[f"keys_{n}"] = np.ascontiguousarray(self.keys[n], dtype=np.uint64)
            tensors[f"counts_{n}"] = np.ascontiguousarray(self.counts[n], dtype=np.uint32)
        header = {**self.header, "format": FORMAT, "version": VERSION, "max_n": self.max_n, "vocab_size": self.vocab_size}
        path = Path(path)
        try:
            with atomic_path(path) as tmp:
                save_file(tensors, str(tmp), metadata={"verispec": json.dumps(header)})
        except OSError as err:
            raise VerispecError(f"cannot write n-gram table {path}: {err.strerror}") from None
        return path.stat().st_size

    @classmethod
    def load(cls, path: str | Path, tokenizer=None) -> NGramTable:
        """Read a table; with `tokenizer`, refuse a table built for another vocabulary."""
        from safetensors import SafetensorError, safe_open

        path = Path(path)
        if not path.is_file():
            raise VerispecError(f"n-gram table not found: {path} (build one with `verispec ngram build`)")
        try:
            with safe_open(str(path), framework="np") as f:
                meta = f.metadata() or {}
                header = json.loads(meta.get("verispec", "{}"))
                if header.get("format") != FORMAT:
                    raise VerispecError(f"{path} is not a verispec n-gram table (built by `verispec ngram build`)")
                if header.get("version") != VERSION:
                    raise VerispecError(f"{path} is n-gram table version {header.get('version')}; "
                                        f"this verispec reads version {VERSION}")
                max_n = int(header["max_n"])
                keys = [np.zeros(0, dtype=np.uint64)] + [f.get_tensor(f"keys_{n}") for n in range(1, max_n + 1)]
                counts = [np.zeros(0, dtype=np.uint32)] + [f.get_tensor(f"counts_{n}") for n in range(1, max_n + 1)]
        except (SafetensorError, OSError, ValueError, KeyError) as err:
            raise VerispecError(f"{path} is not a readable n-gram table ({type(err).__name__}: {err})") from None
        table = cls(max_n, int(header["vocab_size"]), keys, counts, header)
        if tokenizer is not None:
            table.check_tokenizer(tokenizer, str(path))
        return table

    def check_tokenizer(self, tokenizer, where: str = "the n-gram table") -> None:
        expected = self.header.get("tokenizer_sha256")
        if expected != tokenizer_fingerprint(tokenizer):
            raise VerispecError(
                f"{where} was built with another tokenizer ('{self.header.get('tokenizer', '?')}', "
                f"{self.vocab_size} tokens) than the target's ({len(tokenizer)} tokens): "
                "rebuild it with `verispec ngram build --tokenizer <the target>`"
            )


class NGramCounts:
    """Mutable n-gram counts (orders 1..max_n) in dictionaries: a sequence's running context, or
    counts learned online. tables[n] maps a context tuple of n - 1 tokens to {next token: count};
    a context's dict is kept in update order (the latest update last), so ties can favour recency."""

    def __init__(self, max_n: int) -> None:
        self.max_n = max_n
        self.tables: list[dict[tuple[int, ...], dict[int, float]]] = [{} for _ in range(max_n + 1)]
        self.length = 0  # tokens of the stream added by `add_stream` so far

    def add(self, context: tuple[int, ...], token: int, weight: float = 1.0) -> None:
        """Count `token` after `context` (len(context) + 1 <= max_n)."""
        following = self.tables[len(context) + 1].setdefault(context, {})
        following[token] = following.pop(token, 0.0) + weight

    def add_stream(self, tokens: list[int]) -> None:
        """Count the n-grams ending at the tokens of `tokens` not counted yet (`tokens` grows between calls)."""
        if len(tokens) < self.length:  # the stream was cut (a stop string): recount from scratch
            self.tables = [{} for _ in range(self.max_n + 1)]
            self.length = 0
        for i in range(self.length, len(tokens)):
            token = tokens[i]
            for n in range(1, min(self.max_n, i + 1) + 1):
                self.add(tuple(tokens[i - n + 1 : i]), token)
        self.length = len(tokens)

    def continuations(self, context: tuple[int, ...]) -> dict[int, float]:
        """{next token: count} after `context` (empty when unseen); do not modify the result."""
        return self.tables[len(context) + 1].get(context, {})

    def __len__(self) -> int:
        return sum(len(t) for t in self.tables)
