"""Prefix reuse across requests: the target's cache of prompts (and answers) already read, kept by their token ids.

A conversation resends itself every turn, agents resend their tools and files, and many requests share a system
prompt. `PrefixStore` keeps copies of finished rows' caches (`core.protocols.PrefixState.read_prefix`), bounded by
bytes and evicted least recently used first; a joining row starts from the longest stored prefix of its prompt
(`take`), so only the rest is read. The native runner's kernels are batch-invariant, so a reused position is the
same bits a pass would have written: reuse changes the time to the first token, never a token (tested: a
conversation decoded with and without reuse, greedy and seeded sampled, bit for bit).

Entries are whole rows (the tokens a row held and its cache over them); a prefix of an entry is reused by copying
that many positions. An entry that is a prefix of a newer one is dropped (the newer covers it). Lookups compare token
ids as numpy arrays: a store of a few dozen conversations of a few thousand tokens answers in well under a
millisecond, far less than reading one token.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from verispec.core.protocols import PrefixState

log = logging.getLogger("verispec.prefix")


@dataclass
class PrefixStats:
    """lookups: rows that asked; hits: rows that got a prefix; tokens_reused: positions not read again; held_bytes:
    what the store holds now; entries: how many; evicted: entries dropped for room."""

    lookups: int = 0
    hits: int = 0
    tokens_reused: int = 0
    held_bytes: int = 0
    entries: int = 0
    evicted: int = 0


class PrefixStore:
    """Copies of rows' caches by their token ids, at most `budget_bytes` together (least recently used out first).

    Thread-safe: the decoding thread adds and reads, a metrics reader reads `stats`."""

    def __init__(self, budget_bytes: int, min_tokens: int = 16) -> None:
        self.budget_bytes = int(budget_bytes)
        self.min_tokens = min_tokens  # shorter prefixes are not worth a copy
        self._entries: OrderedDict[int, tuple[np.ndarray, object]] = OrderedDict()  # id -> (tokens, prefix)
        self._next = 0
        self._lock = threading.Lock()
        self.stats = PrefixStats()

    @classmethod
    def of(cls, budget_bytes: int) -> PrefixStore | None:
        """A store of `budget_bytes`, or None for 0 (reuse off): what every `reuse_prefixes` keeps."""
        return cls(budget_bytes) if budget_bytes > 0 else None

    def try_take(self, state: PrefixState, row: int, tokens: list[int], who: str, limit: int | None = None) -> int:
        """`take` where reuse is optional (a drafter's own store): a failure is logged, naming `who`, and takes 0."""
        try:
            return self.take(state, row, tokens, limit)
        except Exception as err:  # noqa: BLE001 - the row then reads its tokens itself
            log.warning("%s reused no prefix (%s: %s)", who, type(err).__name__, err)
            return 0

    def try_keep(self, state: PrefixState, row: int, tokens: list[int], who: str) -> None:
        """`keep` where reuse is optional: a failure is logged, naming `who`; nothing is lost but the reuse."""
        try:
            self.keep(state, row, tokens)
        except Exception as err:  # noqa: BLE001
            log.warning("%s kept no prefix (%s: %s)", who, type(err).__name__, err)

    def take(self, state: PrefixState, row: int, tokens: list[int], limit: int | None = None) -> int:
        """Start empty row `row` from the longest stored prefix of `tokens` (at most all but the last: the pass must
        read one token to give the logits after them; at most `limit` positions where given). Returns the positions
        taken (0: none)."""
        want = np.asarray(tokens[: len(tokens) - 1 if limit is None else min(len(tokens) - 1, limit)], dtype=np.int64)
        with self._lock:
            self.stats.lookups += 1
            best, best_len = None, 0
            for key, (stored, prefix) in self._entries.items():
                n = min(len(stored), len(want))
                if n <= best_len:
                    continue
                diff = np.flatnonzero(stored[:n] != want[:n])
                common = int(diff[0]) if diff.size else n
                if common > best_len:
                    best, best_len = key, common
            if best is None or best_len < self.min_tokens:
                return 0
            self._entries.move_to_end(best)
            _, prefix = self._entries[best]
            self.stats.hits += 1
            self.stats.tokens_reused += best_len
        state.write_prefix(row, prefix.head(best_len))
        return best_len

    def keep(self, state: PrefixState, row: int, tokens: list[int]) -> None:
        """Store row `row`'s committed cache over `tokens` (the row's first len(tokens) positions)."""
        if len(tokens) < self.min_tokens:
            return
        prefix = state.read_prefix(row, len(tokens))
        if prefix.nbytes > self.budget_bytes:
            return
        ids = np.asarray(tokens, dtype=np.int64)
        with self._lock:
            for key, (stored, _) in list(self._entries.items()):  # covered by this one: dropped
                if len(stored) <= len(ids) and np.array_equal(stored, ids[: len(stored)]):
                    self._drop(key)
                elif len(stored) > len(ids) and np.array_equal(stored[: len(ids)], ids):
                    self._entries.move_to_end(key)  # this one is covered: the longer entry is fresh again
                    return
            self._entries[self._next] = (ids, prefix)
            self._next += 1
            self.stats.held_bytes += prefix.nbytes
            while self.stats.held_bytes > self.budget_bytes:
                self._drop(next(iter(self._entries)))
                self.stats.evicted += 1
            self.stats.entries = len(self._entries)

    def _drop(self, key: int) -> None:
        _, prefix = self._entries.pop(key)
        self.stats.held_bytes -= prefix.nbytes
        self.stats.entries = len(self._entries)

