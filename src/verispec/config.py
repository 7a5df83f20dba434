"""Frozen configuration dataclasses: the single source of defaults.

The CLI, the Python API and (later) the server only build these objects; none of them
repeats a default. Validation happens here, so bad values fail early with a clear message.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from verispec.errors import VerispecError


@dataclass(frozen=True)
class SamplingConfig:
    """How a distribution over the vocabulary is made from logits.

    The same processing is applied to the target's logits (giving p) and to the draft's
    logits (giving q), so verification compares like with like.

    Attributes:
        temperature: 0 means greedy (argmax), not a tiny temperature. Default 1.0.
        top_k: keep the k most likely tokens; 0 disables. Default 0.
        top_p: nucleus sampling mass in (0, 1]; 1.0 disables. Default 1.0.
        min_p: drop tokens whose probability is below min_p x the top probability; 0 disables.
        repetition_penalty: CTRL-style penalty (> 0) on tokens already in the context; 1.0 disables.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0

    def __post_init__(self) -> None:
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise VerispecError(f"temperature must be >= 0 (0 means greedy), got {self.temperature}")
        if int(self.top_k) != self.top_k or self.top_k < 0:
            raise VerispecError(f"top_k must be an integer >= 0 (0 disables it), got {self.top_k}")
        if not (0.0 < self.top_p <= 1.0):
            raise VerispecError(f"top_p must be in (0, 1], got {self.top_p}")
        if not (0.0 <= self.min_p <= 1.0):
            raise VerispecError(f"min_p must be in [0, 1], got {self.min_p}")
        if not math.isfinite(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise VerispecError(f"repetition_penalty must be > 0 (1.0 disables it), got {self.repetition_penalty}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True)
class SpecConfig:
    """How a speculative generation runs.

    Attributes:
        num_draft_tokens: K, the number of draft tokens proposed per step (>= 1). Default 4.
        max_new_tokens: generation stops after this many new tokens, never more. Default 128.
        stop: strings that end generation; the returned text stops before the first match.
        stop_at_eos: stop when the target's end-of-sequence token is committed. Default True.
    """

    num_draft_tokens: int = 4
    max_new_tokens: int = 128
    stop: tuple[str, ...] = field(default_factory=tuple)
    stop_at_eos: bool = True

    def __post_init__(self) -> None:
        if int(self.num_draft_tokens) != self.num_draft_tokens or self.num_draft_tokens < 1:
            raise VerispecError(f"num_draft_tokens (K) must be an integer >= 1, got {self.num_draft_tokens}")
        if int(self.max_new_tokens) != self.max_new_tokens or self.max_new_tokens < 1:
            raise VerispecError(f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens}")
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        if any(not isinstance(s, str) or s == "" for s in self.stop):
            raise VerispecError("stop strings must be non-empty strings")
        object.__setattr__(self, "stop", tuple(self.stop))


@dataclass(frozen=True)
class PromptLookupConfig:
    """Prompt lookup (n-gram match in the context) drafting.

    Attributes:
        max_ngram: the longest suffix n-gram searched for first. Default 3.
        min_ngram: the shortest suffix n-gram tried before giving up. Default 1.
    """

    max_ngram: int = 3
    min_ngram: int = 1

    def __post_init__(self) -> None:
        if self.min_ngram < 1 or self.max_ngram < self.min_ngram:
            raise VerispecError(
                f"n-gram sizes need 1 <= min_ngram <= max_ngram, got min={self.min_ngram} max={self.max_ngram}"
            )
