"""What a drafter learns from in online adaptation (`verispec.adapt`, `Drafter.adapt`): the target's distribution
at a position (`AdaptExample`) and the bounded, thread-safe buffer examples wait in (`ExampleBuffer`)."""

from __future__ import annotations

import collections
import threading
from dataclasses import dataclass


@dataclass(frozen=True)
class AdaptExample:
    """The target's next-token distribution at one position.

    context: token ids before the position (the most recent AdaptConfig.max_context).
    tokens, probs: the target's top-k next tokens there and their probabilities under p.
    """

    context: tuple[int, ...]
    tokens: tuple[int, ...]
    probs: tuple[float, ...]


class ExampleBuffer:
    """What waits for the next update: bounded (the oldest are dropped), thread-safe; `enabled` False stops
    collecting. OnlineAdapter drains one (an AdaptationBuffer, or a head drafter's windows)."""

    def __init__(self, size: int) -> None:
        self.enabled = True
        self.collected = 0
        self._examples: collections.deque = collections.deque(maxlen=size)
        self._lock = threading.Lock()

    def add(self, examples: list) -> None:
        if not self.enabled:
            return
        with self._lock:
            self._examples.extend(examples)
            self.collected += len(examples)

    def __len__(self) -> int:
        return len(self._examples)

    def drain(self) -> list:
        """Take every buffered example out."""
        with self._lock:
            examples = list(self._examples)
            self._examples.clear()
        return examples
