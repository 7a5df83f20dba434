"""Losslessness audit: does speculative sampling reproduce the target's distribution here?

For a prompt, sample many continuations speculatively (batched, one seed each), then compare
  - the first new token's empirical distribution with the target's exact p(. | prompt), and
  - the second token's, given each of the most frequent first tokens, with p(. | prompt, t1),
by a chi-square test and the total-variation distance. The audit passes when every p-value is
above alpha / (number of tests) (Bonferroni). At temperature 0 every sample must equal the
target's greedy tokens.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from verispec.api import SpeculativeDecoder
from verispec.chisquare import FitResult, chi_square_test
from verispec.config import SamplingConfig, SpecConfig, TreeConfig
from verispec.constraints import apply_constraint
from verispec.errors import VerispecError
from verispec.sampling import Processors, greedy_tokens, logits_to_probs


@dataclass
class AuditCheck:
    """One distribution compared: which position, after which prefix, and the fit."""

    position: int
    prefix: list[int]
    fit: FitResult
    passed: bool = False


@dataclass
class AuditReport:
    samples: int
    alpha: float
    checks: list[AuditCheck] = field(default_factory=list)
    acceptance_rate: float = 0.0

    @property
    def passed(self) -> bool:
        return all(c.passed for c in self.checks)

    def to_dict(self) -> dict:
        return {
            "passed": self.passed,
            "samples": self.samples,
            "alpha": self.alpha,
            "acceptance_rate": round(self.acceptance_rate, 4),
            "checks": [
                {
                    "position": c.position,
                    "prefix_token_ids": c.prefix,
                    "chi_square": round(c.fit.statistic, 4),
                    "dof": c.fit.dof,
                    "p_value": c.fit.p_value,
                    "tv_distance": round(c.fit.tv_distance, 5),
                    "samples": c.fit.samples,
                    "passed": c.passed,
                }
                for c in self.checks
            ],
        }


def exact_distribution(decoder: SpeculativeDecoder, prompt: list[int], sampling: SamplingConfig,
                       answer: tuple[int, ...] = ()) -> torch.Tensor:
    """The target's processed next-token distribution after `prompt` + `answer`: (V,) (one-hot when greedy); under a
    structured-output constraint, restricted to what it allows after `answer`."""
    runner = decoder.runner
    context = list(prompt) + list(answer)
    logits = runner.forward(runner.new_state(1), [context], [1])[0]  # (1, V)
    if sampling.constraint is not None:
        state = decoder.engine.grammars().start(sampling.constraint)
        state.advance(answer)
        logits = apply_constraint(logits, state.allowed().unsqueeze(0))  # (1, V)
    seen = Processors(sampling, len(prompt)).seen(context, logits.shape[-1])  # the penalties' history, or None
    if sampling.greedy:
        return torch.nn.functional.one_hot(greedy_tokens(logits, sampling, seen), logits.shape[-1])[0].double()
    return logits_to_probs(logits, sampling, seen)[0]


def run_audit(
    decoder: SpeculativeDecoder,
    prompt: list[int],
    sampling: SamplingConfig,
    num_draft_tokens: int,
    samples: int = 2000,
    batch_size: int = 64,
    seed: int = 0,
    alpha: float = 0.01,
    second_token_prefixes: int = 3,
    on_progress: Callable[[int], None] | None = None,
    tree: TreeConfig | None = None,
    draft_stop: float = 0.0,
) -> AuditReport:
    """Sample `samples` continuations speculatively (a chain of K, or `tree`) and test positions 1 and 2.
    `draft_stop` audits chains that stop early (SpecConfig.draft_stop)."""
    if samples < 10:
        raise VerispecError(f"an audit needs at least 10 samples, got {samples}")
    if batch_size < 1:
        raise VerispecError(f"batch size must be >= 1, got {batch_size}")
    # depth + 1 new tokens let the first step draft a full chain of K (or the whole tree).
    depth = num_draft_tokens if tree is None else tree.depth(num_draft_tokens)
    spec = SpecConfig(num_draft_tokens=num_draft_tokens, max_new_tokens=max(2, depth + 1), stop_at_eos=False, tree=tree,
                      draft_stop=draft_stop)
    firsts: Counter[int] = Counter()
    pairs: Counter[tuple[int, int]] = Counter()
    drafted = accepted = 0
    for start in range(0, samples, batch_size):
        n = min(batch_size, samples - start)
        seqs = decoder.engine.generate([prompt] * n, sampling, spec, seeds=[seed + start + i for i in range(n)])
        for s in seqs:
            firsts[s.generated[0]] += 1
            if len(s.generated) > 1:  # (a constraint may end the answer after one token)
                pairs[(s.generated[0], s.generated[1])] += 1
            drafted += s.stats.draft_tokens
            accepted += s.stats.accepted_tokens
        if on_progress:
            on_progress(n)
    report = AuditReport(samples=samples, alpha=alpha, acceptance_rate=accepted / drafted if drafted else 0.0)
    p1 = exact_distribution(decoder, prompt, sampling)
    report.checks.append(AuditCheck(1, [], chi_square_test(_counts(firsts, p1.numel()), p1)))
    followed = Counter({first: c for (first, _), c in pairs.items()})
    for first, _ in followed.most_common(second_token_prefixes):
        p2 = exact_distribution(decoder, prompt, sampling, (first,))
        seconds = Counter({b: c for (a, b), c in pairs.items() if a == first})
        report.checks.append(AuditCheck(2, [first], chi_square_test(_counts(seconds, p2.numel()), p2)))
    threshold = alpha / len(report.checks)
    for check in report.checks:
        check.passed = check.fit.p_value >= threshold
    return report


def _counts(counter: Counter, size: int) -> torch.Tensor:
    counts = torch.zeros(size, dtype=torch.float64)
    for token, c in counter.items():
        counts[token] += c
    return counts
