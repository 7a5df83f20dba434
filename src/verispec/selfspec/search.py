"""`verispec self-tune`: search the self-draft's skip set on a target, measuring, never estimating, on this machine.

Draft & Verify searches the skipped layers by Bayesian optimisation over thousands of trials on a GPU. On a
2-core CPU a trial that decodes costs seconds, so a few hundred at most fit in minutes; too few for a
Gaussian process over 2^(2 x layers) sets to beat a good ordering. This search spends its trials where
they tell most:

1. Reference. The target decodes each prompt greedily (its own tokens: the draft is judged on what the
   target writes) and keeps its cache. Plain decoding speed and the target's pass costs v(k) are timed.
2. Screening, by measured first-draft agreement: a draft pass over every generated position at once,
   each query reading the target's committed keys and values and its own (scratch columns: exactly what
   the self drafter's first draft of a step computes), counts how often the draft's argmax is the target's
   next token. Each sublayer is skipped alone (2 x layers trials) and ranked by the agreement it costs
   per byte of weights it saves (an MLP reads ~7x an attention's bytes).
3. Nested sets along that ranking (the first m sublayers, m in steps) are screened the same way, each with
   its draft pass timed; predicted speed = E[tokens](agreement, K) / (K c + v(K)) at the best K.
4. Finalists (the best few predictions) decode the prompts for real with the self drafter at each K:
   tokens/s, acceptance by position and tokens per target pass, all measured. The fastest is kept.

The result goes to a small JSON file (`SkipFile`) that `--draft self:FILE` loads; without a FILE,
`--draft self` uses the one saved for this target in the cache (or shipped with the package).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import numpy as np
import torch

from verispec.config import SamplingConfig, SpecConfig
from verispec.console import progress
from verispec.drafters.self_retune import SublayerCosts
from verispec.drafters.self_draft import SelfDrafter
from verispec.engine import SpeculativeEngine
from verispec.errors import VerispecError
from verispec.models.gguf.runner import NativeRunner
from verispec.models.skip import SkipSet, num_layers
from verispec.tuning import expected_tokens, measure_costs

GREEDY = SamplingConfig(temperature=0)


@dataclass(frozen=True)
class SelfTuneConfig:
    """How `verispec self-tune` searches.

    Attributes:
        tokens: tokens the target writes per prompt (the positions screened; the finalists' decode length). Default 48.
        k_values: chain lengths K the finalists decode with. Default (1, 2, 3).
        finalists: skip sets that decode for real. Default 3.
        step: nested sets grow by this many sublayers. Default 2.
        min_agreement: stop growing nested sets once first-draft agreement falls below this. Default 0.25.
        repeats: timings per draft cost (the median is kept). Default 5.
        heads: draft LM head sizes tried on each nested set (None: the whole vocabulary; see `SkipSet.head`).
            Default (None, 65536, 32768).
    """

    tokens: int = 48
    k_values: tuple[int, ...] = (1, 2, 3)
    finalists: int = 3
    step: int = 2
    min_agreement: float = 0.25
    repeats: int = 5
    heads: tuple[int | None, ...] = (None, 65536, 32768)

    def __post_init__(self) -> None:
        if self.tokens < 4 or self.finalists < 1 or self.step < 1 or self.repeats < 1:
            raise VerispecError("self-tune needs tokens >= 4, finalists >= 1, step >= 1 and repeats >= 1")
        if not self.k_values or min(self.k_values) < 1:
            raise VerispecError(f"self-tune's K values must be >= 1, got {self.k_values}")
        if not 0.0 <= self.min_agreement < 1.0:
            raise VerispecError(f"min_agreement is a rate in [0, 1), got {self.min_agreement}")


@dataclass
class Trial:
    """One screened skip set: first-draft agreement, draft cost relative to a target pass, predicted speedup."""

    skip: SkipSet
    agreement: float
    c: float
    predicted: float = 0.0
    k: int = 0


class SkipSearch:
    """The search over one native target and a list of tokenized prompts (see the module docstring)."""

    def __init__(self, runner, prompts: list[list[int]], config: SelfTuneConfig = SelfTuneConfig(),
                 show_progress: bool = True) -> None:
        if not isinstance(runner, NativeRunner):
            raise VerispecError("self-tune measures on verispec's native runner: give it a GGUF target "
                                "(--backend native; the skip file then serves the same model on torch too)")
        if not prompts:
            raise VerispecError("self-tune needs at least one prompt")
        self.runner, self.prompts, self.config, self.show = runner, prompts, config, show_progress
        self.layers = num_layers(runner)
        self.bytes = SublayerCosts.of(runner)
        self.log: list[str] = []

    # ------------------------------------------------------------------ measurements

    def reference(self) -> None:
        """The target's own greedy continuations, its caches over them, and its pass costs v(k)."""
        runner, n = self.runner, self.config.tokens
        self.states, self.sequences = [], []
        with progress("target writes the reference", len(self.prompts), self.show) as advance:
            for prompt in self.prompts:
                state = runner.new_state(1)
                tokens = list(prompt)
                logits = runner.forward(state, [tokens], [1])[0, 0]
                for _ in range(n):
                    tokens.append(int(logits.argmax()))
                    logits = runner.forward(state, [[tokens[-1]]], [1])[0, 0]
                self.states.append(state)
                self.sequences.append((len(prompt), tokens))
                advance()
        self.profile = measure_costs(runner, None, k_max=max(self.config.k_values))

    def agreement(self, skip: SkipSet, heads: tuple[int | None, ...] = (None,)) -> list[float]:
        """How often the draft's first draft (target's cache, its own scratch entry) is the target's next token,
        for each draft head size in `heads` (one pass: a smaller head's argmax is over the first ids)."""
        matched, total = [0] * len(heads), 0
        bits = skip.bits()
        for state, (prompt_len, tokens) in zip(self.states, self.sequences):
            positions = list(range(prompt_len - 1, len(tokens) - 1))  # each predicts the token after it
            logits = self._scratch_pass(state, [tokens[c] for c in positions], positions, bits)  # (n, V)
            truth = torch.tensor([tokens[c + 1] for c in positions])  # (n,)
            for i, head in enumerate(heads):
                matched[i] += int((logits[:, :head].argmax(-1) == truth).sum())
            total += len(positions)
        return [m / total for m in matched]

    def _scratch_pass(self, state, tokens: list[int], positions: list[int], bits: np.ndarray | None,
                      head: int | None = None) -> torch.Tensor:
        from verispec.models.gguf.attend import Query

        row = state.rows[0]
        scratch = row.length + 1
        row.reserve(scratch + len(tokens))
        queries = [Query(0, t, c, scratch + j, c, [scratch + j], [c]) for j, (t, c) in enumerate(zip(tokens, positions))]
        return self.runner._run(state, queries, [True] * len(queries), 1, len(queries), bits, head)[0]

    def draft_cost(self, skip: SkipSet) -> float:
        """A one-token draft pass's time over a one-token target pass's (medians of `repeats`)."""
        state, (_, tokens) = self.states[0], self.sequences[0]
        c = len(tokens) - 2
        bits = skip.bits()
        self._scratch_pass(state, [tokens[c]], [c], bits, skip.head)  # warm-up
        times = []
        for _ in range(self.config.repeats):
            start = time.perf_counter()
            self._scratch_pass(state, [tokens[c]], [c], bits, skip.head)
            times.append(time.perf_counter() - start)
        return statistics.median(times) / self.profile.target_pass[1]

    def screen(self, skip: SkipSet) -> list[Trial]:
        """The set with each head size: agreement from one pass, each cost timed, the best K's prediction."""
        heads = self.config.heads
        trials = []
        for head, agreement in zip(heads, self.agreement(skip, heads)):
            trial = Trial(skip.with_head(head), agreement, self.draft_cost(skip.with_head(head)))
            best = max(self.config.k_values, key=lambda k: self._speedup(trial, k))
            trial.k, trial.predicted = best, self._speedup(trial, best)
            trials.append(trial)
        return trials

    def _speedup(self, trial: Trial, k: int) -> float:
        return expected_tokens(trial.agreement, k) / (k * trial.c + self.profile.v(k))

    # ------------------------------------------------------------------ the search

    def run(self) -> dict:
        """Search, decode the finalists, and return the report (the best set under "skip")."""
        self.runner.keep_draft_prefix = False  # screening passes leave nothing for verification to reuse
        try:
            started = time.perf_counter()
            self.reference()
            empty = SkipSet(self.layers)
            base, = self.agreement(empty)
            sublayers = empty.sublayers()
            drops = {}
            with progress("screening single sublayers", len(sublayers), self.show) as advance:
                for kind, layer in sublayers:
                    drops[(kind, layer)] = base - self.agreement(empty.toggled(kind, layer))[0]
                    advance()
            weights = {s: (self.bytes.attention if s[0] == "attention" else self.bytes.mlp)[s[1]] for s in sublayers}
            total = sum(weights.values()) + self.bytes.head
            order = sorted(sublayers, key=lambda s: (max(drops[s], 0.0) + 1e-3) / (weights[s] / total))
            trials = []
            sizes = list(range(self.config.step, len(order), self.config.step))
            with progress("screening nested skip sets", len(sizes), self.show) as advance:
                for m in sizes:
                    skip = SkipSet(self.layers)
                    for kind, layer in order[:m]:
                        skip = skip.toggled(kind, layer)
                    screened = self.screen(skip)
                    trials += screened
                    advance()
                    if max(t.agreement for t in screened) < self.config.min_agreement:
                        break
            trials.sort(key=lambda t: -t.predicted)
            finalists = trials[: self.config.finalists]
            plain_tps = self.plain_speed()
            results = []
            runs = [(t, k) for t in finalists for k in self.config.k_values]
            with progress("finalists decode for real", len(runs), self.show) as advance:
                for trial, k in runs:
                    results.append(self.decode(trial, k))
                    advance()
            best = max(results, key=lambda r: r["tokens_per_second"])
            return {
                "skip": best["skip"], "k": best["k"], "plain_tokens_per_second": round(plain_tps, 2),
                "speedup": round(best["tokens_per_second"] / plain_tps, 3), "best": best, "finalists": results,
                "screened": [{"skip": t.skip.text, "sublayers": t.skip.size, "head": t.skip.head,
                              "agreement": round(t.agreement, 3),
                              "c": round(t.c, 3), "k": t.k, "predicted_speedup": round(t.predicted, 3)}
                             for t in sorted(trials, key=lambda t: t.skip.size)],
                "single_sublayer_agreement_drop": {f"{k[0][0]}{k[1]}": round(v, 3) for k, v in drops.items()},
                "reference_agreement": round(base, 3),
                "pass_costs": [round(v, 3) for v in self.profile.pass_costs()],
                "prompts": len(self.prompts), "tokens_per_prompt": self.config.tokens,
                "seconds": round(time.perf_counter() - started, 1),
            }
        finally:
            self.runner.keep_draft_prefix = True

    def decode(self, trial: Trial, k: int) -> dict:
        """Greedy speculative decoding of every prompt with this skip set at this K, measured."""
        self.runner.keep_draft_prefix = True
        sequences, seconds, new_tokens = self._timed(SelfDrafter(self.runner, trial.skip), k)
        self.runner.keep_draft_prefix = False
        for seq, (_, reference) in zip(sequences, self.sequences):
            if seq.tokens != reference[: len(seq.tokens)]:
                raise VerispecError("self-speculation changed greedy output during the search: please report this")
        drafted = np.sum([_padded(s.stats.drafted_per_position, k) for s in sequences], axis=0)
        accepted = np.sum([_padded(s.stats.accepted_per_position, k) for s in sequences], axis=0)
        passes = sum(s.stats.target_forward_passes - 1 for s in sequences)
        return {"skip": trial.skip.text, "k": k, "sublayers": trial.skip.size, "c": round(trial.c, 3),
                "agreement": round(trial.agreement, 3),
                "acceptance_by_position": [round(float(a / d), 3) if d else None for a, d in zip(accepted, drafted)],
                "acceptance": round(float(accepted.sum() / max(1, drafted.sum())), 3),
                "tokens_per_target_pass": round(new_tokens / max(1, passes), 3),
                "tokens_per_second": round(new_tokens / seconds, 2)}


    def _timed(self, drafter, k: int) -> tuple[list, float, int]:
        """Greedy decoding of every prompt: (sequences, seconds after each one's first step, tokens after it).
        The first step reads the prompt (the self drafter drafts nothing then), the same for every system."""
        engine = SpeculativeEngine(self.runner, drafter, set())
        spec = SpecConfig(num_draft_tokens=k, max_new_tokens=self.config.tokens)
        sequences, seconds, tokens = [], 0.0, 0
        for prompt in self.prompts:
            first = seq = None
            for _, seq in engine.stream([prompt], GREEDY, spec):
                if first is None:
                    first, after = time.perf_counter(), len(seq.generated)
            seconds += time.perf_counter() - first
            tokens += len(seq.generated) - after
            sequences.append(seq)
        return sequences, seconds, tokens

    def plain_speed(self) -> float:
        """Plain decoding's tokens/s, timed as `decode` times speculation."""
        _, seconds, tokens = self._timed(None, 1)
        return tokens / seconds


def _padded(values: list[int], k: int) -> np.ndarray:
    out = np.zeros(k)
    out[: min(k, len(values))] = values[:k]
    return out
