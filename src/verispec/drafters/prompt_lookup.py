"""Prompt lookup drafting (Saxena 2023): copy what followed the last matching n-gram in the context.

Deterministic: q is one-hot, so the verifier accepts draft x with probability p(x) when sampling
and recovers from p with x removed; at temperature 0 it accepts while x equals the argmax.
"""

from __future__ import annotations

import numpy as np
import torch

from verispec.config import PromptLookupConfig
from verispec.drafters.base import EMPTY_DRAFT, Draft, Drafter
from verispec.sequence import Sequence


def lookup(tokens: list[int], max_tokens: int, config: PromptLookupConfig) -> list[int]:
    """Continuation of the most recent earlier match of the longest suffix n-gram (max_ngram down to min_ngram)."""
    if max_tokens <= 0:
        return []
    arr = np.asarray(tokens, dtype=np.int64)  # (T,)
    T = arr.size
    for n in range(min(config.max_ngram, T - 1), config.min_ngram - 1, -1):
        windows = np.lib.stride_tricks.sliding_window_view(arr[: T - 1], n)  # (T - n, n) starts 0..T-n-1
        hits = np.flatnonzero((windows == arr[T - n :]).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return arr[start : start + max_tokens].tolist()
    return []


class PromptLookupDrafter(Drafter):
    """n-gram match in the sequence's own context (prompt and generated tokens)."""

    name = "ngram"

    def __init__(self, config: PromptLookupConfig = PromptLookupConfig()) -> None:
        self.config = config

    def propose(self, sequences: list[Sequence], max_tokens: list[int]) -> list[Draft]:
        drafts = []
        for seq, n in zip(sequences, max_tokens):
            found = lookup(seq.tokens, n, self.config)
            drafts.append(Draft(torch.tensor(found, dtype=torch.long)) if found else EMPTY_DRAFT)
        return drafts
