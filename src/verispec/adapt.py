"""Online adaptation (Online Speculative Decoding, Liu et al. 2024): the drafter learns from the
target distributions that verification has already computed, where its drafts were wrong.

    buffer   an engine observer: at each step's first rejected position (and, optionally, where
             nothing was drafted) it keeps the context and the target's p there, top-k compressed
             (at temperature 0, p is one-hot at the argmax); with learn_from="all", also at every
             accepted position and the bonus position, i.e. along the whole output. It only reads:
             no draws from seq.rng.
    adapter  hands the buffered examples to `drafter.adapt` between requests or steps: in a
             background thread (serve, generate) or in the caller (tests, benchmarks).

Draft heads (Medusa, EAGLE) keep their own buffer instead (`drafter.adaptation_buffer()`): they learn from
windows of the target's features and tokens, which only the drafter sees (`drafters.head_adapt`).

Why the output stays exact: adaptation changes only the drafter, and a drafter applies a change
only at the start of a later `propose` (the n-gram drafter queues examples; the draft-model
drafter swaps in retrained weights). Within a step, every q the drafter reports is the distribution
its tokens were drawn from, which is all `rejection.verify` needs.
"""

from __future__ import annotations

import logging
import threading
import time

import torch

from verispec.config import AdaptConfig
from verispec.core.adaptation import AdaptExample, ExampleBuffer
from verispec.errors import VerispecError
from verispec.rejection import Verdict

log = logging.getLogger("verispec.adapt")


class AdaptationBuffer(ExampleBuffer):
    """Collects AdaptExamples as an engine observer (`engine.observers`)."""

    def __init__(self, config: AdaptConfig = AdaptConfig()) -> None:
        super().__init__(config.buffer_size)
        self.config = config

    def __call__(self, seq, draft, p: torch.Tensor, verdict: Verdict, uniforms) -> None:
        """p: (N + 1, V) the target's distributions at the step's positions: at the root and after each node
        (a chain's: after each draft token; a tree's rows made on demand)."""
        if not self.enabled:
            return
        rows = [0] + [node + 1 for node in verdict.path]  # the root, then after each accepted node
        accepted = list(draft.path_tokens(verdict.path))
        all_accepted = verdict.bonus  # the path reached a leaf (else every child of its last node was rejected)
        if not len(draft) and not self.config.include_undrafted:
            return
        if self.config.learn_from == "mistakes":
            if len(draft) and all_accepted:
                return  # every draft was accepted: nothing to correct
            rows = rows[-1:]  # only where the walk stopped
        examples = []
        for depth, row in enumerate(rows, start=len(accepted) + 1 - len(rows)):  # depth: accepted tokens before row
            context = (seq.tokens[-self.config.max_context :] + accepted[:depth])[-self.config.max_context :]
            dist = p[row]  # (V,)
            top = torch.topk(dist, min(self.config.top_k, dist.shape[-1]))
            keep = top.values > 0
            examples.append(AdaptExample(tuple(context), tuple(top.indices[keep].tolist()), tuple(top.values[keep].tolist())))
        self.add(examples)


class OnlineAdapter:
    """Wires a buffer into `engine` and feeds its examples to the engine's drafter.

    Call `poke()` at a good moment (a request or a step ended): with enough examples buffered, an
    update runs, in the background thread (config.background) or right away. `adapt_now()` updates
    synchronously whatever the mode. `close()` detaches the buffer and stops the thread.

    Args:
        engine: a SpeculativeEngine whose drafter can adapt (`drafter.traits.adaptive`).
        config: buffer and update settings.
    """

    def __init__(self, engine, config: AdaptConfig = AdaptConfig()) -> None:
        drafter = engine.drafter
        if not drafter.traits.adaptive:
            raise VerispecError(f"--adapt needs a drafter that can adapt (ngram-corpus, a draft model, Medusa or EAGLE "
                                f"heads); '{drafter.name}' cannot")
        drafter.check_adaptable(config)
        self.engine, self.drafter, self.config = engine, drafter, config
        own = drafter.adaptation_buffer()  # heads log their own windows (drafters.head_adapt)
        self.buffer = own if own is not None else AdaptationBuffer(config)
        if isinstance(self.buffer, AdaptationBuffer):
            engine.observers.append(self.buffer)
        self.updates = 0
        self.examples_used = 0
        self.seconds = 0.0
        self.last_error: str | None = None
        self._update_lock = threading.Lock()
        self._wake = threading.Event()
        self._stopping = False
        self._thread: threading.Thread | None = None
        if config.background:
            self._thread = threading.Thread(target=self._loop, name="verispec-adapt", daemon=True)
            self._thread.start()

    def poke(self) -> None:
        """A good moment to adapt: update if at least config.min_examples examples wait."""
        if len(self.buffer) < self.config.min_examples:
            return
        if self._thread is not None:
            self._wake.set()
        else:
            self.adapt_now()

    def adapt_now(self) -> int:
        """Run one update on every buffered example, in this thread; returns how many were used."""
        with self._update_lock:
            examples = self.buffer.drain()
            if not examples:
                return 0
            start = time.perf_counter()
            self.drafter.adapt(examples)
            self.seconds += time.perf_counter() - start
            self.updates += 1
            self.examples_used += len(examples)
            return len(examples)

    def stats(self) -> dict:
        return {"collected": self.buffer.collected, "buffered": len(self.buffer), "updates": self.updates,
                "examples_used": self.examples_used, "update_seconds": round(self.seconds, 3),
                "last_error": self.last_error}

    def close(self, timeout_s: float = 30.0) -> None:
        """Stop collecting and stop the background thread (an update in progress finishes first)."""
        self.buffer.enabled = False
        if self.buffer in self.engine.observers:
            self.engine.observers.remove(self.buffer)
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout_s)

    def _loop(self) -> None:
        while True:
            self._wake.wait()
            self._wake.clear()
            if self._stopping:
                return
            try:
                self.adapt_now()
            except Exception as err:  # adaptation must never take decoding down
                self.last_error = f"{type(err).__name__}: {err}"
                log.exception("online adaptation update failed; drafting goes on with the current drafter")
