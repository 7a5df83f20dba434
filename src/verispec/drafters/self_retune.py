"""Choosing the self-draft's skip set while decoding, from this sequence's own verified steps (SWIFT-style).

SWIFT (Xia et al., 2024) re-optimises the skipped layers during inference from the tokens the target has
already produced. Here each sequence keeps an incumbent skip set; every `gap` steps a challenger (the
incumbent with one random sublayer flipped) drafts every other step for `trial_steps` of its own steps,
and whichever scores better becomes the incumbent. The score of a set is its expected tokens per step over
its cost, E[tokens](alpha, K) / (1 + K c): alpha from the acceptance its steps saw, c its share of the
target's weights (attention and MLP sublayers it runs, plus the LM head), so the choice is reproducible.

Exactness: the set a step drafts with is fixed before the step drafts and depends only on the outcomes
(accepted counts) of steps already verified and committed, and on a generator of the chooser's own, never
on the step's own draws; so each step's q is a fixed function of the committed context and the
verification stays exact (`tests/test_self_draft.py` checks it with the chi-square harness).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from verispec.config import SelfDraftConfig
from verispec.core.protocols import NativeWeights
from verispec.models.skip import SkipSet
from verispec.tuning import expected_tokens


@dataclass(frozen=True)
class SublayerCosts:
    """Weight bytes (or parameters) a pass reads: per layer's attention and MLP, and the LM head."""

    attention: tuple[float, ...]
    mlp: tuple[float, ...]
    head: float
    vocab: int

    def c(self, skip: SkipSet) -> float:
        """The draft's cost relative to a full pass, by the weights it reads."""
        total = self.head + sum(self.attention) + sum(self.mlp)
        head = self.head * min(1.0, (skip.head or self.vocab) / self.vocab)
        run = head + sum(a for i, a in enumerate(self.attention) if i not in skip.attention) + sum(
            m for i, m in enumerate(self.mlp) if i not in skip.mlp)
        return run / total

    @classmethod
    def of(cls, runner) -> SublayerCosts:
        if isinstance(runner, NativeWeights):
            gguf = runner.gguf
            attention = tuple(float(sum(w.data.nbytes for w in (l.q, l.k, l.v, l.out))) for l in gguf.layers)
            mlp = tuple(float(sum(w.data.nbytes for w in (l.gate, l.up, l.down))) for l in gguf.layers)
            return cls(attention, mlp, float(gguf.head.data.nbytes), int(gguf.config.vocab))
        model = runner.model
        layers = model.model.layers
        attention = tuple(float(sum(p.numel() for p in layer.self_attn.parameters())) for layer in layers)
        mlp = tuple(float(sum(p.numel() for p in layer.mlp.parameters())) for layer in layers)
        head = model.get_output_embeddings().weight
        return cls(attention, mlp, float(head.numel()), int(head.shape[0]))


class _Record:
    """A skip set's accepted drafts and rejections (a geometric count per step, as `tuning.KTuner`)."""

    def __init__(self, prior: float = 0.5, weight: float = 1.0) -> None:
        self.accepted, self.rejections, self.drafted, self.steps = prior * weight, (1 - prior) * weight, 0, 0

    def observe(self, drafted: int, accepted: int) -> None:
        self.accepted += accepted
        self.rejections += int(accepted < drafted)
        self.drafted += drafted
        self.steps += 1

    @property
    def alpha(self) -> float:
        return self.accepted / (self.accepted + self.rejections)


class SkipChooser:
    """One sequence's skip set, re-chosen from its own verified steps (see the module docstring)."""

    def __init__(self, start: SkipSet, costs: SublayerCosts, config: SelfDraftConfig) -> None:
        self.config = config
        self.costs = costs
        self.rng = random.Random(config.seed)
        self.incumbent, self.record = start, _Record()
        self.challenger: SkipSet | None = None
        self.trial = _Record()
        self.since_trial = 0
        self.turn = 0  # steps since the trial began (odd ones draft with the challenger)
        self.current: SkipSet = start  # the set of the step being drafted
        self.switches = 0

    def choose(self) -> SkipSet:
        """The skip set of the next step (decided before it drafts)."""
        if self.challenger is None and self.since_trial >= self.config.gap:
            self.challenger, self.trial, self.turn = self._mutate(self.incumbent), _Record(), 0
        if self.challenger is not None:
            self.turn += 1
            self.current = self.challenger if self.turn % 2 == 0 else self.incumbent
        else:
            self.current = self.incumbent
        return self.current

    def observe(self, drafted: int, accepted: int) -> None:
        """The verified outcome of the step drafted with `current` (drafted > 0)."""
        if drafted == 0:
            return
        if self.current is self.challenger:
            self.trial.observe(drafted, accepted)
            if self.trial.steps >= self.config.trial_steps:
                if self.score(self.challenger, self.trial) > self.score(self.incumbent, self.record):
                    self.incumbent, self.record = self.challenger, self.trial
                    self.switches += 1
                self.challenger, self.since_trial = None, 0
        else:
            self.record.observe(drafted, accepted)
            self.since_trial += 1

    def score(self, skip: SkipSet, record: _Record) -> float:
        """Expected tokens per step over the step's cost, at the record's mean chain length."""
        k = max(1.0, record.drafted / max(1, record.steps))
        return expected_tokens(record.alpha, int(round(k))) / (1.0 + k * self.costs.c(skip))

    def _mutate(self, skip: SkipSet) -> SkipSet:
        """The set with one random sublayer flipped (never one that would skip everything)."""
        order = skip.sublayers()
        self.rng.shuffle(order)
        for kind, layer in order:
            candidate_attention = set(skip.attention) ^ ({layer} if kind == "attention" else set())
            candidate_mlp = set(skip.mlp) ^ ({layer} if kind == "mlp" else set())
            if len(candidate_attention) == skip.layers and len(candidate_mlp) == skip.layers:
                continue
            return skip.toggled(kind, layer)
        return skip

