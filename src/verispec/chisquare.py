"""Goodness-of-fit checks for sampled tokens against an exact distribution.

Used by `verispec audit` and by the test suite. Cells whose expected count is below
`min_expected` are pooled into one cell, the usual condition for the chi-square approximation.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class FitResult:
    statistic: float
    dof: int
    p_value: float
    tv_distance: float
    samples: int


def chi_square_test(counts: torch.Tensor, probs: torch.Tensor, min_expected: float = 5.0) -> FitResult:
    """Pearson chi-square test of observed counts against exact probabilities.

    Args:
        counts: (V,) observed counts.
        probs: (V,) exact probabilities (sum 1).
    Returns:
        statistic, degrees of freedom, p-value, and the total-variation distance between the
        empirical distribution and probs.
    """
    counts = counts.double()
    probs = probs.double() / probs.double().sum()
    n = float(counts.sum())
    if n == 0:
        raise ValueError("no samples")
    tv = 0.5 * float((counts / n - probs).abs().sum())
    expected = probs * n  # (V,)
    big = expected >= min_expected
    obs_cells = [counts[big]]
    exp_cells = [expected[big]]
    rest_expected = float(expected[~big].sum())
    rest_observed = float(counts[~big].sum())
    if rest_expected > 0 or rest_observed > 0:
        obs_cells.append(torch.tensor([rest_observed], dtype=torch.float64))
        exp_cells.append(torch.tensor([rest_expected], dtype=torch.float64))
    observed, expected = torch.cat(obs_cells), torch.cat(exp_cells)
    if bool(((expected == 0) & (observed > 0)).any()):
        return FitResult(float("inf"), int(observed.numel()) - 1, 0.0, tv, int(n))  # impossible tokens seen
    keep = expected > 0
    observed, expected = observed[keep], expected[keep]
    dof = int(observed.numel()) - 1
    if dof < 1:
        return FitResult(0.0, 0, 1.0, tv, int(n))
    stat = float(((observed - expected) ** 2 / expected).sum())
    p_value = float(torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64), torch.tensor(stat / 2.0, dtype=torch.float64)))
    return FitResult(stat, dof, p_value, tv, int(n))
