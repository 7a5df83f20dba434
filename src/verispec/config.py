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


@dataclass(frozen=True)
class NGramConfig:
    """Corpus n-gram drafting (`--draft ngram-corpus[:TABLE]`).

    At each draft position the drafter backs off from the longest context (max_n - 1 tokens) to the
    shortest (min_n - 1 tokens) and drafts from the first order where any source has counts: the
    corpus table, the sequence's own context (prompt and generated tokens) and the counts learned
    online; each source's counts are normalized, then mixed with these weights.

    Attributes:
        max_n: the longest n-gram used (capped by the table's). Default 4.
        min_n: the shortest; with no match down to it, drafting stops early. Default 2.
        corpus_weight, context_weight, adapted_weight: mixture weights of the sources. Defaults 1, 3, 3.
        match_temperature: sample drafts from q^(1/T) (renormalized) at temperature T, closer to the
            target's processed p. Default True.
        min_prob: stop drafting where the most likely continuation has q below this. Default 0 (never).
        adapted_contexts: contexts per order the online counts keep (oldest dropped first). Default 200000.
    """

    max_n: int = 4
    min_n: int = 2
    corpus_weight: float = 1.0
    context_weight: float = 3.0
    adapted_weight: float = 3.0
    match_temperature: bool = True
    min_prob: float = 0.0
    adapted_contexts: int = 200_000

    def __post_init__(self) -> None:
        if self.min_n < 1 or self.max_n < self.min_n:
            raise VerispecError(f"n-gram orders need 1 <= min_n <= max_n, got min_n={self.min_n} max_n={self.max_n}")
        for name in ("corpus_weight", "context_weight", "adapted_weight"):
            if not math.isfinite(getattr(self, name)) or getattr(self, name) < 0:
                raise VerispecError(f"{name} must be a number >= 0, got {getattr(self, name)}")
        if not (0.0 <= self.min_prob < 1.0):
            raise VerispecError(f"min_prob must be in [0, 1), got {self.min_prob}")
        if self.adapted_contexts < 1:
            raise VerispecError(f"adapted_contexts must be >= 1, got {self.adapted_contexts}")


@dataclass(frozen=True)
class AdaptConfig:
    """Online adaptation of the drafter (`--adapt`): learn from the target's distributions that
    verification already computed, where the draft was wrong. Only the draft changes; the output
    distribution stays the target's.

    Attributes:
        buffer_size: examples kept (the oldest are dropped beyond it). Default 4096.
        top_k: target probabilities kept per example (the rest of p is dropped). Default 8.
        max_context: tokens of context kept per example (the most recent). Default 256.
        include_undrafted: also keep the target's distribution where nothing was drafted. Default True.
        min_examples: examples buffered before an update runs. Default 8.
        background: update in a background thread (True), or in the caller between steps. Default True.
        lr, batch_size, epochs, max_steps: draft-model updates (AdamW on forward KL(p_target || q_draft)):
            learning rate (default 1e-5), examples per optimizer step (default 16), passes over the new
            examples (default 1), at most this many optimizer steps per update (default 16).
    """

    buffer_size: int = 4096
    top_k: int = 8
    max_context: int = 256
    include_undrafted: bool = True
    min_examples: int = 8
    background: bool = True
    lr: float = 1e-5
    batch_size: int = 16
    epochs: int = 1
    max_steps: int = 16

    def __post_init__(self) -> None:
        for name in ("buffer_size", "top_k", "max_context", "min_examples", "batch_size", "epochs", "max_steps"):
            if int(getattr(self, name)) != getattr(self, name) or getattr(self, name) < 1:
                raise VerispecError(f"{name} must be an integer >= 1, got {getattr(self, name)}")
        if not math.isfinite(self.lr) or self.lr <= 0:
            raise VerispecError(f"lr must be > 0, got {self.lr}")
