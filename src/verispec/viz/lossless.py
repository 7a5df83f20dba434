"""The losslessness demo's numbers: many single-token speculative samples on a small p and q.

Each sample draws a draft token x ~ q and verifies it with `rejection.verify` (n = 1): the output is
x when accepted, else the recovered token from normalize(max(0, p - q)). The empirical histogram of
outputs converges to p; the acceptance rate to sum_x min(p(x), q(x)); `chisquare.chi_square_test`
gives the p-value of the counts against p.
"""

from __future__ import annotations

import math

import torch

from verispec.chisquare import chi_square_test
from verispec.errors import VerispecError
from verispec.rejection import verify
from verispec.tree import Draft

MAX_TOKENS = 32
MAX_SAMPLES = 20000


def as_distribution(values: list[float], name: str) -> torch.Tensor:
    """Non-negative weights -> a float64 probability vector (V,); bad input is refused by name."""
    if not 2 <= len(values) <= MAX_TOKENS:
        raise VerispecError(f"{name} needs 2 to {MAX_TOKENS} entries, got {len(values)}")
    if any(not math.isfinite(v) or v < 0 for v in values):
        raise VerispecError(f"{name} entries must be finite and >= 0")
    w = torch.tensor(values, dtype=torch.float64)  # (V,)
    if float(w.sum()) <= 0:
        raise VerispecError(f"{name} needs a positive total")
    return w / w.sum()


def speculative_samples(p: torch.Tensor, q: torch.Tensor, samples: int, rng: torch.Generator) -> tuple[torch.Tensor, int]:
    """Output-token counts (V,) and the number of accepted drafts over `samples` speculative samples."""
    counts = torch.zeros(p.numel(), dtype=torch.long)  # (V,)
    rows_p = torch.stack([p, p])  # (n + 1, V) = (2, V): position 1 and the (unused) bonus position
    rows_q = q.unsqueeze(0)  # (n, V) = (1, V)
    accepted = 0
    for _ in range(samples):
        x = torch.multinomial(q, 1, generator=rng)  # (1,) the draft token, x ~ q
        verdict = verify(rows_p, Draft(x, rows_q), rng)
        accepted += verdict.num_accepted
        counts[int(x) if verdict.num_accepted else verdict.token] += 1
    return counts, accepted


def demo_chunk(p_values: list[float], q_values: list[float], samples: int, seed: int,
               counts: list[int] | None = None, accepted: int = 0) -> dict:
    """One chunk of the demo: `samples` more samples (generator seeded with `seed`) added to earlier
    `counts` / `accepted`; returns the totals with the theory and the chi-square fit against p."""
    p, q = as_distribution(p_values, "p"), as_distribution(q_values, "q")
    if p.numel() != q.numel():
        raise VerispecError(f"p and q need the same number of entries, got {p.numel()} and {q.numel()}")
    if not 1 <= samples <= MAX_SAMPLES:
        raise VerispecError(f"samples must be in 1..{MAX_SAMPLES}, got {samples}")
    before = torch.zeros(p.numel(), dtype=torch.long) if not counts else torch.tensor(counts, dtype=torch.long)
    if before.numel() != p.numel() or bool((before < 0).any()):
        raise VerispecError("earlier counts must be one non-negative count per entry")
    new_counts, new_accepted = speculative_samples(p, q, samples, torch.Generator().manual_seed(seed))
    total = before + new_counts
    n = int(total.sum())
    fit = chi_square_test(total, p)
    return {"p": p.tolist(), "q": q.tolist(), "counts": total.tolist(), "samples": n, "accepted": accepted + new_accepted,
            "acceptance_theory": float(torch.minimum(p, q).sum()), "acceptance_empirical": (accepted + new_accepted) / n,
            "chi_square": {"statistic": fit.statistic if math.isfinite(fit.statistic) else None, "dof": fit.dof, "p_value": fit.p_value, "tv_distance": fit.tv_distance}}
