"""Prompt lookup drafting (Saxena 2023): copy what followed the last matching n-gram in the context.

Deterministic: q is one-hot, so the verifier accepts draft x with probability p(x) when sampling
and recovers from p with x removed; at temperature 0 it accepts while x equals the argmax.

Trees: the continuations of several earlier matches (longest n-gram first, most recent match first)
are merged into a trie, so candidates that share a start share nodes. A static shape caps each
node's children per depth; a budget caps the trie's nodes (its depth is K).

Chains stop early under a sequence's `draft_stop` (see verispec.core.stopping): the chance that a
copied token is accepted is calibrated online by the length of the match it follows: how many tokens
before the copy agree with the context's end, counted past the n-gram that found it (up to MAX_MATCH).
"""

from __future__ import annotations

import numpy as np
import torch

from verispec.config import PromptLookupConfig, TreeConfig
from verispec.core.drafter import EMPTY_DRAFT, Draft, Drafter, Traits
from verispec.core.sequence import Sequence
from verispec.core.stopping import AcceptanceCalibration, chain_length
from verispec.tree import breadth_first, tree_from_parents

MAX_MATCHES = 64  # continuations read per trie; more only cost time
MAX_MATCH = 32  # a match's length is counted up to this many tokens (see lookup_match)


def lookup(tokens: list[int], max_tokens: int, config: PromptLookupConfig) -> list[int]:
    """Continuation of the most recent earlier match of the longest suffix n-gram (max_ngram down to min_ngram)."""
    return lookup_match(tokens, max_tokens, config)[0]


def lookup_match(tokens: list[int], max_tokens: int, config: PromptLookupConfig) -> tuple[list[int], int]:
    """`lookup`, with the length of the match it copies after (0 where nothing matched): the number of
    tokens before the copied continuation that equal the context's last tokens, at least the n-gram
    that found it and at most MAX_MATCH."""
    if max_tokens <= 0:
        return [], 0
    arr = np.asarray(tokens, dtype=np.int64)  # (T,)
    T = arr.size
    for n in range(min(config.max_ngram, T - 1), config.min_ngram - 1, -1):
        windows = np.lib.stride_tricks.sliding_window_view(arr[: T - 1], n)  # (T - n, n) starts 0..T-n-1
        hits = np.flatnonzero((windows == arr[T - n :]).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return arr[start : start + max_tokens].tolist(), _match_length(arr, start)
    return [], 0


def _match_length(arr: np.ndarray, start: int) -> int:
    """How many tokens before arr[start] equal the last tokens of arr, up to MAX_MATCH. arr: (T,)."""
    width = min(MAX_MATCH, start)
    before = arr[start - width : start][::-1]  # (width,) the tokens before the copy, nearest first
    suffix = arr[arr.size - width :][::-1]  # (width,) the context's last tokens, last first
    differ = np.flatnonzero(before != suffix)
    return int(differ[0]) if differ.size else width


def lookup_all(tokens: list[int], max_tokens: int, config: PromptLookupConfig, limit: int = MAX_MATCHES) -> list[list[int]]:
    """Continuations (up to max_tokens each) of earlier matches of the suffix n-grams, longest n first,
    most recent match first; the first is `lookup`'s. At most `limit`."""
    if max_tokens <= 0:
        return []
    arr = np.asarray(tokens, dtype=np.int64)  # (T,)
    T = arr.size
    found: list[list[int]] = []
    starts: set[int] = set()  # a shorter n-gram matches again where a longer one did: read each start once
    for n in range(min(config.max_ngram, T - 1), config.min_ngram - 1, -1):
        windows = np.lib.stride_tricks.sliding_window_view(arr[: T - 1], n)  # (T - n, n) starts 0..T-n-1
        for hit in np.flatnonzero((windows == arr[T - n :]).all(axis=1))[::-1]:
            start = int(hit) + n
            if start in starts:
                continue
            starts.add(start)
            found.append(arr[start : start + max_tokens].tolist())
            if len(found) == limit:
                return found
    return found


def build_trie(continuations: list[list[int]], tree: TreeConfig, depth: int) -> tuple[list[int], tuple[int, ...]]:
    """Merge continuations into a trie, breadth first, children in insertion order.

    A node at depth d gets at most shape[d - 1] children (static) and the trie at most `budget` nodes
    (dynamic); a continuation stops where it would break either limit. Returns (tokens, parents).
    """
    tokens: list[int] = []
    parents: list[int] = []
    children: list[dict[int, int]] = [{}]  # children[node + 1]: token -> node
    limit = tree.size_upper_bound(depth)
    for continuation in continuations:
        node = -1
        for d, token in enumerate(continuation[:depth]):
            if token in children[node + 1]:
                node = children[node + 1][token]
                continue
            if len(tokens) >= limit or (tree.shape is not None and len(children[node + 1]) >= tree.shape[d]):
                break
            children[node + 1][token] = len(tokens)
            children.append({})
            tokens.append(token)
            parents.append(node)
            node = len(tokens) - 1
        if len(tokens) >= limit:
            break
    order, new_parents = breadth_first(parents, list(range(len(tokens))))
    return [tokens[i] for i in order], new_parents


class PromptLookupDrafter(Drafter):
    """n-gram match in the sequence's own context (prompt and generated tokens)."""

    name = "ngram"
    traits = Traits(trees=True, stops_chains=True, chunked_prefill=True, follows_prefixes=True)

    def __init__(self, config: PromptLookupConfig = PromptLookupConfig()) -> None:
        self.config = config
        self.calibration = AcceptanceCalibration()  # where chains stop (seq.draft_stop, see core.stopping)
        self.stop_keys: list[list[tuple]] = []  # per row, after propose: calibration keys of its drafts


    def propose(self, sequences: list[Sequence], depths: list[int],
                trees: list[TreeConfig] | None = None) -> list[Draft]:
        drafts, self.stop_keys = [], []
        for b, (seq, n) in enumerate(zip(sequences, depths)):
            if trees is not None:  # a trie of every continuation found, shaped by the row's tree
                tokens, parents = build_trie(lookup_all(seq.tokens, n, self.config), trees[b], n)
                drafts.append(Draft(torch.tensor(tokens, dtype=torch.long), tree=tree_from_parents(parents))
                              if tokens else EMPTY_DRAFT)
                continue
            found, match = lookup_match(seq.tokens, n, self.config)
            keys = []
            if found and seq.draft_stop is not None:
                # Copied token s (from 0) follows a match `match + s` tokens long: the copies before it extend it.
                keys = [AcceptanceCalibration.copy_key(match + s, seq.processors.greedy) for s in range(len(found))]
                found = found[: chain_length(keys, seq.draft_stop, self.calibration)]
                keys = keys[: len(found)]
            self.stop_keys.append(keys)
            drafts.append(Draft(torch.tensor(found, dtype=torch.long)) if found else EMPTY_DRAFT)
        return drafts

    def continuation(self, b: int, seq: Sequence, after: list[int], depth: int) -> list[int]:
        return lookup_match(seq.tokens + after, depth, self.config)[0] if depth > 0 else []

    def commit(self, sequences: list[Sequence], drafts: list[Draft], paths: list[tuple[int, ...]]) -> None:
        for keys, path in zip(self.stop_keys, paths):
            if keys:
                self.calibration.observe(keys, len(path))
        self.stop_keys = []
