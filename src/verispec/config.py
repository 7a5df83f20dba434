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


@dataclass(frozen=True)
class ServeConfig:
    """`verispec serve`: where the server listens and the limits that keep it safe.

    Attributes:
        host: interface to bind; the default serves this machine only. Default "127.0.0.1".
        port: TCP port. Default 8000.
        api_key: if set, every /v1 and /metrics request needs `Authorization: Bearer <api_key>`.
        served_model_name: the model id clients name (None: the target's name).
        max_batch_size: sequences decoded together; 1 turns continuous batching off. Default 8.
        max_queue: requests waiting for a batch slot; more get HTTP 429. Default 64.
        request_timeout: seconds from arrival to the last token before a request is cut. Default 300.
        max_body_bytes: largest request body; larger gets HTTP 413. Default 1 MiB.
        max_prompt_tokens: longest prompt in tokens (None: the context window less one token).
        max_tokens_limit: largest max_tokens a request may ask (None: up to the context window).
        max_draft_tokens: largest per-request K (`speculative.K`). Default 16.
        shutdown_timeout: seconds in-flight requests get to finish on shutdown before being cut. Default 10.
    """

    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    served_model_name: str | None = None
    max_batch_size: int = 8
    max_queue: int = 64
    request_timeout: float = 300.0
    max_body_bytes: int = 1 << 20
    max_prompt_tokens: int | None = None
    max_tokens_limit: int | None = None
    max_draft_tokens: int = 16
    shutdown_timeout: float = 10.0

    def __post_init__(self) -> None:
        if not (0 <= self.port <= 65535):
            raise VerispecError(f"port must be in 0..65535, got {self.port}")
        if self.api_key is not None and not self.api_key.strip():
            raise VerispecError("the API key is empty")
        for name in ("max_batch_size", "max_queue", "max_body_bytes", "max_draft_tokens"):
            if getattr(self, name) < 1:
                raise VerispecError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("max_prompt_tokens", "max_tokens_limit"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise VerispecError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("request_timeout", "shutdown_timeout"):
            if not math.isfinite(getattr(self, name)) or getattr(self, name) <= 0:
                raise VerispecError(f"{name} must be a positive number of seconds, got {getattr(self, name)}")
